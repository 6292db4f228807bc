#include "router/index/flat_table.h"

#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

namespace kvrouter {
namespace {

struct U64Traits {
  using Key = std::uint64_t;
  struct Entry {
    std::uint64_t key;
    std::uint32_t value;
  };
  static Key KeyOf(const Entry& e) { return e.key; }
  static void Set(Entry& e, Key k, std::uint32_t v) { e = {k, v}; }
  // A deliberately poor hash so probe runs collide and wrap around.
  static std::uint64_t Hash(Key k) { return k % 7; }
};

TEST(FlatTable, BehavesLikeAMapUnderRandomInsertAndErase) {
  FlatTable<U64Traits> t;
  std::unordered_map<std::uint64_t, std::uint32_t> ref;
  std::mt19937_64 rng(42);
  for (int i = 0; i < 200000; ++i) {
    const std::uint64_t k = rng() % 512;
    if (rng() % 3 == 0) {
      const std::uint32_t got = t.Erase(k);
      auto it = ref.find(k);
      ASSERT_EQ(got, it == ref.end() ? kFlatEmpty : it->second);
      if (it != ref.end()) ref.erase(it);
    } else {
      const auto v = static_cast<std::uint32_t>(rng() % 1000);
      const std::uint32_t prev = t.Insert(k, v);
      auto it = ref.find(k);
      ASSERT_EQ(prev, it == ref.end() ? kFlatEmpty : it->second);
      ref[k] = v;
    }
    ASSERT_EQ(t.size(), ref.size());
  }
  for (std::uint64_t k = 0; k < 512; ++k) {
    auto it = ref.find(k);
    EXPECT_EQ(t.Find(k), it == ref.end() ? kFlatEmpty : it->second) << k;
  }
  std::size_t visited = 0;
  t.ForEach([&](const U64Traits::Entry& e) {
    ++visited;
    EXPECT_EQ(ref.at(e.key), e.value);
  });
  EXPECT_EQ(visited, ref.size());
}

TEST(FlatTable, InsertOverwritesAndInsertNewKeepsWhatIsThere) {
  FlatTable<U64Traits> t;
  EXPECT_EQ(t.InsertNew(5, 1), kFlatEmpty);
  EXPECT_EQ(t.InsertNew(5, 2), 1u);
  EXPECT_EQ(t.Find(5), 1u);
  EXPECT_EQ(t.Insert(5, 3), 1u);
  EXPECT_EQ(t.Find(5), 3u);
  EXPECT_EQ(t.size(), 1u);
}

TEST(FlatTable, ShrinksWhenEmptied) {
  FlatTable<U64Traits> t;
  for (std::uint64_t k = 0; k < 10000; ++k) (void)t.Insert(k, 1);
  const std::size_t full = t.memory_bytes();
  for (std::uint64_t k = 0; k < 10000; ++k) (void)t.Erase(k);
  EXPECT_TRUE(t.empty());
  EXPECT_LT(t.memory_bytes() * 100, full);
}

// Without shrinking on erase, an emptied table keeps its capacity (refilled, it does not grow
// again step by step) until ShrinkToFit, which leaves it at most half full.
TEST(FlatTable, KeepsItsCapacityUntilShrinkToFitWhenNotShrinkingOnErase) {
  FlatTable<U64Traits> t;
  t.ShrinkOnErase(false);
  for (std::uint64_t k = 0; k < 10000; ++k) (void)t.Insert(k, 1);
  const std::size_t full = t.capacity();
  for (std::uint64_t k = 0; k < 9990; ++k) (void)t.Erase(k);
  EXPECT_EQ(t.capacity(), full);
  EXPECT_TRUE(t.Underfull());
  t.ShrinkToFit();
  EXPECT_EQ(t.capacity(), 32u);  // 10 keys: the smallest power of two at least twice that
  EXPECT_FALSE(t.Underfull());
  for (std::uint64_t k = 9990; k < 10000; ++k) EXPECT_EQ(t.Find(k), 1u);
  for (std::uint64_t k = 9990; k < 10000; ++k) (void)t.Erase(k);
  t.ShrinkToFit();
  EXPECT_EQ(t.memory_bytes(), 0u);
}

// With readers (DeferFrees), a shrink keeps the old slots for a reader that still holds them
// until FreeRetired; the same for an emptied table's ShrinkToFit, which drops the slots.
TEST(FlatTable, ShrinkToFitKeepsTheSlotsAReaderHoldsUntilFreeRetired) {
  FlatTable<U64Traits> t;
  t.DeferFrees(true);
  t.ShrinkOnErase(false);
  for (std::uint64_t k = 0; k < 1000; ++k) (void)t.Insert(k, 7);
  for (std::uint64_t k = 10; k < 1000; ++k) (void)t.Erase(k);
  const auto before = t.Snapshot();
  t.ShrinkToFit();
  EXPECT_TRUE(t.HasRetired());
  EXPECT_EQ(before.Find(3), 7u);  // the reader's slots are still there
  EXPECT_EQ(t.Find(3), 7u);
  t.FreeRetired();
  EXPECT_FALSE(t.HasRetired());
  for (std::uint64_t k = 0; k < 10; ++k) (void)t.Erase(k);
  const auto last = t.Snapshot();
  t.ShrinkToFit();
  EXPECT_EQ(t.memory_bytes(), 0u);
  EXPECT_TRUE(t.HasRetired());
  EXPECT_EQ(last.Find(3), kFlatEmpty);  // readable (and empty) until FreeRetired
  EXPECT_EQ(t.Find(3), kFlatEmpty);
  t.FreeRetired();
}

// Past 2 MiB the table lives on its own huge-page mapping (LargeArray); it must behave the same
// on the way up and back down.
TEST(FlatTable, KeepsEveryKeyAcrossTheMoveToAndFromItsOwnMapping) {
  struct MixTraits : U64Traits {
    static std::uint64_t Hash(Key k) { return Mix64(k); }
  };
  FlatTable<MixTraits> t;
  constexpr std::uint64_t kKeys = 400000;  // 16-byte entries: 8 MiB of slots at this size
  for (std::uint64_t k = 0; k < kKeys; ++k) ASSERT_EQ(t.Insert(k * 977, static_cast<std::uint32_t>(k)), kFlatEmpty);
  EXPECT_GE(t.memory_bytes(), kHugePageBytes);
  for (std::uint64_t k = 0; k < kKeys; ++k) ASSERT_EQ(t.Find(k * 977), k);
  for (std::uint64_t k = 0; k < kKeys; k += 2) ASSERT_EQ(t.Erase(k * 977), k);
  for (std::uint64_t k = 0; k < kKeys; ++k) ASSERT_EQ(t.Find(k * 977), k % 2 ? k : kFlatEmpty);
  for (std::uint64_t k = 1; k < kKeys; k += 2) ASSERT_EQ(t.Erase(k * 977), k);
  EXPECT_TRUE(t.empty());
  EXPECT_LT(t.memory_bytes(), kHugePageBytes);
}

struct Seven {
  std::uint32_t v = 7;
};

TEST(LargeArray, SmallArraysComeFromMallocLargeOnesFromAnAlignedMapping) {
  LargeArray<Seven> small(1000);
  EXPECT_FALSE(small.huge());
  LargeArray<Seven> big(kHugePageBytes / sizeof(Seven) * 2 + 3);  // two huge pages and a bit
  EXPECT_TRUE(big.huge());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(&big[0]) % kHugePageBytes, 0u);
  for (const auto* a : {&small, &big}) {
    bool all_seven = true;
    for (std::size_t i = 0; i < a->size(); ++i) all_seven &= (*a)[i].v == 7;
    EXPECT_TRUE(all_seven);  // member initialisers ran for every element
  }
  big[big.size() - 1].v = 9;  // the last element is inside the mapping
  EXPECT_EQ(big[big.size() - 1].v, 9u);
}

TEST(LargeArray, MovesOwnershipAndFreesOnce) {
  const std::size_t mapped0 = large_array_mapped_bytes.load();
  LargeArray<Seven> a(kHugePageBytes / sizeof(Seven));
  EXPECT_EQ(large_array_mapped_bytes.load(), mapped0 + kHugePageBytes);
  Seven* data = &a[0];
  LargeArray<Seven> b(std::move(a));
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(&b[0], data);
  EXPECT_TRUE(b.huge());
  LargeArray<Seven> c(10);
  c = std::move(b);  // frees c's small array, takes b's mapping
  EXPECT_EQ(&c[0], data);
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(large_array_mapped_bytes.load(), mapped0 + kHugePageBytes);  // one mapping, moved twice
  c.reset();
  EXPECT_EQ(large_array_mapped_bytes.load(), mapped0);
  EXPECT_EQ(c.size(), 0u);
  EXPECT_FALSE(c.huge());
}

}  // namespace
}  // namespace kvrouter
