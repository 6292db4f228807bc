#include "router/scheduling/session_affinity.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
constexpr WorkerKey kA{1, 0};
constexpr WorkerKey kB{2, 0};
const SteadyTime kT0{};

TEST(SessionAffinity, ABindingHoldsForTheTtlAfterItsLastUse) {
  SessionAffinity a(milliseconds(1000), 10);
  EXPECT_FALSE(a.Find("s", kT0));
  a.Bind("s", kA, kT0);
  EXPECT_EQ(a.Find("s", kT0 + milliseconds(999)), kA);
  EXPECT_FALSE(a.Find("s", kT0 + milliseconds(1000)));
  a.Bind("s", kB, kT0 + milliseconds(900));  // used again, and moved
  EXPECT_EQ(a.Find("s", kT0 + milliseconds(1800)), kB);
}

TEST(SessionAffinity, OffItBindsNothing) {
  SessionAffinity a(milliseconds(0), 10);
  EXPECT_FALSE(a.on());
  a.Bind("s", kA, kT0);
  EXPECT_EQ(a.size(), 0u);
  EXPECT_FALSE(a.Find("s", kT0));
}

TEST(SessionAffinity, PastItsBoundTheLeastRecentlyUsedBindingGoes) {
  SessionAffinity a(milliseconds(1000), 2);
  a.Bind("old", kA, kT0);
  a.Bind("mid", kA, kT0 + milliseconds(1));
  a.Bind("old", kA, kT0 + milliseconds(2));  // now the most recent
  a.Bind("new", kB, kT0 + milliseconds(3));
  EXPECT_EQ(a.size(), 2u);
  EXPECT_EQ(a.evicted(), 1u);
  EXPECT_FALSE(a.Find("mid", kT0 + milliseconds(4)));
  EXPECT_EQ(a.Find("old", kT0 + milliseconds(4)), kA);
  EXPECT_EQ(a.Find("new", kT0 + milliseconds(4)), kB);
}

TEST(SessionAffinity, ExpireDropsOnlyTheBindingsUnusedForTheTtl) {
  SessionAffinity a(milliseconds(1000), 10);
  a.Bind("stale", kA, kT0);
  a.Bind("fresh", kB, kT0 + milliseconds(500));
  a.Expire(kT0 + milliseconds(1000));
  EXPECT_EQ(a.size(), 1u);
  EXPECT_EQ(a.Find("fresh", kT0 + milliseconds(1000)), kB);
  EXPECT_EQ(a.evicted(), 0u);  // expiry is not eviction
}

}  // namespace
}  // namespace kvrouter
