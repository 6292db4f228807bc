// An hour of churn on virtual time (the faults issue's soak): 8 workers store and evict prompts,
// clear their caches, restart (ids from 1 again), and lose events on the way, while the router
// recovers them; the ticks run every 50 ms of virtual time. Afterwards the index equals every
// worker, nothing is held or in flight, and the index's memory in the last half hour did not
// grow past what it reached in the first ten minutes.
#include <gtest/gtest.h>

#include <random>

#include "tests/router/service/fake_worker.h"
#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
using testing::FakeWorker;
using testing::kBs;
using testing::PromptTokens;

class SoakTest : public testing::ServiceTest {};

TEST_F(SoakTest, AnHourOfChurnKeepsTheIndexExactAndItsMemoryFlat) {
  StartWith({"--router-mode", "kv"});
  constexpr int kWorkers = 8;
  std::vector<std::unique_ptr<FakeWorker>> workers;
  for (std::uint64_t id = 1; id <= kWorkers; ++id) {
    workers.push_back(std::make_unique<FakeWorker>(bus_, id));
    Register(id, {.lease_ms = 3'600'000});
  }
  std::mt19937_64 rng(2026);
  std::vector<std::vector<BlockHash>> leaves(kWorkers);  // what each worker may evict
  std::size_t memory_at_10_min = 0, most_after_30_min = 0;
  constexpr int kStepsPerSecond = 20;  // one event every 50 ms of virtual time
  for (int step = 0; step < 3600 * kStepsPerSecond; ++step) {
    const std::size_t w = rng() % kWorkers;
    FakeWorker& worker = *workers[w];
    MessageBus* via = rng() % 50 == 0 ? nullptr : &bus_;  // 2 % of events are lost
    const unsigned roll = rng() % 1000;
    if (roll == 0) {
      worker.Clear(via);
      leaves[w].clear();
    } else if (roll == 1) {
      worker.Restart();  // the next event has id 1: the router clears the rank
      leaves[w].clear();
    } else if (roll < 400 && !leaves[w].empty()) {
      const std::size_t k = rng() % leaves[w].size();
      worker.Remove({leaves[w][k]}, via);
      leaves[w].erase(leaves[w].begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const auto tokens = PromptTokens(static_cast<std::uint32_t>(rng() % 400));
      const KvEventBatch chain = StoredPromptBatch(worker.id(), 0, tokens, kBs);
      leaves[w].push_back(std::get<KvStored>(chain.ops[0].data).blocks.back().block_hash);
      worker.Store(tokens, via);
    }
    // The shards answer this step's events (and recover on their threads) before the clock moves:
    // virtual time runs thousands of times faster than theirs and would make every reply late.
    svc_->index().Flush();
    now_ += milliseconds(50);
    svc_->Tick();
    if (step == 600 * kStepsPerSecond) {
      memory_at_10_min = svc_->index().Memory().bytes;
    }
    if (step > 1800 * kStepsPerSecond && step % (60 * kStepsPerSecond) == 0) {
      most_after_30_min = std::max(most_after_30_min, svc_->index().Memory().bytes);
    }
  }
  // One event per worker, delivered, reveals a loss at the very end of its stream.
  for (auto& w : workers) w->Store(PromptTokens(999), &bus_);
  svc_->index().Flush();
  for (auto& w : workers) {
    EXPECT_EQ(svc_->index().TreeSize({w->id(), 0}), w->publisher().held_blocks()) << "worker " << w->id();
  }
  StatsReply s = Stats();
  EXPECT_EQ(s.counters.at("recoveries_in_flight"), 0u);
  EXPECT_EQ(s.counters.at("recoveries_waiting"), 0u);
  EXPECT_EQ(s.counters.at("recoveries_failed"), 0u);
  EXPECT_GT(s.counters.at("recoveries_succeeded"), 100u);
  EXPECT_GT(s.counters.at("event_restarts"), 0u);
  ASSERT_GT(memory_at_10_min, 0u);
  EXPECT_LE(most_after_30_min, memory_at_10_min * 5 / 4)
      << "the index grew: " << memory_at_10_min << " -> " << most_after_30_min;
}

}  // namespace
}  // namespace kvrouter
