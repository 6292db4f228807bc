// RecoveryClient on its own (docs/protocol.md section 6): on an in-memory bus, against recovery
// endpoints the test answers by hand, with a clock the test moves and a real ShardedIndex
// receiving the reply parts. The index's recovery asks are recorded and handed to the client
// by the test thread, so that every call of the client runs on the test's thread.
#include "router/service/recovery_client.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "events/base/log.h"
#include "events/kv_event.h"
#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"
#include "router/index/sharded_index.h"
#include "transport/memory_bus.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
constexpr std::uint32_t kBs = 4;

// The tokens of prompt `p`: 4 blocks, distinct per prompt.
std::vector<std::uint32_t> Tokens(std::uint32_t p) {
  std::vector<std::uint32_t> t(4 * kBs);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = p * 1000 + static_cast<std::uint32_t>(i);
  return t;
}

class RecoveryClientTest : public ::testing::Test {
 protected:
  // What the index asked to recover (RecoveryNeeded's arguments).
  struct Ask {
    WorkerKey worker;
    SequenceKind numbering;
    std::optional<std::uint64_t> start;
    std::uint64_t generation;
  };
  // A query that reached a worker's endpoint, and where to answer it.
  struct Query {
    RecoveryQuery query;
    std::string reply_to;
  };

  void SetUp() override { Start({}); }

  void Start(RecoveryClient::Options options) {
    options.reply_prefix = "_REC.";
    client_sub_.reset();
    client_ = std::make_unique<RecoveryClient>(
        options, bus_, index_, [this] { return now_; }, log_);
    client_sub_ = std::move(bus_.Subscribe(client_->subject_pattern(), "", [this](const BusMessage& m) {
                    client_->OnReply(m);
                  })).value();
  }

  // Serves worker `id`'s rank 0 endpoint: records each query, answers none (the test does).
  void Serve(std::uint64_t id) {
    endpoints_[id] =
        std::move(bus_.Subscribe(RecoverySubject("dynamo", "backend", id, 0), "", [this, id](const BusMessage& m) {
          auto q = RecoveryQuery::Decode(m.data);
          ASSERT_TRUE(q.ok()) << q.status().ToString();
          queries_[id].push_back({*q, std::string(m.reply)});
        })).value();
  }
  void StopServing(std::uint64_t id) { endpoints_.erase(id); }

  void Need(std::uint64_t id, std::optional<std::uint64_t> start, std::uint64_t generation = 1) {
    client_->Need({id, 0}, SequenceKind::kEventId, start, generation);
  }
  // Hands every ask the index made so far to the client.
  void HandAsksToTheClient() {
    index_.Flush();
    std::vector<Ask> asks;
    {
      std::lock_guard g(asks_mu_);
      asks.swap(asks_);
    }
    for (const Ask& a : asks) {
      handed_.push_back(a);
      client_->Need(a.worker, a.numbering, a.start, a.generation);
    }
  }

  void Answer(const std::string& reply_to, const RecoveryReply& reply) {
    ASSERT_TRUE(bus_.Publish(reply_to, AsBytes(EncodeRecoveryReply(reply))).ok());
  }
  // The last query worker `id` received.
  const Query& Last(std::uint64_t id) {
    EXPECT_FALSE(queries_[id].empty()) << "worker " << id << " was not asked";
    static const Query kNone{};
    return queries_[id].empty() ? kNone : queries_[id].back();
  }
  std::size_t Asked(std::uint64_t id) { return bus_.published(RecoverySubject("dynamo", "backend", id, 0)); }
  RecoveryCounters Counters() const { return client_->counters(); }

  InMemoryBus bus_;
  SteadyTime now_{};  // read and moved on the test's thread only
  RateLimitedLog log_{std::chrono::seconds(10), [this] { return now_; }, [](LogLevel, std::string_view) {}};
  std::mutex asks_mu_;
  std::vector<Ask> asks_;  // guarded by asks_mu_: the shard thread appends
  std::vector<Ask> handed_;
  ShardedIndex index_{{.num_shards = 1,
                       .on_recovery = [this](WorkerKey w, SequenceKind k, std::optional<std::uint64_t> start,
                                             std::uint64_t generation) {
                         std::lock_guard g(asks_mu_);
                         asks_.push_back({w, k, start, generation});
                       }}};
  std::unique_ptr<RecoveryClient> client_;
  std::map<std::uint64_t, std::vector<Query>> queries_;
  std::map<std::uint64_t, std::unique_ptr<BusSubscription>> endpoints_;
  std::unique_ptr<BusSubscription> client_sub_;
};

