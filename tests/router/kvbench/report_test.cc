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

TEST(TokenGaps, QuantilesWeighEachGapByItsTokens) {
  TokenGaps gaps;
  EXPECT_EQ(gaps.count(), 0u);
  EXPECT_EQ(gaps.Quantile(0.5), 0);
  gaps.Add(10, 90);   // one step of 90 requests
  gaps.Add(200, 9);   // a step that carried a prefill
  gaps.Add(5);        // one token
  gaps.Add(1000, 0);  // no tokens: nothing
  ASSERT_EQ(gaps.count(), 100u);
  // Sorted: 5, then 90 x 10, then 9 x 200. Rank floor(q * 100), 0-based.
  EXPECT_DOUBLE_EQ(gaps.Quantile(0), 5);
  EXPECT_DOUBLE_EQ(gaps.Quantile(0.005), 5);
  EXPECT_DOUBLE_EQ(gaps.Quantile(0.01), 10);
  EXPECT_DOUBLE_EQ(gaps.Quantile(0.5), 10);
  EXPECT_DOUBLE_EQ(gaps.Quantile(0.90), 10);
  EXPECT_DOUBLE_EQ(gaps.Quantile(0.91), 200);
  EXPECT_DOUBLE_EQ(gaps.Quantile(0.99), 200);
  EXPECT_DOUBLE_EQ(gaps.Quantile(1), 200);
  // The same as one entry per token, percentiles taken as the others are.
  TokenGaps one_by_one;
  one_by_one.Add(5);
  for (int k = 0; k < 90; ++k) one_by_one.Add(10);
  for (int k = 0; k < 9; ++k) one_by_one.Add(200);
  for (double q : {0.0, 0.25, 0.5, 0.9, 0.91, 0.99, 1.0}) EXPECT_EQ(one_by_one.Quantile(q), gaps.Quantile(q)) << q;
}

TEST(TokenGaps, GapsAreKeptToTheMicrosecond) {
  TokenGaps gaps;
  gaps.Add(6.0123456, 3);
  gaps.Add(6.0124, 1);
  gaps.Add(-0.0000001);  // clocks a hair apart: 0
  EXPECT_DOUBLE_EQ(gaps.Quantile(0), 0);
  EXPECT_DOUBLE_EQ(gaps.Quantile(0.5), 6.012);
  EXPECT_DOUBLE_EQ(gaps.Quantile(1), 6.012);
}

TEST(Summary, TpotIsPerRequestAndGoodputCountsRequestsMeetingBothTargets) {
  const SloTargets slo{.ttft_ms = 100, .tpot_ms = 10};
  std::vector<RequestRecord> recs = {
      // TTFT 50, TPOT (950 - 50) / 99 = 9.09: meets both.
      {.arrival_ms = 0, .first_token_ms = 50, .finished_ms = 950, .output_tokens = 100},
      // TTFT 100 (at the target), TPOT 20: misses TPOT.
      {.arrival_ms = 0, .first_token_ms = 100, .finished_ms = 300, .output_tokens = 11},
      // TTFT 150: misses TTFT although its TPOT is 1.
      {.arrival_ms = 0, .first_token_ms = 150, .finished_ms = 160, .output_tokens = 11},
      // One token: no TPOT, meets that part; TTFT 80 meets.
      {.arrival_ms = 20, .first_token_ms = 100, .finished_ms = 100, .output_tokens = 1},
      // Two tokens, TTFT 10, TPOT exactly 10: meets.
      {.arrival_ms = 0, .first_token_ms = 10, .finished_ms = 20, .output_tokens = 2},
      {.arrival_ms = 0, .error = true},                                                // misses
      {.arrival_ms = 0, .first_token_ms = 10, .finished_ms = -1, .output_tokens = 5},  // never finished
  };
  const Summary s = Summarize("pd", recs, {}, slo);
  EXPECT_DOUBLE_EQ(s.goodput, 3.0 / 7.0);
  // TPOTs of the four finished requests of >= 2 tokens, sorted: 1, 9.09, 10, 20.
  EXPECT_DOUBLE_EQ(s.tpot_p50, 10);  // rank floor(0.5 * 4) = 2
  EXPECT_DOUBLE_EQ(s.tpot_p99, 20);
  EXPECT_EQ(s.slo.ttft_ms, 100);
  // No token gaps given: no ITL.
  EXPECT_FALSE(s.itl_p50.has_value());
  const auto json = nlohmann::json::parse(SummaryJson(s));
  EXPECT_FALSE(json.contains("itl_ms")) << json.dump();
  EXPECT_DOUBLE_EQ(json["goodput"].get<double>(), 3.0 / 7.0);
  EXPECT_DOUBLE_EQ(json["tpot_ms"]["p50"].get<double>(), 10);
  EXPECT_DOUBLE_EQ(json["slo"]["tpot_ms"].get<double>(), 10);

  // The default targets: 1,000 ms and 50 ms.
  const Summary d = Summarize("pd", recs, {});
  EXPECT_DOUBLE_EQ(d.goodput, 5.0 / 7.0);

  // Requests their client abandoned on purpose are in no figure but their own count.
  recs.push_back({.arrival_ms = 0, .error = true, .aborted = true});
  recs.push_back({.arrival_ms = 0, .first_token_ms = 5000, .finished_ms = -1, .aborted = true});
  const Summary a = Summarize("pd", recs, {}, slo);
  EXPECT_EQ(a.aborted, 2u);
  EXPECT_EQ(a.errors, s.errors);
  EXPECT_DOUBLE_EQ(a.goodput, 3.0 / 7.0);
  EXPECT_DOUBLE_EQ(a.ttft_p99, s.ttft_p99);
  EXPECT_EQ(nlohmann::json::parse(SummaryJson(a))["aborted"], 2);
}

