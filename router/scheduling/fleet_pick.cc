// Scheduler's pick over the whole fleet (docs/design.md "Decisions over a large fleet"):
// PickFromFleet, the rank Decide would pick among every registered rank, found without a
// candidate per rank. Idle ranks are priced per class (the registration fields the costs read
// of an idle rank: RankClassKeyOf), crowds of ranks matched alike are counted, not visited, and
// the full scan is the fallback. The cost is resolved once per pick (WithCost). The thread
// contract is Scheduler's (scheduler.h): Routing's mutex is held around every call.
#include <algorithm>
#include <bit>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <unordered_map>

#include "router/scheduling/costs.h"
#include "router/scheduling/scheduler.h"

namespace kvrouter {

bool FleetPickServes(const SchedulerOptions& options, const PreparedRequest& p) {
  return options.mode == RouterMode::kKv && !(p.params.temperature > 0);
}

std::uint64_t Scheduler::RankClasses::Hash(WorkerKey rank) {
  return Mix64(rank.worker_id * 0x9e3779b97f4a7c15ULL + rank.dp_rank);
}

void Scheduler::RankClasses::Prefetch(std::uint64_t hash) const { PrefetchLine(&slots[hash & (slots.size() - 1)]); }

Scheduler::RankClasses::Slot* Scheduler::RankClasses::Find(WorkerKey rank, std::uint64_t hash) {
  const std::size_t mask = slots.size() - 1;
  for (std::size_t i = hash & mask;; i = (i + 1) & mask) {
    Slot& s = slots[i];
    if (s.pos1 == 0) return nullptr;
    if (s.rank == rank) return &s;
  }
}

Scheduler::RankClasses& Scheduler::ClassesOf(const std::shared_ptr<const std::vector<RankInfo>>& ranks) {
  if (classes_.of == ranks) return classes_;
  classes_ = {.of = ranks};
  crowds_.clear();  // their positions are in the old list
  std::map<RankClassKey, std::uint32_t> index;
  const std::size_t n = ranks->size();
  classes_.class_of.resize(n);
  classes_.slots.assign(std::bit_ceil(2 * n + 2), {});
  const std::size_t mask = classes_.slots.size() - 1;
  for (std::uint32_t i = 0; i < n; ++i) {
    const RankInfo& r = (*ranks)[i];
    auto [it, fresh] = index.try_emplace(RankClassKeyOf(r), static_cast<std::uint32_t>(classes_.members.size()));
    if (fresh) classes_.members.emplace_back();
    classes_.members[it->second].push_back(i);
    classes_.class_of[i] = it->second;
    std::size_t slot = RankClasses::Hash(r.worker) & mask;
    while (classes_.slots[slot].pos1 != 0) slot = (slot + 1) & mask;
    classes_.slots[slot] = {.rank = r.worker, .pos1 = i + 1, .cls = it->second};
  }
  return classes_;
}

namespace {

// The k-th smallest (from 0) of `positions` (distinct, each below n; reordered).
std::uint32_t KthPosition(std::vector<std::uint32_t>& positions, std::size_t k, std::size_t n) {
  if (positions.size() * 64 < n) {
    std::nth_element(positions.begin(), positions.begin() + static_cast<std::ptrdiff_t>(k), positions.end());
    return positions[k];
  }
  // Many (a group the index matched alike): the k-th set bit of a bitmap of positions costs
  // n / 64 words, where selecting among the positions costs a pass over each.
  thread_local std::vector<std::uint64_t> bits;
  bits.assign((n + 63) / 64, 0);
  for (const std::uint32_t pos : positions) bits[pos >> 6] |= std::uint64_t{1} << (pos & 63);
  std::size_t left = k;
  for (std::size_t w = 0; w < bits.size(); ++w) {
    const auto count = static_cast<std::size_t>(std::popcount(bits[w]));
    if (left >= count) {
      left -= count;
      continue;
    }
    std::uint64_t word = bits[w];
    for (; left > 0; --left) word &= word - 1;  // drops the lowest set bit
    return static_cast<std::uint32_t>(w * 64 + static_cast<std::size_t>(std::countr_zero(word)));
  }
  return 0;  // unreachable: k < positions.size()
}

// A set of distinct positions, ascending, counted with a sign: the tied ranks are such a signed
// sum (a tied class's members less those priced apart), each position in it at most once.
struct SignedPositions {
  std::span<const std::uint32_t> positions;
  int sign = 1;
};

// The k-th smallest (from 0) position of the signed sum of `sets`: the smallest position with
// k + 1 of them at or before it, by a binary search over positions below n.
std::uint32_t KthPositionOf(std::span<const SignedPositions> sets, std::size_t k, std::size_t n) {
  auto count_upto = [&](std::uint32_t pos) {
    std::ptrdiff_t count = 0;
    for (const SignedPositions& s : sets) {
      count += s.sign * (std::upper_bound(s.positions.begin(), s.positions.end(), pos) - s.positions.begin());
    }
    return count;
  };
  std::uint32_t lo = 0, hi = static_cast<std::uint32_t>(n - 1);
  while (lo < hi) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (count_upto(mid) >= static_cast<std::ptrdiff_t>(k + 1)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

bool Holds(std::span<const std::uint32_t> positions, std::uint32_t pos) {
  return std::binary_search(positions.begin(), positions.end(), pos);
}

bool AnyElided(const IndexMatches& matches) {
  return std::any_of(matches.shards.begin(), matches.shards.end(), [](const MatchRuns& m) { return m.any_elided(); });
}

}  // namespace

bool Scheduler::FullScanIsCheaper(const PreparedRequest& p, std::size_t ranks) const {
  // The ranks priced one by one: under a cost that reads a rank's history, every rank booked or
  // learned; else only those with active load (a rank whose requests have ended is idle).
  const std::size_t one_by_one = WithCost(p.params.model, [&]<class Cost>() {
    return Cost::kReadsHistory ? load_.workers() + rates_.ranks() : load_.active_workers();
  });
  return one_by_one * 2 > ranks;
}

Scheduler::FleetChoice Scheduler::PickFromFleet(const std::shared_ptr<const std::vector<RankInfo>>& ranks,
                                                const PreparedRequest& p, OverlapScores& overlaps, FullRanks full) {
  const std::vector<RankInfo>& all = *ranks;
  FleetChoice out;
  // Where most ranks are priced one by one anyway, the full scan is cheaper and chooses the same.
  if (FullScanIsCheaper(p, all.size())) {
    std::vector<Candidate> cands = Candidates(all, p.seq, overlaps);
    for (const Candidate& c : cands) out.best_overlap = std::max(out.best_overlap, c.overlap_blocks);
    if (full == FullRanks::kExcluded) cands = OpenRanks(std::move(cands));
    if (!cands.empty()) out.chosen = cands[selector_.Pick(options_.mode, p.sel, cands, p.params, rng_)];
    out.full_scan = true;
    return out;
  }
  return PickByClasses(ranks, p, overlaps, {}, full);
}

Scheduler::FleetChoice Scheduler::PickFromFleet(const std::shared_ptr<const std::vector<RankInfo>>& ranks,
                                                const PreparedRequest& p, const IndexMatches& matches,
                                                OverlapScores& overlaps, FullRanks full) {
  thread_local std::vector<CrowdMatch> crowds;
  const bool full_scan = FullScanIsCheaper(p, ranks->size());
  bool met = false;
  // Runs elided by stamps no longer kept (or where the full scan or a translation needs every
  // slot): the index is read again without them, once.
  const IndexMatches* read = &matches;
  thread_local IndexMatches whole;
  for (int pass = 0; pass < 2; ++pass) {
    crowds.clear();
    overlaps.clear();
    if (!full_scan && ReadCrowds(ClassesOf(ranks), *read, overlaps, crowds, met)) {
      return PickByClasses(ranks, p, overlaps, crowds, full);
    }
    if (pass == 1 || !AnyElided(matches)) break;
    index_.FindMatches(p.seq, whole);
    read = &whole;
  }
  overlaps.clear();
  // A slot handed to another worker since the read: the index is read again.
  if (!index_.TranslateMatches(*read, overlaps)) index_.FindMatches(p.seq, overlaps);
  FleetChoice out = PickFromFleet(ranks, p, overlaps, full);
  out.runs_refused = !full_scan && met;
  return out;
}

bool Scheduler::ReadCrowds(RankClasses& classes, const IndexMatches& matches, OverlapScores& overlaps,
                           std::vector<CrowdMatch>& crowds, bool& met) {
  ++crowd_reads_;
  // No run the size of a crowd (a small fleet's every read): the runs are translated as they are.
  const bool any_crowd = std::any_of(matches.shards.begin(), matches.shards.end(), [](const MatchRuns& m) {
    for (std::size_t i = 0; i < m.runs.size(); ++i) {
      if (m.runs[i].elided != 0 || m.runs[i].end - (i == 0 ? 0 : m.runs[i - 1].end) >= kCrowd) return true;
    }
    return false;
  });
  if (!any_crowd) return index_.TranslateMatches(matches, overlaps);
  thread_local IndexMatches rest;  // the runs translated rank by rank
  rest.shards.resize(matches.shards.size());
  for (std::size_t s = 0; s < matches.shards.size(); ++s) {
    const MatchRuns& m = matches.shards[s];
    MatchRuns& r = rest.shards[s];
    r.clear();
    r.slot_reuses = m.slot_reuses;
    for (std::size_t i = 0; i < m.runs.size(); ++i) {
      const std::uint32_t begin = i == 0 ? 0 : m.runs[i - 1].end, end = m.runs[i].end;
      const std::span<const std::uint32_t> slots(m.slots.data() + begin, end - begin);
      if (slots.size() < kCrowd && m.runs[i].elided == 0) {
        r.slots.insert(r.slots.end(), slots.begin(), slots.end());
        r.runs.push_back({static_cast<std::uint32_t>(r.slots.size()), m.runs[i].depth});
        continue;
      }
      met = true;
      const Crowd* crowd = CrowdOf(classes, matches, s, slots, m.runs[i]);
      if (crowd == nullptr || crowd->tiered) return false;
      crowds.push_back({crowd, m.runs[i].depth});
    }
  }
  if (!index_.TranslateMatches(rest, overlaps)) return false;
  if (crowds.empty()) return true;
  // A rank's tiers are folded together from its entries (SplitTiers): a crowd's device depths
  // are not among them.
  return std::none_of(overlaps.begin(), overlaps.end(),
                      [](const OverlapScore& o) { return (o.worker.dp_rank & kTierRankBits) != 0; });
}

const Scheduler::Crowd* Scheduler::CrowdOf(RankClasses& classes, const IndexMatches& matches, std::size_t shard,
                                           std::span<const std::uint32_t> slots, const MatchRuns::Run& run) {
  const std::uint64_t reuses = matches.shards[shard].slot_reuses;
  for (Crowd& c : crowds_) {
    if (c.shard != shard || c.slot_reuses != reuses) continue;
    // A stamp names one version of one holder set in the process: equal stamps, equal slots.
    const bool same = run.stamp != 0 ? c.stamp == run.stamp
                                     : c.slots.size() == slots.size() &&
                                           std::memcmp(c.slots.data(), slots.data(), slots.size_bytes()) == 0;
    if (same) {
      c.used = crowd_reads_;
      ++crowds_reused_;
      crowds_elided_ += run.elided != 0;
      return &c;
    }
  }
  if (run.elided != 0) return nullptr;  // its slots were not read: a read without it follows
  // Translated as the index names its slots now: valid if no slot was reused since the read.
  thread_local IndexMatches one;
  one.shards.resize(matches.shards.size());
  for (std::size_t s = 0; s < matches.shards.size(); ++s) {
    one.shards[s].clear();
    one.shards[s].slot_reuses = matches.shards[s].slot_reuses;
  }
  one.shards[shard].slots.assign(slots.begin(), slots.end());
  one.shards[shard].runs.push_back({static_cast<std::uint32_t>(slots.size()), 1});
  thread_local OverlapScores named;
  named.clear();
  if (!index_.TranslateMatches(one, named)) return nullptr;
  // Its place: a new one, or the one least lately used that this read does not use.
  Crowd* c = nullptr;
  if (crowds_.size() < kept_crowds_) {
    crowds_.reserve(kept_crowds_);  // never moved: this read's crowds are pointed at
    c = &crowds_.emplace_back();
  } else {
    for (Crowd& k : crowds_) {
      if (k.used != crowd_reads_ && (c == nullptr || k.used < c->used)) c = &k;
    }
    if (c == nullptr) return nullptr;
  }
  *c = {.shard = shard, .slot_reuses = reuses, .stamp = run.stamp, .used = crowd_reads_};
  c->slots.assign(slots.begin(), slots.end());
  c->positions.assign(classes.members.size(), {});
  for (const OverlapScore& o : named) {
    if ((o.worker.dp_rank & kTierRankBits) != 0) c->tiered = true;
    const RankClasses::Slot* slot = classes.Find(o.worker, RankClasses::Hash(o.worker));
    if (slot != nullptr) c->positions[slot->cls].push_back(slot->pos1 - 1);  // else not registered
  }
  // A rank twice (a read racing its removal and return saw its old slot and its new one) counts once.
  for (auto& v : c->positions) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
  }
  ++crowds_translated_;
  return c;
}

void Scheduler::CrowdStamps(std::vector<std::uint64_t>& out) const {
  out.clear();
  for (const Crowd& c : crowds_) {
    if (c.stamp != 0 && !c.tiered) out.push_back(c.stamp);
  }
  std::sort(out.begin(), out.end());
}

Scheduler::FleetChoice Scheduler::PickByClasses(const std::shared_ptr<const std::vector<RankInfo>>& ranks,
                                                const PreparedRequest& p, OverlapScores& overlaps,
                                                std::span<const CrowdMatch> crowds, FullRanks full) {
  return WithCost(p.params.model,
                  [&]<class Cost>() { return PickByClassesOf<Cost>(ranks, p, overlaps, crowds, full); });
}

template <typename Cost>
Scheduler::FleetChoice Scheduler::PickByClassesOf(const std::shared_ptr<const std::vector<RankInfo>>& ranks,
                                                  const PreparedRequest& p, OverlapScores& overlaps,
                                                  std::span<const CrowdMatch> crowds, FullRanks full) {
  const std::vector<RankInfo>& all = *ranks;
  const std::size_t n = all.size();
  FleetChoice out;
  RankClasses& classes = ClassesOf(ranks);
  ++class_picks_;
  if (++classes.pick == 0) {  // wrapped: forget every mark
    for (RankClasses::Slot& slot : classes.slots) slot.seen = 0;
    classes.pick = 1;
  }
  using Slot = RankClasses::Slot;
  constexpr std::uint32_t kGrouped = RankClasses::kGrouped;

  // Ranks the router has booked (under a cost that reads no history: that have a request now) or
  // has learned a rate of are priced one by one (each once, in no order, with their overlap). Ranks that only
  // the index sets apart cost what every rank of their class with their overlap costs: such a
  // group is priced once.
  struct Special {
    std::uint32_t pos;
    std::uint32_t cls;
    TieredOverlap overlap;
  };
  thread_local std::vector<Special> special;
  special.clear();
  auto add_special = [&](WorkerKey k) {
    Slot* slot = classes.Find(k, RankClasses::Hash(k));
    if (slot == nullptr || slot->seen == classes.pick) return;  // not registered, or met already
    slot->seen = classes.pick;
    slot->special = static_cast<std::uint32_t>(special.size());
    special.push_back({slot->pos1 - 1, slot->cls, {}});
  };
  load_.ForEachWorker([&](WorkerKey k, const WorkerLoad& l) {
    if (Cost::kReadsHistory || l.active_requests != 0 || l.active_blocks != 0 || l.active_prefill_tokens != 0) {
      add_special(k);
    }
  });
  if constexpr (Cost::kReadsHistory) rates_.ForEachRank(add_special);
  struct GroupKey {
    std::uint32_t cls;
    TieredOverlap overlap;
    bool operator==(const GroupKey&) const = default;
  };
  struct GroupKeyHash {
    std::size_t operator()(const GroupKey& g) const {
      return Mix64((std::uint64_t{g.cls} << 32 | g.overlap.device) ^
                   (std::uint64_t{g.overlap.host} << 32 | g.overlap.any) * 0x9e3779b97f4a7c15ULL);
    }
  };
  thread_local std::unordered_map<GroupKey, std::uint32_t, GroupKeyHash> group_of;
  thread_local std::vector<GroupKey> groups;
  thread_local std::vector<std::uint32_t> group_size;
  thread_local std::vector<std::pair<std::uint32_t, std::uint32_t>> grouped;  // (group, position)
  group_of.clear();
  groups.clear();
  group_size.clear();
  grouped.clear();
  std::uint32_t last_group = 0;
  auto group_for = [&](const GroupKey& key) {
    // Ranks matched alike come together (the index emits a holder set at a time): the last
    // group is looked up first.
    if (!groups.empty() && groups[last_group] == key) return last_group;
    auto [it, fresh] = group_of.try_emplace(key, static_cast<std::uint32_t>(groups.size()));
    if (fresh) {
      groups.push_back(key);
      group_size.push_back(0);
    }
    return last_group = it->second;
  };
  auto add_matched = [&](Slot* slot, TieredOverlap overlap) {
    if (slot == nullptr) return;  // not registered
    if (slot->seen == classes.pick) {
      // Met as a special rank, or (a rank with blocks on several tiers) already with all of them.
      if (slot->special != kGrouped) special[slot->special].overlap = overlap;
      return;
    }
    slot->seen = classes.pick;
    slot->special = kGrouped;
    const std::uint32_t g = group_for({slot->cls, overlap});
    ++group_size[g];
    grouped.emplace_back(g, slot->pos1 - 1);
  };
  thread_local std::unordered_map<WorkerKey, TieredOverlap, WorkerKeyHash> tiers;
  SplitTiers(overlaps, tiers);
  // In batches, their slots prefetched first: at 100,000 ranks the table is megabytes, and the
  // misses of a batch overlap.
  constexpr std::size_t kBatch = 16;
  std::uint64_t hashes[kBatch];
  for (std::size_t b = 0; b < overlaps.size(); b += kBatch) {
    const std::size_t m = std::min(kBatch, overlaps.size() - b);
    for (std::size_t i = 0; i < m; ++i) {
      hashes[i] = RankClasses::Hash(overlaps[b + i].worker);
      classes.Prefetch(hashes[i]);
    }
    for (std::size_t i = 0; i < m; ++i) {
      const OverlapScore& s = overlaps[b + i];
      const auto t = tiers.empty() ? tiers.end() : tiers.find(s.worker);
      add_matched(classes.Find(s.worker, hashes[i]),
                  t != tiers.end() ? t->second : TieredOverlap{s.blocks, s.blocks, s.blocks});
    }
  }
  for (const auto& [k, t] : tiers) add_matched(classes.Find(k, RankClasses::Hash(k)), t);

  // The crowds (device only: ReadCrowds). A rank's overlap is the deepest run holding it, and it
  // is counted once: as a special rank, as matched one by one (unless a deeper crowd holds it),
  // or in the deepest crowd holding it. A crowd's members of a class are its positions less
  // those counted elsewhere (`apart`, per crowd and class; ascending once sorted below).
  const std::size_t nc = classes.members.size();
  auto positions = [&](std::size_t i, std::uint32_t cls) -> std::span<const std::uint32_t> {
    return crowds[i].crowd->positions[cls];
  };
  thread_local std::vector<std::vector<std::uint32_t>> apart;
  if (apart.size() < crowds.size() * nc) apart.resize(crowds.size() * nc);
  for (std::size_t i = 0; i < crowds.size() * nc; ++i) apart[i].clear();
  for (Special& s : special) {
    for (std::size_t i = 0; i < crowds.size(); ++i) {
      if (!Holds(positions(i, s.cls), s.pos)) continue;
      apart[i * nc + s.cls].push_back(s.pos);
      const std::uint32_t d = crowds[i].depth;
      s.overlap = {std::max(s.overlap.device, d), std::max(s.overlap.host, d), std::max(s.overlap.any, d)};
    }
  }
  for (auto& [g, pos] : grouped) {
    const std::uint32_t cls = classes.class_of[pos], depth = groups[g].overlap.device;
    bool deeper = false;
    for (std::size_t i = 0; i < crowds.size(); ++i) {
      if (!Holds(positions(i, cls), pos)) continue;
      if (crowds[i].depth > depth) {
        deeper = true;  // counted in the deepest crowd holding it; the others are met below
      } else {
        apart[i * nc + cls].push_back(pos);
      }
    }
    if (deeper) {
      --group_size[g];
      g = kGrouped;
    }
  }
  std::erase_if(grouped, [&](const std::pair<std::uint32_t, std::uint32_t>& x) { return x.first == kGrouped; });
  for (std::size_t i = 0; i < crowds.size(); ++i) {
    for (std::size_t j = 0; j < crowds.size(); ++j) {
      // A crowd copied whole at the depth where most of it dropped out holds the deeper ones.
      if (crowds[i].crowd->shard != crowds[j].crowd->shard || crowds[i].depth >= crowds[j].depth) continue;
      for (std::uint32_t c = 0; c < nc; ++c) {
        std::set_intersection(positions(i, c).begin(), positions(i, c).end(), positions(j, c).begin(),
                              positions(j, c).end(), std::back_inserter(apart[i * nc + c]));
      }
    }
  }
  struct CrowdGroup {
    std::uint32_t crowd, cls, group;
  };
  thread_local std::vector<CrowdGroup> crowd_groups;
  crowd_groups.clear();
  for (std::size_t i = 0; i < crowds.size(); ++i) {
    for (std::uint32_t c = 0; c < nc; ++c) {
      std::vector<std::uint32_t>& a = apart[i * nc + c];
      std::sort(a.begin(), a.end());
      a.erase(std::unique(a.begin(), a.end()), a.end());
      const auto count = static_cast<std::uint32_t>(positions(i, c).size() - a.size());
      if (count == 0) continue;
      const std::uint32_t d = crowds[i].depth;
      const std::uint32_t g = group_for({c, {d, d, d}});
      group_size[g] += count;
      crowd_groups.push_back({static_cast<std::uint32_t>(i), c, g});
    }
  }

  const CandidateContext ctx = ContextNow();
  struct Priced {
    std::uint32_t pos;
    Candidate c;
    double cost = 0;
  };
  thread_local std::vector<Priced> priced;  // the open special ranks
  priced.clear();
  // Per class: the members neither special, matched one by one nor in a crowd.
  std::vector<std::uint32_t> idle(classes.members.size());
  for (std::size_t c = 0; c < idle.size(); ++c) idle[c] = static_cast<std::uint32_t>(classes.members[c].size());
  for (std::size_t g = 0; g < groups.size(); ++g) idle[groups[g].cls] -= group_size[g];
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (group_size[g] > 0) out.best_overlap = std::max(out.best_overlap, groups[g].overlap.device);
  }
  thread_local std::vector<std::pair<std::uint32_t, double>> recent;  // (position, recent requests) != 0
  recent.clear();
  std::size_t open = n;
  for (const Special& s : special) {
    --idle[s.cls];
    Candidate c = CandidateOf(all[s.pos], s.overlap, p.seq, ctx);
    out.best_overlap = std::max(out.best_overlap, c.overlap_blocks);
    if (full == FullRanks::kExcluded && Full(c)) {
      --open;
      continue;
    }
    if (c.recent_requests != 0) recent.emplace_back(s.pos, c.recent_requests);
    priced.push_back({s.pos, c});
  }
  if (open == 0) return out;
  // Summed in rank order, as Selector sums them (the others add zeros).
  std::sort(recent.begin(), recent.end());
  double recent_sum = 0;
  for (const auto& [pos, r] : recent) recent_sum += r;

