// HolderSet: the sorted set of worker slots that hold one index node, 16 bytes with room for
// two holders inline (most nodes of an unshared cache have one), growing onto the heap by
// doubling (terms: docs/design.md "Glossary"). It owns a raw heap pointer and frees it only in
// Release() (nodes are recycled, not destroyed), so it cannot be copied: a copy would free the
// same memory twice.
//
// Readable while its owner writes (ReadView; see router/index/read_gate.h), and then a reader always
// sees one whole version of the set, old or new: the set is one word, either both inline slots
// (bit 0 set: slot 0 in bits 1-31, slot 1 in bits 32-63, an absent slot all ones) or a pointer
// to a heap buffer [capacity, size, slots...]. With readers (HolderHeap::retired set) a heap
// buffer is never changed once published: a change writes a new one and publishes it in one
// store, and the old one waits in `retired` until no reader can hold it. Without readers
// changes are made in place. Slots must be at most kMaxSlot.
// A heap buffer of kStampedCapacity slots or more (a block that a crowd of workers holds, such
// as a fleet's shared system prompt) also carries a stamp after its slots: a number no other
// version of any set in the process carries (every change to such a set, in place or into a new
// buffer, takes a new one; HolderHeap::next_stamp says how far that holds). A reader that kept
// the slots of a stamp knows them again by it, without reading them (MatchRuns' elided runs).
// Thread contract: one writer (the shard thread that owns the node); readers only through
// ReadView/ReadSize, under a ReadGate.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <span>
#include <vector>

#include "router/index/read_gate.h"

namespace kvrouter {

// The heap behind a tree's holder sets: bytes in use, and where replaced buffers wait while
// readers may still be reading them (null: no readers, buffers change in place and are freed
// at once).
struct HolderHeap {
  std::size_t bytes = 0;
  std::vector<void*>* retired = nullptr;
  // The next stamp (HolderSet): each heap counts from its own multiple of 2^40, so stamps are
  // unique in the process for its first 2^24 - 1 heaps, each making up to 2^40 changes to sets
  // in buffers of kStampedCapacity slots or more (past that they may repeat: a reader trusting
  // one then reads a crowd's slots again, below).
  std::uint64_t next_stamp = NewStampBase();

  static std::uint64_t NewStampBase() {
    static std::atomic<std::uint64_t> heaps{0};
    return (heaps.fetch_add(1, std::memory_order_relaxed) + 1) << 40;
  }

  bool readers() const { return retired != nullptr; }
  void Free(void* p) {
    if (retired != nullptr) {
      retired->push_back(p);
    } else {
      std::free(p);
    }
  }
};

class HolderSet {
 public:
  static constexpr std::uint32_t kMaxSlot = (1u << 31) - 2;  // 2^31 - 1 marks an absent slot 0
  static constexpr std::uint32_t kStampedCapacity = 64;

  HolderSet() = default;
  HolderSet(const HolderSet&) = delete;
  HolderSet& operator=(const HolderSet&) = delete;

  std::uint32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  bool Contains(std::uint32_t slot) const {
    if (is_inline()) return Slot0(word_) == slot || Slot1(word_) == slot;
    const std::uint32_t* d = heap_buffer() + kHeader;
    return std::binary_search(d, d + size_, slot);
  }

