// ReplicaPeers on explicit time points: which peers are judged dead and when, whose bookings
// each judgement hands back, epochs, pausing while this router is away, and the bound on peers.
#include "router/scheduling/replica_peers.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
const SteadyTime kT0{};

// The order of the request ids handed back is unspecified.
std::vector<std::string> Sorted(std::vector<std::string> ids) {
  std::sort(ids.begin(), ids.end());
  return ids;
}
using Ids = std::vector<std::string>;

TEST(ReplicaPeers, APeerSilentForFiveSecondsIsDeadAndItsBookingsAreTaken) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  peers.Booked(7, "a", kT0);
  peers.Booked(7, "b", kT0);
  peers.Booked(8, "other", kT0);  // another peer's
  EXPECT_EQ(peers.peers(), 1u);
  EXPECT_TRUE(peers.TakeSilent(kT0 + milliseconds(4999)).empty());
  EXPECT_EQ(Sorted(peers.TakeSilent(kT0 + ReplicaPeers::kSilence)), (Ids{"a", "b"}));
  EXPECT_EQ(peers.peers(), 0u);
  EXPECT_EQ(peers.dead(), 1u);
  EXPECT_FALSE(peers.IsPeerBooking("a"));
  EXPECT_TRUE(peers.IsPeerBooking("other"));
  // Taken once: a dead peer is forgotten.
  EXPECT_TRUE(peers.TakeSilent(kT0 + seconds(60)).empty());
  EXPECT_EQ(peers.dead(), 1u);
}

TEST(ReplicaPeers, APeerThatNeverSendsHeartbeatsIsNeverJudged) {
  ReplicaPeers peers;
  peers.Booked(88, "x", kT0);
  peers.Seen(88, kT0);  // a sign of life of a peer not known: it stays unknown
  EXPECT_EQ(peers.peers(), 0u);
  EXPECT_TRUE(peers.TakeSilent(kT0 + std::chrono::hours(1)).empty());
  EXPECT_TRUE(peers.IsPeerBooking("x"));
  EXPECT_EQ(peers.dead(), 0u);
}

TEST(ReplicaPeers, EachHeartbeatGivesAPeerAFreshFiveSeconds) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  peers.Booked(7, "a", kT0);
  peers.Heard(7, kT0 + seconds(4));
  EXPECT_TRUE(peers.TakeSilent(kT0 + milliseconds(8999)).empty());
  EXPECT_EQ(peers.TakeSilent(kT0 + seconds(9)), (Ids{"a"}));
}

TEST(ReplicaPeers, ASyncMessageOfAKnownPeerIsASignOfLife) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  peers.Seen(7, kT0 + seconds(4));  // its `free` or `prefill_done`
  EXPECT_TRUE(peers.TakeSilent(kT0 + milliseconds(8999)).empty());
  peers.Booked(7, "a", kT0 + seconds(8));  // its `add`
  EXPECT_TRUE(peers.TakeSilent(kT0 + milliseconds(12999)).empty());
  EXPECT_EQ(peers.TakeSilent(kT0 + seconds(13)), (Ids{"a"}));
}

TEST(ReplicaPeers, OnlyTheSilentPeersAreTakenTheLiveOnesKeepTheirBookings) {
  ReplicaPeers peers;
  peers.Heard(1, kT0);
  peers.Heard(2, kT0);
  peers.Heard(3, kT0);
  peers.Booked(1, "of-1", kT0);
  peers.Booked(2, "of-2", kT0);
  peers.Booked(3, "of-3", kT0);
  peers.Heard(2, kT0 + seconds(3));
  EXPECT_EQ(Sorted(peers.TakeSilent(kT0 + seconds(5))), (Ids{"of-1", "of-3"}));
  EXPECT_EQ(peers.peers(), 1u);
  EXPECT_EQ(peers.dead(), 2u);
  EXPECT_TRUE(peers.IsPeerBooking("of-2"));
}

TEST(ReplicaPeers, ADeadPeerHeardAgainIsJudgedAfresh) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  ASSERT_TRUE(peers.TakeSilent(kT0 + seconds(5)).empty());  // dead, with no bookings
  ASSERT_EQ(peers.dead(), 1u);
  peers.Heard(7, kT0 + seconds(10));
  peers.Booked(7, "a", kT0 + seconds(10));
  EXPECT_EQ(peers.peers(), 1u);
  EXPECT_TRUE(peers.TakeSilent(kT0 + milliseconds(14999)).empty());
  EXPECT_EQ(peers.TakeSilent(kT0 + seconds(15)), (Ids{"a"}));
  EXPECT_EQ(peers.dead(), 2u);
}

TEST(ReplicaPeers, AReleasedBookingIsNoLongerAPeersAndIsNotTakenWithIt) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  peers.Booked(7, "a", kT0);
  peers.Booked(7, "b", kT0);
  peers.Released("a");
  peers.Released("never-booked");  // harmless
  EXPECT_FALSE(peers.IsPeerBooking("a"));
  EXPECT_EQ(peers.TakeSilent(kT0 + seconds(5)), (Ids{"b"}));
}