TEST(Summary, InterTokenLatencyIsOverEveryGapNotPerRequestMeans) {
  // One long request with steady 10 ms gaps and one short one whose single gap is 500 ms: a
  // per-request mean would put half the requests at 500 ms; over all gaps it is 1 in 100.
  TokenGaps gaps;
  gaps.Add(10, 99);
  gaps.Add(500);
  Summary s = Summarize("kv", {}, {});
  SetTokenGaps(s, gaps);
  ASSERT_TRUE(s.itl_p50 && s.itl_p99);
  EXPECT_DOUBLE_EQ(*s.itl_p50, 10);
  EXPECT_DOUBLE_EQ(*s.itl_p99, 500);  // rank 99 of 100
  EXPECT_EQ(s.itl_gaps, 100u);
  const auto json = nlohmann::json::parse(SummaryJson(s));
  EXPECT_DOUBLE_EQ(json["itl_ms"]["p99"].get<double>(), 500);
  EXPECT_EQ(json["itl_ms"]["gaps"], 100);
  // Without gaps nothing is set.
  Summary none = Summarize("kv", {}, {});
  SetTokenGaps(none, TokenGaps{});
  EXPECT_FALSE(none.itl_p50.has_value());
}

TEST(Summary, BusyTimesAreSummedPerPoolAndThePrefillPoolsHerdingIsItsMaxOverMean) {
  Summary pd{.mode = "pd"};
  SetBusyTimes(pd, {100, 300, 200, 200, 50, 70}, {"prefill", "prefill", "prefill", "prefill", "decode", "decode"});
  EXPECT_EQ(pd.worker_busy_ms, (std::vector<double>{100, 300, 200, 200, 50, 70}));
  EXPECT_EQ(pd.pool_busy_ms, (std::map<std::string, double>{{"prefill", 800}, {"decode", 120}}));
  ASSERT_TRUE(pd.prefill_busy_max_over_mean.has_value());
  EXPECT_DOUBLE_EQ(*pd.prefill_busy_max_over_mean, 1.5);  // 300 over a mean of 200
  const auto json = nlohmann::json::parse(SummaryJson(pd));
  EXPECT_DOUBLE_EQ(json["pool_busy_ms"]["prefill"].get<double>(), 800);
  EXPECT_DOUBLE_EQ(json["pool_busy_ms"]["decode"].get<double>(), 120);
  EXPECT_DOUBLE_EQ(json["prefill_busy_max_over_mean"].get<double>(), 1.5);

  // An aggregated fleet is one pool, "both", with no prefill pool to herd.
  Summary agg{.mode = "agg"};
  SetBusyTimes(agg, {10, 20}, {"both", "both"});
  EXPECT_EQ(agg.pool_busy_ms, (std::map<std::string, double>{{"both", 30}}));
  EXPECT_FALSE(agg.prefill_busy_max_over_mean.has_value());
  EXPECT_FALSE(nlohmann::json::parse(SummaryJson(agg)).contains("prefill_busy_max_over_mean"));

  // An idle prefill pool: no herding.
  Summary idle{.mode = "idle"};
  SetBusyTimes(idle, {0, 0, 40}, {"prefill", "prefill", "decode"});
  EXPECT_EQ(idle.prefill_busy_max_over_mean, 0.0);
}