  // Adds slot (<= kMaxSlot); false when it was already there.
  bool Insert(std::uint32_t slot, HolderHeap& heap) {
    if (Contains(slot)) return false;
    const std::uint32_t n = size_;
    if (is_inline()) {
      const std::uint32_t a = Slot0(word_);
      if (n == 0) {
        RelaxedStore(word_, Inline(slot, kAbsent));
      } else if (n == 1) {
        RelaxedStore(word_, Inline(std::min(a, slot), std::max(a, slot)));
      } else {
        std::uint32_t* buf = Allocate(4, 3, heap);  // unpublished until the word below
        buf[kHeader] = a;
        buf[kHeader + 1] = Slot1(word_);
        buf[kHeader + 2] = slot;
        std::sort(buf + kHeader, buf + kHeader + 3);
        ReleaseStore(word_, reinterpret_cast<std::uintptr_t>(buf));
      }
      RelaxedStore(size_, n + 1);
      return true;
    }
    std::uint32_t* old = heap_buffer();
    const std::uint32_t* d = old + kHeader;
    const std::size_t idx = static_cast<std::size_t>(std::lower_bound(d, d + n, slot) - d);
    const std::uint32_t cap = old[0];
    if (n == cap || heap.readers()) {  // a new buffer (readers may be reading this one)
      std::uint32_t* buf = Allocate(n == cap ? 2 * cap : cap, n + 1, heap);
      std::memcpy(buf + kHeader, d, idx * sizeof(std::uint32_t));
      buf[kHeader + idx] = slot;
      std::memcpy(buf + kHeader + idx + 1, d + idx, (n - idx) * sizeof(std::uint32_t));
      Replace(buf, heap);
    } else {
      std::uint32_t* w = old + kHeader;
      std::memmove(w + idx + 1, w + idx, (n - idx) * sizeof(std::uint32_t));
      w[idx] = slot;
      old[1] = n + 1;
      Restamp(old, heap);
    }
    RelaxedStore(size_, n + 1);
    return true;
  }

  // Removes slot; false when it was not there.
  bool Erase(std::uint32_t slot, HolderHeap& heap) {
    if (!Contains(slot)) return false;
    const std::uint32_t n = size_;
    if (is_inline()) {
      const std::uint32_t a = Slot0(word_), b = Slot1(word_);
      RelaxedStore(word_, Inline(a == slot ? b : a, kAbsent));
      RelaxedStore(size_, n - 1);
      return true;
    }
    std::uint32_t* old = heap_buffer();
    const std::uint32_t* d = old + kHeader;
    const std::size_t idx = static_cast<std::size_t>(std::lower_bound(d, d + n, slot) - d);
    const std::uint32_t cap = old[0];
    const bool shrink = (n - 1) * 4 <= cap;  // a quarter full or less: half the capacity, or inline
    if (shrink && cap / 2 <= 2) {
      std::uint32_t left[2] = {kAbsent, kAbsent};
      std::size_t k = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (i != idx) left[k++] = d[i];
      }
      ReleaseStore(word_, Inline(left[0], left[1]));
      heap.bytes -= Bytes(cap);
      heap.Free(old);
    } else if (shrink || heap.readers()) {
      std::uint32_t* buf = Allocate(shrink ? cap / 2 : cap, n - 1, heap);
      std::memcpy(buf + kHeader, d, idx * sizeof(std::uint32_t));
      std::memcpy(buf + kHeader + idx, d + idx + 1, (n - idx - 1) * sizeof(std::uint32_t));
      Replace(buf, heap);
    } else {
      std::uint32_t* w = old + kHeader;
      std::memmove(w + idx, w + idx + 1, (n - idx - 1) * sizeof(std::uint32_t));
      old[1] = n - 1;
      Restamp(old, heap);
    }
    RelaxedStore(size_, n - 1);
    return true;
  }

  void Release(HolderHeap& heap) {
    if (!is_inline()) {
      std::uint32_t* buf = heap_buffer();
      heap.bytes -= Bytes(buf[0]);
      ReleaseStore(word_, Inline(kAbsent, kAbsent));
      heap.Free(buf);
    } else {
      RelaxedStore(word_, Inline(kAbsent, kAbsent));
    }
    RelaxedStore(size_, 0u);
  }

  static std::uint64_t LoadStamp(const std::uint64_t* stamp_at) {
    return stamp_at == nullptr ? 0 : RelaxedLoad(*stamp_at);
  }

  // The size, for a reader that may run while the owner writes: without touching the heap
  // buffer (a cache miss per node on a request's path). A hint, not the size of what ReadView
  // returns: the two may belong to different versions of the set.
  std::uint32_t ReadSize() const { return RelaxedLoad(size_); }

