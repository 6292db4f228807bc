#include "router/event_sequence.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

TEST(SequenceTracker, FirstIdSeenIsInOrderWhateverItIs) {
  SequenceTracker t(1);
  EXPECT_EQ(t.Observe(40), SequenceVerdict::kInOrder);
  EXPECT_EQ(t.Observe(41), SequenceVerdict::kInOrder);
}

TEST(SequenceTracker, SkippedIdsAreAGap) {
  SequenceTracker t(1);
  EXPECT_EQ(t.Observe(1), SequenceVerdict::kInOrder);
  EXPECT_EQ(t.Observe(4), SequenceVerdict::kGap);
  EXPECT_EQ(t.Observe(5), SequenceVerdict::kInOrder);
}

TEST(SequenceTracker, RepeatsAreDuplicates) {
  SequenceTracker t(1);
  EXPECT_EQ(t.Observe(1), SequenceVerdict::kInOrder);
  EXPECT_EQ(t.Observe(2), SequenceVerdict::kInOrder);
  EXPECT_EQ(t.Observe(3), SequenceVerdict::kInOrder);
  EXPECT_EQ(t.Observe(3), SequenceVerdict::kDuplicate);
  EXPECT_EQ(t.Observe(2), SequenceVerdict::kDuplicate);
  EXPECT_EQ(t.last(), 3u);
}

TEST(SequenceTracker, BackToFirstIdAfterLaterOnesIsARestart) {
  SequenceTracker t(1);
  for (std::uint64_t id = 1; id <= 5; ++id) ASSERT_EQ(t.Observe(id), SequenceVerdict::kInOrder);
  EXPECT_EQ(t.Observe(1), SequenceVerdict::kRestart);
  EXPECT_EQ(t.Observe(2), SequenceVerdict::kInOrder);
}

TEST(SequenceTracker, VllmSequenceRestartsAtZero) {
  SequenceTracker t(0);
  EXPECT_EQ(t.Observe(0), SequenceVerdict::kInOrder);
  EXPECT_EQ(t.Observe(0), SequenceVerdict::kDuplicate);
  EXPECT_EQ(t.Observe(1), SequenceVerdict::kInOrder);
  EXPECT_EQ(t.Observe(0), SequenceVerdict::kRestart);
}

}  // namespace
}  // namespace kvrouter
