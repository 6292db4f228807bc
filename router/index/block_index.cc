// BlockIndex (block_index.h): its lifetime, the memory kept for readers (retired), the owner's
// upkeep of free nodes and tables, and the bookkeeping reads (Memory). The other jobs have a
// file each: block_index_write.cc (apply events), block_index_match.cc (FindMatches),
// block_index_dump.cc (DumpRank), block_index_tiers.cc (tier ranks folded back).
#include "router/index/block_index.h"

#include <algorithm>
#include <bit>
#include <cstdlib>

namespace kvrouter {

BlockIndex::BlockIndex() {
  chunks_.emplace_back(kChunkSize);
  locals_.emplace_back(kChunkSize);
  chunk_dir_.Set(0, &chunks_[0][0]);
  num_node_slots_ = 1;  // the root
}

BlockIndex::~BlockIndex() {
  FreeRetired();
  holder_heap_.retired = nullptr;
  for (std::uint32_t i = 0; i < num_node_slots_; ++i) node(i).holders.Release(holder_heap_);
}

void BlockIndex::SetConcurrentReaders(bool on) {
  holder_heap_.retired = on ? &retired_holders_ : nullptr;
  node_of_.DeferFrees(on);
  chunk_dir_.DeferFrees(on);
  key_words_.DeferFrees(on);
  if (!on) FreeRetired();
}

bool BlockIndex::HasRetired() const {
  return !retired_holders_.empty() || !retired_nodes_.empty() || !retired_slots_.empty() || node_of_.HasRetired() ||
         chunk_dir_.HasRetired() || key_words_.HasRetired();
}

void BlockIndex::FreeRetired() {
  for (void* p : retired_holders_) std::free(p);
  retired_holders_.clear();
  free_nodes_.insert(free_nodes_.end(), retired_nodes_.begin(), retired_nodes_.end());
  retired_nodes_.clear();
  free_slots_.insert(free_slots_.end(), retired_slots_.begin(), retired_slots_.end());
  retired_slots_.clear();
  node_of_.FreeRetired();
  chunk_dir_.FreeRetired();
  key_words_.FreeRetired();
}

void BlockIndex::TidyFreeNodes() {
  constexpr std::size_t kWorthSorting = 4096;  // freed nodes waiting past the sorted part
  if (free_nodes_.size() - free_sorted_ < kWorthSorting) return;
  // Node numbers are dense: a bitmap orders them in one linear pass, where sorting hundreds of
  // thousands of freed nodes would hold up the shard thread's events.
  std::vector<std::uint64_t> bits((num_node_slots_ + 63) / 64);
  for (std::uint32_t n : free_nodes_) bits[n >> 6] |= std::uint64_t{1} << (n & 63);
  std::size_t k = 0;
  for (std::size_t w = bits.size(); w-- > 0;) {
    for (std::uint64_t b = bits[w]; b != 0;) {
      const int top = 63 - std::countl_zero(b);
      free_nodes_[k++] = static_cast<std::uint32_t>(w * 64 + static_cast<std::size_t>(top));
      b &= ~(std::uint64_t{1} << top);
    }
  }
  free_nodes_.resize(k);  // (a number is never free twice; k is the size)
  free_sorted_ = k;
}

bool BlockIndex::TablesUnderfull() const {
  if (node_of_.Underfull()) return true;
  return std::any_of(slots_.begin(), slots_.end(), [](const WorkerSlot& w) { return w.blocks.Underfull(); });
}

void BlockIndex::ShrinkTables() {
  if (node_of_.Underfull()) node_of_.ShrinkToFit();
  for (WorkerSlot& w : slots_) {
    if (w.blocks.Underfull()) w.blocks.ShrinkToFit();
  }
}

IndexMemory BlockIndex::Memory() const {
  IndexMemory m;
  m.nodes = live_nodes_;
  m.table_bytes = node_of_.memory_bytes();
  m.bytes = chunks_.size() * kChunkSize * (sizeof(Node) + sizeof(LocalHash)) + node_of_.memory_bytes() +
            holder_heap_.bytes + slots_.capacity() * sizeof(WorkerSlot) + chunk_dir_.memory_bytes() +
            key_words_.memory_bytes() + (free_nodes_.capacity() + retired_nodes_.capacity()) * sizeof(std::uint32_t);
  for (const WorkerSlot& w : slots_) {
    m.map_bytes += w.blocks.memory_bytes();
    m.bytes += w.blocks.memory_bytes() + w.held.capacity() * sizeof(std::uint32_t);
    m.holdings += w.holdings();
  }
  // Per-worker bookkeeping maps: an estimate of their node sizes.
  m.bytes += (slot_of_.size() + ranks_of_.size()) * 64;
  return m;
}

}  // namespace kvrouter
