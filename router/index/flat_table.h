// FlatTable: a compact open-addressing hash table (linear probing, backward-shift deletion, no
// tombstones) mapping a key to a u32 value, used for the index's child links and per-worker
// block maps where std::unordered_map's heap node per entry would dominate memory.
//
// Entry layout is given by a Traits type:
//   struct Traits { using Key = ...; struct Entry {...};
//                   Key KeyOf(const Entry&) const; void Set(Entry&, const Key&, uint32_t) const;
//                   uint64_t Hash(const Key&) const; };
// (static members, or members of a traits object given to the constructor: an entry may then
// hold only the value and find its key elsewhere, as approximate mode's table does).
// An entry whose `value` is kFlatEmpty is a free slot, so kFlatEmpty cannot be stored.
// Readable while its owner writes, when Traits also has `static Entry Load(const Entry&)` and
// `static void Store(Entry&, const Entry&)` made of atomic word accesses (see router/index/read_gate.h)
// and DeferFrees(true) is set: Snapshot() gives a reader the slot array of the moment (array and
// size published together), a rehash's old array is kept until FreeRetired(), and a reader's
// probe is bounded. Such a reader may miss a key being moved by a deletion or see an entry
// being written; it must check what it finds (the index checks the node's own hash).
// Thread contract: one owner thread writes; other threads only through Snapshot(), as above.
//
//   FlatTable<U64MapTraits> m;   m.Insert(block_hash, node);  uint32_t n = m.Find(block_hash);
#pragma once

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "router/index/large_array.h"
#include "router/index/read_gate.h"

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

