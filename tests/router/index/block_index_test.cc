#include "router/index/block_index.h"

#include "events/block_hash.h"
#include "tests/router/index/block_index_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

namespace kvrouter {
namespace {

TEST(BlockIndex, StoredChainIsMatchedByLeadingBlocks) {
  BlockIndex idx;
  auto r = idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2, 3}));
  EXPECT_EQ(r.blocks_stored, 3u);
  EXPECT_EQ(Matches(idx, {1, 2, 3, 4}), (std::map<WorkerKey, std::uint32_t>{{kW1, 3}}));
  EXPECT_EQ(Matches(idx, {1, 2}), (std::map<WorkerKey, std::uint32_t>{{kW1, 2}}));
  EXPECT_TRUE(Matches(idx, {2, 3}).empty());  // not a prefix
  EXPECT_EQ(idx.TreeSize(kW1), 3u);
}

TEST(BlockIndex, ChainContinuesFromKnownParent) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));
  auto r = idx.ApplyStored(kW1, 101, Chain(200, {3, 4}));
  EXPECT_FALSE(r.parent_not_found);
  EXPECT_EQ(Matches(idx, {1, 2, 3, 4}), (std::map<WorkerKey, std::uint32_t>{{kW1, 4}}));
}

TEST(BlockIndex, StoredChainWithUnknownParentIsDropped) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1}));
  auto r = idx.ApplyStored(kW1, 999, Chain(200, {2, 3}));
  EXPECT_TRUE(r.parent_not_found);
  EXPECT_EQ(r.blocks_stored, 0u);
  EXPECT_EQ(idx.TreeSize(kW1), 1u);
  // A parent known only to another worker is unknown for this one.
  auto r2 = idx.ApplyStored(kW2, 100, Chain(300, {2}));
  EXPECT_TRUE(r2.parent_not_found);
  EXPECT_EQ(idx.TreeSize(kW2), 0u);
}

TEST(BlockIndex, AChainThatWouldPassMaxBlocksIsDroppedWhole) {
  BlockIndex idx;
  EXPECT_FALSE(idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}), 3).over_capacity);
  auto r = idx.ApplyStored(kW1, 101, Chain(200, {3, 4}), 3);
  EXPECT_TRUE(r.over_capacity);
  EXPECT_EQ(r.blocks_stored, 0u);
  EXPECT_EQ(idx.TreeSize(kW1), 2u);
  EXPECT_EQ(idx.ApplyStored(kW1, 101, Chain(200, {3}), 3).blocks_stored, 1u);  // exactly full
  EXPECT_EQ(Matches(idx, {1, 2, 3}), (std::map<WorkerKey, std::uint32_t>{{kW1, 3}}));
}

TEST(BlockIndex, RestoringKnownBlocksIsIdempotent) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));
  auto r = idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));
  EXPECT_EQ(r.blocks_stored, 0u);
  EXPECT_EQ(idx.TreeSize(kW1), 2u);
  EXPECT_EQ(idx.Memory().nodes, 2u);
  (void)idx.ApplyRemoved(kW1, std::vector<BlockHash>{101});
  EXPECT_EQ(Matches(idx, {1, 2}), (std::map<WorkerKey, std::uint32_t>{{kW1, 1}}));
}

TEST(BlockIndex, RemovingUnknownBlockIsCountedAndRestStillApplies) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2, 3}));
  auto r = idx.ApplyRemoved(kW1, std::vector<BlockHash>{555, 102, 777});
  EXPECT_EQ(r.blocks_not_found, 2u);
  EXPECT_EQ(r.blocks_removed, 1u);
  EXPECT_EQ(idx.TreeSize(kW1), 2u);
  EXPECT_EQ(Matches(idx, {1, 2, 3}), (std::map<WorkerKey, std::uint32_t>{{kW1, 2}}));
}

TEST(BlockIndex, SharedPrefixCountsForEachHolder) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2, 3}));
  (void)idx.ApplyStored(kW2, std::nullopt, Chain(500, {1, 2, 9}));
  EXPECT_EQ(Matches(idx, {1, 2, 3}), (std::map<WorkerKey, std::uint32_t>{{kW1, 3}, {kW2, 2}}));
  EXPECT_EQ(Matches(idx, {1, 2, 9}), (std::map<WorkerKey, std::uint32_t>{{kW1, 2}, {kW2, 3}}));
  EXPECT_EQ(idx.Memory().nodes, 4u);  // 1, 2 shared; 3 and 9 apart
}

TEST(BlockIndex, DpRanksAreSeparateHolders) {
  BlockIndex idx;
  const WorkerKey r0{7, 0}, r1{7, 1};
  (void)idx.ApplyStored(r0, std::nullopt, Chain(100, {1, 2}));
  (void)idx.ApplyStored(r1, std::nullopt, Chain(100, {1}));
  EXPECT_EQ(Matches(idx, {1, 2}), (std::map<WorkerKey, std::uint32_t>{{r0, 2}, {r1, 1}}));
  // Removal by engine hash is per rank.
  (void)idx.ApplyRemoved(r1, std::vector<BlockHash>{100});
  EXPECT_EQ(Matches(idx, {1, 2}), (std::map<WorkerKey, std::uint32_t>{{r0, 2}}));
}

