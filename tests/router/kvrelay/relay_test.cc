// KvRelay on an in-memory bus with a scripted engine: its batches become numbered Dynamo events,
// a gap is filled from the replay, a gap the engine can no longer fill (or a missing replay
// socket) and an engine restart publish `cleared`, bad batches are counted, and the recovery
// endpoint and registrations follow docs/protocol.md sections 4 and 6.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "events/msgpack_reader.h"
#include "events/vllm_codec.h"
#include "events/subjects.h"
#include "events/worker_codec.h"
#include "router/kvrelay/relay.h"
#include "tests/await.h"
#include "transport/memory_bus.h"

namespace kvrouter {
namespace {

constexpr std::uint32_t kBs = 4;
constexpr std::uint64_t kWorker = 42;

// A batch storing one block of 4 tokens starting at `first` under engine hash `hash`.
ZmqBatch Stored(std::int64_t seq, std::uint64_t hash, std::uint32_t first) {
  VllmStoredEvent e{.block_hashes = {hash}, .token_ids = {first, first + 1, first + 2, first + 3}, .block_size = kBs};
  const msgpack::sbuffer body = EncodeVllmBatch(1.0, {e}, 0);
  const auto* p = reinterpret_cast<const std::byte*>(body.data());
  return {"", seq, {p, p + body.size()}};
}

class KvRelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    events_sub_ = bus_.Subscribe("namespace.dynamo.component.backend.kv-events", "",
                                 [this](const BusMessage& m) {
                                   auto b = DecodeDynamoEvent(m.data);
                                   ASSERT_TRUE(b.ok()) << b.status().ToString();
                                   std::lock_guard g(mu_);
                                   events_.push_back(std::move(b).value());
                                 })
                      .value();
    regs_sub_ = bus_.Subscribe("namespace.dynamo.component.backend.instances", "",
                               [this](const BusMessage& m) {
                                 auto r = DecodeWorkerRegistration(m.data);
                                 ASSERT_TRUE(r.ok());
                                 std::lock_guard g(mu_);
                                 regs_.push_back(*r);
                               })
                    .value();
  }
  void Make(bool with_replay,
            RelayOptions options = {.worker_id = kWorker, .block_size = kBs, .total_kv_blocks = 100}) {
    KvRelay::Replay replay;
    if (with_replay) {
      replay = [this](std::int64_t start) -> Result<std::vector<ZmqBatch>> {
        ++replays_;
        if (hold_replays_) {  // an engine slow to answer: until the test lets it
          in_replay_ = true;
          while (hold_replays_.load()) std::this_thread::yield();
        }
        std::vector<ZmqBatch> out;
        for (auto it = engine_.lower_bound(start); it != engine_.end(); ++it) out.push_back(it->second);
        return out;
      };
    }
    relay_ = std::make_unique<KvRelay>(std::move(options), bus_, replay, log_);
    ASSERT_TRUE(relay_->Start().ok());
  }
  // The engine publishes batch `b` (kept for replays); `deliver` false: lost on the way.
  void Engine(const ZmqBatch& b, bool deliver = true) {
    engine_[b.seq] = b;
    if (deliver) relay_->OnBatch(b);
  }
  // What the published events say, in order: "S<hash>" stored, "R<hash>" removed, "C" cleared.
  std::vector<std::string> Ops() const {
    std::vector<std::string> out;
    for (const KvEventBatch& b : events_) {
      for (const KvOp& op : b.ops) {
        if (const auto* s = std::get_if<KvStored>(&op.data)) {
          for (const auto& blk : s->blocks) out.push_back("S" + std::to_string(blk.block_hash));
        } else if (const auto* r = std::get_if<KvRemoved>(&op.data)) {
          for (auto h : r->block_hashes) out.push_back("R" + std::to_string(h));
        } else {
          out.push_back("C");
        }
      }
    }
    return out;
  }

