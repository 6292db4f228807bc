// BlockIndex (block_index.h), the reader: FindMatches (scores, or runs of holder slots) and
// TranslateMatches, on any thread under the shard's ReadGate, exact or tolerant: the walk of a
// request's path, lazy over holder sets and explicit below orphan risk.
#include "router/index/block_index.h"

#include <algorithm>
#include <cassert>
#include <cstring>

namespace kvrouter {

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

// Where FindMatches writes its scores: through a local pointer (when thousands of workers share
// a first block it writes every score of the request, and push_back would reload and store the
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

}  // namespace kvrouter
