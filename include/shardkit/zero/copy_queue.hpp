//! \file zero/copy_queue.hpp
//! `copy_queue<Space>`: the copies between buffers of memory space `Space` (the engine's, "the
//! device") and host memory that an offloaded optimizer step makes, in the order they are
//! enqueued, asynchronously to the caller. A copy returns an event; wait(e) returns once that copy
//! and every copy enqueued before it are complete. On a device this is a copy stream with events
//! (enqueue = an asynchronous copy on the stream, event = one recorded after it); for host
//! memory the same contract is kept by one copy thread working through a queue, so an offloaded
//! host engine runs the same schedule, in the same order, as a device one.
//!
//! `available` says whether a specialisation for the space was seen.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/memory.hpp>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

SHARDKIT_NAMESPACE_BEGIN

//! Primary template: no copies for this memory space.
template <memory_space Space>
struct copy_queue {
  static constexpr bool available = false;
};

//! Host memory as "the device": a copy thread that works through the copies in order.
template <>
class copy_queue<host_space> {
 public:
  static constexpr bool available = true;
  //! Completion of a copy and of every copy enqueued before it.
  using event = std::uint64_t;

  copy_queue() : worker_([this] { work(); }) {}
  copy_queue(const copy_queue&) = delete;
  copy_queue& operator=(const copy_queue&) = delete;
  ~copy_queue() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    worker_.join();
  }

  //! Copies `bytes` bytes of the device buffer `from` into the host buffer `to`.
  event to_host(const void* from, void* to, std::size_t bytes) { return enqueue(from, to, bytes); }
  //! Copies `bytes` bytes of the host buffer `from` into the device buffer `to`.
  event to_device(const void* from, void* to, std::size_t bytes) {
    return enqueue(from, to, bytes);
  }
  //! Returns once copy `e` (and everything enqueued before it) is complete.
  void wait(event e) {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return done_ >= e; });
  }
  //! Every copy enqueued so far is complete.
  void synchronize() { wait(issued_); }
  //! Copies enqueued since construction.
  std::uint64_t copies() const noexcept { return issued_; }

 private:
  struct copy {
    const void* from;
    void* to;
    std::size_t bytes;
  };
  event enqueue(const void* from, void* to, std::size_t bytes) {
    {
      std::lock_guard lock(mutex_);
      pending_.push_back({from, to, bytes});
      ++issued_;
    }
    wake_.notify_one();
    return issued_;
  }
  void work() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stopping, nothing left
      const copy c = pending_.front();
      pending_.pop_front();
      lock.unlock();
      if (c.bytes != 0) std::memcpy(c.to, c.from, c.bytes);
      lock.lock();
      ++done_;
      done_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_cv_;
  std::deque<copy> pending_;
  std::uint64_t issued_ = 0;  // written by the enqueuing thread only
  std::uint64_t done_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: starts once the rest is built
};

SHARDKIT_NAMESPACE_END
