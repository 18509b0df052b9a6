// The argument parsing of the shardkit-plan tool (examples/shardkit-plan/parse.hpp): exact
// counts and bytes with SI and binary suffixes, bandwidths, durations, headroom and unit lists,
// and error messages that name the argument and what was expected.
#include "shardkit-plan/parse.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <string>

using Catch::Contains;

TEST_CASE("shardkit-plan: counts are exact whole numbers with SI or binary suffixes") {
  CHECK(cli::parse_count("--params", "7e9") == 7'000'000'000);
  CHECK(cli::parse_count("--params", "7000000000") == 7'000'000'000);
  CHECK(cli::parse_count("--params", "7G") == 7'000'000'000);
  CHECK(cli::parse_count("--params", "13000M") == 13'000'000'000);
  CHECK(cli::parse_count("--params", "1.5k") == 1500);
  CHECK(cli::parse_count("--params", "2.5e8") == 250'000'000);
  CHECK(cli::parse_count("--params", "0.05k") == 50);
  CHECK(cli::parse_count("--params", "64Ki") == 65536);
  CHECK(cli::parse_count("--params", "1T") == 1'000'000'000'000);
  CHECK(cli::parse_count("--params", "0") == 0);
  CHECK(cli::parse_count("--params", "18446744073709551615") == 18446744073709551615u);

  CHECK_THROWS_WITH(cli::parse_count("--params", "-5"),
                    Contains("--params: '-5' is negative; expected a count >= 0"));
  CHECK_THROWS_WITH(cli::parse_count("--params", "1.2345k"),
                    Contains("is not a whole number of elements"));
  CHECK_THROWS_WITH(cli::parse_count("--ranks", "eight"),
                    Contains("--ranks: 'eight' is not a number"));
  CHECK_THROWS_WITH(cli::parse_count("--params", "7B"), Contains("unknown suffix 'B'"));
  CHECK_THROWS_WITH(cli::parse_count("--params", "7e"), Contains("unknown suffix 'e'"));
  CHECK_THROWS_WITH(cli::parse_count("--params", "1e20"), Contains("too large"));
  CHECK_THROWS_WITH(cli::parse_count("--params", "18446744073709551616"),
                    Contains("too many significant digits"));
  CHECK_THROWS_WITH(cli::parse_count("--params", ""), Contains("is not a number"));
}

TEST_CASE("shardkit-plan: bytes need a unit (GB = 1e9, GiB = 2^30)") {
  CHECK(cli::parse_bytes("--gpu-mem", "80GB") == 80'000'000'000);
  CHECK(cli::parse_bytes("--gpu-mem", "80GiB") == 80ull << 30);
  CHECK(cli::parse_bytes("--gpu-mem", "1.5TB") == 1'500'000'000'000);
  CHECK(cli::parse_bytes("--gpu-mem", "512MB") == 512'000'000);
  CHECK(cli::parse_bytes("--gpu-mem", "100B") == 100);
  CHECK(cli::parse_bytes("--gpu-mem", "4KiB") == 4096);
  CHECK(cli::parse_bytes("--gpu-mem", "0.5KiB") == 512);
  CHECK_THROWS_WITH(cli::parse_bytes("--gpu-mem", "80"),
                    Contains("--gpu-mem: '80' has no unit; expected bytes such as 80GB"));
  CHECK_THROWS_WITH(cli::parse_bytes("--gpu-mem", "80Gb"), Contains("unknown unit 'Gb'"));
  CHECK_THROWS_WITH(cli::parse_bytes("--gpu-mem", "-80GB"), Contains("is negative"));
  CHECK_THROWS_WITH(cli::parse_bytes("--gpu-mem", "0.1B"), Contains("not a whole number of bytes"));
}

TEST_CASE("shardkit-plan: bandwidths, durations and headroom") {
  CHECK(cli::parse_bandwidth("--intra-bw", "450GB/s") == Approx(450e9));
  CHECK(cli::parse_bandwidth("--inter-bw", "400Gbit/s") == Approx(50e9));
  CHECK(cli::parse_bandwidth("--inter-bw", "1GiB/s") == Approx(1073741824.0));
  CHECK_THROWS_WITH(cli::parse_bandwidth("--inter-bw", "400Gbps"), Contains("unknown unit 'Gbps'"));
  CHECK_THROWS_WITH(cli::parse_bandwidth("--inter-bw", "0GB/s"), Contains("positive bandwidth"));
  CHECK_THROWS_WITH(cli::parse_bandwidth("--inter-bw", "50"), Contains("unknown unit ''"));

  CHECK(cli::parse_duration("--alpha", "5us") == Approx(5e-6));
  CHECK(cli::parse_duration("--alpha", "5\xC2\xB5s") == Approx(5e-6));
  CHECK(cli::parse_duration("--alpha", "2ms") == Approx(2e-3));
  CHECK(cli::parse_duration("--alpha", "500ns") == Approx(5e-7));
  CHECK(cli::parse_duration("--alpha", "1e-5s") == Approx(1e-5));
  CHECK_THROWS_WITH(cli::parse_duration("--alpha", "5"), Contains("expected a duration"));
  CHECK_THROWS_WITH(cli::parse_duration("--alpha", "-5us"), Contains("is negative"));

  const auto pct = cli::parse_headroom("--headroom", "10%");
  CHECK(pct.is_percent);
  CHECK(pct.of(80'000'000'000) == 8'000'000'000);
  CHECK(cli::parse_headroom("--headroom", "7.5%").of(1000) == 75);
  CHECK(cli::parse_headroom("--headroom", "4GB").of(80'000'000'000) == 4'000'000'000);
  CHECK_THROWS_WITH(cli::parse_headroom("--headroom", "100%"), Contains("must be below 100%"));
  CHECK_THROWS_WITH(cli::parse_headroom("--headroom", "x%"), Contains("is not a number"));
}

TEST_CASE("shardkit-plan: unit lists inline or from a file") {
  std::string source;
  const auto inline_list = cli::parse_units("--units", "2e8,2e8, 5e7", source);
  CHECK(source == "list");
  REQUIRE(inline_list.size() == 3);
  CHECK(inline_list[2] == 50'000'000);

  const std::string path = "shardkit_plan_units_test.txt";
  {
    std::ofstream f(path);
    f << "# embedding\n1.5e8\n# 2 blocks\n2e8, 2e8  # same size\n\n1000 # head\n";
  }
  const auto from_file = cli::parse_units("--units", path, source);
  CHECK(source == "file " + path);
  REQUIRE(from_file.size() == 4);
  CHECK(from_file[0] == 150'000'000);
  CHECK(from_file[3] == 1000);
  {
    std::ofstream f(path);
    f << "1e8\nlots\n";
  }
  CHECK_THROWS_WITH(cli::parse_units("--units", path, source),
                    Contains("--units: 'lots' is not a number") && Contains("(in file " + path));
  std::remove(path.c_str());

  CHECK_THROWS_WITH(cli::parse_units("--units", "no-such-file.txt", source),
                    Contains("is neither a readable file nor a list of unit sizes"));
  CHECK_THROWS_WITH(cli::parse_units("--units", "1,-2", source), Contains("'-2' is negative"));
  CHECK_THROWS_WITH(cli::parse_units("--units", "1,2,x", source),
                    Contains("--units: 'x' is not a number"));
  CHECK_THROWS_WITH(cli::parse_units("--units", " , ", source), Contains("lists no unit sizes"));
}

TEST_CASE("shardkit-plan: training dtypes for --dtype and --grad-dtype") {
  CHECK(cli::parse_dtype("--grad-dtype", "fp32") == shardkit::dtype::f32);
  CHECK(cli::parse_dtype("--grad-dtype", "bf16") == shardkit::dtype::bf16);
  CHECK(cli::parse_dtype("--dtype", "fp16") == shardkit::dtype::f16);
  CHECK_THROWS_WITH(
      cli::parse_dtype("--grad-dtype", "fp8"),
      Contains("--grad-dtype: 'fp8' is not a training dtype; expected bf16, fp16 or fp32"));
  CHECK_THROWS_WITH(cli::parse_dtype("--grad-dtype", "FP32"), Contains("'FP32' is not a training"));
  CHECK_THROWS_WITH(cli::parse_dtype("--dtype", ""), Contains("--dtype: '' is not a training"));
}