TEST_F(RecoveryClientTest, ARangeAsksTheRanksEndpointFromItsStartAndItsFinalReplyEndsIt) {
  Serve(3);
  client_->Need({3, 0}, SequenceKind::kEventId, 5, 1);
  ASSERT_EQ(queries_[3].size(), 1u);
  EXPECT_EQ(Last(3).query, (RecoveryQuery{.start_event_id = 5}));
  EXPECT_TRUE(Last(3).reply_to.starts_with("_REC.")) << Last(3).reply_to;
  RecoveryCounters c = Counters();
  EXPECT_EQ(c.started, 1u);
  EXPECT_EQ(c.dumps, 0u);
  EXPECT_EQ(c.in_flight, 1u);
  EXPECT_FALSE(client_->AwaitIdle(milliseconds(0)));
  now_ += milliseconds(40);
  Answer(Last(3).reply_to, {.kind = "events", .last_event_id = 5});
  c = Counters();
  EXPECT_EQ(c.succeeded, 1u);
  EXPECT_EQ(c.failed, 0u);
  EXPECT_EQ(c.parts, 1u);
  EXPECT_EQ(c.in_flight, 0u);
  EXPECT_DOUBLE_EQ(c.max_ms, 40.0);
  EXPECT_TRUE(client_->AwaitIdle(milliseconds(0)));
}

TEST_F(RecoveryClientTest, ADumpAsksWithoutAStartOnTheRanksOwnSubject) {
  endpoints_[3] = std::move(bus_.Subscribe(RecoverySubject("dynamo", "backend", 3, 2), "", [this](const BusMessage& m) {
                    queries_[3].push_back({RecoveryQuery::Decode(m.data).value(), std::string(m.reply)});
                  })).value();
  client_->Need({3, 2}, SequenceKind::kEventId, std::nullopt, 1);
  ASSERT_EQ(queries_[3].size(), 1u);
  EXPECT_EQ(Last(3).query, RecoveryQuery{});
  EXPECT_EQ(Counters().dumps, 1u);
}

TEST_F(RecoveryClientTest, AtMostSixteenRunAtOnceAndTheRestStartInOrderAsOthersEnd) {
  for (std::uint64_t id = 1; id <= 20; ++id) Serve(id);
  for (std::uint64_t id = 1; id <= 20; ++id) Need(id, std::nullopt);
  for (std::uint64_t id = 1; id <= 16; ++id) EXPECT_EQ(queries_[id].size(), 1u) << id;
  for (std::uint64_t id = 17; id <= 20; ++id) EXPECT_TRUE(queries_[id].empty()) << id;
  RecoveryCounters c = Counters();
  EXPECT_EQ(c.in_flight, 16u);
  EXPECT_EQ(c.waiting, 4u);
  EXPECT_EQ(c.started, 16u);
  Answer(Last(5).reply_to, {.kind = "tree_dump"});  // one ends: the first waiting starts
  EXPECT_EQ(queries_[17].size(), 1u);
  EXPECT_TRUE(queries_[18].empty());
  Answer(Last(9).reply_to, {.kind = "error", .message = "no"});  // a failure frees a place too
  EXPECT_EQ(queries_[18].size(), 1u);
  EXPECT_TRUE(queries_[19].empty());
  c = Counters();
  EXPECT_EQ(c.in_flight, 16u);
  EXPECT_EQ(c.waiting, 2u);
}

TEST_F(RecoveryClientTest, MaxInFlightIsAnOption) {
  RecoveryClient::Options o;
  o.max_in_flight = 2;
  Start(o);
  for (std::uint64_t id = 1; id <= 3; ++id) Serve(id);
  for (std::uint64_t id = 1; id <= 3; ++id) Need(id, std::nullopt);
  EXPECT_EQ(Counters().in_flight, 2u);
  EXPECT_TRUE(queries_[3].empty());
}

TEST_F(RecoveryClientTest, AReplyInPartsEndsWithItsLastPartAndEachPartIsCounted) {
  Serve(1);
  Need(1, std::nullopt);
  const std::string to = Last(1).reply_to;
  Answer(to, {.kind = "tree_dump", .more = true});
  Answer(to, {.kind = "tree_dump", .more = true});
  RecoveryCounters c = Counters();
  EXPECT_EQ(c.parts, 2u);
  EXPECT_EQ(c.in_flight, 1u);
  EXPECT_EQ(c.succeeded, 0u);
  Answer(to, {.kind = "tree_dump"});
  c = Counters();
  EXPECT_EQ(c.parts, 3u);
  EXPECT_EQ(c.in_flight, 0u);
  EXPECT_EQ(c.succeeded, 1u);
}

