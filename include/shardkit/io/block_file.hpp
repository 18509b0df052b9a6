//! \file io/block_file.hpp
//! A data file whose every block carries a checksum, so that a reader that reads only some
//! ranges (a rank loading its new shard from another world size's files) verifies exactly what
//! it reads. Layout (little-endian):
//!
//!     data: data_bytes bytes, in blocks of block_bytes (the last one may be shorter)
//!     table: one XXH64 per block (block_count × 8 bytes)
//!     footer (48 bytes): "SKBLK001", block_bytes, data_bytes, block_count, XXH64 of the table,
//!                        XXH64 of the footer's first 40 bytes
//!
//! The writer streams (append), the reader reads any byte range (read) or the whole file
//! (verify). A file whose size, footer, table or a block does not check raises format_error
//! naming the file and what is wrong.
#pragma once

#include <shardkit/config.hpp>
#include <shardkit/core/error.hpp>
#include <shardkit/io/checksum.hpp>
#include <shardkit/io/file.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

SHARDKIT_NAMESPACE_BEGIN
namespace io {

static_assert(std::endian::native == std::endian::little,
              "shardkit's file formats are little-endian, as the host must be");

//! What a finished block file is.
struct block_file_info {
  std::uint64_t data_bytes = 0;
  std::uint64_t file_bytes = 0;
  std::uint64_t xxh64 = 0;  //!< of the whole file, data, table and footer
};

inline constexpr char block_file_magic[9] = "SKBLK001";
inline constexpr std::size_t block_file_footer_bytes = 48;

class block_file_writer {
 public:
  //! Creates `path` (replacing a file of that name).
  explicit block_file_writer(const std::string& path, std::size_t block_bytes = 1 << 20)
      : file_(file::create(path)), block_bytes_(block_bytes) {
    if (block_bytes == 0) shardkit::detail::raise("block_file_writer: block size 0");
    buffer_.reserve(std::max<std::size_t>(block_bytes, 4 << 20));
  }

  //! Appends `n` bytes.
  void append(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    while (n != 0) {
      const std::size_t room = block_bytes_ - in_block_;
      const std::size_t take = std::min(room, n);
      block_.update(p, take);
      buffer_.insert(buffer_.end(), p, p + take);
      in_block_ += take;
      p += take;
      n -= take;
      if (in_block_ == block_bytes_) end_block();
      if (buffer_.size() >= buffer_.capacity() - block_bytes_) flush();
    }
  }
  std::uint64_t bytes_written() const noexcept { return data_bytes_ + buffer_.size(); }

  //! Writes the table and footer, syncs and closes the file.
  block_file_info finish() {
    if (in_block_ != 0) end_block();
    flush();
    std::vector<unsigned char> tail(table_.size() * 8 + block_file_footer_bytes);
    if (!table_.empty()) std::memcpy(tail.data(), table_.data(), table_.size() * 8);  // (no data)
    unsigned char* f = tail.data() + table_.size() * 8;
    std::memcpy(f, block_file_magic, 8);
    const std::uint64_t fields[4] = {block_bytes_, data_bytes_, table_.size(),
                                     xxh64(table_.data(), table_.size() * 8)};
    std::memcpy(f + 8, fields, sizeof fields);
    const std::uint64_t self = xxh64(f, 40);
    std::memcpy(f + 40, &self, 8);
    file_.write_at(tail.data(), tail.size(), data_bytes_);
    whole_.update(tail.data(), tail.size());
    file_.sync();
    file_.close();
    return {data_bytes_, data_bytes_ + tail.size(), whole_.digest()};
  }

 private:
  void end_block() {
    table_.push_back(block_.digest());
    block_ = xxh64_stream();
    in_block_ = 0;
  }
  void flush() {
    if (buffer_.empty()) return;
    file_.write_at(buffer_.data(), buffer_.size(), data_bytes_);
    whole_.update(buffer_.data(), buffer_.size());
    data_bytes_ += buffer_.size();
    buffer_.clear();
  }

