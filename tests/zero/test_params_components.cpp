// The parameter components used alone: replicated_params (stages 0-2: the whole working copy on
// every rank, all-gathered after a step that updated this rank's slices) and shard_params
// (ZeRO-3: a rank keeps its shard, units are gathered around their hooks, prefetched ahead, kept
// or persistent on request). Driven by a user's own hook calls and a user's own "optimizer" that
// writes the shard; checked against values and byte counts computed in the test from the
// specification (docs/accounting.md), the live-byte bound, the prefetch schedule, and misuse on
// every rank. Then ZeRO-3 assembled from shard_params, shard_grads and shard_optimizer against
// the unsharded reference and, bit for bit, ZeRO-1 assembled from its components.
#include "zero/component_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

using namespace shardkit;
using test::comp::checks;
using test::comp::mcase;
using test::comp::spec_layout;

namespace {

// The value a test "optimizer" writes for element k of parameter i after `steps` steps: each
// step the owner adds owner + 1 (in W), starting from the rounded initial value.
template <class W>
W expected_value(std::size_t i, std::size_t k, std::uint64_t owner, int steps) {
  W v = from_float<W>(ref::init_value(i, k));
  for (int s = 0; s < steps; ++s) {
    v = from_float<W>(static_cast<float>(v) + static_cast<float>(owner + 1));
  }
  return v;
}

// replicated_params by hand: load, views, the user's update of this rank's slices, after_step.
template <class W, class Comm>
std::string replicated_by_hand(Comm& c, const mcase& mc, bool one_way, std::size_t align) {
  checks check;
  const int N = c.size(), r = c.rank();
  const auto n = static_cast<std::uint64_t>(N);
  const std::uint64_t w = sizeof(W);
  test::comp::model_values mv(mc);
  const param_registry reg(mv.spec);
  const spec_layout L =
      one_way ? test::comp::make_spec(mc.sizes, {}, 1)
              : test::comp::make_spec(mc.sizes, test::comp::unit_starts(mc), n, align);
  const flat_layout layout = one_way ? flat_layout(mc.sizes, {}, 1)
                                     : flat_layout(mc.sizes, reg.unit_starts(), c.size(), align);
  const std::uint64_t me = one_way ? 0 : static_cast<std::uint64_t>(r);
  memory_ledger mem;
  replicated_params<Comm, W> rp(c, layout, me, reg, &mem);
  check(mem.current(memory_category::working_params) == w * L.padded(), "the working copy holds ",
        mem.current(memory_category::working_params), " bytes; w·", one_way ? "Ψ" : "N·S", " = ",
        w * L.padded());
  for (std::size_t i = 0; i < mc.sizes.size(); ++i) rp.load(i, mv.init[i].data(), dtype::f32);
  rp.start();
  auto working = rp.working();
  check(working.size == L.padded() && working.coords == flat_coords::full,
        "working() is not the full buffer of ", L.padded(), " elements");
  // What every rank must see: the initial values, then each owner's update.
  auto verify = [&](const char* when, int steps, bool only_mine) {
    for (std::size_t u = 0; u < reg.num_units(); ++u) {
      rp.pre_forward(u);  // no-ops: the parameters are always whole
      for (std::size_t i = reg.unit_begin(u); i < reg.unit_end(u); ++i) {
        const auto v = rp.view(i);
        check(v.size() == mc.sizes[i], "view(", i, ") has ", v.size(), " elements");
        for (std::size_t k = 0; k < v.size(); ++k) {
          const std::uint64_t owner = L.owner(i, k);
          const int s = only_mine && owner != me ? steps - 1 : steps;
          check(test::comp::bits_of(v[k]) == test::comp::bits_of(expected_value<W>(i, k, owner, s)),
                when, ": p", i, "[", k, "] = ", static_cast<float>(v[k]), ", expected ",
                static_cast<float>(expected_value<W>(i, k, owner, s)));
          check(v.data() + k == working.data + L.full_offset(i, k), "view(", i,
                ") does not alias the working buffer at element ", k);
        }
      }
      rp.post_forward(u);
      rp.pre_backward(u);
      rp.post_backward(u);
    }
  };
  verify("after load", 0, false);
  for (int step = 1; step <= 2; ++step) {
    // The user's optimizer: this rank's slices only (stage 0: everything).
    for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
        if (L.owner(i, k) != me) continue;
        W& x = working.data[L.full_offset(i, k)];
        x = from_float<W>(static_cast<float>(x) + static_cast<float>(me + 1));
      }
    }
    c.barrier();
    const traffic_ledger before = c.traffic();
    rp.after_step(false);  // a skipped step: nothing is exchanged
    c.barrier();
    check(c.traffic().since(before).total_bytes_sent() == 0, "after_step(false) sent bytes");
    if (!one_way && N > 1) verify("after after_step(false)", step, true);
    rp.after_step(true);
    c.barrier();
    std::uint64_t want = 0;
    if (!one_way) {
      for (const auto& q : L.groups) want += test::comp::rs_or_ag_bytes(q.shard, n, w);
    }
    const std::uint64_t sent = c.traffic().since(before).total_bytes_sent();
    check(sent == want, "after_step(true) sent ", sent, " bytes; Σ (N-1)·S_g·w = ", want);
    verify("after after_step(true)", step, false);
  }
  return check.failure;
}

