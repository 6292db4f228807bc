#include "router/scheduling/selector.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace kvrouter {
namespace {

using prior::DecodeStepMs;
using prior::kStepOverheadMs;
using prior::PrefillMs;

// A candidate with `prefill` active prefill blocks and `decode` active decode blocks.
Candidate Loaded(std::uint64_t id, double prefill_blocks, std::uint64_t decode_blocks, std::uint32_t bs = 64) {
  Candidate c;
  c.worker = {id, 0};
  c.active_prefill_tokens = static_cast<std::uint64_t>(prefill_blocks * bs);
  c.active_blocks = decode_blocks;
  return c;
}

TEST(KvBlocksCost, TableOfCases) {
  struct Case {
    const char* name;
    Candidate c;
    SelectionRequest req;
    CostParams p;
    double want;
  };
  Candidate overlap4 = Loaded(1, 0, 0);
  overlap4.overlap_blocks = 4;
  Candidate busy = Loaded(1, 2, 10);
  Candidate active_prefix = Loaded(1, 0, 6);
  active_prefix.active_prefix_blocks = 3;
  const std::vector<Case> cases = {
      {"idle, 4-block prompt", Loaded(1, 0, 0), {256, 4}, {}, 4 + 4},
      {"cached prefix credits prefill", overlap4, {256, 4}, {}, 0 + 4},
      {"credit never makes prefill negative", overlap4, {128, 2}, {}, 0 + 2},
      {"half credit", overlap4, {256, 4}, {.overlap_score_credit = 0.5}, 2 + 4},
      {"active prefill and decode load", busy, {128, 2}, {}, (2 + 2) + (10 + 2)},
      {"prefill scale", busy, {128, 2}, {.prefill_load_scale = 2}, 2 * 4 + 12},
      {"untracked prefill keeps the prompt", busy, {128, 2}, {.track_prefill_tokens = false}, 2 + 12},
      {"partial block divides exactly", Loaded(1, 0, 0), {96, 2}, {}, 1.5 + 2},
      {"active prefix is not double-counted", active_prefix, {256, 4}, {}, 4 + (6 + 4 - 3)},
  };
  for (const Case& k : cases) {
    EXPECT_DOUBLE_EQ(KvBlocksCost::Price(k.c, k.req, k.p), k.want) << k.name;
  }
}

// The overlap credited per tier (candidate.h), then the predicted cost (cost_predicted.h) case by
// case: 64-token blocks, 16,384-block workers and an 8,192-token step budget unless a case says
// otherwise.
TEST(CreditedBlocks, EachTierBeyondTheOneBeforeAtItsWeight) {
  const CostParams p{.host_weight = 0.75, .disk_weight = 0.25};
  Candidate c;
  c.overlap_blocks = 4;
  EXPECT_EQ(CreditedBlocks(c, p), 4.0);  // nothing off device (cumulative counts left 0)
  c.host_overlap_blocks = 10;
  EXPECT_EQ(CreditedBlocks(c, p), 4 + 0.75 * 6);
  c.any_overlap_blocks = 14;
  EXPECT_EQ(CreditedBlocks(c, p), 4 + 0.75 * 6 + 0.25 * 4);
  c.host_overlap_blocks = 0;  // on disk only beyond the device
  EXPECT_EQ(CreditedBlocks(c, p), 4 + 0.25 * 10);
  // Dynamo's formula credits the weighted overlap; the predicted cost prefills what is not.
  Candidate device = Loaded(1, 0, 0);
  device.overlap_blocks = 10;
  Candidate host = Loaded(2, 0, 0);
  host.host_overlap_blocks = 10;
  EXPECT_NEAR(KvBlocksCost::Price(host, {640, 10}, p) - KvBlocksCost::Price(device, {640, 10}, p), 0.25 * 10, 1e-9);
  const CostParams predicted{.model = CostModel::kPredicted};
  EXPECT_LT(PredictedCostMs(device, {640, 10}, predicted), PredictedCostMs(host, {640, 10}, predicted));
  EXPECT_LT(PredictedCostMs(host, {640, 10}, predicted), PredictedCostMs(Loaded(3, 0, 0), {640, 10}, predicted));
}

TEST(PredictedCost, TableOfCases) {
  struct Case {
    const char* name;
    Candidate c;
    SelectionRequest req;
    CostParams p;
    double recent_excess;
    double want;
  };
  const CostParams kP{.model = CostModel::kPredicted};
  const SelectionRequest k4096{4096, 64};
  auto ttft = [](double queued, double queued_sq, double uncached, double steps, double u) {
    return 0.0152 * (queued + uncached) + 4.21e-7 * (queued_sq + uncached * uncached) +
           steps * (16.5 + DecodeStepMs(u));
  };
  Candidate idle = Loaded(1, 0, 0);
  Candidate cached = idle;
  cached.overlap_blocks = 48;
  Candidate in_flight = idle;
  in_flight.active_prefix_blocks = 48;  // being prefilled there now: counts as cached
  Candidate queued = Loaded(1, 0, 0);
  queued.active_prefill_tokens = 6000;
  queued.active_prefill_squares = 6000ull * 6000ull;
  Candidate running = Loaded(1, 0, 3000);
  running.active_requests = 5;
  Candidate crowded = idle;
  crowded.active_requests = 200;  // 200 * 69 ms of prefill inflicted is over 8 * 92 ms
  Candidate small_cache = idle;
  small_cache.total_kv_blocks = 128;
  const std::vector<Case> cases = {
      {"idle", idle, k4096, kP, 0, ttft(0, 0, 4096, 1, 64.0 / 16384)},
      {"a cached prefix is not prefilled", cached, k4096, kP, 0, ttft(0, 0, 1024, 1, 64.0 / 16384)},
      {"a prefix in flight there counts as cached", in_flight, k4096, kP, 0, ttft(0, 0, 1024, 1, 16.0 / 16384)},
      {"queued prefill is waited for, one more step past the budget", queued, k4096, kP, 0,
       ttft(6000, 36e6, 4096, 2, 64.0 / 16384)},
      {"untracked prefill is not",
       queued,
       k4096,
       {.model = CostModel::kPredicted, .track_prefill_tokens = false},
       0,
       ttft(0, 0, 4096, 1, 64.0 / 16384)},
      {"running requests wait out the prefill", running, k4096, kP, 0,
       ttft(0, 0, 4096, 1, 3064.0 / 16384) + 5 * (PrefillMs(4096) - 16.5)},
      {"the waits inflicted count up to 8 times the request's own ttft", crowded, k4096, kP, 0,
       9 * ttft(0, 0, 4096, 1, 64.0 / 16384)},
      {"utilisation is of the announced cache, at most 1", small_cache, k4096, kP, 0, ttft(0, 0, 4096, 1, 0.5)},
      {"recent excess spreads", idle, k4096, kP, 3, ttft(0, 0, 4096, 1, 64.0 / 16384) + 3 * 10},
      {"a small prefill spreads less",
       idle,
       {64, 1},
       kP,
       3,
       ttft(0, 0, 64, 1, 1.0 / 16384) + 3 * 0.15 * (PrefillMs(64) - 16.5)},
      {"a cached prompt spreads as much as an uncached one", cached, k4096, kP, 3,
       ttft(0, 0, 1024, 1, 64.0 / 16384) + 3 * 10},
      {"the spread at its scale",
       idle,
       k4096,
       {.model = CostModel::kPredicted, .spread_scale = 0.5},
       3,
       ttft(0, 0, 4096, 1, 64.0 / 16384) + 3 * 10 * 0.5},
      {"an empty request", idle, {0, 0}, kP, 0, ttft(0, 0, 0, 1, 0)},
  };
  for (const Case& k : cases) {
    EXPECT_NEAR(PredictedCostMs(k.c, k.req, k.p, k.recent_excess), k.want, 1e-9) << k.name;
  }
}

TEST(PredictedCost, RecentExcessIsAboveTheMeanOrAColdIdleWorkersShortfall) {
  Candidate c = Loaded(1, 0, 0);
  auto excess = [&](double recent, std::uint32_t active, double mean) {
    c.recent_requests = recent;
    c.active_requests = active;
    return RecentExcess(c, mean);
  };
  EXPECT_DOUBLE_EQ(excess(6, 0, 4), 2);  // above the mean: its excess
  EXPECT_DOUBLE_EQ(excess(7, 0, 4), 3);
  EXPECT_DOUBLE_EQ(excess(9, 0, 4), 5);
  EXPECT_DOUBLE_EQ(excess(40, 2, 4), 5);  // at most five requests' worth
  EXPECT_DOUBLE_EQ(excess(3, 0, 4), 0);   // below it, but not under half
  EXPECT_DOUBLE_EQ(excess(2, 0, 4), 0);   // half exactly
  EXPECT_DOUBLE_EQ(excess(0, 0, 4), -2);  // idle and under half: its shortfall from half
  EXPECT_DOUBLE_EQ(excess(1, 0, 4), -1);
  EXPECT_DOUBLE_EQ(excess(2, 0, 20), -3);  // at most three requests' worth
  EXPECT_DOUBLE_EQ(excess(0, 1, 4), 0);    // running a request: no credit
  EXPECT_DOUBLE_EQ(excess(0, 0, 0), 0);    // nothing recent anywhere
}

// The first sessions of a fleet: three workers hold the system prompt (a fifth of this new
// session's prompt) and got 5, 6 and 7 requests lately; a fourth is idle and got none. The cached
// prefix saves more than the least used warm worker's excess costs, so without the cold worker's
// shortfall it would stay cold while every new session went where the system prompt is.
TEST(PredictedCost, AColdIdleWorkerDrawsANewSessionFromPeersHoldingTheSharedPrefix) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0), Loaded(4, 0, 0)};
  for (int w = 0; w < 3; ++w) {
    c[w].overlap_blocks = 16;
    c[w].recent_requests = 5 + w;
  }
  const SelectionRequest first_turn{5120, 80};
  const CostParams p{.model = CostModel::kPredicted};
  const double mean = 18.0 / 4;
  const KvPricing pricing = KvPricingOf(first_turn, p, 18, 4);
  EXPECT_LT(PickCost(c[3], first_turn, p, pricing), PickCost(c[0], first_turn, p, pricing));
  // Priced by the excess alone the warm worker wins: the cold one's credit decides.
  EXPECT_LT(PredictedCostMs(c[0], first_turn, p, 5 - mean), PredictedCostMs(c[3], first_turn, p, 0));
  Selector sel;
  std::mt19937_64 rng(1);
  EXPECT_EQ(sel.Pick(RouterMode::kKv, first_turn, c, p, rng), 3u);
  // Running a request, it gets no credit: few recent requests there may be a long prompt.
  c[3].active_requests = 1;
  EXPECT_EQ(sel.Pick(RouterMode::kKv, first_turn, c, p, rng), 0u);
}