  file file_;
  std::size_t block_bytes_;
  std::vector<unsigned char> buffer_;
  std::vector<std::uint64_t> table_;
  xxh64_stream block_, whole_;
  std::size_t in_block_ = 0;
  std::uint64_t data_bytes_ = 0;
};

class block_file_reader {
 public:
  //! Opens `path` and checks its size, footer and table (not the data: read() checks the blocks
  //! it reads, verify() all of them).
  explicit block_file_reader(const std::string& path) : file_(file::open_read(path)) {
    const std::uint64_t size = file_.size();
    if (size < block_file_footer_bytes) bad("is shorter than a block file's footer");
    unsigned char f[block_file_footer_bytes];
    file_.read_at(f, sizeof f, size - sizeof f);
    if (std::memcmp(f, block_file_magic, 8) != 0) bad("does not end with a shardkit block footer");
    std::uint64_t self = 0;
    std::memcpy(&self, f + 40, 8);
    if (xxh64(f, 40) != self) bad("has a corrupt footer (checksum mismatch)");
    std::uint64_t fields[4];
    std::memcpy(fields, f + 8, sizeof fields);
    block_bytes_ = fields[0];
    data_bytes_ = fields[1];
    const std::uint64_t blocks = fields[2];
    // (the block count is computed so that data_bytes_ + block_bytes_ cannot wrap around)
    if (block_bytes_ == 0 ||
        blocks != data_bytes_ / block_bytes_ + (data_bytes_ % block_bytes_ != 0 ? 1 : 0) ||
        blocks > size / 8 || data_bytes_ + blocks * 8 + block_file_footer_bytes != size) {
      bad(shardkit::detail::concat("has an inconsistent footer (", data_bytes_, " data bytes in ",
                                   blocks, " blocks of ", block_bytes_, " for a file of ", size,
                                   " bytes)"));
    }
    table_.resize(blocks);
    file_.read_at(table_.data(), blocks * 8, data_bytes_);
    if (xxh64(table_.data(), blocks * 8) != fields[3]) bad("has a corrupt block table");
  }

  const std::string& path() const noexcept { return file_.path(); }
  std::uint64_t data_bytes() const noexcept { return data_bytes_; }

  //! Bytes [offset, offset + n) of the data, from the blocks that hold them (each verified).
  void read(std::uint64_t offset, std::size_t n, void* out) {
    if (offset > data_bytes_ || n > data_bytes_ - offset) {
      bad(shardkit::detail::concat("holds ", data_bytes_, " data bytes; bytes [", offset, ", ",
                                   offset + n, ") were asked for"));
    }
    auto* o = static_cast<unsigned char*>(out);
    while (n != 0) {
      const std::uint64_t b = offset / block_bytes_;
      load_block(b);
      const std::size_t at = static_cast<std::size_t>(offset - b * block_bytes_);
      const std::size_t take = std::min(n, cached_.size() - at);
      std::memcpy(o, cached_.data() + at, take);
      o += take;
      offset += take;
      n -= take;
    }
  }

  //! Reads every block and checks it; returns the XXH64 of the whole file.
  std::uint64_t verify() {
    xxh64_stream whole;
    for (std::uint64_t b = 0; b < table_.size(); ++b) {
      load_block(b);
      whole.update(cached_.data(), cached_.size());
    }
    const std::uint64_t size = file_.size();
    std::vector<unsigned char> tail(static_cast<std::size_t>(size - data_bytes_));
    file_.read_at(tail.data(), tail.size(), data_bytes_);
    whole.update(tail.data(), tail.size());
    return whole.digest();
  }

 private:
  [[noreturn]] void bad(const std::string& what) const {
    throw format_error(shardkit::detail::concat("'", file_.path(), "' ", what));
  }
  void load_block(std::uint64_t b) {
    if (b == cached_block_) return;
    const std::uint64_t begin = b * block_bytes_;
    const std::size_t len =
        static_cast<std::size_t>(std::min<std::uint64_t>(block_bytes_, data_bytes_ - begin));
    cached_.resize(len);
    file_.read_at(cached_.data(), len, begin);
    if (xxh64(cached_.data(), len) != table_[b]) {
      cached_block_ = ~std::uint64_t{0};
      bad(shardkit::detail::concat("is corrupt: block ", b, " (bytes ", begin, " to ", begin + len,
                                   ") does not match its checksum"));
    }
    cached_block_ = b;
  }

  file file_;
  std::uint64_t block_bytes_ = 0;
  std::uint64_t data_bytes_ = 0;
  std::vector<std::uint64_t> table_;
  std::vector<unsigned char> cached_;
  std::uint64_t cached_block_ = ~std::uint64_t{0};
};

}  // namespace io
SHARDKIT_NAMESPACE_END