// shard_params by hand, no persistent or kept units: the exact set of gathered units after every
// hook, the gathers each hook issues (prefetch), views of released and in-flight units refused,
// the user's update of the shard gathered by the next step.
template <class W, class Comm>
std::string shard_params_by_hand(Comm& c, const mcase& mc, std::size_t D, bool reuse) {
  checks check;
  const int N = c.size(), r = c.rank();
  const auto n = static_cast<std::uint64_t>(N);
  const auto me = static_cast<std::uint64_t>(r);
  const std::uint64_t w = sizeof(W);
  test::comp::model_values mv(mc);
  const param_registry reg(mv.spec);
  const spec_layout L = test::comp::make_spec(mc.sizes, test::comp::unit_starts(mc), n);
  const flat_layout layout(mc.sizes, reg.unit_starts(), c.size());
  const std::size_t U = reg.num_units();
  memory_ledger mem;
  shard_params_options o;
  o.prefetch = D;
  o.trace = true;
  o.reuse_buffers = reuse;
  shard_params<Comm, W> sp(c, layout, me, reg, o, &mem);
  for (std::size_t i = 0; i < mc.sizes.size(); ++i) sp.load(i, mv.init[i].data(), dtype::f32);
  check(mem.current(memory_category::working_params) == w * L.S, "the shard holds ",
        mem.current(memory_category::working_params), " bytes; w·S = ", w * L.S);
  check(sp.working().size == L.S && sp.working().coords == flat_coords::shard,
        "working() is not the shard of S = ", L.S, " elements");
  for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
    for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
      if (L.owner(i, k) != me) continue;
      check(test::comp::bits_of(sp.shard()[L.shard_offset(i, k)]) ==
                test::comp::bits_of(expected_value<W>(i, k, me, 0)),
            "load() put p", i, "[", k, "] in the wrong place of the shard");
    }
  }
  sp.start();
  std::uint64_t largest = 0;
  for (const auto& q : L.groups) largest = std::max(largest, n * q.shard);
  const std::uint64_t bound = std::min<std::uint64_t>(1 + D, U) * largest;
  check(sp.live_bound_elems() == bound, "live_bound_elems() = ", sp.live_bound_elems(),
        "; min(1 + D, U)·max N·S_u = ", bound);

  // Bytes of the units [a, b] (a <= b, clipped to the model), gathered at N·S_u each.
  auto window = [&](long a, long b) {
    std::uint64_t e = 0;
    for (long v = std::max(a, 0L); v <= std::min(b, static_cast<long>(U) - 1); ++v) {
      e += n * L.groups[static_cast<std::size_t>(v)].shard;
    }
    return e * w;
  };
  // Bytes of the gathered units: what the ledger holds less the buffers kept for reuse, which
  // must stay within the bound with them (and exist only with reuse).
  auto gathered = [&] {
    const std::uint64_t held = mem.current(memory_category::gathered_params);
    const std::uint64_t spare = w * sp.spare_elems();
    check(held <= bound * w && held >= spare, "the ledger holds ", held, " gathered bytes with ",
          spare, " kept for reuse; the bound is ", bound * w);
    check(reuse || spare == 0, spare, " bytes kept for reuse with reuse_buffers off");
    return held - spare;
  };
  // Units whose gather a hook issued.
  auto issued_since = [&](std::size_t from) {
    std::vector<std::size_t> us;
    const auto& ev = sp.trace().events();
    for (std::size_t e = from; e < ev.size(); ++e) {
      if (ev[e].what == trace_event::kind::gather_issued) us.push_back(ev[e].unit);
    }
    return us;
  };
  auto refuses_view = [&](std::size_t u, const char* when) {
    for (std::size_t i = reg.unit_begin(u); i < reg.unit_end(u); ++i) {
      std::string msg;
      try {
        (void)sp.view(i);
      } catch (const usage_error& e) {
        msg = e.what();
      }
      check(msg.find("shard_params::view(" + std::to_string(i) + "): parameter 'p" +
                     std::to_string(i) + "' belongs to unit 'u" + std::to_string(u) +
                     "', which is not gathered") != std::string::npos,
            when, ": view(", i, ") of unit ", u, " gave '", msg, "'");
    }
  };
  auto views_are = [&](std::size_t u, int steps, const char* when) {
    for (std::size_t i = reg.unit_begin(u); i < reg.unit_end(u); ++i) {
      const auto v = sp.view(i);
      check(v.size() == mc.sizes[i], when, ": view(", i, ") has ", v.size(), " elements");
      for (std::size_t k = 0; k < v.size(); ++k) {
        const W want = expected_value<W>(i, k, L.owner(i, k), steps);
        check(test::comp::bits_of(v[k]) == test::comp::bits_of(want), when, ": p", i, "[", k,
              "] = ", static_cast<float>(v[k]), ", expected ", static_cast<float>(want));
      }
    }
  };

  for (int step = 0; step < 2; ++step) {
    c.barrier();
    const traffic_ledger before = c.traffic();
    const long last = static_cast<long>(U) - 1, d = static_cast<long>(D);
    for (long u = 0; u <= last; ++u) {  // forward, in the declared order
      const auto uu = static_cast<std::size_t>(u);
      const std::size_t mark = sp.trace().events().size();
      sp.pre_forward(uu);
      // The first hook gathers its unit and the next D; later ones prefetch the D-th next.
      std::vector<std::size_t> want_issued;
      for (long v = u == 0 ? 0 : u + d; v <= std::min(u + d, last); ++v) {
        want_issued.push_back(static_cast<std::size_t>(v));
      }
      if (D == 0) want_issued = {uu};
      check(issued_since(mark) == want_issued, "step ", step, ": pre_forward(", u, ") issued ",
            issued_since(mark).size(), " gathers, expected ", want_issued.size());
      check(gathered() == window(u, u + d), "step ", step, ": after pre_forward(", u, ") ",
            gathered(), " bytes are gathered, expected units ", u, "..", u + d, ": ",
            window(u, u + d));
      if (u + 1 <= last && D > 0) refuses_view(uu + 1, "a prefetched unit still in flight");
      views_are(uu, step, "forward");
      sp.post_forward(uu);
      check(gathered() == (u + 1 <= u + d ? window(u + 1, u + d) : 0), "step ", step,
            ": after post_forward(", u, ") ", gathered(), " bytes are gathered");
      refuses_view(uu, "after post_forward");
    }
    for (long u = last; u >= 0; --u) {  // backward, in reverse
      const auto uu = static_cast<std::size_t>(u);
      const std::size_t mark = sp.trace().events().size();
      sp.pre_backward(uu);
      std::vector<std::size_t> want_issued;
      for (long v = u == last ? last : u - d; v >= std::max(u - d, 0L); --v) {
        want_issued.push_back(static_cast<std::size_t>(v));
      }
      if (D == 0) want_issued = {uu};
      check(issued_since(mark) == want_issued, "step ", step, ": pre_backward(", u, ") issued ",
            issued_since(mark).size(), " gathers, expected ", want_issued.size());
      check(gathered() == window(u - d, u), "step ", step, ": after pre_backward(", u, ") ",
            gathered(), " bytes are gathered, expected ", window(u - d, u));
      views_are(uu, step, "backward");
      sp.post_backward(uu);
      refuses_view(uu, "after post_backward");
    }
    check(gathered() == 0, "after the backward ", gathered(), " bytes are still gathered");
    sp.check_idle();
    // The user's optimizer on the shard (shard coordinates): owner adds owner + 1.
    auto shard = sp.working();
    for (std::size_t i = 0; i < mc.sizes.size(); ++i) {
      for (std::size_t k = 0; k < mc.sizes[i]; ++k) {
        if (L.owner(i, k) != me) continue;
        W& x = shard.data[L.shard_offset(i, k)];
        x = from_float<W>(static_cast<float>(x) + static_cast<float>(me + 1));
      }
    }
    check(sp.spare_elems() == 0, "after the backward ", sp.spare_elems(),
          " elements are kept for reuse");
    sp.after_step(true);
    check(mem.current(memory_category::gathered_params) == 0 && sp.spare_elems() == 0,
          "after after_step() ", mem.current(memory_category::gathered_params),
          " gathered bytes are held (", w * sp.spare_elems(), " kept for reuse)");
    c.barrier();
    std::uint64_t want = 0;  // each unit gathered for its forward and for its backward
    for (const auto& q : L.groups) want += 2 * test::comp::rs_or_ag_bytes(q.shard, n, w);
    const std::uint64_t sent = c.traffic().since(before).total_bytes_sent();
    check(sent == want, "step ", step, " sent ", sent, " bytes; Σ 2·(N-1)·S_u·w = ", want);
  }
  // The next forward sees both updates.
  sp.pre_forward(0);
  views_are(0, 2, "after two steps");
  sp.post_forward(0);
  const std::uint64_t peak = mem.peak(memory_category::gathered_params);
  check(peak <= bound * w && peak >= largest * w, "gathered parameters peaked at ", peak,
        " bytes; the bound is ", bound * w, ", the largest unit ", largest * w);
  return check.failure;
}