  // Costs: each special rank's, and each class's as its idle members'.
  const KvPricing pricing = Cost::PricingOf(p.sel, p.params, recent_sum, open);
  double lo = std::numeric_limits<double>::infinity();
  for (Priced& x : priced) {
    x.cost = Cost::PickPrice(x.c, p.sel, p.params, pricing);
    lo = std::min(lo, x.cost);
  }
  // A rank neither booked nor learned costs what an idle one of its class with its overlap does.
  const CandidateContext idle_ctx{.no_load = true, .no_rates = true, .typical = ctx.typical};
  auto idle_cost = [&](std::uint32_t cls, const TieredOverlap& overlap) {
    return Cost::PickPrice(CandidateOf(all[classes.members[cls][0]], overlap, p.seq, idle_ctx), p.sel, p.params,
                           pricing);
  };
  std::vector<double> class_cost(idle.size(), std::numeric_limits<double>::infinity());
  for (std::size_t c = 0; c < idle.size(); ++c) {
    if (idle[c] == 0) continue;
    class_cost[c] = idle_cost(static_cast<std::uint32_t>(c), {});
    lo = std::min(lo, class_cost[c]);
  }
  thread_local std::vector<double> group_cost;
  group_cost.resize(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    // A group whose ranks all went to deeper crowds prices no rank.
    group_cost[g] =
        group_size[g] == 0 ? std::numeric_limits<double>::infinity() : idle_cost(groups[g].cls, groups[g].overlap);
    lo = std::min(lo, group_cost[g]);
  }