TEST(BlockIndex, ClearWorkerDropsEveryRankAndFreesNodes) {
  BlockIndex idx;
  (void)idx.ApplyStored({7, 0}, std::nullopt, Chain(100, {1, 2}));
  (void)idx.ApplyStored({7, 1}, std::nullopt, Chain(100, {5, 6}));
  (void)idx.ApplyStored(kW2, std::nullopt, Chain(100, {1}));
  EXPECT_EQ(idx.ClearWorker(7), 4u);
  EXPECT_EQ(idx.TreeSize({7, 0}), 0u);
  EXPECT_EQ(idx.TreeSize({7, 1}), 0u);
  EXPECT_EQ(Matches(idx, {1, 2}), (std::map<WorkerKey, std::uint32_t>{{kW2, 1}}));
  EXPECT_EQ(idx.Memory().nodes, 1u);
  // The worker is still known and can store again.
  (void)idx.ApplyStored({7, 0}, std::nullopt, Chain(100, {1}));
  EXPECT_EQ(Matches(idx, {1}).size(), 2u);
}

TEST(BlockIndex, RemoveWorkerForgetsIt) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));
  EXPECT_EQ(idx.RemoveWorker(1), 2u);
  EXPECT_TRUE(Matches(idx, {1, 2}).empty());
  EXPECT_EQ(idx.Memory().nodes, 0u);
  std::size_t known = 0;
  idx.ForEachWorker([&](WorkerKey, std::size_t) { ++known; });
  EXPECT_EQ(known, 0u);
}

// With concurrent readers a freed node and a removed worker's slot keep their numbers until
// FreeRetired: a tolerant read spanning several events never meets a node recycled for another
// block or a slot handed to another worker (which could name a returning worker twice).
// Without readers they are reused at once.
TEST(BlockIndex, FreedNodesAndSlotsAreReusedOnlyAfterFreeRetiredWhenReadersMayRead) {
  for (const bool readers : {false, true}) {
    SCOPED_TRACE(readers ? "concurrent readers" : "no readers");
    BlockIndex idx;
    idx.SetConcurrentReaders(readers);
    (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));
    EXPECT_EQ(idx.RemoveWorker(1), 2u);
    (void)idx.ApplyStored(kW2, std::nullopt, Chain(200, {3, 4}));
    // The root and two nodes, one slot; twice as many while the freed ones wait.
    EXPECT_EQ(idx.node_numbers(), readers ? 5u : 3u);
    EXPECT_EQ(idx.slot_numbers(), readers ? 2u : 1u);
    EXPECT_EQ(idx.HasRetired(), readers);
    idx.FreeRetired();
    EXPECT_EQ(idx.RemoveWorker(2), 2u);
    idx.FreeRetired();
    (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));  // now from the free lists
    EXPECT_EQ(idx.node_numbers(), readers ? 5u : 3u);
    EXPECT_EQ(idx.slot_numbers(), readers ? 2u : 1u);
    EXPECT_EQ(Matches(idx, {1, 2}), (std::map<WorkerKey, std::uint32_t>{{kW1, 2}}));
  }
}

TEST(BlockIndex, RunsReadBeforeASlotPassedToAnotherWorkerAreNotTranslated) {
  BlockIndex idx;
  idx.SetConcurrentReaders(true);
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));
  (void)idx.ApplyStored(kW2, std::nullopt, Chain(200, {1}));
  const auto seq = ComputeSequenceHashes(std::vector<LocalHash>{1, 2});
  MatchRuns runs;
  idx.FindMatches(seq, runs);
  // A thousand holders drop out at one depth as one run; here two runs: both at 1, kW1 at 2.
  ASSERT_EQ(runs.runs.size(), 2u);
  EXPECT_EQ(runs.max_depth(), 2u);
  // kW1 leaves; its slot, once free, goes to kW3: the runs would now name kW3.
  EXPECT_EQ(idx.RemoveWorker(1), 2u);
  OverlapScores out;
  EXPECT_TRUE(idx.TranslateMatches(runs, out));  // not reused yet: the keys as read
  EXPECT_EQ(out.size(), 2u);
  idx.FreeRetired();
  (void)idx.ApplyStored({3, 0}, std::nullopt, Chain(300, {7}));
  out.clear();
  EXPECT_FALSE(idx.TranslateMatches(runs, out));
  EXPECT_TRUE(out.empty());
  idx.FindMatches(seq, runs);  // read again
  EXPECT_TRUE(idx.TranslateMatches(runs, out));
  EXPECT_EQ(std::vector<OverlapScore>(out.begin(), out.end()), (std::vector<OverlapScore>{{kW2, 1}}));
}