// Decisions where the predicted cost and Dynamo's formula at scale 1 part ways.
TEST(PredictedCost, StaysWithTheCacheWhereDynamosFormulaChasesDecodeLoad) {
  // 6,400-token prompt: worker 1 holds 90 of its 100 blocks and decodes 1,500 blocks; worker 2
  // is idle. Dynamo at scale 1: 10 + 1500 + 100 against 100 + 100 -> the idle one, re-prefilling.
  std::vector<Candidate> c = {Loaded(1, 0, 1500), Loaded(2, 0, 0)};
  c[0].overlap_blocks = 90;
  c[0].active_requests = 3;
  Selector sel;
  std::mt19937_64 rng(1);
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {6400, 100}, c, {.model = CostModel::kKvBlocks}, rng), 1u);
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {6400, 100}, c, {.model = CostModel::kPredicted}, rng), 0u);
}

TEST(PredictedCost, AffinityYieldsToAWorkerThatIsBusyEnough) {
  // The cached worker has 40 requests running and a long prefill queued: prefilling 3,200
  // tokens elsewhere is cheaper than making all of them wait.
  std::vector<Candidate> c = {Loaded(1, 0, 4000), Loaded(2, 0, 0)};
  c[0].overlap_blocks = 40;
  c[0].active_requests = 40;
  c[0].active_prefill_tokens = 30000;
  c[0].active_prefill_squares = 30000ull * 30000ull;
  Selector sel;
  std::mt19937_64 rng(1);
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {3200, 50}, c, {.model = CostModel::kPredicted}, rng), 1u);
  // Lightly loaded, it keeps the request.
  c[0].active_requests = 2;
  c[0].active_prefill_tokens = 0;
  c[0].active_prefill_squares = 0;
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {3200, 50}, c, {.model = CostModel::kPredicted}, rng), 0u);
}

