// HolderSet: the sorted set of worker slots that hold one index node, 16 bytes with room for
// two holders inline (most nodes of an unshared cache have one), growing onto the heap by
// doubling. It owns a raw heap pointer and frees it only in Release() (nodes are recycled, not
// destroyed), so it cannot be copied: a copy would free the same memory twice.
// Not thread-safe: owned by the shard thread that owns the node.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <span>

namespace kvrouter {

class HolderSet {
 public:
  HolderSet() = default;
  HolderSet(const HolderSet&) = delete;
  HolderSet& operator=(const HolderSet&) = delete;

  std::span<const std::uint32_t> view() const { return {data(), size_}; }
  std::uint32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  bool Contains(std::uint32_t slot) const {
    const std::uint32_t* d = data();
    return std::binary_search(d, d + size_, slot);
  }

  // Adds slot; false when it was already there. heap_bytes tracks heap memory in use.
  bool Insert(std::uint32_t slot, std::size_t& heap_bytes) {
    std::uint32_t* d = data();
    std::uint32_t* pos = std::lower_bound(d, d + size_, slot);
    if (pos != d + size_ && *pos == slot) return false;
    const std::size_t idx = static_cast<std::size_t>(pos - d);
    if (size_ == capacity_) {
      Resize(capacity_ * 2, heap_bytes);
      d = data();
    }
    std::memmove(d + idx + 1, d + idx, (size_ - idx) * sizeof(std::uint32_t));
    d[idx] = slot;
    ++size_;
    return true;
  }

  // Removes slot; false when it was not there.
  bool Erase(std::uint32_t slot, std::size_t& heap_bytes) {
    std::uint32_t* d = data();
    std::uint32_t* pos = std::lower_bound(d, d + size_, slot);
    if (pos == d + size_ || *pos != slot) return false;
    std::memmove(pos, pos + 1, static_cast<std::size_t>(d + size_ - pos - 1) * sizeof(std::uint32_t));
    --size_;
    if (capacity_ > kInline && size_ * 4 <= capacity_) Resize(std::max(kInline, capacity_ / 2), heap_bytes);
    return true;
  }

  void Release(std::size_t& heap_bytes) {
    if (capacity_ > kInline) {
      heap_bytes -= capacity_ * sizeof(std::uint32_t);
      std::free(heap_);
    }
    capacity_ = kInline;
    size_ = 0;
  }

 private:
  static constexpr std::uint32_t kInline = 2;

  std::uint32_t* data() { return capacity_ > kInline ? heap_ : inline_; }
  const std::uint32_t* data() const { return capacity_ > kInline ? heap_ : inline_; }

  void Resize(std::uint32_t new_capacity, std::size_t& heap_bytes) {
    std::uint32_t* from = data();
    std::uint32_t* to = inline_;
    if (new_capacity > kInline) {
      to = static_cast<std::uint32_t*>(std::malloc(new_capacity * sizeof(std::uint32_t)));
      if (to == nullptr) throw std::bad_alloc();
      heap_bytes += new_capacity * sizeof(std::uint32_t);
      std::memcpy(to, from, size_ * sizeof(std::uint32_t));
    } else {
      std::uint32_t tmp[kInline];
      std::memcpy(tmp, from, size_ * sizeof(std::uint32_t));
      std::memcpy(to, tmp, size_ * sizeof(std::uint32_t));
    }
    if (capacity_ > kInline) {
      heap_bytes -= capacity_ * sizeof(std::uint32_t);
      std::free(from);
    }
    if (new_capacity > kInline) heap_ = to;
    capacity_ = new_capacity;
  }
  union {
    std::uint32_t inline_[kInline] = {0, 0};
    std::uint32_t* heap_;
  };
  std::uint32_t size_ = 0;
  std::uint32_t capacity_ = kInline;
};

static_assert(sizeof(HolderSet) == 16);

}  // namespace kvrouter