// A run that is one crowd-sized holder set, whole, carries that version's stamp; read with the
// stamp known, it is elided (its slots not copied), which only a reader keeping them can use.
// Any change to the set, in place (no readers) or into a new buffer, gives it a new stamp, never
// one used before: an old stamp does not elide the new version.
TEST(BlockIndex, ACrowdsRunIsElidedByItsHolderSetsStampOnlyWhileThatVersionLasts) {
  for (const bool readers : {false, true}) {
    SCOPED_TRACE(readers ? "concurrent readers" : "no readers");
    BlockIndex idx;
    idx.SetConcurrentReaders(readers);
    constexpr std::uint64_t kCrowd = 100;
    for (std::uint64_t w = 1; w <= kCrowd; ++w) (void)idx.ApplyStored({w, 0}, std::nullopt, Chain(1000 * w, {1, 2}));
    (void)idx.ApplyStored(kW1, 1001, Chain(2001, {3}));
    const auto seq = ComputeSequenceHashes(std::vector<LocalHash>{1, 2, 3, 4});
    // The crowd holding blocks 1-2 drops out at depth 2 (kW1 goes on): copied whole, stamped.
    MatchRuns runs;
    idx.FindMatches(seq, runs);
    ASSERT_EQ(runs.runs.size(), 2u);
    const std::uint64_t stamp = runs.runs[0].stamp;
    EXPECT_NE(stamp, 0u);
    EXPECT_EQ(runs.runs[0].depth, 2u);
    EXPECT_EQ(runs.runs[0].end, kCrowd);
    EXPECT_EQ(runs.runs[0].elided, 0u);
    EXPECT_EQ(runs.runs[1].stamp, 0u);  // one holder: kept inline, no stamp
    OverlapScores out;
    EXPECT_TRUE(idx.TranslateMatches(runs, out));
    EXPECT_EQ(out.size(), kCrowd);

    // Known: elided, and not translated.
    const std::vector<std::uint64_t> known{stamp - 1, stamp, stamp + 1};
    idx.FindMatches(seq, runs, false, known);
    ASSERT_EQ(runs.runs.size(), 2u);
    EXPECT_EQ(runs.runs[0].stamp, stamp);
    EXPECT_EQ(runs.runs[0].elided, kCrowd);
    EXPECT_EQ(runs.runs[0].end, 0u);
    EXPECT_EQ(runs.slots.size(), 1u);  // kW1's slot at depth 3 only
    EXPECT_EQ(runs.max_depth(), 3u);
    out.clear();
    EXPECT_FALSE(idx.TranslateMatches(runs, out));
    EXPECT_TRUE(out.empty());

    // The set changes (a holder joins, then leaves again): each version a new stamp.
    std::vector<std::uint64_t> seen{stamp};
    auto reread = [&] {
      idx.FindMatches(seq, runs, false, seen);
      EXPECT_EQ(runs.runs[0].elided, 0u);
      const std::uint64_t s = runs.runs[0].stamp;
      EXPECT_EQ(std::find(seen.begin(), seen.end(), s), seen.end()) << "a stamp came back";
      seen.insert(std::upper_bound(seen.begin(), seen.end(), s), s);
    };
    (void)idx.ApplyStored({kCrowd + 1, 0}, std::nullopt, Chain(999'000, {1, 2}));
    reread();
    EXPECT_EQ(runs.runs[0].end, kCrowd + 1);
    (void)idx.ApplyRemoved({kCrowd + 1, 0}, std::vector<BlockHash>{999'001, 999'000});
    reread();
    EXPECT_EQ(runs.runs[0].end, kCrowd);
    // Another index's sets never carry this one's stamps.
    BlockIndex other;
    for (std::uint64_t w = 1; w <= kCrowd; ++w) (void)other.ApplyStored({w, 0}, std::nullopt, Chain(1000 * w, {1, 2}));
    other.FindMatches(seq, runs, false, seen);
    ASSERT_EQ(runs.runs.size(), 1u);
    EXPECT_EQ(runs.runs[0].elided, 0u);
    EXPECT_EQ(std::find(seen.begin(), seen.end(), runs.runs[0].stamp), seen.end());
  }
}

TEST(BlockIndex, InteriorRemovalStopsTheMatchAtTheGap) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2, 3}));
  (void)idx.ApplyStored(kW2, std::nullopt, Chain(500, {1, 2, 3}));
  (void)idx.ApplyRemoved(kW1, std::vector<BlockHash>{101});  // middle block
  EXPECT_EQ(Matches(idx, {1, 2, 3}), (std::map<WorkerKey, std::uint32_t>{{kW1, 1}, {kW2, 3}}));
  (void)idx.ApplyRemoved(kW2, std::vector<BlockHash>{500});  // first block
  EXPECT_EQ(Matches(idx, {1, 2, 3}), (std::map<WorkerKey, std::uint32_t>{{kW1, 1}}));
}

TEST(BlockIndex, KnownBlockStoredAtNewPositionMoves) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));
  // Engine reuses id 101 for different content under a new root.
  (void)idx.ApplyStored(kW1, std::nullopt, std::vector<StoredBlock>{{300, 7}, {101, 8}});
  EXPECT_EQ(idx.TreeSize(kW1), 3u);
  EXPECT_EQ(Matches(idx, {1, 2}), (std::map<WorkerKey, std::uint32_t>{{kW1, 1}}));
  EXPECT_EQ(Matches(idx, {7, 8}), (std::map<WorkerKey, std::uint32_t>{{kW1, 2}}));
}

