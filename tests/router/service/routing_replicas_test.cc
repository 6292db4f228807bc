// Replica sync (--router-replica-sync, docs/protocol.md section 8) on the service: bookings shared
// between replicas, heartbeats, a dead replica's bookings released, epochs after outages.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <set>

#include "events/subjects.h"
#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using testing::kTwelve;
using testing::ServiceTest;

TEST_F(ServiceTest, ReplicaSyncSharesBookingsBetweenReplicas) {
  StartWith({"--router-mode", "kv", "--router-replica-sync"});
  std::vector<const char*> argv = {"kvrouter", "--block-size", "4", "--router-mode", "kv", "--router-replica-sync"};
  auto cfg = ParseRouterConfig(static_cast<int>(argv.size()), argv.data(), [](const char*) { return nullptr; });
  ASSERT_TRUE(cfg.ok());
  KvRouterService other(
      cfg->config, bus_, [this] { return now_.now(); }, 43);
  ASSERT_TRUE(other.Start().ok());
  Register(1);
  ASSERT_TRUE(Route(Prompt(kTwelve, "shared")).ok());  // answered by one replica of the group
  // Each replica's stats (the group alternates between them) counts the booking exactly once.
  for (int i = 0; i < 2; ++i) EXPECT_EQ(Counter("active_requests"), 1u);
  (void)bus_.Publish(svc_->subjects().free, AsBytes(EncodeLifecycleRequest("shared")));
  for (int i = 0; i < 2; ++i) EXPECT_EQ(Counter("active_requests"), 0u);
  // Garbage on the sync subject is counted, not applied.
  (void)bus_.Publish(svc_->subjects().active_sequences, AsBytes(std::string_view("\x81\xa1x\x01")));
  std::uint64_t counted = 0;
  for (int i = 0; i < 2; ++i) {
    counted += Dropped("replica_sync_decode_error");
  }
  EXPECT_EQ(counted, 2u);  // both replicas received it
  EXPECT_EQ(Counter("active_requests"), 0u);
}

TEST_F(ServiceTest, ADeadReplicasBookingsAreReleasedAfterItsHeartbeatsStop) {
  StartWith({"--router-mode", "kv", "--router-replica-sync"});
  Register(1, {.lease_ms = 3'600'000});
  auto heartbeat = [&](std::uint64_t router_id) {
    (void)bus_.Publish(svc_->subjects().router_heartbeats, AsBytes(EncodeRouterHeartbeat({.router_id = router_id})));
  };
  auto add = [&](std::uint64_t router_id, const std::string& id) {
    const ActiveSequenceEvent e{
        .router_id = router_id, .request_id = id, .worker_id = 1, .seq_hashes = {11, 12}, .isl = 8};
    (void)bus_.Publish(svc_->subjects().active_sequences, AsBytes(EncodeActiveSequenceEvent(e)));
  };
  heartbeat(77);
  add(77, "of-77");  // a replica that sends heartbeats
  add(88, "of-88");  // one that never does (another implementation): never judged
  EXPECT_EQ(Counter("active_requests"), 2u);
  EXPECT_EQ(Counter("replica_peers"), 1u);
  now_ += std::chrono::milliseconds(4000);
  svc_->Tick();
  EXPECT_EQ(Counter("active_requests"), 2u);  // silent, but not for long enough
  // While this router's own connection is down nobody can be heard: nothing is judged.
  svc_->OnEventsDisconnected();
  now_ += std::chrono::seconds(30);
  svc_->Tick();
  EXPECT_EQ(Counter("active_requests"), 2u);
  // Back: the peers' `free`s sent meanwhile are lost, so their bookings here go (they would
  // otherwise stay for the 300 s sweep); every peer gets a fresh 5 s.
  svc_->OnEventsReconnected();
  EXPECT_EQ(Counter("active_requests"), 0u);
  EXPECT_EQ(Counter("replica_bookings_released"), 2u);
  add(77, "of-77-again");
  add(88, "of-88-again");
  now_ += std::chrono::milliseconds(4000);
  svc_->Tick();
  EXPECT_EQ(Counter("active_requests"), 2u);
  now_ += std::chrono::milliseconds(1000);
  svc_->Tick();
  EXPECT_EQ(Counter("active_requests"), 1u);  // 77 is dead: its booking goes, 88's stays
  EXPECT_EQ(Counter("replica_bookings_released"), 3u);
  EXPECT_EQ(Counter("replica_peers_dead"), 1u);
  EXPECT_EQ(Counter("replica_peers"), 0u);
  // A live peer keeps its bookings; a heartbeat that cannot be decoded is counted.
  heartbeat(99);
  add(99, "of-99");
  for (int i = 0; i < 10; ++i) {
    now_ += std::chrono::milliseconds(1000);
    heartbeat(99);
    svc_->Tick();
  }
  EXPECT_EQ(Counter("active_requests"), 2u);
  (void)bus_.Publish(svc_->subjects().router_heartbeats, AsBytes(std::string_view("\x81\xa1x\x01")));
  EXPECT_EQ(Dropped("replica_heartbeat_decode_error"), 1u);
}