  // The tied ranks in rank order: the idle members of tied classes, and the tied special ranks.
  // Selector draws the k-th of them (no draw when only one rank is open).
  std::vector<std::uint32_t> tied_classes;
  std::size_t tied = 0;
  for (std::size_t c = 0; c < idle.size(); ++c) {
    if (idle[c] > 0 && class_cost[c] == lo) {
      tied_classes.push_back(static_cast<std::uint32_t>(c));
      tied += idle[c];
    }
  }
  thread_local std::vector<std::uint32_t> tied_special;
  tied_special.clear();
  for (const Priced& x : priced) {
    if (x.cost == lo) tied_special.push_back(x.pos);
  }
  for (const auto& [g, pos] : grouped) {
    if (group_cost[g] == lo) tied_special.push_back(pos);
  }
  tied += tied_special.size();
  // Tied crowds: their members, as sets.
  thread_local std::vector<SignedPositions> sets;
  sets.clear();
  for (const CrowdGroup& x : crowd_groups) {
    if (group_cost[x.group] != lo) continue;
    const std::vector<std::uint32_t>& a = apart[x.crowd * nc + x.cls];
    sets.push_back({positions(x.crowd, x.cls), 1});
    sets.push_back({a, -1});
    tied += positions(x.crowd, x.cls).size() - a.size();
  }
  const std::size_t k = open == 1 ? 0 : TieDraw(tied, rng_);
  std::uint32_t chosen = 0;
  if (tied_classes.empty() && sets.empty()) {
    chosen = KthPosition(tied_special, k, n);
  } else {
    // Special, matched and crowd ranks of tied classes are counted there as members: take them out.
    thread_local std::vector<std::uint32_t> excluded;
    excluded.clear();
    auto in_tied_class = [&](std::uint32_t pos) {
      return std::find(tied_classes.begin(), tied_classes.end(), classes.class_of[pos]) != tied_classes.end();
    };
    for (const Special& s : special) {
      if (in_tied_class(s.pos)) excluded.push_back(s.pos);
    }
    for (const auto& [g, pos] : grouped) {
      if (in_tied_class(pos)) excluded.push_back(pos);
    }
    for (const std::uint32_t c : tied_classes) {
      sets.push_back({classes.members[c], 1});
      for (const CrowdGroup& x : crowd_groups) {
        if (x.cls != c) continue;
        sets.push_back({positions(x.crowd, c), -1});
        sets.push_back({apart[x.crowd * nc + c], 1});
      }
    }
    std::sort(excluded.begin(), excluded.end());
    std::sort(tied_special.begin(), tied_special.end());
    sets.push_back({excluded, -1});
    sets.push_back({tied_special, 1});
    chosen = KthPositionOf(sets, k, n);
  }
  for (const Priced& x : priced) {
    if (x.pos == chosen) out.chosen = x.c;
  }
  if (!out.chosen) {
    TieredOverlap overlap;
    for (const auto& [g, pos] : grouped) {
      if (pos == chosen) overlap = groups[g].overlap;
    }
    for (const CrowdGroup& x : crowd_groups) {
      if (x.cls == classes.class_of[chosen] && Holds(positions(x.crowd, x.cls), chosen) &&
          !Holds(apart[x.crowd * nc + x.cls], chosen)) {
        overlap = groups[x.group].overlap;
      }
    }
    out.chosen = CandidateOf(all[chosen], overlap, p.seq, ctx);
  }
  return out;
}

}  // namespace kvrouter