  InMemoryBus bus_;
  RateLimitedLog log_{std::chrono::seconds(10), nullptr, [](LogLevel, std::string_view) {}};
  std::unique_ptr<BusSubscription> events_sub_, regs_sub_;
  // events_ and regs_ are filled on the publishing thread: a test that publishes from two
  // threads reads them under mu_ (the others once their single thread is done).
  std::mutex mu_;
  std::vector<KvEventBatch> events_;
  std::vector<WorkerRegistration> regs_;
  std::map<std::int64_t, ZmqBatch> engine_;
  std::atomic<int> replays_{0};
  std::atomic<bool> hold_replays_{false}, in_replay_{false};
  std::unique_ptr<KvRelay> relay_;
};

TEST_F(KvRelayTest, BatchesBecomeDynamoEventsWithTheirOwnIdsAndTheRouterHashes) {
  Make(true);
  Engine(Stored(0, 7001, 10));
  Engine(Stored(1, 7002, 20));
  ASSERT_EQ(events_.size(), 2u);
  for (std::size_t i = 0; i < events_.size(); ++i) {
    EXPECT_EQ(events_[i].worker_id, kWorker);
    EXPECT_EQ(events_[i].sequence.value, i + 1);  // event ids from 1
  }
  const auto& blk = std::get<KvStored>(events_[0].ops[0].data).blocks.at(0);
  EXPECT_EQ(blk.block_hash, 7001u);  // the engine's hash kept
  const std::vector<std::uint32_t> tokens = {10, 11, 12, 13};
  const KvEventBatch ours = StoredPromptBatch(kWorker, 1, tokens, kBs);
  EXPECT_EQ(blk.tokens_hash, std::get<KvStored>(ours.ops[0].data).blocks.at(0).tokens_hash);  // section 1
  EXPECT_EQ(replays_, 0);  // seq 0 first: nothing missed
  EXPECT_EQ(relay_->counters().batches, 2u);
}

TEST_F(KvRelayTest, AGapIsReplayedFromTheEngine) {
  Make(true);
  Engine(Stored(0, 7001, 10));
  Engine(Stored(1, 7002, 20), /*deliver=*/false);
  Engine(Stored(2, 7003, 30), false);
  Engine(Stored(3, 7004, 40));
  EXPECT_EQ(Ops(), (std::vector<std::string>{"S7001", "S7002", "S7003", "S7004"}));
  EXPECT_EQ(replays_, 1);
  EXPECT_EQ(relay_->counters().replayed, 2u);
  EXPECT_EQ(relay_->counters().gaps_unrepaired, 0u);
}

TEST_F(KvRelayTest, FirstSightPastZeroReplaysTheEnginesHistory) {
  Make(true);
  Engine(Stored(0, 7001, 10), false);  // before the relay was listening
  Engine(Stored(1, 7002, 20), false);
  Engine(Stored(2, 7003, 30));
  EXPECT_EQ(Ops(), (std::vector<std::string>{"S7001", "S7002", "S7003"}));
}

TEST_F(KvRelayTest, AGapTheEngineCanNoLongerFillClearsTheRank) {
  Make(true);
  Engine(Stored(0, 7001, 10));
  Engine(Stored(1, 7002, 20), false);
  Engine(Stored(2, 7003, 30), false);
  engine_.erase(1);  // gone from the engine's buffer
  Engine(Stored(3, 7004, 40));
  EXPECT_EQ(Ops(), (std::vector<std::string>{"S7001", "C", "S7003", "S7004"}));
  EXPECT_EQ(relay_->counters().gaps_unrepaired, 1u);
}

TEST_F(KvRelayTest, WithoutAReplaySocketAGapClearsTheRank) {
  Make(false);
  Engine(Stored(0, 7001, 10));
  Engine(Stored(1, 7002, 20), false);
  Engine(Stored(2, 7003, 30));
  EXPECT_EQ(Ops(), (std::vector<std::string>{"S7001", "C", "S7003"}));
  EXPECT_EQ(relay_->counters().gaps_unrepaired, 1u);
}

