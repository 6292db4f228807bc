// Recovery (docs/protocol.md section 6) of the service on an in-memory bus: workers that serve the
// endpoint from a KvEventPublisher (as kvmocker does), workers that do not, lost events, a
// restarted router, large dumps in parts, and a bus that drops, duplicates, reorders and delays
// events - after which the router's index must equal what the workers hold, exactly.
#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <random>

#include "events/event_codec.h"
#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"
#include "tests/router/service/fake_worker.h"
#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
using testing::FakeWorker;
using testing::kBs;
using testing::PromptTokens;

class RecoveryTest : public testing::ServiceTest {
 protected:
  void StartRouter(std::vector<std::string> flags = {}) {
    flags.insert(flags.begin(), {"--router-mode", "kv"});
    StartWith(flags);
  }
  // The router's overlap for `tokens` on worker `id`, as best_worker sees it.
  std::uint32_t Overlap(std::uint64_t id, const std::vector<std::uint32_t>& tokens) {
    svc_->index().Flush();
    RouteRequest q = Prompt(tokens);
    q.allowed_worker_ids = std::vector<std::uint64_t>{id};
    auto r = Route(q, /*best_worker=*/true);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->overlap_blocks : 0;
  }
  // The index holds exactly what the worker holds.
  void ExpectIndexEqualsWorker(const FakeWorker& w) {
    svc_->index().Flush();
    EXPECT_EQ(svc_->index().TreeSize({w.id(), 0}), w.publisher().held_blocks()) << "worker " << w.id();
  }
};

TEST_F(RecoveryTest, ALostEventIsRecoveredFromTheWorker) {
  StartRouter();
  FakeWorker w(bus_, 1);
  Register(1);
  svc_->index().Flush();  // its first-sight dump (empty) is done
  w.Store(PromptTokens(1), &bus_);
  w.Store(PromptTokens(2), nullptr);  // lost on the way
  w.Store(PromptTokens(3), &bus_);    // reveals the gap
  EXPECT_EQ(Overlap(1, PromptTokens(2)), 4u);
  EXPECT_EQ(Overlap(1, PromptTokens(3)), 4u);
  ExpectIndexEqualsWorker(w);
  EXPECT_GE(Counter("recoveries_succeeded"), 2u);  // the first-sight dump and the gap's range
  EXPECT_EQ(Counter("recoveries_failed"), 0u);
  EXPECT_EQ(Counter("events_recovered"), 2u);  // the range [2, 3]; 3 was held, then dropped
}

TEST_F(RecoveryTest, ARestartedRouterLearnsEveryCacheFromDumpsBeforeAnyNewEvent) {
  FakeWorker w(bus_, 1);
  for (std::uint32_t p = 1; p <= 5; ++p) w.Store(PromptTokens(p), nullptr);  // before this router
  StartRouter();
  Register(1);  // its heartbeat: first sight
  for (std::uint32_t p = 1; p <= 5; ++p) EXPECT_EQ(Overlap(1, PromptTokens(p)), 4u) << p;
  ExpectIndexEqualsWorker(w);
  EXPECT_EQ(Counter("recovery_dumps"), 1u);
}

TEST_F(RecoveryTest, ARestartedWorkerWhoseFirstEventWasLostIsRecoveredFromADump) {
  StartRouter();
  FakeWorker w(bus_, 1);
  Register(1);
  for (std::uint32_t p = 1; p <= 5; ++p) w.Store(PromptTokens(p), &bus_);  // ids 1..5
  svc_->index().Flush();
  // First sight asks a dump (one or two, as the registration and the first event race).
  const std::uint64_t dumps_before = Counter("recovery_dumps");
  w.Restart();                                  // an empty cache, ids from 1 again
  w.Store(PromptTokens(10), nullptr);           // id 1, lost: the router never sees the restart
  w.Store(PromptTokens(11), &bus_);             // id 2, below the cursor (5): not a repeat of it
  EXPECT_EQ(Overlap(1, PromptTokens(1)), 0u);   // the old cache is gone
  EXPECT_EQ(Overlap(1, PromptTokens(10)), 4u);  // the lost event came back with the dump
  EXPECT_EQ(Overlap(1, PromptTokens(11)), 4u);
  ExpectIndexEqualsWorker(w);
  w.Store(PromptTokens(12), &bus_);  // id 3 follows the dump's cursor: applied, no new recovery
  EXPECT_EQ(Overlap(1, PromptTokens(12)), 4u);
  EXPECT_EQ(Counter("recoveries_failed"), 0u);
  EXPECT_EQ(Counter("recoveries_restarted"), 1u);          // the range asked was answered too_new
  EXPECT_EQ(Counter("recovery_dumps"), dumps_before + 1);  // the restart's
}

