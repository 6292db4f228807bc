#include "router/block_index.h"

#include <algorithm>
#include <cassert>

namespace kvrouter {

BlockIndex::BlockIndex() {
  chunks_.emplace_back(kChunkSize);
  num_node_slots_ = 1;  // the root
}

BlockIndex::~BlockIndex() {
  for (std::uint32_t i = 0; i < num_node_slots_; ++i) node(i).holders.Release(holder_heap_bytes_);
}

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
  } else {
    s = static_cast<std::uint32_t>(slots_.size());
    slots_.emplace_back();
    key_of_slot_.emplace_back();
  }
  slots_[s].key = worker;
  key_of_slot_[s] = worker;
  slots_[s].in_use = true;
  slot_of_.emplace(worker, s);
  ranks_of_[worker.worker_id].push_back(s);
  return s;
}

std::uint32_t BlockIndex::ChildOrCreate(std::uint32_t parent, SequenceHash seq) {
  // A 64-bit sequence hash names one prefix (collisions are as unlikely as in the engines'
  // own prefix caches), so an existing node under this hash is this prefix.
  if (std::uint32_t c = node_of_.Find(seq); c != kFlatEmpty) return c;
  std::uint32_t c;
  if (free_nodes_ != kFlatEmpty) {
    c = free_nodes_;
    free_nodes_ = node(c).parent;
  } else {
    c = num_node_slots_++;
    if ((c >> kChunkBits) == chunks_.size()) chunks_.emplace_back(kChunkSize);
  }
  Node& n = node(c);
  n.seq = seq;
  n.parent = parent;
  n.num_children = 0;
  n.orphan_risk = 0;
  ++node(parent).num_children;
  node_of_.Insert(seq, c);
  ++live_nodes_;
  return c;
}

void BlockIndex::AddHolding(std::uint32_t slot, std::uint32_t i) {
  if (!node(i).holders.Insert(slot, holder_heap_bytes_)) ++slots_[slot].extra_refs[i];
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
  [[maybe_unused]] bool erased = n.holders.Erase(slot, holder_heap_bytes_);
  assert(erased);
  if (n.num_children > 0) n.orphan_risk = 1;
  MaybeFree(i);
}