TEST_F(KvRelayTest, AnEngineRestartClearsAndCountingStartsAgain) {
  Make(true);
  Engine(Stored(0, 7001, 10));
  Engine(Stored(1, 7002, 20));
  engine_.clear();
  Engine(Stored(0, 7101, 50));  // seq back to 0
  Engine(Stored(1, 7102, 60));
  EXPECT_EQ(Ops(), (std::vector<std::string>{"S7001", "S7002", "C", "S7101", "S7102"}));
  EXPECT_EQ(relay_->counters().restarts, 1u);
  EXPECT_EQ(relay_->last_seq(), 1);
}

TEST_F(KvRelayTest, BadBatchesAreCountedAndNothingElseChanges) {
  Make(true);
  Engine(Stored(0, 7001, 10));
  Engine({"", 1, {std::byte{0xc1}}});  // not msgpack
  VllmStoredEvent wrong{.block_hashes = {7009}, .token_ids = {1, 2, 3, 4, 5, 6, 7, 8}, .block_size = 8};
  const msgpack::sbuffer body = EncodeVllmBatch(1.0, {wrong}, 0);
  const auto* p = reinterpret_cast<const std::byte*>(body.data());
  Engine({"", 2, {p, p + body.size()}});  // blocks of 8 tokens, not 4
  Engine(Stored(3, 7004, 40));
  const KvRelay::Counters c = relay_->counters();
  EXPECT_EQ(c.bad_batches, 1u);
  EXPECT_EQ(c.block_size_mismatches, 1u);
  EXPECT_EQ(c.gaps, 0u);  // a bad batch still moves the seq on
  const std::vector<std::string> ops = Ops();
  EXPECT_EQ(ops.front(), "S7001");
  EXPECT_EQ(ops.back(), "S7004");
  EXPECT_EQ(std::count(ops.begin(), ops.end(), "S7009"), 0);
}

TEST_F(KvRelayTest, ServesRecoveryAndRegistersWithHeartbeatsThenLeaves) {
  Make(true);
  ASSERT_EQ(regs_.size(), 1u);
  EXPECT_EQ(regs_[0].worker_id, kWorker);
  EXPECT_EQ(regs_[0].block_size, kBs);
  EXPECT_EQ(regs_[0].total_kv_blocks, 100u);
  EXPECT_FALSE(regs_[0].leaving);
  Engine(Stored(0, 7001, 10));
  Engine(Stored(1, 7002, 20));
  const auto reply = bus_.Request(RecoverySubject("dynamo", "backend", kWorker, 0), AsBytes(RecoveryQuery{}.Encode()));
  ASSERT_TRUE(reply.has_value());
  auto r = DecodeRecoveryReply(*reply, kWorker);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind, "tree_dump");
  EXPECT_EQ(r->last_event_id, 2u);
  relay_->Tick(std::chrono::steady_clock::now() + std::chrono::seconds(2));
  EXPECT_EQ(regs_.size(), 2u);
  relay_->Stop();
  ASSERT_EQ(regs_.size(), 3u);
  EXPECT_TRUE(regs_.back().leaving);
}

TEST_F(KvRelayTest, RegistrationsCarryTheEnginesUrlAndModels) {
  Make(true,
       {.worker_id = kWorker, .block_size = kBs, .http_url = "http://127.0.0.1:8001", .models = {"llama", "qwen"}});
  relay_->Tick(std::chrono::steady_clock::now() + std::chrono::seconds(2));
  relay_->Stop();
  ASSERT_EQ(regs_.size(), 3u);  // the first, a heartbeat, `leaving`
  for (const WorkerRegistration& r : regs_) {
    EXPECT_EQ(r.http_url, "http://127.0.0.1:8001");
    EXPECT_EQ(r.models, (std::vector<std::string>{"llama", "qwen"}));
  }
}

