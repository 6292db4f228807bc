#include "events/block_hash.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvrouter {
namespace {

// Golden vectors of docs/protocol.md section 1 (block_size 4).
TEST(BlockHash, LocalHashesMatchGoldenVectors) {
  std::vector<std::uint32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  auto local = ComputeLocalHashes(tokens, 4);
  ASSERT_EQ(local.size(), 3u);
  EXPECT_EQ(local[0], 14643705804678351452ull);
  EXPECT_EQ(local[1], 16777012769546811212ull);
  EXPECT_EQ(local[2], 483935686894639516ull);
}

TEST(BlockHash, SequenceHashesMatchGoldenVectors) {
  std::vector<std::uint32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  auto seq = ComputeSequenceHashes(ComputeLocalHashes(tokens, 4));
  ASSERT_EQ(seq.size(), 3u);
  EXPECT_EQ(seq[0], 14643705804678351452ull);
  EXPECT_EQ(seq[1], 4945711292740353085ull);
  EXPECT_EQ(seq[2], 12583592247330656132ull);
}

TEST(BlockHash, LoraNameChangesTheSeed) {
  EXPECT_EQ(LoraSeed("my-adapter"), 1337ull + 2360313164392601971ull);
  std::vector<std::uint32_t> tokens = {1, 2, 3, 4};
  auto local = ComputeLocalHashes(tokens, 4, "my-adapter");
  ASSERT_EQ(local.size(), 1u);
  EXPECT_EQ(local[0], 15633847640104431966ull);
}

TEST(BlockHash, TrailingPartialBlockIsNotHashed) {
  std::vector<std::uint32_t> tokens = {1, 2, 3, 4, 5, 6};
  EXPECT_EQ(ComputeLocalHashes(tokens, 4).size(), 1u);
  EXPECT_TRUE(ComputeLocalHashes(std::vector<std::uint32_t>{1, 2, 3}, 4).empty());
  EXPECT_TRUE(ComputeLocalHashes(tokens, 0).empty());
}

TEST(BlockHash, EmptyLoraNameKeepsDefaultSeed) { EXPECT_EQ(LoraSeed(""), kBlockHashSeed); }

}  // namespace
}  // namespace kvrouter
