#include "router/index/block_index.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

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

void SplitTiers(OverlapScores& scores, std::unordered_map<WorkerKey, TieredOverlap, WorkerKeyHash>& tiers) {
  tiers.clear();
  std::size_t kept = 0;
  for (std::size_t i = 0; i < scores.size(); ++i) {
    const OverlapScore s = scores[i];
    if ((s.worker.dp_rank & kTierRankBits) == 0) {
      scores[kept++] = s;
      continue;
    }
    TieredOverlap& t = tiers[{s.worker.worker_id, s.worker.dp_rank & ~kTierRankBits}];
    if (s.worker.dp_rank & kHostTierRank) {
      t.host = std::max(t.host, s.blocks);
    } else {
      t.any = std::max(t.any, s.blocks);
    }
  }
  scores.resize(kept);
  if (tiers.empty()) return;
  // Fold in the device figures and make the three cumulative.
  for (const OverlapScore& s : scores) {
    if (auto it = tiers.find(s.worker); it != tiers.end()) it->second.device = s.blocks;
  }
  for (auto& [key, t] : tiers) {
    t.host = std::max(t.host, t.device);
    t.any = std::max(t.any, t.host);
  }
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

RankOverlaps::RankOverlaps(OverlapScores& scores) : scores_(scores) {
  SplitTiers(scores_, tiers_);
  std::sort(scores_.begin(), scores_.end(),
            [](const OverlapScore& a, const OverlapScore& b) { return a.worker < b.worker; });
}

TieredOverlap RankOverlaps::At(WorkerKey rank) {
  while (next_ < scores_.size() && scores_[next_].worker < rank) ++next_;
  if (!tiers_.empty()) {
    if (auto t = tiers_.find(rank); t != tiers_.end()) return t->second;
  }
  if (next_ < scores_.size() && scores_[next_].worker == rank) {
    const std::uint32_t n = scores_[next_].blocks;
    return {n, n, n};
  }
  return {};
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

namespace {

// An exact read runs while no event is being applied (ReadGate), so it reads plainly and trusts
// what it reads; a tolerant one checks every slot and loads each word atomically.
template <bool kTolerant>
std::uint32_t Word(const std::uint32_t& v) {
  if constexpr (kTolerant) {
    return RelaxedLoad(v);
  } else {
    return v;
  }
}

// Calls f(slot) for every slot of `holders` not in `kept` (both sorted); returns how many of
// kept's slots it met in holders.
template <bool kTolerant, typename F>
std::size_t ForEachMissing(std::span<const std::uint32_t> holders, std::span<const std::uint32_t> kept, F&& f) {
  std::size_t j = 0, matched = 0;
  for (const std::uint32_t& h : holders) {
    const std::uint32_t s = Word<kTolerant>(h);
    while (j < kept.size() && Word<kTolerant>(kept[j]) < s) ++j;
    if (j < kept.size() && Word<kTolerant>(kept[j]) == s) {
      ++j;
      ++matched;
    } else {
      f(s);
    }
  }
  return matched;
}

// Where FindMatches writes its scores: through a local pointer (at 7,000 workers sharing a first
// block it writes every score of the request, and push_back would reload and store the
// vector's end for each one), never past the room made for the first block's holders, and only
// for slots that have a key. The walk emits each slot at most once by construction (below), so
// a tolerant read needs no record of the slots it has emitted.
template <bool kTolerant>
class ScoreWriter {
 public:
  static constexpr bool kIsTolerant = kTolerant;
  ScoreWriter(OverlapScores& out, const PublishedArray<std::uint32_t>& keys) : out_(out), key_words_(keys) {}

  // Room for the first block's holders: no slot is emitted that is not one of them. The keys
  // are taken now, after those holders were read: a slot is keyed before it joins a holder set.
  void Begin(std::size_t room) {
    const auto keys = key_words_.Snapshot();
    keys_ = keys.data;
    slots_ = keys.size / 3;
    const std::size_t base = out_.size();
    out_.resize(base + room);
    w_ = out_.data() + base;
    end_ = out_.data() + out_.size();
  }
  void Finish() { out_.resize(static_cast<std::size_t>(w_ - out_.data())); }

  void Emit(std::uint32_t slot, std::uint32_t depth) { w_ = Put(w_, slot, depth); }
  // Every slot of `holders` not in `kept` (both sorted). With `check`, returns whether kept is
  // a subset of holders (else true): always so in an exact read below a node without orphan
  // risk; below one with it kept may hold a worker holders lack, and in a tolerant read a slot
  // the event in progress has added below and not yet (as the reader saw it) above. (The loops
  // write through a local pointer: memcpy may alias any member.)
  bool EmitMissing(std::span<const std::uint32_t> holders, const std::uint64_t* /*stamp_at*/,
                   std::span<const std::uint32_t> kept, std::uint32_t depth, bool check) {
    OverlapScore* o = w_;
    const std::size_t matched =
        ForEachMissing<kTolerant>(holders, kept, [&](std::uint32_t s) { o = Put(o, s, depth); });
    w_ = o;
    return !check || matched == kept.size();
  }
  void EmitAll(std::span<const std::uint32_t> holders, std::uint32_t depth,
               const std::uint64_t* /*stamp_at*/ = nullptr) {
    OverlapScore* o = w_;
    for (const std::uint32_t& h : holders) o = Put(o, Word<kTolerant>(h), depth);
    w_ = o;
  }

 private:
  // Writes slot's score at o; returns where the next one goes.
  OverlapScore* Put(OverlapScore* o, std::uint32_t slot, std::uint32_t depth) const {
    if constexpr (kTolerant) {
      if (slot >= slots_ || o == end_) return o;
    } else {
      assert(slot < slots_ && o != end_);
    }
    const std::uint32_t* k = keys_ + 3 * std::size_t{slot};
    if constexpr (kTolerant) {
      const std::uint64_t id = (std::uint64_t{RelaxedLoad(k[1])} << 32) | RelaxedLoad(k[0]);
      *o = {WorkerKey{id, RelaxedLoad(k[2])}, depth};
    } else {
      std::memcpy(static_cast<void*>(&o->worker), k, sizeof(WorkerKey));  // worker_id low, high, dp_rank
      o->blocks = depth;
    }
    return o + 1;
  }

  OverlapScores& out_;
  const PublishedArray<std::uint32_t>& key_words_;
  OverlapScore* w_ = nullptr;
  OverlapScore* end_ = nullptr;
  const std::uint32_t* keys_ = nullptr;
  std::size_t slots_ = 0;
};

// Where FindMatches writes its runs (MatchRuns): where most of the matching set drops out at a
// depth, the whole set as read before the drop is copied as one run at that depth (those that
// go on match again, deeper, in a later run) rather than written slot by slot. So a prompt
// whose first block thousands of workers hold, and whose next block few do, costs one copy of
// the first block's holder array.
template <bool kTolerant>
class RunWriter {
 public:
  static constexpr bool kIsTolerant = kTolerant;
  RunWriter(MatchRuns& out, std::span<const std::uint64_t> known) : out_(out), known_(known) {}

  void Begin(std::size_t room) { out_.slots.reserve(out_.slots.size() + room); }
  void Finish() {}

  void Emit(std::uint32_t slot, std::uint32_t depth) {
    Open(depth);
    out_.slots.push_back(slot);
    out_.runs.back().end = static_cast<std::uint32_t>(out_.slots.size());
  }
  // The slots of `holders` that drop out here (not in `kept`, the child's holders; both sorted)
  // at depth: when most drop out, all of holders copied (those kept come again, deeper); when
  // at most half do, only those, found by a merge. So no walk writes more than twice the slots
  // it reports. With `check`, returns whether kept is a subset of holders (see
  // ScoreWriter::EmitMissing).
  bool EmitMissing(std::span<const std::uint32_t> holders, const std::uint64_t* stamp_at,
                   std::span<const std::uint32_t> kept, std::uint32_t depth, bool check) {
    if (kept.size() * 2 >= holders.size()) {
      const std::size_t matched = ForEachMissing<kTolerant>(holders, kept, [&](std::uint32_t s) { Emit(s, depth); });
      return !check || matched == kept.size();
    }
    EmitAll(holders, depth, stamp_at);
    return !check || Subset(kept, holders);
  }
  // holders, whole: a run of their own where they are one version of a set with a stamp
  // (HolderSet::ReadView's stamp_at), elided where the reader knows that version.
  void EmitAll(std::span<const std::uint32_t> holders, std::uint32_t depth, const std::uint64_t* stamp_at = nullptr) {
    if (holders.empty()) return;
    if (const std::uint64_t stamp = HolderSet::LoadStamp(stamp_at); stamp != 0) {
      const auto end = static_cast<std::uint32_t>(out_.slots.size());
      const bool known = std::binary_search(known_.begin(), known_.end(), stamp);
      out_.runs.push_back({.end = end,
                           .depth = depth,
                           .stamp = stamp,
                           .elided = known ? static_cast<std::uint32_t>(holders.size()) : 0});
      if (known) return;
    } else {
      Open(depth);
    }
    const std::size_t n = out_.slots.size();
    out_.slots.resize(n + holders.size());
    if constexpr (kTolerant) {
      std::uint32_t* o = out_.slots.data() + n;
      for (const std::uint32_t& h : holders) *o++ = Word<kTolerant>(h);
    } else {
      std::memcpy(out_.slots.data() + n, holders.data(), holders.size() * sizeof(std::uint32_t));
    }
    out_.runs.back().end = static_cast<std::uint32_t>(out_.slots.size());
  }

 private:
  void Open(std::uint32_t depth) {
    if (out_.runs.empty() || out_.runs.back().depth != depth || out_.runs.back().stamp != 0) {
      out_.runs.push_back({static_cast<std::uint32_t>(out_.slots.size()), depth});
    }
  }
  // a within b, both sorted: a few binary searches when a is small against b (the usual drop
  // from thousands of holders to a few), else one merge.
  static bool Subset(std::span<const std::uint32_t> a, std::span<const std::uint32_t> b) {
    if (a.size() > b.size()) return false;
    if (a.size() * 16 < b.size()) {
      for (const std::uint32_t& x : a) {
        const std::uint32_t s = Word<kTolerant>(x);
        const auto it =
            std::partition_point(b.begin(), b.end(), [&](const std::uint32_t& y) { return Word<kTolerant>(y) < s; });
        if (it == b.end() || Word<kTolerant>(*it) != s) return false;
      }
      return true;
    }
    return ForEachMissing<kTolerant>(b, a, [](std::uint32_t) {}) == a.size();
  }

  MatchRuns& out_;
  std::span<const std::uint64_t> known_;
};

}  // namespace

void BlockIndex::FindMatches(std::span<const SequenceHash> hashes, OverlapScores& out, bool tolerant) const {
  if (tolerant) {
    ScoreWriter<true> w(out, key_words_);
    WalkMatches(hashes, w);
  } else {
    ScoreWriter<false> w(out, key_words_);
    WalkMatches(hashes, w);
  }
}

void BlockIndex::FindMatches(std::span<const SequenceHash> hashes, MatchRuns& out, bool tolerant,
                             std::span<const std::uint64_t> known) const {
  out.clear();
  out.slot_reuses = slot_reuses_.load(std::memory_order_acquire);
  if (tolerant) {
    RunWriter<true> w(out, known);
    WalkMatches(hashes, w);
  } else {
    RunWriter<false> w(out, known);
    WalkMatches(hashes, w);
  }
}

bool BlockIndex::TranslateMatches(const MatchRuns& runs, OverlapScores& out, bool tolerant) const {
  if (slot_reuses_.load(std::memory_order_acquire) != runs.slot_reuses) return false;
  if (runs.any_elided()) return false;
  const std::size_t base = out.size();
  if (tolerant) {
    Translate<true>(runs, key_words_.Snapshot(), out);
  } else {
    Translate<false>(runs, key_words_.Snapshot(), out);
  }
  // The keys read are the slots' keys as of the runs' read unless a slot was handed to another
  // worker since: SlotFor counts before it writes the new key.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (slot_reuses_.load(std::memory_order_relaxed) != runs.slot_reuses) {
    out.resize(base);
    return false;
  }
  return true;
}

template <bool kTolerant>
void BlockIndex::Translate(const MatchRuns& runs, PublishedArray<std::uint32_t>::View keys, OverlapScores& out) {
  // A slot's overlap is its last run's depth (the depths ascend), so the runs are read from the
  // last, each slot written the first time it is met: deepest first.
  const std::size_t slots = keys.size / 3;
  thread_local std::vector<std::uint64_t> seen;
  seen.assign((slots + 63) / 64, 0);
  const std::size_t base = out.size();
  out.resize(base + runs.slots.size());
  OverlapScore* o = out.data() + base;
  for (std::size_t r = runs.runs.size(); r-- > 0;) {
    const std::uint32_t begin = r == 0 ? 0 : runs.runs[r - 1].end, depth = runs.runs[r].depth;
    for (std::uint32_t i = runs.runs[r].end; i-- > begin;) {
      const std::uint32_t slot = runs.slots[i];
      if (slot >= slots) continue;  // not a slot of this index: nothing to name
      std::uint64_t& word = seen[slot >> 6];
      const std::uint64_t bit = std::uint64_t{1} << (slot & 63);
      if ((word & bit) != 0) continue;
      word |= bit;
      const std::uint32_t* k = keys.data + 3 * std::size_t{slot};
      const std::uint64_t id = (std::uint64_t{Word<kTolerant>(k[1])} << 32) | Word<kTolerant>(k[0]);
      *o++ = {WorkerKey{id, Word<kTolerant>(k[2])}, depth};
    }
  }
  out.resize(static_cast<std::size_t>(o - out.data()));
}

// One function on purpose: the route's hot path, with the prefetch pipeline, the holder-set
// walk and its fallback sharing locals that splitting would pass around.
// Everything is read through snapshots and atomic loads, so it may run while the owner writes
// (see the header comment): a node found by hash is used only if it carries that hash.
template <typename Writer>
void BlockIndex::WalkMatches(std::span<const SequenceHash> hashes, Writer& w) const {
  constexpr bool kTolerant = Writer::kIsTolerant;
  const auto table = node_of_.Snapshot();
  const auto dir = chunk_dir_.Snapshot();
  auto node_at = [&](std::uint32_t i) -> const Node* {
    const std::size_t c = i >> kChunkBits;
    const Node* chunk = c < dir.size ? AcquireLoad(dir.data[c]) : nullptr;
    return chunk == nullptr ? nullptr : chunk + (i & (kChunkSize - 1));
  };
  // Phase 1: the nodes of the request's path. The lookups are independent, so prefetching a
  // few levels ahead overlaps their cache misses.
  constexpr std::size_t kAhead = 8;
  thread_local std::vector<const Node*> path;
  path.clear();
  for (std::size_t i = 0; i < std::min(kAhead, hashes.size()); ++i) table.Prefetch(hashes[i]);
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (i + kAhead < hashes.size()) table.Prefetch(hashes[i + kAhead]);
    const Node* n = node_at(table.Find(hashes[i]));
    if (n == nullptr) break;
    PrefetchLine(n);
    path.push_back(n);
  }
  if (path.empty() || RelaxedLoad(path[0]->seq) != hashes[0]) return;

  // Phase 2: walk the path. `held`, the workers still matching and not yet emitted, is one
  // version of a holder set read once ("lazy": no copy; each inline set is read into one of
  // two small buffers, tmp[t] backing held) or an explicit sorted list (`active`). Every step
  // emits held minus the child's holders (a RunWriter: all of held) and continues with a
  // subset of held, so every emitted slot belongs to the first block's set as read here, and a
  // ScoreWriter emits it once: the room for it.
  std::uint32_t tmp[2][2];
  unsigned t = 0;
  const std::uint64_t* held_stamp = nullptr;  // the stamp of the version held is, whole (null: none)
  std::span<const std::uint32_t> held = path[0]->holders.ReadView(tmp[t], held_stamp);
  w.Begin(held.size());

  // Lazy is valid while each child's set as read is a subset of held: so below a node without
  // orphan risk in an exact read (and there equal sizes mean equal sets); below one with it the
  // subset is checked, and in a tolerant read wherever the sizes differ. Otherwise the walk
  // intersects explicitly.
  bool lazy = true;
  thread_local std::vector<std::uint32_t> active;
  thread_local std::vector<std::uint32_t> next;
  auto intersect = [&](std::span<const std::uint32_t> a, std::span<const std::uint32_t> b) {
    active.clear();
    std::size_t j = 0;
    for (const std::uint32_t& x : a) {
      const std::uint32_t s = Word<kTolerant>(x);
      while (j < b.size() && Word<kTolerant>(b[j]) < s) ++j;
      if (j < b.size() && Word<kTolerant>(b[j]) == s) active.push_back(s);
    }
  };
  const Node* cur = path[0];
  std::uint32_t depth = 1;
  for (; depth < path.size(); ++depth) {
    const Node* child = path[depth];
    if (RelaxedLoad(child->seq) != hashes[depth]) break;  // recycled or moved meanwhile: path ends
    if (lazy) {
      // Sizes first: without orphan risk equal sizes (the common case) need neither holder array.
      const bool risk = (RelaxedLoad(cur->meta) & 1) != 0;
      if (risk || child->holders.ReadSize() != held.size()) {
        const std::uint64_t* child_stamp = nullptr;
        const auto child_holders = child->holders.ReadView(tmp[t ^ 1], child_stamp);
        const bool subset = w.EmitMissing(held, held_stamp, child_holders, depth, kTolerant || risk);
        if (child_holders.empty()) return w.Finish();
        if (subset) {
          held = child_holders;
          held_stamp = child_stamp;
          t ^= 1;
        } else {  // a worker below that held lacks: orphan risk, or an event in progress (tolerant)
          intersect(held, child_holders);
          lazy = false;
        }
      }
      cur = child;
      continue;
    }
    const std::uint64_t* child_stamp = nullptr;
    const auto child_holders = child->holders.ReadView(tmp[t ^ 1], child_stamp);
    next.clear();
    std::size_t j = 0;
    for (std::uint32_t s : active) {
      while (j < child_holders.size() && Word<kTolerant>(child_holders[j]) < s) ++j;
      if (j < child_holders.size() && Word<kTolerant>(child_holders[j]) == s) {
        next.push_back(s);
      } else {
        w.Emit(s, depth);
      }
    }
    active.swap(next);
    if (active.empty()) return w.Finish();
    cur = child;
    if (active.size() == child_holders.size()) {  // active == holders(child) as read
      held = child_holders;
      held_stamp = child_stamp;
      t ^= 1;
      lazy = true;
    }
  }
  if (lazy) {
    w.EmitAll(held, depth, held_stamp);
  } else {
    w.EmitAll(active, depth);
  }
  w.Finish();
}

