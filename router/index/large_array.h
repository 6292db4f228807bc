// LargeArray<T>: a fixed-size array for the index's big tables (the sequence-hash table, node
// chunks). Arrays of 2 MiB and more get their own mapping, aligned to 2 MiB and marked for
// transparent huge pages (MADV_HUGEPAGE: Debian's default THP mode is "madvise", so without
// the mark every 4 KiB page of a 100 MB table costs its own TLB entry, and a find_matches that
// looks up a hundred random nodes spends much of its time in page walks). Smaller arrays come
// from malloc. Where the kernel refuses huge pages the array still works, on 4 KiB pages.
// T must be trivially destructible (elements are never destroyed one by one).
// Not thread-safe (one owner, like the tables that use it).
//
//   LargeArray<Entry> slots(1 << 20);   slots[5] = e;
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace kvrouter {

inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// Bytes of every LargeArray mapping in the process (malloc's own statistics do not see them).
inline std::atomic<std::size_t> large_array_mapped_bytes{0};

template <typename T>
class LargeArray {
  static_assert(std::is_trivially_destructible_v<T>);

 public:
  LargeArray() = default;
  // n default-initialised elements (T's member initialisers run; a plain struct is left as is).
  explicit LargeArray(std::size_t n) : size_(n) {
    if (n == 0) return;
    const std::size_t bytes = n * sizeof(T);
    if (bytes >= kHugePageBytes) {
      mapped_bytes_ = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
      data_ = static_cast<T*>(MapAligned(mapped_bytes_));
    } else {
      data_ = static_cast<T*>(std::malloc(bytes));
      if (data_ == nullptr) throw std::bad_alloc();
    }
    std::uninitialized_default_construct_n(data_, n);
  }
  ~LargeArray() { reset(); }
  LargeArray(LargeArray&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        mapped_bytes_(std::exchange(o.mapped_bytes_, 0)) {}
  LargeArray& operator=(LargeArray&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      mapped_bytes_ = std::exchange(o.mapped_bytes_, 0);
    }
    return *this;
  }
  LargeArray(const LargeArray&) = delete;
  LargeArray& operator=(const LargeArray&) = delete;

  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  std::size_t size() const { return size_; }
  bool huge() const { return mapped_bytes_ != 0; }  // on its own mapping, marked for huge pages

  void reset() {
    if (mapped_bytes_ != 0) {
      munmap(data_, mapped_bytes_);
      large_array_mapped_bytes.fetch_sub(mapped_bytes_, std::memory_order_relaxed);
    } else {
      std::free(data_);
    }
    data_ = nullptr;
    size_ = 0;
    mapped_bytes_ = 0;
  }

 private:
  // bytes (a multiple of kHugePageBytes) of zeroed memory at a kHugePageBytes boundary: maps
  // one huge page more than asked and gives back what lies outside the aligned range.
  static void* MapAligned(std::size_t bytes) {
    const std::size_t span = bytes + kHugePageBytes;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t aligned = (start + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
    if (aligned > start) munmap(raw, aligned - start);
    const std::size_t tail = start + span - (aligned + bytes);
    if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
    madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);  // advice: failure is harmless
    large_array_mapped_bytes.fetch_add(bytes, std::memory_order_relaxed);
    return reinterpret_cast<void*>(aligned);
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t mapped_bytes_ = 0;  // 0: from malloc
};

}  // namespace kvrouter
