// shardkit-plan --offload: for stages 1-3, the bytes a rank holds on the GPU and in host memory
// with the optimizer offloaded (plan/offload.hpp), and whether offload is what makes the stage
// fit. Host memory per rank is --host-mem (default: no limit).
#pragma once

#include <shardkit/plan/offload.hpp>
#include <shardkit/plan/planner.hpp>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>

namespace shardkit_plan {

inline void print_offload(const shardkit::plan::plan_report& r, std::uint64_t usable,
                          std::optional<std::uint64_t> host_mem) {
  namespace plan = shardkit::plan;
  const std::uint64_t host = host_mem.value_or(std::numeric_limits<std::uint64_t>::max());
  std::printf("\noffload (master and optimizer state in host memory; bytes per rank):\n");
  std::printf("  %-8s %20s %20s %8s %8s\n", "", "GPU bytes", "host bytes", "fits?", "offload?");
  std::string first;  // the lowest stage that fits only with offload
  for (const auto& st : r.stages) {
    if (st.config.stage == 0) continue;  // offload applies to stages 1-3
    const plan::offload_memory m = plan::offloaded_memory_per_rank(st.config, st.layout);
    const plan::offload_verdict v = plan::offload_fit(st.config, st.layout, usable, host);
    const bool with = v.fits_offload && st.live_ok;
    const bool without = st.fits;
    const std::string label = "stage " + std::to_string(st.config.stage);
    std::printf("  %-8s %20llu %20llu %8s %8s\n", label.c_str(),
                static_cast<unsigned long long>(m.device.total()),
                static_cast<unsigned long long>(m.host.total()), with ? "yes" : "no",
                with && !without ? "needed"
                : with           ? "optional"
                                 : "-");
    if (first.empty() && with && !without) first = label;
  }
  if (!first.empty()) {
    std::printf("offload makes %s fit, which does not fit without it\n", first.c_str());
  } else {
    std::printf("offload makes no stage fit that does not fit without it\n");
  }
}

}  // namespace shardkit_plan