TEST(BlockIndex, TwoEngineHashesForOneNodeKeepTheHoldingUntilBothGo) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, std::vector<StoredBlock>{{100, 1}});
  (void)idx.ApplyStored(kW1, std::nullopt, std::vector<StoredBlock>{{200, 1}});
  EXPECT_EQ(idx.TreeSize(kW1), 2u);
  (void)idx.ApplyRemoved(kW1, std::vector<BlockHash>{100});
  EXPECT_EQ(Matches(idx, {1}), (std::map<WorkerKey, std::uint32_t>{{kW1, 1}}));
  (void)idx.ApplyRemoved(kW1, std::vector<BlockHash>{200});
  EXPECT_TRUE(Matches(idx, {1}).empty());
  EXPECT_EQ(idx.Memory().nodes, 0u);
}

std::vector<LocalHash> Locals(std::uint64_t from, std::uint64_t to) {  // from..to-1
  std::vector<LocalHash> out;
  for (std::uint64_t l = from; l < to; ++l) out.push_back(l);
  return out;
}

// Removals are worked through in groups whose lookups are loaded ahead: a long event, crossing
// groups, with a block named twice and unknown ones, removes each held block once, both for a
// worker whose engine hashes are the sequence hashes and for one with engine hashes of its own,
// and with readers (as a shard's index) or without.
TEST(BlockIndex, ALongRemovalWithRepeatsAndUnknownsRemovesEachHeldBlockOnce) {
  for (const bool own_ids : {false, true}) {
    for (const bool readers : {false, true}) {
      SCOPED_TRACE(testing::Message() << "own engine ids " << own_ids << ", readers " << readers);
      BlockIndex idx;
      idx.SetConcurrentReaders(readers);
      idx.ShrinkTablesLater(readers);
      const std::vector<LocalHash> locals = Locals(1, 41);
      std::vector<StoredBlock> chain = Chain(1000, locals);
      if (!own_ids) {
        const auto seq = ComputeSequenceHashes(locals);
        for (std::size_t i = 0; i < chain.size(); ++i) chain[i].block_hash = seq[i];
      }
      (void)idx.ApplyStored(kW1, std::nullopt, chain);
      (void)idx.ApplyStored(kW2, std::nullopt, Chain(7000, Locals(1, 11)));  // the first 10, shared
      // The last 20 blocks, tail first, block 35 twice and an unknown id among them.
      std::vector<BlockHash> tail;
      for (std::size_t i = 40; i-- > 20;) {
        tail.push_back(chain[i].block_hash);
        if (i == 35) tail.push_back(chain[i].block_hash);
        if (i == 30) tail.push_back(424242);
      }
      ApplyOutcome r = idx.ApplyRemoved(kW1, tail);
      EXPECT_EQ(r.blocks_removed, 20u);
      EXPECT_EQ(r.blocks_not_found, 2u);
      EXPECT_EQ(idx.TreeSize(kW1), 20u);
      EXPECT_EQ(Matches(idx, locals), (std::map<WorkerKey, std::uint32_t>{{kW1, 20}, {kW2, 10}}));
      EXPECT_EQ(idx.Memory().nodes, 20u);
      // The rest, tail first, with the whole tail again (all unknown now).
      std::vector<BlockHash> rest;
      for (std::size_t i = 20; i-- > 0;) rest.push_back(chain[i].block_hash);
      rest.insert(rest.end(), tail.begin(), tail.end());
      r = idx.ApplyRemoved(kW1, rest);
      EXPECT_EQ(r.blocks_removed, 20u);
      EXPECT_EQ(r.blocks_not_found, tail.size());
      EXPECT_EQ(idx.TreeSize(kW1), 0u);
      EXPECT_EQ(Matches(idx, locals), (std::map<WorkerKey, std::uint32_t>{{kW2, 10}}));
      EXPECT_EQ(idx.Memory().nodes, 10u);
    }
  }
}

// A clear walks a worker's nodes with their lookups loaded ahead: a worker with engine hashes of
// its own, two of them on some nodes, loses every holding, the nodes only it held are freed, and
// it stores and removes as before afterwards.
TEST(BlockIndex, ClearingAWorkerWithTwoEngineHashesOnSomeNodesFreesWhatOnlyItHeld) {
  for (const bool readers : {false, true}) {
    SCOPED_TRACE(testing::Message() << "readers " << readers);
    BlockIndex idx;
    idx.SetConcurrentReaders(readers);
    idx.ShrinkTablesLater(readers);
    const std::vector<LocalHash> locals = Locals(1, 41);
    (void)idx.ApplyStored(kW1, std::nullopt, Chain(1000, locals));
    (void)idx.ApplyStored(kW1, std::nullopt, Chain(5000, Locals(1, 21)));  // the first 20 again, other ids
    (void)idx.ApplyStored(kW2, std::nullopt, Chain(7000, Locals(1, 11)));
    EXPECT_EQ(idx.TreeSize(kW1), 60u);
    EXPECT_EQ(idx.ClearWorker(1), 60u);
    EXPECT_EQ(idx.TreeSize(kW1), 0u);
    EXPECT_EQ(Matches(idx, locals), (std::map<WorkerKey, std::uint32_t>{{kW2, 10}}));
    EXPECT_EQ(idx.Memory().nodes, 10u);
    (void)idx.ApplyStored(kW1, std::nullopt, Chain(9000, Locals(1, 6)));
    EXPECT_EQ(Matches(idx, Locals(1, 6)), (std::map<WorkerKey, std::uint32_t>{{kW1, 5}, {kW2, 5}}));
    const ApplyOutcome r = idx.ApplyRemoved(kW1, std::vector<BlockHash>{9004, 9003, 9002, 9001, 9000});
    EXPECT_EQ(r.blocks_removed, 5u);
    EXPECT_EQ(idx.TreeSize(kW1), 0u);
    EXPECT_EQ(Matches(idx, Locals(1, 6)), (std::map<WorkerKey, std::uint32_t>{{kW2, 5}}));
    EXPECT_EQ(idx.Memory().nodes, 10u);
  }
}