void BlockIndex::DumpRank(WorkerKey rank, std::vector<DumpedChain>& out, std::size_t max_chain_blocks) const {
  max_chain_blocks = std::max<std::size_t>(max_chain_blocks, 1);
  const WorkerKey device{rank.worker_id, rank.dp_rank & ~kTierRankBits};
  constexpr StorageTier kTiers[] = {StorageTier::kDevice, StorageTier::kHostPinned, StorageTier::kDisk};
  // Per tier: the rank's (node, engine hash) holdings, each node's first holding by node number
  // (the hash that names it as a parent), and per first holding: kInner (a parent of another
  // holding on this tier), kPlaced (its run is decided), kEmitted (and written), kWaiting (its
  // run waits this round for a parent on another tier: not climbed again until the next round).
  enum : std::uint8_t { kInner = 1, kPlaced = 2, kEmitted = 4, kWaiting = 8 };
  struct Tier {
    std::vector<std::pair<std::uint32_t, BlockHash>> held;
    FlatTable<U64MapTraits> first;
    std::vector<std::uint8_t> flags;
    std::uint32_t Find(std::uint32_t n) const { return first.size() == 0 ? kFlatEmpty : first.Find(n); }
  };
  std::array<Tier, 3> tiers;
  for (std::size_t t = 0; t < 3; ++t) {
    const std::uint32_t slot = FindSlot(TierRank(device, kTiers[t]));
    if (slot == kFlatEmpty) continue;
    const WorkerSlot& w = slots_[slot];
    Tier& tier = tiers[t];
    auto hold = [&](std::uint32_t n, BlockHash h) {
      if (tier.first.Find(n) == kFlatEmpty) tier.first.Insert(n, static_cast<std::uint32_t>(tier.held.size()));
      tier.held.emplace_back(n, h);
    };
    if (!w.mapped) {
      for (std::uint32_t n : w.held) {  // stale and repeated entries are skipped
        if (node(n).holders.Contains(slot) && tier.first.Find(n) == kFlatEmpty) hold(n, node(n).seq);
      }
    } else {
      w.blocks.ForEach([&](const U64MapTraits::Entry& e) { hold(e.value, U64MapTraits::KeyOf(e)); });
    }
    tier.flags.assign(tier.held.size(), 0);
    for (const auto& [n, h] : tier.held) {
      if (const std::uint32_t p = tier.Find(node(n).parent); p != kFlatEmpty) tier.flags[p] |= kInner;
    }
  }
  // Where the parent of a run on tier t stands: the root, written (its engine hash on a tier
  // where it is written: this tier first; a block offloaded from GPU to CPU names its parent
  // wherever that is), still to be written on some tier (the run waits for it), or nowhere (the
  // run is left out).
  enum class Parent { kNone, kWritten, kPending, kMissing };  // kNone: the root
  auto resolve = [&](std::size_t t, std::uint32_t parent, BlockHash& hash) {
    if (parent == kRoot) return Parent::kNone;
    bool pending = false;
    for (std::size_t k : {t, std::size_t{0}, std::size_t{1}, std::size_t{2}}) {
      const std::uint32_t i = tiers[k].Find(parent);
      if (i == kFlatEmpty) continue;
      if ((tiers[k].flags[i] & kEmitted) != 0) {
        hash = tiers[k].held[i].second;
        return Parent::kWritten;
      }
      if ((tiers[k].flags[i] & kPlaced) == 0) pending = true;
    }
    return pending ? Parent::kPending : Parent::kMissing;
  };
  // A run's blocks on tier t, in chains of at most max_chain_blocks.
  auto emit_run = [&](std::size_t t, std::optional<BlockHash> parent, auto&& blocks, std::size_t size) {
    for (std::size_t i = 0; i < size; i += max_chain_blocks) {
      DumpedChain& c = out.emplace_back();
      c.tier = kTiers[t];
      c.stored.parent_hash = i == 0 ? parent : std::optional<BlockHash>(blocks(i - 1).block_hash);
      const std::size_t end = std::min(size, i + max_chain_blocks);
      c.stored.blocks.reserve(end - i);
      for (std::size_t k = i; k < end; ++k) c.stored.blocks.push_back(blocks(k));
    }
  };
  // Rounds over the tiers (device, host, disk) until nothing more can be written: a run whose
  // parent is on another tier and not written yet waits for a later round.
  std::vector<std::uint32_t> climb;  // first holdings, from a leaf up
  std::array<std::vector<bool>, 3> extra_done;
  for (std::size_t t = 0; t < 3; ++t) extra_done[t].assign(tiers[t].held.size(), false);
  // Another round only while runs wait and the last round wrote something they may wait for.
  for (bool again = true; again;) {
    bool progress = false, waited = false;
    for (Tier& tier : tiers) {
      for (std::uint8_t& f : tier.flags) f &= ~kWaiting;
    }
    for (std::size_t t = 0; t < 3; ++t) {
      Tier& tier = tiers[t];
      // Leaves first: climbing from a leaf writes its whole path in one run, so a tree of k
      // leaves comes out as k runs rather than a block at a time.
      for (const bool leaves : {true, false}) {
        for (std::uint32_t k = 0; k < tier.held.size(); ++k) {
          const std::uint32_t i = tier.Find(tier.held[k].first);
          if (((tier.flags[i] & kInner) == 0) != leaves) continue;
          if ((tier.flags[i] & (kPlaced | kWaiting)) == 0) {
            // Up to the highest ancestor on this tier not yet placed, then down from it.
            climb.clear();
            bool waits = false;
            for (std::uint32_t m = i;;) {
              climb.push_back(m);
              const std::uint32_t p = tier.Find(node(tier.held[m].first).parent);
              if (p == kFlatEmpty || (tier.flags[p] & kPlaced) != 0) break;
              if ((tier.flags[p] & kWaiting) != 0) {  // below a run that waits: waits too
                waits = true;
                break;
              }
              m = p;
            }
            BlockHash hash = 0;
            const Parent parent =
                waits ? Parent::kPending : resolve(t, node(tier.held[climb.back()].first).parent, hash);
            if (parent == Parent::kPending) {
              for (std::uint32_t m : climb) tier.flags[m] |= kWaiting;
              waited = true;
              continue;
            }
            const bool written = parent != Parent::kMissing;
            for (std::uint32_t m : climb) tier.flags[m] |= kPlaced | (written ? kEmitted : 0);
            progress = true;
            if (written) {
              emit_run(
                  t, parent == Parent::kNone ? std::nullopt : std::optional<BlockHash>(hash),
                  [&](std::size_t j) {
                    const auto& [n, h] = tier.held[climb[climb.size() - 1 - j]];
                    return StoredBlock{h, local_of(n)};
                  },
                  climb.size());
            }
          }
          if (k != i && !extra_done[t][k] && (tier.flags[i] & kEmitted) != 0) {
            // A second engine hash of the same block, under the same parent.
            extra_done[t][k] = true;
            BlockHash hash = 0;
            const Parent parent = resolve(t, node(tier.held[k].first).parent, hash);
            if (parent == Parent::kNone || parent == Parent::kWritten) {
              const StoredBlock block{tier.held[k].second, local_of(tier.held[k].first)};
              emit_run(
                  t, parent == Parent::kNone ? std::nullopt : std::optional<BlockHash>(hash),
                  [&](std::size_t) { return block; }, 1);
            }
          }
        }
      }
    }
    again = progress && waited;
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
