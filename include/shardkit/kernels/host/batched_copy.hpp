//! \file kernels/host/batched_copy.hpp
//! Many converting copies in one call, the host twin of gpu::batched_copy
//! (kernels/cuda/convert.cuh): flatten tensors into a padded flat buffer, unflatten it, or any
//! other list of copies between host arrays, with the padding zeroed on the way.
//!
//!     // flatten three fp32 gradients into a padded bf16 flat buffer:
//!     using copy = shardkit::host::batched_copy<float, bf16>;
//!     std::vector<copy::item> in = {{g0, flat + 0, n0}, {g1, flat + n0, n1},
//!                                   {g2, flat + n0 + n1, n2, padding}};
//!     copy flatten(in);                  // checks the list once
//!     flatten.run(&team);                // every step; nullptr: the caller's thread only
//!
//! The work is cut into equal pieces of the concatenated elements (copies and zeros), one per
//! thread, whatever the sizes of the tensors: a model of many small tensors runs on every
//! thread, and a thread's piece may span several tensors. Whether the outputs are written with
//! streaming stores (kernels/host/streaming.hpp) is decided once for the whole call, from the
//! bytes one thread moves: a model's flat buffer is often larger than the cache when none of
//! its tensors is. The bits are those of host::convert, whatever the threads and the stores.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/kernels/host/convert.hpp>
#include <shardkit/kernels/host/parallel.hpp>
#include <shardkit/kernels/host/streaming.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace host {

//! A list of copies from S arrays to D arrays (converting), each followed by zeros, run as one
//! call on the threads of an executor. Build it once, run it as often as needed; the arrays
//! must stay valid. Destinations must not overlap each other or any source.
template <float_storage S, float_storage D>
class batched_copy {
 public:
  //! Copy `count` elements from `src` to `dst` (converting), then write `zero_fill` zeros after
  //! them (padding).
  struct item {
    const S* src = nullptr;
    D* dst = nullptr;
    std::size_t count = 0;
    std::size_t zero_fill = 0;
  };

  batched_copy() = default;

  //! Checks the list (invalid_argument names the first bad item: a null pointer for a
  //! nonzero count, or a destination that overlaps another destination or a source).
  explicit batched_copy(std::span<const item> items) : items_(items.begin(), items.end()) {
    check(items_);
    ends_.reserve(items_.size());
    for (const item& it : items_) {
      elements_ += it.count + it.zero_fill;
      ends_.push_back(elements_);
      bytes_moved_ += it.count * (sizeof(S) + sizeof(D)) + it.zero_fill * sizeof(D);
    }
  }

  //! Runs every copy on the threads of `exec` (nullptr: the caller's only). `how`: whether the
  //! destinations are written with streaming stores (stores::automatic: when the bytes one
  //! thread moves reach host::streaming_threshold()).
  void run(executor* exec = nullptr, stores how = stores::automatic) const {
    if (elements_ == 0) return;
    const pieces p = pieces::of(exec, elements_, convert_grain);
    const double per_thread = static_cast<double>(bytes_moved_) * static_cast<double>(p.per) /
                              static_cast<double>(elements_);
    const stores each =
        streams(how, static_cast<std::size_t>(per_thread)) ? stores::streaming : stores::cached;
    parallel_for(exec, elements_, convert_grain,
                 [&](std::size_t b, std::size_t e) { run_range(b, e, each); });
  }

  //! Elements written per run (copies and zeros).
  std::size_t elements() const noexcept { return elements_; }
  //! Bytes read plus bytes written per run.
  std::size_t bytes_moved() const noexcept { return bytes_moved_; }
  std::span<const item> items() const noexcept { return items_; }

 private:
  //! Elements [b, e) of the concatenation of every item's copy and zeros.
  void run_range(std::size_t b, std::size_t e, stores how) const {
    std::size_t k =
        static_cast<std::size_t>(std::upper_bound(ends_.begin(), ends_.end(), b) - ends_.begin());
    for (; k < items_.size() && b < e; ++k) {
      const item& it = items_[k];
      const std::size_t start = ends_[k] - it.count - it.zero_fill;
      const std::size_t lo = b - start;                      // within this item
      const std::size_t hi = std::min(e, ends_[k]) - start;  // exclusive
      if (lo < it.count) convert(it.src + lo, it.dst + lo, std::min(hi, it.count) - lo, how);
      if (hi > it.count) std::fill(it.dst + std::max(lo, it.count), it.dst + hi, D{});
      b = start + hi;
    }
  }

  static void check(std::span<const item> items) {
    struct range {
      std::uintptr_t begin, end;
      std::size_t item;
      bool destination;
    };
    std::vector<range> ranges;
    for (std::size_t i = 0; i < items.size(); ++i) {
      const item& it = items[i];
      if ((it.count != 0 && (it.src == nullptr || it.dst == nullptr)) ||
          (it.zero_fill != 0 && it.dst == nullptr)) {
        ::shardkit::detail::raise("host::batched_copy: item ", i, " has a null pointer for ",
                                  it.count, " elements and ", it.zero_fill, " zeros");
      }
      const auto dst = reinterpret_cast<std::uintptr_t>(it.dst);
      const auto src = reinterpret_cast<std::uintptr_t>(it.src);
      if (it.count + it.zero_fill != 0) {
        ranges.push_back({dst, dst + (it.count + it.zero_fill) * sizeof(D), i, true});
      }
      if (it.count != 0) ranges.push_back({src, src + it.count * sizeof(S), i, false});
    }
    std::sort(ranges.begin(), ranges.end(),
              [](const range& a, const range& b) { return a.begin < b.begin; });
    // Swept by start: a range overlaps an earlier one iff that one ends after it starts, so
    // the earlier range that ends last (of any kind; of the destinations) is the one to test.
    const range* last_any = nullptr;
    const range* last_destination = nullptr;
    for (const range& r : ranges) {
      const range* other = r.destination ? last_any : last_destination;
      if (other != nullptr && other->end > r.begin) {
        ::shardkit::detail::raise(
            "host::batched_copy: the ", other->destination ? "destination" : "source", " of item ",
            other->item, " overlaps the ", r.destination ? "destination" : "source", " of item ",
            r.item, " (destinations must not overlap each other or any source)");
      }
      if (last_any == nullptr || r.end > last_any->end) last_any = &r;
      if (r.destination && (last_destination == nullptr || r.end > last_destination->end)) {
        last_destination = &r;
      }
    }
  }

  std::vector<item> items_;
  std::vector<std::size_t> ends_;  // running total of elements at the end of each item
  std::size_t elements_ = 0;
  std::size_t bytes_moved_ = 0;
};

}  // namespace host
SHARDKIT_NAMESPACE_END
