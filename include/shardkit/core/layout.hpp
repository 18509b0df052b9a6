//! \file core/layout.hpp
//! The flat layout: how a list of parameters is packed into one padded buffer and cut into
//! equal per-rank shards.
//!
//! Parameters are packed in registration order into *groups* (gradient buckets, or ZeRO-3
//! units). A parameter never spans two groups. Group g holds Ψ_g true elements and is padded to
//! N·S_g elements, where
//!
//!     S_g = round_up(ceil(Ψ_g / N), alignment)
//!
//! Rank r owns the contiguous slice [r·S_g, (r+1)·S_g) of every group, so each collective on a
//! group has equal per-rank counts (NCCL semantics). A rank's *shard buffer* is the concatenation
//! of its slices: S = Σ_g S_g elements. The *full buffer* is the concatenation of the padded
//! groups: N·S elements. With one group and alignment 1, S = ceil(Ψ/N) exactly
//! (docs/accounting.md).
//!
//! Padding is always at the end of a group, never inside a parameter. Uneven sizes, N > Ψ and
//! zero-size parameters are ordinary cases.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/checked.hpp>
#include <shardkit/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

SHARDKIT_CORE_NAMESPACE_BEGIN

//! Half-open element range [offset, offset + count).
struct index_range {
  std::size_t offset = 0;
  std::size_t count = 0;
  constexpr std::size_t end() const noexcept { return offset + count; }
  friend constexpr bool operator==(const index_range&, const index_range&) = default;
};

class flat_layout {
 public:
  //! Where one parameter sits.
  struct param_entry {
    std::size_t numel;         //!< elements of the parameter
    std::size_t group;         //!< group (bucket or unit) holding it
    std::size_t offset;        //!< first element in the full buffer
    std::size_t group_offset;  //!< first element relative to the start of its group
  };

  //! One group (bucket or unit).
  struct group_entry {
    std::size_t first_param;   //!< first parameter index
    std::size_t end_param;     //!< one past the last parameter index
    std::size_t numel;         //!< true elements Ψ_g
    std::size_t shard;         //!< per-rank slice S_g
    std::size_t offset;        //!< first element in the full buffer (N·Σ_{j<g} S_j)
    std::size_t shard_offset;  //!< first element in a rank's shard buffer (Σ_{j<g} S_j)
    std::size_t padded;        //!< N·S_g: elements the group occupies in the full buffer
  };

  //! A contiguous piece of one parameter owned by one rank.
  struct piece {
    std::size_t param;         //!< parameter index
    int rank;                  //!< owning rank
    std::size_t param_offset;  //!< first element within the parameter
    std::size_t shard_offset;  //!< first element within the owner's shard buffer
    std::size_t full_offset;   //!< first element within the full buffer
    std::size_t count;         //!< elements
  };

  flat_layout() = default;

  //! Packs parameters of the given sizes into groups that start at the parameter indices in
  //! `group_starts` (first must be 0, strictly increasing; empty = one group), for `ranks`
  //! ranks, each rank's slice rounded up to a multiple of `alignment` elements.
  flat_layout(std::span<const std::size_t> numels, std::span<const std::size_t> group_starts,
              std::size_t ranks, std::size_t alignment = 1)
      : ranks_(ranks), alignment_(alignment) {
    if (ranks == 0) core_detail::raise("flat_layout: ranks must be at least 1, got 0");
    if (alignment == 0)
      core_detail::raise("flat_layout: alignment must be at least 1 element, got 0");
    std::vector<std::size_t> starts(group_starts.begin(), group_starts.end());
    if (starts.empty()) starts.push_back(0);
    if (!numels.empty() || starts.size() > 1 || starts[0] != 0) {
      if (starts[0] != 0) {
        core_detail::raise("flat_layout: the first group must start at parameter 0, got ",
                           starts[0]);
      }
      for (std::size_t g = 1; g < starts.size(); ++g) {
        if (starts[g] <= starts[g - 1] || starts[g] >= numels.size()) {
          core_detail::raise(
              "flat_layout: group starts must be strictly increasing parameter indices "
              "below ",
              numels.size(), "; group ", g, " starts at ", starts[g]);
        }
      }
    }
    params_.resize(numels.size());
    std::size_t full = 0, shard_total = 0;
    for (std::size_t g = 0; g < starts.size(); ++g) {
      group_entry e{};
      e.first_param = starts[g];
      e.end_param = g + 1 < starts.size() ? starts[g + 1] : numels.size();
      std::size_t n = 0;
      for (std::size_t i = e.first_param; i < e.end_param; ++i) {
        params_[i] = param_entry{numels[i], g, checked_add(full, n, "flat_layout: offset"), n};
        n = checked_add(n, numels[i], "flat_layout: elements of a group");
      }
      e.numel = n;
      e.shard = checked_round_up(ceil_div(n, ranks), alignment, "flat_layout: aligned shard");
      e.offset = full;
      e.shard_offset = shard_total;
      e.padded = checked_mul(e.shard, ranks, "flat_layout: padded group (shard * ranks)");
      full = checked_add(full, e.padded, "flat_layout: padded elements");
      shard_total = checked_add(shard_total, e.shard, "flat_layout: shard elements");
      numel_ = checked_add(numel_, n, "flat_layout: elements");
      groups_.push_back(e);
    }
    padded_ = full;
    shard_ = shard_total;
  }