// shard_params with persistent units (Ψ_u < persist_below) and units kept from forward to
// backward: what stays gathered when, the live bound, and the gathers per step.
template <class W, class Comm>
std::string persistent_and_kept(Comm& c, const mcase& mc, std::size_t persist_below,
                                std::vector<bool> keep, std::size_t D) {
  checks check;
  const int N = c.size();
  const auto n = static_cast<std::uint64_t>(N);
  const auto me = static_cast<std::uint64_t>(c.rank());
  const std::uint64_t w = sizeof(W);
  test::comp::model_values mv(mc, keep);
  const param_registry reg(mv.spec);
  const spec_layout L = test::comp::make_spec(mc.sizes, test::comp::unit_starts(mc), n);
  const flat_layout layout(mc.sizes, reg.unit_starts(), c.size());
  const std::size_t U = reg.num_units();
  std::vector<bool> persistent(U), kept(U);
  std::uint64_t largest = 0, pers = 0, kept_elems = 0, transient = 0;
  for (std::size_t u = 0; u < U; ++u) {
    const std::uint64_t padded = n * L.groups[u].shard;
    persistent[u] = L.groups[u].psi < persist_below;
    kept[u] = !persistent[u] && u < keep.size() && keep[u];
    if (persistent[u]) {
      pers += padded;
    } else {
      ++transient;
      largest = std::max(largest, padded);
      if (kept[u]) kept_elems += padded;
    }
  }
  memory_ledger mem;
  shard_params_options o;
  o.prefetch = D;
  o.persist_below = persist_below;
  shard_params<Comm, W> sp(c, layout, me, reg, o, &mem);
  for (std::size_t u = 0; u < U; ++u) {
    check(sp.persistent(u) == persistent[u], "unit ", u, " persistent: ", sp.persistent(u));
    check(sp.reshard_after_forward(u) == !(u < keep.size() && keep[u]), "unit ", u,
          " reshard_after_forward: ", sp.reshard_after_forward(u));
  }
  for (std::size_t i = 0; i < mc.sizes.size(); ++i) sp.load(i, mv.init[i].data(), dtype::f32);
  const std::uint64_t bound =
      std::min<std::uint64_t>(1 + D, transient) * largest + pers + kept_elems;
  check(sp.live_bound_elems() == bound, "live_bound_elems() = ", sp.live_bound_elems(),
        "; min(1 + D, U_t)·max + persistent + kept = ", bound);
  sp.start();
  auto gathered = [&] { return mem.current(memory_category::gathered_params); };
  check(gathered() == pers * w, "after start() ", gathered(), " bytes are gathered; the ",
        "persistent units take ", pers * w);
  auto viewable = [&](std::size_t u) {
    for (std::size_t i = reg.unit_begin(u); i < reg.unit_end(u); ++i) {
      try {
        const auto v = sp.view(i);
        for (std::size_t k = 0; k < v.size(); ++k) {
          if (test::comp::bits_of(v[k]) !=
              test::comp::bits_of(from_float<W>(ref::init_value(i, k)))) {
            return false;
          }
        }
      } catch (const usage_error&) {
        return false;
      }
    }
    return true;
  };
  for (std::size_t u = 0; u < U; ++u) {
    if (persistent[u]) check(viewable(u), "persistent unit ", u, " is not viewable after start()");
  }
  c.barrier();
  const traffic_ledger before = c.traffic();
  for (std::size_t u = 0; u < U; ++u) {
    sp.pre_forward(u);
    sp.post_forward(u);
    if (reg.unit_end(u) > reg.unit_begin(u) && L.groups[u].psi != 0) {
      check(viewable(u) == (persistent[u] || kept[u]), "after post_forward(", u, ") unit ", u,
            " is ", viewable(u) ? "" : "not ", "viewable");
    }
    check(gathered() <= bound * w, "above the live bound after post_forward(", u, ")");
  }
  for (std::size_t u = U; u-- > 0;) {
    sp.pre_backward(u);
    check(viewable(u), "unit ", u, " is not viewable in its backward");
    sp.post_backward(u);
    if (L.groups[u].psi != 0) {
      check(viewable(u) == persistent[u], "after post_backward(", u, ") unit ", u, " is ",
            viewable(u) ? "" : "not ", "viewable");
    }
  }
  sp.after_step(true);
  c.barrier();
  std::uint64_t want = 0;  // persistent: regathered once after the step; kept: once; else twice
  for (std::size_t u = 0; u < U; ++u) {
    const std::uint64_t gathers = persistent[u] || kept[u] ? 1 : 2;
    want += gathers * test::comp::rs_or_ag_bytes(L.groups[u].shard, n, w);
  }
  const std::uint64_t sent = c.traffic().since(before).total_bytes_sent();
  check(sent == want, "the step sent ", sent, " bytes; the specification says ", want);
  check(gathered() == pers * w, "after the step ", gathered(), " bytes are gathered, not ",
        pers * w);
  const std::uint64_t peak = mem.peak(memory_category::gathered_params);
  check(peak <= bound * w, "gathered parameters peaked at ", peak, " bytes, above ", bound * w);
  return check.failure;
}

}  // namespace