// Section 13: the engine's role, connector and bootstrap port go into every registration.
TEST_F(KvRelayTest, RegistrationsCarryTheEnginesRoleAndConnector) {
  RelayOptions o{.worker_id = kWorker, .block_size = kBs};
  o.role = WorkerRole::kPrefill;
  o.kv_connector = KvConnector::kSglang;
  o.bootstrap_port = 9100;
  Make(true, o);
  relay_->Stop();
  ASSERT_EQ(regs_.size(), 2u);  // the first, `leaving`
  for (const WorkerRegistration& r : regs_) {
    EXPECT_EQ(r.role, WorkerRole::kPrefill);
    EXPECT_EQ(r.kv_connector, KvConnector::kSglang);
    EXPECT_EQ(r.bootstrap_port, 9100u);
  }
}

TEST_F(KvRelayTest, WithoutAnEngineUrlRegistrationsCarryNone) {
  Make(true);
  ASSERT_EQ(regs_.size(), 1u);
  EXPECT_EQ(regs_[0].http_url, "");
  EXPECT_TRUE(regs_[0].models.empty());
}

RelayOptions Watched() {
  return {.worker_id = kWorker,
          .block_size = kBs,
          .http_url = "http://127.0.0.1:8001",
          .models = {"m"},
          .register_when = RegisterWhen::kEngineUp};
}

TEST_F(KvRelayTest, AWatchedEngineIsRegisteredOnlyOnceItIsUp) {
  Make(true, Watched());
  const SteadyTime now = std::chrono::steady_clock::now();
  relay_->Tick(now + std::chrono::hours(1));
  Engine(Stored(0, 7001, 10));  // an engine still starting: nothing goes out for it
  EXPECT_TRUE(regs_.empty());
  EXPECT_TRUE(events_.empty());
  EXPECT_FALSE(relay_->registered());
  EXPECT_EQ(relay_->counters().batches_engine_down, 1u);

  EXPECT_TRUE(relay_->EngineUp(now));
  EXPECT_FALSE(relay_->EngineUp(now));  // once
  ASSERT_EQ(regs_.size(), 1u);
  EXPECT_FALSE(regs_[0].leaving);
  EXPECT_EQ(regs_[0].http_url, "http://127.0.0.1:8001");
  relay_->Tick(now + std::chrono::seconds(2));
  EXPECT_EQ(regs_.size(), 2u);  // heartbeats
  Engine(Stored(1, 7002, 20));  // seq 0 was dropped: replayed
  EXPECT_EQ(Ops(), (std::vector<std::string>{"S7001", "S7002"}));
}

TEST_F(KvRelayTest, AnEngineThatGoesDownIsClearedAndLeavesAndItsBatchesAreDropped) {
  Make(true, Watched());
  const SteadyTime now = std::chrono::steady_clock::now();
  ASSERT_TRUE(relay_->EngineUp(now));
  Engine(Stored(0, 7001, 10));
  Engine(Stored(1, 7002, 20));
  EXPECT_TRUE(relay_->EngineDown("connection refused"));
  EXPECT_FALSE(relay_->EngineDown("again"));                            // once
  EXPECT_EQ(Ops(), (std::vector<std::string>{"S7001", "S7002", "C"}));  // cleared, then
  ASSERT_EQ(regs_.size(), 2u);
  EXPECT_TRUE(regs_.back().leaving);  // leaving
  EXPECT_FALSE(relay_->registered());
  EXPECT_EQ(relay_->last_seq(), -1);
  relay_->Tick(now + std::chrono::hours(1));
  EXPECT_EQ(regs_.size(), 2u);  // no heartbeat
  Engine(Stored(2, 7003, 30));
  EXPECT_EQ(events_.size(), 3u);  // dropped
  EXPECT_EQ(relay_->counters().batches_engine_down, 1u);
  // The section 6 index is empty: what a router asks when the worker comes back is a fresh view.
  const auto reply = bus_.Request(RecoverySubject("dynamo", "backend", kWorker, 0), AsBytes(RecoveryQuery{}.Encode()));
  ASSERT_TRUE(reply.has_value());
  auto r = DecodeRecoveryReply(*reply, kWorker);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind, "tree_dump");
  EXPECT_TRUE(r->events.empty());
  EXPECT_EQ(r->last_event_id, 3u);  // event ids go on
}