TEST(ReplicaPeers, ABookingBelongsToThePeerThatSyncedItLast) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  peers.Heard(8, kT0 + seconds(3));
  peers.Booked(7, "a", kT0);
  peers.Booked(8, "a", kT0 + seconds(3));
  EXPECT_TRUE(peers.TakeSilent(kT0 + seconds(5)).empty());  // 7 is dead, but "a" is 8's now
  EXPECT_EQ(peers.dead(), 1u);
  EXPECT_EQ(peers.TakeSilent(kT0 + seconds(8)), (Ids{"a"}));
}

TEST(ReplicaPeers, PruneDropsTheBookingsThatNoLongerExist) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  for (const char* id : {"a", "b", "c"}) peers.Booked(7, id, kT0);
  peers.Prune([](const std::string& id) { return id == "b"; });
  EXPECT_TRUE(peers.IsPeerBooking("a"));
  EXPECT_FALSE(peers.IsPeerBooking("b"));
  EXPECT_TRUE(peers.IsPeerBooking("c"));
  EXPECT_EQ(peers.peers(), 1u);  // the peer stays known
  EXPECT_EQ(Sorted(peers.TakeSilent(kT0 + seconds(5))), (Ids{"a", "c"}));
}

TEST(ReplicaPeers, WhilePausedNobodyIsJudgedAndResumeHandsBackEveryPeerBookingAndAFreshFiveSeconds) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  peers.Booked(7, "of-7", kT0);
  peers.Booked(88, "of-88", kT0);  // a peer without heartbeats: its `free`s may be lost too
  peers.Pause();
  EXPECT_TRUE(peers.TakeSilent(kT0 + seconds(30)).empty());
  EXPECT_EQ(peers.peers(), 1u);
  EXPECT_EQ(peers.dead(), 0u);
  EXPECT_EQ(Sorted(peers.Resume(kT0 + seconds(30))), (Ids{"of-7", "of-88"}));
  EXPECT_FALSE(peers.IsPeerBooking("of-7"));
  EXPECT_FALSE(peers.IsPeerBooking("of-88"));
  // Judging again, from the resume: 7 gets 5 s, counted from then.
  peers.Booked(7, "again", kT0 + seconds(30));
  EXPECT_TRUE(peers.TakeSilent(kT0 + milliseconds(34999)).empty());
  EXPECT_EQ(peers.TakeSilent(kT0 + seconds(35)), (Ids{"again"}));
  EXPECT_EQ(peers.dead(), 1u);
}

TEST(ReplicaPeers, ResumeGivesEveryPeerAFreshFiveSecondsEvenOneSilentBeforeThePause) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  peers.Pause();
  ASSERT_TRUE(peers.Resume(kT0 + seconds(4)).empty());
  EXPECT_TRUE(peers.TakeSilent(kT0 + milliseconds(8999)).empty());
  EXPECT_EQ(peers.peers(), 1u);
  (void)peers.TakeSilent(kT0 + seconds(9));
  EXPECT_EQ(peers.peers(), 0u);
}

TEST(ReplicaPeers, APeerFirstSeenAtEpochZeroHandsBackNothing) {
  ReplicaPeers peers;
  peers.Booked(7, "a", kT0);
  EXPECT_EQ(peers.Advance(7, 0, kT0), std::nullopt);
  EXPECT_TRUE(peers.IsPeerBooking("a"));
}

TEST(ReplicaPeers, APeerFirstSeenAtALaterEpochMayBeBackFromAnOutageAndHandsBackItsBookings) {
  ReplicaPeers peers;
  peers.Booked(7, "a", kT0);
  peers.Booked(8, "b", kT0);
  auto taken = peers.Advance(7, 3, kT0);
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(*taken, (Ids{"a"}));
  EXPECT_TRUE(peers.IsPeerBooking("b"));
  // A first sight with no bookings still says "later" (the caller sends its own again).
  auto none = peers.Advance(9, 1, kT0);
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->empty());
}

TEST(ReplicaPeers, ALaterEpochHandsBackThatPeersBookingsOnceAndTheSameOrAnOlderEpochNothing) {
  ReplicaPeers peers;
  ASSERT_EQ(peers.Advance(7, 0, kT0), std::nullopt);
  peers.Booked(7, "a", kT0);
  peers.Booked(7, "b", kT0);
  peers.Booked(8, "c", kT0);
  EXPECT_EQ(peers.Advance(7, 0, kT0), std::nullopt);
  auto taken = peers.Advance(7, 1, kT0);
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(Sorted(*taken), (Ids{"a", "b"}));
  EXPECT_TRUE(peers.IsPeerBooking("c"));
  peers.Booked(7, "b", kT0);  // its live one, sent again at epoch 1
  EXPECT_EQ(peers.Advance(7, 1, kT0), std::nullopt);
  EXPECT_EQ(peers.Advance(7, 0, kT0), std::nullopt);
  EXPECT_TRUE(peers.IsPeerBooking("b"));
}