TEMPLATE_TEST_CASE("replicated_params alone: views, the user's update, after_step's all-gather",
                   "[components][replicated_params]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  const auto mc = test::comp::models()[GENERATE(0u, 1u, 2u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, mc.name);
  auto run = [&](auto body) { test::require_all_ok(World::run(n, body)); };
  SECTION("a 1-way layout (stage 0), bf16") {
    run([&](Comm& c) { return replicated_by_hand<bf16>(c, mc, true, 1); });
  }
  SECTION("sharded over the ranks in units (stages 1-2), bf16 and fp32, aligned to 4") {
    run([&](Comm& c) { return replicated_by_hand<bf16>(c, mc, false, 1); });
    run([&](Comm& c) { return replicated_by_hand<float>(c, mc, false, 4); });
  }
}

TEMPLATE_TEST_CASE("shard_params alone: gathered units after every hook, prefetch, the shard",
                   "[components][shard_params]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  const auto mc = test::comp::models()[GENERATE(0u, 1u, 2u, 3u)];
  const std::size_t D = GENERATE(0u, 1u, 2u);
  const bool reuse = GENERATE(false, true);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, mc.name, D, reuse);
  test::require_all_ok(
      World::run(n, [&](Comm& c) { return shard_params_by_hand<bf16>(c, mc, D, reuse); }));
}