TEST_F(RecoveryTest, ALateEventBelowTheCursorCostsARangeNotADump) {
  StartRouter();
  FakeWorker w(bus_, 1);
  Register(1);
  svc_->index().Flush();
  w.Store(PromptTokens(1), &bus_);
  const msgpack::sbuffer late = w.Store(PromptTokens(2), &bus_);  // id 2
  w.Store(PromptTokens(3), &bus_);                                // id 3: the cursor
  svc_->index().Flush();
  const std::uint64_t dumps = Counter("recovery_dumps");
  const std::uint64_t ranges = Counter("recoveries_succeeded");
  (void)bus_.Publish(KvEventsSubject("dynamo", "backend"), AsBytes(late));  // id 2 again, late
  svc_->index().Flush();
  EXPECT_EQ(Counter("recovery_dumps"), dumps);
  EXPECT_EQ(Counter("recoveries_succeeded"), ranges + 1);  // [3, ...]: nothing new
  EXPECT_EQ(Counter("recoveries_failed"), 0u);
  ExpectIndexEqualsWorker(w);
}

TEST_F(RecoveryTest, AWorkerWithoutTheEndpointIsIndexedAtOnceAndCounted) {
  StartRouter();
  FakeWorker w(bus_, 1, /*serve=*/false);
  Register(1);
  svc_->index().Flush();  // its first-sight dump failed at once: no responders
  EXPECT_EQ(Counter("recoveries_failed"), 1u);
  w.Store(PromptTokens(1), &bus_);
  EXPECT_EQ(Overlap(1, PromptTokens(1)), 4u);  // indexed at once, not asked again
  w.Store(PromptTokens(2), nullptr);
  w.Store(PromptTokens(3), &bus_);  // a gap: not asked again so soon (backoff), applied as it is
  EXPECT_EQ(Overlap(1, PromptTokens(3)), 4u);
  EXPECT_EQ(Overlap(1, PromptTokens(2)), 0u);
  EXPECT_EQ(Counter("recoveries_backed_off"), 1u);
}

TEST_F(RecoveryTest, AWorkerThatNeverAnswersTimesOutAfterOneSecond) {
  StartRouter();
  FakeWorker w(bus_, 1);
  w.set_answer(false);
  Register(1);
  w.Store(PromptTokens(1), &bus_);
  EXPECT_EQ(Overlap(1, PromptTokens(1)), 0u);  // held while the dump is awaited
  now_ += milliseconds(999);
  svc_->Tick();
  EXPECT_EQ(Overlap(1, PromptTokens(1)), 0u);
  now_ += milliseconds(2);
  svc_->Tick();
  EXPECT_EQ(Overlap(1, PromptTokens(1)), 4u);
  EXPECT_EQ(Counter("recoveries_failed"), 1u);
}

TEST_F(RecoveryTest, ALargeDumpArrivesInPartsAndRebuildsTheWorkerExactly) {
  StartRouter();
  bus_.set_max_payload(16 << 10);  // 16 KiB messages: the dump needs many parts
  FakeWorker w(bus_, 1);
  for (std::uint32_t p = 1; p <= 300; ++p) w.Store(PromptTokens(p, 8), nullptr);
  Register(1);
  ExpectIndexEqualsWorker(w);
  EXPECT_EQ(w.publisher().held_blocks(), 2400u);
  EXPECT_GT(Counter("recovery_parts"), 5u);
  EXPECT_EQ(Overlap(1, PromptTokens(150, 8)), 8u);
}

TEST_F(RecoveryTest, AGapOlderThanTheWorkersBufferGetsADump) {
  StartRouter();
  FakeWorker w(bus_, 1, /*serve=*/true, /*buffer=*/2);
  Register(1);
  w.Store(PromptTokens(1), &bus_);
  for (std::uint32_t p = 2; p <= 6; ++p) w.Store(PromptTokens(p), nullptr);  // 5 lost
  w.Store(PromptTokens(7), &bus_);
  for (std::uint32_t p = 1; p <= 7; ++p) EXPECT_EQ(Overlap(1, PromptTokens(p)), 4u) << p;
  ExpectIndexEqualsWorker(w);
}

