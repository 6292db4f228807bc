// Worker selection for every router mode (docs/design.md "Selection"). Pure decision logic over a
// list of candidates that the service assembles (overlap from the index, load from ActiveLoad,
// limits from registrations); randomness comes from the caller's seeded generator, so
// decisions are reproducible in tests. Not thread-safe (round-robin keeps a cursor); the
// service calls it under its routing lock.
//
//   Selector sel;  std::size_t i = sel.Pick(RouterMode::kKv, request, candidates, params, rng);
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "router/index/worker_key.h"
#include "router/scheduling/policy.h"
#include "router/scheduling/worker_rates.h"

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
  CostModel model = CostModel::kDynamo;
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
double CreditedBlocks(const Candidate& c, const CostParams& p);

// The kv cost of one candidate: P * max(prefill_blocks - C * overlap, 0) + decode_blocks, with
// overlap = CreditedBlocks.
double KvCost(const Candidate& c, const SelectionRequest& req, const CostParams& p);

// The predicted cost, in milliseconds of the fleet's time, of sending the request to c:
//   cached    = max(CreditedBlocks, active prefix) blocks (a prefix being prefilled there now will be
//               cached by the time this request runs), U = isl - cached * bs uncached tokens
//   Q         = active prefill tokens queued there; steps = ceil((Q + U) / max_num_batched_tokens)
//   u         = KV utilisation with this request: (decode_blocks of KvCost) / total_kv_blocks
//   ttft      = 0.0152 (Q + U) + 4.21e-7 (sum of queued prefills' squares + U^2)
//               + steps * (16.5 + DecodeStepMs(u))
//   inflicted = min(active_requests * (PrefillMs(U) - 16.5), 8 ttft, 12,000): each running
//               request waits out this prefill; capped, so a prompt long to prefill anywhere is
//               not placed behind a long queue by whom it stalls alone
//   spread    = recent_excess * min(10, 0.15 * (PrefillMs(isl) - 16.5)) * p.spread_scale:
//               recent_excess = how many more requests than the candidates' mean it got lately
//               (recent_requests; RecentExcess below, negative for a cold idle worker); it
//               spreads new sessions at equal cost, and tiny prompts barely pay it
//   cost      = ttft + inflicted + spread
// with the engine timing of router/engine/engine_model.h as the prior, scaled per rank by what
// was learned of it (WorkerRates): ttft and `inflicted` by c.prefill_factor (learned from
// observed times to first token). Selector::PickKv passes RecentExcess(c, mean over the
// candidates).
double PredictedCostMs(const Candidate& c, const SelectionRequest& req, const CostParams& p, double recent_excess = 0);
// The prior's parts of `ttft` above for c (unscaled): what WorkerRates compares the observed
// time to first token and decode steps with.
PriorTtft PriorTtftOf(const Candidate& c, const SelectionRequest& req, const CostParams& p);

// How many requests of recent excess the spread prices c at: recent_requests - mean, between 0
// and 5 (a tie breaker's size: a fast rank of a mixed fleet serves far more than the mean), or,
// for an idle candidate that got less than half the mean, recent_requests - mean / 2, at least
// -3 (< 0: it draws new sessions rather than stay cold while its peers hold their shared prefix).
double RecentExcess(const Candidate& c, double mean_recent);
// What one request booked lately on a rank counts in its recent_requests: 1, or for a rank
// learned more than 1.5x faster than the fleet's typical factor, its factor over the typical one
// (at least 1/4). A request keeps a fast rank busy for less time: counted whole, a mixed fleet's
// fast ranks look overused and new sessions go to its slow ones. Within 1.5x the factors are the
// learning's scatter, which must not move a uniform fleet's ties. Slower ranks count 1: their
// slowness is priced in their ttft already, and in an overloaded fleet the busiest ranks learn
// slow factors (docs/performance.md, "Mixed fleets and learned rates").
double RecentWeight(double prefill_factor, double typical_prefill);
// How PickKv prices every candidate of one decision: the predicted cost's spread term is
// relative to the candidates' mean of recent requests (the sum over them, in their order, over
// their count, as PickKv adds them).
struct KvPricing {
  double mean_recent = 0;
  double spread_price = 0;  // SpreadPrice of the request (kPredicted only)
};
KvPricing KvPricingOf(const SelectionRequest& req, const CostParams& p, double recent_sum, std::size_t candidates);
// The cost PickKv compares for c: KvCost, or PredictedCostMs with c's recent excess over the
// mean; NaN (extreme weights a request may set) as infinity, so it ranks last.
double PickCost(const Candidate& c, const SelectionRequest& req, const CostParams& p, const KvPricing& pricing);
// The draw that breaks a tie among n candidates of equal cost: the index of the one taken, in
// candidate order.
std::size_t TieDraw(std::size_t n, std::mt19937_64& rng);

class Selector {
 public:
  // Index into candidates (non-empty) of the chosen one. kDirect is the caller's business
  // (the pin is resolved before selection) and picks the first candidate.
  std::size_t Pick(RouterMode mode, const SelectionRequest& req, std::span<const Candidate> cands,
                   const CostParams& params, std::mt19937_64& rng);

 private:
  std::size_t PickKv(const SelectionRequest& req, std::span<const Candidate> cands, const CostParams& params,
                     std::mt19937_64& rng) const;
  static std::size_t LeastLoaded(std::span<const Candidate> cands, const std::vector<std::size_t>& among,
                                 std::mt19937_64& rng);
  std::uint64_t round_robin_ = 0;
};

}  // namespace kvrouter
