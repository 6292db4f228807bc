#include "router/scheduling/active_load.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

using std::chrono::seconds;
constexpr WorkerKey kA{1, 0};
constexpr WorkerKey kB{2, 0};
const SteadyTime kT0{};

TEST(ActiveLoad, SharedPrefixesCountOnce) {
  ActiveLoad load;
  const std::vector<SequenceHash> r1 = {10, 11, 12};
  const std::vector<SequenceHash> r2 = {10, 11, 99};
  ASSERT_TRUE(load.Book("r1", kA, r1, 192, kT0));
  ASSERT_TRUE(load.Book("r2", kA, r2, 64, kT0));
  WorkerLoad l = load.Load(kA);
  EXPECT_EQ(l.active_blocks, 4u);
  EXPECT_EQ(l.active_prefill_tokens, 256u);
  EXPECT_EQ(l.active_requests, 2u);
  EXPECT_EQ(load.ActivePrefix(kA, std::vector<SequenceHash>{10, 11, 50}), 2u);
  EXPECT_EQ(load.ActivePrefix(kB, r1), 0u);
  ASSERT_TRUE(load.Free("r1"));
  l = load.Load(kA);
  EXPECT_EQ(l.active_blocks, 3u);  // 10, 11 still held by r2
  EXPECT_EQ(l.active_prefill_tokens, 64u);
}

TEST(ActiveLoad, PrefillSquaresFollowBookingsAndMarks) {
  ActiveLoad load;
  ASSERT_TRUE(load.Book("big", kA, std::vector<SequenceHash>{1}, 8000, kT0));
  ASSERT_TRUE(load.Book("small", kA, std::vector<SequenceHash>{2}, 1000, kT0));
  EXPECT_EQ(load.Load(kA).active_prefill_squares, 8000u * 8000u + 1000u * 1000u);
  ASSERT_TRUE(load.MarkPrefill("big"));
  EXPECT_EQ(load.Load(kA).active_prefill_squares, 1000u * 1000u);
  ASSERT_TRUE(load.Free("small"));
  EXPECT_EQ(load.Load(kA).active_prefill_squares, 0u);
  // A prompt past 2^24 tokens counts as 2^24: the sum cannot overflow.
  ASSERT_TRUE(load.Book("huge", kB, std::vector<SequenceHash>{3}, std::uint64_t{1} << 40, kT0));
  EXPECT_EQ(load.Load(kB).active_prefill_squares, std::uint64_t{1} << 48);
}

TEST(ActiveLoad, RecentRequestsHalveEveryHalfLifeAndOutliveTheBookings) {
  ActiveLoad load;
  const auto half = ActiveLoad::kRecentHalfLife;
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(load.Book("r" + std::to_string(i), kA, std::vector<SequenceHash>{1}, 0, kT0));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(load.Free("r" + std::to_string(i)));
  EXPECT_DOUBLE_EQ(load.RecentRequests(kA, kT0), 4.0);
  EXPECT_DOUBLE_EQ(load.RecentRequests(kA, kT0 + half), 2.0);
  EXPECT_DOUBLE_EQ(load.RecentRequests(kA, kT0 + 2 * half), 1.0);
  ASSERT_TRUE(load.Book("later", kA, std::vector<SequenceHash>{1}, 0, kT0 + half));
  EXPECT_DOUBLE_EQ(load.RecentRequests(kA, kT0 + half), 3.0);
  EXPECT_DOUBLE_EQ(load.RecentRequests(kB, kT0), 0.0);
  // Far later the scale is moved forward (no overflow) and the old requests are all but gone.
  ASSERT_TRUE(load.Book("much-later", kB, std::vector<SequenceHash>{1}, 0, kT0 + 200 * half));
  EXPECT_NEAR(load.RecentRequests(kB, kT0 + 200 * half), 1.0, 1e-12);
  EXPECT_NEAR(load.RecentRequests(kA, kT0 + 200 * half), 0.0, 1e-12);
  EXPECT_DOUBLE_EQ(load.RecentRequests(kB, kT0 + 201 * half), 0.5);
  load.RemoveWorker(kA.worker_id);
  EXPECT_DOUBLE_EQ(load.RecentRequests(kA, kT0 + half), 0.0);
}