TEMPLATE_TEST_CASE("shard_params reuses the buffers of released units, within the window",
                   "[components][shard_params]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3);
  if (!test::fits<World>(n)) return;
  // Four units of the same size, prefetch 1: a window of two units. With max_live_elems of one
  // unit, prefetching stops and one buffer serves every gather.
  const mcase mc{"four equal units", {5, 7, 5, 7, 5, 7, 5, 7}, {0, 2, 4, 6}};
  const bool limited = GENERATE(false, true);
  // keep_buffers_between_steps: the window's buffers outlive the backward and the step, and the
  // next step gathers into them.
  const bool keep = GENERATE(false, true);
  CAPTURE(World::name, n, limited, keep);
  test::require_all_ok(World::run(n, [&](Comm& c) {
    checks check;
    test::comp::model_values mv(mc);
    const param_registry reg(mv.spec);
    const flat_layout layout(mc.sizes, reg.unit_starts(), c.size());
    const std::size_t padded = layout.group(0).padded;
    const std::size_t window = limited ? 1 : 2;
    memory_ledger mem;
    shard_params_options o;
    o.prefetch = 1;
    o.max_live_elems = limited ? padded : 0;
    o.keep_buffers_between_steps = keep;
    shard_params<Comm, bf16> sp(c, layout, static_cast<std::size_t>(c.rank()), reg, o, &mem);
    for (std::size_t i = 0; i < mc.sizes.size(); ++i) sp.load(i, mv.init[i].data(), dtype::f32);
    sp.start();
    auto held = [&] { return mem.current(memory_category::gathered_params); };
    auto values_are_initial = [&](std::size_t u, const char* when) {
      for (std::size_t i = reg.unit_begin(u); i < reg.unit_end(u); ++i) {
        const auto v = sp.view(i);
        for (std::size_t k = 0; k < v.size(); ++k) {
          check(test::comp::bits_of(v[k]) ==
                    test::comp::bits_of(from_float<bf16>(ref::init_value(i, k))),
                when, ": p", i, "[", k, "] = ", static_cast<float>(v[k]));
        }
      }
    };
    std::vector<const bf16*> before;  // the buffers of the step before
    for (int step = 0; step < 3; ++step) {
      std::vector<const bf16*> at(4);
      for (std::size_t u = 0; u < 4; ++u) {
        sp.pre_forward(u);
        at[u] = sp.view(reg.unit_begin(u)).data();
        if (keep && step > 0 && u < window) {
          check(std::find(before.begin(), before.end(), at[u]) != before.end(), "step ", step,
                ": unit ", u, " was not gathered into a buffer kept from the step before");
        }
        if (u >= window) {
          check(at[u] == at[u - window], "step ", step, ": unit ", u,
                " was not gathered into the buffer unit ", u - window, " released");
        }
        values_are_initial(u, "forward");
        sp.post_forward(u);
        check(held() <= window * padded * sizeof(bf16), "step ", step, ": after post_forward(", u,
              ") ", held(), " bytes are held, more than the window of ", window, " units");
        // The released unit's buffer is kept (the last unit's too, beside the one before it).
        const std::size_t kept = (u == 3 ? window : 1) * padded;
        check(sp.spare_elems() == kept, "step ", step, ": after post_forward(", u, ") ",
              sp.spare_elems(), " elements are kept for reuse, expected ", kept);
      }
      for (std::size_t u = 4; u-- > 0;) {
        sp.pre_backward(u);
        if (u == 3) {  // the first backward gather takes a buffer the forward left
          const bf16* p = sp.view(reg.unit_begin(u)).data();
          check(p == at[2] || p == at[3], "step ", step,
                ": the backward's first gather did not reuse a forward buffer");
        }
        values_are_initial(u, "backward");
        sp.post_backward(u);
        check(held() <= window * padded * sizeof(bf16), "step ", step, ": after post_backward(", u,
              ") ", held(), " bytes are held, more than the window of ", window, " units");
      }
      // The backward order is over: nothing is kept for a gather that will not come in this
      // step; with keep, the window's buffers are kept for the next step.
      const std::uint64_t kept = keep ? window * padded : 0;
      check(held() == kept * sizeof(bf16) && sp.spare_elems() == kept, "step ", step,
            ": after the backward ", held(), " bytes are held, ", sp.spare_elems(),
            " elements kept for reuse; expected ", kept);
      sp.release_transient();  // what the engine calls before its optimizer runs
      sp.after_step(false);
      check(held() == kept * sizeof(bf16) && sp.spare_elems() == kept, "step ", step,
            ": after after_step() ", held(), " bytes are held, ", sp.spare_elems(),
            " elements kept for reuse; expected ", kept);
      before = at;
    }
    sp.free_kept();
    check(held() == 0 && sp.spare_elems() == 0, "after free_kept() ", held(),
          " bytes are still held");
    check(mem.peak(memory_category::gathered_params) == window * padded * sizeof(bf16),
          "gathered parameters peaked at ", mem.peak(memory_category::gathered_params),
          " bytes; the window is ", window, " units of ", padded * sizeof(bf16));
    return check.failure;
  }));
}

