#include "router/index/block_index.h"

#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "tests/router/index/block_index_test_util.h"

namespace kvrouter {
namespace {

TEST(BlockIndexDump, ARanksTiersComeBackWithTheirEngineHashesAndLocalHashes) {
  BlockIndex idx;
  const WorkerKey host = TierRank(kW1, StorageTier::kHostPinned);
  const WorkerKey disk = TierRank(kW1, StorageTier::kDisk);
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2, 3}));  // mapped: engine ids
  (void)idx.ApplyStored(host, 102, Chain(200, {4, 5}));             // offloaded below a device block
  (void)idx.ApplyStored(disk, std::nullopt, Chain(300, {7}));
  (void)idx.ApplyStored(kW2, std::nullopt, CanonicalChain({1, 2}));  // another rank: not dumped
  std::vector<DumpedChain> chains;
  idx.DumpRank(kW1, chains);
  const std::vector<DumpedChain> want = {
      {StorageTier::kDevice, KvStored{std::nullopt, Chain(100, {1, 2, 3})}},
      {StorageTier::kHostPinned, KvStored{102, Chain(200, {4, 5})}},
      {StorageTier::kDisk, KvStored{std::nullopt, Chain(300, {7})}},
  };
  EXPECT_EQ(chains, want);

  BlockIndex copy;
  CopyByDump(idx, copy);
  EXPECT_EQ(Matches(copy, {1, 2, 3, 4, 5}), Matches(idx, {1, 2, 3, 4, 5}));
  EXPECT_EQ(copy.TreeSize(host), 2u);
  EXPECT_EQ(copy.TreeSize(disk), 1u);
  EXPECT_EQ(copy.TreeSize(kW2), 2u);
}

// A block stored under a parent the rank holds on a later tier only (host, then disk) comes
// after that parent, whatever the tiers' order.
TEST(BlockIndexDump, AChainBelowABlockOnALaterTierComesAfterIt) {
  BlockIndex idx;
  const WorkerKey host = TierRank(kW1, StorageTier::kHostPinned);
  const WorkerKey disk = TierRank(kW1, StorageTier::kDisk);
  (void)idx.ApplyStored(disk, std::nullopt, Chain(300, {1}));
  (void)idx.ApplyStored(host, 300, Chain(200, {2}));
  (void)idx.ApplyStored(kW1, 200, Chain(100, {3, 4}));
  ASSERT_EQ(idx.TreeSize(kW1), 2u);
  std::vector<DumpedChain> chains;
  idx.DumpRank(kW1, chains);
  const std::vector<DumpedChain> want = {
      {StorageTier::kDisk, KvStored{std::nullopt, Chain(300, {1})}},
      {StorageTier::kHostPinned, KvStored{300, Chain(200, {2})}},
      {StorageTier::kDevice, KvStored{200, Chain(100, {3, 4})}},
  };
  EXPECT_EQ(chains, want);
  BlockIndex copy;
  CopyByDump(idx, copy);
  EXPECT_EQ(copy.TreeSize(kW1), 2u);
  EXPECT_EQ(copy.TreeSize(host), 1u);
  EXPECT_EQ(copy.TreeSize(disk), 1u);
}

TEST(BlockIndexDump, ABlockWhoseParentWasRemovedIsLeftOutWithItsChildren) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2, 3, 4}));
  (void)idx.ApplyRemoved(kW1, std::vector<BlockHash>{101});
  std::vector<DumpedChain> chains;
  idx.DumpRank(kW1, chains);
  ASSERT_EQ(chains.size(), 1u);
  EXPECT_EQ(chains[0].stored, (KvStored{std::nullopt, Chain(100, {1})}));
}

TEST(BlockIndexDump, ASecondEngineHashOfABlockComesBackAsItsOwnChain) {
  BlockIndex idx;
  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));
  (void)idx.ApplyStored(kW1, 100, Chain(500, {2}));  // block 101's prefix again, under 500
  std::vector<DumpedChain> chains;
  idx.DumpRank(kW1, chains);
  BlockIndex copy;
  CopyByDump(idx, copy);
  EXPECT_EQ(copy.TreeSize(kW1), 3u);
  (void)copy.ApplyRemoved(kW1, std::vector<BlockHash>{101});
  EXPECT_EQ(Matches(copy, {1, 2}).at(kW1), 2u);  // still held under 500
}

}  // namespace
}  // namespace kvrouter
