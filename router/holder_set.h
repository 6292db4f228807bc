// HolderSet: the sorted set of worker slots that hold one index node, 16 bytes with room for
// two holders inline (most nodes of an unshared cache have one), growing onto the heap by
// doubling. It owns a raw heap pointer and frees it only in Release() (nodes are recycled, not
// destroyed), so it cannot be copied: a copy would free the same memory twice.
//
// Readable while its owner writes (ReadView; see router/read_gate.h): the set is one word that
// is either the two inline slots (bit 0 set: slot 0 in bits 1-31, slot 1 in bits 32-63) or a
// pointer to a heap buffer that starts with its own capacity, plus a size. A reader loads the
// word once, so it never mistakes inline slots for a pointer, and bounds the size by what the
// buffer it loaded can hold. Every change is made with atomic stores, and a replaced buffer goes
// to HolderHeap::retired when readers may still hold it. Slots must be below 2^31.
// Thread contract: one writer (the shard thread that owns the node); readers only through
// ReadView, under a ReadGate.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <span>
#include <vector>

#include "router/read_gate.h"

namespace kvrouter {

// The heap behind a tree's holder sets: bytes in use, and where replaced buffers wait while
// readers may still be reading them (null: freed at once).
struct HolderHeap {
  std::size_t bytes = 0;
  std::vector<void*>* retired = nullptr;

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
  static constexpr std::uint32_t kMaxSlot = (1u << 31) - 1;

  HolderSet() = default;
  HolderSet(const HolderSet&) = delete;
  HolderSet& operator=(const HolderSet&) = delete;

  std::uint32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  bool Contains(std::uint32_t slot) const {
    if (is_inline()) return (size_ > 0 && Slot0(word_) == slot) || (size_ > 1 && Slot1(word_) == slot);
    const std::uint32_t* d = heap_data();
    return std::binary_search(d, d + size_, slot);
  }

  // Adds slot (<= kMaxSlot); false when it was already there.
  bool Insert(std::uint32_t slot, HolderHeap& heap) {
    if (is_inline()) {
      const std::uint32_t a = Slot0(word_), b = Slot1(word_);
      if ((size_ > 0 && a == slot) || (size_ > 1 && b == slot)) return false;
      if (size_ < 2) {
        RelaxedStore(word_, size_ == 0 ? Inline(slot, 0) : Inline(std::min(a, slot), std::max(a, slot)));
      } else {
        std::uint32_t* buf = Allocate(4, heap);  // unpublished until the word below
        buf[1] = a;
        buf[2] = b;
        buf[3] = slot;
        std::sort(buf + 1, buf + 4);
        ReleaseStore(word_, reinterpret_cast<std::uintptr_t>(buf));
      }
      RelaxedStore(size_, size_ + 1);
      return true;
    }
    std::uint32_t* d = heap_data();
    const std::uint32_t n = size_;
    std::uint32_t* pos = std::lower_bound(d, d + n, slot);
    if (pos != d + n && *pos == slot) return false;
    const std::size_t idx = static_cast<std::size_t>(pos - d);
    if (n == capacity()) {
      std::uint32_t* buf = Allocate(2 * n, heap);
      std::memcpy(buf + 1, d, idx * sizeof(std::uint32_t));
      buf[1 + idx] = slot;
      std::memcpy(buf + 2 + idx, d + idx, (n - idx) * sizeof(std::uint32_t));
      Replace(buf, heap);
    } else {
      for (std::size_t i = n; i > idx; --i) RelaxedStore(d[i], d[i - 1]);
      RelaxedStore(d[idx], slot);
    }
    RelaxedStore(size_, n + 1);
    return true;
  }

