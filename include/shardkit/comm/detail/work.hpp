//! \file comm/detail/work.hpp
//! `basic_work<Op>`: what every shardkit work handle shares. It is move-only; wait() blocks
//! until the collective is done and rethrows its error, once (calling it again is a no-op);
//! test() says whether it is done; and a handle destroyed, or assigned over, before wait()
//! *settles* its collective, so that a dropped handle never leaves a collective writing into
//! buffers its caller believes are free. The transport's `Op` says what each of these means:
//!
//!     void wait();              // block, rethrow the collective's error
//!     bool test();              // done (or failed)?
//!     void settle() noexcept;   // a dropped handle: wait quietly (host transports), or make the
//!                               // compute stream wait for it (device transports)
#pragma once

#include <shardkit/config.hpp>

#include <utility>

SHARDKIT_NAMESPACE_BEGIN
namespace detail {

template <class Op>
class basic_work {
 public:
  basic_work() = default;
  explicit basic_work(Op op) : op_(std::move(op)), pending_(true) {}
  basic_work(basic_work&& o) noexcept
      : op_(std::move(o.op_)), pending_(std::exchange(o.pending_, false)) {}
  basic_work& operator=(basic_work&& o) noexcept {
    if (this != &o) {
      settle();
      op_ = std::move(o.op_);
      pending_ = std::exchange(o.pending_, false);
    }
    return *this;
  }
  basic_work(const basic_work&) = delete;
  basic_work& operator=(const basic_work&) = delete;
  ~basic_work() { settle(); }

  //! Blocks until the collective is done; rethrows its error. Calling it again is a no-op.
  void wait() {
    if (!pending_) return;
    pending_ = false;
    op_.wait();
  }
  //! True when the collective is done (or failed, or the handle is empty or waited for).
  bool test() { return !pending_ || op_.test(); }

 protected:
  Op& op() noexcept { return op_; }
  const Op& op() const noexcept { return op_; }
  //! wait() has not been called yet.
  bool pending() const noexcept { return pending_; }

 private:
  void settle() noexcept {
    if (!pending_) return;
    pending_ = false;
    op_.settle();
  }

  Op op_{};
  bool pending_ = false;
};

}  // namespace detail
SHARDKIT_NAMESPACE_END
