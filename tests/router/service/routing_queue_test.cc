// The admission queue (--router-queue-threshold) on the service: requests wait while every rank
// is full and leave in the policy's order; bounds, timeouts, pins, cancellation, replicas.
#include <gtest/gtest.h>

#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
using testing::kTwelve;
using testing::ServiceTest;

class QueueTest : public ServiceTest {
 protected:
  // Two workers whose rank is full above 8 prefill tokens (threshold 1 x 8); each 12-token
  // request books 12 prefill tokens, so one request fills a worker.
  void SetUpQueue(std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--router-mode", "kv", "--router-queue-threshold", "1"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    StartWith(flags);
    Register(1, {.max_num_batched_tokens = 8});
    Register(2, {.max_num_batched_tokens = 8});
  }
  static RouteRequest Prio(std::string id, std::int64_t priority, std::vector<std::uint32_t> tokens = kTwelve) {
    RouteRequest r = Prompt(std::move(tokens), std::move(id));
    r.priority = priority;
    return r;
  }
  InMemoryBus::PendingRequest Send(const RouteRequest& r) {
    return bus_.RequestAsync(svc_->subjects().route, AsBytes(EncodeRouteRequest(r)));
  }
  void MarkPrefill(const std::string& id) {
    (void)bus_.Request(svc_->subjects().mark_prefill, AsBytes(EncodeLifecycleRequest(id)));
  }
  static Result<RouteReply> ReplyOf(const InMemoryBus::PendingRequest& p) {
    if (!p.reply->has_value()) return Internal("no reply yet");
    return DecodeRouteReply(**p.reply);
  }
};

TEST_F(QueueTest, RequestsWaitWhileEveryRankIsFullAndLeaveInPriorityOrder) {
  SetUpQueue();
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());
  ASSERT_TRUE(Route(Prio("r2", 0)).ok());
  auto low = Send(Prio("low", 0));
  auto high = Send(Prio("high", 5));
  auto mid = Send(Prio("mid", 2));
  EXPECT_FALSE(low.reply->has_value() || high.reply->has_value() || mid.reply->has_value());
  EXPECT_EQ(Counter("queue_length"), 3u);
  now_ += milliseconds(40);
  MarkPrefill("r1");  // one rank opens: exactly one admission, the highest priority
  ASSERT_TRUE(ReplyOf(high).ok());
  EXPECT_FALSE(mid.reply->has_value() || low.reply->has_value());
  EXPECT_DOUBLE_EQ(ReplyOf(high)->queued_ms, 40.0);
  MarkPrefill("r2");
  ASSERT_TRUE(ReplyOf(mid).ok());
  EXPECT_FALSE(low.reply->has_value());
  MarkPrefill("high");
  ASSERT_TRUE(ReplyOf(low).ok());
  auto doc = Stats();
  EXPECT_EQ(doc.counters.at("queue_length"), 0u);
  EXPECT_EQ(doc.counters.at("queue_admitted"), 3u);
}

TEST_F(QueueTest, WsptAdmitsTheShortestRemainingPrefillFirst) {
  SetUpQueue({"--router-queue-policy", "wspt"});
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());
  ASSERT_TRUE(Route(Prio("r2", 0)).ok());
  std::vector<std::uint32_t> long_prompt(64);
  for (std::uint32_t i = 0; i < 64; ++i) long_prompt[i] = 1000 + i;
  auto big = Send(Prio("big", 0, long_prompt));
  auto small = Send(Prio("small", 0, {50, 51, 52, 53, 54, 55, 56, 57, 58}));
  MarkPrefill("r1");
  EXPECT_TRUE(ReplyOf(small).ok());
  EXPECT_FALSE(big.reply->has_value());
}

TEST_F(QueueTest, ExactlyAtTheThresholdIsNotFull) {
  StartWith({"--router-mode", "kv", "--router-queue-threshold", "1"});
  Register(1, {.max_num_batched_tokens = 12});
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());  // 12 prefill tokens = 1 x 12: not full
  auto second = Send(Prio("r2", 0));
  EXPECT_TRUE(ReplyOf(second).ok());  // answered at once
  auto third = Send(Prio("r3", 0));   // 24 > 12: full now
  EXPECT_FALSE(third.reply->has_value());
}