TEST_F(RecoveryClientTest, NoReplyWithinTheTimeoutFailsTheRecoveryAndALateReplyIsIgnored) {
  Serve(1);
  Need(1, 4);
  now_ += milliseconds(999);
  client_->Tick();
  EXPECT_EQ(Counters().in_flight, 1u);
  now_ += milliseconds(1);
  client_->Tick();
  RecoveryCounters c = Counters();
  EXPECT_EQ(c.failed, 1u);
  EXPECT_EQ(c.in_flight, 0u);
  Answer(Last(1).reply_to, {.kind = "events"});  // too late
  c = Counters();
  EXPECT_EQ(c.parts, 0u);
  EXPECT_EQ(c.succeeded, 0u);
  EXPECT_EQ(c.failed, 1u);
}

TEST_F(RecoveryClientTest, EachPartGivesTheNextOneTheFullTimeout) {
  Serve(1);
  Need(1, std::nullopt);
  now_ += milliseconds(800);
  Answer(Last(1).reply_to, {.kind = "tree_dump", .more = true});
  now_ += milliseconds(999);  // 1,799 ms after the ask, 999 after the part
  client_->Tick();
  EXPECT_EQ(Counters().in_flight, 1u);
  now_ += milliseconds(1);
  client_->Tick();
  EXPECT_EQ(Counters().failed, 1u);
}

TEST_F(RecoveryClientTest, ARecoveryLongerThanMaxDurationFailsHoweverManyPartsItSends) {
  RecoveryClient::Options o;
  o.max_duration = milliseconds(2000);
  Start(o);
  Serve(1);
  Need(1, std::nullopt);
  for (int i = 0; i < 3; ++i) {
    now_ += milliseconds(500);
    Answer(Last(1).reply_to, {.kind = "tree_dump", .more = true});
    client_->Tick();
  }
  EXPECT_EQ(Counters().in_flight, 1u);  // 1,500 ms
  now_ += milliseconds(499);
  Answer(Last(1).reply_to, {.kind = "tree_dump", .more = true});
  client_->Tick();
  EXPECT_EQ(Counters().in_flight, 1u);
  now_ += milliseconds(1);  // 2,000 ms, the last part 1 ms ago
  client_->Tick();
  EXPECT_EQ(Counters().failed, 1u);
  EXPECT_EQ(Counters().in_flight, 0u);
}

TEST_F(RecoveryClientTest, AWorkerWithoutTheEndpointFailsAtOnce) {
  Need(1, std::nullopt);  // NATS answers "no responders"
  RecoveryCounters c = Counters();
  EXPECT_EQ(c.started, 1u);
  EXPECT_EQ(c.failed, 1u);
  EXPECT_EQ(c.in_flight, 0u);
}

TEST_F(RecoveryClientTest, ErrorInvalidRangeAndUndecodableRepliesFailTheRecovery) {
  for (std::uint64_t id = 1; id <= 4; ++id) Serve(id);
  for (std::uint64_t id = 1; id <= 4; ++id) Need(id, 3);
  Answer(Last(1).reply_to, {.kind = "error", .message = "boom"});
  Answer(Last(2).reply_to, {.kind = "invalid_range", .message = "end < start"});
  ASSERT_TRUE(bus_.Publish(Last(3).reply_to, AsBytes(std::string_view("\xc1", 1))).ok());
  Answer(Last(4).reply_to, {.kind = "something_new"});
  RecoveryCounters c = Counters();
  EXPECT_EQ(c.failed, 4u);
  EXPECT_EQ(c.succeeded, 0u);
  EXPECT_EQ(c.in_flight, 0u);
}

TEST_F(RecoveryClientTest, AQueryThatCannotBeSentFailsItsRecovery) {
  Serve(1);
  bus_.set_max_payload(1);
  Need(1, 7);
  EXPECT_TRUE(queries_[1].empty());
  EXPECT_EQ(Counters().failed, 1u);
  EXPECT_EQ(Counters().in_flight, 0u);
}