TEST_F(KvRelayTest, AnEngineBackUpRegistersAgainAndItsStreamIsReadAsNew) {
  Make(true, Watched());
  const SteadyTime now = std::chrono::steady_clock::now();
  ASSERT_TRUE(relay_->EngineUp(now));
  Engine(Stored(0, 7001, 10));
  Engine(Stored(1, 7002, 20));
  ASSERT_TRUE(relay_->EngineDown("timeout"));
  // The engine restarted: seq from 0, an empty cache. Its first batch reached the relay while the
  // health checks had not yet said so; the second comes after.
  engine_.clear();
  Engine(Stored(0, 7101, 50));
  EXPECT_TRUE(relay_->EngineUp(now));
  EXPECT_FALSE(regs_.back().leaving);
  Engine(Stored(1, 7102, 60));  // first sight past 0: replayed from 0
  EXPECT_EQ(Ops(), (std::vector<std::string>{"S7001", "S7002", "C", "S7101", "S7102"}));
  EXPECT_EQ(relay_->counters().restarts, 0u);  // no second `cleared`: the engine's going down said it
  EXPECT_EQ(relay_->last_seq(), 1);
}

TEST_F(KvRelayTest, AHiccupThatKeptTheEnginesCacheIsReplayedFromItsStart) {
  Make(true, Watched());
  const SteadyTime now = std::chrono::steady_clock::now();
  ASSERT_TRUE(relay_->EngineUp(now));
  Engine(Stored(0, 7001, 10));
  ASSERT_TRUE(relay_->EngineDown("timeout"));
  ASSERT_TRUE(relay_->EngineUp(now));
  Engine(Stored(1, 7002, 20));  // the same engine, seq going on: its whole history is replayed
  EXPECT_EQ(Ops(), (std::vector<std::string>{"S7001", "C", "S7001", "S7002"}));
  EXPECT_EQ(relay_->counters().gaps_unrepaired, 0u);
}

TEST_F(KvRelayTest, StopAfterTheEngineWentDownStillSaysLeavingAndEngineUpIsRefused) {
  Make(true, Watched());
  const SteadyTime now = std::chrono::steady_clock::now();
  ASSERT_TRUE(relay_->EngineUp(now));
  ASSERT_TRUE(relay_->EngineDown("refused"));
  relay_->Stop();
  EXPECT_TRUE(regs_.back().leaving);
  EXPECT_FALSE(relay_->EngineUp(now));
  EXPECT_TRUE(regs_.back().leaving);
}

// Regression (with kvrelay_test's SigtermDuringAReplaySaysLeavingAtOnce): kvrelay now calls Stop
// from its signal thread while the ZMQ loop may wait in a replay; `leaving` goes out at once and
// the loop, when the replay returns, publishes nothing more for the worker.
TEST_F(KvRelayTest, StopDuringAReplaySaysLeavingAndPublishesNothingAfter) {
  Make(true);
  Engine(Stored(0, 7001, 10));
  Engine(Stored(1, 7002, 20), /*deliver=*/false);
  hold_replays_ = true;
  std::thread zmq_loop([&] { Engine(Stored(2, 7003, 30)); });  // a gap: waits in the replay
  ASSERT_TRUE(AwaitTrue([&] { return in_replay_.load(); }));
  relay_->Stop();  // another thread, the replay still waiting
  std::size_t events_at_stop = 0;
  {
    std::lock_guard g(mu_);
    ASSERT_FALSE(regs_.empty());
    EXPECT_TRUE(regs_.back().leaving);
    events_at_stop = events_.size();
  }
  hold_replays_ = false;
  zmq_loop.join();
  relay_->Tick(std::chrono::steady_clock::now() + std::chrono::hours(1));
  relay_->OnBatch(Stored(3, 7004, 40));
  EXPECT_TRUE(regs_.back().leaving);          // no heartbeat after it
  EXPECT_EQ(events_.size(), events_at_stop);  // neither the replayed batches nor later ones
}

}  // namespace
}  // namespace kvrouter
