#include "events/block_hash.h"

#include <gtest/gtest.h>

#include <string>

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

// docs/protocol.md section 12's golden vectors (block_size 4, tokens [1,2,3,4], no LoRA).
TEST(BlockHash, MultimodalItemsMatchGoldenVectors) {
  const std::vector<std::uint32_t> tokens = {1, 2, 3, 4};
  const std::uint64_t seed = LoraSeed("");
  EXPECT_EQ(HashBlockWithItems(tokens, {}, seed), 14643705804678351452ull);
  const std::uint64_t one[] = {0x0123456789abcdefull};
  EXPECT_EQ(HashBlockWithItems(tokens, one, seed), 2142804768136187117ull);
  const std::uint64_t two[] = {0xfedcba9876543210ull, 0x0123456789abcdefull};  // sorted before hashing
  EXPECT_EQ(HashBlockWithItems(tokens, two, seed), 2696063630716342798ull);
  const std::uint64_t repeated[] = {0x0123456789abcdefull, 0xfedcba9876543210ull, 0x0123456789abcdefull};
  EXPECT_EQ(HashBlockWithItems(tokens, repeated, seed), 2696063630716342798ull);  // distinct hashes
  EXPECT_EQ(MmItemHash(std::string(64, 'a')), 12297829382473034410ull);
  EXPECT_EQ(MmItemHash("img-42"), 12830648656646803821ull);
}

TEST(BlockHash, AnItemBelongsToEveryBlockItsRangeOverlaps) {
  const std::vector<std::uint32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const auto plain = ComputeLocalHashes(tokens, 4);
  // Positions 3..5: the first two blocks, not the third.
  const MmItem item{.hash = 42, .offset = 3, .length = 3};
  const auto with = ComputeLocalHashes(tokens, 4, "", std::span<const MmItem>(&item, 1));
  ASSERT_EQ(with.size(), 3u);
  const std::uint64_t h[] = {42};
  EXPECT_EQ(with[0], HashBlockWithItems(std::span(tokens).subspan(0, 4), h, kBlockHashSeed));
  EXPECT_EQ(with[1], HashBlockWithItems(std::span(tokens).subspan(4, 4), h, kBlockHashSeed));
  EXPECT_NE(with[0], plain[0]);
  EXPECT_EQ(with[2], plain[2]);
  // Another image at the same place: other hashes; none at all: the plain ones.
  const MmItem other{.hash = 43, .offset = 3, .length = 3};
  EXPECT_NE(ComputeLocalHashes(tokens, 4, "", std::span<const MmItem>(&other, 1))[0], with[0]);
  EXPECT_EQ(ComputeLocalHashes(tokens, 4, "", std::span<const MmItem>()), plain);
  // An item past the full blocks, or empty, changes nothing.
  const MmItem past[] = {{.hash = 9, .offset = 12, .length = 4}, {.hash = 9, .offset = 0, .length = 0}};
  EXPECT_EQ(ComputeLocalHashes(tokens, 4, "", past), plain);
}

TEST(BlockHash, EmptyLoraNameKeepsDefaultSeed) { EXPECT_EQ(LoraSeed(""), kBlockHashSeed); }

}  // namespace
}  // namespace kvrouter
