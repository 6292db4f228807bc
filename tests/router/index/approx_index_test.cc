#include "router/index/approx_index.h"

#include <gtest/gtest.h>

#include <map>

namespace kvrouter {
namespace {

using std::chrono::seconds;
const SteadyTime kT0{};
constexpr WorkerKey kA{1, 0};
constexpr WorkerKey kB{2, 0};

struct Prompt {
  std::vector<LocalHash> local;
  std::vector<SequenceHash> seq;
};
// A prompt of `blocks` blocks whose local hashes start at `first`.
Prompt MakePrompt(LocalHash first, std::size_t blocks) {
  Prompt p;
  for (std::size_t i = 0; i < blocks; ++i) p.local.push_back(first + i);
  p.seq = ComputeSequenceHashes(p.local);
  return p;
}

std::map<WorkerKey, std::uint32_t> Matches(const ApproxIndex& a, const Prompt& p) {
  OverlapScores s;
  a.FindMatches(p.seq, s);
  std::map<WorkerKey, std::uint32_t> out;
  for (auto& e : s) out[e.worker] = e.blocks;
  return out;
}

TEST(ApproxIndex, RecordedPrefixIsPredictedForThatWorkerOnly) {
  ApproxIndex a(seconds(120), 1000, 0.8);
  const Prompt p = MakePrompt(10, 4);
  a.Record(kA, p.local, p.seq, kT0);
  EXPECT_EQ(Matches(a, p), (std::map<WorkerKey, std::uint32_t>{{kA, 4}}));
  // A longer prompt sharing the prefix matches the 4 recorded blocks.
  const Prompt longer = MakePrompt(10, 6);
  EXPECT_EQ(Matches(a, longer), (std::map<WorkerKey, std::uint32_t>{{kA, 4}}));
  EXPECT_EQ(a.TreeSize(kA), 4u);
  EXPECT_EQ(a.TreeSize(kB), 0u);
}

TEST(ApproxIndex, BlocksExpireTtlAfterTheirLastUse) {
  ApproxIndex a(seconds(120), 1000, 0.8);
  const Prompt p = MakePrompt(10, 3);
  a.Record(kA, p.local, p.seq, kT0);
  EXPECT_EQ(a.Expire(kT0 + seconds(119)), 0u);
  EXPECT_EQ(a.Expire(kT0 + seconds(120)), 3u);
  EXPECT_TRUE(Matches(a, p).empty());
  EXPECT_EQ(a.size(), 0u);
}

TEST(ApproxIndex, RoutingTheSamePrefixAgainRefreshesIt) {
  ApproxIndex a(seconds(120), 1000, 0.8);
  const Prompt p = MakePrompt(10, 3);
  a.Record(kA, p.local, p.seq, kT0);
  const Prompt prefix = MakePrompt(10, 2);
  a.Record(kA, prefix.local, prefix.seq, kT0 + seconds(100));  // refreshes the first two
  EXPECT_EQ(a.Expire(kT0 + seconds(150)), 1u);                 // only the third was stale
  EXPECT_EQ(Matches(a, p), (std::map<WorkerKey, std::uint32_t>{{kA, 2}}));
  EXPECT_EQ(a.Expire(kT0 + seconds(220)), 2u);
}

TEST(ApproxIndex, WorkersAgeIndependently) {
  ApproxIndex a(seconds(120), 1000, 0.8);
  const Prompt p = MakePrompt(10, 2);
  a.Record(kA, p.local, p.seq, kT0);
  a.Record(kB, p.local, p.seq, kT0 + seconds(60));
  EXPECT_EQ(a.Expire(kT0 + seconds(130)), 2u);
  EXPECT_EQ(Matches(a, p), (std::map<WorkerKey, std::uint32_t>{{kB, 2}}));
}

TEST(ApproxIndex, PruningDropsEarliestExpiringThenDeepestFirst) {
  // Limit 10 blocks, prune down to 5.
  ApproxIndex a(seconds(120), 10, 0.5);
  const Prompt old_prompt = MakePrompt(100, 4);  // used at t0
  const Prompt mid_prompt = MakePrompt(200, 4);  // used at t0+1
  const Prompt new_prompt = MakePrompt(300, 3);  // used at t0+2: 11 blocks > 10
  a.Record(kA, old_prompt.local, old_prompt.seq, kT0);
  a.Record(kA, mid_prompt.local, mid_prompt.seq, kT0 + seconds(1));
  a.Record(kA, new_prompt.local, new_prompt.seq, kT0 + seconds(2));
  EXPECT_EQ(a.size(), 5u);
  EXPECT_EQ(a.pruned(), 6u);
  // All 4 old blocks went, then the 2 deepest of the middle prompt: its first 2 remain.
  EXPECT_TRUE(Matches(a, old_prompt).empty());
  EXPECT_EQ(Matches(a, mid_prompt), (std::map<WorkerKey, std::uint32_t>{{kA, 2}}));
  EXPECT_EQ(Matches(a, new_prompt), (std::map<WorkerKey, std::uint32_t>{{kA, 3}}));
}

TEST(ApproxIndex, RemovedWorkerLosesItsPredictionsOnly) {
  ApproxIndex a(seconds(120), 1000, 0.8);
  const Prompt p = MakePrompt(10, 3);
  a.Record({1, 0}, p.local, p.seq, kT0);
  a.Record({1, 1}, p.local, p.seq, kT0);
  a.Record(kB, p.local, p.seq, kT0);
  a.RemoveWorker(1);
  EXPECT_EQ(Matches(a, p), (std::map<WorkerKey, std::uint32_t>{{kB, 3}}));
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(a.Expire(kT0 + seconds(120)), 3u);  // no dangling entries of worker 1
}

TEST(ApproxIndex, ExpiryStaysRightAcrossMonthsOfUptime) {
  // Ages are kept in 32-bit milliseconds from a base that moves forward after 24.8 days.
  using Days = std::chrono::duration<std::int64_t, std::ratio<86400>>;
  ApproxIndex a(seconds(120), 1000, 0.8);
  const Prompt old_prompt = MakePrompt(10, 2);
  const Prompt new_prompt = MakePrompt(20, 3);
  a.Record(kA, old_prompt.local, old_prompt.seq, kT0);
  const SteadyTime later = kT0 + Days(30) + std::chrono::milliseconds(1);
  a.Record(kA, new_prompt.local, new_prompt.seq, later);
  EXPECT_EQ(a.Expire(later + seconds(119)), 2u);  // only the month-old blocks
  EXPECT_EQ(Matches(a, new_prompt), (std::map<WorkerKey, std::uint32_t>{{kA, 3}}));
  const SteadyTime much_later = later + Days(40);
  a.Record(kB, old_prompt.local, old_prompt.seq, much_later);
  EXPECT_EQ(a.Expire(much_later + seconds(119)), 3u);
  EXPECT_EQ(a.Expire(much_later + seconds(120)), 2u);
  EXPECT_EQ(a.size(), 0u);
}

TEST(ApproxIndex, AClockThatGoesBackExpiresNothing) {
  ApproxIndex a(seconds(120), 1000, 0.8);
  const Prompt p = MakePrompt(10, 2);
  a.Record(kA, p.local, p.seq, kT0 + seconds(500));
  EXPECT_EQ(a.Expire(kT0 + seconds(100)), 0u);
  EXPECT_EQ(a.Expire(kT0 + seconds(620)), 2u);
}

TEST(ApproxIndex, APredictionCostsAtMost40BytesBesideTheIndexAndExpiredOnesAreReused) {
  ApproxIndex a(seconds(120), 1 << 20, 0.8);
  for (LocalHash first = 0; first < 100'000; first += 100) {
    const Prompt p = MakePrompt(first * 1000, 100);
    a.Record({first % 7, 0}, p.local, p.seq, kT0);
  }
  ASSERT_EQ(a.size(), 100'000u);
  const std::size_t bytes = a.OwnBytes();
  EXPECT_LE(static_cast<double>(bytes) / a.size(), 40.0);
  EXPECT_EQ(a.Expire(kT0 + seconds(120)), 100'000u);
  for (LocalHash first = 0; first < 100'000; first += 100) {
    const Prompt p = MakePrompt(first * 1000 + 7, 100);
    a.Record({first % 7, 0}, p.local, p.seq, kT0 + seconds(200));
  }
  EXPECT_EQ(a.size(), 100'000u);
  EXPECT_LE(a.OwnBytes(), bytes);  // freed entries were reused, the table regrew to its size
}

}  // namespace
}  // namespace kvrouter