TEMPLATE_TEST_CASE("buffers kept between steps survive the regather of persistent units",
                   "[components][shard_params]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n);
  // Unit 0 (7 elements) persists; units 1 and 2 (41 elements each) are gathered per hook.
  const mcase mc{"a persistent unit and two others", {3, 4, 20, 21, 20, 21}, {0, 2, 4}};
  test::require_all_ok(World::run(n, [&](Comm& c) {
    checks check;
    test::comp::model_values mv(mc);
    const param_registry reg(mv.spec);
    const flat_layout layout(mc.sizes, reg.unit_starts(), c.size());
    const std::uint64_t fixed = layout.group(0).padded, padded = layout.group(1).padded;
    memory_ledger mem;
    shard_params_options o;
    o.prefetch = 1;
    o.persist_below = 10;
    o.keep_buffers_between_steps = true;
    shard_params<Comm, bf16> sp(c, layout, static_cast<std::size_t>(c.rank()), reg, o, &mem);
    for (std::size_t i = 0; i < mc.sizes.size(); ++i) sp.load(i, mv.init[i].data(), dtype::f32);
    sp.start();
    check(sp.persistent(0) && !sp.persistent(1) && !sp.persistent(2),
          "expected unit 0 alone to persist");
    for (int step = 0; step < 2; ++step) {
      for (std::size_t u = 0; u < 3; ++u) {
        sp.pre_forward(u);
        sp.post_forward(u);
      }
      for (std::size_t u = 3; u-- > 0;) {
        sp.pre_backward(u);
        sp.post_backward(u);
      }
      sp.release_transient();
      sp.after_step(true);  // regathers unit 0 from the shard
      const std::uint64_t held = mem.current(memory_category::gathered_params);
      check(sp.spare_elems() == 2 * padded && held == (fixed + 2 * padded) * sizeof(bf16), "step ",
            step, ": after after_step(true) ", sp.spare_elems(), " elements are kept and ", held,
            " bytes held; expected the two buffers of ", padded,
            " elements besides the persistent unit's ", fixed);
    }
    return check.failure;
  }));
}