void BlockIndex::MaybeFree(std::uint32_t i) {
  while (i != kRoot && node(i).holders.empty() && node(i).num_children == 0) {
    Node& n = node(i);
    const std::uint32_t parent = n.parent;
    node_of_.Erase(n.seq);
    n.holders.Release(holder_heap_bytes_);
    n.parent = free_nodes_;
    free_nodes_ = i;
    --live_nodes_;
    --node(parent).num_children;
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
    const std::uint32_t child = ChildOrCreate(parent, seqs[i]);
    if (!w.mapped && node(child).seq != b.block_hash) MakeMapped(slot);
    if (!w.mapped) {
      // The engine hash names this node, so a known one is this very holding.
      if (node(child).holders.Insert(slot, holder_heap_bytes_)) {
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

ApplyOutcome BlockIndex::ApplyRemoved(WorkerKey worker, std::span<const BlockHash> block_hashes) {
  ApplyOutcome out;
  const std::uint32_t slot = FindSlot(worker);
  for (BlockHash h : block_hashes) {
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
  auto drop = [&](std::uint32_t n) {
    // A stale or repeated canonical entry finds the slot gone (a freed node has no holders).
    if (node(n).holders.Erase(slot, holder_heap_bytes_)) MaybeFree(n);
  };
  if (!w.mapped) {
    for (std::uint32_t n : w.held) drop(n);
  } else {
    w.blocks.ForEach([&](const U64MapTraits::Entry& e) {
      auto& extra = w.extra_refs;
      if (!extra.empty()) {
        if (auto it = extra.find(e.value); it != extra.end()) {
          if (--it->second == 0) extra.erase(it);
          return;
        }
      }
      drop(e.value);
    });
  }
  w.held = {};
  w.canonical_blocks = 0;
  w.blocks.Clear();
  w.extra_refs.clear();
  w.mapped = false;
  return dropped;
}

std::size_t BlockIndex::ClearRank(WorkerKey worker) {
  const std::uint32_t slot = FindSlot(worker);
  return slot == kFlatEmpty ? 0 : ClearSlot(slot);
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
    free_slots_.push_back(slot);
  }
  ranks_of_.erase(it);
  return dropped;
}

std::size_t BlockIndex::TreeSize(WorkerKey worker) const {
  const std::uint32_t slot = FindSlot(worker);
  return slot == kFlatEmpty ? 0 : slots_[slot].holdings();
}

// One function on purpose (74 lines): the route's hot path, with the prefetch pipeline, the
// holder-set walk and its fallback sharing locals that splitting would pass around.
namespace {

// The two ways FindMatches reports workers. They write through a local pointer: at 7,000
// workers sharing a first block they write every score of the request, and push_back would
// reload and store the vector's end for each one.
// Writes every slot of `holders` (sorted) that is not in `kept` (a sorted subset) at `depth`.
OverlapScore* EmitMissing(std::span<const std::uint32_t> holders, std::span<const std::uint32_t> kept,
                          std::uint32_t depth, const WorkerKey* key_of_slot, OverlapScore* w) {
  std::size_t j = 0;
  for (std::uint32_t s : holders) {
    if (j < kept.size() && kept[j] == s) {
      ++j;
    } else {
      *w++ = {key_of_slot[s], depth};
    }
  }
  return w;
}

OverlapScore* EmitAll(std::span<const std::uint32_t> holders, std::uint32_t depth, const WorkerKey* key_of_slot,
                      OverlapScore* w) {
  for (std::uint32_t s : holders) *w++ = {key_of_slot[s], depth};
  return w;
}

}  // namespace

void BlockIndex::FindMatches(std::span<const SequenceHash> hashes, OverlapScores& out) const {
  // Phase 1: the nodes of the request's path. The lookups are independent, so prefetching a
  // few levels ahead overlaps their cache misses.
  constexpr std::size_t kAhead = 8;
  thread_local std::vector<std::uint32_t> path;
  path.clear();
  for (std::size_t i = 0; i < std::min(kAhead, hashes.size()); ++i) node_of_.Prefetch(hashes[i]);
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (i + kAhead < hashes.size()) node_of_.Prefetch(hashes[i + kAhead]);
    const std::uint32_t n = node_of_.Find(hashes[i]);
    if (n == kFlatEmpty) break;
    __builtin_prefetch(&node(n));
    path.push_back(n);
  }
  if (path.empty()) return;
  // No worker matches without the first block: room for its holders, trimmed at the end.
  const std::size_t base = out.size();
  out.resize(base + node(path[0]).holders.size());
  OverlapScore* w = out.data() + base;
  const WorkerKey* keys = key_of_slot_.data();
  auto finish = [&] {
    assert(w <= out.data() + out.size());  // every worker written holds the first block, once
    out.resize(static_cast<std::size_t>(w - out.data()));
  };

  // Phase 2: walk the path. The workers still matching are either exactly holders(cur)
  // ("lazy": no copy; valid while cur has no orphan risk, because then every child's holders
  // are a subset of cur's) or an explicit sorted list.
  bool lazy = true;
  thread_local std::vector<std::uint32_t> active;
  thread_local std::vector<std::uint32_t> next;
  std::uint32_t cur = path[0];
  std::uint32_t depth = 1;
  for (; depth < path.size(); ++depth) {
    const std::uint32_t child = path[depth];
    const auto child_holders = node(child).holders.view();
    if (lazy && !node(cur).orphan_risk) {
      const auto cur_holders = node(cur).holders.view();
      if (child_holders.size() != cur_holders.size()) {
        // child_holders is a subset: emit cur's holders missing from child.
        w = EmitMissing(cur_holders, child_holders, depth, keys, w);
        if (child_holders.empty()) return finish();
      }
      cur = child;
      continue;
    }
    if (lazy) {
      const auto cur_holders = node(cur).holders.view();
      active.assign(cur_holders.begin(), cur_holders.end());
      lazy = false;
    }
    next.clear();
    std::size_t j = 0;
    for (std::uint32_t s : active) {
      while (j < child_holders.size() && child_holders[j] < s) ++j;
      if (j < child_holders.size() && child_holders[j] == s) {
        next.push_back(s);
      } else {
        *w++ = {keys[s], depth};
      }
    }
    active.swap(next);
    if (active.empty()) return finish();
    cur = child;
    if (active.size() == child_holders.size()) lazy = true;  // active == holders(child)
  }
  w = EmitAll(lazy ? node(cur).holders.view() : std::span<const std::uint32_t>(active), depth, keys, w);
  finish();
}

IndexMemory BlockIndex::Memory() const {
  IndexMemory m;
  m.nodes = live_nodes_;
  m.bytes = chunks_.size() * kChunkSize * sizeof(Node) + node_of_.memory_bytes() + holder_heap_bytes_ +
            slots_.capacity() * sizeof(WorkerSlot);
  for (const WorkerSlot& w : slots_) {
    m.bytes += w.blocks.memory_bytes() + w.held.capacity() * sizeof(std::uint32_t);
    m.holdings += w.holdings();
  }
  // Per-worker bookkeeping maps: an estimate of their node sizes.
  m.bytes += (slot_of_.size() + ranks_of_.size()) * 64;
  return m;
}

}  // namespace kvrouter
