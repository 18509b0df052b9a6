//! \file comm/detail/scratch_cache.hpp
//! `detail::scratch_cache`: host scratch that a communicator keeps from one collective to the
//! next. A reduce-scatter or all-reduce over MPI receives the other ranks' blocks into scratch of
//! up to (N−1)/N of the array before reducing them (comm/mpi/stages.hpp). Allocated and freed
//! per collective, a block of more than glibc's largest mmap threshold (32 MiB) is a fresh
//! mapping every time, so every call faults in, and the kernel clears, every page of it: a
//! 67M-parameter bf16 model's stage-0 step over MPI at N = 2 took 157 ms that way and takes 117
//! with the blocks kept (medians of five runs, benchmarks/README.md). Kept, the same pages are
//! reused, already mapped.
//!
//! The cache keeps at most `capacity` bytes of blocks that no collective uses; blocks in use are
//! not limited (each collective in flight has its own). take() lends the smallest kept block that
//! fits, unless it is more than twice the size asked for (a small collective must not take the
//! block a large one will want), and allocates a new one otherwise. give() takes a block back;
//! trim() frees kept blocks beyond the capacity, keeping the largest ones that fit (they cost the
//! most to fault in again). A block that cannot be kept (larger than the capacity) lives on
//! ordinary pages; the others are long-lived buffers (core/memory.hpp: 2 MiB aligned, advised to
//! use huge pages).
//!
//! Every block is counted as memory_category::comm_scratch in the ledger, if one is given, from
//! take() until trim() frees it. The ledger is not thread-safe, so only take() and trim() touch
//! it: give() may run on a communicator's progress thread and only files the block. Not
//! thread-safe itself: the communicator calls it under its own lock.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/ledger.hpp>
#include <shardkit/core/memory.hpp>

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace detail {

//! `bytes` bytes of host scratch (not zeroed), counted as comm_scratch in `ledger` (may be null)
//! while it lives. Move-only. Not a buffer<std::byte>: that zeroes its memory (a pass over every
//! block a collective allocates), and a category decides whether it is long-lived, where here
//! the cache's bound does.
class scratch_block {
 public:
  scratch_block() = default;
  scratch_block(std::size_t bytes, bool long_lived, memory_ledger* ledger)
      : bytes_(bytes), long_lived_(long_lived), ledger_(ledger) {
    if (bytes == 0) return;
    try {
      data_ = static_cast<std::byte*>(space_allocator<host_space>::allocate(bytes, 0, long_lived));
    } catch (const std::bad_alloc&) {
      raise<error>("allocating ", bytes, " bytes of communication scratch in host memory failed");
    }
    if (ledger_ != nullptr) {
      try {
        ledger_->add(memory_category::comm_scratch, bytes);
      } catch (...) {
        space_allocator<host_space>::deallocate(data_, bytes_, long_lived_);
        throw;
      }
    }
  }
  scratch_block(const scratch_block&) = delete;
  scratch_block& operator=(const scratch_block&) = delete;
  scratch_block(scratch_block&& o) noexcept { swap(o); }
  scratch_block& operator=(scratch_block&& o) noexcept {
    scratch_block tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  ~scratch_block() { reset(); }

  std::byte* get() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  //! Frees the block and takes it out of the ledger.
  void reset() noexcept {
    if (data_ == nullptr) return;
    if (ledger_ != nullptr) {
      try {
        ledger_->remove(memory_category::comm_scratch, bytes_);
      } catch (...) {  // a ledger out of balance is a library bug; never throw from here
      }
    }
    space_allocator<host_space>::deallocate(data_, bytes_, long_lived_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void swap(scratch_block& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(long_lived_, o.long_lived_);
    std::swap(ledger_, o.ledger_);
  }
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool long_lived_ = false;
  memory_ledger* ledger_ = nullptr;
};

//! The scratch blocks a communicator keeps between collectives (see the file comment).
class scratch_cache {
 public:
  scratch_cache(std::size_t capacity, memory_ledger* ledger) noexcept
      : capacity_(capacity), ledger_(ledger) {}

  //! A block of at least `bytes` bytes (none for 0): the smallest kept block that fits and is at
  //! most twice `bytes`, or a new one.
  scratch_block take(std::size_t bytes) {
    if (bytes == 0) return {};
    // Room for every block lent out to come back without allocating (give() cannot fail).
    kept_.reserve(kept_.size() + lent_ + 1);
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->bytes() >= bytes && it->bytes() / 2 <= bytes &&
          (best == kept_.end() || it->bytes() < best->bytes())) {
        best = it;
      }
    }
    scratch_block b;
    if (best != kept_.end()) {
      b = std::move(*best);
      kept_.erase(best);
    } else {
      b = scratch_block(bytes, bytes <= capacity_, ledger_);
    }
    ++lent_;
    return b;
  }

  //! Takes back a block that take() lent (no collective uses it any more). Never frees and never
  //! throws, so that it may run on a progress thread; trim() frees what is beyond the capacity.
  void give(scratch_block&& b) noexcept {
    if (!b) return;
    --lent_;
    kept_.push_back(std::move(b));  // take() reserved room for it
  }

  //! Frees kept blocks until at most `capacity` bytes are kept, keeping the largest that fit.
  //! Called after every call on the communicator; sorts only when over the bound.
  void trim() noexcept {
    std::size_t kept = 0;
    for (const auto& b : kept_) kept += b.bytes();
    if (kept <= capacity_) return;
    std::sort(kept_.begin(), kept_.end(),
              [](const scratch_block& a, const scratch_block& b) { return a.bytes() > b.bytes(); });
    std::size_t held = 0;
    for (auto& b : kept_) {
      if (b.bytes() <= capacity_ - held) {
        held += b.bytes();
      } else {
        b.reset();
      }
    }
    std::erase_if(kept_, [](const scratch_block& b) { return !b; });
  }

 private:
  std::size_t capacity_;
  memory_ledger* ledger_;
  std::vector<scratch_block> kept_;
  std::size_t lent_ = 0;
};

}  // namespace detail
SHARDKIT_NAMESPACE_END
