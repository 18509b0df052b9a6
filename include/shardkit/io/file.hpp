//! \file io/file.hpp
//! The file operations checkpoints and safetensors files are made of (POSIX): positioned reads
//! and writes that never stop half-way silently, fsync of files and directories, and atomic
//! replacement of a directory or file. Every failure raises io_error naming the operation, the
//! path and the system's reason; a read past the end of a file raises format_error ("truncated").
//!
//! A test seam: io::detail::fault_injector() may be set to a function that is asked before each
//! write, sync, rename and directory creation, and whose non-zero errno makes the operation fail
//! with it. The tests use it to make a disk full (ENOSPC) or a directory read-only (EROFS) at
//! any moment of a save; it is empty otherwise.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <system_error>
#include <unistd.h>
#include <utility>

SHARDKIT_NAMESPACE_BEGIN
namespace io {

namespace detail {
//! See the file comment.
inline std::function<int(std::string_view op, const std::string& path)>& fault_injector() {
  static std::function<int(std::string_view, const std::string&)> f;
  return f;
}
inline int injected(std::string_view op, const std::string& path) {
  const auto& f = fault_injector();
  return f ? f(op, path) : 0;
}
}  // namespace detail

//! Raises io_error: "<op> '<path>' failed: <reason>".
[[noreturn]] inline void raise_errno(std::string_view op, const std::string& path, int err) {
  throw io_error(shardkit::detail::concat(op, " '", path, "' failed: ", std::strerror(err)));
}

//! An open file descriptor, closed by the destructor (close() reports errors).
class file {
 public:
  file() = default;
  //! Creates (or truncates) `path` for writing.
  static file create(const std::string& path) {
    if (int e = detail::injected("create", path)) raise_errno("creating", path, e);
    return file(path, ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                "creating");
  }
  //! Opens the existing `path` for writing at offsets (no truncation).
  static file open_write(const std::string& path) {
    if (int e = detail::injected("open", path)) raise_errno("opening", path, e);
    return file(path, ::open(path.c_str(), O_WRONLY | O_CLOEXEC), "opening");
  }
  //! Opens `path` for reading.
  static file open_read(const std::string& path) {
    return file(path, ::open(path.c_str(), O_RDONLY | O_CLOEXEC), "opening");
  }
  file(file&& o) noexcept : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)) {}
  file& operator=(file&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
      path_ = std::move(o.path_);
    }
    return *this;
  }
  file(const file&) = delete;
  file& operator=(const file&) = delete;
  ~file() {
    if (fd_ >= 0) ::close(fd_);
  }

  const std::string& path() const noexcept { return path_; }
  bool is_open() const noexcept { return fd_ >= 0; }

  //! Writes all `n` bytes at byte `offset`.
  void write_at(const void* data, std::size_t n, std::uint64_t offset) {
    if (int e = detail::injected("write", path_)) raise_errno("writing", path_, e);
    const auto* p = static_cast<const unsigned char*>(data);
    while (n != 0) {
      const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
      if (w < 0) {
        if (errno == EINTR) continue;
        raise_errno("writing", path_, errno);
      }
      if (w == 0) raise_errno("writing", path_, ENOSPC);
      p += w;
      n -= static_cast<std::size_t>(w);
      offset += static_cast<std::uint64_t>(w);
    }
  }
  //! Reads exactly `n` bytes at byte `offset`; format_error when the file ends before.
  void read_at(void* data, std::size_t n, std::uint64_t offset) const {
    auto* p = static_cast<unsigned char*>(data);
    while (n != 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        raise_errno("reading", path_, errno);
      }
      if (r == 0) {
        throw format_error(shardkit::detail::concat("'", path_, "' is truncated: ", n,
                                                    " bytes missing at byte ", offset));
      }
      p += r;
      n -= static_cast<std::size_t>(r);
      offset += static_cast<std::uint64_t>(r);
    }
  }
  //! The file's size in bytes.
  std::uint64_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) raise_errno("inspecting", path_, errno);
    return static_cast<std::uint64_t>(st.st_size);
  }
  //! Sets the file's size (preallocating a file to be written at offsets).
  void resize(std::uint64_t bytes) {
    if (int e = detail::injected("write", path_)) raise_errno("sizing", path_, e);
    if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) raise_errno("sizing", path_, errno);
  }
  //! Flushes the file's data and metadata to storage.
  void sync() {
    if (int e = detail::injected("sync", path_)) raise_errno("syncing", path_, e);
    if (::fsync(fd_) != 0) raise_errno("syncing", path_, errno);
  }
  //! Closes now, reporting errors (a deferred write error can surface here).
  void close() {
    if (fd_ < 0) return;
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) raise_errno("closing", path_, errno);
  }

 private:
  file(std::string path, int fd, const char* what) : fd_(fd), path_(std::move(path)) {
    if (fd_ < 0) raise_errno(what, path_, errno);
  }
  int fd_ = -1;
  std::string path_;
};

