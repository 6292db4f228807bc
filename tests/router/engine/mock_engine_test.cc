#include "router/engine/mock_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "events/worker_publisher.h"
#include "router/engine/engine_model.h"
#include "router/index/block_index.h"

namespace kvrouter {
namespace {

constexpr std::uint64_t kWorker = 7;
constexpr std::uint32_t kRank = 1;
constexpr WorkerKey kKey{kWorker, kRank};

// Tokens first, first+1, ..., first+n-1.
std::vector<std::uint32_t> Tokens(std::uint32_t first, std::size_t n) {
  std::vector<std::uint32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = first + static_cast<std::uint32_t>(i);
  return t;
}

std::vector<std::uint32_t> Concat(std::vector<std::uint32_t> a, const std::vector<std::uint32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<SequenceHash> SeqHashes(const std::vector<std::uint32_t>& tokens, std::uint32_t bs,
                                    std::string_view lora = {}) {
  return ComputeSequenceHashes(ComputeLocalHashes(tokens, bs, lora));
}

// An engine on virtual time whose events a publisher of (kWorker, kRank) numbers; records every
// event and output.
class EngineHarness {
 public:
  explicit EngineHarness(MockEngineConfig config, std::size_t event_buffer = 1024)
      : publisher_({.worker_id = kWorker, .dp_rank = kRank, .event_buffer = event_buffer}),
        engine_(config, [this](KvEventData&& d) { events.push_back(publisher_.Publish(std::move(d))); }) {}

  MockEngine& engine() { return engine_; }
  KvEventPublisher& publisher() { return publisher_; }

  void Add(std::string id, std::vector<std::uint32_t> tokens, std::uint32_t max_tokens = 1, std::string lora = {}) {
    engine_.Add(
        {.id = std::move(id), .tokens = std::move(tokens), .max_tokens = max_tokens, .lora_name = std::move(lora)});
  }
  // One step at the current virtual time; returns its duration.
  double Step() {
    const double d = engine_.Step(now, outputs);
    now += d;
    ++steps;
    return d;
  }
  // Steps as the header's owner contract says: at the next timer when a step computed nothing.
  // Bounded, so an engine that breaks the contract fails the test instead of hanging it.
  void RunUntilIdle() {
    for (int i = 0; i < 100000 && !engine_.Idle(); ++i) {
      if (Step() > 0) continue;
      const auto timer = engine_.NextTimerMs();
      if (!timer || *timer <= now) break;
      now = *timer;
    }
    ASSERT_TRUE(engine_.Idle()) << "the engine stopped short of idle at " << now << " ms";
  }
  const EngineOutput* Find(const std::string& id, EngineOutput::Kind kind) const {
    for (const auto& o : outputs) {
      if (o.id == id && o.kind == kind) return &o;
    }
    return nullptr;
  }
  std::size_t CountKind(EngineOutput::Kind kind) const {
    std::size_t n = 0;
    for (const auto& o : outputs) n += o.kind == kind;
    return n;
  }

  double now = 0;
  int steps = 0;
  std::vector<KvEventBatch> events;
  std::vector<EngineOutput> outputs;

 private:
  KvEventPublisher publisher_;
  MockEngine engine_;
};

const KvStored& StoredOf(const KvEventBatch& b) { return std::get<KvStored>(b.ops.at(0).data); }
const KvRemoved& RemovedOf(const KvEventBatch& b) { return std::get<KvRemoved>(b.ops.at(0).data); }

void Apply(BlockIndex& index, const KvEventBatch& b) {
  for (const KvOp& op : b.ops) {
    if (const auto* s = std::get_if<KvStored>(&op.data)) {
      ApplyOutcome o = index.ApplyStored({b.worker_id, b.dp_rank}, s->parent_hash, s->blocks);
      ASSERT_FALSE(o.parent_not_found);
    } else if (const auto* r = std::get_if<KvRemoved>(&op.data)) {
      ApplyOutcome o = index.ApplyRemoved({b.worker_id, b.dp_rank}, r->block_hashes);
      ASSERT_EQ(o.blocks_not_found, 0u);
    } else {
      index.ClearWorker(b.worker_id);
    }
  }
}

std::size_t IndexMatch(const BlockIndex& index, std::span<const SequenceHash> seq) {
  OverlapScores scores;
  index.FindMatches(seq, scores);
  for (const auto& s : scores) {
    if (s.worker == kKey) return s.blocks;
  }
  return 0;
}

// ---- Timing model ----

TEST(MockEngineTiming, PrefillFollowsTheQuadraticModel) {
  EXPECT_DOUBLE_EQ(MockPrefillMs(0, 1), 16.5);
  EXPECT_NEAR(MockPrefillMs(1000, 1), 0.421 + 15.2 + 16.5, 1e-9);
  EXPECT_NEAR(MockPrefillMs(8192, 1), 4.21e-7 * 8192.0 * 8192.0 + 0.0152 * 8192 + 16.5, 1e-9);
  EXPECT_NEAR(MockPrefillMs(8192, 1), 169.2712, 1e-3);
}

TEST(MockEngineTiming, DecodeFollowsTheUtilizationModelWithAFloorOfOneMs) {
  EXPECT_DOUBLE_EQ(MockDecodeStepMs(0, 1), 5.74);
  EXPECT_NEAR(MockDecodeStepMs(0.5, 1), -25.74 / 4 + 54.01 / 2 + 5.74, 1e-9);
  EXPECT_NEAR(MockDecodeStepMs(1, 1), 34.01, 1e-9);
  EXPECT_DOUBLE_EQ(MockDecodeStepMs(3, 1), 1.0);  // the quadratic is negative there
}

TEST(MockEngineTiming, SpeedupRatioDividesEveryDuration) {
  EXPECT_NEAR(MockPrefillMs(1000, 4), MockPrefillMs(1000, 1) / 4, 1e-12);
  EXPECT_NEAR(MockDecodeStepMs(0.5, 10), MockDecodeStepMs(0.5, 1) / 10, 1e-12);
  EXPECT_DOUBLE_EQ(MockDecodeStepMs(3, 2), 0.5);
}

// ---- Prefix caching and events ----

TEST(MockEngine, FirstPromptPublishesOneStoredChainOfItsFullBlocks) {
  EngineHarness h({.block_size = 4});
  const auto prompt = Tokens(1, 10);  // two full blocks + a partial one
  h.Add("a", prompt);
  h.RunUntilIdle();
  ASSERT_EQ(h.events.size(), 1u);
  KvEventBatch want = StoredPromptBatch(kWorker, 1, prompt, 4);
  want.dp_rank = kRank;
  EXPECT_EQ(h.events[0], want);
  EXPECT_EQ(h.engine().CachedBlocks(), 2u);
  const EngineOutput* fin = h.Find("a", EngineOutput::kFinished);
  ASSERT_NE(fin, nullptr);
  EXPECT_EQ(fin->prompt_tokens, 10u);
  EXPECT_EQ(fin->cached_tokens, 0u);
}

TEST(MockEngine, RepeatedPromptHitsItsCachedBlocksAndPublishesNothing) {
  EngineHarness h({.block_size = 4});
  const auto prompt = Tokens(1, 10);
  h.Add("a", prompt);
  h.RunUntilIdle();
  ASSERT_EQ(h.events.size(), 1u);
  h.Add("b", prompt, 3);
  h.RunUntilIdle();
  EXPECT_EQ(h.events.size(), 1u);
  const EngineOutput* first = h.Find("b", EngineOutput::kFirstToken);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->cached_tokens, 8u);
  EXPECT_EQ(h.Find("b", EngineOutput::kFinished)->output_tokens, 3u);
  EXPECT_EQ(h.engine().CachedBlocks(), 2u);
}

TEST(MockEngine, SharedPrefixPublishesAChainWhoseParentIsTheLastSharedBlock) {
  EngineHarness h({.block_size = 4});
  const auto a = Tokens(1, 12);                         // blocks A0 A1 A2
  const auto b = Concat(Tokens(1, 8), Tokens(100, 9));  // blocks A0 A1 B2 B3 + partial
  h.Add("a", a);
  h.RunUntilIdle();
  h.Add("b", b);
  h.RunUntilIdle();
  ASSERT_EQ(h.events.size(), 2u);
  const auto seq_b = SeqHashes(b, 4);
  const auto local_b = ComputeLocalHashes(b, 4);
  const KvStored& s = StoredOf(h.events[1]);
  EXPECT_EQ(s.parent_hash, seq_b[1]);
  ASSERT_EQ(s.blocks.size(), 2u);
  EXPECT_EQ(s.blocks[0], (StoredBlock{seq_b[2], local_b[2]}));
  EXPECT_EQ(s.blocks[1], (StoredBlock{seq_b[3], local_b[3]}));
  EXPECT_EQ(h.Find("b", EngineOutput::kFirstToken)->cached_tokens, 8u);
  EXPECT_EQ(h.engine().CachedBlocks(), 5u);
}

TEST(MockEngine, StoredTokensInsideTheSinkAreTheTokensOfTheNewBlocksOnly) {
  std::vector<std::vector<std::uint32_t>> stored_tokens;
  std::size_t removals_with_tokens = 0;
  MockEngine* engine = nullptr;
  MockEngine e({.num_gpu_blocks = 5, .block_size = 4}, [&](KvEventData&& d) {
    const auto t = engine->stored_tokens();
    if (std::holds_alternative<KvStored>(d)) {
      stored_tokens.emplace_back(t.begin(), t.end());
    } else {
      removals_with_tokens += !t.empty();
    }
  });
  engine = &e;
  std::vector<EngineOutput> out;
  auto run = [&] {
    for (double now = 0; !e.Idle();) now += e.Step(now, out);
  };
  e.Add({.id = "a", .tokens = Tokens(1, 14)});  // 3 full blocks + a partial one
  run();
  e.Add({.id = "b", .tokens = Concat(Tokens(1, 8), Tokens(100, 10))});  // A0 A1 B2 B3 + partial
  run();                                                                // evicts A2
  ASSERT_EQ(stored_tokens.size(), 2u);
  EXPECT_EQ(stored_tokens[0], Tokens(1, 12));
  EXPECT_EQ(stored_tokens[1], Tokens(100, 8));
  EXPECT_EQ(removals_with_tokens, 0u);
  EXPECT_TRUE(e.stored_tokens().empty());
}

TEST(MockEngine, LoraNameSeparatesCachedBlocks) {
  EngineHarness h({.block_size = 4});
  const auto prompt = Tokens(1, 8);
  h.Add("a", prompt);
  h.Add("b", prompt, 1, "my-adapter");
  h.RunUntilIdle();
  EXPECT_EQ(h.Find("b", EngineOutput::kFirstToken)->cached_tokens, 0u);
  ASSERT_EQ(h.events.size(), 2u);
  EXPECT_EQ(StoredOf(h.events[1]).blocks[0].tokens_hash, ComputeLocalHashes(prompt, 4, "my-adapter")[0]);
  EXPECT_EQ(h.engine().CachedBlocks(), 4u);
}

TEST(MockEngine, RequestsAdmittedInTheSameStepShareNewlyStoredBlocks) {
  EngineHarness h({.block_size = 4});
  h.Add("a", Tokens(1, 8));
  h.Add("b", Tokens(1, 8));
  h.Step();
  EXPECT_EQ(h.events.size(), 1u);
  EXPECT_EQ(h.Find("b", EngineOutput::kFirstToken)->cached_tokens, 8u);
  EXPECT_EQ(h.engine().CachedBlocks(), 2u);
}

TEST(MockEngine, EvictsLeastRecentlyReleasedBlocksFirstAndPublishesRemovals) {
  EngineHarness h({.num_gpu_blocks = 4, .block_size = 4});
  const auto a = Tokens(1, 8), b = Tokens(100, 8), c = Tokens(200, 8);
  const auto sa = SeqHashes(a, 4), sb = SeqHashes(b, 4), sc = SeqHashes(c, 4);
  h.Add("a", a);
  h.RunUntilIdle();
  h.Add("b", b);
  h.RunUntilIdle();
  h.Add("a2", a);  // touches a: its blocks are now released after b's
  h.RunUntilIdle();
  ASSERT_EQ(h.events.size(), 2u);
  EXPECT_EQ(h.engine().CachedBlocks(), 4u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 0u);

  h.Add("c", c);
  h.RunUntilIdle();
  ASSERT_EQ(h.events.size(), 4u);
  // b's blocks go, last block first (a request releases its blocks last to first).
  EXPECT_EQ(RemovedOf(h.events[2]).block_hashes, (std::vector<BlockHash>{sb[1], sb[0]}));
  EXPECT_EQ(StoredOf(h.events[3]).blocks.size(), 2u);
  EXPECT_EQ(StoredOf(h.events[3]).blocks[0].block_hash, sc[0]);
  EXPECT_EQ(h.engine().CachedPrefixBlocks(sa), 2u);
  EXPECT_EQ(h.engine().CachedPrefixBlocks(sb), 0u);
  EXPECT_EQ(h.engine().CachedPrefixBlocks(sc), 2u);
}

TEST(MockEngine, EvictionTakesAReleasedTailBeforeItsSharedPrefix) {
  EngineHarness h({.num_gpu_blocks = 4, .block_size = 4});
  const auto a = Tokens(1, 12);   // A0 A1 A2
  const auto x = Tokens(500, 4);  // X0
  h.Add("a", a);
  h.RunUntilIdle();
  h.Add("x", x);
  h.RunUntilIdle();
  // LRU: A2 A1 A0 X0. A 2-block prompt sharing nothing evicts A2 then A1.
  h.Add("y", Tokens(900, 8));
  h.RunUntilIdle();
  const auto sa = SeqHashes(a, 4);
  ASSERT_EQ(h.events.size(), 4u);
  EXPECT_EQ(RemovedOf(h.events[2]).block_hashes, (std::vector<BlockHash>{sa[2], sa[1]}));
  EXPECT_EQ(h.engine().CachedPrefixBlocks(sa), 1u);
}

TEST(MockEngine, RequestThatCannotGetBlocksWaitsUntilOthersFinish) {
  EngineHarness h({.num_gpu_blocks = 4, .block_size = 4});
  h.Add("a", Tokens(1, 12), 3);  // 3 blocks, held for 3 steps
  h.Add("b", Tokens(100, 8));    // 2 blocks: only 1 free while a runs
  h.Step();
  EXPECT_NE(h.Find("a", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.Find("b", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.engine().NumWaiting(), 1u);
  h.Step();
  h.Step();  // a finishes at the end of this step
  const EngineOutput* a_done = h.Find("a", EngineOutput::kFinished);
  ASSERT_NE(a_done, nullptr);
  EXPECT_EQ(h.Find("b", EngineOutput::kFirstToken), nullptr);
  h.Step();
  const EngineOutput* b_first = h.Find("b", EngineOutput::kFirstToken);
  ASSERT_NE(b_first, nullptr);
  EXPECT_GT(b_first->at_ms, h.Find("a", EngineOutput::kFinished)->at_ms);
  // b evicted one of a's blocks (a's last one, released first).
  ASSERT_EQ(h.events.size(), 3u);
  EXPECT_EQ(RemovedOf(h.events[1]).block_hashes, (std::vector<BlockHash>{SeqHashes(Tokens(1, 12), 4)[2]}));
  EXPECT_TRUE(h.engine().Idle());
}

TEST(MockEngine, PromptLargerThanTheCacheIsRejected) {
  EngineHarness h({.num_gpu_blocks = 2, .block_size = 4});
  h.Add("big", Tokens(1, 12));
  h.Add("ok", Tokens(100, 8));
  h.RunUntilIdle();
  const EngineOutput* r = h.Find("big", EngineOutput::kRejected);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->prompt_tokens, 12u);
  EXPECT_EQ(h.Find("big", EngineOutput::kFirstToken), nullptr);
  EXPECT_NE(h.Find("ok", EngineOutput::kFinished), nullptr);
  EXPECT_EQ(h.events.size(), 1u);
}

// ---- Scheduler limits ----

TEST(MockEngine, MaxNumSeqsLimitsRunningRequests) {
  EngineHarness h({.block_size = 4, .max_num_seqs = 2});
  h.Add("a", Tokens(1, 4), 2);
  h.Add("b", Tokens(100, 4), 3);
  h.Add("c", Tokens(200, 4), 1);
  h.Step();
  EXPECT_EQ(h.CountKind(EngineOutput::kFirstToken), 2u);
  EXPECT_EQ(h.engine().NumRunning(), 2u);
  EXPECT_EQ(h.engine().NumWaiting(), 1u);
  h.Step();  // a finishes; c still cannot start in this step
  EXPECT_NE(h.Find("a", EngineOutput::kFinished), nullptr);
  EXPECT_EQ(h.Find("c", EngineOutput::kFirstToken), nullptr);
  h.Step();
  EXPECT_NE(h.Find("c", EngineOutput::kFirstToken), nullptr);
  h.RunUntilIdle();
  EXPECT_EQ(h.CountKind(EngineOutput::kFinished), 3u);
}

TEST(MockEngine, MaxNumBatchedTokensLimitsUncachedPrefillTokensPerStep) {
  EngineHarness h({.block_size = 4, .max_num_batched_tokens = 16});
  h.Add("a", Tokens(1, 8));
  h.Add("b", Tokens(100, 8));
  h.Add("c", Tokens(200, 8));
  const double d1 = h.Step();
  EXPECT_NE(h.Find("b", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.Find("c", EngineOutput::kFirstToken), nullptr);
  EXPECT_DOUBLE_EQ(d1, MockPrefillMs(16, 1));
  h.Step();
  EXPECT_NE(h.Find("c", EngineOutput::kFirstToken), nullptr);
}

TEST(MockEngine, CachedTokensDoNotCountAgainstTheTokenBudget) {
  EngineHarness h({.block_size = 4, .max_num_batched_tokens = 16});
  h.Add("warm", Tokens(1, 16));
  h.RunUntilIdle();
  h.Add("a", Tokens(1, 16));                         // fully cached: 0 uncached tokens
  h.Add("b", Concat(Tokens(1, 12), Tokens(50, 4)));  // 4 uncached
  h.Add("c", Tokens(100, 12));                       // 12 uncached: 16 in all
  h.Add("d", Tokens(200, 4));                        // over the budget
  const double d = h.Step();
  EXPECT_NE(h.Find("c", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.Find("d", EngineOutput::kFirstToken), nullptr);
  EXPECT_DOUBLE_EQ(d, MockPrefillMs(16, 1));
}

TEST(MockEngine, PromptLargerThanTheBudgetIsAdmittedAloneIntoAStep) {
  EngineHarness h({.block_size = 4, .max_num_batched_tokens = 16});
  h.Add("small", Tokens(1, 4));
  h.Add("big", Tokens(100, 40));
  h.Add("after", Tokens(200, 4));
  h.Step();  // small fits; big does not fit the rest of the budget
  EXPECT_NE(h.Find("small", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.Find("big", EngineOutput::kFirstToken), nullptr);
  const double d = h.Step();  // big is the first prefill of this step: admitted alone
  EXPECT_NE(h.Find("big", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.Find("after", EngineOutput::kFirstToken), nullptr);
  EXPECT_DOUBLE_EQ(d, MockPrefillMs(40, 1));  // small finished in step 1: nothing decodes
  h.Step();
  EXPECT_NE(h.Find("after", EngineOutput::kFirstToken), nullptr);
}

// ---- Timing of outputs ----

TEST(MockEngine, FirstTokenAndFinishTimesFollowTheTimingModel) {
  const double speedup = 2;
  EngineHarness h({.num_gpu_blocks = 100, .block_size = 16, .speedup_ratio = speedup});
  h.now = 1000;
  h.Add("a", Tokens(1, 100), 3);  // 6 full blocks
  h.Step();
  const double t1 = 1000 + MockPrefillMs(100, speedup);
  ASSERT_NE(h.Find("a", EngineOutput::kFirstToken), nullptr);
  EXPECT_DOUBLE_EQ(h.Find("a", EngineOutput::kFirstToken)->at_ms, t1);
  EXPECT_DOUBLE_EQ(h.engine().Utilization(), 0.06);

  // A prefill joining a decode step costs both; utilisation includes the new blocks.
  h.Add("b", Tokens(1000, 40), 1);  // 2 full blocks
  h.Step();
  const double t2 = t1 + MockPrefillMs(40, speedup) + MockDecodeStepMs(0.08, speedup);
  EXPECT_DOUBLE_EQ(h.Find("b", EngineOutput::kFirstToken)->at_ms, t2);
  EXPECT_DOUBLE_EQ(h.Find("b", EngineOutput::kFinished)->at_ms, t2);
  EXPECT_EQ(h.Find("b", EngineOutput::kFinished)->output_tokens, 1u);

  h.Step();  // b released its blocks at the end of the previous step
  const double t3 = t2 + MockDecodeStepMs(0.06, speedup);
  const EngineOutput* fin = h.Find("a", EngineOutput::kFinished);
  ASSERT_NE(fin, nullptr);
  EXPECT_DOUBLE_EQ(fin->at_ms, t3);
  EXPECT_EQ(fin->output_tokens, 3u);
  EXPECT_EQ(fin->prompt_tokens, 100u);
  EXPECT_TRUE(h.engine().Idle());
  EXPECT_EQ(h.engine().Step(t3, h.outputs), 0.0);
  EXPECT_EQ(h.engine().Utilization(), 0.0);
  EXPECT_EQ(h.engine().CachedBlocks(), 8u);
}

TEST(MockEngine, PrefillsAdmittedTogetherAreBatchedIntoOneStep) {
  EngineHarness h({.block_size = 16});
  h.Add("a", Tokens(1, 300));
  h.Add("b", Tokens(1000, 500));
  const double d = h.Step();
  EXPECT_DOUBLE_EQ(d, MockPrefillMs(800, 1));
  EXPECT_DOUBLE_EQ(h.Find("a", EngineOutput::kFirstToken)->at_ms, d);
  EXPECT_DOUBLE_EQ(h.Find("b", EngineOutput::kFirstToken)->at_ms, d);
}

// ---- Per-token outputs and aborts ----

TEST(MockEngine, ByDefaultOnlyTheFirstTokenAndTheFinishAreReported) {
  EngineHarness h({.block_size = 4});
  h.Add("a", Tokens(1, 8), 5);
  h.RunUntilIdle();
  EXPECT_EQ(h.CountKind(EngineOutput::kToken), 0u);
  EXPECT_EQ(h.CountKind(EngineOutput::kFirstToken), 1u);
  EXPECT_EQ(h.CountKind(EngineOutput::kFinished), 1u);
  EXPECT_EQ(h.outputs.size(), 2u);
}

TEST(MockEngine, EveryTokenOutputsReportEachLaterTokenAtTheEndOfItsStep) {
  EngineHarness h({.block_size = 4, .outputs = EngineOutputs::kEveryToken});
  h.Add("a", Tokens(1, 8), 4);
  std::vector<double> step_ends;
  while (!h.engine().Idle()) {
    h.Step();
    step_ends.push_back(h.now);
  }
  ASSERT_EQ(step_ends.size(), 4u);  // one token per step
  // kFirstToken (token 1), kToken for tokens 2, 3, 4, then kFinished after the last kToken.
  ASSERT_EQ(h.outputs.size(), 5u);
  EXPECT_EQ(h.outputs[0].kind, EngineOutput::kFirstToken);
  EXPECT_EQ(h.outputs[0].output_tokens, 1u);
  for (std::uint32_t k = 1; k < 4; ++k) {
    EXPECT_EQ(h.outputs[k].kind, EngineOutput::kToken);
    EXPECT_EQ(h.outputs[k].output_tokens, k + 1);
    EXPECT_DOUBLE_EQ(h.outputs[k].at_ms, step_ends[k]);
  }
  EXPECT_EQ(h.outputs[4].kind, EngineOutput::kFinished);
  EXPECT_EQ(h.outputs[4].output_tokens, 4u);
  EXPECT_DOUBLE_EQ(h.outputs[4].at_ms, step_ends[3]);
}

TEST(MockEngine, EveryTokenOutputsChangeNeitherTimingNorEvents) {
  const auto run = [](EngineOutputs outputs) {
    EngineHarness h({.num_gpu_blocks = 12, .block_size = 4, .max_num_seqs = 3, .outputs = outputs});
    for (std::uint32_t i = 0; i < 6; ++i) h.Add(std::to_string(i), Tokens(1 + 100 * (i % 4), 9), 2 + i);
    std::vector<double> steps;
    while (!h.engine().Idle()) steps.push_back(h.Step());
    std::erase_if(h.outputs, [](const EngineOutput& o) { return o.kind == EngineOutput::kToken; });
    std::vector<std::pair<std::string, double>> outs;
    for (const auto& o : h.outputs) outs.emplace_back(o.id + "/" + std::to_string(o.kind), o.at_ms);
    return std::tuple(steps, outs, h.events);
  };
  EXPECT_EQ(run(EngineOutputs::kFirstAndFinish), run(EngineOutputs::kEveryToken));
}

TEST(MockEngine, LastStepTokensCountsTheStepsLaterTokensWhateverTheOutputs) {
  // Requests of different lengths joining over several steps: each step's count is the kToken
  // outputs it reports with kEveryToken, and the same without them.
  const auto run = [](EngineOutputs outputs) {
    EngineHarness h({.num_gpu_blocks = 12, .block_size = 4, .max_num_seqs = 3, .outputs = outputs});
    EXPECT_EQ(h.engine().last_step_tokens(), 0u);
    for (std::uint32_t i = 0; i < 6; ++i) h.Add(std::to_string(i), Tokens(1 + 100 * (i % 4), 9), 1 + i);
    std::vector<std::size_t> counted, reported;
    while (!h.engine().Idle()) {
      h.outputs.clear();
      h.Step();
      counted.push_back(h.engine().last_step_tokens());
      reported.push_back(h.CountKind(EngineOutput::kToken));
    }
    return std::pair(counted, reported);
  };
  const auto [counted, reported] = run(EngineOutputs::kEveryToken);
  EXPECT_EQ(counted, reported);
  // 0 + 1 + ... + 5 later tokens in all.
  EXPECT_EQ(std::accumulate(counted.begin(), counted.end(), std::size_t{0}), 15u);
  EXPECT_EQ(run(EngineOutputs::kFirstAndFinish).first, counted);
}

TEST(MockEngine, AbortingAWaitingRequestRemovesItWithoutTouchingTheCache) {
  EngineHarness h({.num_gpu_blocks = 16, .block_size = 4, .max_num_seqs = 1});
  h.Add("a", Tokens(1, 8), 3);
  h.Step();  // a runs; b waits behind max_num_seqs
  h.Add("b", Tokens(100, 8), 3);
  EXPECT_EQ(h.engine().NumWaiting(), 1u);
  EXPECT_TRUE(h.engine().Abort("b"));
  EXPECT_EQ(h.engine().NumWaiting(), 0u);
  h.RunUntilIdle();
  EXPECT_EQ(h.Find("b", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.Find("b", EngineOutput::kFinished), nullptr);
  EXPECT_EQ(h.engine().CachedBlocks(), 2u);  // a's only
  EXPECT_EQ(h.events.size(), 1u);
}

TEST(MockEngine, AbortingARunningRequestReleasesItsBlocksWhichStayCached) {
  EngineHarness h({.num_gpu_blocks = 16, .block_size = 4, .outputs = EngineOutputs::kEveryToken});
  const auto prompt = Tokens(1, 10);
  h.Add("a", prompt, 100);
  h.Step();
  h.Step();
  ASSERT_EQ(h.engine().NumRunning(), 1u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 2u);
  EXPECT_TRUE(h.engine().Abort("a"));
  EXPECT_TRUE(h.engine().Idle());
  EXPECT_EQ(h.engine().ActiveBlocks(), 0u);
  EXPECT_EQ(h.engine().CachedBlocks(), 2u);
  EXPECT_EQ(h.Step(), 0.0);  // nothing more for it
  EXPECT_EQ(h.Find("a", EngineOutput::kFinished), nullptr);
  EXPECT_FALSE(h.engine().Abort("a"));

  // The same prompt again finds both blocks; they were released, not removed.
  h.Add("a2", prompt, 1);
  h.RunUntilIdle();
  ASSERT_NE(h.Find("a2", EngineOutput::kFinished), nullptr);
  EXPECT_EQ(h.Find("a2", EngineOutput::kFinished)->cached_tokens, 8u);
  EXPECT_EQ(h.events.size(), 1u);
}

TEST(MockEngine, AbortedBlocksAreEvictableLeavesFirst) {
  EngineHarness h({.num_gpu_blocks = 3, .block_size = 4});
  h.Add("a", Tokens(1, 12), 100);  // all three blocks
  h.Step();
  EXPECT_TRUE(h.engine().Abort("a"));
  h.Add("b", Tokens(1, 4), 1);    // shares a's first block
  h.Add("c", Tokens(500, 8), 1);  // needs two: a's tail goes, deepest first
  h.RunUntilIdle();
  ASSERT_NE(h.Find("c", EngineOutput::kFinished), nullptr);
  ASSERT_EQ(h.events.size(), 3u);
  const auto seq = SeqHashes(Tokens(1, 12), 4);
  EXPECT_EQ(RemovedOf(h.events[1]).block_hashes, (std::vector<SequenceHash>{seq[2], seq[1]}));
}

TEST(MockEngine, AbortOfAnUnknownIdIsRefused) {
  EngineHarness h({.block_size = 4});
  EXPECT_FALSE(h.engine().Abort("nobody"));
  h.Add("a", Tokens(1, 4), 1);
  h.RunUntilIdle();
  EXPECT_FALSE(h.engine().Abort("a"));  // finished
}

// ---- A prefill carries every decoding request's next token ----

// The engine does not chunk prefills: the step that admits a long prompt delays the next token
// of every request decoding here by the whole prefill (docs/design.md compares vLLM).
TEST(MockEngine, AStepThatAdmitsAPrefillDelaysTheNextTokenOfEveryDecodingRequest) {
  EngineHarness h({.num_gpu_blocks = 1000, .block_size = 16, .outputs = EngineOutputs::kEveryToken});
  h.Add("d", Tokens(1, 64), 10);
  h.Step();  // d's prefill and first token
  h.Step();  // d's second token: a plain decode step
  const double plain_gap = h.Step();
  EXPECT_DOUBLE_EQ(plain_gap, MockDecodeStepMs(4.0 / 1000, 1));

  constexpr std::size_t kLong = 4000;  // 250 full blocks
  h.Add("long", Tokens(10000, kLong), 2);
  const double before = h.now;
  h.Step();
  const EngineOutput* token = nullptr;
  for (const EngineOutput& o : h.outputs) {
    if (o.id == "d" && o.kind == EngineOutput::kToken && o.output_tokens == 4) token = &o;
  }
  ASSERT_NE(token, nullptr);
  const double gap = token->at_ms - before;
  EXPECT_DOUBLE_EQ(gap, MockPrefillMs(kLong, 1) + MockDecodeStepMs(254.0 / 1000, 1));
  EXPECT_GE(gap - plain_gap, MockPrefillMs(kLong, 1));
  EXPECT_DOUBLE_EQ(h.Find("long", EngineOutput::kFirstToken)->at_ms, token->at_ms);
}

// ---- Chunked prefill (MockEngineConfig::chunked_prefill, vLLM V1's scheduler) ----

// A chunked step's prefill cost: its chunks [a, b) and one step overhead, before the speedup.
double ChunkStepMs(std::initializer_list<std::pair<double, double>> chunks) {
  double ms = kStepOverheadMs;
  for (const auto& [a, b] : chunks) ms += PrefillChunkMs(a, b);
  return ms;
}

TEST(MockEngineChunked, ChunksOfAPromptAddUpToItsWholePrefillAndOneOverheadEach) {
  EXPECT_NEAR(PrefillChunkMs(0, 20000) + kStepOverheadMs, PrefillMs(20000), 1e-9);
  EXPECT_NEAR(PrefillChunkMs(0, 8192) + PrefillChunkMs(8192, 20000), PrefillChunkMs(0, 20000), 1e-9);
  // A later chunk attends to the earlier ones: it costs more than the same tokens prefilled alone.
  EXPECT_GT(PrefillChunkMs(8192, 16384), PrefillChunkMs(0, 8192));
}

TEST(MockEngineChunked, LongPromptIsPrefilledOverStepsAndItsFirstTokenEndsTheLast) {
  EngineHarness h({.num_gpu_blocks = 1000, .max_num_batched_tokens = 8192, .chunked_prefill = true});
  h.Add("long", Tokens(1, 20000), 2);
  EXPECT_NEAR(h.Step(), ChunkStepMs({{0, 8192}}), 1e-9);
  EXPECT_EQ(h.Find("long", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.engine().ActiveBlocks(), 312u);  // every full block allocated at admission
  EXPECT_NEAR(h.Step(), ChunkStepMs({{8192, 16384}}), 1e-9);
  EXPECT_EQ(h.Find("long", EngineOutput::kFirstToken), nullptr);
  EXPECT_NEAR(h.Step(), ChunkStepMs({{16384, 20000}}), 1e-9);
  const EngineOutput* first = h.Find("long", EngineOutput::kFirstToken);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(h.steps, 3);
  EXPECT_DOUBLE_EQ(first->at_ms, h.now);
  EXPECT_EQ(first->cached_tokens, 0u);
  // Three chunks: the whole prefill and two step overheads more.
  EXPECT_NEAR(h.now, PrefillMs(20000) + 2 * kStepOverheadMs, 1e-9);
  EXPECT_EQ(h.Find("long", EngineOutput::kFinished), nullptr);
  EXPECT_DOUBLE_EQ(h.Step(), MockDecodeStepMs(312.0 / 1000, 1));  // then it decodes
  EXPECT_NE(h.Find("long", EngineOutput::kFinished), nullptr);
}

TEST(MockEngineChunked, ARequestDecodingAlongsideGetsATokenEveryStepEachGapStretchedByOneChunk) {
  EngineHarness h({.num_gpu_blocks = 1000,
                   .max_num_batched_tokens = 8192,
                   .outputs = EngineOutputs::kEveryToken,
                   .chunked_prefill = true});
  h.Add("d", Tokens(1, 64), 10);  // one full block
  h.Step();                       // d's prefill and first token
  const double plain_gap = h.Step();
  EXPECT_DOUBLE_EQ(plain_gap, MockDecodeStepMs(1.0 / 1000, 1));

  h.Add("long", Tokens(10000, 20000), 2);  // 312 full blocks
  const double decode = MockDecodeStepMs(313.0 / 1000, 1);
  // d's token takes one of the budget's 8,192 tokens.
  const std::vector<double> expected = {ChunkStepMs({{0, 8191}}) + decode, ChunkStepMs({{8191, 16382}}) + decode,
                                        ChunkStepMs({{16382, 20000}}) + decode};
  for (std::size_t i = 0; i < expected.size(); ++i) {
    h.outputs.clear();
    const double before = h.now;
    h.Step();
    const EngineOutput* token = h.Find("d", EngineOutput::kToken);
    ASSERT_NE(token, nullptr) << "step " << i;
    EXPECT_EQ(token->output_tokens, 3 + i);
    EXPECT_NEAR(token->at_ms - before, expected[i], 1e-9) << "step " << i;
    EXPECT_LT(token->at_ms - before, MockPrefillMs(20000, 1)) << "step " << i;  // not the whole prefill
    EXPECT_EQ(h.engine().last_step_tokens(), 1u) << "step " << i;               // d's; long has none yet
    EXPECT_EQ(h.Find("long", EngineOutput::kFirstToken) != nullptr, i == 2) << "step " << i;
  }
  h.outputs.clear();
  h.Step();
  EXPECT_EQ(h.engine().last_step_tokens(), 2u);  // d's and long's second token
  EXPECT_EQ(h.CountKind(EngineOutput::kToken), 2u);
}

TEST(MockEngineChunked, DecodeTokensTakeTheBudgetBeforeAnyPrefill) {
  EngineHarness h({.num_gpu_blocks = 2000, .block_size = 16, .max_num_batched_tokens = 8192, .chunked_prefill = true});
  for (std::uint32_t i = 0; i < 100; ++i) h.Add("d" + std::to_string(i), Tokens(100000 + 100 * i, 16), 50);
  h.Step();  // 100 prefills of 16 tokens and their first tokens
  ASSERT_EQ(h.CountKind(EngineOutput::kFirstToken), 100u);

  // 8,092 tokens a step beside 100 decodes: three steps, where a budget the decodes did not
  // take would prefill it in two.
  constexpr std::size_t kPrompt = 2 * 8192 - 100;
  h.Add("long", Tokens(1, kPrompt), 1);
  const double decode = MockDecodeStepMs((100.0 + kPrompt / 16) / 2000, 1);
  EXPECT_NEAR(h.Step(), ChunkStepMs({{0, 8092}}) + decode, 1e-9);
  EXPECT_NEAR(h.Step(), ChunkStepMs({{8092, 16184}}) + decode, 1e-9);
  EXPECT_EQ(h.Find("long", EngineOutput::kFirstToken), nullptr);
  EXPECT_NEAR(h.Step(), ChunkStepMs({{16184, kPrompt}}) + decode, 1e-9);
  EXPECT_NE(h.Find("long", EngineOutput::kFirstToken), nullptr);
}

TEST(MockEngineChunked, AFullyCachedPromptGetsItsFirstTokenInItsAdmissionStep) {
  EngineHarness h({.num_gpu_blocks = 1000, .max_num_batched_tokens = 8192, .chunked_prefill = true});
  h.Add("warm", Tokens(1, 640));  // 10 full blocks
  h.RunUntilIdle();
  // Behind a prompt whose last chunk leaves budget over: both first tokens come in that step.
  h.Add("long", Tokens(10000, 10000));
  h.Add("cached", Tokens(1, 640));
  EXPECT_NEAR(h.Step(), ChunkStepMs({{0, 8192}}), 1e-9);
  EXPECT_EQ(h.Find("cached", EngineOutput::kFirstToken), nullptr);  // no budget left: it waits
  EXPECT_EQ(h.engine().NumWaiting(), 1u);
  EXPECT_NEAR(h.Step(), ChunkStepMs({{8192, 10000}}), 1e-9);  // its 0 uncached tokens cost nothing
  const EngineOutput* first = h.Find("cached", EngineOutput::kFirstToken);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->cached_tokens, 640u);
  EXPECT_DOUBLE_EQ(first->at_ms, h.now);
  EXPECT_NE(h.Find("long", EngineOutput::kFirstToken), nullptr);

  h.Add("again", Tokens(1, 640));  // alone: a step of the overhead only, as without chunking
  EXPECT_DOUBLE_EQ(h.Step(), MockPrefillMs(0, 1));
  EXPECT_NE(h.Find("again", EngineOutput::kFirstToken), nullptr);
}

TEST(MockEngineChunked, OffByDefaultALongPromptIsPrefilledWholeInOneStep) {
  EngineHarness h({.num_gpu_blocks = 1000, .max_num_batched_tokens = 8192});
  h.Add("long", Tokens(1, 20000));
  EXPECT_DOUBLE_EQ(h.Step(), MockPrefillMs(20000, 1));
  EXPECT_NE(h.Find("long", EngineOutput::kFirstToken), nullptr);
}

// Chunked, on a random workload whose prompts mostly exceed the budget, with evictions: every
// request gets one first token and finishes with all its tokens, the later tokens counted by
// last_step_tokens are all of them, and the events still rebuild the cache.
TEST(MockEngineChunked, ARandomWorkloadFinishesEveryRequestAndItsEventsRebuildTheCache) {
  constexpr std::uint32_t kBs = 4;
  std::mt19937_64 rng(20261206);
  BlockIndex index;
  KvEventPublisher publisher({.worker_id = kWorker, .dp_rank = kRank});
  MockEngine engine({.num_gpu_blocks = 40,
                     .block_size = kBs,
                     .max_num_seqs = 5,
                     .max_num_batched_tokens = 10,
                     .chunked_prefill = true},
                    [&](KvEventData&& d) { Apply(index, publisher.Publish(std::move(d))); });
  std::map<std::string, std::uint32_t> max_tokens;
  std::vector<std::vector<SequenceHash>> prompts;
  std::vector<EngineOutput> outputs;
  std::size_t later_tokens = 0;
  double now = 0;
  for (int round = 0; round < 600 || !engine.Idle(); ++round) {
    ASSERT_LT(round, 100000) << "the engine never ends idle";
    for (int a = round < 600 ? static_cast<int>(rng() % 2) : 0; a > 0; --a) {
      auto tokens = Tokens(1000 * static_cast<std::uint32_t>(rng() % 4), kBs * (rng() % 5));
      const std::size_t suffix = rng() % 25;
      const auto salt = static_cast<std::uint32_t>(rng() % 10) * 100000;
      for (std::size_t i = 0; i < suffix; ++i) tokens.push_back(salt + static_cast<std::uint32_t>(i));
      const std::string id = std::to_string(round);
      max_tokens[id] = 1 + static_cast<std::uint32_t>(rng() % 5);
      prompts.push_back(SeqHashes(tokens, kBs));
      engine.Add({.id = id, .tokens = std::move(tokens), .max_tokens = max_tokens[id]});
    }
    now += engine.Step(now, outputs);
    later_tokens += engine.last_step_tokens();
  }
  std::map<std::string, int> firsts;
  std::map<std::string, std::uint32_t> finished;
  std::size_t chunked_first_tokens = 0;  // prompts of more uncached tokens than the budget
  for (const EngineOutput& o : outputs) {
    ASSERT_NE(o.kind, EngineOutput::kRejected);
    if (o.kind == EngineOutput::kFirstToken) {
      ++firsts[o.id];
      chunked_first_tokens += o.prompt_tokens - o.cached_tokens > 10;
    }
    if (o.kind == EngineOutput::kFinished) finished[o.id] = o.output_tokens;
  }
  std::size_t expected_later = 0;
  for (const auto& [id, n] : max_tokens) {
    EXPECT_EQ(firsts[id], 1) << id;
    EXPECT_EQ(finished[id], n) << id;
    expected_later += n - 1;
  }
  EXPECT_EQ(later_tokens, expected_later);
  EXPECT_GT(chunked_first_tokens, 50u);
  EXPECT_EQ(engine.ActiveBlocks(), 0u);
  ASSERT_EQ(index.TreeSize(kKey), engine.CachedBlocks());
  for (const auto& seq : prompts) ASSERT_EQ(IndexMatch(index, seq), engine.CachedPrefixBlocks(seq));
}

// ---- Disaggregated legs (docs/protocol.md section 13) ----

EngineRequest PrefillLeg(std::string id, std::vector<std::uint32_t> tokens, std::uint32_t max_tokens = 1) {
  return {.id = std::move(id), .tokens = std::move(tokens), .max_tokens = max_tokens, .leg = EngineLeg::kPrefill};
}

// A decode leg whose transfer names the prompt's own hashes at `bs` (valid when bs is the engine's).
EngineRequest DecodeLeg(std::string id, std::vector<std::uint32_t> tokens, std::uint32_t bs,
                        std::uint32_t max_tokens = 1) {
  KvPull transfer{.source_worker_id = 3, .source_request_id = "p-" + id, .blocks = SeqHashes(tokens, bs)};
  return {.id = std::move(id),
          .tokens = std::move(tokens),
          .max_tokens = max_tokens,
          .leg = EngineLeg::kDecode,
          .transfer = std::move(transfer)};
}

// 4 tokens of 1,000 bytes per block at 0.001 Gbit/s: 32 ms per block, before the speedup.
constexpr MockEngineConfig kPdConfig{.num_gpu_blocks = 16,
                                     .block_size = 4,
                                     .speedup_ratio = 2,
                                     .kv_bytes_per_token = 1000,
                                     .kv_transfer_gbps = 0.001,
                                     .kv_lease_ms = 1000};

TEST(MockEngineDisagg, TransferTimeIsTheLackingBlocksBytesOverTheLinkDividedByTheSpeedup) {
  EXPECT_DOUBLE_EQ(MockKvTransferMs(0, kPdConfig), 0.0);
  EXPECT_DOUBLE_EQ(MockKvTransferMs(3, kPdConfig), 3 * 32.0 / 2);
  // The defaults: a 64-token block of 128 KiB per token is 8 MiB, 0.16777216 ms at 400 Gbit/s.
  EXPECT_NEAR(MockKvTransferMs(10, MockEngineConfig{}), 1.6777216, 1e-12);
}

TEST(MockEngineDisagg, PrefillLegAnswersOneTokenAndPinsItsBlocksUntilReleased) {
  MockEngineConfig c = kPdConfig;
  c.num_gpu_blocks = 4;
  EngineHarness h(c);
  h.engine().Add(PrefillLeg("p", Tokens(1, 10), 50));  // 2 full blocks; max_tokens becomes 1
  const double d = h.Step();
  EXPECT_DOUBLE_EQ(d, MockPrefillMs(10, 2));
  ASSERT_NE(h.Find("p", EngineOutput::kFinished), nullptr);
  EXPECT_EQ(h.Find("p", EngineOutput::kFinished)->output_tokens, 1u);
  EXPECT_EQ(h.engine().PinnedBlocks(), 2u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 2u);
  EXPECT_FALSE(h.engine().Idle());
  const auto pinned = h.engine().PinnedBlocksOf("p");
  EXPECT_EQ(std::vector<SequenceHash>(pinned.begin(), pinned.end()), SeqHashes(Tokens(1, 10), 4));

  // 3 new blocks do not fit beside the pinned two: the request waits, and nothing computes.
  h.Add("w", Tokens(100, 12));
  EXPECT_EQ(h.Step(), 0.0);
  EXPECT_EQ(h.engine().NumWaiting(), 1u);
  EXPECT_GT(*h.engine().NextTimerMs(), h.now);

  EXPECT_TRUE(h.engine().ReleasePinned("p"));
  EXPECT_FALSE(h.engine().ReleasePinned("p"));
  EXPECT_TRUE(h.engine().PinnedBlocksOf("p").empty());
  EXPECT_EQ(h.engine().PinnedBlocks(), 0u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 0u);
  EXPECT_EQ(h.engine().CachedBlocks(), 2u);  // released, still cached
  EXPECT_FALSE(h.engine().NextTimerMs().has_value());
  h.Step();
  EXPECT_NE(h.Find("w", EngineOutput::kFirstToken), nullptr);
  h.RunUntilIdle();
  EXPECT_TRUE(h.engine().Idle());
}

TEST(MockEngineDisagg, PinIsReleasedAtTheLeaseEndAndNotBefore) {
  EngineHarness h(kPdConfig);
  h.engine().Add(PrefillLeg("p", Tokens(1, 8)));
  h.Step();
  const double finished = h.Find("p", EngineOutput::kFinished)->at_ms;
  const double lease_end = finished + 1000.0 / 2;  // kv_lease_ms over the speedup
  ASSERT_TRUE(h.engine().NextTimerMs().has_value());
  EXPECT_DOUBLE_EQ(*h.engine().NextTimerMs(), lease_end);

  EXPECT_EQ(h.engine().Step(lease_end - 0.001, h.outputs), 0.0);
  EXPECT_EQ(h.engine().PinnedBlocks(), 2u);
  EXPECT_FALSE(h.engine().Idle());

  EXPECT_EQ(h.engine().Step(lease_end, h.outputs), 0.0);
  EXPECT_EQ(h.engine().PinnedBlocks(), 0u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 0u);
  EXPECT_TRUE(h.engine().Idle());
  EXPECT_FALSE(h.engine().NextTimerMs().has_value());
  EXPECT_FALSE(h.engine().ReleasePinned("p"));  // the lease took it
}

TEST(MockEngineDisagg, BlocksPinnedByTwoLegsCountOnceAndStayUntilBothAreReleased) {
  EngineHarness h(kPdConfig);
  h.engine().Add(PrefillLeg("p1", Tokens(1, 8)));
  h.engine().Add(PrefillLeg("p2", Tokens(1, 12)));     // shares p1's two blocks, one more
  h.engine().Add(PrefillLeg("tiny", Tokens(500, 3)));  // no full block: pins nothing
  h.Step();
  EXPECT_EQ(h.engine().PinnedBlocks(), 3u);
  EXPECT_FALSE(h.engine().ReleasePinned("tiny"));
  EXPECT_TRUE(h.engine().ReleasePinned("p2"));
  EXPECT_EQ(h.engine().PinnedBlocks(), 2u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 2u);
  EXPECT_TRUE(h.engine().ReleasePinned("p1"));
  EXPECT_EQ(h.engine().PinnedBlocks(), 0u);
  EXPECT_TRUE(h.engine().Idle());
}

TEST(MockEngineDisagg, DecodeLegWaitsTheTransferOfTheBlocksItLacksThenDecodes) {
  EngineHarness h(kPdConfig);
  const auto prompt = Tokens(1, 14);  // 3 full blocks
  h.Add("warm", Tokens(1, 4));        // the first of them
  h.RunUntilIdle();
  const double t0 = h.now;
  h.engine().Add(DecodeLeg("d", prompt, 4, 3));
  EXPECT_EQ(h.Step(), 0.0);  // no prefill compute, nothing else runs
  EXPECT_EQ(h.engine().NumTransferring(), 1u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 3u);  // its hit and the two blocks it receives
  const double end = t0 + 2 * 32.0 / 2;
  ASSERT_TRUE(h.engine().NextTimerMs().has_value());
  EXPECT_DOUBLE_EQ(*h.engine().NextTimerMs(), end);
  EXPECT_EQ(h.Find("d", EngineOutput::kPulled), nullptr);

  EXPECT_EQ(h.engine().Step(end - 0.001, h.outputs), 0.0);  // not yet
  EXPECT_EQ(h.Find("d", EngineOutput::kPulled), nullptr);
  h.now = end;
  const double d = h.Step();
  EXPECT_DOUBLE_EQ(d, MockDecodeStepMs(3.0 / 16, 2));  // the first token of a decode step
  const EngineOutput* pulled = h.Find("d", EngineOutput::kPulled);
  ASSERT_NE(pulled, nullptr);
  EXPECT_DOUBLE_EQ(pulled->at_ms, end);
  EXPECT_EQ(pulled->cached_tokens, 4u);
  const EngineOutput* first = h.Find("d", EngineOutput::kFirstToken);
  ASSERT_NE(first, nullptr);
  EXPECT_DOUBLE_EQ(first->at_ms, end + d);
  EXPECT_EQ(first->cached_tokens, 4u);
  h.RunUntilIdle();
  EXPECT_EQ(h.Find("d", EngineOutput::kFinished)->output_tokens, 3u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 0u);
  EXPECT_EQ(h.engine().local_prefills_on_invalid_transfer(), 0u);
}

TEST(MockEngineDisagg, DecodeLegHoldingEveryBlockPullsNothingAndDecodesAtOnce) {
  EngineHarness h(kPdConfig);
  const auto prompt = Tokens(1, 14);
  h.Add("warm", prompt);
  h.RunUntilIdle();
  const std::size_t events = h.events.size();
  const double t0 = h.now;
  h.engine().Add(DecodeLeg("d", prompt, 4));
  const double d = h.Step();
  EXPECT_DOUBLE_EQ(d, MockDecodeStepMs(3.0 / 16, 2));
  EXPECT_EQ(h.engine().NumTransferring(), 0u);
  ASSERT_NE(h.Find("d", EngineOutput::kPulled), nullptr);
  EXPECT_DOUBLE_EQ(h.Find("d", EngineOutput::kPulled)->at_ms, t0);
  EXPECT_DOUBLE_EQ(h.Find("d", EngineOutput::kFirstToken)->at_ms, t0 + d);
  EXPECT_EQ(h.events.size(), events);  // it received nothing
}

TEST(MockEngineDisagg, DecodeLegPublishesStoredForTheReceivedBlocksOnly) {
  EngineHarness h(kPdConfig);
  const auto prompt = Tokens(1, 14);
  const auto seq = SeqHashes(prompt, 4);
  const auto local = ComputeLocalHashes(prompt, 4);
  h.Add("warm", Tokens(1, 4));
  h.RunUntilIdle();
  ASSERT_EQ(h.events.size(), 1u);
  h.engine().Add(DecodeLeg("d", prompt, 4));
  h.Step();  // admitted: the blocks it receives are allocated and published
  ASSERT_EQ(h.events.size(), 2u);
  const KvStored& s = StoredOf(h.events[1]);
  EXPECT_EQ(s.parent_hash, seq[0]);
  ASSERT_EQ(s.blocks.size(), 2u);
  EXPECT_EQ(s.blocks[0], (StoredBlock{seq[1], local[1]}));
  EXPECT_EQ(s.blocks[1], (StoredBlock{seq[2], local[2]}));
  h.now = *h.engine().NextTimerMs();
  h.RunUntilIdle();
  EXPECT_EQ(h.events.size(), 2u);
  EXPECT_EQ(h.engine().CachedPrefixBlocks(seq), 3u);  // kept as its own cached blocks
}

TEST(MockEngineDisagg, InvalidOrMissingTransferMeansALocalPrefill) {
  const auto prompt = Tokens(1, 14);
  EngineRequest missing = DecodeLeg("missing", prompt, 4);
  missing.transfer.reset();
  EngineRequest other_prompt = DecodeLeg("other-prompt", prompt, 4);
  other_prompt.transfer->blocks = SeqHashes(Tokens(2, 14), 4);
  EngineRequest other_block_size = DecodeLeg("other-block-size", prompt, 2);
  EngineRequest short_list = DecodeLeg("short-list", prompt, 4);
  short_list.transfer->blocks.pop_back();
  for (EngineRequest& r :
       {std::ref(missing), std::ref(other_prompt), std::ref(other_block_size), std::ref(short_list)}) {
    SCOPED_TRACE(r.id);
    EngineHarness h(kPdConfig);
    const std::string id = r.id;
    h.engine().Add(std::move(r));
    EXPECT_EQ(h.engine().local_prefills_on_invalid_transfer(), 1u);
    const double d = h.Step();
    EXPECT_DOUBLE_EQ(d, MockPrefillMs(14, 2));  // the whole prompt prefilled here
    EXPECT_EQ(h.engine().NumTransferring(), 0u);
    EXPECT_EQ(h.Find(id, EngineOutput::kPulled), nullptr);
    ASSERT_NE(h.Find(id, EngineOutput::kFirstToken), nullptr);
    EXPECT_DOUBLE_EQ(h.Find(id, EngineOutput::kFirstToken)->at_ms, d);
  }
}

TEST(MockEngineDisagg, AbortDuringTheTransferReleasesItsBlocks) {
  EngineHarness h(kPdConfig);
  h.engine().Add(DecodeLeg("d", Tokens(1, 12), 4));
  h.Step();
  ASSERT_EQ(h.engine().NumTransferring(), 1u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 3u);
  const double end = *h.engine().NextTimerMs();
  EXPECT_TRUE(h.engine().Abort("d"));
  EXPECT_FALSE(h.engine().Abort("d"));
  EXPECT_EQ(h.engine().NumTransferring(), 0u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 0u);
  EXPECT_EQ(h.engine().CachedBlocks(), 3u);  // evictable now
  EXPECT_TRUE(h.engine().Idle());
  EXPECT_FALSE(h.engine().NextTimerMs().has_value());
  EXPECT_EQ(h.engine().Step(end, h.outputs), 0.0);
  EXPECT_EQ(h.Find("d", EngineOutput::kPulled), nullptr);
  EXPECT_EQ(h.Find("d", EngineOutput::kFirstToken), nullptr);
}

TEST(MockEngineDisagg, ATransferEndingInsideAStepIsPulledAtItsEndAndDecodesFromTheNextStep) {
  MockEngineConfig c = kPdConfig;
  c.num_gpu_blocks = 1000;
  EngineHarness h(c);
  h.Add("y", Tokens(5000, 2000), 3);  // a long prefill step
  h.engine().Add(DecodeLeg("d", Tokens(1, 4), 4));
  const double d1 = h.Step();  // y prefills; d's one block arrives 16 ms in
  EXPECT_DOUBLE_EQ(d1, MockPrefillMs(2000, 2));
  ASSERT_GT(d1, 16.0);
  EXPECT_EQ(h.Find("d", EngineOutput::kPulled), nullptr);
  h.Step();
  const EngineOutput* pulled = h.Find("d", EngineOutput::kPulled);
  ASSERT_NE(pulled, nullptr);
  EXPECT_DOUBLE_EQ(pulled->at_ms, 16.0);
  ASSERT_NE(h.Find("d", EngineOutput::kFirstToken), nullptr);
  EXPECT_DOUBLE_EQ(h.Find("d", EngineOutput::kFirstToken)->at_ms, h.now);
}

TEST(MockEngineDisagg, ALegInTransferHoldsItsSlotAndBlocksButDoesNotStopAdmission) {
  MockEngineConfig c = kPdConfig;
  c.max_num_seqs = 2;
  EngineHarness h(c);
  h.engine().Add(DecodeLeg("d", Tokens(1, 8), 4));
  h.Add("a", Tokens(100, 8), 5);  // behind it in the queue
  h.Add("b", Tokens(200, 8), 5);  // the third: max_num_seqs counts the transfer
  h.Step();
  EXPECT_EQ(h.engine().NumTransferring(), 1u);
  EXPECT_NE(h.Find("a", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.Find("b", EngineOutput::kFirstToken), nullptr);
  EXPECT_EQ(h.engine().NumWaiting(), 1u);
  EXPECT_EQ(h.engine().ActiveBlocks(), 4u);
}

TEST(MockEngineDisagg, ADecodeLegTakesNoPrefillBudget) {
  MockEngineConfig c = kPdConfig;
  c.max_num_batched_tokens = 8;
  EngineHarness h(c);
  h.Add("a", Tokens(100, 8));                        // the step's whole budget
  h.engine().Add(DecodeLeg("d", Tokens(1, 16), 4));  // 16 prompt tokens, none computed here
  h.Add("b", Tokens(200, 4));                        // over the budget
  const double d = h.Step();
  EXPECT_DOUBLE_EQ(d, MockPrefillMs(8, 2));
  EXPECT_EQ(h.engine().NumTransferring(), 1u);
  EXPECT_EQ(h.Find("b", EngineOutput::kFirstToken), nullptr);
}

// The owner loop of the header's contract ends, and never steps twice at one time for nothing.
TEST(MockEngineDisagg, AnOwnerSteppingAtNextTimerMsWhenAStepIsEmptyEndsIdle) {
  EngineHarness h(kPdConfig);
  h.engine().Add(PrefillLeg("p", Tokens(1, 16)));
  h.engine().Add(DecodeLeg("d", Tokens(100, 16), 4, 4));
  h.Add("w", Tokens(200, 16), 4);
  int waits = 0;  // steps that computed nothing while a timer was pending
  for (int i = 0; i < 100 && !h.engine().Idle(); ++i) {
    const double d = h.engine().Step(h.now, h.outputs);
    if (d > 0) {
      h.now += d;
      continue;
    }
    if (h.engine().Idle()) break;
    ++waits;
    ASSERT_TRUE(h.engine().NextTimerMs().has_value());
    ASSERT_GT(*h.engine().NextTimerMs(), h.now);
    h.now = *h.engine().NextTimerMs();
  }
  EXPECT_TRUE(h.engine().Idle());
  EXPECT_EQ(waits, 2);  // the transfer (w finished before it), then the lease
  EXPECT_NE(h.Find("d", EngineOutput::kFinished), nullptr);
  EXPECT_NE(h.Find("w", EngineOutput::kFinished), nullptr);
  EXPECT_EQ(h.engine().ActiveBlocks(), 0u);
}

TEST(MockEngineDisagg, AChunkedPrefillLegPinsItsBlocksAtTheEndOfItsLastChunk) {
  MockEngineConfig c = kPdConfig;
  c.max_num_batched_tokens = 8;
  c.chunked_prefill = true;
  EngineHarness h(c);
  h.engine().Add(PrefillLeg("p", Tokens(1, 20), 50));  // 5 full blocks, 20 uncached tokens
  for (int i = 0; i < 2; ++i) {
    EXPECT_NEAR(h.Step(), ChunkStepMs({{8.0 * i, 8.0 * (i + 1)}}) / 2, 1e-9);
    EXPECT_EQ(h.Find("p", EngineOutput::kFinished), nullptr);
    EXPECT_EQ(h.engine().PinnedBlocks(), 0u);
    EXPECT_EQ(h.engine().ActiveBlocks(), 5u);  // referenced by the running leg
  }
  EXPECT_NEAR(h.Step(), ChunkStepMs({{16, 20}}) / 2, 1e-9);
  const EngineOutput* fin = h.Find("p", EngineOutput::kFinished);
  ASSERT_NE(fin, nullptr);
  EXPECT_EQ(fin->output_tokens, 1u);
  EXPECT_DOUBLE_EQ(fin->at_ms, h.now);
  EXPECT_EQ(h.engine().PinnedBlocks(), 5u);
  EXPECT_EQ(h.engine().NumRunning(), 0u);
  ASSERT_TRUE(h.engine().NextTimerMs().has_value());
  EXPECT_DOUBLE_EQ(*h.engine().NextTimerMs(), h.now + 1000.0 / 2);  // the lease from its finish
  EXPECT_TRUE(h.engine().ReleasePinned("p"));
  EXPECT_TRUE(h.engine().Idle());
}

TEST(MockEngineDisagg, AChunkedDecodeLegWithAValidTransferComputesNothing) {
  MockEngineConfig c = kPdConfig;
  c.max_num_batched_tokens = 8;
  c.chunked_prefill = true;
  EngineHarness h(c);
  h.engine().Add(DecodeLeg("d", Tokens(1, 14), 4, 2));  // 3 blocks to pull, 2 tokens of budget over
  EXPECT_EQ(h.Step(), 0.0);
  EXPECT_EQ(h.engine().NumTransferring(), 1u);
  h.now = *h.engine().NextTimerMs();
  EXPECT_DOUBLE_EQ(h.Step(), MockDecodeStepMs(3.0 / 16, 2));  // a decode step, no prefill
  EXPECT_NE(h.Find("d", EngineOutput::kFirstToken), nullptr);
  h.RunUntilIdle();
  EXPECT_EQ(h.Find("d", EngineOutput::kFinished)->output_tokens, 2u);
}

// ---- Events replay exactly ----

// A random shared-prefix workload over a small cache, so that evictions happen all the time.
TEST(MockEngine, ReplayingEveryEventIntoABlockIndexReproducesTheCache) {
  constexpr std::uint32_t kBs = 4;
  std::mt19937_64 rng(20240611);
  BlockIndex index;
  std::uint64_t next_id = 1;
  std::size_t removed = 0, stored = 0;
  KvEventPublisher publisher({.worker_id = kWorker, .dp_rank = kRank});
  MockEngine engine({.num_gpu_blocks = 48, .block_size = kBs, .max_num_seqs = 6, .max_num_batched_tokens = 64},
                    [&](KvEventData&& d) {
                      const KvEventBatch b = publisher.Publish(std::move(d));
                      ASSERT_EQ(b.worker_id, kWorker);
                      ASSERT_EQ(b.dp_rank, kRank);
                      ASSERT_EQ(b.sequence, (EventSequence{SequenceKind::kEventId, next_id}));
                      ASSERT_EQ(b.ops.size(), 1u);
                      ASSERT_EQ(b.ops[0].tier, StorageTier::kDevice);
                      ++next_id;
                      removed += std::holds_alternative<KvRemoved>(b.ops[0].data);
                      stored += std::holds_alternative<KvStored>(b.ops[0].data);
                      Apply(index, b);
                    });

  std::vector<std::vector<std::uint32_t>> prefixes;
  for (std::uint32_t p = 0; p < 6; ++p) prefixes.push_back(Tokens(10000 * (p + 1), kBs * (1 + p % 4)));
  std::vector<std::vector<SequenceHash>> prompts;  // sequence hashes of every prompt sent
  // The live replay and a tree dump (which only reaches blocks whose parents are cached) both
  // agree with the engine.
  auto check = [&] {
    ASSERT_EQ(index.TreeSize(kKey), engine.CachedBlocks());
    BlockIndex dumped;
    for (const auto& b : publisher.Recover(std::nullopt, std::nullopt).events) Apply(dumped, b);
    ASSERT_EQ(dumped.TreeSize(kKey), engine.CachedBlocks());
    for (const auto& seq : prompts) {
      ASSERT_EQ(IndexMatch(index, seq), engine.CachedPrefixBlocks(seq));
      ASSERT_EQ(IndexMatch(dumped, seq), engine.CachedPrefixBlocks(seq));
    }
  };

  std::vector<EngineOutput> outputs;
  double now = 0;
  for (int round = 0; round < 1000; ++round) {
    const int arrivals = static_cast<int>(rng() % 3);
    for (int a = 0; a < arrivals; ++a) {
      auto tokens = prefixes[rng() % prefixes.size()];
      const std::size_t suffix = rng() % (3 * kBs + 3);
      const std::uint32_t salt = static_cast<std::uint32_t>(rng() % 20) * 1000;  // repeats too
      for (std::size_t i = 0; i < suffix; ++i) tokens.push_back(salt + static_cast<std::uint32_t>(i));
      std::string lora = rng() % 8 == 0 ? "adapter" : "";
      prompts.push_back(SeqHashes(tokens, kBs, lora));
      engine.Add({.id = std::to_string(round) + "." + std::to_string(a),
                  .tokens = std::move(tokens),
                  .max_tokens = static_cast<std::uint32_t>(1 + rng() % 6),
                  .lora_name = std::move(lora)});
    }
    now += engine.Step(now, outputs);
    if (round % 25 == 0) check();
  }
  while (!engine.Idle()) now += engine.Step(now, outputs);
  check();
  EXPECT_EQ(publisher.last_event_id(), next_id - 1);
  EXPECT_GT(removed, 100u);  // the workload really evicts
  EXPECT_GT(stored, 200u);
  std::size_t hits = 0;
  for (const auto& o : outputs) hits += o.kind == EngineOutput::kFirstToken && o.cached_tokens > 0;
  EXPECT_GT(hits, 100u);
}

// ---- Recovery ----

class MockEngineRecovery : public ::testing::Test {
 protected:
  // 9 events into a 6-block cache: 5 prompts of 2 blocks (the 4th and 5th evict), then one
  // extending the 5th prompt's blocks (evicts again, stores a chain with a parent).
  void SetUp() override {
    for (std::uint32_t i = 0; i < 5; ++i) h_.Add("r" + std::to_string(i), Tokens(100 * (i + 1), 8));
    h_.RunUntilIdle();
    h_.Add("s", Concat(Tokens(500, 8), Tokens(7, 8)));
    h_.RunUntilIdle();
    ASSERT_EQ(h_.events.size(), 9u);
    ASSERT_EQ(h_.publisher().last_event_id(), 9u);
    ASSERT_EQ(StoredOf(h_.events[8]).parent_hash, SeqHashes(Tokens(500, 8), 4)[1]);
  }
  EngineHarness h_{{.num_gpu_blocks = 6, .block_size = 4}, /*event_buffer=*/4};
};

TEST_F(MockEngineRecovery, EventIdsAreConsecutiveFromOne) {
  for (std::size_t i = 0; i < h_.events.size(); ++i) {
    EXPECT_EQ(h_.events[i].sequence, (EventSequence{SequenceKind::kEventId, i + 1}));
  }
}

TEST_F(MockEngineRecovery, ReturnsTheRequestedRangeFromTheBuffer) {
  const std::uint64_t last = h_.publisher().last_event_id();
  auto r = h_.publisher().Recover(last - 2, last - 1);
  EXPECT_EQ(r.kind, "events");
  EXPECT_EQ(r.last_event_id, last);
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_EQ(r.events[0], h_.events[last - 3]);
  EXPECT_EQ(r.events[1], h_.events[last - 2]);

  auto open = h_.publisher().Recover(last - 3, std::nullopt);  // the oldest buffered id
  EXPECT_EQ(open.kind, "events");
  ASSERT_EQ(open.events.size(), 4u);
  EXPECT_EQ(open.events.back(), h_.events.back());

  auto clamped = h_.publisher().Recover(last, last + 10);
  EXPECT_EQ(clamped.kind, "events");
  ASSERT_EQ(clamped.events.size(), 1u);
}

TEST_F(MockEngineRecovery, StartOlderThanTheBufferGetsATreeDumpThatRebuildsTheCache) {
  const std::uint64_t last = h_.publisher().last_event_id();
  const std::vector<std::optional<std::uint64_t>> starts = {last - 4, 1, std::nullopt};
  for (const auto& start : starts) {
    auto r = h_.publisher().Recover(start, std::nullopt);
    EXPECT_EQ(r.kind, "tree_dump");
    EXPECT_EQ(r.last_event_id, last);
    BlockIndex fresh;
    for (const auto& b : r.events) {
      EXPECT_EQ(b.sequence.value, last);
      Apply(fresh, b);
    }
    EXPECT_EQ(fresh.TreeSize(kKey), h_.engine().CachedBlocks());
    // The same tree as replaying every event.
    BlockIndex replayed;
    for (const auto& b : h_.events) Apply(replayed, b);
    for (std::uint32_t i = 0; i < 5; ++i) {
      const auto seq = SeqHashes(Tokens(100 * (i + 1), 8), 4);
      EXPECT_EQ(IndexMatch(fresh, seq), IndexMatch(replayed, seq));
      EXPECT_EQ(IndexMatch(fresh, seq), h_.engine().CachedPrefixBlocks(seq));
    }
    const auto s = SeqHashes(Concat(Tokens(500, 8), Tokens(7, 8)), 4);
    EXPECT_EQ(IndexMatch(fresh, s), 4u);
  }
}

TEST_F(MockEngineRecovery, StartBeyondTheLastEventIsTooNew) {
  const std::uint64_t last = h_.publisher().last_event_id();
  auto r = h_.publisher().Recover(last + 1, std::nullopt);
  EXPECT_EQ(r.kind, "too_new");
  EXPECT_EQ(r.last_event_id, last);
  EXPECT_TRUE(r.events.empty());
  EXPECT_FALSE(r.message.empty());
}

TEST_F(MockEngineRecovery, EndBeforeStartIsAnInvalidRange) {
  auto r = h_.publisher().Recover(5, 4);
  EXPECT_EQ(r.kind, "invalid_range");
  EXPECT_TRUE(r.events.empty());
}

TEST(MockEngineRecoveryDump, TreeDumpListsParentsBeforeChildren) {
  EngineHarness h({.block_size = 4}, /*event_buffer=*/0);
  // A branching tree: P0 P1 {A2 A3, B2, C2 C3 C4}, and Q0.
  const auto p = Tokens(1, 8);
  h.Add("a", Concat(p, Tokens(100, 8)));
  h.Add("b", Concat(p, Tokens(200, 4)));
  h.Add("c", Concat(p, Tokens(300, 12)));
  h.Add("q", Tokens(900, 4));
  h.RunUntilIdle();
  auto r = h.publisher().Recover(1, std::nullopt);  // nothing buffered
  ASSERT_EQ(r.kind, "tree_dump");
  std::vector<BlockHash> seen;
  std::size_t blocks = 0;
  for (const auto& b : r.events) {
    const KvStored& s = StoredOf(b);
    if (s.parent_hash) {
      EXPECT_NE(std::find(seen.begin(), seen.end(), *s.parent_hash), seen.end());
    }
    for (const auto& blk : s.blocks) seen.push_back(blk.block_hash);
    blocks += s.blocks.size();
  }
  EXPECT_EQ(blocks, h.engine().CachedBlocks());
  EXPECT_EQ(blocks, 9u);
  EXPECT_LE(r.events.size(), 4u);  // chains, not one event per block
}

}  // namespace
}  // namespace kvrouter
