#include "router/index/approx_index.h"

#include <algorithm>
#include <cmath>

namespace kvrouter {

ApproxIndex::ApproxIndex(std::chrono::milliseconds ttl, std::uint64_t max_blocks, double prune_target_ratio)
    : ttl_ms_(static_cast<std::uint64_t>(std::max<std::int64_t>(0, ttl.count()))),
      max_blocks_(max_blocks),
      prune_to_(static_cast<std::uint64_t>(std::floor(static_cast<double>(max_blocks) * prune_target_ratio))) {}

std::uint32_t ApproxIndex::Tick(SteadyTime now) {
  using std::chrono::milliseconds;
  if (!has_base_) {
    base_ = now;
    has_base_ = true;
  }
  const auto ms = std::chrono::duration_cast<milliseconds>(now - base_).count();
  if (ms < 0) return 0;  // a clock before the first prediction counts as the first
  constexpr std::int64_t kRebaseAt = std::int64_t{1} << 31;
  if (ms < kRebaseAt) return static_cast<std::uint32_t>(ms);
  // 24.8 days in: move the base 12.4 days on. An entry older than that (only with a ttl that
  // long) is clamped to the new base, so it can live up to 12.4 days past its ttl.
  constexpr std::uint32_t kShift = std::uint32_t{1} << 30;
  for (std::uint32_t i = head_; i != kNil; i = at(i).next) at(i).last_use -= std::min(at(i).last_use, kShift);
  base_ += milliseconds(kShift);
  return Tick(now);
}

std::uint32_t ApproxIndex::WorkerNumber(WorkerKey worker) {
  auto [it, inserted] = worker_number_.try_emplace(worker, static_cast<std::uint32_t>(workers_.size()));
  if (inserted) workers_.push_back(worker);
  return it->second;
}

std::uint32_t ApproxIndex::Allocate() {
  if (free_ != kNil) {
    const std::uint32_t i = free_;
    free_ = at(i).next;
    return i;
  }
  const std::uint32_t i = slots_used_++;
  if ((i >> kChunkBits) == chunks_.size()) chunks_.push_back(std::make_unique<Entry[]>(std::size_t{1} << kChunkBits));
  return i;
}

void ApproxIndex::Unlink(std::uint32_t i) {
  Entry& e = at(i);
  (e.prev == kNil ? head_ : at(e.prev).next) = e.next;
  (e.next == kNil ? tail_ : at(e.next).prev) = e.prev;
  e.prev = e.next = kNil;
}

void ApproxIndex::PushBack(std::uint32_t i) {
  Entry& e = at(i);
  e.prev = tail_;
  e.next = kNil;
  (tail_ == kNil ? head_ : at(tail_).next) = i;
  tail_ = i;
}

void ApproxIndex::Drop(std::uint32_t i, IndexBlock block) {
  Entry& e = at(i);
  if (block == IndexBlock::kRemove) {
    const BlockHash h = e.seq;
    (void)index_.ApplyRemoved(workers_[e.worker], std::span<const BlockHash>(&h, 1));
  }
  lookup_.Erase({e.worker, e.seq});  // before the entry stops naming its key
  Unlink(i);
  e.next = free_;
  free_ = i;
  --live_;
}

void ApproxIndex::Record(WorkerKey worker, std::span<const LocalHash> local, std::span<const SequenceHash> seq,
                         SteadyTime now) {
  const std::size_t n = std::min(local.size(), seq.size());
  if (n == 0) return;
  thread_local std::vector<StoredBlock> chain;
  chain.resize(n);
  for (std::size_t i = 0; i < n; ++i) chain[i] = {seq[i], local[i]};
  (void)index_.ApplyStored(worker, std::nullopt, chain);  // known blocks: idempotent
  const std::uint32_t w = WorkerNumber(worker);
  const std::uint32_t tick = Tick(now);
  // Leaf first, so the root of the prefix ends up last (expires last among equals).
  for (std::size_t k = n; k-- > 0;) {
    std::uint32_t i = lookup_.Find({w, seq[k]});
    if (i == kNil) {
      i = Allocate();
      at(i) = Entry{.seq = seq[k], .worker = w, .last_use = tick};
      lookup_.Insert({w, seq[k]}, i);
      ++live_;
    } else {
      at(i).last_use = tick;
      Unlink(i);
    }
    PushBack(i);
  }
  if (live_ > max_blocks_) {
    while (live_ > prune_to_) {
      Drop(head_, IndexBlock::kRemove);
      ++pruned_;
    }
  }
}

std::size_t ApproxIndex::Expire(SteadyTime now) {
  if (head_ == kNil) return 0;
  const std::uint64_t tick = Tick(now);
  std::size_t n = 0;
  // A clock that went back expires nothing.
  while (head_ != kNil && tick >= at(head_).last_use && tick - at(head_).last_use >= ttl_ms_) {
    Drop(head_, IndexBlock::kRemove);
    ++n;
  }
  expired_ += n;
  return n;
}

void ApproxIndex::RemoveWorker(std::uint64_t worker_id) {
  for (std::uint32_t i = head_; i != kNil;) {
    const std::uint32_t next = at(i).next;
    if (workers_[at(i).worker].worker_id == worker_id) Drop(i, IndexBlock::kLeave);  // the index forgets all below
    i = next;
  }
  index_.RemoveWorker(worker_id);
}

std::size_t ApproxIndex::OwnBytes() const {
  return chunks_.size() * (std::size_t{1} << kChunkBits) * sizeof(Entry) + lookup_.memory_bytes() +
         workers_.capacity() * sizeof(WorkerKey) + worker_number_.size() * 64;
}

}  // namespace kvrouter
