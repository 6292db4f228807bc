#include "router/service/router_stats.h"

namespace kvrouter {

void DropCounters::Add(std::string_view reason, std::uint64_t n) {
  KvMutexLock g(mu_);
  auto it = counts_.find(reason);
  if (it == counts_.end()) it = counts_.emplace(std::string(reason), 0).first;
  it->second += n;
}

std::map<std::string, std::uint64_t> DropCounters::Snapshot() const {
  KvMutexLock g(mu_);
  return {counts_.begin(), counts_.end()};
}

StatsReply BuildStats(const StatsRequest& page, const WorkerRegistry& registry, const Routing& routing,
                      const ShardedIndex& index, const DropCounters& drops) {
  StatsReply r;
  r.offset = page.offset;
  for (RankEntry& e : registry.Page(page.offset, page.limit, &r.workers_total)) {
    r.workers.push_back({.worker_id = e.worker.worker_id,
                         .dp_rank = e.worker.dp_rank,
                         .device = std::move(e.device),
                         .role = std::string(WorkerRoleName(e.role)),
                         .without_events = e.without_events});
  }
  // Indexed blocks of the page's ranks, on every tier (approximate mode overwrites them with
  // predictions).
  for (WorkerStats& w : r.workers) {
    const WorkerKey rank{w.worker_id, w.dp_rank};
    for (StorageTier t : {StorageTier::kDevice, StorageTier::kHostPinned, StorageTier::kDisk})
      w.blocks += index.TreeSize(TierRank(rank, t));
  }
  routing.FillStats(r);

  const IndexCounters c = index.Counters();
  std::map<std::string, std::uint64_t> dropped = drops.Snapshot();
  dropped["parent_block_not_found"] += c.parent_block_not_found;
  dropped["block_not_found"] += c.block_not_found;
  dropped["duplicate"] += c.duplicate;
  dropped["queue_full"] += c.queue_full;
  dropped["over_capacity"] += c.over_capacity;
  r.breakdowns["events_dropped"] = std::move(dropped);
  r.breakdowns["registrations_refused"] = registry.refused();
  r.counters["events_applied"] = c.ops_applied;
  r.counters["event_gaps"] = c.gaps;
  r.counters["event_restarts"] = c.restarts;
  r.counters["events_recovered"] = c.events_recovered;
  r.counters["events_held_dropped"] = c.held_dropped;
  r.counters["workers_refused"] = registry.refused_total();
  r.counters["leases_expired"] = registry.leases_expired();
  r.counters["workers_without_events"] = registry.silent_workers();
  return r;
}

}  // namespace kvrouter