// A worker past the threshold is no candidate while another is open, even when it holds the
// whole prompt: without the threshold the predicted cost would keep the request there (2,000
// cached tokens against 1,200 queued ones).
TEST_F(QueueTest, AFullWorkerHoldingThePrefixIsPassedOverForAnOpenOne) {
  std::vector<std::uint32_t> prompt(2000), other(1200);
  for (std::uint32_t k = 0; k < prompt.size(); ++k) prompt[k] = k + 1;
  for (std::uint32_t k = 0; k < other.size(); ++k) other[k] = 50000 + k;
  for (const char* threshold : {"1", ""}) {
    std::vector<std::string> flags = {"--router-mode", "kv"};
    if (*threshold) flags.insert(flags.end(), {"--router-queue-threshold", threshold});
    StartWith(flags);
    Register(1, {.max_num_batched_tokens = 1000});
    Register(2, {.max_num_batched_tokens = 1000});
    StorePrompt(1, 1, prompt);
    RouteRequest fill = Prio("fill", 0, other);
    fill.worker_id = 1;
    ASSERT_TRUE(Route(fill).ok());  // 1,200 prefill tokens > 1 x 1,000: worker 1 is full
    auto r = Route(Prio("r", 0, prompt));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->worker_id, *threshold ? 2u : 1u) << "threshold '" << threshold << "'";
    svc_.reset();
  }
}

TEST_F(QueueTest, BestWorkerNeverWaits) {
  SetUpQueue();
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());
  ASSERT_TRUE(Route(Prio("r2", 0)).ok());
  EXPECT_TRUE(Route(Prompt(kTwelve), /*best_worker=*/true).ok());
  EXPECT_EQ(Counter("queue_length"), 0u);
}

TEST_F(QueueTest, PinnedHeadDoesNotBlockOthers) {
  SetUpQueue();
  auto r1 = Route(Prio("r1", 0));
  auto r2 = Route(Prio("r2", 0));
  ASSERT_TRUE(r1.ok() && r2.ok());
  ASSERT_NE(r1->worker_id, r2->worker_id);
  RouteRequest pinned = Prio("pinned", 9);  // first in fcfs order, but pinned to r1's worker
  pinned.worker_id = r1->worker_id;
  auto head = Send(pinned);
  auto other = Send(Prio("other", 0));
  MarkPrefill("r2");  // opens r2's worker only
  EXPECT_FALSE(head.reply->has_value());
  ASSERT_TRUE(ReplyOf(other).ok());
  EXPECT_EQ(ReplyOf(other)->worker_id, r2->worker_id);
  MarkPrefill("r1");
  ASSERT_TRUE(ReplyOf(head).ok());
  EXPECT_EQ(ReplyOf(head)->worker_id, r1->worker_id);
}

TEST_F(QueueTest, BoundRefusesWithOverloaded) {
  SetUpQueue({"--router-queue-max", "1"});
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());
  ASSERT_TRUE(Route(Prio("r2", 0)).ok());
  auto queued = Send(Prio("q1", 0));
  EXPECT_FALSE(queued.reply->has_value());
  EXPECT_EQ(Route(Prio("q2", 0)).status().code(), StatusCode::kOverloaded);
  EXPECT_EQ(Counter("queue_refused"), 1u);
}

TEST_F(QueueTest, TimedOutRequestGetsTimeoutAndBooksNothing) {
  SetUpQueue();
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());
  ASSERT_TRUE(Route(Prio("r2", 0)).ok());
  RouteRequest r = Prio("late", 0);
  r.timeout_ms = 100;
  auto late = Send(r);
  now_ += milliseconds(100);
  svc_->Tick();
  EXPECT_FALSE(late.reply->has_value());  // at the deadline, not past it
  now_ += milliseconds(1);
  svc_->Tick();
  ASSERT_TRUE(late.reply->has_value());
  EXPECT_EQ(ReplyOf(late).status().code(), StatusCode::kTimeout);
  auto doc = Stats();
  EXPECT_EQ(doc.counters.at("queue_timed_out"), 1u);
  EXPECT_EQ(doc.counters.at("active_requests"), 2u);  // r1, r2 only
  MarkPrefill("r1");                                  // nothing left to admit
  EXPECT_EQ(Counter("queue_admitted"), 0u);
}