// The columns of the second table's row for `mode` (the one below the blank line).
std::vector<std::string> LatencyColumns(const std::string& table, const std::string& mode) {
  const auto second = table.find("\n\n");
  if (second == std::string::npos) return {};
  std::istringstream lines(table.substr(second + 2));
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with(mode + " ")) continue;
    std::istringstream words(line);
    std::vector<std::string> columns;
    for (std::string w; words >> w;) columns.push_back(w);
    return columns;
  }
  return {};
}

TEST(Summary, TheSecondTableShowsLatenciesGoodputPoolsAndDecisions) {
  Summary pd{.mode = "pd",
             .itl_p50 = 6.5,
             .itl_p99 = 12.3,
             .tpot_p50 = 7,
             .tpot_p99 = 30,
             .goodput = 0.875,
             .disagg_decisions = {{"disaggregated", 5}, {"local", 3}, {"fallback", 1}}};
  SetBusyTimes(pd, {2000, 4000, 9000}, {"prefill", "prefill", "decode"});
  Summary online{.mode = "online", .tpot_p50 = 8, .tpot_p99 = 9, .goodput = 1};
  const std::string table = SummaryTable({pd, online});
  using Columns = std::vector<std::string>;
  EXPECT_EQ(LatencyColumns(table, "mode"), (Columns{"mode", "itl_p50", "itl_p99", "tpot_p50", "tpot_p99", "goodput",
                                                    "prefill_max/mean", "pool_busy_s", "disagg/local/fallback"}))
      << table;
  EXPECT_EQ(LatencyColumns(table, "pd"),
            (Columns{"pd", "6.5ms", "12.3ms", "7.0ms", "30.0ms", "87.5%", "1.33x", "prefill=6,decode=9", "5/3/1"}))
      << table;
  EXPECT_EQ(LatencyColumns(table, "online"), (Columns{"online", "-", "-", "8.0ms", "9.0ms", "100.0%", "-", "-", "-"}))
      << table;
  EXPECT_NE(table.find("TTFT <= 1000 ms and TPOT <= 50 ms"), std::string::npos) << table;
  const auto json = nlohmann::json::parse(SummaryJson(pd));
  EXPECT_EQ(json["disagg_decisions"]["local"], 3);
  EXPECT_FALSE(nlohmann::json::parse(SummaryJson(online)).contains("disagg_decisions"));
  EXPECT_EQ(table.find("still books"), std::string::npos) << table;  // nothing left: nothing said
}

TEST(Summary, BookingsLeftAfterARunAreReported) {
  Summary clean{.mode = "clean", .bookings_left = BookingsLeft{}};
  Summary leaky{.mode = "leaky", .bookings_left = BookingsLeft{.requests = 2, .prefill_tokens = 300, .blocks = 7}};
  const std::string table = SummaryTable({clean, leaky});
  EXPECT_NE(table.find("leaky: the router still books 2 requests, 300 prefill tokens, 7 blocks"), std::string::npos)
      << table;
  EXPECT_EQ(table.find("clean: the router"), std::string::npos) << table;
  const auto json = nlohmann::json::parse(SummaryJson(leaky));
  EXPECT_EQ(json["bookings_left"]["prefill_tokens"], 300);
  EXPECT_EQ(nlohmann::json::parse(SummaryJson(clean))["bookings_left"]["requests"], 0);
  EXPECT_FALSE(nlohmann::json::parse(SummaryJson(Summary{})).contains("bookings_left"));  // online
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