//! True when `path` exists (file or directory).
inline bool exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

//! Creates directory `path` (its parent must exist).
inline void make_directory(const std::string& path) {
  if (int e = detail::injected("mkdir", path)) raise_errno("creating directory", path, e);
  if (::mkdir(path.c_str(), 0755) != 0) raise_errno("creating directory", path, errno);
}

//! Creates directory `path` and any missing parents (nothing when it exists).
inline void make_directories(const std::string& path) {
  if (path.empty() || path == "." || exists(path)) return;
  if (int e = detail::injected("mkdir", path)) raise_errno("creating directory", path, e);
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) raise_errno("creating directory", path, ec.value());
}

//! Removes `path` and everything below it (nothing when it does not exist).
inline void remove_all(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) raise_errno("removing", path, ec.value());
}

//! Flushes a directory's entries (a created, renamed or removed name) to storage.
inline void sync_directory(const std::string& path) {
  if (int e = detail::injected("sync", path)) raise_errno("syncing directory", path, e);
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) raise_errno("opening directory", path, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) raise_errno("syncing directory", path, err);
}

//! The directory holding `path` ("." when it has none).
inline std::string parent_of(const std::string& path) {
  const auto p = std::filesystem::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

//! Renames `from` to `to` atomically (a file, or a directory onto a path that does not exist).
inline void rename_path(const std::string& from, const std::string& to) {
  if (int e = detail::injected("rename", to)) raise_errno("renaming to", to, e);
  if (::rename(from.c_str(), to.c_str()) != 0) {
    const int err = errno;
    throw io_error(shardkit::detail::concat("renaming '", from, "' to '", to,
                                            "' failed: ", std::strerror(err)));
  }
}

//! Puts directory `from` in the place of `to` atomically: a plain rename when `to` does not
//! exist; otherwise the two are exchanged in one step (renameat2 RENAME_EXCHANGE, Linux), so at
//! every moment `to` is either the old or the new directory, and the old one is then removed
//! from `from`. Syncs the parent directory.
inline void replace_directory(const std::string& from, const std::string& to) {
  if (!exists(to)) {
    rename_path(from, to);
  } else {
    if (int e = detail::injected("rename", to)) raise_errno("replacing", to, e);
#if defined(__linux__) && defined(RENAME_EXCHANGE)
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) != 0) {
      const int err = errno;
      throw io_error(shardkit::detail::concat("exchanging '", from, "' with '", to,
                                              "' failed: ", std::strerror(err)));
    }
#else
    throw io_error(shardkit::detail::concat("replacing '", to,
                                            "' needs an atomic directory exchange, which this "
                                            "platform lacks; save to a new directory"));
#endif
  }
  sync_directory(parent_of(to));
  if (exists(from)) remove_all(from);  // the old checkpoint, now at the temporary name
}

}  // namespace io
SHARDKIT_NAMESPACE_END