TEST(ReplicaPeers, OnlyAMessageOfAnEpochOlderThanThePeersKnownOneIsStale) {
  ReplicaPeers peers;
  EXPECT_FALSE(peers.IsStale(7, 0));  // not known: nothing is stale
  (void)peers.Advance(7, 2, kT0);
  EXPECT_TRUE(peers.IsStale(7, 0));
  EXPECT_TRUE(peers.IsStale(7, 1));
  EXPECT_FALSE(peers.IsStale(7, 2));
  EXPECT_FALSE(peers.IsStale(7, 3));
  EXPECT_FALSE(peers.IsStale(8, 0));
}

TEST(ReplicaPeers, ADeadPeersEpochIsForgottenSoItsReturnAtALaterEpochIsNoticed) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  ASSERT_TRUE(peers.Advance(7, 2, kT0).has_value());
  ASSERT_TRUE(peers.IsStale(7, 1));
  ASSERT_TRUE(peers.TakeSilent(kT0 + seconds(5)).empty());
  EXPECT_FALSE(peers.IsStale(7, 1));  // forgotten with the peer
  EXPECT_TRUE(peers.Advance(7, 3, kT0).has_value());
}

TEST(ReplicaPeers, ANewPeerAfterADeadOneAtEpochZeroHandsBackNothing) {
  ReplicaPeers peers;
  peers.Heard(7, kT0);
  (void)peers.Advance(7, 5, kT0);
  ASSERT_TRUE(peers.TakeSilent(kT0 + seconds(5)).empty());
  EXPECT_EQ(peers.Advance(7, 0, kT0), std::nullopt);  // a peer not known, at epoch 0: a new one
}

TEST(ReplicaPeers, AtMostMaxPeersAreTrackedAndTheRestAreNeverJudged) {
  ReplicaPeers peers;
  for (std::uint64_t id = 1; id <= ReplicaPeers::kMaxPeers; ++id) peers.Heard(id, kT0);
  ASSERT_EQ(peers.peers(), ReplicaPeers::kMaxPeers);
  const std::uint64_t extra = ReplicaPeers::kMaxPeers + 1;
  peers.Heard(extra, kT0);
  EXPECT_EQ(peers.peers(), ReplicaPeers::kMaxPeers);
  peers.Booked(extra, "of-extra", kT0);
  peers.Booked(1, "of-1", kT0);
  // A tracked peer's heartbeat still renews it at the bound.
  for (std::uint64_t id = 2; id <= ReplicaPeers::kMaxPeers; ++id) peers.Heard(id, kT0 + seconds(3));
  EXPECT_EQ(peers.TakeSilent(kT0 + seconds(5)), (Ids{"of-1"}));
  EXPECT_EQ(peers.dead(), 1u);
  EXPECT_TRUE(peers.IsPeerBooking("of-extra"));  // not tracked: left to the booking sweep
  // Room again: the next new peer is tracked.
  peers.Heard(extra, kT0 + seconds(5));
  EXPECT_EQ(peers.peers(), ReplicaPeers::kMaxPeers);
  EXPECT_TRUE(peers.TakeSilent(kT0 + milliseconds(7999)).empty());
  EXPECT_EQ(Sorted(peers.TakeSilent(kT0 + seconds(10))), (Ids{"of-extra"}));
}

// Peers that send no heartbeats (other routers' sync messages only) are tracked by epoch; one
// quiet for kForgetEpoch is forgotten, so a stream of such peers never fills the table and leaves
// later ones untracked. A peer the full table cannot track is not judged: its bookings stay.
TEST(ReplicaPeers, QuietPeersWithoutHeartbeatsAreForgottenAndAFullTableJudgesNoNewPeer) {
  ReplicaPeers peers;
  for (std::uint64_t id = 1; id <= ReplicaPeers::kMaxPeers; ++id) (void)peers.Advance(id, 0, kT0);
  ASSERT_EQ(peers.epochs_tracked(), ReplicaPeers::kMaxPeers);
  peers.Booked(99999, "x", kT0);
  EXPECT_EQ(peers.Advance(99999, 4, kT0), std::nullopt);  // untracked: its booking is not released
  EXPECT_TRUE(peers.IsPeerBooking("x"));
  // Peer 1 keeps speaking; the others fall quiet.
  const auto later = kT0 + ReplicaPeers::kForgetEpoch - seconds(1);
  (void)peers.Advance(1, 0, later);
  (void)peers.TakeSilent(kT0 + ReplicaPeers::kForgetEpoch);
  EXPECT_EQ(peers.epochs_tracked(), 1u);
  EXPECT_EQ(peers.Advance(99999, 4, kT0 + ReplicaPeers::kForgetEpoch), (std::optional<Ids>{Ids{"x"}}));
}

}  // namespace
}  // namespace kvrouter
