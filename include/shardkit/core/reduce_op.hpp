//! \file core/reduce_op.hpp
//! The reduction operations of all_reduce and reduce_scatter. Vocabulary shared by the
//! communicators (comm/) and the reduction kernels (kernels/), so neither includes the other.
#pragma once

#include <shardkit/config.hpp>

#include <cstdint>
#include <ostream>

SHARDKIT_CORE_NAMESPACE_BEGIN

//! Reduction operation of all_reduce and reduce_scatter.
enum class reduce_op : std::uint8_t { sum, avg, max, min };

constexpr const char* name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum:
      return "sum";
    case reduce_op::avg:
      return "avg";
    case reduce_op::max:
      return "max";
    case reduce_op::min:
      return "min";
  }
  return "unknown";
}

inline std::ostream& operator<<(std::ostream& os, reduce_op op) {
  return os << name(op);
}

SHARDKIT_CORE_NAMESPACE_END