TEST(PredictedCost, AHugePromptAvoidsAWorkerBusyWithAnotherHugePrefill) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0)};
  c[0].active_prefill_tokens = 80000;
  c[0].active_prefill_squares = 80000ull * 80000ull;
  c[0].active_requests = 1;
  c[1].active_requests = 1;
  c[1].active_blocks = 1200;
  Selector sel;
  std::mt19937_64 rng(1);
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {90000, 1407}, c, {.model = CostModel::kPredicted}, rng), 1u);
}

TEST(PredictedCost, AHugePromptIsNotPlacedBehindALongQueueByWhomItStalls) {
  // A 100k-token prompt, cached nowhere: worker 1 has 8 requests, 4 of them 50k-token prompts
  // still queued (about 8 s of prefill ahead); worker 2 has 12 requests running and no queue.
  // Counting every wait it inflicts, worker 1 stalls 4 fewer and wins by the queue it makes the
  // prompt wait out; with the inflicted waits bounded by 8 times its own time to first token,
  // the prompt goes where it starts at once.
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0)};
  c[0].active_requests = 8;
  c[0].active_prefill_tokens = 4 * 50000;
  c[0].active_prefill_squares = 4 * 50000ull * 50000ull;
  c[1].active_requests = 12;
  Selector sel;
  std::mt19937_64 rng(1);
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {100000, 1563}, c, {.model = CostModel::kPredicted}, rng), 1u);
  // A short prompt is far below the bound: the fewer it stalls, the better.
  c[0].active_prefill_tokens = 0;
  c[0].active_prefill_squares = 0;
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {4096, 64}, c, {.model = CostModel::kPredicted}, rng), 0u);
}