// Nodes freed by a clear are taken again in address order once tidied: new nodes then share
// cache lines and pages. A few freed nodes are not worth sorting.
TEST(BlockIndex, TidiedFreeNodesAreTakenInAddressOrder) {
  BlockIndex idx;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 3; ++i) (void)idx.ApplyStored(kW1, std::nullopt, std::vector<StoredBlock>{{rng(), rng()}});
  (void)idx.ClearWorker(kW1.worker_id);
  std::vector<std::uint32_t> few(idx.free_node_numbers().begin(), idx.free_node_numbers().end());
  idx.TidyFreeNodes();
  EXPECT_TRUE(std::ranges::equal(idx.free_node_numbers(), few));

  // Two workers' blocks interleaved, one worker cleared in the order of its random hashes.
  for (int i = 0; i < 10000; ++i) {
    (void)idx.ApplyStored(i % 2 ? kW1 : kW2, std::nullopt, std::vector<StoredBlock>{{rng(), rng()}});
  }
  (void)idx.ClearWorker(kW1.worker_id);
  std::vector<std::uint32_t> freed(idx.free_node_numbers().begin(), idx.free_node_numbers().end());
  ASSERT_EQ(freed.size(), 5000u);
  idx.TidyFreeNodes();
  std::vector<std::uint32_t> tidied(idx.free_node_numbers().begin(), idx.free_node_numbers().end());
  EXPECT_TRUE(std::ranges::is_sorted(tidied, std::greater<>()));  // taken from the back: ascending
  std::ranges::sort(freed);
  std::ranges::sort(tidied);
  EXPECT_EQ(tidied, freed);  // the same numbers
  // The index is unchanged: worker 2 keeps all its blocks, and new ones take the freed nodes.
  EXPECT_EQ(idx.TreeSize(kW2), 5000u);
  const std::size_t numbers = idx.node_numbers();
  for (int i = 0; i < 5000; ++i) (void)idx.ApplyStored(kW1, std::nullopt, std::vector<StoredBlock>{{rng(), rng()}});
  EXPECT_EQ(idx.node_numbers(), numbers);
  EXPECT_EQ(idx.TreeSize(kW1), 5000u);

  // A few nodes taken and a few freed since: not worth another pass (the list keeps its order).
  (void)idx.ClearWorker(kW1.worker_id);
  idx.TidyFreeNodes();
  for (int i = 0; i < 10; ++i) (void)idx.ApplyStored(kW1, std::nullopt, std::vector<StoredBlock>{{rng(), rng()}});
  const auto some = idx.free_node_numbers();
  const std::vector<std::uint32_t> before(some.begin(), some.end());
  std::vector<BlockHash> three;
  for (int i = 0; i < 3; ++i) {
    three.push_back(rng());
    (void)idx.ApplyStored(kW2, std::nullopt, std::vector<StoredBlock>{{three.back(), rng()}});
  }
  (void)idx.ApplyRemoved(kW2, three);  // three nodes freed after the tidy, in that order
  const auto after = idx.free_node_numbers();
  const std::vector<std::uint32_t> freed_late(after.begin(), after.end());
  idx.TidyFreeNodes();
  EXPECT_TRUE(std::ranges::equal(idx.free_node_numbers(), freed_late));
  EXPECT_EQ(freed_late.size(), before.size());  // three taken from the list and three given back
}

// By default the sequence-hash table halves as blocks go (approximate mode's index relies on
// it); ShrinkTablesLater keeps the capacity until ShrinkTables.
TEST(BlockIndex, TheTableShrinksAsBlocksGoUnlessShrinkingIsLeftToTheOwner) {
  auto fill_and_clear = [](BlockIndex& idx) {
    for (std::uint64_t b = 1; b <= 5000; ++b)
      (void)idx.ApplyStored(kW1, std::nullopt, std::vector<StoredBlock>{{b, b}});
    const std::size_t full = idx.Memory().table_bytes;
    (void)idx.ClearWorker(kW1.worker_id);
    return full;
  };
  BlockIndex eager;
  const std::size_t full = fill_and_clear(eager);
  EXPECT_GT(full, 5000u * 12);
  EXPECT_LT(eager.Memory().table_bytes * 8, full);
  BlockIndex later;
  later.ShrinkTablesLater(true);
  EXPECT_EQ(fill_and_clear(later), full);
  EXPECT_EQ(later.Memory().table_bytes, full);
  EXPECT_TRUE(later.TablesUnderfull());
  later.ShrinkTables();
  EXPECT_EQ(later.Memory().table_bytes, 0u);
}