TEST_F(RecoveryClientTest, AFailedWorkerIsNotAskedBeforeItsBackoffEndsAndIsCountedAsBackedOff) {
  Need(1, std::nullopt);  // fails: no responders; backoff 100 ms
  ASSERT_EQ(Asked(1), 1u);
  now_ += milliseconds(99);
  Need(1, 5);
  EXPECT_EQ(Asked(1), 1u);
  EXPECT_EQ(Counters().backed_off, 1u);
  EXPECT_EQ(Counters().started, 1u);
  now_ += milliseconds(1);
  Need(1, 5);
  EXPECT_EQ(Asked(1), 2u);
  // Another worker is not held back by it.
  Need(2, std::nullopt);
  EXPECT_EQ(Asked(2), 1u);
  EXPECT_EQ(Counters().backed_off, 1u);
}

TEST_F(RecoveryClientTest, TheBackoffDoublesFrom100MsUpTo10Seconds) {
  const std::vector<int> waits = {100, 200, 400, 800, 1600, 3200, 6400, 10000, 10000};
  Need(1, std::nullopt);  // the first failure
  std::uint64_t asked = 1;
  for (int wait : waits) {
    now_ += milliseconds(wait - 1);
    Need(1, std::nullopt);
    EXPECT_EQ(Asked(1), asked) << "backoff " << wait << " ms";
    now_ += milliseconds(1);
    Need(1, std::nullopt);  // fails again
    EXPECT_EQ(Asked(1), ++asked) << "backoff " << wait << " ms";
  }
  EXPECT_EQ(Counters().backed_off, waits.size());
}

TEST_F(RecoveryClientTest, ASuccessResetsTheBackoff) {
  Need(1, std::nullopt);  // fails: 100 ms
  now_ += milliseconds(100);
  Need(1, std::nullopt);  // fails again: 200 ms
  now_ += milliseconds(200);
  Serve(1);
  Need(1, std::nullopt);
  Answer(Last(1).reply_to, {.kind = "tree_dump"});
  ASSERT_EQ(Counters().succeeded, 1u);
  StopServing(1);
  Need(1, std::nullopt);  // fails: 100 ms again, not 400
  now_ += milliseconds(100);
  Need(1, std::nullopt);
  EXPECT_EQ(Asked(1), 5u);
  EXPECT_EQ(Counters().backed_off, 0u);
}

TEST_F(RecoveryClientTest, ABackoffIsForgottenOnceTheWorkerStaysClearOfFailuresForAsLongAgain) {
  Need(1, std::nullopt);  // fails at 0: backoff 100 ms, remembered until 200
  now_ += milliseconds(200);
  client_->Tick();        // forgotten
  Need(1, std::nullopt);  // fails at 200: 100 ms again (remembered, it would be 200)
  now_ += milliseconds(100);
  Need(1, std::nullopt);
  EXPECT_EQ(Asked(1), 3u);
  EXPECT_EQ(Counters().backed_off, 0u);
}

TEST_F(RecoveryClientTest, ABackoffStillRememberedDoublesTheNextOne) {
  Need(1, std::nullopt);  // fails at 0: backoff 100 ms, remembered until 200
  now_ += milliseconds(199);
  client_->Tick();        // remembered still
  Need(1, std::nullopt);  // fails at 199: 200 ms
  now_ += milliseconds(100);
  Need(1, std::nullopt);
  EXPECT_EQ(Asked(1), 2u);
  EXPECT_EQ(Counters().backed_off, 1u);
}

TEST_F(RecoveryClientTest, RepliesOnSubjectsItNeverHandedOutAreIgnored) {
  Serve(1);
  Need(1, std::nullopt);
  for (const char* subject : {"_REC.", "_REC.x", "_REC.999", "_REC.-1"}) {
    Answer(subject, {.kind = "tree_dump"});
    ASSERT_TRUE(bus_.PublishWithHeaders(subject, {}, {{"Status", "503"}}).ok());
  }
  RecoveryCounters c = Counters();
  EXPECT_EQ(c.parts, 0u);
  EXPECT_EQ(c.succeeded, 0u);
  EXPECT_EQ(c.failed, 0u);
  EXPECT_EQ(c.in_flight, 1u);
}

// ---- with the index: what the client hands it ---------------------------------------------