TEMPLATE_TEST_CASE("shard_params alone: persistent units, units kept from forward to backward",
                   "[components][shard_params]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n);
  const auto models = test::comp::models();
  // Units of 5, 14, 67, 7 elements: below 10 persist; the third is kept; prefetch 0, 1, 2.
  for (std::size_t D : {0u, 1u, 2u}) {
    CAPTURE(D);
    test::require_all_ok(World::run(n, [&](Comm& c) {
      return persistent_and_kept<bf16>(c, models[0], 10, {false, false, true, false}, D);
    }));
    // Every unit of the MLP kept; none persists.
    test::require_all_ok(World::run(n, [&](Comm& c) {
      return persistent_and_kept<float>(c, models[3], 0, {true, true}, D);
    }));
  }
}

TEMPLATE_TEST_CASE("the parameter components refuse misuse on every rank",
                   "[components][shard_params][replicated_params][errors]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = 3;
  if (!test::fits<World>(n)) return;
  const mcase mc{"two units", {4, 6, 2, 5}, {0, 2}};
  auto with_shard_params = [&](shard_params_options o, auto misuse) {
    return test::comp::errors_on<World>(n, [&](Comm& c) {
      test::comp::model_values mv(mc);
      const param_registry reg(mv.spec);
      const flat_layout layout(mc.sizes, reg.unit_starts(), c.size());
      shard_params<Comm, bf16> sp(c, layout, static_cast<std::size_t>(c.rank()), reg, o);
      sp.start();
      misuse(sp);
    });
  };
  SECTION("hooks out of order") {
    test::comp::require_all_contain(with_shard_params({},
                                                      [](auto& sp) {
                                                        sp.pre_forward(0);
                                                        sp.pre_forward(0);
                                                      }),
                                    "pre_forward(0): unit 'u0' is already in its forward "
                                    "(gathered twice: call post_forward(0) first)");
    test::comp::require_all_contain(
        with_shard_params({}, [](auto& sp) { sp.post_backward(1); }),
        "post_backward(1): unit 'u1' is not in its backward (call pre_backward(1) first)");
    test::comp::require_all_contain(
        with_shard_params({},
                          [](auto& sp) {
                            sp.pre_forward(0);
                            sp.check_idle("my_step");
                          }),
        "my_step: unit 'u0' is still in its forward (call post_forward(0)");
    test::comp::require_all_contain(with_shard_params({}, [](auto& sp) { sp.pre_forward(2); }),
                                    "pre_forward: unit 2 out of range (2 units declared)");
  }
  SECTION("a view of a released unit") {
    test::comp::require_all_contain(with_shard_params({},
                                                      [](auto& sp) {
                                                        sp.pre_forward(1);
                                                        sp.post_forward(1);
                                                        (void)sp.view(3);
                                                      }),
                                    "shard_params::view(3): parameter 'p3' belongs to unit 'u1', "
                                    "which is not gathered");
  }
  SECTION("construction: a layout that is not the units, a live limit below a unit") {
    auto build = [&](auto make) {
      return test::comp::errors_on<World>(n, [&](Comm& c) {
        test::comp::model_values mv(mc);
        const param_registry reg(mv.spec);
        make(c, reg);
      });
    };
    test::comp::require_all_contain(
        build([&](Comm& c, const param_registry& reg) {
          const flat_layout one(mc.sizes, {}, c.size());
          shard_params<Comm, bf16> sp(c, one, static_cast<std::size_t>(c.rank()), reg);
        }),
        "shard_params: the layout has 1 groups but the model declares 2 units");
    test::comp::require_all_contain(
        build([&](Comm& c, const param_registry& reg) {
          const flat_layout layout(mc.sizes, reg.unit_starts(), c.size());
          shard_params_options o;
          o.max_live_elems = 8;  // unit u0 takes N·S_u = 3·4 = 12
          shard_params<Comm, bf16> sp(c, layout, static_cast<std::size_t>(c.rank()), reg, o);
        }),
        "shard_params: max_live_elems = 8 cannot hold unit 'u0' (12 elements gathered");
    test::comp::require_all_contain(
        build([&](Comm& c, const param_registry& reg) {
          const flat_layout four(mc.sizes, reg.unit_starts(), 4);
          replicated_params<Comm, bf16> rp(c, four, 0, reg);
        }),
        "replicated_params: a layout of 4 shards over a communicator of 3 ranks");
    test::comp::require_all_contain(build([&](Comm& c, const param_registry& reg) {
                                      const flat_layout whole(mc.sizes, {}, 1);
                                      replicated_params<Comm, bf16> rp(c, whole, 0, reg);
                                      rp.post_backward(5);
                                    }),
                                    "post_backward: unit 5 out of range (2 units declared)");
  }
}