// Publishes KV events with faults: drops, duplicates, swaps neighbours and delays (seeded).
class FaultyBus {
 public:
  FaultyBus(InMemoryBus& bus, std::uint64_t seed) : bus_(bus), rng_(seed) {}
  void Send(msgpack::sbuffer body) {
    std::uniform_real_distribution<double> u(0, 1);
    const double x = u(rng_);
    if (x < 0.10) return;  // dropped
    if (x < 0.15) {        // delayed: sent after a few others
      delayed_.push_back(std::move(body));
      return;
    }
    if (x < 0.25 && held_) {  // swapped with the one before
      Publish(body);
      Publish(*held_);
      held_.reset();
      return;
    }
    if (held_) Publish(*held_);
    held_.reset();
    if (x < 0.30) Publish(body);  // duplicated
    if (x < 0.40) {
      held_ = std::move(body);  // may be swapped with the next
      return;
    }
    Publish(body);
    if (!delayed_.empty() && u(rng_) < 0.3) {
      Publish(delayed_.front());
      delayed_.pop_front();
    }
  }
  void Drain() {
    if (held_) Publish(*held_);
    held_.reset();
    for (auto& b : delayed_) Publish(b);
    delayed_.clear();
  }

 private:
  void Publish(const msgpack::sbuffer& b) {
    (void)bus_.Publish(KvEventsSubject("dynamo", "backend"), AsBytes(b));
  }
  InMemoryBus& bus_;
  std::mt19937_64 rng_;
  std::optional<msgpack::sbuffer> held_;
  std::deque<msgpack::sbuffer> delayed_;
};

TEST_F(RecoveryTest, AfterDropsDuplicatesReordersAndDelaysTheIndexEqualsEveryWorker) {
  StartRouter();
  std::vector<std::unique_ptr<FakeWorker>> workers;
  for (std::uint64_t id = 1; id <= 4; ++id) {
    workers.push_back(std::make_unique<FakeWorker>(bus_, id));
    Register(id);
  }
  FaultyBus faults(bus_, 7);
  std::mt19937_64 rng(11);
  std::vector<std::vector<BlockHash>> stored(workers.size());
  for (int step = 0; step < 2000; ++step) {
    const std::size_t wi = rng() % workers.size();
    FakeWorker& w = *workers[wi];
    if (!stored[wi].empty() && rng() % 3 == 0) {
      // Remove a whole prompt's last block (a leaf, as an engine evicts).
      const std::size_t k = rng() % stored[wi].size();
      faults.Send(w.Remove({stored[wi][k]}, nullptr));
      stored[wi].erase(stored[wi].begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const auto tokens = PromptTokens(static_cast<std::uint32_t>(rng() % 200));
      const KvEventBatch chain = StoredPromptBatch(w.id(), 0, tokens, kBs);
      stored[wi].push_back(std::get<KvStored>(chain.ops[0].data).blocks.back().block_hash);
      faults.Send(w.Store(tokens, nullptr));
    }
    if (step % 100 == 0) {
      now_ += milliseconds(50);
      svc_->Tick();
    }
  }
  faults.Drain();
  // One last event per worker, delivered, reveals any gap at the end of its stream.
  for (auto& w : workers) w->Store(PromptTokens(999), &bus_);
  now_ += milliseconds(50);
  svc_->Tick();
  for (auto& w : workers) ExpectIndexEqualsWorker(*w);
  // No wrong overlaps: every prompt the router credits to a worker, the worker holds.
  for (std::uint32_t p = 0; p < 200; ++p) {
    const auto tokens = PromptTokens(p);
    const auto seq = ComputeSequenceHashes(ComputeLocalHashes(tokens, kBs));
    for (auto& w : workers) {
      std::uint32_t held = 0;
      const auto blocks = w->publisher().HeldBlocks();
      for (SequenceHash h : seq) {
        if (!std::binary_search(blocks.begin(), blocks.end(), HeldBlock{h},
                                [](const HeldBlock& a, const HeldBlock& b) { return a.block_hash < b.block_hash; })) {
          break;
        }
        ++held;
      }
      EXPECT_EQ(Overlap(w->id(), tokens), held) << "prompt " << p << " worker " << w->id();
    }
  }
  EXPECT_GT(Counter("recoveries_succeeded"), 10u);
  EXPECT_EQ(Counter("recoveries_failed"), 0u);
  EXPECT_EQ(Counter("recoveries_backed_off"), 0u);
}

}  // namespace
}  // namespace kvrouter
