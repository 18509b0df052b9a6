// Sharded checkpoints (include/shardkit/io/checkpoint.hpp), written once over every World:
// bit-exact resume at every stage (with loss scaling and micro-batches), resharding to other
// world sizes and stages (with and without hybrid sharding), asynchronous saves, crash safety at
// every moment of a save, a full disk and a read-only directory, and damaged or foreign
// checkpoints, each a clear error on every rank.
#include <shardkit/io/checkpoint.hpp>
#include <shardkit/io/manifest.hpp>

#include "io/ckpt_harness.hpp"
#include "support/world.hpp"

#include <catch2/catch.hpp>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

using namespace shardkit;

namespace {

template <class World, class P, class W>
void resume_is_exact(int n, ckpt::config cfg, const std::string& dir) {
  // Uninterrupted: four steps.
  ckpt::config whole = cfg;
  whole.steps = 4;
  const auto a = ckpt::run<World, P, W>(n, whole);
  // Two steps, save, a new engine, load, two more.
  ckpt::config first = cfg;
  first.steps = 2;
  first.save_dir = dir;
  (void)ckpt::run<World, P, W>(n, first);
  ckpt::config second = cfg;
  second.first_step = 3;
  second.steps = 2;
  second.load_dir = dir;
  const auto b = ckpt::run<World, P, W>(n, second);
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r);
    REQUIRE(a[r].failure == "");
    REQUIRE(b[r].failure == "");
    CHECK(b[r].step == 4);
    CHECK(b[r].notes.empty());
    CHECK(b[r].pieces == a[r].pieces);
    CHECK(b[r].kinds == a[r].kinds);      // master and both Adam moments, bit for bit
    CHECK(b[r].working == a[r].working);  // the working copy
    CHECK(b[r].scale_bits == a[r].scale_bits);
  }
}

// Saves with `from` (N ranks, stage of P) and loads with `to` (M ranks, stage of Q): the whole
// model of every kind must be the same bits.
template <class World, class P, class Q>
void reshard_is_exact(int n, std::size_t g_from, int m, std::size_t g_to, const std::string& dir) {
  ckpt::config save;
  save.steps = 3;
  save.loss_scaling = true;
  save.shard_group_size = g_from;
  save.save_dir = dir;
  const auto saved = ckpt::run<World, P, bf16>(n, save);
  ckpt::config load;
  load.steps = 0;
  load.shard_group_size = g_to;
  load.load_dir = dir;
  load.loss_scaling = true;
  const auto loaded = ckpt::run<World, Q, bf16>(m, load);
  const auto a = ckpt::assemble(saved, save.sizes);
  const auto b = ckpt::assemble(loaded, load.sizes);
  REQUIRE(a.failure == "");
  REQUIRE(b.failure == "");
  CHECK(b.kinds == a.kinds);
  CHECK(b.working == a.working);
  for (const auto& d : loaded) {
    CHECK(d.step == 3);
    CHECK(d.scale_bits == saved[0].scale_bits);
  }
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// Every rank's error message when loading `dir` into a fresh engine (all must fail).
template <class World>
std::vector<std::string> load_errors(int n, const std::string& dir, ckpt::config cfg = {}) {
  cfg.steps = 0;
  cfg.load_dir = dir;
  try {
    (void)ckpt::run<World, zero2, bf16>(n, cfg);
  } catch (const group_error& e) {
    std::vector<std::string> msgs;
    for (const auto& f : e.failures()) msgs.push_back(f.message);
    return msgs;
  }
  return {};
}

}  // namespace

TEMPLATE_TEST_CASE("resume from a checkpoint continues bit for bit at every stage",
                   "[io][checkpoint]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  const int n = GENERATE(1, 3, 4);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n);
  ckpt::config cfg;
  SECTION("bf16, loss scaling, two micro-batches") {
    cfg.loss_scaling = true;
    cfg.micro_batches = 2;
    const std::string dir = ckpt::test_dir<World>("resume-bf16-" + std::to_string(n));
    resume_is_exact<World, zero0, bf16>(n, cfg, dir + "-0");
    resume_is_exact<World, zero1, bf16>(n, cfg, dir + "-1");
    resume_is_exact<World, zero2, bf16>(n, cfg, dir + "-2");
    resume_is_exact<World, zero3, bf16>(n, cfg, dir + "-3");
  }
  SECTION("fp32 (no master: the working values are saved)") {
    const std::string dir = ckpt::test_dir<World>("resume-fp32-" + std::to_string(n));
    resume_is_exact<World, zero1, float>(n, cfg, dir + "-1");
    resume_is_exact<World, zero3, float>(n, cfg, dir + "-3");
  }
  SECTION("hybrid sharding, 2 x 2") {
    if (n != 4) return;
    cfg.shard_group_size = 2;
    cfg.loss_scaling = true;
    const std::string dir = ckpt::test_dir<World>("resume-hybrid");
    resume_is_exact<World, zero2, bf16>(n, cfg, dir + "-2");
    resume_is_exact<World, zero3, bf16>(n, cfg, dir + "-3");
  }
}

