// FlatTable: a compact open-addressing hash table (linear probing, backward-shift deletion, no
// tombstones) mapping a key to a u32 value, used for the index's child links and per-worker
// block maps where std::unordered_map's ~50 bytes per entry would dominate memory.
//
// Entry layout is given by a Traits type:
//   struct Traits { using Key = ...; struct Entry {...};
//                   Key KeyOf(const Entry&) const; void Set(Entry&, const Key&, uint32_t) const;
//                   uint64_t Hash(const Key&) const; };
// (static members, or members of a traits object given to the constructor: an entry may then
// hold only the value and find its key elsewhere, as approximate mode's table does).
// An entry whose `value` is kFlatEmpty is a free slot, so kFlatEmpty cannot be stored.
// Not thread-safe: owned by one shard thread (readers hold the shard's shared lock).
//
//   FlatTable<U64MapTraits> m;   m.Insert(block_hash, node);  uint32_t n = m.Find(block_hash);
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "router/large_array.h"

namespace kvrouter {

inline constexpr std::uint32_t kFlatEmpty = 0xffffffffu;

// MurmurHash3's 64-bit finaliser: engine block ids may be small sequential integers.
inline std::uint64_t Mix64(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

template <typename Traits>
class FlatTable {
 public:
  using Key = typename Traits::Key;
  using Entry = typename Traits::Entry;

  FlatTable() = default;
  explicit FlatTable(Traits traits) : traits_(traits) {}
  FlatTable(FlatTable&& o) noexcept { *this = std::move(o); }
  FlatTable& operator=(FlatTable&& o) noexcept {
    traits_ = o.traits_;
    slots_ = std::move(o.slots_);
    capacity_ = std::exchange(o.capacity_, 0);
    size_ = std::exchange(o.size_, 0);
    return *this;
  }
  FlatTable(const FlatTable&) = delete;
  FlatTable& operator=(const FlatTable&) = delete;

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::size_t memory_bytes() const { return capacity_ * sizeof(Entry); }

  // The value for key, or kFlatEmpty.
  std::uint32_t Find(const Key& key) const {
    if (size_ == 0) return kFlatEmpty;
    const std::size_t mask = capacity_ - 1;
    for (std::size_t i = traits_.Hash(key) & mask;; i = (i + 1) & mask) {
      const Entry& e = slots_[i];
      if (e.value == kFlatEmpty) return kFlatEmpty;
      if (traits_.KeyOf(e) == key) return e.value;
    }
  }

  // Starts loading the cache line where key's probe begins (no effect on contents).
  void Prefetch(const Key& key) const {
    if (capacity_ != 0) __builtin_prefetch(&slots_[traits_.Hash(key) & (capacity_ - 1)]);
  }

  // Inserts or overwrites. Returns the previous value, or kFlatEmpty if the key was new.
  std::uint32_t Insert(const Key& key, std::uint32_t value) {
    if ((size_ + 1) * 4 > capacity_ * 3) Rehash(capacity_ == 0 ? 8 : capacity_ * 2);
    const std::size_t mask = capacity_ - 1;
    for (std::size_t i = traits_.Hash(key) & mask;; i = (i + 1) & mask) {
      Entry& e = slots_[i];
      if (e.value == kFlatEmpty) {
        traits_.Set(e, key, value);
        ++size_;
        return kFlatEmpty;
      }
      if (traits_.KeyOf(e) == key) return std::exchange(e.value, value);
    }
  }

  // Removes key. Returns its value, or kFlatEmpty if it was absent.
  std::uint32_t Erase(const Key& key) {
    if (size_ == 0) return kFlatEmpty;
    const std::size_t mask = capacity_ - 1;
    std::size_t i = traits_.Hash(key) & mask;
    for (;; i = (i + 1) & mask) {
      if (slots_[i].value == kFlatEmpty) return kFlatEmpty;
      if (traits_.KeyOf(slots_[i]) == key) break;
    }
    const std::uint32_t old = slots_[i].value;
    // Backward-shift: pull later members of the probe run into the hole.
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask; slots_[j].value != kFlatEmpty; j = (j + 1) & mask) {
      const std::size_t home = traits_.Hash(traits_.KeyOf(slots_[j])) & mask;
      // Move j into the hole unless its home lies cyclically in (hole, j].
      const bool home_after_hole = ((j - home) & mask) < ((j - hole) & mask);
      if (!home_after_hole) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].value = kFlatEmpty;
    --size_;
    if (capacity_ > 8 && size_ * 8 < capacity_) Rehash(capacity_ / 2);  // give memory back
    return old;
  }

  void Clear() {
    slots_.reset();
    capacity_ = 0;
    size_ = 0;
  }

  template <typename F>  // f(const Entry&)
  void ForEach(F&& f) const {
    for (std::size_t i = 0; i < capacity_; ++i) {
      if (slots_[i].value != kFlatEmpty) f(slots_[i]);
    }
  }

 private:
  void Rehash(std::size_t new_capacity) {
    LargeArray<Entry> old = std::move(slots_);
    const std::size_t old_capacity = capacity_;
    slots_ = LargeArray<Entry>(new_capacity);
    for (std::size_t i = 0; i < new_capacity; ++i) slots_[i].value = kFlatEmpty;
    capacity_ = new_capacity;
    const std::size_t mask = capacity_ - 1;
    for (std::size_t k = 0; k < old_capacity; ++k) {
      if (old[k].value == kFlatEmpty) continue;
      std::size_t i = traits_.Hash(traits_.KeyOf(old[k])) & mask;
      while (slots_[i].value != kFlatEmpty) i = (i + 1) & mask;
      slots_[i] = old[k];
    }
  }

  [[no_unique_address]] Traits traits_{};
  LargeArray<Entry> slots_;  // huge pages when large (the index's sequence-hash table)
  std::size_t capacity_ = 0;  // 0 or a power of two
  std::size_t size_ = 0;
};

}  // namespace kvrouter
