// Helpers shared by the BlockIndex tests (block_index_test.cc, block_index_dump_test.cc): chains
// to store, a query read both ways (scores, and runs translated, which must agree), and an index
// rebuilt from another's dumps. Test code: gtest assertions inside; single-threaded.
//
//   BlockIndex idx;  (void)idx.ApplyStored(kW1, std::nullopt, Chain(100, {1, 2}));
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "events/block_hash.h"
#include "router/index/block_index.h"

namespace kvrouter {

inline constexpr WorkerKey kW1{1, 0};
inline constexpr WorkerKey kW2{2, 0};

// A chain whose engine hashes are `first_id, first_id+1, ...` and token hashes `locals`.
inline std::vector<StoredBlock> Chain(std::uint64_t first_id, std::vector<LocalHash> locals) {
  std::vector<StoredBlock> out;
  for (std::size_t i = 0; i < locals.size(); ++i) out.push_back({first_id + i, locals[i]});
  return out;
}

// The matches of a query, read both ways: scores at once, and runs of slots turned into scores
// (which must agree, in any order).
inline std::map<WorkerKey, std::uint32_t> Matches(const BlockIndex& idx, std::vector<LocalHash> h) {
  const auto seq = ComputeSequenceHashes(h);
  OverlapScores s;
  idx.FindMatches(seq, s);
  MatchRuns runs;
  idx.FindMatches(seq, runs);
  OverlapScores translated;
  EXPECT_TRUE(idx.TranslateMatches(runs, translated));
  auto sorted = [](const OverlapScores& v) {
    std::vector<std::pair<WorkerKey, std::uint32_t>> out;
    for (const OverlapScore& e : v) out.emplace_back(e.worker, e.blocks);
    std::sort(out.begin(), out.end());
    return out;
  };
  EXPECT_EQ(sorted(translated), sorted(s));
  std::uint32_t deepest = 0;
  std::map<WorkerKey, std::uint32_t> out;
  for (auto& e : s) {
    EXPECT_TRUE(out.emplace(e.worker, e.blocks).second) << "worker reported twice";
    deepest = std::max(deepest, e.blocks);
  }
  EXPECT_EQ(runs.max_depth(), deepest);
  return out;
}

// Chains whose engine hashes are their sequence hashes.
inline std::vector<StoredBlock> CanonicalChain(const std::vector<LocalHash>& locals) {
  const auto seq = ComputeSequenceHashes(locals);
  std::vector<StoredBlock> out;
  for (std::size_t i = 0; i < locals.size(); ++i) out.push_back({seq[i], locals[i]});
  return out;
}

// Rebuilds `from` in `to` from DumpRank of every rank, in chains of at most two blocks (so long
// runs are split); every chain must find its parent.
inline void CopyByDump(const BlockIndex& from, BlockIndex& to) {
  std::set<WorkerKey> ranks;
  from.ForEachWorker([&](WorkerKey k, std::size_t) { ranks.insert({k.worker_id, k.dp_rank & ~kTierRankBits}); });
  for (WorkerKey r : ranks) {
    std::vector<DumpedChain> chains;
    from.DumpRank(r, chains, 2);
    for (const DumpedChain& c : chains) {
      EXPECT_LE(c.stored.blocks.size(), 2u);
      const ApplyOutcome o = to.ApplyStored(TierRank(r, c.tier), c.stored.parent_hash, c.stored.blocks);
      EXPECT_FALSE(o.parent_not_found) << "rank " << r.worker_id << "." << r.dp_rank;
    }
  }
}

}  // namespace kvrouter
