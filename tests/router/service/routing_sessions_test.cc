// docs/protocol.md section 11 on the service: the route reply names the chosen engine's http_url,
// excluded_worker_ids are never chosen, and a session_id sticks to its worker
// (--router-session-affinity-ttl-secs) unless that worker is past the queue threshold.
#include <gtest/gtest.h>

#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using std::chrono::seconds;
using testing::kTwelve;
using testing::ServiceTest;

RouteRequest InSession(std::string session, std::string id) {
  RouteRequest r;
  r.request_id = std::move(id);
  r.token_ids = kTwelve;
  r.has_token_ids = true;
  r.isl = static_cast<std::uint32_t>(kTwelve.size());
  r.session_id = std::move(session);
  return r;
}

TEST_F(ServiceTest, TheRouteReplyNamesTheChosenWorkersHttpUrl) {
  StartWith({});
  Register(1, {.http_url = "http://engine-1:8000"});
  Register(2);
  RouteRequest r = Prompt(kTwelve);
  r.worker_id = 1;
  auto reply = Route(r);
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  EXPECT_EQ(reply->http_url, "http://engine-1:8000");
  r.worker_id = 2;
  reply = Route(r);
  ASSERT_TRUE(reply.ok());
  EXPECT_TRUE(reply->http_url.empty());  // it announced none
}

TEST_F(ServiceTest, ExcludedWorkersAreNeverChosenEvenHoldingThePrefix) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  Register(2);
  StorePrompt(1, 1, kTwelve);
  RouteRequest r = Prompt(kTwelve);
  ASSERT_EQ(Route(r)->worker_id, 1u);
  r.excluded_worker_ids = std::vector<std::uint64_t>{1};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(Route(r)->worker_id, 2u);
  r.excluded_worker_ids = std::vector<std::uint64_t>{2, 1};
  EXPECT_EQ(Route(r).status().code(), StatusCode::kNoWorkers);
  r.excluded_worker_ids.reset();
  r.worker_id = 1;  // a pin to an excluded worker leaves nothing either
  r.excluded_worker_ids = std::vector<std::uint64_t>{1};
  EXPECT_EQ(Route(r).status().code(), StatusCode::kNoWorkers);
}

TEST_F(ServiceTest, ASessionSticksToTheWorkerItLastWentTo) {
  StartWith({"--router-session-affinity-ttl-secs", "10"});  // round-robin: alternates otherwise
  Register(1);
  Register(2);
  const std::uint64_t first = Route(InSession("chat", "t1"))->worker_id;
  for (int turn = 2; turn <= 5; ++turn) {
    EXPECT_EQ(Route(InSession("chat", "t" + std::to_string(turn)))->worker_id, first) << "turn " << turn;
  }
  EXPECT_EQ(Counter("session_hits"), 4u);
  EXPECT_EQ(Counter("session_bindings"), 1u);
  // Without affinity the same requests alternate.
  const std::uint64_t a = Route(Prompt(kTwelve, "x1"))->worker_id;
  EXPECT_NE(Route(Prompt(kTwelve, "x2"))->worker_id, a);
}

TEST_F(ServiceTest, OffASessionIdChangesNothing) {
  StartWith({});
  Register(1);
  Register(2);
  const std::uint64_t a = Route(InSession("chat", "t1"))->worker_id;
  EXPECT_NE(Route(InSession("chat", "t2"))->worker_id, a);
  EXPECT_EQ(Counter("session_bindings"), 0u);
}

TEST_F(ServiceTest, ABindingEndsTtlAfterItsLastUse) {
  StartWith({"--router-session-affinity-ttl-secs", "10"});
  Register(1);
  Register(2);
  const std::uint64_t first = Route(InSession("chat", "t1"))->worker_id;
  now_ += seconds(9);
  EXPECT_EQ(Route(InSession("chat", "t2"))->worker_id, first);  // used again: ten more seconds
  now_ += seconds(10);
  Register(1);  // heartbeats keep both leases
  Register(2);
  (void)Route(InSession("chat", "t3"));
  EXPECT_EQ(Counter("session_hits"), 1u);  // t3 found no live binding
}

TEST_F(ServiceTest, ABindingYieldsWhenItsWorkerIsPastTheQueueThreshold) {
  StartWith({"--router-session-affinity-ttl-secs", "10", "--router-queue-threshold", "1"});
  Register(1, {.max_num_batched_tokens = 8});
  Register(2, {.max_num_batched_tokens = 8});
  const std::uint64_t first = Route(InSession("chat", "t1"))->worker_id;  // 12 prefill tokens: past 8
  const auto second = Route(InSession("chat", "t2"));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_NE(second->worker_id, first);
  EXPECT_EQ(Counter("session_hits"), 0u);
  // Bound anew to the worker it went to.
  (void)bus_.Publish(svc_->subjects().free, AsBytes(EncodeLifecycleRequest("t1")));
  (void)bus_.Publish(svc_->subjects().free, AsBytes(EncodeLifecycleRequest("t2")));
  EXPECT_EQ(Route(InSession("chat", "t3"))->worker_id, second->worker_id);
}

TEST_F(ServiceTest, BestWorkerFollowsABindingButNeverMakesOne) {
  StartWith({"--router-session-affinity-ttl-secs", "10"});
  Register(1);
  Register(2);
  (void)Route(InSession("asked", ""), /*best_worker=*/true);
  EXPECT_EQ(Counter("session_bindings"), 0u);
  const std::uint64_t bound = Route(InSession("chat", "t1"))->worker_id;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Route(InSession("chat", ""), /*best_worker=*/true)->worker_id, bound);
}

TEST_F(ServiceTest, APeersSyncedBookingBindsItsSessionHereToo) {
  StartWith({"--router-session-affinity-ttl-secs", "10", "--router-replica-sync"});
  Register(1);
  Register(2);
  const ActiveSequenceEvent add{.router_id = 99,
                                .request_id = "peer-1",
                                .worker_id = 2,
                                .kind = ActiveSequenceEvent::Kind::kAdd,
                                .seq_hashes = {1},
                                .isl = 4,
                                .session_id = "chat"};
  (void)bus_.Publish(svc_->subjects().active_sequences, AsBytes(EncodeActiveSequenceEvent(add)));
  for (int turn = 1; turn <= 3; ++turn) {
    EXPECT_EQ(Route(InSession("chat", "t" + std::to_string(turn)))->worker_id, 2u);
  }
  // And this replica's own bookings carry the session to its peers.
  std::vector<ActiveSequenceEvent> sent;
  auto sub = bus_.Subscribe(svc_->subjects().active_sequences, "", [&](const BusMessage& m) {
    if (auto e = DecodeActiveSequenceEvent(m.data); e.ok() && e->kind == ActiveSequenceEvent::Kind::kAdd) {
      sent.push_back(*e);
    }
  });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(Route(InSession("chat", "t4")).ok());
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].session_id, "chat");
  EXPECT_EQ(sent[0].worker_id, 2u);
}

}  // namespace
}  // namespace kvrouter
