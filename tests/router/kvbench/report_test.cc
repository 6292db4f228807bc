#include "router/kvbench/report.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace kvrouter::bench {
namespace {

TEST(Summary, HitRatePercentilesAndSpread) {
  std::vector<RequestRecord> recs = {
      {.arrival_ms = 0,
       .first_token_ms = 100,
       .finished_ms = 1000,
       .prompt_tokens = 1000,
       .cached_tokens = 500,
       .worker_id = 1},
      {.arrival_ms = 0,
       .first_token_ms = 300,
       .finished_ms = 2000,
       .prompt_tokens = 1000,
       .cached_tokens = 0,
       .worker_id = 2},
      {.arrival_ms = 0, .error = true},
  };
  const Summary s = Summarize("kv", recs, {1, 2, 3});
  EXPECT_EQ(s.requests, 3u);
  EXPECT_EQ(s.errors, 1u);
  EXPECT_DOUBLE_EQ(s.kv_hit_rate, 0.25);
  EXPECT_DOUBLE_EQ(s.ttft_p50, 300);
  EXPECT_DOUBLE_EQ(s.throughput_rps, 1.0);  // 2 finished over 2 s
  EXPECT_EQ(s.worker_requests, (std::vector<std::uint64_t>{1, 1, 0}));
  const auto json = nlohmann::json::parse(SummaryJson(s));
  EXPECT_EQ(json["mode"], "kv");
  EXPECT_DOUBLE_EQ(json["kv_hit_rate"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(json["ttft_ms"]["p99"].get<double>(), s.ttft_p99);
  EXPECT_EQ(json["worker_requests"], nlohmann::json::parse("[1, 1, 0]"));
}

// The last two columns of the table row that starts with `mode` (the header: "mode").
std::vector<std::string> LastTwoColumns(const std::string& table, const std::string& mode) {
  std::istringstream lines(table);
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with(mode + " ")) continue;
    std::istringstream words(line);
    std::vector<std::string> columns;
    for (std::string w; words >> w;) columns.push_back(w);
    if (columns.size() < 2) break;
    return {columns.end() - 2, columns.end()};
  }
  return {};
}

TEST(Summary, BusyTimeBalanceIsTheBusiestWorkerOverTheMean) {
  Summary s{.mode = "offline", .worker_requests = {1, 3, 2}, .worker_busy_ms = {100, 300, 200}};
  ASSERT_TRUE(BusyTimeMaxOverMean(s).has_value());
  EXPECT_DOUBLE_EQ(*BusyTimeMaxOverMean(s), 1.5);  // 300 over a mean of 200
  const auto json = nlohmann::json::parse(SummaryJson(s));
  EXPECT_DOUBLE_EQ(json["busy_time_max_over_mean"].get<double>(), 1.5);
  EXPECT_EQ(json["worker_busy_ms"], nlohmann::json::parse("[100.0, 300.0, 200.0]"));
  EXPECT_EQ(json["worker_requests"], nlohmann::json::parse("[1, 3, 2]"));

  // The table keeps the request share and puts the busy-time balance beside it.
  Summary even{.mode = "even", .worker_requests = {2, 2}, .worker_busy_ms = {50, 50}};
  const std::string table = SummaryTable({s, even});
  using Columns = std::vector<std::string>;
  EXPECT_EQ(LastTwoColumns(table, "mode"), (Columns{"max/share", "busy_max/mean"})) << table;
  EXPECT_EQ(LastTwoColumns(table, "offline"), (Columns{"1.50x", "1.50x"})) << table;
  EXPECT_EQ(LastTwoColumns(table, "even"), (Columns{"1.00x", "1.00x"})) << table;

  // Workers that never ran a step: no imbalance to report.
  Summary idle{.mode = "idle", .worker_busy_ms = {0, 0}};
  EXPECT_EQ(BusyTimeMaxOverMean(idle), 0.0);
}

TEST(Summary, OnlineRunsHaveNoBusyTime) {
  Summary s{.mode = "online", .requests = 4, .worker_requests = {3, 1}};  // no engine steps seen
  EXPECT_FALSE(BusyTimeMaxOverMean(s).has_value());
  const auto json = nlohmann::json::parse(SummaryJson(s));
  EXPECT_FALSE(json.contains("busy_time_max_over_mean")) << json.dump();
  EXPECT_FALSE(json.contains("worker_busy_ms")) << json.dump();
  // The request share still shows.
  EXPECT_EQ(LastTwoColumns(SummaryTable({s}), "online"), (std::vector<std::string>{"1.50x", "-"})) << SummaryTable({s});
}

TEST(Summary, JsonEscapesTheLabel) {
  Summary s;
  s.mode = "kv \"quoted\"\n";
  const auto json = nlohmann::json::parse(SummaryJson(s));  // would throw on a broken document
  EXPECT_EQ(json["mode"], s.mode);
}

TEST(Plot, DrawsEveryRunAndTheBoundIntoAnSvg) {
  Summary a{.mode = "kv (default)",
            .requests = 10,
            .kv_hit_rate = 0.5,
            .ttft_p50 = 40,
            .ttft_p99 = 90,
            .pooled_lru_hit_rate = 0.6};
  Summary b{.mode = "kv, Dynamo's cost",
            .requests = 10,
            .kv_hit_rate = 0.3,
            .ttft_p50 = 60,
            .ttft_p99 = 200,
            .pooled_lru_hit_rate = 0.6};
  const std::string path = ::testing::TempDir() + "kvbench-plot-test.svg";
  std::filesystem::remove(path);
  ASSERT_TRUE(PlotSummaries({a, b}, "a \"quoted\" title", path).ok());
  std::ifstream in(path);
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  for (const char* text : {"kv (default)", "Dynamo", "pooled-LRU bound", "p99", "quoted"}) {
    EXPECT_NE(svg.find(text), std::string::npos) << text;
  }
  std::filesystem::remove(path);
}

TEST(Plot, WithoutGnuplotTheErrorSaysWhatToInstall) {
  const std::string old_path = std::getenv("PATH") ? std::getenv("PATH") : "";
  setenv("PATH", "/nonexistent", 1);
  const Status s = PlotSummaries({Summary{.mode = "kv"}}, "t", ::testing::TempDir() + "never.svg");
  setenv("PATH", old_path.c_str(), 1);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("gnuplot-nox"), std::string::npos) << s.message();
  EXPECT_FALSE(PlotSummaries({}, "t", "x.svg").ok());
}

}  // namespace
}  // namespace kvrouter::bench
