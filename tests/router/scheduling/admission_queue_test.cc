#include "router/scheduling/admission_queue.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvrouter {

namespace {

using std::chrono::milliseconds;
const SteadyTime kT0{};

RouteRequest Request(std::string id, std::int64_t priority = 0) {
  RouteRequest r;
  r.request_id = std::move(id);
  r.priority = priority;
  r.token_ids = {1, 2, 3, 4};
  r.has_token_ids = true;
  r.isl = 4;
  return r;
}

PreparedRequest Blocks(std::uint32_t blocks) {
  PreparedRequest p;
  p.sel = {.isl = blocks * 4, .request_blocks = blocks};
  return p;
}

class AdmissionQueueTest : public ::testing::Test {
 protected:
  Status Push(AdmissionQueue& q, RouteRequest r, RouteKind kind = RouteKind::kRoute, std::uint32_t blocks = 1) {
    std::string reply = "reply." + r.request_id;  // before r is moved from
    return q.Push(std::move(r), Blocks(blocks), 0, std::move(reply), kind, kT0);
  }
  // Drains, admitting the requests `admit` says yes to; returns the ids taken, in order.
  std::vector<std::string> Drain(AdmissionQueue& q,
                                 const std::function<AdmissionQueue::Admission(const QueuedRoute&)>& admit) {
    std::vector<std::string> taken;
    q.Drain([&](QueuedRoute& r, SteadyTime) { return admit(r); },
            [&](QueuedRoute&& r) { taken.push_back(r.req.request_id); });
    return taken;
  }
  AdmissionQueue queue_{QueuePolicy::kFcfs, 3, 1000, 4};
};

TEST_F(AdmissionQueueTest, PastEitherBoundAPushIsOverloadedAndCounted) {
  for (std::string id : {"a", "b", "c"}) ASSERT_TRUE(Push(queue_, Request(id)).ok());
  EXPECT_EQ(Push(queue_, Request("d")).code(), StatusCode::kOverloaded);
  EXPECT_EQ(queue_.size(), 3u);
  EXPECT_EQ(queue_.refused(), 1u);

  AdmissionQueue small(QueuePolicy::kFcfs, 10, 5, 4);
  ASSERT_TRUE(Push(small, Request("a"), RouteKind::kRoute, 4).ok());
  EXPECT_EQ(Push(small, Request("b"), RouteKind::kRoute, 2).code(), StatusCode::kOverloaded);
  EXPECT_EQ(small.blocks(), 4u);
}

TEST_F(AdmissionQueueTest, DrainOffersRequestsInPolicyOrderAndCountsAdmissions) {
  ASSERT_TRUE(Push(queue_, Request("low", 0)).ok());
  ASSERT_TRUE(Push(queue_, Request("high", 5)).ok());
  auto taken = Drain(queue_, [](const QueuedRoute&) { return AdmissionQueue::Admission::kAdmitted; });
  EXPECT_EQ(taken, (std::vector<std::string>{"high", "low"}));
  EXPECT_EQ(queue_.admitted(), 2u);
  EXPECT_TRUE(queue_.empty());
}

TEST_F(AdmissionQueueTest, AnUnrestrictedRequestWithoutRoomEndsTheDrain) {
  ASSERT_TRUE(Push(queue_, Request("head", 1)).ok());
  ASSERT_TRUE(Push(queue_, Request("next")).ok());
  int offered = 0;
  auto taken = Drain(queue_, [&](const QueuedRoute&) {
    ++offered;
    return AdmissionQueue::Admission::kNoRoom;
  });
  EXPECT_TRUE(taken.empty());
  EXPECT_EQ(offered, 1);  // nothing behind it can go either
  EXPECT_EQ(queue_.size(), 2u);
}

TEST_F(AdmissionQueueTest, ARestrictedRequestWithoutRoomIsPassedOver) {
  RouteRequest pinned = Request("pinned", 1);
  pinned.worker_id = 7;
  ASSERT_TRUE(Push(queue_, pinned).ok());
  ASSERT_TRUE(Push(queue_, Request("free")).ok());
  auto taken = Drain(queue_, [](const QueuedRoute& r) {
    return r.req.worker_id ? AdmissionQueue::Admission::kNoRoom : AdmissionQueue::Admission::kAdmitted;
  });
  EXPECT_EQ(taken, std::vector<std::string>{"free"});
  EXPECT_EQ(queue_.size(), 1u);
}

TEST_F(AdmissionQueueTest, AFailedRequestIsTakenButNotCountedAsAdmitted) {
  ASSERT_TRUE(Push(queue_, Request("gone")).ok());
  auto taken = Drain(queue_, [](const QueuedRoute&) { return AdmissionQueue::Admission::kFailed; });
  EXPECT_EQ(taken, std::vector<std::string>{"gone"});
  EXPECT_EQ(queue_.admitted(), 0u);
  EXPECT_FALSE(queue_.Cancel("gone", [](QueuedRoute&&) {}));  // its id left with it
}

TEST_F(AdmissionQueueTest, RequestsPastTheirDeadlineExpire) {
  RouteRequest quick = Request("quick");
  quick.timeout_ms = 100;
  ASSERT_TRUE(Push(queue_, quick).ok());
  ASSERT_TRUE(Push(queue_, Request("patient")).ok());  // no timeout_ms: kDefaultWait
  std::vector<std::string> expired;
  auto collect = [&](QueuedRoute&& r) { expired.push_back(r.req.request_id); };
  queue_.Expire(kT0 + milliseconds(100), collect);
  EXPECT_TRUE(expired.empty());  // at the deadline it still waits
  queue_.Expire(kT0 + milliseconds(101), collect);
  EXPECT_EQ(expired, std::vector<std::string>{"quick"});
  queue_.Expire(kT0 + AdmissionQueue::kDefaultWait + milliseconds(1), collect);
  EXPECT_EQ(expired, (std::vector<std::string>{"quick", "patient"}));
  EXPECT_EQ(queue_.timed_out(), 2u);
}

TEST_F(AdmissionQueueTest, CancelTakesTheRequestQueuedUnderItsIdOnce) {
  ASSERT_TRUE(Push(queue_, Request("a")).ok());
  ASSERT_TRUE(Push(queue_, Request("b")).ok());
  std::string reply;
  EXPECT_TRUE(queue_.Cancel("b", [&](QueuedRoute&& r) { reply = r.reply; }));
  EXPECT_EQ(reply, "reply.b");
  EXPECT_FALSE(queue_.Cancel("b", [](QueuedRoute&&) { ADD_FAILURE() << "cancelled twice"; }));
  EXPECT_FALSE(queue_.Cancel("", [](QueuedRoute&&) { ADD_FAILURE() << "an empty id names nothing"; }));
  EXPECT_EQ(queue_.size(), 1u);
}

TEST_F(AdmissionQueueTest, FailPinnedTakesOnlyRequestsPinnedToTheGoneWorkers) {
  RouteRequest on3 = Request("on3");
  on3.worker_id = 3;
  RouteRequest on5 = Request("on5");
  on5.worker_id = 5;
  ASSERT_TRUE(Push(queue_, on3).ok());
  ASSERT_TRUE(Push(queue_, on5).ok());
  ASSERT_TRUE(Push(queue_, Request("any")).ok());
  std::vector<std::string> failed;
  const std::vector<std::uint64_t> gone = {1, 3};
  queue_.FailPinned(gone, [&](QueuedRoute&& r) { failed.push_back(r.req.request_id); });
  EXPECT_EQ(failed, std::vector<std::string>{"on3"});
  EXPECT_EQ(queue_.size(), 2u);
}

TEST_F(AdmissionQueueTest, ARouteWaitsWithoutItsTokensAGenerateKeepsThem) {
  ASSERT_TRUE(Push(queue_, Request("route"), RouteKind::kRoute).ok());
  ASSERT_TRUE(Push(queue_, Request("generate"), RouteKind::kGenerate).ok());
  std::map<std::string, std::size_t> tokens;
  Drain(queue_, [&](const QueuedRoute& r) {
    tokens[r.req.request_id] = r.req.token_ids.size();
    return AdmissionQueue::Admission::kAdmitted;
  });
  EXPECT_EQ(tokens["route"], 0u);  // hashed already: only a forward needs them
  EXPECT_EQ(tokens["generate"], 4u);
}

}  // namespace
}  // namespace kvrouter
