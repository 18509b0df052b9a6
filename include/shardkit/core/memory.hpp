//! \file core/memory.hpp
//! Memory spaces (where bytes live), their allocators, and `buffer`: an owning, aligned,
//! ledger-tracked array that every library allocation goes through.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/checked.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/core/ledger.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

// Long-lived blocks of 2 MiB or more are mappings of their own (mmap) on Linux, except under
// AddressSanitizer, whose allocator then still sees every buffer and its overflows.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SHARDKIT_DETAIL_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define SHARDKIT_DETAIL_ASAN 1
#endif
#if defined(__linux__) && !defined(SHARDKIT_DETAIL_ASAN)
#define SHARDKIT_DETAIL_MAP_BLOCKS 1
#endif

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

//! Whether buffers of `c` live across steps: everything but ZeRO-3's gathered units and the
//! staging of initialisation, checkpoints and exports, which are allocated and freed within a
//! step or a call.
constexpr bool long_lived(memory_category c) noexcept {
  return c != memory_category::gathered_params && c != memory_category::io_staging;
}

//! Host memory, aligned to 64 bytes (a cache line, and the widest vector register).
//!
//! Large allocations are also staggered within a 4 KiB page. malloc hands out large blocks at
//! one page offset (mmap'ed chunks), or at offsets a few cache lines apart (heap chunks of
//! page-multiple sizes), so flat buffers streamed together at the same index (the fused
//! optimizer step reads the gradient, master, m and v and writes master, m, v and the working
//! copy) would agree in their low 12 address bits: loads then wait on unrelated earlier stores
//! (4K aliasing) and every stream's lines fall in the same cache sets, which slowed a streaming
//! multi-array kernel 10x on this kind of machine. An allocation of at least
//! `stagger_threshold` bytes therefore starts `stagger_step` × k bytes past a 4 KiB boundary,
//! k = 0, 1, ..., `stagger_slots` - 1 in turn per thread (each rank thread allocates its own
//! buffers, so a rank's consecutive buffers get distinct slots). A full flat buffer of which a
//! rank streams only its slices names the byte offset of its first slice (`hot`): that byte,
//! rather than the first, is put on the slot. Any `stagger_slots` consecutive large allocations
//! of one thread are then at least 256 bytes apart modulo 4096, hence modulo every larger power
//! of two (tests/zero/test_buffer_placement.cpp). The cost: up to 3840 bytes and a 4 KiB
//! alignment per large allocation; memory ledgers count the bytes asked for, not this slack.
//! Smaller allocations are only 64-byte aligned.
//!
//! Long-lived allocations (`huge`: what a buffer of a category that lives across steps asks
//! for, long_lived()) of at least `huge_threshold` bytes (2 MiB) are also aligned to 2 MiB and,
//! on Linux, mappings of their own (fresh pages, unmapped when freed: map_block) advised to use
//! transparent huge pages (madvise MADV_HUGEPAGE). A step that streams seven arrays of tens of
//! megabytes misses the TLB on every 4 KiB of every array otherwise, and under a hypervisor each
//! miss walks two page tables: on this kind of machine (a VM) the fused fp32 AdamW step
//! ran 1.03-1.28x faster on 2 MiB pages, median about 1.1x (benchmarks/README.md). The advice
//! changes speed only, never values; a kernel without transparent huge pages ignores it. Only whole
//! 2 MiB ranges get huge pages, so beyond the stagger below the resident memory stays what was
//! asked for; the 2 MiB alignment is address space, not memory. Transient buffers (ZeRO-3's
//! gathered units, I/O staging) are left on ordinary pages: they are allocated and freed every
//! step, and faulting in fresh huge pages each time (the kernel clears 2 MiB per fault) made a
//! ZeRO-3 step of 4M parameters 1.4x slower. `SHARDKIT_HUGE_PAGES=0` turns the advice off (`1`, the
//! default, keeps it on); any other value is an invalid_argument error at the next large
//! allocation.
//!
//! Allocations on 2 MiB boundaries are staggered across threads as well: each starts a further
//! `thread_step` (32 KiB) × the allocating thread's slot past its boundary, slots 0 ..
//! `thread_slots` - 1. Thread ranks allocate the same buffers in the same order, so without it
//! rank r's gradients and rank s's would agree in their low 21 address bits, and on huge pages
//! in their physical ones; a collective of the thread communicator streams every rank's buffer
//! at the same offsets at once (the all-reduce reads chunk r of every rank's input and writes it
//! to every rank's output). Measured on this project's 2-core AMD EPYC (Zen 4): the in-place
//! all-reduce of 16 MiB of bf16 over 4 thread ranks took 3.6 ms with the ranks' buffers
//! congruent modulo 2 MiB and 2.1 ms with each on its own slot
//! (collectives/placement_all_reduce_in_place; benchmarks/README.md).
//! run_ranks gives rank r slot r % thread_slots (set_thread_slot); any other thread takes the
//! next slot in turn at its first such allocation. The cost: up to 224 KiB more address space
//! per allocation of 2 MiB or more, resident where a huge page covers it (at most 11% of a
//! 2 MiB buffer, 1.4% of a 16 MiB one); ledgers count the bytes asked for.
template <>
struct space_allocator<host_space> {
  static constexpr std::size_t alignment = 64;
  static constexpr std::size_t page = 4096;
  static constexpr std::size_t stagger_step = 256;
  static constexpr std::size_t stagger_slots = page / stagger_step;
  static constexpr std::size_t stagger_threshold = std::size_t{64} << 10;

  static constexpr std::size_t huge_page = std::size_t{2} << 20;
  static constexpr std::size_t huge_threshold = huge_page;
  static constexpr std::size_t thread_step = std::size_t{32} << 10;
  static constexpr std::size_t thread_slots = 8;
  //! Whether a long-lived block of 2 MiB or more is a mapping of its own, of pages nothing
  //! touched before (Linux, but not under AddressSanitizer); see map_block.
#if defined(SHARDKIT_DETAIL_MAP_BLOCKS)
  static constexpr bool own_mappings = true;
#else
  static constexpr bool own_mappings = false;
#endif
  static_assert(thread_step * (thread_slots - 1) + page <= huge_page,
                "the stagger of an allocation on a 2 MiB boundary stays within its first 2 MiB");

  //! Puts this thread's later allocations on 2 MiB boundaries on slot `slot` % thread_slots of
  //! the stagger across threads (run_ranks: the rank).
  static void set_thread_slot(std::size_t slot) noexcept {
    thread_slot_ref() = slot % thread_slots;
  }
  //! This thread's slot: the one set, else the next in turn across threads, taken at the first
  //! call.
  static std::size_t thread_slot() noexcept {
    std::size_t& s = thread_slot_ref();
    if (s == unset) s = next_thread_slot().fetch_add(1, std::memory_order_relaxed) % thread_slots;
    return s;
  }

  //! The alignment of the block behind an allocation of `bytes` bytes (`huge`: long-lived).
  static constexpr std::size_t block_alignment(std::size_t bytes, bool huge) noexcept {
    if (bytes < stagger_threshold) return alignment;
    return bytes < huge_threshold || !huge ? page : huge_page;
  }

  //! Whether large allocations are advised to use huge pages (SHARDKIT_HUGE_PAGES, read at
  //! every large allocation).
  static bool huge_pages_enabled() {
    const char* v = std::getenv("SHARDKIT_HUGE_PAGES");
    if (v == nullptr || std::string_view(v) == "1") return true;
    if (std::string_view(v) == "0") return false;
    core_detail::raise<invalid_argument>("SHARDKIT_HUGE_PAGES=", v,
                                         ": accepted values are 0 (no huge-page advice) and 1 "
                                         "(advise huge pages for host allocations of 2 MiB or "
                                         "more, the default)");
  }

  //! `bytes` bytes; for a large allocation, byte `hot` of them lands on the next stagger slot
  //! (within 64 bytes: the block stays 64-byte aligned). `huge`: long-lived, a candidate for
  //! huge pages.
  static void* allocate(std::size_t bytes, std::size_t hot = 0, bool huge = false) {
    if (bytes == 0) return nullptr;
    if (bytes < stagger_threshold) return ::operator new (bytes, std::align_val_t{alignment});
    const bool on_huge = block_alignment(bytes, huge) == huge_page;
    const std::size_t slot = stagger_step * (next_slot() % stagger_slots);
    const std::size_t across_threads = on_huge ? thread_step * thread_slot() : 0;
    const std::size_t offset =
        across_threads + (slot + page - hot % page / alignment * alignment) % page;
    const std::size_t total = checked_add(bytes, offset, "host allocation: bytes + page stagger");
    if (on_huge) return map_block(total, huge_pages_enabled()) + offset;
    return static_cast<std::byte*>(::operator new (total, std::align_val_t{page})) + offset;
  }
  static void deallocate(void* p, std::size_t bytes, bool huge = false) noexcept {
    if (p == nullptr) return;
    if (bytes < stagger_threshold) {
      ::operator delete (p, std::align_val_t{alignment});
      return;
    }
    // The block starts at the boundary of its alignment at or below p (the stagger is under a
    // page, or under 2 MiB on a 2 MiB boundary).
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    const std::size_t block = block_alignment(bytes, huge);
    auto* base = reinterpret_cast<std::byte*>(at - at % block);
    if (block == huge_page) {
      unmap_block(base, static_cast<std::size_t>(at % block) + bytes);
      return;
    }
    ::operator delete (base, std::align_val_t{block});
  }
  static void zero(void* p, std::size_t bytes) noexcept {
    if (bytes != 0) std::memset(p, 0, bytes);
  }