TEMPLATE_TEST_CASE("ZeRO-3 assembled from shard_params, shard_grads and shard_optimizer",
                   "[components][shard_params][shard_grads][assembled]", SHARDKIT_TEST_WORLDS) {
  using World = TestType;
  using Comm = typename World::comm_type;
  const int n = GENERATE(1, 2, 3, 4, 7);
  const auto mc = test::comp::models()[GENERATE(0u, 1u, 2u, 3u)];
  if (!test::fits<World>(n)) return;
  CAPTURE(World::name, n, mc.name);
  using test::comp::assemble;
  using test::comp::assemble_config;
  auto run = [&](auto body) {
    const auto per_rank = World::run(n, body);
    for (std::size_t r = 0; r < per_rank.size(); ++r) {
      INFO("rank " << r);
      REQUIRE(per_rank[r].failure == "");
      REQUIRE(per_rank[r].working_hash == per_rank[0].working_hash);
    }
    return per_rank[0];
  };
  assemble_config cfg;
  const auto z1 = run([&](Comm& c) { return assemble<1, bf16, float>(c, mc, cfg); });
  SECTION("prefetch 0, 1 and 2, two staging buffers: the same bits as ZeRO-1") {
    for (std::size_t D : {0u, 1u, 2u}) {
      assemble_config z3 = cfg;
      z3.params.prefetch = D;
      z3.grad_buffers = D == 2 ? 2 : 1;
      const auto s3 = run([&](Comm& c) { return assemble<3, bf16, float>(c, mc, z3); });
      CHECK(s3.working_hash == z1.working_hash);
      CHECK(s3.master_hash == z1.master_hash);
    }
  }
  SECTION("small units persist, the first unit is kept, two micro-batches") {
    assemble_config z3 = cfg;
    z3.params.persist_below = 10;
    z3.keep_after_forward = {true};
    const auto s3 = run([&](Comm& c) { return assemble<3, bf16, float>(c, mc, z3); });
    CHECK(s3.working_hash == z1.working_hash);
    z3.micro_batches = 2;
    assemble_config z1k = cfg;
    z1k.micro_batches = 2;
    const auto a = run([&](Comm& c) { return assemble<3, float, float>(c, mc, z3); });
    const auto b = run([&](Comm& c) { return assemble<1, float, float>(c, mc, z1k); });
    CHECK(a.working_hash == b.working_hash);  // exact fp32 sums
  }
  SECTION("bf16 gradients") {
    const auto s3 = run([&](Comm& c) { return assemble<3, bf16, bf16>(c, mc, cfg); });
    const auto s1 = run([&](Comm& c) { return assemble<1, bf16, bf16>(c, mc, cfg); });
    CHECK(s3.working_hash == s1.working_hash);
  }
}
