// Byte serialisation of rank-function results, so that a World whose ranks live in separate
// processes (mpi_world) can hand every rank's result to every rank. Supported: trivially
// copyable types (numbers, bf16, plain structs such as plan::state_bytes), std::string,
// std::vector, std::pair and std::tuple of supported types, and structs that list their members
// with a free function `fields(T&)` returning std::tie(...) (found by argument-dependent lookup).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace test::serial {

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};

template <class T>
struct is_tuple : std::false_type {};
template <class... Ts>
struct is_tuple<std::tuple<Ts...>> : std::true_type {};
template <class A, class B>
struct is_tuple<std::pair<A, B>> : std::true_type {};

template <class T>
concept has_fields = requires(T& t) {
  fields(t);
};

template <class T>
void write(std::string& out, const T& v);
template <class T>
void read(const char*& p, const char* end, T& v);

template <class T>
void write(std::string& out, const T& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    write(out, static_cast<std::uint64_t>(v.size()));
    out.append(v);
  } else if constexpr (is_vector<T>::value) {
    static_assert(!std::is_same_v<T, std::vector<bool>>, "serial: std::vector<bool> unsupported");
    write(out, static_cast<std::uint64_t>(v.size()));
    for (const auto& x : v) write(out, x);
  } else if constexpr (is_tuple<T>::value) {
    std::apply([&](const auto&... x) { (write(out, x), ...); }, v);
  } else if constexpr (has_fields<T>) {
    auto refs = fields(const_cast<T&>(v));
    std::apply([&](const auto&... x) { (write(out, x), ...); }, refs);
  } else {
    static_assert(std::is_trivially_copyable_v<T> && !std::is_pointer_v<T>,
                  "serial: a World result must be a number, a trivially copyable struct, "
                  "std::string, std::vector, std::pair/std::tuple of those, or a struct with "
                  "fields(T&) returning std::tie(members...)");
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
}

template <class T>
void read(const char*& p, const char* end, T& v) {
  auto need = [&](std::size_t n) {
    if (static_cast<std::size_t>(end - p) < n) throw std::runtime_error("serial: truncated data");
  };
  if constexpr (std::is_same_v<T, std::string>) {
    std::uint64_t n = 0;
    read(p, end, n);
    need(n);
    v.assign(p, n);
    p += n;
  } else if constexpr (is_vector<T>::value) {
    std::uint64_t n = 0;
    read(p, end, n);
    v.clear();
    v.resize(n);
    for (auto& x : v) read(p, end, x);
  } else if constexpr (is_tuple<T>::value) {
    std::apply([&](auto&... x) { (read(p, end, x), ...); }, v);
  } else if constexpr (has_fields<T>) {
    auto refs = fields(v);
    std::apply([&](auto&... x) { (read(p, end, x), ...); }, refs);
  } else {
    need(sizeof(T));
    std::memcpy(static_cast<void*>(&v), p, sizeof(T));
    p += sizeof(T);
  }
}

//! The bytes of `v`.
template <class T>
std::string encode(const T& v) {
  std::string out;
  write(out, v);
  return out;
}

//! The value encoded in `bytes` (which must hold exactly one value of type T).
template <class T>
T decode(const std::string& bytes) {
  T v{};
  const char* p = bytes.data();
  read(p, bytes.data() + bytes.size(), v);
  if (p != bytes.data() + bytes.size()) throw std::runtime_error("serial: trailing bytes");
  return v;
}

}  // namespace test::serial