  // The slots, for a reader that may run while the owner writes (under a ReadGate): one whole
  // version of the set. `tmp` holds inline slots.
  std::span<const std::uint32_t> ReadView(std::uint32_t (&tmp)[2]) const {
    const std::uint64_t* stamp_at = nullptr;
    return ReadView(tmp, stamp_at);
  }
  // The same, and where that version's stamp is (null for a set in a buffer of fewer than
  // kStampedCapacity slots): LoadStamp reads it while the read lasts, only if it is wanted (it
  // lies past the slots, another cache line).
  std::span<const std::uint32_t> ReadView(std::uint32_t (&tmp)[2], const std::uint64_t*& stamp_at) const {
    const std::uint64_t w = AcquireLoad(word_);
    stamp_at = nullptr;
    if ((w & 1) != 0) {
      std::size_t n = 0;
      if (Slot0(w) != kAbsent) tmp[n++] = Slot0(w);
      if (Slot1(w) != kAbsent) tmp[n++] = Slot1(w);
      return {tmp, n};
    }
    const auto* buf = reinterpret_cast<const std::uint32_t*>(static_cast<std::uintptr_t>(w));
    const std::uint32_t cap = RelaxedLoad(buf[0]);
    if (cap >= kStampedCapacity) stamp_at = StampOf(buf, cap);
    return {buf + kHeader, std::min(RelaxedLoad(buf[1]), cap)};
  }

 private:
  static constexpr std::uint32_t kAbsent = 0xffffffffu;  // an absent inline slot
  static constexpr std::size_t kHeader = 2;              // capacity, size

  static std::uint64_t Inline(std::uint32_t s0, std::uint32_t s1) {
    return (std::uint64_t{s1} << 32) | (std::uint64_t{s0 & 0x7fffffffu} << 1) | 1;
  }
  static std::uint32_t Slot0(std::uint64_t w) {
    const std::uint32_t s = static_cast<std::uint32_t>(w) >> 1;
    return s == 0x7fffffffu ? kAbsent : s;
  }
  static std::uint32_t Slot1(std::uint64_t w) { return static_cast<std::uint32_t>(w >> 32); }
  // Capacities are powers of two from 4, so a stamp after the slots is 8-byte aligned.
  static std::size_t Bytes(std::uint32_t cap) {
    return (cap + kHeader + (cap >= kStampedCapacity ? 2 : 0)) * sizeof(std::uint32_t);
  }
  static const std::uint64_t* StampOf(const std::uint32_t* buf, std::uint32_t cap) {
    return reinterpret_cast<const std::uint64_t*>(buf + kHeader + cap);
  }
  static void Restamp(std::uint32_t* buf, HolderHeap& heap) {
    if (buf[0] >= kStampedCapacity) {
      RelaxedStore(*reinterpret_cast<std::uint64_t*>(buf + kHeader + buf[0]), heap.next_stamp++);
    }
  }

  bool is_inline() const { return (word_ & 1) != 0; }
  std::uint32_t* heap_buffer() const { return reinterpret_cast<std::uint32_t*>(static_cast<std::uintptr_t>(word_)); }

  // A buffer for `cap` slots holding `size` (to be filled; unpublished, so plain writes).
  static std::uint32_t* Allocate(std::uint32_t cap, std::uint32_t size, HolderHeap& heap) {
    auto* buf = static_cast<std::uint32_t*>(std::malloc(Bytes(cap)));
    if (buf == nullptr) throw std::bad_alloc();
    buf[0] = cap;
    buf[1] = size;
    Restamp(buf, heap);
    heap.bytes += Bytes(cap);
    return buf;
  }
  // Publishes buf (filled) in place of the current heap buffer.
  void Replace(std::uint32_t* buf, HolderHeap& heap) {
    std::uint32_t* old = heap_buffer();
    heap.bytes -= Bytes(old[0]);
    ReleaseStore(word_, reinterpret_cast<std::uintptr_t>(buf));
    heap.Free(old);
  }

  std::uint64_t word_ = Inline(kAbsent, kAbsent);
  std::uint32_t size_ = 0;
  std::uint32_t unused_ = 0;
};

static_assert(sizeof(HolderSet) == 16);

}  // namespace kvrouter
