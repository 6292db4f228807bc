#include "router/kvbench/trace.h"

#include <gtest/gtest.h>

#include <cctype>

#include <map>
#include <set>

namespace kvrouter::bench {
namespace {

TEST(MooncakeTrace, ParsesALineWithUnknownKeysAndWhitespace) {
  auto r = ParseMooncakeLine(
      R"( {"timestamp": 27482, "input_length": 6955, "output_length": 52, "note": "x", "hash_ids": [46, 47, 1, 2]} )");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->timestamp_ms, 27482);
  EXPECT_EQ(r->input_length, 6955u);
  EXPECT_EQ(r->output_length, 52u);
  EXPECT_EQ(r->hash_ids, (std::vector<std::uint64_t>{46, 47, 1, 2}));
}

TEST(MooncakeTrace, NestedValuesAreSkippedAndLargeIdsStayExact) {
  // Hash ids above 2^53 would lose bits through a double.
  auto r = ParseMooncakeLine(
      R"({"hash_ids": [18446744073709551615, 9007199254740993], "x": {"a": [1, 2]}, "input_length": 3})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->hash_ids, (std::vector<std::uint64_t>{18446744073709551615ull, 9007199254740993ull}));
  EXPECT_EQ(r->input_length, 3u);
  EXPECT_FALSE(ParseMooncakeLine(R"({"input_length": 4294967296})").ok());  // beyond u32
  EXPECT_FALSE(ParseMooncakeLine(R"({"input_length": 1.5})").ok());
}

TEST(MooncakeTrace, MalformedLinesAreInvalidArgument) {
  for (const char* bad : {"", "[1,2]", R"({"hash_ids": [1, -2]})", R"({"input_length": "x"})", R"({"timestamp": 1,)",
                          R"({"hash_ids": [1 2]})"}) {
    auto r = ParseMooncakeLine(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    }
  }
}

TEST(MooncakeTrace, EqualHashIdsGiveEqualTokens) {
  TraceRequest a{0, 1200, 1, {7, 8, 9}};
  TraceRequest b{5, 1200, 1, {7, 8, 3}};
  const auto ta = TokensFor(a), tb = TokensFor(b);
  ASSERT_EQ(ta.size(), 1200u);
  ASSERT_EQ(tb.size(), 1200u);
  // The first two 512-token blocks are shared, the third differs: whatever the router's block
  // size, blocks inside the first 1024 tokens hash equal.
  EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 1024, tb.begin()));
  EXPECT_FALSE(std::equal(ta.begin() + 1024, ta.end(), tb.begin() + 1024));
}

TEST(MooncakeTrace, TextPromptsShareAPrefixExactlyWhereTheirIdsDo) {
  TraceRequest a{0, 1200, 1, {7, 8, 9}};
  TraceRequest b{5, 1100, 1, {7, 8, 3}};
  const std::string ta = TextFor(a), tb = TextFor(b);
  ASSERT_EQ(ta.size(), 1200u);  // one byte per token, as kvmocker's face tokenizes
  ASSERT_EQ(tb.size(), 1100u);
  EXPECT_EQ(ta.substr(0, 1024), tb.substr(0, 1024));
  EXPECT_NE(ta.substr(1024, 64), tb.substr(1024, 64));
  // Letters and digits only: the prompt travels in JSON without escapes.
  EXPECT_TRUE(std::all_of(ta.begin(), ta.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)); }));
}

TEST(MooncakeTrace, PromptsLongerThanTheirIdsContinueWithUniqueContent) {
  TraceRequest a{1, 1024, 1, {7}};
  TraceRequest b{2, 1024, 1, {7}};
  const auto ta = TokensFor(a), tb = TokensFor(b);
  EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 512, tb.begin()));
  EXPECT_FALSE(std::equal(ta.begin() + 512, ta.end(), tb.begin() + 512));
}

TEST(SyntheticConversations, TurnsExtendTheirConversationAndShareTheSystemPrompt) {
  const auto t = SyntheticConversations({.sessions = 5, .turns = 3, .system_blocks = 2, .blocks_per_turn = 2});
  ASSERT_EQ(t.size(), 15u);
  std::set<std::vector<std::uint64_t>> prompts;
  for (std::size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i].hash_ids[0], 0u);
    EXPECT_EQ(t[i].hash_ids[1], 1u);
    if (i > 0) {
      EXPECT_GE(t[i].timestamp_ms, t[i - 1].timestamp_ms);
    }
    EXPECT_LE(t[i].input_length, t[i].hash_ids.size() * kTraceBlockTokens);
    prompts.insert(t[i].hash_ids);
    // Every longer turn's history starts with an earlier turn of its session (or is a first turn).
    const std::size_t turn = (t[i].hash_ids.size() - 2) / 2;
    if (turn > 1) {
      std::vector<std::uint64_t> before(t[i].hash_ids.begin(), t[i].hash_ids.end() - 2);
      EXPECT_TRUE(prompts.count(before)) << i;
    }
  }
}