TEST(ActiveLoad, MarkPrefillAndFreeAreIdempotent) {
  ActiveLoad load;
  ASSERT_TRUE(load.Book("r", kA, std::vector<SequenceHash>{1, 2}, 128, kT0));
  EXPECT_FALSE(load.Book("r", kB, std::vector<SequenceHash>{1}, 5, kT0));  // already booked
  EXPECT_TRUE(load.MarkPrefill("r"));
  EXPECT_FALSE(load.MarkPrefill("r"));
  EXPECT_EQ(load.Load(kA).active_prefill_tokens, 0u);
  EXPECT_EQ(load.Load(kA).active_blocks, 2u);
  EXPECT_TRUE(load.Free("r"));
  EXPECT_FALSE(load.Free("r"));
  EXPECT_FALSE(load.MarkPrefill("unknown"));
  EXPECT_EQ(load.Load(kA).active_requests, 0u);
  EXPECT_EQ(load.requests(), 0u);
}

// Section 13: a disaggregated booking's prefill part weighs on its prefill rank (one request,
// its prefill tokens, no blocks) until ReleasePrefill, MarkPrefill or Free; the request's own rank
// then prefills nothing; a booking takes one part in its life; its prefill worker leaving takes
// only that part.
TEST(ActiveLoad, APrefillPartWeighsOnItsRankUntilReleased) {
  ActiveLoad load;
  const std::vector<SequenceHash> seq = {11, 12, 13};
  ASSERT_TRUE(load.Book("r", kA, seq, 12, kT0));
  EXPECT_FALSE(load.BookPrefill("unknown", kB, 100, kT0));
  EXPECT_FALSE(load.BookPrefill("r", kA, 100, kT0));  // its own rank is not a prefill part
  ASSERT_TRUE(load.BookPrefill("r", kB, 100, kT0));
  EXPECT_FALSE(load.BookPrefill("r", kB, 100, kT0));
  EXPECT_EQ(load.Load(kA).active_prefill_tokens, 0u);  // prefilled on kB instead
  EXPECT_EQ(load.Load(kA).active_prefill_squares, 0u);
  EXPECT_EQ(load.Load(kB).active_requests, 1u);
  EXPECT_EQ(load.Load(kB).active_prefill_tokens, 100u);
  EXPECT_EQ(load.Load(kB).active_prefill_squares, 10000u);
  EXPECT_EQ(load.Load(kB).active_blocks, 0u);
  EXPECT_EQ(load.Load(kA).active_blocks, 3u);
  ASSERT_NE(load.PrefillWorkerOf("r"), nullptr);
  EXPECT_EQ(*load.PrefillWorkerOf("r"), kB);
  EXPECT_TRUE(load.ReleasePrefill("r"));
  EXPECT_FALSE(load.ReleasePrefill("r"));
  EXPECT_EQ(load.Load(kB).active_requests, 0u);
  EXPECT_EQ(load.Load(kB).active_prefill_tokens, 0u);
  EXPECT_EQ(load.PrefillWorkerOf("r"), nullptr);
  EXPECT_FALSE(load.BookPrefill("r", kB, 100, kT0));  // once in its life
  EXPECT_EQ(load.requests(), 1u);
  // MarkPrefill releases it too, and is true for that alone.
  ASSERT_TRUE(load.Book("m", kA, seq, 0, kT0));
  ASSERT_TRUE(load.BookPrefill("m", kB, 7, kT0));
  EXPECT_TRUE(load.MarkPrefill("m"));
  EXPECT_FALSE(load.MarkPrefill("m"));
  EXPECT_EQ(load.Load(kB).active_requests, 0u);
  // The prefill worker leaving takes only its part; Free takes both.
  ASSERT_TRUE(load.Book("g", kA, seq, 0, kT0));
  ASSERT_TRUE(load.BookPrefill("g", kB, 7, kT0));
  EXPECT_EQ(load.RemoveWorker(kB.worker_id), 1u);
  EXPECT_EQ(load.requests(), 3u);
  EXPECT_EQ(load.Load(kA).active_requests, 3u);
  ASSERT_TRUE(load.Book("f", kA, seq, 0, kT0));
  ASSERT_TRUE(load.BookPrefill("f", kB, 7, kT0));
  EXPECT_EQ(load.prefill_parts(), 1u);
  EXPECT_TRUE(load.Free("f"));
  EXPECT_EQ(load.prefill_parts(), 0u);
  EXPECT_EQ(load.Load(kB).active_requests, 0u);
  for (const char* id : {"r", "m", "g"}) EXPECT_TRUE(load.Free(id));
  EXPECT_EQ(load.active_workers(), 0u);
  // Its decode worker leaving takes the whole booking, prefill part included.
  ASSERT_TRUE(load.Book("s", kA, seq, 0, kT0));
  ASSERT_TRUE(load.BookPrefill("s", kB, 9, kT0));
  EXPECT_EQ(load.RemoveWorker(kA.worker_id), 1u);
  EXPECT_EQ(load.Load(kB).active_requests, 0u);
  EXPECT_EQ(load.requests(), 0u);
}

