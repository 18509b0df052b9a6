//! \file core/memory.hpp
//! Memory spaces (where bytes live), their allocators, and `buffer`: an owning, aligned,
//! ledger-tracked array that every library allocation goes through.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/checked.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>

#include <cstddef>
#include <cstring>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

SHARDKIT_CORE_NAMESPACE_BEGIN

//! Ordinary host memory.
struct host_space {
  static constexpr const char* name = "host";
};

//! CUDA device memory. Allocation and kernels for it live in the CUDA headers
//! (`kernels/cuda/`); host-only builds can name the space but not allocate in it.
struct cuda_space {
  static constexpr const char* name = "cuda";
};

//! A tag type naming where memory lives.
template <class S>
concept memory_space = std::is_empty_v<S> && requires {
  { S::name } -> std::convertible_to<const char*>;
};

//! True when code running on the host may dereference pointers into `Space`.
template <memory_space Space>
inline constexpr bool host_accessible = std::is_same_v<Space, host_space>;

//! Allocation in a memory space; specialised per space. Only host memory is available here.
template <memory_space Space>
struct space_allocator;

//! Host memory, aligned to 64 bytes (a cache line, and the widest vector register).
template <>
struct space_allocator<host_space> {
  static constexpr std::size_t alignment = 64;
  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    return ::operator new (bytes, std::align_val_t{alignment});
  }
  static void deallocate(void* p, std::size_t) noexcept {
    if (p != nullptr) ::operator delete (p, std::align_val_t{alignment});
  }
  static void zero(void* p, std::size_t bytes) noexcept {
    if (bytes != 0) std::memset(p, 0, bytes);
  }
};

//! An owning array of `n` elements of trivially copyable `T` in `Space`, zero-initialised, whose
//! bytes are recorded in a memory ledger under one category for as long as it lives.
template <class T, memory_space Space = host_space>
class buffer {
  static_assert(std::is_trivially_copyable_v<T>, "buffer<T>: T must be trivially copyable");

 public:
  using value_type = T;
  using memory_space = Space;

  buffer() = default;

  //! Allocates `n` zeroed elements and records them in `ledger` (may be null) as `category`.
  buffer(std::size_t n, memory_ledger* ledger, memory_category category)
      : size_(n), ledger_(ledger), category_(category) {
    const std::size_t bytes = checked_mul(n, sizeof(T), "buffer: bytes (elements * element size)");
    try {
      data_ = static_cast<T*>(space_allocator<Space>::allocate(bytes));
    } catch (const std::bad_alloc&) {
      core_detail::raise<error>("allocating ", bytes, " bytes of ", name(category), " in ",
                                Space::name, " memory failed");
    }
    space_allocator<Space>::zero(data_, bytes);
    if (ledger_ != nullptr) {
      try {
        ledger_->add(category_, bytes);
      } catch (...) {
        space_allocator<Space>::deallocate(data_, bytes);
        throw;
      }
    }
  }

  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  buffer(buffer&& o) noexcept { swap(o); }
  buffer& operator=(buffer&& o) noexcept {
    buffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  ~buffer() { release(); }

  //! Frees the memory now and removes it from the ledger.
  void release() noexcept {
    if (ledger_ != nullptr && size_ != 0) {
      try {
        ledger_->remove(category_, size_ * sizeof(T));
      } catch (...) {  // a ledger out of balance is a library bug; never throw from here
      }
    }
    space_allocator<Space>::deallocate(data_, size_ * sizeof(T));
    data_ = nullptr;
    size_ = 0;
  }

  void swap(buffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(ledger_, o.ledger_);
    std::swap(category_, o.category_);
  }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }
  memory_category category() const noexcept { return category_; }

  //! Host view of the elements (host memory only).
  std::span<T> span() noexcept requires host_accessible<Space> { return {data_, size_}; }
  std::span<const T> span() const noexcept requires host_accessible<Space> {
    return {data_, size_};
  }

  //! Sets every element to zero bits.
  void zero() noexcept { space_allocator<Space>::zero(data_, bytes()); }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
  memory_ledger* ledger_ = nullptr;
  memory_category category_ = memory_category::comm_scratch;
};

SHARDKIT_CORE_NAMESPACE_END