  // Removes slot; false when it was not there.
  bool Erase(std::uint32_t slot, HolderHeap& heap) {
    if (is_inline()) {
      const std::uint32_t a = Slot0(word_), b = Slot1(word_);
      if (size_ > 0 && a == slot) {
        RelaxedStore(word_, Inline(size_ > 1 ? b : 0, 0));
      } else if (size_ > 1 && b == slot) {
        RelaxedStore(word_, Inline(a, 0));
      } else {
        return false;
      }
      RelaxedStore(size_, size_ - 1);
      return true;
    }
    std::uint32_t* d = heap_data();
    const std::uint32_t n = size_;
    std::uint32_t* pos = std::lower_bound(d, d + n, slot);
    if (pos == d + n || *pos != slot) return false;
    const std::uint32_t cap = capacity();
    if ((n - 1) * 4 <= cap) {  // a quarter full or less: half the capacity, or inline
      const std::uint32_t new_cap = cap / 2;
      const std::size_t idx = static_cast<std::size_t>(pos - d);
      if (new_cap <= 2) {
        std::uint32_t left[2] = {0, 0};
        std::size_t k = 0;
        for (std::size_t i = 0; i < n; ++i) {
          if (i != idx) left[k++] = d[i];
        }
        RelaxedStore(size_, n - 1);
        ReleaseStore(word_, Inline(left[0], left[1]));
        heap.bytes -= Bytes(cap);
        heap.Free(d - 1);
        return true;
      }
      std::uint32_t* buf = Allocate(new_cap, heap);
      std::memcpy(buf + 1, d, idx * sizeof(std::uint32_t));
      std::memcpy(buf + 1 + idx, d + idx + 1, (n - idx - 1) * sizeof(std::uint32_t));
      RelaxedStore(size_, n - 1);
      Replace(buf, heap);
      return true;
    }
    for (std::size_t i = static_cast<std::size_t>(pos - d); i + 1 < n; ++i) RelaxedStore(d[i], d[i + 1]);
    RelaxedStore(size_, n - 1);
    return true;
  }

  void Release(HolderHeap& heap) {
    if (is_inline()) {
      RelaxedStore(word_, Inline(0, 0));
    } else {
      heap.bytes -= Bytes(capacity());
      std::uint32_t* buf = heap_data() - 1;
      ReleaseStore(word_, Inline(0, 0));
      heap.Free(buf);
    }
    RelaxedStore(size_, 0u);
  }

  // The size, for a reader that may run while the owner writes (under a ReadGate): without
  // touching the heap buffer (a cache miss per node on a request's path). Not a bound for
  // reading elements: use ReadView's size for that.
  std::uint32_t ReadSize() const {
    const std::uint32_t n = RelaxedLoad(size_);
    return (RelaxedLoad(word_) & 1) != 0 ? std::min<std::uint32_t>(n, 2) : n;
  }

  // The slots, for a reader that may run while the owner writes (under a ReadGate). `tmp`
  // holds inline slots. Read the elements with RelaxedLoad: during a tolerant read they may be
  // changing (repeated or out of order for a moment, never out of bounds).
  std::span<const std::uint32_t> ReadView(std::uint32_t (&tmp)[2]) const {
    const std::uint64_t w = AcquireLoad(word_);
    const std::uint32_t n = RelaxedLoad(size_);
    if ((w & 1) != 0) {
      tmp[0] = Slot0(w);
      tmp[1] = Slot1(w);
      return {tmp, std::min<std::uint32_t>(n, 2)};
    }
    const auto* buf = reinterpret_cast<const std::uint32_t*>(static_cast<std::uintptr_t>(w));
    return {buf + 1, std::min(n, RelaxedLoad(buf[0]))};
  }

 private:
  static std::uint64_t Inline(std::uint32_t s0, std::uint32_t s1) {
    return (std::uint64_t{s1} << 32) | (std::uint64_t{s0} << 1) | 1;
  }
  static std::uint32_t Slot0(std::uint64_t w) { return static_cast<std::uint32_t>(w) >> 1; }
  static std::uint32_t Slot1(std::uint64_t w) { return static_cast<std::uint32_t>(w >> 32); }
  static std::size_t Bytes(std::uint32_t cap) { return (std::size_t{cap} + 1) * sizeof(std::uint32_t); }

  bool is_inline() const { return (word_ & 1) != 0; }
  std::uint32_t* heap_data() const { return reinterpret_cast<std::uint32_t*>(static_cast<std::uintptr_t>(word_)) + 1; }
  std::uint32_t capacity() const { return is_inline() ? 2 : heap_data()[-1]; }

  // A buffer of `cap` slots, its capacity written in front (unpublished: plain writes).
  static std::uint32_t* Allocate(std::uint32_t cap, HolderHeap& heap) {
    auto* buf = static_cast<std::uint32_t*>(std::malloc(Bytes(cap)));
    if (buf == nullptr) throw std::bad_alloc();
    buf[0] = cap;
    heap.bytes += Bytes(cap);
    return buf;
  }
  // Publishes buf (filled) in place of the current heap buffer.
  void Replace(std::uint32_t* buf, HolderHeap& heap) {
    std::uint32_t* old = heap_data() - 1;
    heap.bytes -= Bytes(old[0]);
    ReleaseStore(word_, reinterpret_cast<std::uintptr_t>(buf));
    heap.Free(old);
  }

  std::uint64_t word_ = 1;  // inline, empty
  std::uint32_t size_ = 0;
  std::uint32_t unused_ = 0;
};

static_assert(sizeof(HolderSet) == 16);

}  // namespace kvrouter
