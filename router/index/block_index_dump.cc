// BlockIndex (block_index.h), DumpRank: a rank's blocks on every storage tier read back as
// stored chains that rebuild it (router.dump: a peer replica warms its index from them).
#include "router/index/block_index.h"

#include <algorithm>
#include <array>

namespace kvrouter {

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

}  // namespace kvrouter