// A worker whose engine hashes are not sequence hashes keeps its map of them through a clear
// too, when shrinking is left to the owner, and refills it without growing it again.
TEST(BlockIndex, AClearedWorkersMapOfEngineHashesIsKeptUntilTheOwnerShrinks) {
  auto fill = [](BlockIndex& idx) {
    std::optional<BlockHash> parent;
    for (std::uint64_t b = 1; b <= 5000; ++b) {
      const BlockHash engine = b + (1ull << 40);
      (void)idx.ApplyStored(kW1, parent, std::vector<StoredBlock>{{engine, b}});
      parent = engine;
    }
    return idx.Memory().map_bytes;
  };
  BlockIndex later;
  later.ShrinkTablesLater(true);
  const std::size_t full = fill(later);
  EXPECT_GT(full, 5000u * 12);
  (void)later.ClearWorker(kW1.worker_id);
  EXPECT_EQ(later.Memory().map_bytes, full);
  EXPECT_EQ(later.Memory().holdings, 0u);
  EXPECT_TRUE(later.TablesUnderfull());
  EXPECT_EQ(fill(later), full);  // refilled without growing
  EXPECT_EQ(later.Memory().holdings, 5000u);
  (void)later.ClearWorker(kW1.worker_id);
  later.ShrinkTables();
  EXPECT_EQ(later.Memory().map_bytes, 0u);
  EXPECT_FALSE(later.TablesUnderfull());
  BlockIndex eager;  // without ShrinkTablesLater the map goes with the clear
  EXPECT_EQ(fill(eager), full);
  (void)eager.ClearWorker(kW1.worker_id);
  EXPECT_EQ(eager.Memory().map_bytes, 0u);
}

// Worker 2 holds `other`; worker 1 stores `chain` and removes it a million times. The index's
// memory before and after the million.
std::pair<IndexMemory, IndexMemory> StoreAndRemoveAMillionTimes(const std::vector<StoredBlock>& chain,
                                                                const std::vector<StoredBlock>& other) {
  BlockIndex idx;
  std::vector<BlockHash> ids;
  for (const auto& b : chain) ids.push_back(b.block_hash);
  (void)idx.ApplyStored(kW2, std::nullopt, other);
  (void)idx.ApplyStored(kW1, std::nullopt, chain);
  (void)idx.ApplyRemoved(kW1, ids);
  const IndexMemory before = idx.Memory();
  for (int i = 0; i < 1'000'000; ++i) {
    (void)idx.ApplyStored(kW1, std::nullopt, chain);
    (void)idx.ApplyRemoved(kW1, ids);
  }
  return {before, idx.Memory()};
}

TEST(BlockIndex, MemoryDoesNotGrowWhenSameBlocksAreStoredAndRemovedAMillionTimes) {
  const auto [before, after] = StoreAndRemoveAMillionTimes(Chain(100, {11, 12, 13, 14}), Chain(900, {11, 12}));
  EXPECT_EQ(after.bytes, before.bytes);
  EXPECT_EQ(after.nodes, 2u);
  EXPECT_EQ(after.holdings, 2u);
}

// Reference model: each worker's blocks as full paths of local hashes.
class ReferenceIndex {
 public:
  void Stored(WorkerKey w, std::optional<BlockHash> parent, const std::vector<StoredBlock>& bs) {
    auto& blocks = workers_[w];
    std::vector<LocalHash> path;
    if (parent) {
      auto it = blocks.find(*parent);
      if (it == blocks.end()) return;
      path = it->second;
    }
    for (const auto& b : bs) {
      path.push_back(b.tokens_hash);
      blocks[b.block_hash] = path;
    }
  }
  void Removed(WorkerKey w, const std::vector<BlockHash>& hs) {
    for (BlockHash h : hs) workers_[w].erase(h);
  }
  void Clear(std::uint64_t id) {
    for (auto& [k, b] : workers_)
      if (k.worker_id == id) b.clear();
  }
  std::map<WorkerKey, std::uint32_t> Matches(const std::vector<LocalHash>& h) const {
    std::map<WorkerKey, std::uint32_t> out;
    for (const auto& [w, blocks] : workers_) {
      std::set<std::vector<LocalHash>> held;
      for (const auto& [id, path] : blocks) held.insert(path);
      std::uint32_t n = 0;
      std::vector<LocalHash> prefix;
      for (LocalHash x : h) {
        prefix.push_back(x);
        if (!held.count(prefix)) break;
        ++n;
      }
      if (n > 0) out[w] = n;
    }
    return out;
  }
  std::size_t Size(WorkerKey w) const {
    auto it = workers_.find(w);
    return it == workers_.end() ? 0 : it->second.size();
  }
  std::map<WorkerKey, std::map<BlockHash, std::vector<LocalHash>>> workers_;
};