TEST_F(QueueTest, RankFilteredHeadDoesNotStallTheQueue) {
  StartWith({"--router-mode", "kv", "--router-queue-threshold", "1"});
  Register(1, {.dp_size = 2, .max_num_batched_tokens = 8});
  RouteRequest fill0 = Prio("fill0", 0);
  fill0.dp_rank = 0;
  RouteRequest fill1 = Prio("fill1", 0);
  fill1.dp_rank = 1;
  ASSERT_TRUE(Route(fill0).ok());
  ASSERT_TRUE(Route(fill1).ok());
  RouteRequest head = Prio("rank1-only", 9);
  head.dp_rank = 1;
  auto h = Send(head);
  auto other = Send(Prio("any-rank", 0));
  MarkPrefill("fill0");  // only rank 0 opens
  EXPECT_FALSE(h.reply->has_value());
  ASSERT_TRUE(ReplyOf(other).ok());
  EXPECT_EQ(ReplyOf(other)->dp_rank, 0u);
}

TEST_F(QueueTest, FreeingAQueuedRequestCancelsIt) {
  SetUpQueue();
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());
  ASSERT_TRUE(Route(Prio("r2", 0)).ok());
  auto gone = Send(Prio("gone", 0));
  (void)bus_.Request(svc_->subjects().free, AsBytes(EncodeLifecycleRequest("gone")));
  ASSERT_TRUE(gone.reply->has_value());
  EXPECT_EQ(ReplyOf(gone).status().code(), StatusCode::kTimeout);
  MarkPrefill("r1");
  auto doc = Stats();
  EXPECT_EQ(doc.counters.at("queue_length"), 0u);
  EXPECT_EQ(doc.counters.at("active_requests"), 2u);  // r1 and r2 only: "gone" was never booked
}

TEST_F(QueueTest, LeavingWorkerFailsItsPinsEvenBehindABlockedHead) {
  SetUpQueue();
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());
  ASSERT_TRUE(Route(Prio("r2", 0)).ok());
  auto head = Send(Prio("unpinned", 9));  // first in order, cannot go anywhere
  RouteRequest pinned = Prio("pinned", 0);
  pinned.worker_id = 2;
  auto p = Send(pinned);
  Register(2, {.max_num_batched_tokens = 8, .leaving = true});
  ASSERT_TRUE(p.reply->has_value());
  EXPECT_EQ(ReplyOf(p).status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(head.reply->has_value());
}

// Regression: replica sync used to publish while holding the routing mutex; with a bus that
// delivers synchronously, replica B admitting a queued request on A's sync message published
// back into A on the same thread, and A's handler locked A's mutex again.
TEST_F(QueueTest, ReplicasWithSyncAndQueuesDoNotDeadlock) {
  SetUpQueue({"--router-replica-sync"});
  std::vector<const char*> argv = {
      "kvrouter", "--block-size", "4", "--router-mode", "kv", "--router-queue-threshold", "1", "--router-replica-sync"};
  auto cfg = ParseRouterConfig(static_cast<int>(argv.size()), argv.data(), [](const char*) { return nullptr; });
  ASSERT_TRUE(cfg.ok());
  KvRouterService other(
      cfg->config, bus_, [this] { return now_.now(); }, 43);
  ASSERT_TRUE(other.Start().ok());
  Register(1, {.max_num_batched_tokens = 8});
  Register(2, {.max_num_batched_tokens = 8});
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());
  ASSERT_TRUE(Route(Prio("r2", 0)).ok());
  auto q1 = Send(Prio("q1", 0));  // the route group alternates: one queued on each replica
  auto q2 = Send(Prio("q2", 0));
  MarkPrefill("r1");
  MarkPrefill("r2");
  EXPECT_TRUE(q1.reply->has_value() || q2.reply->has_value());
}

TEST_F(QueueTest, LeavingWorkerFailsRequestsPinnedToIt) {
  SetUpQueue();
  ASSERT_TRUE(Route(Prio("r1", 0)).ok());
  ASSERT_TRUE(Route(Prio("r2", 0)).ok());
  RouteRequest pinned = Prio("pinned", 0);
  pinned.worker_id = 1;
  auto p = Send(pinned);
  Register(1, {.max_num_batched_tokens = 8, .leaving = true});
  ASSERT_TRUE(p.reply->has_value());
  EXPECT_EQ(ReplyOf(p).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvrouter
