// BlockIndex (block_index.h), the writer: stored chains, removals, clears and removed workers
// applied by the owner, with the prefetches that run ahead of them; worker slots (canonical or
// mapped) and nodes taken and freed; TierRank, where a rank's blocks on a tier are kept; and
// TreeSize, which reads the slots the writer keeps.
#include "router/index/block_index.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <stdexcept>

namespace kvrouter {

std::uint32_t BlockIndex::FindSlot(WorkerKey worker) const {
  auto it = slot_of_.find(worker);
  return it == slot_of_.end() ? kFlatEmpty : it->second;
}

std::uint32_t BlockIndex::SlotFor(WorkerKey worker) {
  if (std::uint32_t s = FindSlot(worker); s != kFlatEmpty) return s;
  std::uint32_t s;
  if (!free_slots_.empty()) {
    s = free_slots_.back();
    free_slots_.pop_back();
    slot_reuses_.store(slot_reuses_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);  // the count before the new key
  } else {
    if (slots_.size() > HolderSet::kMaxSlot) throw std::length_error("BlockIndex: too many (worker, dp_rank) slots");
    s = static_cast<std::uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  slots_[s].key = worker;
  // dp_rank first: a reader that sees the new worker_id then sees this slot's new rank too
  key_words_.Set(3 * std::size_t{s} + 2, worker.dp_rank);
  key_words_.Set(3 * std::size_t{s}, static_cast<std::uint32_t>(worker.worker_id));
  key_words_.Set(3 * std::size_t{s} + 1, static_cast<std::uint32_t>(worker.worker_id >> 32));
  slots_[s].in_use = true;
  slot_of_.emplace(worker, s);
  ranks_of_[worker.worker_id].push_back(s);
  return s;
}

std::uint32_t BlockIndex::ChildOrCreate(std::uint32_t parent, SequenceHash seq, LocalHash local) {
  // A 64-bit sequence hash names one prefix (collisions are as unlikely as in the engines'
  // own prefix caches), so an existing node under this hash is this prefix, a child of parent:
  // a parent without children has none to find (a chain growing at its end, as engines store).
  if (node(parent).num_children() > 0) {
    if (std::uint32_t c = node_of_.Find(seq); c != kFlatEmpty) return c;
  }
  std::uint32_t c;
  if (!free_nodes_.empty()) {
    c = free_nodes_.back();
    free_nodes_.pop_back();
    free_sorted_ = std::min(free_sorted_, free_nodes_.size());
    // Freed nodes lie anywhere in memory: start loading the one a few new nodes from now, so
    // its cache miss overlaps the work until then instead of stalling it.
    constexpr std::size_t kAhead = 8;
    if (free_nodes_.size() >= kAhead) PrefetchLine(&node(free_nodes_[free_nodes_.size() - kAhead]));
  } else {
    c = num_node_slots_++;
    if ((c >> kChunkBits) == chunks_.size()) {
      chunks_.emplace_back(kChunkSize);
      locals_.emplace_back(kChunkSize);
      chunk_dir_.Set(chunks_.size() - 1, &chunks_.back()[0]);
    }
  }
  local_of(c) = local;
  Node& n = node(c);
  RelaxedStore(n.seq, seq);
  n.parent = parent;
  RelaxedStore(n.meta, 0u);
  Node& p = node(parent);
  RelaxedStore(p.meta, p.meta + 2);  // one child more
  if (const std::uint32_t there = node_of_.InsertNew(seq, c); there != kFlatEmpty) {
    // Found after all, under another parent: a sequence-hash collision (the lookup above was
    // skipped). The prefixes share that node, as when the lookup finds it; c was never
    // reachable, so it is free again at once.
    RelaxedStore(p.meta, p.meta - 2);
    free_nodes_.push_back(c);
    return there;
  }
  ++live_nodes_;
  return c;
}

void BlockIndex::AddHolding(std::uint32_t slot, std::uint32_t i) {
  if (!node(i).holders.Insert(slot, holder_heap_)) ++slots_[slot].extra_refs[i];
}

void BlockIndex::DropHolding(std::uint32_t slot, std::uint32_t i) {
  auto& extra = slots_[slot].extra_refs;
  if (!extra.empty()) {
    if (auto it = extra.find(i); it != extra.end()) {
      if (--it->second == 0) extra.erase(it);
      return;
    }
  }
  Node& n = node(i);
  // The flag before the holder goes, so a reader never sees the subset rule broken unflagged.
  if (n.num_children() > 0) RelaxedStore(n.meta, n.meta | 1);
  [[maybe_unused]] bool erased = n.holders.Erase(slot, holder_heap_);
  assert(erased);
  MaybeFree(i);
}

void BlockIndex::MaybeFree(std::uint32_t i) {
  while (i != kRoot && node(i).holders.empty() && node(i).num_children() == 0) {
    Node& n = node(i);
    const std::uint32_t parent = n.parent;
    node_of_.Erase(n.seq);
    n.holders.Release(holder_heap_);
    if (holder_heap_.retired != nullptr) {  // a reader may still walk it: reused once quiet
      retired_nodes_.push_back(i);
    } else {
      free_nodes_.push_back(i);
    }
    --live_nodes_;
    Node& p = node(parent);
    RelaxedStore(p.meta, p.meta - 2);  // one child fewer
    i = parent;
  }
}

std::uint32_t BlockIndex::HeldNode(std::uint32_t slot, BlockHash h) const {
  if (slot == kFlatEmpty) return kFlatEmpty;
  const WorkerSlot& w = slots_[slot];
  if (w.mapped) return w.blocks.Find(h);
  const std::uint32_t n = node_of_.Find(h);
  return n != kFlatEmpty && node(n).holders.Contains(slot) ? n : kFlatEmpty;
}

void BlockIndex::MakeMapped(std::uint32_t slot) {
  WorkerSlot& w = slots_[slot];
  for (std::uint32_t n : w.held) {
    if (node(n).holders.Contains(slot)) w.blocks.Insert(node(n).seq, n);  // duplicates fold
  }
  w.held = {};
  w.canonical_blocks = 0;
  w.mapped = true;
}

void BlockIndex::MaybeCompact(std::uint32_t slot) {
  WorkerSlot& w = slots_[slot];
  if (w.held.size() <= 2 * std::size_t{w.canonical_blocks} + 32) return;
  std::sort(w.held.begin(), w.held.end());
  w.held.erase(std::unique(w.held.begin(), w.held.end()), w.held.end());
  std::erase_if(w.held, [&](std::uint32_t n) { return !node(n).holders.Contains(slot); });
  if (w.held.capacity() > 4 * w.held.size() + 64) w.held.shrink_to_fit();
}

void BlockIndex::PrefetchStored(WorkerKey worker, std::optional<BlockHash> parent,
                                std::span<const StoredBlock> blocks) const {
  constexpr std::size_t kMaxBlocks = 8;
  const std::size_t n = std::min(kMaxBlocks, blocks.size());
  if (n == 0) return;
  const std::uint32_t slot = FindSlot(worker);
  if (slot == kFlatEmpty || !slots_[slot].mapped) {
    if (parent) node_of_.Prefetch(*parent);
    for (std::size_t i = 0; i < n; ++i) node_of_.Prefetch(blocks[i].block_hash);
    return;
  }
  // Engine ids name no tree node, so the tree's slots are found by the prefixes' sequence
  // hashes, chained from the parent's. The parent is usually this worker's previous event's last
  // block, stored moments ago: its map slot and node are still in cache.
  const FlatTable<U64MapTraits>& ids = slots_[slot].blocks;
  for (std::size_t i = 0; i < n; ++i) ids.Prefetch(blocks[i].block_hash);
  std::uint32_t at = kRoot;
  if (parent && (at = ids.Find(*parent)) == kFlatEmpty) return;  // ApplyStored looks further
  SequenceHash seq = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const LocalHash local = blocks[i].tokens_hash;
    seq = i == 0 && at == kRoot ? local : ChainSequenceHash(i == 0 ? node(at).seq : seq, local);
    node_of_.Prefetch(seq);
  }
}

WorkerKey TierRank(WorkerKey worker, StorageTier tier) {
  switch (tier) {
    case StorageTier::kDevice: return worker;
    case StorageTier::kHostPinned: return {worker.worker_id, worker.dp_rank | kHostTierRank};
    case StorageTier::kDisk:
    case StorageTier::kExternal: return {worker.worker_id, worker.dp_rank | kDiskTierRank};
  }
  return worker;
}

std::uint32_t BlockIndex::ParentOnAnotherTier(WorkerKey worker, BlockHash parent_hash) {
  const WorkerKey device{worker.worker_id, worker.dp_rank & ~kTierRankBits};
  for (const StorageTier t : {StorageTier::kDevice, StorageTier::kHostPinned, StorageTier::kDisk}) {
    const WorkerKey other = TierRank(device, t);
    if (other == worker) continue;
    if (const std::uint32_t n = HeldNode(FindSlot(other), parent_hash); n != kFlatEmpty) {
      // This rank will hold children of a node it does not hold: FindMatches must intersect
      // below it (the node's orphan risk, sticky until it is freed).
      RelaxedStore(node(n).meta, node(n).meta | 1);
      return n;
    }
  }
  return kFlatEmpty;
}

ApplyOutcome BlockIndex::ApplyStored(WorkerKey worker, std::optional<BlockHash> parent_hash,
                                     std::span<const StoredBlock> blocks, std::uint64_t max_blocks) {
  ApplyOutcome out;
  std::uint32_t slot = FindSlot(worker);
  const std::size_t held = slot == kFlatEmpty ? 0 : slots_[slot].holdings();
  if (held + blocks.size() > max_blocks) {
    out.over_capacity = true;
    return out;
  }
  std::uint32_t parent = kRoot;
  if (parent_hash) {
    parent = HeldNode(slot, *parent_hash);
    if (parent == kFlatEmpty) parent = ParentOnAnotherTier(worker, *parent_hash);
    if (parent == kFlatEmpty) {
      out.parent_not_found = true;
      return out;
    }
  }
  if (slot == kFlatEmpty) slot = SlotFor(worker);
  WorkerSlot& w = slots_[slot];
  // The chain's sequence hashes first, so the hash-table lookups can be prefetched a few blocks
  // ahead and their cache misses overlap (most stored blocks are new, so most lookups miss).
  thread_local std::vector<SequenceHash> seqs;
  seqs.resize(blocks.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const LocalHash local = blocks[i].tokens_hash;
    if (i > 0) {
      seqs[i] = ChainSequenceHash(seqs[i - 1], local);
    } else {
      seqs[i] = parent == kRoot ? local : ChainSequenceHash(node(parent).seq, local);
    }
  }
  constexpr std::size_t kAhead = 8;
  for (std::size_t i = 0; i < std::min(kAhead, seqs.size()); ++i) node_of_.Prefetch(seqs[i]);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const StoredBlock& b = blocks[i];
    if (i + kAhead < seqs.size()) node_of_.Prefetch(seqs[i + kAhead]);
    const std::uint32_t child = ChildOrCreate(parent, seqs[i], b.tokens_hash);
    if (!w.mapped && node(child).seq != b.block_hash) MakeMapped(slot);
    if (!w.mapped) {
      // The engine hash names this node, so a known one is this very holding.
      if (node(child).holders.Insert(slot, holder_heap_)) {
        w.held.push_back(child);
        ++w.canonical_blocks;
        ++out.blocks_stored;
      }
    } else if (const std::uint32_t previous = w.blocks.Insert(b.block_hash, child); previous != child) {
      // Hold the new node before letting go of the old one, so freeing the old one's
      // ancestors can never free the node being stored.
      AddHolding(slot, child);
      if (previous == kFlatEmpty) {
        ++out.blocks_stored;
      } else {
        DropHolding(slot, previous);
      }
    }
    parent = child;
  }
  return out;
}

void BlockIndex::PrefetchRemoved(WorkerKey worker, std::span<const BlockHash> block_hashes) const {
  constexpr std::size_t kMaxBlocks = 8;
  const std::uint32_t slot = FindSlot(worker);
  if (slot == kFlatEmpty) return;
  const FlatTable<U64MapTraits>& ids = slots_[slot].mapped ? slots_[slot].blocks : node_of_;
  for (std::size_t i = 0; i < std::min(kMaxBlocks, block_hashes.size()); ++i) ids.Prefetch(block_hashes[i]);
}

void BlockIndex::PrefetchRemovals(std::uint32_t slot, std::span<const BlockHash> block_hashes) const {
  // Three lookups in a row per block, each a likely cache miss when the block is old: its map or
  // table slot, its node, then (for an engine id) its prefix's table slot, which erasing the
  // node needs. In stages over the whole group, the misses of one stage overlap each other.
  const WorkerSlot& w = slots_[slot];
  const FlatTable<U64MapTraits>& ids = w.mapped ? w.blocks : node_of_;
  for (BlockHash h : block_hashes) ids.Prefetch(h);
  std::array<std::uint32_t, kRemovalGroup> nodes;
  for (std::size_t i = 0; i < block_hashes.size(); ++i) {
    nodes[i] = ids.Find(block_hashes[i]);
    if (nodes[i] != kFlatEmpty) PrefetchLine(&node(nodes[i]));
  }
  if (!w.mapped) return;  // the node's table slot is the one just read
  for (std::size_t i = 0; i < block_hashes.size(); ++i) {
    if (nodes[i] != kFlatEmpty) node_of_.Prefetch(node(nodes[i]).seq);
  }
}

ApplyOutcome BlockIndex::ApplyRemoved(WorkerKey worker, std::span<const BlockHash> block_hashes) {
  ApplyOutcome out;
  const std::uint32_t slot = FindSlot(worker);
  for (std::size_t i = 0; i < block_hashes.size(); ++i) {
    const BlockHash h = block_hashes[i];
    // A lone block has nothing to overlap its lookups with: staging it would only read it twice.
    if (slot != kFlatEmpty && i % kRemovalGroup == 0 && block_hashes.size() - i > 1) {
      PrefetchRemovals(slot, block_hashes.subspan(i, std::min(kRemovalGroup, block_hashes.size() - i)));
    }
    std::uint32_t node = kFlatEmpty;
    if (slot != kFlatEmpty) node = slots_[slot].mapped ? slots_[slot].blocks.Erase(h) : HeldNode(slot, h);
    if (node == kFlatEmpty) {
      ++out.blocks_not_found;
      continue;
    }
    if (!slots_[slot].mapped) --slots_[slot].canonical_blocks;
    DropHolding(slot, node);
    ++out.blocks_removed;
  }
  if (slot != kFlatEmpty && !slots_[slot].mapped) MaybeCompact(slot);
  return out;
}

std::size_t BlockIndex::ClearSlot(std::uint32_t slot) {
  WorkerSlot& w = slots_[slot];
  const std::size_t dropped = w.holdings();
  // Every node this slot holds loses it; a node still held by the slot cannot be freed by an
  // earlier step of this loop, so no node is visited after being freed. The whole worker goes,
  // so no orphan is left behind for it and orphan_risk need not be set.
  thread_local std::vector<std::uint32_t> mapped_nodes;
  mapped_nodes.clear();
  if (w.mapped) {
    mapped_nodes.reserve(w.blocks.size());  // before any count below changes: nothing throws between
    w.blocks.ForEach([&](const U64MapTraits::Entry& e) {
      auto& extra = w.extra_refs;
      if (!extra.empty()) {
        if (auto it = extra.find(e.value); it != extra.end()) {
          if (--it->second == 0) extra.erase(it);
          return;
        }
      }
      mapped_nodes.push_back(e.value);
    });
  }
  const std::span<const std::uint32_t> nodes = w.mapped ? std::span<const std::uint32_t>(mapped_nodes) : w.held;
  // The nodes lie anywhere in memory, and so do their slots in the sequence-hash table, which
  // freeing a node erases: both are loaded a few nodes ahead, so that their misses overlap.
  constexpr std::size_t kNodeAhead = 16, kTableAhead = 8;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (i + kNodeAhead < nodes.size()) PrefetchLine(&node(nodes[i + kNodeAhead]));
    if (i + kTableAhead < nodes.size()) node_of_.Prefetch(node(nodes[i + kTableAhead]).seq);
    // A stale or repeated canonical entry finds the slot gone (a freed node has no holders).
    if (node(nodes[i]).holders.Erase(slot, holder_heap_)) MaybeFree(nodes[i]);
  }
  if (mapped_nodes.capacity() > (std::size_t{1} << 16)) mapped_nodes = {};  // a large worker's, not kept
  w.held = {};
  w.canonical_blocks = 0;
  if (shrink_later_) {
    w.blocks.ClearKeepingCapacity();  // no reader reads a worker's map
  } else {
    w.blocks.Clear();
  }
  w.extra_refs.clear();
  w.mapped = false;
  return dropped;
}