TEST_F(RecoveryClientTest, ADumpInPartsRebuildsTheRankInTheIndex) {
  KvEventPublisher worker({.worker_id = 5});
  for (std::uint32_t p = 1; p <= 20; ++p) {
    (void)worker.Publish(StoredPromptBatch(5, 0, Tokens(p), kBs).ops.at(0).data);
  }
  Serve(5);
  index_.RequestDump({5, 0});
  HandAsksToTheClient();
  ASSERT_EQ(handed_.size(), 1u);
  EXPECT_EQ(handed_[0].start, std::nullopt);
  auto parts = EncodeRecoveryReplyParts(worker.Answer(Last(5).query), 512);
  ASSERT_TRUE(parts.ok()) << parts.status().ToString();
  ASSERT_GT(parts->size(), 3u);
  for (const auto& part : *parts) ASSERT_TRUE(bus_.Publish(Last(5).reply_to, AsBytes(part)).ok());
  index_.Flush();
  EXPECT_EQ(index_.TreeSize({5, 0}), worker.held_blocks());
  EXPECT_EQ(worker.held_blocks(), 80u);
  EXPECT_EQ(Counters().parts, parts->size());
  EXPECT_EQ(Counters().succeeded, 1u);
}

TEST_F(RecoveryClientTest, AFailureHandsTheIndexItsHeldEventsToApplyAsTheyAre) {
  // Worker 6 does not serve the endpoint. Its first event is held for a first-sight dump.
  KvEventPublisher worker({.worker_id = 6});
  index_.Submit(worker.Publish(StoredPromptBatch(6, 0, Tokens(1), kBs).ops.at(0).data));
  HandAsksToTheClient();
  ASSERT_EQ(handed_.size(), 1u);
  index_.Flush();
  EXPECT_EQ(index_.TreeSize({6, 0}), 4u);  // the dump failed at once: applied as it was
  // A gap: the range it asks is backed off, and fails at once as well.
  (void)worker.Publish(StoredPromptBatch(6, 0, Tokens(2), kBs).ops.at(0).data);  // lost
  index_.Submit(worker.Publish(StoredPromptBatch(6, 0, Tokens(3), kBs).ops.at(0).data));
  HandAsksToTheClient();
  ASSERT_EQ(handed_.size(), 2u);
  EXPECT_EQ(handed_[1].start, std::optional<std::uint64_t>{2});
  index_.Flush();
  EXPECT_EQ(index_.TreeSize({6, 0}), 8u);
  EXPECT_EQ(Counters().backed_off, 1u);
  EXPECT_EQ(Asked(6), 1u);
}

// too_new to a range: the worker restarted (its ids are behind what the index holds). It serves
// the endpoint, so it is not backed off, and the index asks for a dump instead. The range is
// counted as restarted: not recovered (no success), nor a failure (the dump decides that).
TEST_F(RecoveryClientTest, TooNewToARangeIsNotBackedOffAndTheIndexAsksADumpInstead) {
  Serve(7);
  index_.RequestDump({7, 0});
  HandAsksToTheClient();
  Answer(Last(7).reply_to, {.kind = "tree_dump", .last_event_id = 10});  // the cursor is 10
  KvEventBatch gap = StoredPromptBatch(7, 12, Tokens(1), kBs);           // 11 is missing
  index_.Submit(std::move(gap));
  HandAsksToTheClient();
  ASSERT_EQ(handed_.size(), 2u);
  ASSERT_EQ(handed_[1].start, std::optional<std::uint64_t>{11});
  EXPECT_EQ(Last(7).query, (RecoveryQuery{.start_event_id = 11}));
  ASSERT_EQ(Counters().succeeded, 1u);  // the first dump
  Answer(Last(7).reply_to, {.kind = "too_new", .last_event_id = 2, .message = "restarted"});
  EXPECT_EQ(Counters().in_flight, 0u);
  EXPECT_EQ(Counters().succeeded, 1u);
  EXPECT_EQ(Counters().failed, 0u);
  EXPECT_EQ(Counters().restarted, 1u);
  HandAsksToTheClient();
  ASSERT_EQ(handed_.size(), 3u);
  EXPECT_EQ(handed_[2].start, std::nullopt);  // a dump
  EXPECT_EQ(queries_[7].size(), 3u);          // asked at once: no backoff
  EXPECT_EQ(Last(7).query, RecoveryQuery{});
  EXPECT_EQ(Counters().backed_off, 0u);
}

TEST_F(RecoveryClientTest, TooNewToADumpIsAFailureLikeAnyOther) {
  Serve(1);
  Need(1, std::nullopt);
  Answer(Last(1).reply_to, {.kind = "too_new"});
  EXPECT_EQ(Counters().failed, 1u);
  Need(1, std::nullopt);
  EXPECT_EQ(Counters().backed_off, 1u);
  EXPECT_EQ(queries_[1].size(), 1u);
}

}  // namespace
}  // namespace kvrouter
