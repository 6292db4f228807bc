#include "router/flat_table.h"

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

TEST(FlatTable, ShrinksWhenEmptied) {
  FlatTable<U64Traits> t;
  for (std::uint64_t k = 0; k < 10000; ++k) (void)t.Insert(k, 1);
  const std::size_t full = t.memory_bytes();
  for (std::uint64_t k = 0; k < 10000; ++k) (void)t.Erase(k);
  EXPECT_TRUE(t.empty());
  EXPECT_LT(t.memory_bytes() * 100, full);
}

}  // namespace
}  // namespace kvrouter
