#include "router/scheduling/request_queue.h"

#include <gtest/gtest.h>

#include <string>

namespace kvrouter {
namespace {

using Queue = RequestQueue<std::string>;
using Time = Queue::Time;
const Time kT0{};

struct Item {
  std::string name;
  QueueKey key;
};

std::vector<std::string> Order(QueuePolicy policy, const std::vector<Item>& items) {
  Queue q(policy, 100);
  for (const auto& i : items) {
    std::string n = i.name;
    EXPECT_TRUE(q.Push(i.key, kT0, std::nullopt, std::move(n)));
  }
  std::vector<std::string> out;
  q.Clear([&](Queue::Entry&& e) { out.push_back(e.payload); });
  return out;
}

TEST(RequestQueue, PoliciesOrderAsSpecified) {
  // Arrival order a, b, c, d.
  const std::vector<Item> items = {
      {"a", {.priority = 0, .isl = 1000, .best_overlap_tokens = 0}},
      {"b", {.priority = 1, .isl = 4000, .best_overlap_tokens = 0}},
      {"c", {.priority = 0, .isl = 200, .best_overlap_tokens = 0}},
      {"d", {.priority = 1, .isl = 5000, .best_overlap_tokens = 4800}},
  };
  struct Case {
    QueuePolicy policy;
    std::vector<std::string> want;
  };
  const std::vector<Case> cases = {
      // Priority first, then arrival.
      {QueuePolicy::kFcfs, {"b", "d", "a", "c"}},
      // Scores: a 1/1000, b 2/4000, c 1/200, d 2/200 -> d, c, a, b.
      {QueuePolicy::kWspt, {"d", "c", "a", "b"}},
      {QueuePolicy::kLcfs, {"d", "c", "b", "a"}},
  };
  for (const auto& c : cases) EXPECT_EQ(Order(c.policy, items), c.want) << QueuePolicyName(c.policy);
}

TEST(RequestQueue, EqualKeysKeepArrivalOrder) {
  const std::vector<Item> items = {{"x", {}}, {"y", {}}, {"z", {}}};
  EXPECT_EQ(Order(QueuePolicy::kFcfs, items), (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(Order(QueuePolicy::kWspt, items), (std::vector<std::string>{"x", "y", "z"}));
}

TEST(RequestQueue, IsBounded) {
  Queue q(QueuePolicy::kFcfs, 2);
  EXPECT_TRUE(q.Push({}, kT0, std::nullopt, "1"));
  EXPECT_TRUE(q.Push({}, kT0, std::nullopt, "2"));
  std::string third = "3";
  EXPECT_FALSE(q.Push({}, kT0, std::nullopt, std::move(third)));
  EXPECT_EQ(third, "3");  // not consumed
  EXPECT_EQ(q.size(), 2u);
}

TEST(RequestQueue, IsBoundedByWeightToo) {
  Queue q(QueuePolicy::kFcfs, 10, 100);
  EXPECT_TRUE(q.Push({}, kT0, std::nullopt, "60", 60));
  EXPECT_FALSE(q.Push({}, kT0, std::nullopt, "50", 50));
  EXPECT_TRUE(q.Push({}, kT0, std::nullopt, "40", 40));
  EXPECT_EQ(q.weight(), 100u);
  q.Scan([](const Queue::Entry& e) { return e.payload == "60" ? ScanStep::kTake : ScanStep::kKeep; },
         [](Queue::Entry&&) {});
  EXPECT_EQ(q.weight(), 40u);  // what leaves the queue gives its weight back
  EXPECT_TRUE(q.Push({}, kT0, std::nullopt, "50", 50));
  EXPECT_FALSE(q.Push({}, kT0, std::nullopt, "huge", ~0ull));  // no overflow past the bound
}

TEST(RequestQueue, ScanCanSkipTheHeadAndStop) {
  Queue q(QueuePolicy::kFcfs, 10);
  for (const char* n : {"pinned-to-busy", "free-1", "free-2", "free-3"}) q.Push({}, kT0, std::nullopt, n);
  std::vector<std::string> taken;
  int admitted = 0;
  q.Scan(
      [&](const Queue::Entry& e) {
        if (e.payload == "pinned-to-busy") return ScanStep::kKeep;  // no head-of-line blocking
        return admitted++ < 2 ? ScanStep::kTake : ScanStep::kStop;
      },
      [&](Queue::Entry&& e) { taken.push_back(e.payload); });
  EXPECT_EQ(taken, (std::vector<std::string>{"free-1", "free-2"}));
  EXPECT_EQ(q.size(), 2u);
}

TEST(RequestQueue, ExpireRemovesOnlyPastDeadlines) {
  Queue q(QueuePolicy::kFcfs, 10);
  using std::chrono::milliseconds;
  q.Push({}, kT0, kT0 + milliseconds(100), "short");
  q.Push({}, kT0, kT0 + milliseconds(500), "long");
  q.Push({}, kT0, std::nullopt, "forever");
  std::vector<std::string> gone;
  q.Expire(kT0 + milliseconds(100), [&](Queue::Entry&& e) { gone.push_back(e.payload); });
  EXPECT_TRUE(gone.empty());  // exactly at the deadline is not past it
  q.Expire(kT0 + milliseconds(101), [&](Queue::Entry&& e) { gone.push_back(e.payload); });
  EXPECT_EQ(gone, (std::vector<std::string>{"short"}));
  EXPECT_EQ(q.size(), 2u);
}

}  // namespace
}  // namespace kvrouter
