#include "router/scheduling/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>

namespace kvrouter {
namespace {

constexpr WorkerKey kA{1, 0};
constexpr WorkerKey kB{2, 0};

RouteRequest Prompt(std::string id, std::uint32_t tokens, std::uint32_t first_token = 0) {
  RouteRequest r;
  r.request_id = std::move(id);
  r.token_ids.resize(tokens);
  std::iota(r.token_ids.begin(), r.token_ids.end(), first_token);
  r.has_token_ids = true;
  r.isl = tokens;
  return r;
}

class SchedulerTest : public ::testing::Test {
 protected:
  SchedulerOptions Options() {
    SchedulerOptions o;
    o.mode = RouterMode::kKv;
    o.block_size = 4;
    o.cost.block_size = 4;
    return o;
  }
  std::unique_ptr<Scheduler> Make(SchedulerOptions o) {
    return std::make_unique<Scheduler>(
        o, index_, [this] { return now_; }, 7);
  }
  PreparedRequest Prepared(const SchedulerOptions& o, const RouteRequest& r) {
    auto p = PrepareRequest(o, r);
    EXPECT_TRUE(p.ok()) << p.status().message();
    return *p;
  }
  // Books, teaches and frees n requests on `rank` alone, each observed to take `factor` times the
  // prior's time to first token; `step` passes between them. False if one was not booked.
  bool Teach(Scheduler& s, const SchedulerOptions& o, WorkerKey rank, double factor, int n = 40,
             std::chrono::milliseconds step = std::chrono::milliseconds(0)) {
    std::vector<RankInfo> only = {{.worker = rank}};
    for (int i = 0; i < n; ++i) {
      const RouteRequest r = Prompt("r" + std::to_string(rank.worker_id) + "-" + std::to_string(i), 64,
                                    static_cast<std::uint32_t>(i) * 1000);
      const PreparedRequest p = Prepared(o, r);
      OverlapScores none;
      auto d = s.Decide(r, p, s.Candidates(only, p.seq, none));
      const PriorTtft* prior = s.load().PriorOf(r.request_id);
      if (!d.ok() || !d->booked || prior == nullptr) return false;
      EXPECT_TRUE(s.Learn(r.request_id, {.ttfb_ms = factor * (prior->prefill_ms + prior->decode_ms)}));
      EXPECT_TRUE(s.load().Free(r.request_id));
      now_ += step;
    }
    return true;
  }
  std::vector<RankInfo> ranks_ = {{.worker = kA}, {.worker = kB}};
  ShardedIndex index_{{.num_shards = 1}};
  SteadyTime now_{};
};

TEST_F(SchedulerTest, PrepareRefusesAPromptOverTheLimit) {
  SchedulerOptions o = Options();
  o.max_prompt_tokens = 8;
  auto p = PrepareRequest(o, Prompt("r", 9));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(PrepareRequest(o, Prompt("r", 8)).ok());
}

TEST_F(SchedulerTest, PrepareRefusesBlockHashesThatDoNotFitTheirIsl) {
  RouteRequest r;
  r.isl = 5;  // two blocks of 4 at most
  r.block_hashes = {1, 2, 3};
  auto p = PrepareRequest(Options(), r);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  r.block_hashes = {1, 2};
  ASSERT_TRUE(PrepareRequest(Options(), r).ok());
}

TEST_F(SchedulerTest, DirectModeNeedsAPinnedWorker) {
  SchedulerOptions o = Options();
  o.mode = RouterMode::kDirect;
  RouteRequest r = Prompt("r", 8);
  EXPECT_EQ(PrepareRequest(o, r).status().code(), StatusCode::kInvalidArgument);
  r.worker_id = 1;
  EXPECT_TRUE(PrepareRequest(o, r).ok());
}

TEST_F(SchedulerTest, PrepareHashesWholeBlocksAndARequestsWeightsSelectDynamosFormula) {
  SchedulerOptions o = Options();
  o.cost.model = CostModel::kPredicted;
  RouteRequest r = Prompt("r", 10);  // 2 whole blocks of 4, 3 blocks to serve
  PreparedRequest p = Prepared(o, r);
  EXPECT_EQ(p.seq.size(), 2u);
  EXPECT_EQ(p.sel.isl, 10u);
  EXPECT_EQ(p.sel.request_blocks, 3u);
  EXPECT_EQ(p.params.model, CostModel::kPredicted);
  r.config_override.overlap_score_credit = 0.5;
  p = Prepared(o, r);
  EXPECT_EQ(p.params.model, CostModel::kKvBlocks);
  EXPECT_EQ(p.params.overlap_score_credit, 0.5);
}

TEST_F(SchedulerTest, CandidatesCarryTheirRanksOverlapAndLoad) {
  auto s = Make(Options());
  ASSERT_TRUE(s->load().Book("old", kA, std::vector<SequenceHash>{99}, 40, now_));
  OverlapScores overlaps;
  overlaps.push_back({.worker = kB, .blocks = 2});
  auto cands = s->Candidates(ranks_, {}, overlaps);
  ASSERT_EQ(cands.size(), 2u);
  EXPECT_EQ(cands[0].worker, kA);
  EXPECT_EQ(cands[0].overlap_blocks, 0u);
  EXPECT_EQ(cands[0].active_requests, 1u);
  EXPECT_EQ(cands[0].active_prefill_tokens, 40u);
  EXPECT_EQ(cands[1].worker, kB);
  EXPECT_EQ(cands[1].overlap_blocks, 2u);
  EXPECT_EQ(cands[1].active_requests, 0u);
}

TEST_F(SchedulerTest, OpenRanksDropsRanksAboveTheThresholdButNotAtIt) {
  SchedulerOptions o = Options();
  o.queue_threshold = 0.5;
  auto s = Make(o);
  std::vector<Candidate> cands(2);
  cands[0].worker = kA;
  cands[0].max_num_batched_tokens = 100;
  cands[0].active_prefill_tokens = 50;  // at the threshold: open
  cands[1].worker = kB;
  cands[1].max_num_batched_tokens = 100;
  cands[1].active_prefill_tokens = 51;
  auto open = s->OpenRanks(cands);
  ASSERT_EQ(open.size(), 1u);
  EXPECT_EQ(open[0].worker, kA);
  EXPECT_EQ(Make(Options())->OpenRanks(cands).size(), 2u);  // no threshold: nothing is full
}

TEST_F(SchedulerTest, DecideBooksTheUncachedPrefillOnTheChosenRank) {
  auto s = Make(Options());
  const RouteRequest r = Prompt("r", 12);
  const PreparedRequest p = Prepared(Options(), r);
  OverlapScores overlaps;
  overlaps.push_back({.worker = kB, .blocks = 2});
  auto cands = s->Candidates(ranks_, p.seq, overlaps);
  auto d = s->Decide(r, p, cands);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->worker, kB);
  EXPECT_EQ(d->overlap_blocks, 2u);
  EXPECT_TRUE(d->booked);
  EXPECT_EQ(s->load().Load(kB).active_prefill_tokens, 12u - 2 * 4);
  EXPECT_EQ(s->load().Load(kB).active_requests, 1u);
}

TEST_F(SchedulerTest, DecideBooksNothingWithoutStatesOrARequestId) {
  auto s = Make(Options());
  RouteRequest r = Prompt("r", 8);
  r.update_states = false;
  const PreparedRequest p = Prepared(Options(), r);
  OverlapScores none;
  auto d = s->Decide(r, p, s->Candidates(ranks_, p.seq, none));
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->booked);
  r = Prompt("", 8);
  d = s->Decide(r, p, s->Candidates(ranks_, p.seq, none));
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->booked);
  EXPECT_EQ(s->load().requests(), 0u);
}

TEST_F(SchedulerTest, DecideRefusesARequestIdBookedAlready) {
  auto s = Make(Options());
  const RouteRequest r = Prompt("r", 8);
  const PreparedRequest p = Prepared(Options(), r);
  OverlapScores none;
  ASSERT_TRUE(s->Decide(r, p, s->Candidates(ranks_, p.seq, none)).ok());
  auto again = s->Decide(r, p, s->Candidates(ranks_, p.seq, none));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->load().requests(), 1u);
}

TEST_F(SchedulerTest, BookingsPastTheBoundsAreOverloaded) {
  SchedulerOptions o = Options();
  o.max_active_requests = 1;
  auto s = Make(o);
  OverlapScores none;
  const RouteRequest first = Prompt("a", 8);
  const PreparedRequest p = Prepared(o, first);
  ASSERT_TRUE(s->Decide(first, p, s->Candidates(ranks_, p.seq, none)).ok());
  auto second = s->Decide(Prompt("b", 8), p, s->Candidates(ranks_, p.seq, none));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kOverloaded);

  o = Options();
  o.max_active_blocks = 3;
  auto blocks = Make(o);
  EXPECT_TRUE(blocks->BookingRoom(3).ok());
  EXPECT_EQ(blocks->BookingRoom(4).code(), StatusCode::kOverloaded);
}

TEST_F(SchedulerTest, InApproximateModeADecisionIsPredictedOnItsRank) {
  SchedulerOptions o = Options();
  o.predictions = SchedulerOptions::Predictions{};
  auto s = Make(o);
  const RouteRequest r = Prompt("r", 12);
  const PreparedRequest p = Prepared(o, r);
  OverlapScores overlaps;
  s->PredictedOverlaps(p, overlaps);
  EXPECT_TRUE(overlaps.empty());
  auto d = s->Decide(r, p, s->Candidates(ranks_, p.seq, overlaps));
  ASSERT_TRUE(d.ok());
  s->FreshOverlaps(p, overlaps);
  ASSERT_EQ(overlaps.size(), 1u);
  EXPECT_EQ(overlaps[0].worker, d->worker);
  EXPECT_EQ(overlaps[0].blocks, 3u);
  // Approximate mode never reads the event index.
  IndexOverlaps(o, index_, p, overlaps);
  EXPECT_TRUE(overlaps.empty());
  // The worker goes: its booking and its predictions with it.
  EXPECT_EQ(s->ForgetWorker(d->worker.worker_id), 1u);
  s->PredictedOverlaps(p, overlaps);
  EXPECT_TRUE(overlaps.empty());
  EXPECT_EQ(s->load().requests(), 0u);
}

TEST_F(SchedulerTest, AFreeWithTimingTeachesTheRankItWasBookedOnAndCandidatesCarryIt) {
  auto s = Make(Options());
  ASSERT_TRUE(Teach(*s, Options(), kA, 3));  // rank A takes three times the prior's time to first token
  EXPECT_NEAR(s->rates().Of(kA).prefill, 3, 0.3);
  OverlapScores none;
  const auto cands = s->Candidates(ranks_, Prepared(Options(), Prompt("x", 8)).seq, none);
  EXPECT_NEAR(cands[0].prefill_factor, 3, 0.3);
  EXPECT_FALSE(s->Learn("unknown", {.ttfb_ms = 5}));
  s->ForgetWorker(kA.worker_id);
  EXPECT_EQ(s->rates().Of(kA).observations, 0u);
}

TEST_F(SchedulerTest, AFastRanksRecentRequestsCountByItsSpeedPastTheFleetsScatter) {
  auto s = Make(Options());
  // 40 requests on each of six ranks, each taking `factor` times the prior's time.
  const std::vector<std::pair<WorkerKey, double>> fleet = {{{1, 0}, 0.1}, {{2, 0}, 0.4}, {{3, 0}, 0.6},
                                                           {{4, 0}, 0.8}, {{5, 0}, 1.0}, {{6, 0}, 1.0}};
  std::vector<RankInfo> all;
  for (const auto& [rank, factor] : fleet) {
    all.push_back({.worker = rank});
    ASSERT_TRUE(Teach(*s, Options(), rank, factor));
  }
  now_ += std::chrono::seconds(1);
  EXPECT_FALSE(s->Learn("none", {}));  // the fleet's typical factor is taken again (once a second)
  OverlapScores none;
  const auto cands = s->Candidates(all, Prepared(Options(), Prompt("x", 8)).seq, none);
  ASSERT_EQ(cands.size(), 6u);
  const double whole = cands[5].recent_requests;  // 40 requests a second old, counted plainly
  EXPECT_NEAR(whole, 40, 1);
  // The typical factor is the median, about 0.69. Rank 2 (0.4) counts each request by its speed,
  // about 0.58 of one; rank 1 (0.1, a seventh of the typical) a quarter, the least; rank 3 (0.6)
  // is faster but within the learning's scatter, and ranks 4 to 6, slower, count plainly.
  const double typical = s->rates().Typical().prefill;
  EXPECT_NEAR(typical, std::sqrt(0.6 * 0.8), 0.02);
  EXPECT_DOUBLE_EQ(cands[0].recent_requests, whole * 0.25);
  EXPECT_NEAR(cands[1].recent_requests, whole * s->rates().Of(fleet[1].first).prefill / typical, 1e-9);
  EXPECT_LT(cands[1].recent_requests, 0.65 * whole);
  EXPECT_GT(cands[1].recent_requests, 0.5 * whole);
  for (std::size_t k = 2; k < 5; ++k) EXPECT_DOUBLE_EQ(cands[k].recent_requests, whole) << "rank " << k + 1;
}

TEST_F(SchedulerTest, TheSpreadIsPricedInTheFleetsTimeAtMostHalvedNeverRaised) {
  SchedulerOptions o = Options();
  o.cost.model = CostModel::kPredicted;
  // The scale PriceSpread gives a request once rank A (the fleet's only observed rank) is learned
  // to take `factor` times the prior's time to first token.
  auto scale_after = [&](double factor) {
    auto s = Make(o);
    // 100 ms apart: the fleet's typical factor is taken again each second.
    if (!Teach(*s, o, kA, factor, 40, std::chrono::milliseconds(100))) return -1.0;
    PreparedRequest p = Prepared(o, Prompt("x", 8));
    s->PriceSpread(p);
    return p.params.spread_scale;
  };
  EXPECT_EQ(scale_after(1), 1.0);
  EXPECT_NEAR(scale_after(0.7), 0.7, 0.07);  // a fleet faster than the prior: its factor
  EXPECT_EQ(scale_after(0.1), 0.5);          // at most halved
  EXPECT_EQ(scale_after(3), 1.0);            // a slower fleet's hits are worth more: unchanged
  // Nothing learned, or Dynamo's formula (no spread term): 1.
  auto fresh = Make(o);
  PreparedRequest p = Prepared(o, Prompt("x", 8));
  fresh->PriceSpread(p);
  EXPECT_EQ(p.params.spread_scale, 1.0);
  o.cost.model = CostModel::kKvBlocks;
  EXPECT_EQ(scale_after(0.1), 1.0);
}

// Mode kv over blocks of 4 tokens, priced by `model`, the queue on at threshold 0.5 or off.
SchedulerOptions KvOptions(CostModel model, bool queue) {
  SchedulerOptions o;
  o.mode = RouterMode::kKv;
  o.block_size = 4;
  o.cost.block_size = 4;
  o.cost.model = model;
  if (queue) o.queue_threshold = 0.5;
  return o;
}

// One request decided both ways: by the full scan (Candidates, OpenRanks, Decide) over
// `overlaps`, and by `pick` (wide's PickFromFleet, however it reads the index) then wide's Decide.
// Expects the same best overlap, rank, overlaps, booking and prior; returns whether the request
// was booked, or nullopt when nothing was decided (or the two differ).
std::optional<bool> DecideBothWays(Scheduler& full, Scheduler& wide, const std::vector<RankInfo>& all,
                                   const RouteRequest& r, const PreparedRequest& p, OverlapScores& overlaps,
                                   bool open_only,
                                   const std::function<Scheduler::FleetChoice(Scheduler::FullRanks)>& pick) {
  std::vector<Candidate> cands = full.Candidates(all, p.seq, overlaps);
  std::uint32_t best_overlap = 0;
  for (const Candidate& c : cands) best_overlap = std::max(best_overlap, c.overlap_blocks);
  if (open_only) cands = full.OpenRanks(std::move(cands));
  const Scheduler::FleetChoice choice =
      pick(open_only ? Scheduler::FullRanks::kExcluded : Scheduler::FullRanks::kIncluded);
  EXPECT_EQ(choice.best_overlap, best_overlap);
  EXPECT_EQ(choice.chosen.has_value(), !cands.empty());
  if (cands.empty() || !choice.chosen) return std::nullopt;
  auto a = full.Decide(r, p, cands);
  auto b = wide.Decide(r, p, {&*choice.chosen, 1});
  EXPECT_EQ(a.ok(), b.ok());
  if (!a.ok() || !b.ok()) return std::nullopt;
  EXPECT_EQ(a->worker, b->worker);
  EXPECT_EQ(a->overlap_by_tier, b->overlap_by_tier);
  EXPECT_EQ(a->booked, b->booked);
  if (a->worker != b->worker || a->booked != b->booked) return std::nullopt;
  if (a->booked) {
    const PriorTtft* pa = full.load().PriorOf(r.request_id);
    const PriorTtft* pb = wide.load().PriorOf(r.request_id);
    EXPECT_TRUE(pa != nullptr && pb != nullptr);
    if (pa != nullptr && pb != nullptr) {
      EXPECT_EQ(pa->prefill_ms, pb->prefill_ms);
    }
  }
  return a->booked;
}