TEST(PredictedCost, EqualCostsGoToTheWorkerWithFewerRecentRequests) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0)};
  c[0].recent_requests = 12;
  c[1].recent_requests = 3;
  c[2].recent_requests = 9;
  Selector sel;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 20; ++i)
    EXPECT_EQ(sel.Pick(RouterMode::kKv, {640, 10}, c, {.model = CostModel::kPredicted}, rng), 1u);
}

// A mixed fleet at a burst of questions on a new document: the fast ranks serve most requests
// (100 each lately, against 3 on the idle slow ranks) and the document is being prefilled on
// them now. Priced at its whole excess (48.5 requests, about 485 ms) a fast rank would lose the
// next question to an idle slow rank, which prefills the whole document at 1.7x the prior's
// time (a slow rank seldom used, so not yet learned whole: 4x slower in kvbench's fan-out, its
// factor stays near 1.7 there); bounded at a tie breaker's size, the question waits for its
// document where it is.
TEST(PredictedCost, AFastRankServingMostRequestsKeepsABurstsNewPrefixFromAnIdleSlowRank) {
  std::vector<Candidate> c = {Loaded(1, 136, 600), Loaded(2, 136, 600), Loaded(3, 0, 0), Loaded(4, 0, 0)};
  for (int i : {0, 1}) {
    c[i].active_prefill_squares = c[i].active_prefill_tokens * c[i].active_prefill_tokens;
    c[i].active_prefix_blocks = 128;  // the document, 8,192 tokens
    c[i].active_requests = 5;
    c[i].recent_requests = 100;
  }
  for (int i : {2, 3}) {
    c[i].prefill_factor = 1.7;
    c[i].recent_requests = 3;
  }
  const SelectionRequest req{8600, 135};
  const CostParams p{.model = CostModel::kPredicted};
  Selector sel;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 10; ++i) EXPECT_LT(sel.Pick(RouterMode::kKv, req, c, p, rng), 2u);
  // The excess bounded: its whole would have outweighed the document's prefill.
  const double mean = (100 + 100 + 3 + 3) / 4.0;
  EXPECT_GT(PredictedCostMs(c[0], req, p, 100 - mean), PredictedCostMs(c[2], req, p, RecentExcess(c[2], mean)));
}

TEST(PredictedCost, OnAFleetFasterThanThePriorASessionKeepsItsCacheAgainstALittleRecentExcess) {
  // Every rank 4x faster than the prior: the 512 cached tokens of rank 0 save a quarter of their
  // prior prefill time (about 2.4 ms), less than rank 0's recent excess costs at the whole spread
  // price (0.3 requests x 10 ms) but more than at half of it.
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0)};
  for (Candidate& x : c) x.prefill_factor = 0.25;
  c[0].overlap_blocks = 8;
  c[0].recent_requests = 0.6;  // the mean is 0.3: an excess of 0.3 requests
  Selector sel;
  std::mt19937_64 rng(1);
  const SelectionRequest req{4096, 64};
  EXPECT_EQ(sel.Pick(RouterMode::kKv, req, c, {.model = CostModel::kPredicted}, rng), 1u);
  EXPECT_EQ(sel.Pick(RouterMode::kKv, req, c, {.model = CostModel::kPredicted, .spread_scale = 0.5}, rng), 0u);
}