// Starts loading the cache line at p. On x86 an explicit instruction: GCC 12 drops
// __builtin_prefetch when the address comes from a loaded pointer and a hash (every prefetch
// of this table's probes vanished from the binary).
inline void PrefetchLine(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
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
    st_ = std::move(o.st_);
    published_ = std::exchange(o.published_, nullptr);
    size_ = std::exchange(o.size_, 0);
    defer_frees_ = o.defer_frees_;
    shrink_on_erase_ = o.shrink_on_erase_;
    retired_ = std::move(o.retired_);
    return *this;
  }
  FlatTable(const FlatTable&) = delete;
  FlatTable& operator=(const FlatTable&) = delete;

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::size_t capacity() const { return st_ ? st_->mask + 1 : 0; }
  std::size_t memory_bytes() const { return capacity() * sizeof(Entry); }

  // The value for key, or kFlatEmpty. The owner's lookup: no deletion runs meanwhile, so a
  // miss needs no second look (View::Find).
  std::uint32_t Find(const Key& key) const { return Snapshot().Probe(key); }

  // Starts loading the cache line where key's probe begins (no effect on contents).
  void Prefetch(const Key& key) const { Snapshot().Prefetch(key); }

  // The table as it is now, for lookups from any thread while the owner writes (see the header
  // comment); valid until the owner's FreeRetired().
  class View {
   public:
    std::uint32_t Find(const Key& key) const {
      // A deletion moves later entries of a probe run back, and a probe it overtakes misses one
      // that is there: a miss counts only if no deletion ran meanwhile (a few tries).
      for (int attempt = 0;; ++attempt) {
        const std::uint32_t e0 = AcquireLoad(*erasing_);
        const std::uint32_t v = Probe(key);
        if (v != kFlatEmpty) return v;
        std::atomic_thread_fence(std::memory_order_acquire);
        const std::uint32_t e1 = RelaxedLoad(*erasing_);
        if (((e0 & 1) == 0 && e0 == e1) || attempt == 3) return v;
      }
    }
    void Prefetch(const Key& key) const {
      if (slots_ != nullptr) PrefetchLine(&slots_[traits_->Hash(key) & mask_]);
    }

   private:
    friend class FlatTable;
    std::uint32_t Probe(const Key& key) const {
      if (slots_ == nullptr) return kFlatEmpty;
      std::size_t i = traits_->Hash(key) & mask_;
      for (std::size_t probes = 0; probes <= mask_; ++probes, i = (i + 1) & mask_) {
        const Entry e = Load(slots_[i]);
        if (e.value == kFlatEmpty) return kFlatEmpty;
        if (traits_->KeyOf(e) == key) return e.value;
      }
      return kFlatEmpty;
    }

    const std::uint32_t* erasing_ = nullptr;
    const Traits* traits_ = nullptr;
    const Entry* slots_ = nullptr;
    std::size_t mask_ = 0;
  };
  View Snapshot() const {
    View v;
    v.traits_ = &traits_;
    v.erasing_ = &erasing_;
    if (const Storage* st = AcquireLoad(published_)) {
      v.slots_ = &st->slots[0];
      v.mask_ = st->mask;
    }
    return v;
  }

  // Inserts or overwrites. Returns the previous value, or kFlatEmpty if the key was new.
  std::uint32_t Insert(const Key& key, std::uint32_t value) { return Put(key, value, /*overwrite=*/true); }
  // Inserts unless the key is there. Returns the value there (left as it is), or kFlatEmpty if
  // the key was new.
  std::uint32_t InsertNew(const Key& key, std::uint32_t value) { return Put(key, value, /*overwrite=*/false); }

  // Removes key. Returns its value, or kFlatEmpty if it was absent.
  std::uint32_t Erase(const Key& key) {
    if (size_ == 0) return kFlatEmpty;
    const std::size_t mask = st_->mask;
    LargeArray<Entry>& slots = st_->slots;
    std::size_t i = traits_.Hash(key) & mask;
    for (;; i = (i + 1) & mask) {
      if (slots[i].value == kFlatEmpty) return kFlatEmpty;
      if (traits_.KeyOf(slots[i]) == key) break;
    }
    const std::uint32_t old = slots[i].value;
    // Backward-shift: pull later members of the probe run into the hole. Readers see the count
    // odd meanwhile (View::Find).
    RelaxedStore(erasing_, erasing_ + 1);
    std::atomic_thread_fence(std::memory_order_release);
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask; slots[j].value != kFlatEmpty; j = (j + 1) & mask) {
      const std::size_t home = traits_.Hash(traits_.KeyOf(slots[j])) & mask;
      // Move j into the hole unless its home lies cyclically in (hole, j].
      const bool home_after_hole = ((j - home) & mask) < ((j - hole) & mask);
      if (!home_after_hole) {
        Store(slots[hole], slots[j]);
        hole = j;
      }
    }
    RelaxedStore(slots[hole].value, kFlatEmpty);
    ReleaseStore(erasing_, erasing_ + 1);
    --size_;
    if (shrink_on_erase_ && Underfull()) Rehash(capacity() / 2);  // give memory back
    return old;
  }

  // Under an eighth full: a table that shrinks on erase halves here.
  bool Underfull() const { return capacity() > 8 && size_ * 8 < capacity(); }
  // Off: Erase keeps the capacity, and the owner gives memory back with ShrinkToFit when the
  // table has stayed small (a table emptied and refilled at once then never rehashes).
  void ShrinkOnErase(bool on) { shrink_on_erase_ = on; }
  // To the smallest capacity (at least 8) that leaves the table at most half full; nothing left
  // when empty.
  void ShrinkToFit() {
    if (size_ == 0) {
      Clear();
      return;
    }
    std::size_t fit = 8;
    while (fit < 2 * size_) fit *= 2;
    if (fit < capacity()) Rehash(fit);
  }

  void Clear() {
    Retire(std::move(st_));
    ReleaseStore(published_, nullptr);
    size_ = 0;
  }
  // Empty, keeping the capacity: a table refilled at once then never rehashes. Only for a table
  // no reader reads (its slots are overwritten in place).
  void ClearKeepingCapacity() {
    for (std::size_t i = 0; i < capacity(); ++i) st_->slots[i].value = kFlatEmpty;
    size_ = 0;
  }

  template <typename F>  // f(const Entry&)
  void ForEach(F&& f) const {
    for (std::size_t i = 0; i < capacity(); ++i) {
      if (st_->slots[i].value != kFlatEmpty) f(st_->slots[i]);
    }
  }

  // Readers may look up while the owner writes: replaced arrays are kept until FreeRetired.
  void DeferFrees(bool on) { defer_frees_ = on; }
  bool HasRetired() const { return !retired_.empty(); }
  void FreeRetired() { retired_.clear(); }

 private:
  std::uint32_t Put(const Key& key, std::uint32_t value, bool overwrite) {
    if ((size_ + 1) * 4 > capacity() * 3) Rehash(capacity() == 0 ? 8 : capacity() * 2);
    const std::size_t mask = st_->mask;
    for (std::size_t i = traits_.Hash(key) & mask;; i = (i + 1) & mask) {
      Entry& e = st_->slots[i];
      if (e.value == kFlatEmpty) {
        Entry n;
        traits_.Set(n, key, value);
        Store(e, n);
        ++size_;
        return kFlatEmpty;
      }
      if (traits_.KeyOf(e) == key) {
        const std::uint32_t old = e.value;
        if (overwrite) RelaxedStore(e.value, value);
        return old;
      }
    }
  }

  struct Storage {
    LargeArray<Entry> slots;
    std::size_t mask = 0;  // capacity - 1 (a power of two)
  };

  static Entry Load(const Entry& e) {
    if constexpr (requires { Traits::Load(e); }) {
      return Traits::Load(e);
    } else {
      return e;
    }
  }
  static void Store(Entry& to, const Entry& from) {
    if constexpr (requires { Traits::Store(to, from); }) {
      Traits::Store(to, from);
    } else {
      to = from;
    }
  }

  void Retire(std::unique_ptr<Storage> st) {
    if (st != nullptr && defer_frees_) retired_.push_back(std::move(st));
  }

  void Rehash(std::size_t new_capacity) {
    auto fresh = std::make_unique<Storage>();
    fresh->slots = LargeArray<Entry>(new_capacity);
    fresh->mask = new_capacity - 1;
    LargeArray<Entry>& slots = fresh->slots;
    for (std::size_t i = 0; i < new_capacity; ++i) slots[i].value = kFlatEmpty;
    const std::size_t mask = fresh->mask;
    for (std::size_t k = 0; k < capacity(); ++k) {
      const Entry& e = st_->slots[k];
      if (e.value == kFlatEmpty) continue;
      std::size_t i = traits_.Hash(traits_.KeyOf(e)) & mask;
      while (slots[i].value != kFlatEmpty) i = (i + 1) & mask;
      slots[i] = e;
    }
    ReleaseStore(published_, fresh.get());  // filled before readers can see it
    Retire(std::exchange(st_, std::move(fresh)));
  }

  [[no_unique_address]] Traits traits_{};
  std::unique_ptr<Storage> st_;   // the slot array (huge pages when large); null when empty
  Storage* published_ = nullptr;  // st_.get(), for readers (atomic accesses)
  std::size_t size_ = 0;
  std::uint32_t erasing_ = 0;  // odd while Erase moves entries (atomic accesses)
  bool defer_frees_ = false;
  bool shrink_on_erase_ = true;
  std::vector<std::unique_ptr<Storage>> retired_;
};

}  // namespace kvrouter
