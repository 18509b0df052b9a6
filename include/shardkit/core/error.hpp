//! \file core/error.hpp
//! The exceptions shardkit throws. Every message names what was wrong and what was expected.
#pragma once

#include <shardkit/config.hpp>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

SHARDKIT_CORE_NAMESPACE_BEGIN

//! Base of every exception shardkit throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

//! A value passed to an API does not fit its contract (a size, a dtype, a rank index, ...).
class invalid_argument : public error {
 public:
  using error::error;
};

//! An API was called in an order or state it does not allow (for example a backward hook for a
//! unit that was never gathered).
class usage_error : public error {
 public:
  using error::error;
};

//! Base of communication failures. Raised on every rank that takes part in the failed collective.
class comm_error : public error {
 public:
  using error::error;
};

//! A collective waited longer than the communicator's timeout for other ranks to arrive.
class comm_timeout : public comm_error {
 public:
  using comm_error::comm_error;
};

//! The communicator was aborted (another rank failed or an abort was requested).
class comm_aborted : public comm_error {
 public:
  using comm_error::comm_error;
};

//! Ranks called different collectives (kind, element type, count, root or operation) at the same
//! position of their sequence of calls.
class collective_mismatch : public comm_error {
 public:
  using comm_error::comm_error;
};

//! A file could not be opened, read, written, synced or renamed. The message names the file, the
//! operation and the system's reason.
class io_error : public error {
 public:
  using error::error;
};

//! A file holds something other than what was expected: a checkpoint or safetensors file that is
//! truncated, corrupt (a checksum does not match), of an unknown format version, or of another
//! model. The message names the file and the problem.
class format_error : public error {
 public:
  using error::error;
};

namespace core_detail {

//! Concatenates streamable values into a string (message building for exceptions).
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <class E = invalid_argument, class... Args>
[[noreturn]] void raise(Args&&... args) {
  throw E(concat(std::forward<Args>(args)...));
}

}  // namespace core_detail

SHARDKIT_CORE_NAMESPACE_END