TEMPLATE_TEST_CASE("a checkpoint loads onto another world size and stage, every value exact",
                   "[io][checkpoint][reshard]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  CAPTURE(World::name);
  const std::string dir = ckpt::test_dir<World>("reshard");
  if (test::fits<World>(4)) {
    reshard_is_exact<World, zero2, zero3>(4, 0, 3, 0, dir + "-a");  // fewer ranks, not a divisor
    reshard_is_exact<World, zero3, zero1>(2, 0, 4, 0, dir + "-b");  // more ranks
    reshard_is_exact<World, zero1, zero0>(3, 0, 2, 0, dir + "-c");  // to stage 0
    reshard_is_exact<World, zero0, zero2>(1, 0, 4, 0, dir + "-d");  // from stage 0, one rank
    reshard_is_exact<World, zero3, zero2>(4, 2, 3, 0, dir + "-e");  // from hybrid 2 x 2
    reshard_is_exact<World, zero1, zero3>(2, 0, 4, 2, dir + "-f");  // to hybrid 2 x 2
  }
  if (test::fits<World>(7)) {
    reshard_is_exact<World, zero3, zero2>(4, 0, 7, 0, dir + "-g");
    reshard_is_exact<World, zero2, zero3>(7, 0, 5, 0, dir + "-h");
  }
}

TEMPLATE_TEST_CASE("an asynchronous save holds the state of its start while training goes on",
                   "[io][checkpoint][async]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  if (!test::fits<World>(3)) return;
  const std::string dir = ckpt::test_dir<World>("async");
  ckpt::config two;
  two.steps = 2;
  const auto reference = ckpt::run<World, zero3, bf16>(3, two);
  ckpt::config save = two;
  save.save_dir = dir;
  save.async_save = true;
  save.steps_during_save = 2;
  const auto went_on = ckpt::run<World, zero3, bf16>(3, save);
  ckpt::config load;
  load.steps = 0;
  load.load_dir = dir;
  const auto loaded = ckpt::run<World, zero3, bf16>(3, load);
  for (int r = 0; r < 3; ++r) {
    CHECK(went_on[r].step == 4);
    CHECK(loaded[r].step == 2);
    CHECK(loaded[r].kinds == reference[r].kinds);
    CHECK(loaded[r].working == reference[r].working);
    CHECK(loaded[r].kinds != went_on[r].kinds);
  }
}

TEMPLATE_TEST_CASE(
    "a full disk or a read-only directory fails the save on every rank, the "
    "previous checkpoint intact",
    "[io][checkpoint][faults]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  if (!test::fits<World>(3)) return;
  const std::string dir = ckpt::test_dir<World>("faults");
  ckpt::config first;
  first.steps = 1;
  first.save_dir = dir;
  const auto before = ckpt::run<World, zero2, bf16>(3, first);
  struct fault {
    const char* op;
    const char* file;
    int err;
    const char* expect;
  };
  const fault cases[] = {
      {"write", "rank-00002.bin", ENOSPC, "rank 2"},          // a full disk on one rank
      {"mkdir", ".partial", EROFS, "Read-only file system"},  // a read-only directory
      {"sync", "manifest.json", EIO, "manifest.json"},
      {"rename", "faults", ENOSPC, "No space left"},
  };
  for (const auto& f : cases) {
    CAPTURE(f.op, f.file);
    io::detail::fault_injector() = [&](std::string_view op, const std::string& path) {
      return op == f.op && path.find(f.file) != std::string::npos ? f.err : 0;
    };
    ckpt::config again;
    again.steps = 3;
    again.save_dir = dir;
    std::vector<std::string> msgs;
    try {
      (void)ckpt::run<World, zero2, bf16>(3, again);
    } catch (const group_error& e) {
      for (const auto& x : e.failures()) msgs.push_back(x.message);
    }
    io::detail::fault_injector() = nullptr;
    REQUIRE(msgs.size() == 3);  // every rank raised
    for (const auto& m : msgs) {
      CHECK_THAT(m, Catch::Contains("checkpoint save to '" + dir) && Catch::Contains(f.expect) &&
                        Catch::Contains("unchanged"));
    }
    CHECK_FALSE(std::filesystem::exists(dir + ".partial"));
    // The previous checkpoint still loads, and holds the first save's state.
    ckpt::config load;
    load.steps = 0;
    load.load_dir = dir;
    const auto after = ckpt::run<World, zero2, bf16>(3, load);
    for (int r = 0; r < 3; ++r) {
      CHECK(after[r].step == 1);
      CHECK(after[r].kinds == before[r].kinds);
    }
  }
}