// Random stores, removals and clears on 4 workers x 2 ranks, checked against the reference
// after every step. canonical_percent: the share of stored blocks whose engine hash is their
// sequence hash (as Dynamo's workers publish); the rest get small engine ids, which turn the
// worker's slot from canonical to mapped part way.
void RunAgainstReference(std::uint64_t seed, int canonical_percent) {
  std::mt19937_64 rng(seed);
  BlockIndex idx;
  ReferenceIndex ref;
  auto pick = [&](std::uint64_t n) { return rng() % n; };
  for (int step = 0; step < 4000; ++step) {
    const WorkerKey w{pick(4), static_cast<std::uint32_t>(pick(2))};
    const std::uint64_t op = pick(100);
    if (op < 55) {
      std::optional<BlockHash> parent;
      std::vector<LocalHash> path;
      if (pick(2) == 0 && ref.Size(w) > 0) {
        auto& blocks = ref.workers_[w];
        auto it = blocks.begin();
        std::advance(it, pick(blocks.size()));
        parent = it->first;
        path = it->second;
      } else if (pick(10) == 0) {
        parent = 10'000 + pick(50);  // probably unknown
      }
      std::vector<StoredBlock> bs;
      const std::size_t len = 1 + pick(4);
      for (std::size_t i = 0; i < len; ++i) {
        const LocalHash local = pick(3);
        path.push_back(local);
        const bool canonical = static_cast<int>(pick(100)) < canonical_percent;
        bs.push_back({canonical ? ComputeSequenceHashes(path).back() : pick(60), local});
      }
      ref.Stored(w, parent, bs);
      (void)idx.ApplyStored(w, parent, bs);
    } else if (op < 95) {
      std::vector<BlockHash> hs;
      auto& blocks = ref.workers_[w];
      for (std::size_t i = 0, n = 1 + pick(3); i < n; ++i) {
        if (pick(4) != 0 && !blocks.empty()) {
          auto it = blocks.begin();
          std::advance(it, pick(blocks.size()));
          hs.push_back(it->first);  // a held one, whichever kind its hash is
        } else {
          hs.push_back(pick(60));
        }
      }
      ref.Removed(w, hs);
      (void)idx.ApplyRemoved(w, hs);
    } else {
      ref.Clear(w.worker_id);
      (void)idx.ClearWorker(w.worker_id);
    }
    ASSERT_EQ(idx.TreeSize(w), ref.Size(w)) << "step " << step;
    std::vector<LocalHash> q;
    for (std::size_t i = 0, n = 1 + pick(6); i < n; ++i) q.push_back(pick(3));
    ASSERT_EQ(Matches(idx, q), ref.Matches(q)) << "step " << step;
    if (step % 500 == 499) {  // a copy made from the dump answers every query the same way
      BlockIndex copy;
      CopyByDump(idx, copy);
      for (int k = 0; k < 200; ++k) {
        std::vector<LocalHash> q2;
        for (std::size_t i = 0, n = 1 + pick(6); i < n; ++i) q2.push_back(pick(3));
        ASSERT_EQ(Matches(copy, q2), Matches(idx, q2)) << "step " << step;
      }
      for (std::uint64_t id = 0; id < 4; ++id) {
        for (std::uint32_t r = 0; r < 2; ++r) ASSERT_LE(copy.TreeSize({id, r}), idx.TreeSize({id, r}));
      }
    }
  }
}

TEST(BlockIndex, AgreesWithReferenceModelUnderRandomEvents) {
  for (std::uint64_t seed : {1u, 2u, 3u, 4u, 5u}) {
    SCOPED_TRACE(seed);
    RunAgainstReference(seed, 0);
  }
}

TEST(BlockIndex, CanonicalWorkersAgreeWithReferenceModel) {
  for (std::uint64_t seed : {1u, 2u, 3u, 4u, 5u}) {
    SCOPED_TRACE(seed);
    RunAgainstReference(seed, 100);
  }
}

TEST(BlockIndex, WorkersTurningFromCanonicalToMappedAgreeWithReferenceModel) {
  for (std::uint64_t seed : {1u, 2u, 3u, 4u, 5u}) {
    SCOPED_TRACE(seed);
    RunAgainstReference(seed, 97);
  }
}