  //! All parameters in one group (one bucket): S = round_up(ceil(Ψ/N), alignment).
  static flat_layout single_group(std::span<const std::size_t> numels, std::size_t ranks,
                                  std::size_t alignment = 1) {
    return flat_layout(numels, {}, ranks, alignment);
  }

  //! Gradient buckets of at least `bucket_elems` elements, closed greedily from the last
  //! parameter backwards (the order in which backward produces gradients). The first bucket
  //! may be smaller. bucket_elems = 0 puts everything in one bucket.
  static flat_layout bucketed(std::span<const std::size_t> numels, std::size_t ranks,
                              std::size_t bucket_elems, std::size_t alignment = 1) {
    std::vector<std::size_t> starts;
    if (bucket_elems != 0) {
      std::size_t acc = 0;
      for (std::size_t i = numels.size(); i-- > 0;) {
        acc += numels[i];
        if (acc >= bucket_elems && i != 0) {
          starts.push_back(i);
          acc = 0;
        }
      }
    }
    starts.push_back(0);
    std::vector<std::size_t> ordered(starts.rbegin(), starts.rend());
    return flat_layout(numels, ordered, ranks, alignment);
  }

  std::size_t num_params() const noexcept { return params_.size(); }
  std::size_t num_groups() const noexcept { return groups_.size(); }
  std::size_t ranks() const noexcept { return ranks_; }
  std::size_t alignment() const noexcept { return alignment_; }

  //! Ψ: true elements over all parameters.
  std::size_t numel() const noexcept { return numel_; }
  //! Elements of the full (padded) buffer: N·S.
  std::size_t padded_numel() const noexcept { return padded_; }
  //! Elements of one rank's shard buffer: S = Σ_g S_g.
  std::size_t shard_numel() const noexcept { return shard_; }
  //! Padding elements in the full buffer.
  std::size_t padding() const noexcept { return padded_ - numel_; }

  const param_entry& param(std::size_t i) const {
    check_param(i);
    return params_[i];
  }
  const group_entry& group(std::size_t g) const {
    if (g >= groups_.size()) {
      core_detail::raise("flat_layout: group ", g, " out of range (", groups_.size(), " groups)");
    }
    return groups_[g];
  }
  std::span<const param_entry> params() const noexcept { return params_; }
  std::span<const group_entry> groups() const noexcept { return groups_; }

  //! Rank `rank`'s slice of group `g`, in full-buffer coordinates.
  index_range shard_range(std::size_t rank, std::size_t g) const {
    check_rank(rank);
    const auto& e = group(g);
    return {e.offset + rank * e.shard, e.shard};
  }

  //! Pieces of parameters that rank `rank` owns, in shard-buffer order. Padding is not a piece.
  std::vector<piece> pieces(std::size_t rank) const {
    check_rank(rank);
    std::vector<piece> out;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto& e = groups_[g];
      const std::size_t lo = rank * e.shard, hi = lo + e.shard;  // group-relative
      for (std::size_t i = e.first_param; i < e.end_param; ++i) {
        const auto& p = params_[i];
        const std::size_t b = std::max(lo, p.group_offset);
        const std::size_t en = std::min(hi, p.group_offset + p.numel);
        if (b < en) {
          out.push_back(piece{i, static_cast<int>(rank), b - p.group_offset,
                              e.shard_offset + (b - lo), e.offset + b, en - b});
        }
      }
    }
    return out;
  }

  //! The pieces of parameter `i`, one per owning rank, in parameter order.
  std::vector<piece> pieces_of(std::size_t i) const {
    check_param(i);
    const auto& p = params_[i];
    const auto& e = groups_[p.group];
    std::vector<piece> out;
    std::size_t pos = p.group_offset;
    const std::size_t end = p.group_offset + p.numel;
    while (pos < end) {
      const std::size_t r = pos / e.shard;
      const std::size_t hi = std::min(end, (r + 1) * e.shard);
      out.push_back(piece{i, static_cast<int>(r), pos - p.group_offset,
                          e.shard_offset + (pos - r * e.shard), e.offset + pos, hi - pos});
      pos = hi;
    }
    return out;
  }

 private:
  void check_param(std::size_t i) const {
    if (i >= params_.size()) {
      core_detail::raise("flat_layout: parameter ", i, " out of range (", params_.size(),
                         " parameters)");
    }
  }
  void check_rank(std::size_t r) const {
    if (r >= ranks_)
      core_detail::raise("flat_layout: rank ", r, " out of range (", ranks_, " ranks)");
  }

  std::vector<param_entry> params_;
  std::vector<group_entry> groups_;
  std::size_t ranks_ = 1;
  std::size_t alignment_ = 1;
  std::size_t numel_ = 0;
  std::size_t padded_ = 0;
  std::size_t shard_ = 0;
};

SHARDKIT_CORE_NAMESPACE_END