std::size_t BlockIndex::ClearRank(WorkerKey worker) {
  auto clear = [&](WorkerKey key) {
    const std::uint32_t slot = FindSlot(key);
    return slot == kFlatEmpty ? 0 : ClearSlot(slot);
  };
  if ((worker.dp_rank & kTierRankBits) != 0) return clear(worker);  // one tier's rank alone
  std::size_t dropped = 0;
  for (const StorageTier t : {StorageTier::kDevice, StorageTier::kHostPinned, StorageTier::kDisk})
    dropped += clear(TierRank(worker, t));
  return dropped;
}

std::size_t BlockIndex::ClearWorker(std::uint64_t worker_id) {
  auto it = ranks_of_.find(worker_id);
  if (it == ranks_of_.end()) return 0;
  std::size_t dropped = 0;
  for (std::uint32_t slot : it->second) dropped += ClearSlot(slot);
  return dropped;
}

std::size_t BlockIndex::RemoveWorker(std::uint64_t worker_id) {
  auto it = ranks_of_.find(worker_id);
  if (it == ranks_of_.end()) return 0;
  std::size_t dropped = 0;
  for (std::uint32_t slot : it->second) {
    dropped += ClearSlot(slot);
    slot_of_.erase(slots_[slot].key);
    slots_[slot] = WorkerSlot{};
    // A reader may still report this slot: its key words change only once the shard is quiet.
    (holder_heap_.retired != nullptr ? retired_slots_ : free_slots_).push_back(slot);
  }
  ranks_of_.erase(it);
  return dropped;
}

std::size_t BlockIndex::TreeSize(WorkerKey worker) const {
  const std::uint32_t slot = FindSlot(worker);
  return slot == kFlatEmpty ? 0 : slots_[slot].holdings();
}

}  // namespace kvrouter
