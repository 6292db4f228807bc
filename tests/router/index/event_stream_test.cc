#include "router/index/event_stream.h"

#include <gtest/gtest.h>

#include <tuple>

namespace kvrouter {
namespace {

constexpr WorkerKey kW{7, 0};

KvEventBatch Event(std::uint64_t id, SequenceKind kind = SequenceKind::kEventId) {
  KvEventBatch b{.worker_id = kW.worker_id, .dp_rank = kW.dp_rank, .sequence = {kind, id}};
  b.ops.push_back({StorageTier::kDevice, KvRemoved{{id}}});
  return b;
}

std::vector<std::uint64_t> Ids(const std::vector<KvEventBatch>& batches) {
  std::vector<std::uint64_t> out;
  for (const auto& b : batches) out.push_back(b.sequence.value);
  return out;
}

class EventStreamsTest : public ::testing::Test {
 protected:
  explicit EventStreamsTest(bool recover = true)
      : streams_({.recover = recover, .max_held = 4},
                 [this](WorkerKey w, SequenceKind, std::optional<std::uint64_t> s, std::uint64_t generation) {
                   asked_.emplace_back(w, s);
                   generation_ = generation;
                 }) {}
  EventStreams::Verdict Live(std::uint64_t id) {
    KvEventBatch b = Event(id);
    return streams_.Live(b);
  }
  // A reply part to the latest ask.
  RecoveryPart Part(RecoveryPart::Kind kind, std::vector<std::uint64_t> ids, std::uint64_t last, bool final = true) {
    RecoveryPart p{.worker = kW, .kind = kind, .last_event_id = last, .final = final, .generation = generation_};
    for (auto id : ids) p.events.push_back(Event(id));
    return p;
  }
  EventStreams streams_;
  std::vector<std::pair<WorkerKey, std::optional<std::uint64_t>>> asked_;
  std::uint64_t generation_ = 0;
};

class EventStreamsWithoutRecovery : public EventStreamsTest {
 protected:
  EventStreamsWithoutRecovery() : EventStreamsTest(false) {}
};

using V = EventStreams::Verdict;

TEST_F(EventStreamsWithoutRecovery, GapsAreCountedAndAppliedRepeatsDroppedRestartsCleared) {
  EXPECT_EQ(Live(1), V::kApply);
  EXPECT_EQ(Live(2), V::kApply);
  EXPECT_EQ(Live(5), V::kApply);  // a gap, applied
  EXPECT_EQ(Live(5), V::kDrop);
  EXPECT_EQ(Live(3), V::kDrop);
  EXPECT_EQ(Live(1), V::kClearThenApply);  // back to the first id: restarted
  EXPECT_EQ(streams_.counters().gaps, 1u);
  EXPECT_EQ(streams_.counters().duplicates, 2u);
  EXPECT_EQ(streams_.counters().restarts, 1u);
  EXPECT_TRUE(asked_.empty());
}

TEST_F(EventStreamsTest, FirstSightHoldsAndAsksForADumpThatClearsOnceAndReleasesTheRest) {
  EXPECT_EQ(Live(3), V::kHeld);
  ASSERT_EQ(asked_.size(), 1u);
  EXPECT_EQ(asked_[0].second, std::nullopt);  // a dump
  EXPECT_EQ(Live(4), V::kHeld);
  EXPECT_EQ(Live(5), V::kHeld);
  auto first = Part(RecoveryPart::Kind::kDump, {4, 4}, 4, /*final=*/false);
  auto o1 = streams_.Recovered(first);
  EXPECT_TRUE(o1.clear_first);
  EXPECT_EQ(first.events.size(), 2u);  // a dump's events are all applied
  EXPECT_TRUE(o1.rejudge.empty());
  auto last = Part(RecoveryPart::Kind::kDump, {4}, 4);
  auto o2 = streams_.Recovered(last);
  EXPECT_FALSE(o2.clear_first);  // only the first part clears
  // What the dump covered (up to 4) is dropped; 5 is judged again, and is next.
  EXPECT_EQ(Ids(o2.rejudge), (std::vector<std::uint64_t>{5}));
  EXPECT_EQ(streams_.Live(o2.rejudge[0]), V::kApply);
  EXPECT_EQ(Live(6), V::kApply);
}

TEST_F(EventStreamsTest, AGapAsksForTheMissingRangeAndTheReplyFillsIt) {
  EXPECT_EQ(Live(1), V::kHeld);
  auto dump = Part(RecoveryPart::Kind::kDump, {}, 0);
  auto released = streams_.Recovered(dump).rejudge;
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(streams_.Live(released[0]), V::kApply);  // after an empty dump the cursor is 0
  EXPECT_EQ(Live(2), V::kApply);
  EXPECT_EQ(Live(5), V::kHeld);
  ASSERT_EQ(asked_.size(), 2u);
  EXPECT_EQ(asked_[1].second, 3u);
  EXPECT_EQ(Live(6), V::kHeld);
  auto range = Part(RecoveryPart::Kind::kEvents, {2, 3, 4, 5}, 6);  // 2 is already applied
  auto o = streams_.Recovered(range);
  EXPECT_FALSE(o.clear_first);
  EXPECT_EQ(Ids(range.events), (std::vector<std::uint64_t>{3, 4, 5}));
  EXPECT_TRUE(o.rejudge.empty());  // the held 5 and 6 came with the reply (it reached 6)
  EXPECT_EQ(Live(7), V::kApply);
}

TEST_F(EventStreamsTest, AFailedRecoveryAppliesWhatWasHeldAndTheNextGapAsksAgain) {
  EXPECT_EQ(Live(1), V::kHeld);
  auto fail = Part(RecoveryPart::Kind::kFailed, {}, 0);
  auto o = streams_.Recovered(fail);
  EXPECT_EQ(Ids(o.apply), (std::vector<std::uint64_t>{1}));
  EXPECT_EQ(Live(2), V::kApply);
  EXPECT_EQ(Live(4), V::kHeld);  // the next gap
  EXPECT_EQ(asked_.size(), 2u);
  EXPECT_EQ(Live(6), V::kHeld);
  auto fail2 = Part(RecoveryPart::Kind::kFailed, {}, 0);
  auto o2 = streams_.Recovered(fail2);
  EXPECT_EQ(Ids(o2.apply), (std::vector<std::uint64_t>{4, 6}));  // gaps and all
  EXPECT_EQ(Live(7), V::kApply);
}

TEST_F(EventStreamsTest, AnOverflowingHoldEndsInAFreshDump) {
  EXPECT_EQ(Live(1), V::kHeld);                                             // dump 1 asked
  for (std::uint64_t id = 2; id <= 6; ++id) EXPECT_EQ(Live(id), V::kHeld);  // 5 > max_held 4
  EXPECT_EQ(streams_.counters().held_dropped, 4u);
  auto reply = Part(RecoveryPart::Kind::kDump, {}, 1);
  auto o = streams_.Recovered(reply);
  EXPECT_TRUE(o.rejudge.empty());
  ASSERT_EQ(asked_.size(), 2u);
  EXPECT_EQ(asked_[1].second, std::nullopt);  // the fresh dump
  auto fresh = Part(RecoveryPart::Kind::kDump, {}, 6);
  auto o2 = streams_.Recovered(fresh);
  EXPECT_TRUE(o2.clear_first);
  EXPECT_TRUE(o2.rejudge.empty());  // 5 and 6, held after the overflow, came with the dump
  EXPECT_EQ(Live(7), V::kApply);
}

TEST_F(EventStreamsTest, AReplyForAForgottenWorkerIsIgnored) {
  EXPECT_EQ(Live(1), V::kHeld);
  streams_.RemoveWorker(kW.worker_id);
  auto late = Part(RecoveryPart::Kind::kDump, {1}, 1);
  auto o = streams_.Recovered(late);
  EXPECT_FALSE(o.clear_first);
  EXPECT_TRUE(late.events.empty());
  EXPECT_FALSE(streams_.Recovering(kW));
}

TEST_F(EventStreamsTest, ADumpRequestedDuringARecoveryFollowsIt) {
  EXPECT_EQ(Live(1), V::kHeld);
  auto dump = Part(RecoveryPart::Kind::kDump, {}, 0);
  for (auto& b : streams_.Recovered(dump).rejudge) EXPECT_EQ(streams_.Live(b), V::kApply);
  EXPECT_EQ(Live(3), V::kHeld);  // gap: asks [2, ...]
  streams_.RequestDump(kW);      // e.g. NATS reconnected meanwhile
  auto range = Part(RecoveryPart::Kind::kEvents, {2, 3}, 3);
  auto o = streams_.Recovered(range);
  EXPECT_TRUE(o.rejudge.empty());
  ASSERT_EQ(asked_.size(), 3u);
  EXPECT_EQ(asked_[2].second, std::nullopt);
  EXPECT_TRUE(streams_.Recovering(kW));
}

TEST_F(EventStreamsTest, AReplyToAnOlderAskIsIgnored) {
  EXPECT_EQ(Live(1), V::kHeld);  // ask 1: a dump
  auto stale = Part(RecoveryPart::Kind::kDump, {1}, 1);
  streams_.RemoveWorker(kW.worker_id);  // its lease ran out...
  EXPECT_EQ(Live(1), V::kHeld);         // ...and it is back: ask 2
  EXPECT_NE(stale.generation, generation_);
  auto o = streams_.Recovered(stale);  // the answer to ask 1 arrives late
  EXPECT_TRUE(stale.events.empty());
  EXPECT_FALSE(o.clear_first);
  EXPECT_TRUE(streams_.Recovering(kW));  // still waiting for ask 2
  auto fresh = Part(RecoveryPart::Kind::kDump, {1}, 1);
  auto o2 = streams_.Recovered(fresh);
  EXPECT_TRUE(o2.clear_first);
  EXPECT_FALSE(streams_.Recovering(kW));
}

TEST_F(EventStreamsTest, VllmRanksCountTheirSection6IdsFromOne) {
  // Kv-Seq starts at 0; §6 ids count the same batches from 1 (id = Kv-Seq + 1).
  KvEventBatch first = Event(0, SequenceKind::kVllmSeq);
  EXPECT_EQ(streams_.Live(first), V::kHeld);           // first sight: a dump
  auto dump = Part(RecoveryPart::Kind::kDump, {}, 3);  // the worker has published 3 batches: Kv-Seq 0..2
  auto o = streams_.Recovered(dump);
  EXPECT_TRUE(o.rejudge.empty());  // Kv-Seq 0 was in the dump (not a restart)
  KvEventBatch next = Event(3, SequenceKind::kVllmSeq);
  EXPECT_EQ(streams_.Live(next), V::kApply);  // the one after it
  KvEventBatch later = Event(6, SequenceKind::kVllmSeq);
  EXPECT_EQ(streams_.Live(later), V::kHeld);  // Kv-Seq 4, 5 missing
  ASSERT_EQ(asked_.size(), 2u);
  EXPECT_EQ(asked_[1].second, 5u);  // §6 id of Kv-Seq 4
  RecoveryPart range{.worker = kW, .kind = RecoveryPart::Kind::kEvents, .last_event_id = 7, .generation = generation_};
  for (std::uint64_t id : {5, 6, 7}) range.events.push_back(Event(id));  // §6 ids of Kv-Seq 4..6
  auto o2 = streams_.Recovered(range);
  EXPECT_EQ(Ids(range.events), (std::vector<std::uint64_t>{5, 6, 7}));
  EXPECT_TRUE(o2.rejudge.empty());  // Kv-Seq 6 came with the range
  KvEventBatch after = Event(7, SequenceKind::kVllmSeq);
  EXPECT_EQ(streams_.Live(after), V::kApply);
}

// A peer's dump part for kW (RecoveryPart::from_peer).
RecoveryPart PeerPart(std::vector<std::uint64_t> ids, std::uint64_t last, bool final = true,
                      RecoveryPart::Kind kind = RecoveryPart::Kind::kDump) {
  RecoveryPart p{.worker = kW, .kind = kind, .last_event_id = last, .final = final, .from_peer = true};
  for (auto id : ids) p.events.push_back(Event(id));
  return p;
}

TEST_F(EventStreamsTest, APeersDumpOfAnUnknownRankSetsItsCursorWithoutAsking) {
  auto first = PeerPart({1, 1}, 4, /*final=*/false);
  auto o1 = streams_.Recovered(first);
  EXPECT_TRUE(o1.clear_first);
  EXPECT_EQ(first.events.size(), 2u);
  EXPECT_EQ(o1.superseded, std::nullopt);
  EXPECT_FALSE(streams_.PositionOf(kW).has_value());  // recovering until the last part
  EXPECT_EQ(Live(5), V::kHeld);
  auto last = PeerPart({1}, 4);
  auto o2 = streams_.Recovered(last);
  EXPECT_FALSE(o2.clear_first);
  EXPECT_EQ(last.events.size(), 1u);
  EXPECT_EQ(Ids(o2.rejudge), (std::vector<std::uint64_t>{5}));
  EXPECT_EQ(streams_.Live(o2.rejudge[0]), V::kApply);
  EXPECT_TRUE(asked_.empty());
  EXPECT_EQ(streams_.PositionOf(kW)->last_event_id, 5u);
  // The worker's registration comes after: its rank is known, nothing is asked.
  streams_.RequestDump(kW, SequenceKind::kEventId, /*first_sight=*/true);
  EXPECT_TRUE(asked_.empty());
}

TEST_F(EventStreamsTest, APeersDumpTakesThePlaceOfAFirstSightAskNotYetAnswered) {
  EXPECT_EQ(Live(3), V::kHeld);
  ASSERT_EQ(asked_.size(), 1u);
  const std::uint64_t asked_generation = generation_;
  auto peer = PeerPart({1}, 2);
  auto o = streams_.Recovered(peer);
  EXPECT_EQ(o.superseded, asked_generation);
  EXPECT_EQ(Ids(o.rejudge), (std::vector<std::uint64_t>{3}));
  EXPECT_EQ(streams_.Live(o.rejudge[0]), V::kApply);
  // The worker's late answer to the superseded ask changes nothing.
  RecoveryPart late{
      .worker = kW, .kind = RecoveryPart::Kind::kDump, .last_event_id = 9, .generation = asked_generation};
  late.events.push_back(Event(1));
  auto o2 = streams_.Recovered(late);
  EXPECT_TRUE(late.events.empty());
  EXPECT_FALSE(o2.clear_first);
  EXPECT_EQ(Live(4), V::kApply);
}

TEST_F(EventStreamsTest, APeersDumpOfARankThisReplicaKnowsIsIgnored) {
  EXPECT_EQ(Live(1), V::kHeld);
  auto dump = Part(RecoveryPart::Kind::kDump, {}, 1);
  (void)streams_.Recovered(dump);
  auto peer = PeerPart({1}, 7);
  auto o = streams_.Recovered(peer);
  EXPECT_TRUE(peer.events.empty());
  EXPECT_FALSE(o.clear_first);
  EXPECT_EQ(streams_.PositionOf(kW)->last_event_id, 1u);
  EXPECT_EQ(Live(2), V::kApply);
}

TEST_F(EventStreamsTest, APeersDumpThatBreaksOffMidRankAsksTheWorker) {
  auto first = PeerPart({1}, 4, /*final=*/false);
  (void)streams_.Recovered(first);
  EXPECT_EQ(Live(5), V::kHeld);
  auto broke = PeerPart({}, 0, true, RecoveryPart::Kind::kFailed);
  (void)streams_.Recovered(broke);
  ASSERT_EQ(asked_.size(), 1u);
  EXPECT_EQ(asked_[0].second, std::nullopt);  // a dump
  auto dump = Part(RecoveryPart::Kind::kDump, {1}, 6);
  auto o = streams_.Recovered(dump);
  EXPECT_TRUE(o.clear_first);  // the peer's half goes
  EXPECT_TRUE(o.rejudge.empty());
  EXPECT_EQ(Live(7), V::kApply);
  // A broken-off part for a rank that never took the peer's dump leaves no trace.
  const WorkerKey other{8, 0};
  RecoveryPart stray{.worker = other, .kind = RecoveryPart::Kind::kFailed, .from_peer = true};
  (void)streams_.Recovered(stray);
  EXPECT_FALSE(streams_.Known(other));
}

TEST_F(EventStreamsTest, AFirstSightDumpRequestIsMadeOnlyForAnUnknownRank) {
  streams_.RequestDump(kW, SequenceKind::kEventId, /*first_sight=*/true);
  ASSERT_EQ(asked_.size(), 1u);
  streams_.RequestDump(kW, SequenceKind::kEventId, /*first_sight=*/true);  // already asked
  EXPECT_EQ(asked_.size(), 1u);
  streams_.RequestDump(kW);  // a reconnect's: after the reply in flight
  auto dump = Part(RecoveryPart::Kind::kDump, {}, 0);
  (void)streams_.Recovered(dump);
  EXPECT_EQ(asked_.size(), 2u);
}

}  // namespace
}  // namespace kvrouter