TEST(PredictedCost, TheLearnedPrefillFactorScalesThePriorsTimeToFirstToken) {
  Candidate c = Loaded(1, 0, 100);
  c.active_prefill_tokens = 2000;
  c.active_prefill_squares = 2000ull * 2000ull;
  c.active_requests = 2;
  const SelectionRequest req{1000, 16};
  const CostParams p{.model = CostModel::kPredicted};
  const PriorTtft prior = PriorTtftOf(c, req, p);
  const double inflicted = 2 * (PrefillMs(1000) - kStepOverheadMs);
  // Factors of 1: the prior's ttft (its two parts) plus the prefill it inflicts.
  EXPECT_NEAR(PredictedCostMs(c, req, p), prior.prefill_ms + prior.decode_ms + inflicted, 1e-9);
  EXPECT_NEAR(prior.decode_step_ms, DecodeStepMs((100.0 + 16) / 16384), 1e-12);
  c.prefill_factor = 3;
  c.decode_factor = 0.5;  // reported, not priced
  EXPECT_NEAR(PredictedCostMs(c, req, p), 3 * (prior.prefill_ms + prior.decode_ms) + 3 * inflicted, 1e-9);
  EXPECT_EQ(PriorTtftOf(c, req, p).prefill_ms, prior.prefill_ms);  // the prior does not learn
}

TEST(PredictedCost, AtEqualCacheAndLoadTheFasterRankWinsAndDynamosFormulaIgnoresSpeed) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0)};
  c[0].prefill_factor = 4;
  c[0].decode_factor = 4;
  Selector sel;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(sel.Pick(RouterMode::kKv, {640, 10}, c, {.model = CostModel::kPredicted}, rng), 1u);
  }
  // A slow rank holding a long prompt still beats a fast one that must prefill all of it.
  c[0].overlap_blocks = 125;
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {8000, 125}, c, {.model = CostModel::kPredicted}, rng), 0u);
  // Dynamo's block formula: the factors change nothing.
  Candidate same_unlearned = Loaded(1, 0, 0);
  same_unlearned.overlap_blocks = 125;
  EXPECT_EQ(KvBlocksCost::Price(c[0], {8000, 125}, {}), KvBlocksCost::Price(same_unlearned, {8000, 125}, {}));
}

// docs/design.md's worked example: prefill+decode blocks 8+10, 5+5, 2+9 -> the 5+5 worker.
TEST(Selector, WorkedExamplePicksTheFivePlusFiveWorker) {
  std::vector<Candidate> c = {Loaded(1, 8, 10), Loaded(2, 5, 5), Loaded(3, 2, 9)};
  Selector sel;
  std::mt19937_64 rng(1);
  // An empty request (isl 0) leaves just the existing load: costs 18, 10, 11.
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {0, 0}, c, {}, rng), 1u);
}

TEST(Selector, KvPrefersTheCachedWorkerWhenLoadIsEqual) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0)};
  c[2].overlap_blocks = 3;
  Selector sel;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sel.Pick(RouterMode::kKv, {256, 4}, c, {}, rng), 2u);
}

TEST(Selector, TiesAreBrokenUniformly) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0), Loaded(4, 9, 9)};
  Selector sel;
  std::mt19937_64 rng(7);
  std::map<std::size_t, int> hits;
  for (int i = 0; i < 3000; ++i) ++hits[sel.Pick(RouterMode::kKv, {64, 1}, c, {}, rng)];
  EXPECT_EQ(hits.count(3), 0u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(hits[i], 1000, 120) << i;
}

