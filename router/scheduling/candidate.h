// The inputs of a kv cost (docs/design.md "Selection"; terms in "Glossary"): a registered rank (RankInfo), a rank
// as one request's candidate (Candidate: its overlap, the router's load on it, its learned
// rates), the request (SelectionRequest) and the cost parameters it resolved (CostParams).
// Plain values; the scheduler fills them (Scheduler::Candidates), the costs read them
// (cost_kv_blocks.h, cost_predicted.h).
//
//   Candidate c{.worker = {7, 0}, .overlap_blocks = 12};  double b = CreditedBlocks(c, params);
#pragma once

#include <algorithm>
#include <array>
#include <compare>
#include <cstdint>

#include "router/index/worker_key.h"
#include "router/scheduling/policy.h"

namespace kvrouter {

// What the router needs of one rank to consider it for a request (the worker
// registry's view of it).
struct RankInfo {
  WorkerKey worker;
  bool is_cpu = false;
  std::uint32_t max_num_seqs = 256;
  std::uint32_t max_num_batched_tokens = 8192;
  std::uint64_t total_kv_blocks = 0;  // 0 = not announced
};

// The registration fields of a rank that one cost's price of it reads when the rank is idle
// (no load booked, nothing learned: Scheduler::PickFromFleet), as numbers: ranks with equal keys
// price alike when idle. Each cost fills it (its IdleKeyOf); unused fields stay 0.
struct IdleKey {
  std::array<std::uint64_t, 4> fields{};
  auto operator<=>(const IdleKey&) const = default;
};

struct Candidate {
  WorkerKey worker;
  std::uint32_t overlap_blocks = 0;  // leading request blocks cached there (on device)
  // The same on device or host, and on any tier (cumulative, so >= overlap_blocks): blocks
  // offloaded from GPU still save prefill, credited at CostParams' tier weights.
  std::uint32_t host_overlap_blocks = 0;
  std::uint32_t any_overlap_blocks = 0;
  std::uint32_t active_prefix_blocks = 0;  // leading request blocks already active there
  std::uint64_t active_blocks = 0;         // decode blocks of active requests
  std::uint64_t active_prefill_tokens = 0;
  std::uint64_t active_prefill_squares = 0;  // sum of the squares of their prefill tokens
  std::uint32_t active_requests = 0;
  double recent_requests = 0;                   // routed there lately (ActiveLoad::RecentRequests) times RecentWeight
  bool is_cpu = false;                          // registration device == "cpu"
  std::uint32_t capacity = 1;                   // max_num_seqs, for device-aware weighting
  std::uint32_t max_num_batched_tokens = 8192;  // for the queue's "full" test and prefill steps
  std::uint64_t total_kv_blocks = 0;            // registration's cache size (0 = unknown)
  double prefill_factor = 1;                    // learned (WorkerRates): times the prior's prefill time
  double decode_factor = 1;                     // learned: times the prior's decode step (not in costs)
};

struct SelectionRequest {
  std::uint32_t isl = 0;             // prompt tokens
  std::uint32_t request_blocks = 0;  // ceil(isl / block_size)
};

struct CostParams {
  CostModel model = CostModel::kKvBlocks;
  std::uint32_t block_size = 64;
  double overlap_score_credit = 1.0;  // C
  double prefill_load_scale = 1.0;    // P
  double temperature = 0.0;
  bool track_prefill_tokens = true;
  double device_ratio = 8.0;
  double host_weight = 0.75;  // --router-host-cache-hit-weight: a block held on host only
  double disk_weight = 0.25;  // --router-disk-cache-hit-weight: on disk or external only
  // kPredicted: the spread term's scale, the fleet's typical learned prefill factor clamped to
  // [0.5, 1] (Scheduler::PriceSpread): on a fleet faster than the prior a cache hit saves that
  // much less time, and the tie breaker shrinks with it, at most by half (it also keeps sessions
  // spread over the fleet's caches); on a slower fleet it stays as it is.
  double spread_scale = 1.0;
};

// The overlap credited to c: its device blocks, plus host_weight per block it holds on host
// beyond them and disk_weight per block on disk beyond those. Exactly overlap_blocks when it
// holds nothing off device (or the cumulative counts are left 0).
inline double CreditedBlocks(const Candidate& c, const CostParams& p) {
  const std::uint32_t host = std::max(c.host_overlap_blocks, c.overlap_blocks);
  const std::uint32_t any = std::max(c.any_overlap_blocks, host);
  if (any == c.overlap_blocks) return c.overlap_blocks;
  return c.overlap_blocks + p.host_weight * (host - c.overlap_blocks) + p.disk_weight * (any - host);
}

// What a kv pick computes once for all its candidates before it prices them: the predicted
// cost's spread term is relative to the candidates' mean of recent requests (the sum over them,
// in their order, over their count, as Selector adds them). Empty for a cost that reads none.
struct KvPricing {
  double mean_recent = 0;
  double spread_price = 0;  // the price of one request of recent excess (kPredicted only)
};

}  // namespace kvrouter