// Now and then (one call in three) one of `booked` moves on alike in both schedulers: it may
// teach its rank a timing (4x or half the prior), then is prefilled or ends.
void MoveOneOnBothWays(Scheduler& full, Scheduler& wide, std::vector<std::string>& booked,
                       const std::function<std::uint64_t(std::uint64_t, std::uint64_t)>& uniform) {
  if (booked.empty() || uniform(0, 2) != 0) return;
  const std::size_t i = uniform(0, booked.size() - 1);
  const PriorTtft* prior = full.load().PriorOf(booked[i]);
  if (prior != nullptr && uniform(0, 1) == 0) {
    const ResponseTiming timing{.ttfb_ms = (prior->prefill_ms + prior->decode_ms) * (uniform(0, 1) ? 4 : 0.5)};
    EXPECT_EQ(full.Learn(booked[i], timing), wide.Learn(booked[i], timing));
  }
  if (uniform(0, 1) == 0) {
    EXPECT_EQ(full.load().MarkPrefill(booked[i]), wide.load().MarkPrefill(booked[i]));
  } else {
    EXPECT_TRUE(full.load().Free(booked[i]));
    EXPECT_TRUE(wide.load().Free(booked[i]));
    booked.erase(booked.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

// PickFromFleet against the full scan (Candidates, OpenRanks, Decide) on random fleets: ranks of a
// few registration classes (one with max_num_batched_tokens 0), replaced now and then by another
// list (ranks come and go, booked and learned ones among them); random overlaps on device, host
// and disk, some of ranks that are not registered; bookings, mark_prefills, frees, learned rates
// and their drift; both cost models, requests that set Dynamo's weights (credit 0 makes matched
// ranks tie with idle ones; 1e308 makes costs infinite); with and without the queue. Two
// schedulers of the same seed must choose the same rank every time, with the same draws, so
// that their loads stay equal.
TEST(PickFromFleet, ChoosesWhatTheFullScanChoosesOnRandomFleetsLoadsAndPrompts) {
  ShardedIndex index{{.num_shards = 1}};
  std::uint64_t class_picks = 0;
  std::size_t decided = 0;
  for (std::uint64_t trial = 0; trial < 160; ++trial) {
    std::mt19937_64 rng(trial);
    auto uniform = [&](std::uint64_t lo, std::uint64_t hi) {
      return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng);
    };
    const SchedulerOptions o = KvOptions(trial % 2 == 0 ? CostModel::kPredicted : CostModel::kKvBlocks, trial % 3 == 0);
    const std::uint64_t kinds = uniform(1, 4);
    auto fleet = [&] {
      auto ranks = std::make_shared<std::vector<RankInfo>>();
      const std::uint64_t n = trial % 4 == 0 ? uniform(1, 8) : uniform(60, 300);
      for (std::uint64_t w = 1; ranks->size() < n; w += uniform(1, 3)) {
        for (std::uint32_t dp = 0; dp < 2 && ranks->size() < n; ++dp) {
          if (dp == 1 && uniform(0, 1) == 0) continue;
          const std::uint64_t kind = uniform(0, kinds - 1);
          ranks->push_back({.worker = {w, dp},
                            .is_cpu = uniform(0, 1) == 0,
                            .max_num_seqs = static_cast<std::uint32_t>(uniform(1, 4)),
                            .max_num_batched_tokens = kind == 1 ? 32u : (kind == 3 ? 0u : 8192u),
                            .total_kv_blocks = kind == 2 ? 64u : 0u});
        }
      }
      return std::shared_ptr<const std::vector<RankInfo>>(ranks);
    };
    std::shared_ptr<const std::vector<RankInfo>> all = fleet();
    SteadyTime now{};
    Scheduler full(
        o, index, [&] { return now; }, trial);
    Scheduler wide(
        o, index, [&] { return now; }, trial);
    std::vector<std::string> booked;
    for (int step = 0; step < 80; ++step) {
      if (uniform(0, 9) == 0) all = fleet();
      now += std::chrono::milliseconds(uniform(0, 3000));
      RouteRequest r = Prompt("t" + std::to_string(trial) + "-" + std::to_string(step),
                              static_cast<std::uint32_t>(uniform(1, 48)), static_cast<std::uint32_t>(uniform(0, 2)));
      r.update_states = uniform(0, 3) != 0;
      switch (uniform(0, 5)) {
        case 0: r.config_override.overlap_score_credit = 0; break;
        case 1: r.config_override.prefill_load_scale = 0; break;
        case 2: r.config_override.prefill_load_scale = 1e308; break;
        default: break;
      }
      const PreparedRequest p = *PrepareRequest(o, r);
      OverlapScores overlaps;
      // Device, device and host, host only, or all three tiers.
      auto match = [&](WorkerKey k) {
        const auto blocks = static_cast<std::uint32_t>(uniform(1, p.sel.request_blocks + 1));
        const std::uint64_t shape = uniform(0, 5);
        if (shape != 4) overlaps.push_back({.worker = k, .blocks = blocks});
        if (shape >= 3) {
          overlaps.push_back({.worker = {k.worker_id, k.dp_rank | kHostTierRank},
                              .blocks = blocks + static_cast<std::uint32_t>(uniform(0, 2))});
        }
        if (shape >= 4) {
          overlaps.push_back({.worker = {k.worker_id, k.dp_rank | kDiskTierRank},
                              .blocks = blocks + static_cast<std::uint32_t>(uniform(0, 3))});
        }
      };
      const std::uint64_t match_one_in = step % 3 == 0 ? 0 : uniform(2, 40);  // 0: the index matches none
      for (const RankInfo& rank : *all) {
        if (match_one_in != 0 && uniform(1, match_one_in) == 1) match(rank.worker);
      }
      if (match_one_in != 0) match({uniform(1000, 2000), 0});  // an event-only worker
      std::shuffle(overlaps.begin(), overlaps.end(), rng);
      OverlapScores overlaps2 = overlaps;
      const bool open_only = uniform(0, 4) != 0;

      const std::optional<bool> both =
          DecideBothWays(full, wide, *all, r, p, overlaps, open_only,
                         [&](auto full_ranks) { return wide.PickFromFleet(all, p, overlaps2, full_ranks); });
      ASSERT_FALSE(::testing::Test::HasFailure()) << "trial " << trial << " step " << step;
      if (!both) continue;
      ++decided;
      if (*both) booked.push_back(r.request_id);
      MoveOneOnBothWays(full, wide, booked, uniform);
      ASSERT_FALSE(::testing::Test::HasFailure()) << "trial " << trial << " step " << step;
      if (uniform(0, 30) == 0) {
        full.DriftRates(now);
        wide.DriftRates(now);
      }
    }
    class_picks += wide.class_picks();
  }
  EXPECT_GT(decided, 8000u);
  EXPECT_GT(class_picks, 4000u);  // most decisions were made by classes, not by the fallback
}

// PickFromFleet from the index's runs against the full scan over the same runs translated, on a
// real index of two shards: random fleets of a few classes where most ranks hold a shared
// prefix to one of several depths (crowds of thousands in miniature: runs of kCrowd slots and
// more, nested where a crowd copied whole holds a deeper one), some of them booked or learned
// (special ranks inside crowds), holders that are not registered, now and then a rank's
// host-tier blocks (the fallback), workers removed and their slots given to others (crowds
// translated again), ranks evicting a block under others' deeper ones (orphan risk), and the
// registered list replaced; runs read with the crowds' stamps (elided), now and then stale ones.
// Same choice, same overlap, same draws.
TEST(PickFromFleet, FromTheIndexsRunsCountsCrowdsAndChoosesWhatTheFullScanChooses) {
  std::uint64_t translated = 0, reused = 0, elided = 0;
  std::size_t decided = 0;
  for (std::uint64_t trial = 0; trial < 24; ++trial) {
    std::mt19937_64 rng(1000 + trial);
    auto uniform = [&](std::uint64_t lo, std::uint64_t hi) {
      return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng);
    };
    ShardedIndex index{{.num_shards = 2}};
    const SchedulerOptions o = KvOptions(trial % 3 == 0 ? CostModel::kPredicted : CostModel::kKvBlocks, trial % 4 == 1);
    const std::uint64_t kinds = uniform(1, 3);
    std::vector<std::uint32_t> base(48);
    std::iota(base.begin(), base.end(), static_cast<std::uint32_t>(trial * 1000));
    const std::uint32_t depths[] = {2, 5, 9, 12};
    std::map<WorkerKey, std::uint64_t> event_ids;
    // The first `blocks` blocks of the shared prefix on the rank (host tier: as an offloading
    // engine stores them).
    auto store = [&](WorkerKey k, std::uint32_t blocks, StorageTier tier = StorageTier::kDevice) {
      KvEventBatch b = StoredPromptBatch(k.worker_id, ++event_ids[k], std::span(base).first(blocks * 4), 4);
      b.dp_rank = k.dp_rank;
      for (KvOp& op : b.ops) op.tier = tier;
      ASSERT_TRUE(index.Submit(std::move(b)));
    };
    // The rank's block at `blocks` removed (an engine evicting it): where other ranks hold the
    // prefix deeper, its node gets orphan risk and reads check their subsets there.
    auto evict = [&](WorkerKey k, std::uint32_t blocks) {
      KvEventBatch b = StoredPromptBatch(k.worker_id, ++event_ids[k], std::span(base).first(blocks * 4), 4);
      const BlockHash last = std::get<KvStored>(b.ops.at(0).data).blocks.back().block_hash;
      b.dp_rank = k.dp_rank;
      b.ops = {KvOp{.data = KvRemoved{.block_hashes = {last}}}};
      ASSERT_TRUE(index.Submit(std::move(b)));
    };
    auto fleet = [&](std::uint64_t first_worker) {
      auto ranks = std::make_shared<std::vector<RankInfo>>();
      const std::uint64_t n = uniform(150, 500);
      for (std::uint64_t w = first_worker; ranks->size() < n; ++w) {
        for (std::uint32_t dp = 0; dp < 2 && ranks->size() < n; ++dp) {
          if (dp == 1 && uniform(0, 1) == 0) continue;
          const std::uint64_t kind = uniform(0, kinds - 1);
          ranks->push_back({.worker = {w, dp},
                            .max_num_seqs = 4,
                            .max_num_batched_tokens = kind == 1 ? 32u : 8192u,
                            .total_kv_blocks = kind == 2 ? 64u : 0u});
        }
      }
      return std::shared_ptr<const std::vector<RankInfo>>(ranks);
    };
    // Odd trials: each depth held by 40 % of the ranks holding the one before, so a crowd is
    // copied whole where most of it drops out, and the next crowd is inside it.
    const bool nested = trial % 2 == 1;
    auto depth = [&] {
      if (!nested) return depths[std::min<std::uint64_t>(uniform(0, 4), 3)];
      std::size_t d = 0;
      while (d < 3 && uniform(0, 9) < 4) ++d;
      return depths[d];
    };
    auto fill = [&](const std::vector<RankInfo>& ranks) {
      const std::uint64_t holds_one_in = nested ? 1 : uniform(1, 3);  // most, or about a third
      for (const RankInfo& r : ranks) {
        if (uniform(1, holds_one_in) != 1) continue;
        store(r.worker, depth());
        if (trial % 6 == 5 && uniform(0, 60) == 0) store(r.worker, depths[uniform(0, 3)], StorageTier::kHostPinned);
      }
      for (std::uint64_t w = 0; w < 20; ++w) store({90'000 + w, 0}, depths[uniform(0, 3)]);  // not registered
      index.Flush();
    };
    std::shared_ptr<const std::vector<RankInfo>> all = fleet(1);
    fill(*all);
    SteadyTime now{};
    Scheduler full(
        o, index, [&] { return now; }, trial);
    Scheduler wide(
        o, index, [&] { return now; }, trial);
    std::vector<std::string> booked;
    IndexMatches runs, whole;
    OverlapScores overlaps, scratch;
    // The crowds' stamps as a route thread passes them: kept at the last decision, or older
    // (evicted since, or of a set changed since: read again, the same choice).
    std::vector<std::uint64_t> known, older;
    for (int step = 0; step < 120; ++step) {
      if (uniform(0, 40) == 0) all = fleet(uniform(1, 3));  // another list: the crowds are translated again
      if (uniform(0, 15) == 0) {
        // A worker leaves the index and another takes its slot: every crowd of its shard is stale.
        const WorkerKey gone = (*all)[uniform(0, all->size() - 1)].worker;
        index.RemoveWorker(gone.worker_id);
        index.Flush();
        store({gone.worker_id + 50'000, 0}, depths[uniform(0, 3)]);
        index.Flush();
      }
      if (uniform(0, 10) == 0) {
        evict((*all)[uniform(0, all->size() - 1)].worker, depths[uniform(0, 2)]);
        index.Flush();
      }
      now += std::chrono::milliseconds(uniform(0, 2000));
      RouteRequest r = Prompt("c" + std::to_string(trial) + "-" + std::to_string(step), 1);
      const auto shared = static_cast<std::uint32_t>(uniform(1, 12) * 4);
      r.token_ids.assign(base.begin(), base.begin() + shared);
      for (std::uint64_t t = uniform(0, 12); t > 0; --t)
        r.token_ids.push_back(static_cast<std::uint32_t>(uniform(1, 1 << 20)));
      r.isl = static_cast<std::uint32_t>(r.token_ids.size());
      r.update_states = uniform(0, 3) != 0;
      if (uniform(0, 5) == 0) r.config_override.overlap_score_credit = 0;  // crowds tie with idle ranks
      const PreparedRequest p = *PrepareRequest(o, r);
      const std::uint64_t read = uniform(0, 5);  // 0-2: every slot; 3-4: with the stamps kept; 5: older ones
      ASSERT_TRUE(IndexRuns(o, index, p, whole));
      ASSERT_TRUE(IndexRuns(o, index, p, runs, read < 3 ? std::span<const std::uint64_t>{} : read < 5 ? known : older));
      if (read >= 3) {
        for (const MatchRuns& m : runs.shards) {
          for (const MatchRuns::Run& run : m.runs) elided += run.elided != 0;
        }
      }
      if (read == 0) {
        // As a read racing a writer may see them: a few slots of deeper runs in a shallower one
        // of their own (a slot's overlap is the deepest run holding it).
        for (MatchRuns& m : runs.shards) {
          if (m.slots.empty() || m.runs.front().depth < 2) continue;
          std::vector<std::uint32_t> early;
          for (std::uint64_t i = uniform(1, 5); i > 0; --i) early.push_back(m.slots[uniform(0, m.slots.size() - 1)]);
          std::sort(early.begin(), early.end());
          early.erase(std::unique(early.begin(), early.end()), early.end());
          m.slots.insert(m.slots.begin(), early.begin(), early.end());
          for (MatchRuns::Run& run : m.runs) run.end += static_cast<std::uint32_t>(early.size());
          m.runs.insert(m.runs.begin(), {static_cast<std::uint32_t>(early.size()), 1});
        }
      }
      overlaps.clear();
      ASSERT_TRUE(index.TranslateMatches(read < 3 ? runs : whole, overlaps));
      const bool open_only = uniform(0, 4) != 0;

      const std::optional<bool> both =
          DecideBothWays(full, wide, *all, r, p, overlaps, open_only,
                         [&](auto full_ranks) { return wide.PickFromFleet(all, p, runs, scratch, full_ranks); });
      ASSERT_FALSE(::testing::Test::HasFailure()) << "trial " << trial << " step " << step;
      if (uniform(0, 8) == 0) older = known;
      wide.CrowdStamps(known);
      if (!both) continue;
      ++decided;
      if (*both) booked.push_back(r.request_id);
      MoveOneOnBothWays(full, wide, booked, uniform);
      ASSERT_FALSE(::testing::Test::HasFailure()) << "trial " << trial << " step " << step;
    }
    translated += wide.crowds_translated();
    reused += wide.crowds_reused();
  }
  EXPECT_GT(decided, 2000u);
  EXPECT_GT(translated, 50u);
  EXPECT_GT(reused, 2 * translated);  // most crowds were met translated already
  EXPECT_GT(elided, 200u);
}

// Under Dynamo's formula a rank whose requests have all ended costs what an idle one costs, so
// booking traffic does not send the decisions back to the full scan; the predicted cost reads the
// ranks' recent requests, so there the booked ranks are priced one by one until the full scan is
// cheaper.
TEST(PickFromFleet, UnderDynamosFormulaRanksWhoseRequestsEndedStayOutOfTheFullScan) {
  ShardedIndex index{{.num_shards = 1}};
  auto ranks = std::make_shared<std::vector<RankInfo>>();
  for (std::uint64_t w = 1; w <= 1000; ++w) ranks->push_back({.worker = {w, 0}});
  const std::shared_ptr<const std::vector<RankInfo>> all = ranks;
  for (const CostModel model : {CostModel::kKvBlocks, CostModel::kPredicted}) {
    SchedulerOptions o;
    o.mode = RouterMode::kKv;
    o.block_size = 4;
    o.cost.block_size = 4;
    o.cost.model = model;
    SteadyTime now{};
    Scheduler s(
        o, index, [&] { return now; }, 1);
    constexpr int kRoutes = 2000;
    for (int i = 0; i < kRoutes; ++i) {
      now += std::chrono::milliseconds(50);
      const RouteRequest r = Prompt("r" + std::to_string(i), 64, static_cast<std::uint32_t>(i) * 100);
      const PreparedRequest p = *PrepareRequest(o, r);
      OverlapScores none;
      const auto choice = s.PickFromFleet(all, p, none, Scheduler::FullRanks::kExcluded);
      ASSERT_TRUE(choice.chosen);
      ASSERT_TRUE(s.Decide(r, p, {&*choice.chosen, 1}).ok());
      ASSERT_TRUE(s.load().Free(r.request_id));  // every request ends at once
    }
    EXPECT_GT(s.load().workers(), 500u);  // most ranks were booked once
    if (model == CostModel::kKvBlocks) {
      EXPECT_EQ(s.class_picks(), std::uint64_t{kRoutes});
    } else {
      EXPECT_LT(s.class_picks(), std::uint64_t{kRoutes});
    }
  }
}

}  // namespace
}  // namespace kvrouter