TEST(Selector, TemperatureSamplesBySoftmaxOfNormalisedCost) {
  // Costs 0, 1, 2 (max - min = 2), T = 1: weights exp(0), exp(-0.5), exp(-1).
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 1), Loaded(3, 0, 2)};
  Selector sel;
  std::mt19937_64 rng(12345);
  std::map<std::size_t, int> hits;
  constexpr int kN = 20000;
  for (int i = 0; i < kN; ++i) ++hits[sel.Pick(RouterMode::kKv, {0, 0}, c, {.temperature = 1.0}, rng)];
  const double w[3] = {1.0, std::exp(-0.5), std::exp(-1.0)};
  const double sum = w[0] + w[1] + w[2];
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(hits[i] / double(kN), w[i] / sum, 0.015) << i;
}

TEST(Selector, ExtremeWeightsStillPickTheCheapestFiniteCandidate) {
  // A scale of 1e308 makes every loaded candidate's cost inf; the idle cached one stays finite.
  std::vector<Candidate> c = {Loaded(1, 4, 4), Loaded(2, 0, 0), Loaded(3, 9, 9)};
  c[1].overlap_blocks = 4;
  Selector sel;
  std::mt19937_64 rng(3);
  const CostParams huge{.prefill_load_scale = 1e308, .temperature = 1e308};
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sel.Pick(RouterMode::kKv, {256, 4}, c, huge, rng), 1u);
  // Temperature 1e308 over finite costs: (max - min) * T overflows; sampling stays valid.
  std::vector<Candidate> finite = {Loaded(1, 0, 0), Loaded(2, 0, 5)};
  std::map<std::size_t, int> hits;
  for (int i = 0; i < 200; ++i) ++hits[sel.Pick(RouterMode::kKv, {0, 0}, finite, {.temperature = 1e308}, rng)];
  EXPECT_EQ(hits[0] + hits[1], 200);
}

TEST(Selector, RoundRobinCycles) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0)};
  Selector sel;
  std::mt19937_64 rng(1);
  std::vector<std::size_t> got;
  for (int i = 0; i < 6; ++i) got.push_back(sel.Pick(RouterMode::kRoundRobin, {}, c, {}, rng));
  EXPECT_EQ(got, (std::vector<std::size_t>{0, 1, 2, 0, 1, 2}));
}

TEST(Selector, RandomCoversEveryCandidate) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0)};
  Selector sel;
  std::mt19937_64 rng(3);
  std::map<std::size_t, int> hits;
  for (int i = 0; i < 3000; ++i) ++hits[sel.Pick(RouterMode::kRandom, {}, c, {}, rng)];
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(hits[i], 1000, 120);
}

TEST(Selector, LeastLoadedAndPowerOfTwoAvoidTheBusiest) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0)};
  c[0].active_requests = 5;
  c[1].active_requests = 1;
  c[2].active_requests = 3;
  Selector sel;
  std::mt19937_64 rng(5);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sel.Pick(RouterMode::kLeastLoaded, {}, c, {}, rng), 1u);
  // Power of two never picks the busiest of three: it always loses its pair.
  for (int i = 0; i < 200; ++i) EXPECT_NE(sel.Pick(RouterMode::kPowerOfTwo, {}, c, {}, rng), 0u);
}

TEST(Selector, DeviceAwareSplitsByRatioTimesCapacity) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0)};
  c[0].is_cpu = true;
  Selector sel;
  std::mt19937_64 rng(11);
  int cpu = 0;
  constexpr int kN = 9000;
  for (int i = 0; i < kN; ++i) cpu += sel.Pick(RouterMode::kDeviceAwareWeighted, {}, c, {.device_ratio = 8}, rng) == 0;
  EXPECT_NEAR(cpu / double(kN), 1.0 / 9.0, 0.015);  // accelerator weight 8 x 1 vs CPU 1
}

TEST(RecentWeight, ARankFasterThanTheScatterOfLearnedFactorsCountsItsRequestsByItsSpeed) {
  EXPECT_EQ(RecentWeight(1.0, 1.0), 1);
  EXPECT_EQ(RecentWeight(0.7, 1.0), 1);  // within 1.5x: the learning's scatter
  EXPECT_EQ(RecentWeight(0.5, 1.0), 0.5);
  EXPECT_EQ(RecentWeight(1.0, 4.0), 0.25);       // relative to the typical factor
  EXPECT_EQ(RecentWeight(1.0 / 64, 1.0), 0.25);  // at least a quarter
  EXPECT_EQ(RecentWeight(4.0, 1.0), 1);          // slower: priced in its ttft already
  EXPECT_EQ(RecentWeight(std::nan(""), 1.0), 1);
}

}  // namespace
}  // namespace kvrouter