TEST(BlockIndex, CanonicalWorkerIsFoundByParentAndRemovedByItsSequenceHash) {
  BlockIndex idx;
  const auto chain = CanonicalChain({1, 2, 3});
  (void)idx.ApplyStored(kW1, std::nullopt, std::span(chain).first(2));
  auto r = idx.ApplyStored(kW1, chain[1].block_hash, std::span(chain).subspan(2));
  EXPECT_FALSE(r.parent_not_found);
  EXPECT_EQ(r.blocks_stored, 1u);
  // Another worker holding the same node does not make it this one's parent.
  auto r2 = idx.ApplyStored(kW2, chain[1].block_hash, std::span(chain).subspan(2));
  EXPECT_TRUE(r2.parent_not_found);
  (void)idx.ApplyStored(kW2, std::nullopt, chain);
  auto removed = idx.ApplyRemoved(kW1, std::vector<BlockHash>{chain[1].block_hash, chain[1].block_hash});
  EXPECT_EQ(removed.blocks_removed, 1u);
  EXPECT_EQ(removed.blocks_not_found, 1u);  // the repeat: already gone
  EXPECT_EQ(Matches(idx, {1, 2, 3}), (std::map<WorkerKey, std::uint32_t>{{kW1, 1}, {kW2, 3}}));
  EXPECT_EQ(idx.TreeSize(kW1), 2u);
  EXPECT_EQ(idx.ClearWorker(1), 2u);
  EXPECT_EQ(Matches(idx, {1, 2, 3}), (std::map<WorkerKey, std::uint32_t>{{kW2, 3}}));
}

// A chain growing at its end is stored without looking its blocks up (its parent has no
// children), but a sequence hash that is already taken still names the node that has it: two
// prefixes colliding share it, and the table keeps it, as when the lookup finds it.
TEST(BlockIndex, ASequenceHashCollisionUnderAChildlessParentSharesTheNodeThere) {
  BlockIndex idx;
  // Worker 1 holds a first block whose sequence hash is that of the prefix {1, 2}.
  const SequenceHash s = ComputeSequenceHashes(std::vector<LocalHash>{1, 2})[1];
  ASSERT_FALSE(idx.ApplyStored(kW1, std::nullopt, std::vector<StoredBlock>{{s, s}}).parent_not_found);
  // Worker 2 (engine ids) stores {1}, then {2} under it: the second block's prefix is that node.
  (void)idx.ApplyStored(kW2, std::nullopt, Chain(100, {1}));
  EXPECT_EQ(idx.ApplyStored(kW2, BlockHash{100}, Chain(101, {2})).blocks_stored, 1u);
  EXPECT_EQ(Matches(idx, {s}), (std::map<WorkerKey, std::uint32_t>{{kW1, 1}, {kW2, 1}}));
  // Worker 2's blocks go; worker 1's node stays found, as a parent and by a query.
  EXPECT_EQ(idx.ApplyRemoved(kW2, std::vector<BlockHash>{101, 100}).blocks_removed, 2u);
  const auto child = CanonicalChain({s, 7});
  EXPECT_FALSE(idx.ApplyStored(kW1, s, std::span(child).subspan(1)).parent_not_found);
  EXPECT_EQ(Matches(idx, {s}), (std::map<WorkerKey, std::uint32_t>{{kW1, 1}}));
  EXPECT_EQ(idx.TreeSize(kW1), 2u);
}

TEST(BlockIndex, CanonicalWorkerKeepsNoMapAndTurnsMappedOnItsFirstOtherHash) {
  BlockIndex idx;
  std::vector<LocalHash> locals(1000);
  for (std::size_t i = 0; i < locals.size(); ++i) locals[i] = 1000 + i;
  (void)idx.ApplyStored(kW1, std::nullopt, CanonicalChain(locals));
  const std::size_t canonical_bytes = idx.Memory().bytes;
  // Now an engine id that is not a sequence hash: the worker keeps every block, under both kinds.
  (void)idx.ApplyStored(kW1, std::nullopt, std::vector<StoredBlock>{{7, 5}});
  EXPECT_EQ(idx.TreeSize(kW1), 1001u);
  EXPECT_GE(idx.Memory().bytes, canonical_bytes + 1000 * 12);  // the map it did not need before
  EXPECT_EQ(idx.ApplyRemoved(kW1, std::vector<BlockHash>{7, ComputeSequenceHashes(locals).back()}).blocks_removed, 2u);
  EXPECT_EQ(Matches(idx, locals), (std::map<WorkerKey, std::uint32_t>{{kW1, 999}}));
  // Cleared, it is canonical again.
  EXPECT_EQ(idx.ClearWorker(1), 999u);
  (void)idx.ApplyStored(kW1, std::nullopt, CanonicalChain(locals));
  // No map any more (1,000 x 12 bytes and more); the list of free node numbers that the clear
  // filled keeps its capacity (1,024 x 4 bytes).
  EXPECT_GE(idx.Memory().bytes, canonical_bytes);
  EXPECT_LE(idx.Memory().bytes, canonical_bytes + 1024 * sizeof(std::uint32_t));
}

TEST(BlockIndex, CanonicalWorkerMemoryStaysBoundedWhenTheSameBlocksComeAndGoAMillionTimes) {
  const auto [before, after] = StoreAndRemoveAMillionTimes(CanonicalChain({11, 12, 13, 14}), CanonicalChain({11, 12}));
  // The held list collects stale entries between compactions: at most 2 x live + 32 of them.
  EXPECT_LE(after.bytes, before.bytes + 64 * sizeof(std::uint32_t));
  EXPECT_EQ(after.nodes, 2u);
  EXPECT_EQ(after.holdings, 2u);
}

}  // namespace
}  // namespace kvrouter