#if !defined(SHARDKIT_TEST_MPI)  // forks: not inside an MPI process
TEST_CASE("a crash at any moment of a save leaves the newest complete checkpoint loadable",
          "[io][checkpoint][crash]") {
  // Each crash is a real one: a child process runs the save on thread ranks and ends itself
  // (_exit) at one moment, without unwinding or cleaning up.
  const std::string dir = ckpt::test_dir<test::thread_world>("crash");
  ckpt::config first;
  first.steps = 1;
  first.save_dir = dir;
  const auto old_state = ckpt::run<test::thread_world, zero3, bf16>(2, first);
  ckpt::config newer = first;
  newer.steps = 2;
  newer.save_dir = "";
  const auto new_state = ckpt::run<test::thread_world, zero3, bf16>(2, newer);
  for (const char* moment : {"partial directory created", "rank file written", "manifest written",
                             "before replace", "after replace"}) {
    CAPTURE(moment);
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      ckpt::config crash = newer;
      crash.save_dir = dir;
      crash.on_moment = [moment](std::string_view m) {
        if (m == moment) _exit(17);
      };
      try {
        (void)ckpt::run<test::thread_world, zero3, bf16>(2, crash);
      } catch (...) {
      }
      _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 17);  // it died at that moment
    ckpt::config load;
    load.steps = 0;
    load.load_dir = dir;
    const auto now = ckpt::run<test::thread_world, zero3, bf16>(2, load);
    const bool replaced = std::string(moment) == "after replace";
    for (int r = 0; r < 2; ++r) {
      CHECK(now[r].step == (replaced ? 2u : 1u));
      CHECK(now[r].kinds == (replaced ? new_state[r].kinds : old_state[r].kinds));
    }
    // A later save cleans up after the crash and succeeds.
    ckpt::config redo = first;
    (void)ckpt::run<test::thread_world, zero3, bf16>(2, redo);
    CHECK_FALSE(std::filesystem::exists(dir + ".partial"));
  }
}
#endif

TEMPLATE_TEST_CASE("a damaged, foreign or future checkpoint is a clear error on every rank",
                   "[io][checkpoint][errors]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  if (!test::fits<World>(2)) return;
  const std::string dir = ckpt::test_dir<World>("damaged");
  auto fresh = [&] {
    ckpt::config c;
    c.steps = 1;
    c.save_dir = dir;
    (void)ckpt::run<World, zero2, bf16>(2, c);
  };
  auto expect_all = [&](const std::vector<std::string>& msgs, const std::string& a,
                        const std::string& b) {
    REQUIRE(msgs.size() == 2);
    for (const auto& m : msgs) CHECK_THAT(m, Catch::Contains(a) && Catch::Contains(b));
  };
  const std::string rank1 = dir + "/rank-00001.bin";
  SECTION("a truncated rank file") {
    fresh();
    ckpt::once<World>(
        [&] { std::filesystem::resize_file(rank1, std::filesystem::file_size(rank1) - 7); });
    expect_all(load_errors<World>(2, dir), "rank-00001.bin", "footer");
  }
  SECTION("a flipped byte in a rank file's data") {
    fresh();
    ckpt::once<World>([&] {
      std::string bytes = read_text(rank1);
      bytes[3] = static_cast<char>(bytes[3] ^ 0x10);
      write_text(rank1, bytes);
    });
    expect_all(load_errors<World>(2, dir), "rank-00001.bin", "does not match its checksum");
  }
  SECTION("a flipped byte in the manifest") {
    fresh();
    ckpt::once<World>([&] {
      std::string text = read_text(dir + "/manifest.json");
      const auto at = text.find("\"step\": 1");
      if (at == std::string::npos) throw std::runtime_error("no step in the manifest");
      text[at + 8] = '7';
      write_text(dir + "/manifest.json", text);
    });
    expect_all(load_errors<World>(2, dir), "manifest.json", "does not match its checksum");
  }
  SECTION("a missing rank file") {
    fresh();
    ckpt::once<World>([&] { std::filesystem::remove(rank1); });
    expect_all(load_errors<World>(2, dir), "is missing 'rank-00001.bin'", "written by rank 1");
  }
  SECTION("a future format version") {
    fresh();
    ckpt::once<World>([&] {
      auto m = io::read_manifest(dir);
      m.version = 2;
      write_text(dir + "/manifest.json", io::to_json(m));
    });
    expect_all(load_errors<World>(2, dir), "format version 2", "newer shardkit");
  }
  SECTION("a checkpoint of another model, or of other shapes") {
    fresh();
    ckpt::config other;
    other.sizes = {5, 0, 13, 1, 64, 3, 0, 8};  // the last parameter is one element longer
    expect_all(load_errors<World>(2, dir, other), "another model",
               "parameter #7 is 'p7' [7], the engine's is 'p7' [8]");
    ckpt::config fewer;
    fewer.sizes = {5, 0, 13};
    fewer.units = {0};
    expect_all(load_errors<World>(2, dir, fewer), "holds 8 parameters", "has 3");
  }
  SECTION("a directory that is not a checkpoint") {
    ckpt::once<World>([&] {
      std::filesystem::remove_all(dir);
      std::filesystem::create_directories(dir);
    });
    expect_all(load_errors<World>(2, dir), "is not a shardkit checkpoint", "no manifest.json");
    ckpt::once<World>([&] { std::filesystem::remove_all(dir); });
    expect_all(load_errors<World>(2, dir), "does not exist", dir);
  }
}
