// Storage tiers folded back (block_index.h): SplitTiers and RankOverlaps turn FindMatches'
// entries for a rank's host and disk tier ranks into one TieredOverlap per rank. TierRank, which
// keys a tier's blocks when they are stored, is with the writer (block_index_write.cc).
#include "router/index/block_index.h"

#include <algorithm>

namespace kvrouter {

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

}  // namespace kvrouter
