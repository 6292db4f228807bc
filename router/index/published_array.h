// PublishedArray<T>: a growable array of words (integers or pointers) that one owner thread
// writes while readers look entries up (the index's node-chunk directory and slot keys; see
// router/index/read_gate.h). Growing copies into a new array and publishes it with its size in one
// pointer store, so a reader's Snapshot() is always an array and the size it really has; the
// old array is kept until FreeRetired() when DeferFrees(true) is set. Entries are written with
// atomic stores (Set), read with RelaxedLoad/AcquireLoad.
// Thread contract: one owner thread; readers only through Snapshot(), valid until the owner's
// next FreeRetired().
//
//   PublishedArray<Node*> dir;  dir.Set(3, chunk);            // owner (grows as needed)
//   auto v = dir.Snapshot();    if (i < v.size) p = AcquireLoad(v.data[i]);   // reader
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "router/index/read_gate.h"

namespace kvrouter {

template <typename T>
class PublishedArray {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(void*));

 public:
  struct View {
    const T* data = nullptr;
    std::size_t size = 0;
  };

  std::size_t size() const { return st_ ? st_->size : 0; }
  // Owner: entry i (plain read; only the owner writes).
  T operator[](std::size_t i) const { return st_->data[i]; }

  // Owner: sets entry i, growing the array (new entries zero) when i is past its end.
  void Set(std::size_t i, T v) {
    if (i >= size()) Grow(std::max<std::size_t>(i + 1, 2 * size()));
    ReleaseStore(st_->data[i], v);
  }

  View Snapshot() const {
    const Storage* st = AcquireLoad(published_);
    return st == nullptr ? View{} : View{st->data.get(), st->size};
  }

  std::size_t memory_bytes() const { return size() * sizeof(T); }
  void DeferFrees(bool on) { defer_frees_ = on; }
  bool HasRetired() const { return !retired_.empty(); }
  void FreeRetired() { retired_.clear(); }

 private:
  struct Storage {
    std::size_t size = 0;
    std::unique_ptr<T[]> data;
  };

  void Grow(std::size_t n) {
    auto fresh = std::make_unique<Storage>();
    fresh->size = n;
    fresh->data = std::make_unique<T[]>(n);  // zeroed
    if (st_) std::copy_n(st_->data.get(), st_->size, fresh->data.get());
    ReleaseStore(published_, fresh.get());  // filled before readers can see it
    std::unique_ptr<Storage> old = std::exchange(st_, std::move(fresh));
    if (old && defer_frees_) retired_.push_back(std::move(old));
  }

  std::unique_ptr<Storage> st_;
  Storage* published_ = nullptr;  // st_.get(), for readers (atomic accesses)
  bool defer_frees_ = false;
  std::vector<std::unique_ptr<Storage>> retired_;
};

}  // namespace kvrouter
