// The flat layout: shard sizes, padding, offsets and the per-rank pieces of every parameter.
#include <shardkit/core/layout.hpp>

#include <catch2/catch.hpp>

#include <numeric>
#include <vector>

using namespace shardkit;

namespace {
// Every element of every parameter belongs to exactly one piece of exactly one rank, and the
// pieces agree with the layout's offsets.
void check_cover(const flat_layout& L) {
  std::vector<std::vector<int>> owner(L.num_params());
  for (std::size_t i = 0; i < L.num_params(); ++i) owner[i].assign(L.param(i).numel, -1);
  std::vector<int> shard_used(L.shard_numel() * L.ranks(), 0);
  for (std::size_t r = 0; r < L.ranks(); ++r) {
    std::size_t prev_end = 0;
    for (const auto& pc : L.pieces(r)) {
      REQUIRE(pc.rank == static_cast<int>(r));
      REQUIRE(pc.shard_offset >= prev_end);  // in shard order
      prev_end = pc.shard_offset + pc.count;
      REQUIRE(prev_end <= L.shard_numel());
      const auto& p = L.param(pc.param);
      REQUIRE(pc.full_offset == p.offset + pc.param_offset);
      const auto& g = L.group(p.group);
      // the piece lies inside rank r's slice of the group
      REQUIRE(pc.full_offset >= g.offset + r * g.shard);
      REQUIRE(pc.full_offset + pc.count <= g.offset + (r + 1) * g.shard);
      REQUIRE(pc.shard_offset == g.shard_offset + (pc.full_offset - g.offset - r * g.shard));
      for (std::size_t k = 0; k < pc.count; ++k) {
        REQUIRE(owner[pc.param][pc.param_offset + k] == -1);
        owner[pc.param][pc.param_offset + k] = static_cast<int>(r);
        REQUIRE(shard_used[r * L.shard_numel() + pc.shard_offset + k]++ == 0);
      }
    }
  }
  for (std::size_t i = 0; i < L.num_params(); ++i) {
    for (int o : owner[i]) REQUIRE(o >= 0);
    // pieces_of agrees with pieces
    std::size_t pos = 0;
    for (const auto& pc : L.pieces_of(i)) {
      REQUIRE(pc.param_offset == pos);
      for (std::size_t k = 0; k < pc.count; ++k) REQUIRE(owner[i][pos + k] == pc.rank);
      pos += pc.count;
    }
    REQUIRE(pos == L.param(i).numel);
  }
}
}  // namespace

TEST_CASE("single group: S = ceil(psi / N), padding at the end", "[layout]") {
  const std::vector<std::size_t> sizes{5, 0, 13, 1, 64, 3, 0, 7};  // psi = 93
  for (std::size_t n : {1u, 2u, 3u, 4u, 7u, 8u, 100u}) {
    const auto L = flat_layout::single_group(sizes, n);
    CAPTURE(n);
    REQUIRE(L.numel() == 93);
    REQUIRE(L.shard_numel() == (93 + n - 1) / n);
    REQUIRE(L.padded_numel() == n * L.shard_numel());
    REQUIRE(L.padding() == L.padded_numel() - 93);
    REQUIRE(L.num_groups() == 1);
    std::size_t off = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      REQUIRE(L.param(i).offset == off);
      off += sizes[i];
    }
    check_cover(L);
  }
}