// A peer whose own connection came back says so with a later epoch: the frees it sent around
// its outage may be lost, so its older bookings go (it sends its live ones again at the new
// epoch), and this router sends its own bookings again (the peer dropped everything synced to it).
TEST_F(ServiceTest, APeersNewEpochReleasesItsOlderBookingsWhicheverMessageSaysItFirst) {
  StartWith({"--router-mode", "kv", "--router-replica-sync"});
  Register(1, {.lease_ms = 3'600'000});
  std::vector<ActiveSequenceEvent> sent;  // this router's sync messages
  auto sub = bus_.Subscribe(svc_->subjects().active_sequences, "", [&](const BusMessage& m) {
    auto e = DecodeActiveSequenceEvent(m.data);
    ASSERT_TRUE(e.ok());
    if (e->router_id != 77) sent.push_back(*e);
  });
  ASSERT_TRUE(sub.ok());
  auto heartbeat = [&](std::uint32_t epoch) {
    (void)bus_.Publish(svc_->subjects().router_heartbeats,
                       AsBytes(EncodeRouterHeartbeat({.router_id = 77, .epoch = epoch})));
  };
  auto add = [&](const std::string& id, std::uint32_t epoch) {
    const ActiveSequenceEvent e{
        .router_id = 77, .request_id = id, .worker_id = 1, .seq_hashes = {11, 12}, .isl = 8, .epoch = epoch};
    (void)bus_.Publish(svc_->subjects().active_sequences, AsBytes(EncodeActiveSequenceEvent(e)));
  };
  heartbeat(0);
  add("a", 0);
  add("b", 0);
  ASSERT_TRUE(Route(Prompt(kTwelve, "ours")).ok());
  ASSERT_EQ(Counter("active_requests"), 3u);
  ASSERT_EQ(sent.size(), 1u);  // our own `add`
  const std::uint32_t our_epoch = sent[0].epoch;
  sent.clear();

  heartbeat(1);  // 77 came back: "a" and "b" may have been freed meanwhile
  EXPECT_EQ(Counter("active_requests"), 1u);
  EXPECT_EQ(Counter("replica_bookings_released"), 2u);
  ASSERT_EQ(sent.size(), 1u);  // ours again, for 77, with the prefill still to do
  EXPECT_EQ(sent[0].request_id, "ours");
  EXPECT_EQ(sent[0].kind, ActiveSequenceEvent::Kind::kAdd);
  EXPECT_EQ(sent[0].isl, 12u);
  EXPECT_EQ(sent[0].overlap_blocks, 0u);
  EXPECT_EQ(sent[0].epoch, our_epoch);  // our own epoch did not change
  add("b", 1);                          // 77's live one, sent again
  heartbeat(1);                         // the same epoch again releases nothing
  EXPECT_EQ(Counter("active_requests"), 2u);

  // A sync message may be handled before the heartbeat that announces its epoch (they come on
  // two subscriptions): it advances the epoch itself, and the heartbeat then releases nothing.
  add("c", 2);
  EXPECT_EQ(Counter("active_requests"), 2u);  // "b" (epoch 1) went, "c" came
  EXPECT_EQ(Counter("replica_bookings_released"), 3u);
  heartbeat(2);
  EXPECT_EQ(Counter("active_requests"), 2u);
  // A message of an older epoch, sent before the outage and handled late: its `free` still
  // applies; its `add` does not (a live booking came again at the new epoch; this one may have
  // been freed by a `free` that was lost).
  const ActiveSequenceEvent late{
      .router_id = 77, .request_id = "c", .worker_id = 1, .kind = ActiveSequenceEvent::Kind::kFree, .epoch = 1};
  (void)bus_.Publish(svc_->subjects().active_sequences, AsBytes(EncodeActiveSequenceEvent(late)));
  EXPECT_EQ(Counter("active_requests"), 1u);
  add("stale", 1);
  EXPECT_EQ(Counter("active_requests"), 1u);
  sent.clear();

  // 77 silent for 5 s is dead here; when it is back at a later epoch it is a peer not known any
  // more, yet it dropped what was synced to it: ours go again. A new peer at epoch 0 gets nothing.
  now_ += std::chrono::milliseconds(5000);
  svc_->Tick();
  EXPECT_EQ(Counter("replica_peers"), 0u);
  heartbeat(3);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].request_id, "ours");
  sent.clear();
  (void)bus_.Publish(svc_->subjects().router_heartbeats, AsBytes(EncodeRouterHeartbeat({.router_id = 78})));
  EXPECT_TRUE(sent.empty());
}