 private:
  //! A block of `total` bytes on a 2 MiB boundary, of pages nothing has touched yet (`advise`:
  //! advised to use huge pages). On Linux it is a mapping of its own: malloc serves large
  //! requests from memory freed earlier once its mmap threshold has risen (glibc raises it to
  //! the size of every mmap'ed block freed, up to 32 MiB), and pages already faulted in on
  //! 4 KiB stay so whatever the advice. An engine built after another one was destroyed then
  //! ran on 4 KiB pages: over MPI at N = 2 its in-place all-gather of 16 MiB took 2.0 ms instead
  //! of 0.9 ms (benchmarks/README.md).
  static std::byte* map_block(std::size_t total, bool advise) {
#if defined(SHARDKIT_DETAIL_MAP_BLOCKS)
    const std::size_t length = checked_round_up(total, page, "host allocation: whole pages");
    const std::size_t reserve =
        checked_add(length, huge_page - page, "host allocation: 2 MiB alignment");
    void* const m =
        ::mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    auto* const first = static_cast<std::byte*>(m);
    const auto at = reinterpret_cast<std::uintptr_t>(first);
    std::byte* const base = first + (huge_page - at % huge_page) % huge_page;
    // Unmap what lies before the boundary and after the block.
    if (base != first) (void)::munmap(first, static_cast<std::size_t>(base - first));
    if (std::byte* const end = base + length; end != first + reserve)
      (void)::munmap(end, static_cast<std::size_t>(first + reserve - end));
    if (advise) advise_huge_pages(base, length);
    return base;
#else
    auto* const base = static_cast<std::byte*>(::operator new (total, std::align_val_t{huge_page}));
    if (advise) advise_huge_pages(base, total / page * page);
    return base;
#endif
  }
  //! Advises [p, p + length) (whole pages) to use huge pages, before the first touch, so that
  //! the first faults already map them. A failure (no transparent huge pages in this kernel)
  //! leaves ordinary pages: nothing to report.
  static void advise_huge_pages([[maybe_unused]] void* p, [[maybe_unused]] std::size_t length) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)::madvise(p, length, MADV_HUGEPAGE);
#endif
  }
  //! Releases a block of map_block(total).
  static void unmap_block(std::byte* base, std::size_t total) noexcept {
#if defined(SHARDKIT_DETAIL_MAP_BLOCKS)
    (void)::munmap(base, (total + page - 1) / page * page);  // fits: map_block checked it
#else
    (void)total;
    ::operator delete (base, std::align_val_t{huge_page});
#endif
  }
  static std::size_t next_slot() noexcept {
    thread_local std::size_t slot = 0;
    return slot++;
  }
  static constexpr std::size_t unset = ~std::size_t{0};
  static std::size_t& thread_slot_ref() noexcept {
    thread_local std::size_t slot = unset;
    return slot;
  }
  static std::atomic<std::size_t>& next_thread_slot() noexcept {
    static std::atomic<std::size_t> next{0};
    return next;
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
  //! `hot`: the first element of the part a rank streams through, where that is not element 0
  //! (a full flat buffer of which the rank steps its slices); host memory staggers that
  //! element's address within a page (space_allocator<host_space>).
  buffer(std::size_t n, memory_ledger* ledger, memory_category category, std::size_t hot = 0)
      : size_(n), ledger_(ledger), category_(category) {
    const std::size_t bytes = checked_mul(n, sizeof(T), "buffer: bytes (elements * element size)");
    try {
      if constexpr (requires { space_allocator<Space>::allocate(bytes, bytes, true); }) {
        data_ = static_cast<T*>(
            space_allocator<Space>::allocate(bytes, hot * sizeof(T), long_lived(category)));
      } else {
        data_ = static_cast<T*>(space_allocator<Space>::allocate(bytes));
      }
    } catch (const std::bad_alloc&) {
      core_detail::raise<error>("allocating ", bytes, " bytes of ", name(category), " in ",
                                Space::name, " memory failed");
    }
    space_allocator<Space>::zero(data_, bytes);
    if (ledger_ != nullptr) {
      try {
        ledger_->add(category_, bytes);
      } catch (...) {
        deallocate();
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
    deallocate();
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
  void deallocate() noexcept {
    if constexpr (requires { space_allocator<Space>::deallocate(data_, 0, true); }) {
      space_allocator<Space>::deallocate(data_, size_ * sizeof(T), long_lived(category_));
    } else {
      space_allocator<Space>::deallocate(data_, size_ * sizeof(T));
    }
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  memory_ledger* ledger_ = nullptr;
  memory_category category_ = memory_category::comm_scratch;
};

SHARDKIT_CORE_NAMESPACE_END