TEST_CASE("docs/accounting.md: MLP 64-256-10 on 4 ranks has S = 4,803", "[layout][facts]") {
  const std::vector<std::size_t> sizes{64 * 256, 256, 256 * 10, 10};
  const auto L = flat_layout::single_group(sizes, 4);
  REQUIRE(L.numel() == 19'210);
  REQUIRE(L.shard_numel() == 4'803);
  REQUIRE(12 * L.shard_numel() == 57'636);  // fp32 master + m + v per rank
  REQUIRE(12 * L.numel() == 230'520);       // unsharded
  check_cover(L);
}

TEST_CASE("alignment rounds every rank's slice up", "[layout]") {
  const std::vector<std::size_t> sizes{10, 7};
  const auto L = flat_layout::single_group(sizes, 3, 4);  // ceil(17/3) = 6 -> 8
  REQUIRE(L.shard_numel() == 8);
  REQUIRE(L.padded_numel() == 24);
  REQUIRE(L.shard_range(2, 0) == index_range{16, 8});
  check_cover(L);
}

namespace {
// The pieces of parameter i, as {rank, param_offset, shard_offset, full_offset, count} rows.
std::vector<std::vector<std::size_t>> rows_of(const flat_layout& L, std::size_t i) {
  std::vector<std::vector<std::size_t>> rows;
  for (const auto& pc : L.pieces_of(i)) {
    REQUIRE(pc.param == i);
    rows.push_back({static_cast<std::size_t>(pc.rank), pc.param_offset, pc.shard_offset,
                    pc.full_offset, pc.count});
  }
  return rows;
}
using rows = std::vector<std::vector<std::size_t>>;
}  // namespace

TEST_CASE("pieces_of: offsets worked out by hand", "[layout]") {
  SECTION("one group of {10, 7} on 3 ranks, alignment 4: S = 8, full buffer 24") {
    // Rank r owns [8r, 8r + 8) of the full buffer; parameter 1 starts at element 10.
    const auto L = flat_layout::single_group(std::vector<std::size_t>{10, 7}, 3, 4);
    //                 rank  param_off  shard_off  full_off  count
    CHECK(rows_of(L, 0) == rows{{0, 0, 0, 0, 8}, {1, 8, 0, 8, 2}});
    CHECK(rows_of(L, 1) == rows{{1, 0, 2, 10, 6}, {2, 6, 0, 16, 1}});
  }
  SECTION("groups {3} and {5, 4} on 2 ranks: S_0 = 2, S_1 = 5, shards concatenated") {
    // Group 0 takes full elements [0, 4) and shard elements [0, 2); group 1 full [4, 14) and
    // shard [2, 7). Parameter 1 fills rank 0's slice of group 1, parameter 2 rank 1's.
    const flat_layout L(std::vector<std::size_t>{3, 5, 4}, std::vector<std::size_t>{0, 1}, 2);
    CHECK(rows_of(L, 0) == rows{{0, 0, 0, 0, 2}, {1, 2, 0, 2, 1}});
    CHECK(rows_of(L, 1) == rows{{0, 0, 2, 4, 5}});
    CHECK(rows_of(L, 2) == rows{{1, 0, 2, 9, 4}});
  }
}

TEST_CASE("groups: each padded on its own, shards concatenated", "[layout]") {
  const std::vector<std::size_t> sizes{5, 0, 13, 1, 64, 3, 0, 7};
  const std::vector<std::size_t> starts{0, 2, 4, 7};
  for (std::size_t n : {1u, 2u, 3u, 8u}) {
    CAPTURE(n);
    const flat_layout L(sizes, starts, n);
    REQUIRE(L.num_groups() == 4);
    const std::size_t psi_g[] = {5, 14, 67, 7};
    std::size_t shard = 0, full = 0;
    for (std::size_t g = 0; g < 4; ++g) {
      const auto& e = L.group(g);
      REQUIRE(e.numel == psi_g[g]);
      REQUIRE(e.shard == (psi_g[g] + n - 1) / n);
      REQUIRE(e.shard_offset == shard);
      REQUIRE(e.offset == full);
      REQUIRE(e.padded == n * e.shard);
      shard += e.shard;
      full += e.padded;
    }
    REQUIRE(L.shard_numel() == shard);
    REQUIRE(L.padded_numel() == full);
    check_cover(L);
  }
}

TEST_CASE("buckets close from the last parameter backwards", "[layout]") {
  const std::vector<std::size_t> sizes{4, 4, 4, 4, 4};
  const auto L = flat_layout::bucketed(sizes, 2, 8);
  REQUIRE(L.num_groups() == 3);  // {0}, {1, 2}, {3, 4}
  REQUIRE(L.group(0).first_param == 0);
  REQUIRE(L.group(1).first_param == 1);
  REQUIRE(L.group(2).first_param == 3);
  REQUIRE(flat_layout::bucketed(sizes, 2, 0).num_groups() == 1);
  REQUIRE(flat_layout::bucketed(sizes, 2, 1).num_groups() == 5);
  check_cover(L);
}

TEST_CASE("N larger than the number of elements, empty models, zero-size parameters", "[layout]") {
  const std::vector<std::size_t> tiny{1, 0, 2};
  const auto L = flat_layout::single_group(tiny, 8);
  REQUIRE(L.shard_numel() == 1);
  REQUIRE(L.padded_numel() == 8);
  for (std::size_t r = 3; r < 8; ++r) REQUIRE(L.pieces(r).empty());
  check_cover(L);

  const auto E = flat_layout::single_group(std::vector<std::size_t>{}, 4);
  REQUIRE(E.numel() == 0);
  REQUIRE(E.shard_numel() == 0);
  REQUIRE(E.pieces(3).empty());

  const auto Z = flat_layout::single_group(std::vector<std::size_t>{0, 0}, 3);
  REQUIRE(Z.padded_numel() == 0);
  REQUIRE(Z.pieces_of(1).empty());
}

TEST_CASE("bad layouts are rejected with a message", "[layout][errors]") {
  const std::vector<std::size_t> sizes{1, 2, 3};
  REQUIRE_THROWS_WITH(flat_layout::single_group(sizes, 0),
                      Catch::Contains("ranks must be at least 1"));
  REQUIRE_THROWS_WITH(flat_layout::single_group(sizes, 2, 0), Catch::Contains("alignment"));
  REQUIRE_THROWS_WITH(flat_layout(sizes, std::vector<std::size_t>{1}, 2),
                      Catch::Contains("first group must start at parameter 0"));
  REQUIRE_THROWS_WITH(flat_layout(sizes, std::vector<std::size_t>{0, 2, 2}, 2),
                      Catch::Contains("strictly increasing"));
  REQUIRE_THROWS_WITH(flat_layout(sizes, std::vector<std::size_t>{0, 3}, 2),
                      Catch::Contains("strictly increasing"));
  const auto L = flat_layout::single_group(sizes, 2);
  REQUIRE_THROWS_AS(L.param(3), invalid_argument);
  REQUIRE_THROWS_AS(L.pieces(2), invalid_argument);
}