TEST(ActiveLoad, SweepReleasesRequestsOlderThanTheLimit) {
  ActiveLoad load;
  ASSERT_TRUE(load.Book("old", kA, std::vector<SequenceHash>{1}, 64, kT0));
  ASSERT_TRUE(load.Book("new", kA, std::vector<SequenceHash>{2}, 64, kT0 + seconds(200)));
  EXPECT_EQ(load.Sweep(kT0 + seconds(300)), 0u);  // exactly 300 s is not older
  EXPECT_EQ(load.Sweep(kT0 + seconds(301)), 1u);
  EXPECT_EQ(load.WorkerOf("old"), nullptr);
  ASSERT_NE(load.WorkerOf("new"), nullptr);
  EXPECT_EQ(load.Load(kA).active_requests, 1u);
}

TEST(ActiveLoad, RemovedWorkerReleasesItsRequests) {
  ActiveLoad load;
  ASSERT_TRUE(load.Book("a0", {1, 0}, std::vector<SequenceHash>{1}, 64, kT0));
  ASSERT_TRUE(load.Book("a1", {1, 1}, std::vector<SequenceHash>{1}, 64, kT0));
  ASSERT_TRUE(load.Book("b", kB, std::vector<SequenceHash>{1}, 64, kT0));
  EXPECT_EQ(load.RemoveWorker(1), 2u);
  EXPECT_EQ(load.Load({1, 0}).active_requests, 0u);
  EXPECT_EQ(load.Load(kB).active_requests, 1u);
  EXPECT_FALSE(load.Free("a0"));
  EXPECT_EQ(load.RemoveWorker(1), 0u);
  EXPECT_EQ(load.RemoveWorker(2), 1u);
  EXPECT_EQ(load.requests(), 0u);
}

TEST(ActiveLoad, ActiveWorkersAreTheRanksWithARequestNowNotThoseBookedOnce) {
  ActiveLoad load;
  ASSERT_TRUE(load.Book("a0", kA, std::vector<SequenceHash>{1}, 64, kT0));
  ASSERT_TRUE(load.Book("a1", kA, std::vector<SequenceHash>{2}, 64, kT0));
  ASSERT_TRUE(load.Book("b", kB, std::vector<SequenceHash>{1}, 64, kT0));
  EXPECT_EQ(load.active_workers(), 2u);
  ASSERT_TRUE(load.Free("a0"));
  EXPECT_EQ(load.active_workers(), 2u);  // a1 is still there
  ASSERT_TRUE(load.Free("a1"));
  EXPECT_EQ(load.active_workers(), 1u);
  EXPECT_EQ(load.workers(), 2u);  // A keeps its entry (its recent requests)
  EXPECT_EQ(load.Sweep(kT0 + std::chrono::seconds(301)), 1u);
  EXPECT_EQ(load.active_workers(), 0u);
  ASSERT_TRUE(load.Book("b2", kB, std::vector<SequenceHash>{1}, 64, kT0));
  EXPECT_EQ(load.RemoveWorker(kB.worker_id), 1u);
  EXPECT_EQ(load.active_workers(), 0u);
}

TEST(ActiveLoad, BookedBlocksFollowEveryWayABookingEnds) {
  ActiveLoad load;
  ASSERT_TRUE(load.Book("a", kA, std::vector<SequenceHash>{1, 2, 3}, 64, kT0));
  ASSERT_TRUE(load.Book("b", kA, std::vector<SequenceHash>{1, 2}, 64, kT0));  // shared: counted per booking
  ASSERT_TRUE(load.Book("c", kB, std::vector<SequenceHash>{7}, 64, kT0 + seconds(100)));
  EXPECT_EQ(load.booked_blocks(), 6u);
  EXPECT_FALSE(load.Book("a", kB, std::vector<SequenceHash>{9, 9, 9, 9}, 1, kT0));
  EXPECT_EQ(load.booked_blocks(), 6u);
  ASSERT_TRUE(load.Free("b"));
  EXPECT_EQ(load.booked_blocks(), 4u);
  EXPECT_EQ(load.Sweep(kT0 + seconds(301)), 1u);  // a
  EXPECT_EQ(load.booked_blocks(), 1u);
  EXPECT_EQ(load.RemoveWorker(kB.worker_id), 1u);
  EXPECT_EQ(load.booked_blocks(), 0u);
}

}  // namespace
}  // namespace kvrouter