// This router's own outage: afterwards it says so at once (a heartbeat at the next epoch) and
// sends its live bookings again at that epoch, in that order.
TEST_F(ServiceTest, AfterItsOwnOutageAReplicaAnnouncesANewEpochAndSendsItsBookingsAgain) {
  StartWith({"--router-mode", "kv", "--router-replica-sync"});
  Register(1, {.lease_ms = 3'600'000});
  ASSERT_TRUE(Route(Prompt(kTwelve, "ours")).ok());
  (void)bus_.Request(svc_->subjects().mark_prefill, AsBytes(EncodeLifecycleRequest("ours")));
  std::vector<std::string> order;
  auto hb = bus_.Subscribe(svc_->subjects().router_heartbeats, "", [&](const BusMessage& m) {
    auto h = DecodeRouterHeartbeat(m.data);
    ASSERT_TRUE(h.ok());
    order.push_back(fmt::format("heartbeat {}", h->epoch));
  });
  auto sync = bus_.Subscribe(svc_->subjects().active_sequences, "", [&](const BusMessage& m) {
    auto e = DecodeActiveSequenceEvent(m.data);
    ASSERT_TRUE(e.ok());
    const bool add = e->kind == ActiveSequenceEvent::Kind::kAdd;
    // The resume marker's id: "kvrouter-resume-<16 hex digits>-<n>" (random digits).
    std::string id = e->request_id;
    if (id.starts_with("kvrouter-resume-") && id.size() >= 34 && id[32] == '-') id.replace(16, 16, "R");
    order.push_back(fmt::format("{} {} isl {} epoch {}", add ? "add" : "free", id, e->isl, e->epoch));
  });
  ASSERT_TRUE(hb.ok() && sync.ok());
  svc_->Tick();  // a heartbeat at the epoch this router started with
  ASSERT_EQ(order.size(), 1u);
  const std::uint32_t e0 = static_cast<std::uint32_t>(std::stoul(order[0].substr(std::string("heartbeat ").size())));
  EXPECT_GT(e0, 1'700'000'000u);  // the wall clock's seconds: a restart keeps counting up
  order.clear();
  svc_->OnEventsDisconnected();
  svc_->OnEventsReconnected();
  // The marker to itself comes back (this bus hands it to the service before the test, so the
  // service's answer to it is seen first).
  EXPECT_EQ(order, (std::vector<std::string>{fmt::format("heartbeat {}", e0 + 1),
                                             fmt::format("add ours isl 0 epoch {}", e0 + 1),  // prefill done
                                             fmt::format("free kvrouter-resume-R-1 isl 0 epoch {}", e0)}));
  EXPECT_EQ(Counter("active_requests"), 1u);
  // The request connection publishes the sync messages: its own outage moves the epoch too,
  // and releases nothing of the peers (their messages come on the event connection).
  const ActiveSequenceEvent peer{.router_id = 77, .request_id = "theirs", .worker_id = 1, .seq_hashes = {9}, .isl = 4};
  (void)bus_.Publish(svc_->subjects().active_sequences, AsBytes(EncodeActiveSequenceEvent(peer)));
  order.clear();
  svc_->OnRequestsReconnected();
  EXPECT_EQ(order, (std::vector<std::string>{fmt::format("heartbeat {}", e0 + 2),
                                             fmt::format("add ours isl 0 epoch {}", e0 + 2)}));
  EXPECT_EQ(Counter("active_requests"), 2u);
}

// The event connection as NATS delivers it around an outage: messages received before it may
// still wait in the subscription's queue when the reconnected callback runs. This bus holds the
// sync subject's messages while told to, and hands them over later in order.
class HoldingBus : public MessageBus {
 public:
  HoldingBus(InMemoryBus& bus, std::string held) : bus_(bus), held_(std::move(held)) {}
  Result<std::unique_ptr<BusSubscription>> Subscribe(std::string subject, std::string group, Handler h) override {
    if (subject != held_) return bus_.Subscribe(std::move(subject), std::move(group), std::move(h));
    handler_ = h;
    return bus_.Subscribe(std::move(subject), std::move(group), [this, h](const BusMessage& m) {
      if (!holding_) return h(m);
      queued_.emplace_back(m.data.begin(), m.data.end());
    });
  }
  Status Publish(std::string_view subject, std::span<const std::byte> data) override {
    return bus_.Publish(subject, data);
  }
  Status PublishRequest(std::string_view subject, std::string_view reply, std::span<const std::byte> data) override {
    return bus_.PublishRequest(subject, reply, data);
  }
  std::size_t MaxPayload() const override { return bus_.MaxPayload(); }
  Status Flush(std::chrono::milliseconds t) override { return bus_.Flush(t); }

  void Hold() { holding_ = true; }
  void Release() {
    holding_ = false;
    for (const auto& q : queued_) handler_(BusMessage{.subject = held_, .data = q});
    queued_.clear();
  }

 private:
  InMemoryBus& bus_;
  const std::string held_;
  Handler handler_;
  bool holding_ = false;
  std::vector<std::vector<std::byte>> queued_;
};

// A peer's `add` received just before this router's outage and handled after the reconnect: the
// release of the peers' bookings waits for it (its `free` may be lost in the outage), so nothing
// stays booked until the 300 s sweep.
class ReplicaOutageTest : public ServiceTest {
 protected:
  void TearDown() override { svc_.reset(); }  // before the bus it reads events from

  const std::string sync_subject = ActiveSequencesSubject("dynamo", "backend");
  HoldingBus events{bus_, sync_subject};
};

TEST_F(ReplicaOutageTest, TheSyncMessagesQueuedBeforeItAreAppliedBeforeThePeersBookingsGo) {
  StartWith({"--router-mode", "kv", "--router-replica-sync"}, &events);
  ASSERT_EQ(svc_->subjects().active_sequences, sync_subject);
  Register(1, {.lease_ms = 3'600'000});
  auto add = [&](const std::string& id) {
    const ActiveSequenceEvent e{.router_id = 77, .request_id = id, .worker_id = 1, .seq_hashes = {11, 12}, .isl = 8};
    (void)bus_.Publish(sync_subject, AsBytes(EncodeActiveSequenceEvent(e)));
  };
  std::set<std::uint32_t> epochs;  // this router's, from its heartbeats
  auto hb = bus_.Subscribe(svc_->subjects().router_heartbeats, "", [&](const BusMessage& m) {
    auto h = DecodeRouterHeartbeat(m.data);
    ASSERT_TRUE(h.ok());
    epochs.insert(h->epoch);
  });
  ASSERT_TRUE(hb.ok());
  svc_->Tick();
  ASSERT_EQ(epochs.size(), 1u);
  add("applied");
  events.Hold();
  add("queued");  // received, not yet handled, when the connection drops
  svc_->OnEventsDisconnected();
  svc_->OnEventsReconnected();
  EXPECT_EQ(Counter("active_requests"), 1u);  // nothing released before the queue is through
  EXPECT_EQ(epochs.size(), 1u);
  events.Release();  // "queued", then this router's marker
  EXPECT_EQ(Counter("active_requests"), 0u);
  EXPECT_EQ(Counter("replica_bookings_released"), 2u);
  EXPECT_EQ(epochs.size(), 2u);  // the next epoch

  // A marker that never comes back (lost with a second outage, or late) holds the release back
  // for kResumeMarkerWait at most, and only while the connection is up.
  add("before-second");
  events.Hold();
  svc_->OnEventsDisconnected();
  svc_->OnEventsReconnected();
  now_ += KvRouterService::kResumeMarkerWait - std::chrono::milliseconds(1);
  svc_->Tick();
  EXPECT_EQ(Counter("active_requests"), 1u);
  now_ += std::chrono::milliseconds(1);
  svc_->OnEventsDisconnected();
  svc_->Tick();
  EXPECT_EQ(Counter("active_requests"), 1u);  // down again: nobody is judged
  svc_->OnEventsReconnected();
  now_ += KvRouterService::kResumeMarkerWait;
  svc_->Tick();
  EXPECT_EQ(Counter("active_requests"), 0u);
  EXPECT_EQ(epochs.size(), 3u);
  add("after");
  events.Release();  // both markers, late: neither releases anything again
  EXPECT_EQ(Counter("active_requests"), 1u);
  EXPECT_EQ(epochs.size(), 3u);

  // A marker that comes back after the connection dropped again resumes nothing: the peers stay
  // paused (nobody is judged) until the next reconnect's own marker.
  events.Hold();
  svc_->OnEventsDisconnected();
  svc_->OnEventsReconnected();
  svc_->OnEventsDisconnected();
  events.Release();
  EXPECT_EQ(Counter("active_requests"), 1u);
  EXPECT_EQ(epochs.size(), 3u);
  svc_->OnEventsReconnected();  // not held: its marker comes back at once
  EXPECT_EQ(Counter("active_requests"), 0u);
  EXPECT_EQ(epochs.size(), 4u);
}

TEST_F(ServiceTest, WithoutReplicaSyncAReconnectSendsNoSyncMessages) {
  StartWith({"--router-mode", "kv"});
  Register(1, {.lease_ms = 3'600'000});
  ASSERT_TRUE(Route(Prompt(kTwelve, "ours")).ok());
  int published = 0;
  auto hb = bus_.Subscribe(svc_->subjects().router_heartbeats, "", [&](const BusMessage&) { ++published; });
  auto sync = bus_.Subscribe(svc_->subjects().active_sequences, "", [&](const BusMessage&) { ++published; });
  ASSERT_TRUE(hb.ok() && sync.ok());
  svc_->OnEventsDisconnected();
  svc_->OnEventsReconnected();
  svc_->OnRequestsReconnected();
  EXPECT_EQ(published, 0);
  EXPECT_EQ(Counter("active_requests"), 1u);
}

TEST_F(ServiceTest, AReplicaWithSyncSendsAHeartbeatEverySecond) {
  StartWith({"--router-mode", "kv", "--router-replica-sync"});
  std::vector<RouterHeartbeat> seen;
  auto sub = bus_.Subscribe(svc_->subjects().router_heartbeats, "", [&](const BusMessage& m) {
    auto h = DecodeRouterHeartbeat(m.data);
    ASSERT_TRUE(h.ok());
    seen.push_back(*h);
  });
  ASSERT_TRUE(sub.ok());
  for (int i = 0; i < 60; ++i) {  // 3 s of 50 ms ticks
    svc_->Tick();
    now_ += std::chrono::milliseconds(50);
  }
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].interval_ms, 1000u);
  EXPECT_NE(seen[0].router_id, 0u);
  EXPECT_EQ(Counter("replica_peers"), 0u);  // its own heartbeats are not a peer
}

}  // namespace
}  // namespace kvrouter
