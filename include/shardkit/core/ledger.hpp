//! \file core/ledger.hpp
//! Accounting of what a rank holds and what it sends. The memory ledger counts bytes held per
//! category (current and peak); the traffic ledger counts calls and bytes sent per collective.
//! Tests compare both with closed-form formulas, so every allocation and every collective of the
//! library goes through one of them.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/checked.hpp>
#include <shardkit/core/error.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <ostream>

SHARDKIT_CORE_NAMESPACE_BEGIN

//! What a block of memory held by a rank is for.
enum class memory_category : std::uint8_t {
  working_params,     //!< parameters the forward/backward pass reads (16-bit or fp32)
  grads,              //!< gradients kept across the step (full, or this rank's shard)
  master_params,      //!< fp32 master copy of the parameters (absent when training in fp32)
  optimizer_moments,  //!< optimizer state (Adam: m and v)
  gathered_params,    //!< full parameters of gathered ZeRO-3 units, and released units'
                      //!< buffers kept for reuse within the step (transient)
  grad_buckets,       //!< full-size gradient staging buckets before their reduce-scatter
  comm_scratch,       //!< other communication scratch space
  io_staging,         //!< host staging of initialisation, checkpoints and exports (transient)
  offload_staging,    //!< host copies of the gradient and working shards of an offloaded step
};
inline constexpr std::size_t memory_category_count = 9;

constexpr const char* name(memory_category c) noexcept {
  switch (c) {
    case memory_category::working_params:
      return "working_params";
    case memory_category::grads:
      return "grads";
    case memory_category::master_params:
      return "master_params";
    case memory_category::optimizer_moments:
      return "optimizer_moments";
    case memory_category::gathered_params:
      return "gathered_params";
    case memory_category::grad_buckets:
      return "grad_buckets";
    case memory_category::comm_scratch:
      return "comm_scratch";
    case memory_category::io_staging:
      return "io_staging";
    case memory_category::offload_staging:
      return "offload_staging";
  }
  return "unknown";
}

inline std::ostream& operator<<(std::ostream& os, memory_category c) {
  return os << name(c);
}

//! Bytes held per category, now and at the peak. One per engine (per rank); not thread-safe.
class memory_ledger {
 public:
  void add(memory_category c, std::size_t bytes) {
    auto& e = entries_[index(c)];
    e.current = checked_add(e.current, bytes, "memory_ledger: bytes held");
    e.peak = std::max(e.peak, e.current);
    total_ = checked_add(total_, bytes, "memory_ledger: total bytes held");
    total_peak_ = std::max(total_peak_, total_);
  }

  void remove(memory_category c, std::size_t bytes) {
    auto& e = entries_[index(c)];
    if (bytes > e.current) {
      core_detail::raise<error>("memory_ledger: releasing ", bytes, " bytes of ", name(c),
                                " but only ", e.current, " are recorded");
    }
    e.current -= bytes;
    total_ -= bytes;
  }

  //! Bytes of category `c` held now.
  std::size_t current(memory_category c) const noexcept { return entries_[index(c)].current; }
  //! Most bytes of category `c` held at once since construction or the last reset_peaks().
  std::size_t peak(memory_category c) const noexcept { return entries_[index(c)].peak; }
  //! Bytes held now, all categories.
  std::size_t total() const noexcept { return total_; }
  //! Most bytes held at once, all categories together.
  std::size_t total_peak() const noexcept { return total_peak_; }

  //! Sets every peak to the current value (start a new measurement window).
  void reset_peaks() noexcept {
    for (auto& e : entries_) e.peak = e.current;
    total_peak_ = total_;
  }

 private:
  struct entry {
    std::size_t current = 0;
    std::size_t peak = 0;
  };
  static constexpr std::size_t index(memory_category c) noexcept {
    return static_cast<std::size_t>(c);
  }
  std::array<entry, memory_category_count> entries_{};
  std::size_t total_ = 0;
  std::size_t total_peak_ = 0;
};

//! The collectives a communicator offers.
enum class collective : std::uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  barrier,
  all_to_all,
};
inline constexpr std::size_t collective_count = 6;

constexpr const char* name(collective c) noexcept {
  switch (c) {
    case collective::all_reduce:
      return "all_reduce";
    case collective::reduce_scatter:
      return "reduce_scatter";
    case collective::all_gather:
      return "all_gather";
    case collective::broadcast:
      return "broadcast";
    case collective::barrier:
      return "barrier";
    case collective::all_to_all:
      return "all_to_all";
  }
  return "unknown";
}

inline std::ostream& operator<<(std::ostream& os, collective c) {
  return os << name(c);
}

//! Calls and bytes sent per collective by one rank. Bytes are those a ring algorithm sends from
//! this rank (see comm/volume.hpp), whatever transport carries them. Thread-safe counters: a
//! communicator's progress thread records while the rank's own thread may read.
class traffic_ledger {
 public:
  traffic_ledger() = default;
  traffic_ledger(const traffic_ledger& o) noexcept { *this = o; }
  traffic_ledger& operator=(const traffic_ledger& o) noexcept {
    for (std::size_t i = 0; i < collective_count; ++i) {
      calls_[i].store(o.calls_[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
      bytes_[i].store(o.bytes_[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
    }
    return *this;
  }

  void record(collective c, std::uint64_t bytes_sent) noexcept {
    calls_[index(c)].fetch_add(1, std::memory_order_relaxed);
    bytes_[index(c)].fetch_add(bytes_sent, std::memory_order_relaxed);
  }

  std::uint64_t calls(collective c) const noexcept {
    return calls_[index(c)].load(std::memory_order_relaxed);
  }
  std::uint64_t bytes_sent(collective c) const noexcept {
    return bytes_[index(c)].load(std::memory_order_relaxed);
  }
  std::uint64_t total_bytes_sent() const noexcept {
    std::uint64_t t = 0;
    for (const auto& b : bytes_) t += b.load(std::memory_order_relaxed);
    return t;
  }
  std::uint64_t total_calls() const noexcept {
    std::uint64_t t = 0;
    for (const auto& b : calls_) t += b.load(std::memory_order_relaxed);
    return t;
  }

  void reset() noexcept {
    for (auto& c : calls_) c.store(0, std::memory_order_relaxed);
    for (auto& b : bytes_) b.store(0, std::memory_order_relaxed);
  }

  //! Counts since `earlier` (a copy taken before).
  traffic_ledger since(const traffic_ledger& earlier) const noexcept {
    traffic_ledger d;
    for (std::size_t i = 0; i < collective_count; ++i) {
      d.calls_[i].store(calls_[i].load(std::memory_order_relaxed) -
                        earlier.calls_[i].load(std::memory_order_relaxed));
      d.bytes_[i].store(bytes_[i].load(std::memory_order_relaxed) -
                        earlier.bytes_[i].load(std::memory_order_relaxed));
    }
    return d;
  }

 private:
  static constexpr std::size_t index(collective c) noexcept { return static_cast<std::size_t>(c); }
  std::array<std::atomic<std::uint64_t>, collective_count> calls_{};
  std::array<std::atomic<std::uint64_t>, collective_count> bytes_{};
};

SHARDKIT_CORE_NAMESPACE_END