TEST(SyntheticWorkloads, NamesRoundTripAndUnknownOnesAreRefused) {
  for (auto shape : {WorkloadShape::kChat, WorkloadShape::kSystemPrompts, WorkloadShape::kAgentic,
                     WorkloadShape::kBursts, WorkloadShape::kFanout}) {
    EXPECT_EQ(WorkloadFromName(WorkloadName(shape)), shape);
    EXPECT_EQ(WorkloadDefaults(shape).shape, shape);
  }
  EXPECT_FALSE(WorkloadFromName("poisson").has_value());
}

TEST(SyntheticWorkloads, SystemPromptsAreFewLongAndThePopularOnesComeMostOften) {
  const SyntheticOptions o = WorkloadDefaults(WorkloadShape::kSystemPrompts);
  const auto t = SyntheticConversations(o);
  ASSERT_EQ(t.size(), std::size_t{o.sessions} * o.turns);
  std::map<std::uint64_t, int> by_prompt;  // first block id -> requests
  std::set<std::uint64_t> questions;
  for (const TraceRequest& r : t) {
    ASSERT_EQ(r.hash_ids.size(), o.system_blocks + o.blocks_per_turn);
    ++by_prompt[r.hash_ids[0]];
    EXPECT_TRUE(questions.insert(r.hash_ids.back()).second) << "every question is new";
  }
  EXPECT_LE(by_prompt.size(), o.system_prompts);
  EXPECT_GT(by_prompt.begin()->second, 3 * by_prompt.rbegin()->second) << "prompt 1 is far more popular than the last";
}

TEST(SyntheticWorkloads, AgenticSessionsGrowLongTurnAfterTurn) {
  const SyntheticOptions o = WorkloadDefaults(WorkloadShape::kAgentic);
  const auto t = SyntheticConversations(o);
  ASSERT_EQ(t.size(), std::size_t{o.sessions} * o.turns);
  std::size_t longest = 0;
  std::map<std::uint64_t, std::size_t> last_size;  // session (its first own block) -> blocks
  for (const TraceRequest& r : t) {
    const std::uint64_t session = r.hash_ids.at(o.system_blocks);
    const std::size_t before = last_size[session];
    EXPECT_EQ(r.hash_ids.size(), before == 0 ? o.system_blocks + o.first_turn_blocks : before + o.blocks_per_turn);
    last_size[session] = r.hash_ids.size();
    longest = std::max(longest, r.hash_ids.size());
    EXPECT_GE(r.output_length, o.min_output);
    EXPECT_LE(r.output_length, o.max_output);
  }
  EXPECT_EQ(last_size.size(), o.sessions);
  EXPECT_EQ(longest, o.system_blocks + o.first_turn_blocks + (o.turns - 1) * o.blocks_per_turn);
}

TEST(SyntheticWorkloads, BurstsArriveTogetherThenPause) {
  const SyntheticOptions o = WorkloadDefaults(WorkloadShape::kBursts);
  const auto t = SyntheticConversations(o);
  ASSERT_EQ(t.size(), std::size_t{o.sessions} * o.turns);
  const double gap_ms = 1000.0 * o.burst_size / o.requests_per_second;
  for (std::size_t i = 0; i < t.size(); ++i) {
    const double start = static_cast<double>(i / o.burst_size) * gap_ms;
    EXPECT_GE(t[i].timestamp_ms, start) << i;
    EXPECT_LT(t[i].timestamp_ms, start + 250) << i;
    if (i > 0) {
      EXPECT_GE(t[i].timestamp_ms, t[i - 1].timestamp_ms) << i;
    }
  }
}

TEST(SyntheticWorkloads, FanoutBurstsShareAFreshDocumentAtOneInstant) {
  const SyntheticOptions o = WorkloadDefaults(WorkloadShape::kFanout);
  const auto t = SyntheticConversations(o);
  ASSERT_EQ(t.size(), std::size_t{o.sessions} * o.turns);
  std::set<std::uint64_t> documents;
  for (std::size_t b = 0; b < o.sessions; ++b) {
    const TraceRequest& first = t[b * o.turns];
    EXPECT_TRUE(documents.insert(first.hash_ids[0]).second) << "burst " << b << " has a new document";
    for (std::size_t q = 1; q < o.turns; ++q) {
      const TraceRequest& r = t[b * o.turns + q];
      EXPECT_EQ(r.timestamp_ms, first.timestamp_ms);
      EXPECT_TRUE(std::equal(first.hash_ids.begin(), first.hash_ids.begin() + o.system_blocks, r.hash_ids.begin()));
      EXPECT_NE(r.hash_ids.back(), first.hash_ids.back());
    }
  }
}

}  // namespace
}  // namespace kvrouter::bench
