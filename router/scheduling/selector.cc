#include "router/scheduling/selector.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "router/engine/engine_model.h"

namespace kvrouter {
namespace {

// The predicted cost's price of one request above the candidates' mean of recent requests: a
// tie breaker that spreads new sessions, far below what a cache hit saves. It is a fraction of
// the whole prompt's prefill, at most kSpreadMs, so that tiny prompts still follow their cache.
constexpr double kSpreadMs = 10;
constexpr double kSpreadOfPrefill = 0.15;
// An idle worker that got fewer than this fraction of the candidates' mean of recent requests is
// priced below the others by its shortfall, at the spread's price, up to kMaxShortfall requests'
// worth. Otherwise a worker left cold while the first sessions arrive stays cold: its peers hold
// the prompts' shared prefix (a system prompt), whose hit outweighs their few requests of excess,
// and the sessions, once placed, keep their cache (docs/performance.md, agentic). Only idle
// workers: in an overloaded fleet few recent requests mean long prompts running, not room. The
// bound keeps the credit a tie breaker's size however fast requests come: without it a slow
// rank of a mixed fleet, idle, would draw sessions from their caches at a high request rate.
constexpr double kUnderusedOfMean = 0.5;
constexpr double kMaxShortfall = 3;
// And a worker that got more than the mean is priced above the others by at most this many
// requests' worth: a tie breaker, never the price of a cache hit. A mixed fleet's fast ranks
// serve most requests, tens of requests over the mean: priced whole (hundreds of milliseconds),
// that excess sends questions to idle slow ranks away from their prefix being prefilled on a
// fast one (4 of 8 workers 4x slower, seeds 1-12, TTFT p99 unbounded against bounded: fan-out
// 833 against 748 ms, chat 285 against 259, bursts 500 against 469). On a uniform fleet it seldom
// binds (the quality suite within 1.5 %). At 3 the overloaded all-slow trace lost half a point of
// hit rate.
constexpr double kMaxExcess = 5;
// RecentWeight: a rank's factor within this ratio of the typical one is the learning's scatter.
constexpr double kFasterThanScatter = 1.5;
constexpr double kMinRecentWeight = 0.25;
// The waits a request inflicts on those running at a worker count up to this many times its own
// predicted time to first token. A prompt that takes long to prefill everywhere would otherwise
// be placed by who it stalls alone, behind a long queue: on the shared trace with every engine 4x
// slower than the prior, prompts of 90k+ tokens waited 6.2 s in queues against 0.8 s under
// Dynamo's formula. Short prompts stay far below the cap, so a cache hit keeps its whole worth.
constexpr double kInflictedOfTtft = 8;
// And to this many milliseconds whatever the request: where the waits a request would inflict
// pass it, the request is long everywhere and every worker it could go to is busy (every engine
// 4x slower than the prior, the trace's prompts of 90k+ tokens), and its own start decides.
// With the relative bound alone such prompts waited 2.1 s in queues (TTFT p99 17.4 s against
// Dynamo's formula's 16.4 s); with both, p99 16.1 s, the hit rate 0.6 points lower (24.8 %).
constexpr double kInflictedMaxMs = 12000;

// A count as a double in one instruction (an unsigned 64-bit conversion takes a branch); counts
// stay far below 2^63.
double AsDouble(std::uint64_t v) { return static_cast<double>(static_cast<std::int64_t>(v)); }

std::size_t Uniform(std::size_t n, std::mt19937_64& rng) {
  return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
}

}  // namespace

double CreditedBlocks(const Candidate& c, const CostParams& p) {
  const std::uint32_t host = std::max(c.host_overlap_blocks, c.overlap_blocks);
  const std::uint32_t any = std::max(c.any_overlap_blocks, host);
  if (any == c.overlap_blocks) return c.overlap_blocks;
  return c.overlap_blocks + p.host_weight * (host - c.overlap_blocks) + p.disk_weight * (any - host);
}

double KvCost(const Candidate& c, const SelectionRequest& req, const CostParams& p) {
  const double bs = p.block_size;
  const double prefill_tokens = (p.track_prefill_tokens ? static_cast<double>(c.active_prefill_tokens) : 0.0) + req.isl;
  const double prefill_blocks = prefill_tokens / bs;
  const double adjusted = std::max(prefill_blocks - p.overlap_score_credit * CreditedBlocks(c, p), 0.0);
  const double decode_blocks =
      static_cast<double>(c.active_blocks) + req.request_blocks - std::min(c.active_prefix_blocks, req.request_blocks);
  return p.prefill_load_scale * adjusted + decode_blocks;
}

namespace {

// The price of one request of recent excess for this request (the same for every candidate).
double SpreadPriceMs(const SelectionRequest& req, const CostParams& p) {
  return p.spread_scale * std::min(kSpreadMs, kSpreadOfPrefill * (PrefillMs(req.isl) - kStepOverheadMs));
}

struct Prediction {
  PriorTtft prior;
  double uncached = 0;  // prompt tokens to prefill there
};

Prediction Predict(const Candidate& c, const SelectionRequest& req, const CostParams& p) {
  const double bs = p.block_size;
  const std::uint32_t active_prefix = std::min(c.active_prefix_blocks, req.request_blocks);
  const double cached_blocks =
      std::min<double>(std::max<double>(CreditedBlocks(c, p), active_prefix), req.request_blocks);
  const double uncached = std::max(static_cast<double>(req.isl) - cached_blocks * bs, 0.0);
  const double queued = p.track_prefill_tokens ? AsDouble(c.active_prefill_tokens) : 0.0;
  const double queued_squares = p.track_prefill_tokens ? AsDouble(c.active_prefill_squares) : 0.0;
  const double budget = std::max<std::uint32_t>(1, c.max_num_batched_tokens);
  const double steps = std::max(1.0, std::ceil((queued + uncached) / budget));
  const double capacity = c.total_kv_blocks > 0 ? AsDouble(c.total_kv_blocks) : 16384.0;
  const double decode_blocks = AsDouble(c.active_blocks) + req.request_blocks - active_prefix;
  const double u = std::min(1.0, decode_blocks / capacity);
  const double step = DecodeStepMs(u);
  return {.prior = {.prefill_ms = kPrefillMsPerToken * (queued + uncached) +
                                  kPrefillMsPerTokenSquared * (queued_squares + uncached * uncached) +
                                  steps * kStepOverheadMs,
                    .decode_ms = steps * step,
                    .decode_step_ms = step},
          .uncached = uncached};
}

// PredictedCostMs with its spread term already priced.
double PredictedCostPricedMs(const Candidate& c, const SelectionRequest& req, const CostParams& p, double spread) {
  const Prediction x = Predict(c, req, p);
  const double ttft = c.prefill_factor * (x.prior.prefill_ms + x.prior.decode_ms);
  // Each request running there waits out this prefill.
  const double inflicted = c.active_requests * c.prefill_factor * (PrefillMs(x.uncached) - kStepOverheadMs);
  return ttft + (std::min({inflicted, kInflictedOfTtft * ttft, kInflictedMaxMs}) + spread);
}

}  // namespace

double PredictedCostMs(const Candidate& c, const SelectionRequest& req, const CostParams& p, double recent_excess) {
  return PredictedCostPricedMs(c, req, p, recent_excess * SpreadPriceMs(req, p));
}

PriorTtft PriorTtftOf(const Candidate& c, const SelectionRequest& req, const CostParams& p) {
  return Predict(c, req, p).prior;
}

double RecentExcess(const Candidate& c, double mean_recent) {
  if (c.active_requests == 0 && c.recent_requests < kUnderusedOfMean * mean_recent) {
    return std::max(c.recent_requests - kUnderusedOfMean * mean_recent, -kMaxShortfall);
  }
  return std::min(std::max(0.0, c.recent_requests - mean_recent), kMaxExcess);
}

double RecentWeight(double prefill_factor, double typical_prefill) {
  const double ratio = prefill_factor / typical_prefill;
  return ratio < 1 / kFasterThanScatter ? std::max(ratio, kMinRecentWeight) : 1;  // NaN: 1
}

KvPricing KvPricingOf(const SelectionRequest& req, const CostParams& p, double recent_sum, std::size_t candidates) {
  if (p.model != CostModel::kPredicted) return {};
  return {.mean_recent = recent_sum / static_cast<double>(candidates), .spread_price = SpreadPriceMs(req, p)};
}

double PickCost(const Candidate& c, const SelectionRequest& req, const CostParams& p, const KvPricing& pricing) {
  double cost = 0;
  if (p.model == CostModel::kPredicted) {
    cost = PredictedCostPricedMs(c, req, p, RecentExcess(c, pricing.mean_recent) * pricing.spread_price);
  } else {
    cost = KvCost(c, req, p);
  }
  return std::isnan(cost) ? std::numeric_limits<double>::infinity() : cost;
}

std::size_t TieDraw(std::size_t n, std::mt19937_64& rng) { return Uniform(n, rng); }

std::size_t Selector::PickKv(const SelectionRequest& req, std::span<const Candidate> cands, const CostParams& p,
                             std::mt19937_64& rng) const {
  std::vector<double> cost(cands.size());
  double lo = std::numeric_limits<double>::infinity();
  double hi = -lo;
  double recent_sum = 0;
  if (p.model == CostModel::kPredicted) {
    for (const Candidate& c : cands) recent_sum += c.recent_requests;
  }
  const KvPricing pricing = KvPricingOf(req, p, recent_sum, cands.size());
  for (std::size_t i = 0; i < cands.size(); ++i) {
    cost[i] = PickCost(cands[i], req, p, pricing);
    lo = std::min(lo, cost[i]);
    hi = std::max(hi, cost[i]);
  }
  if (p.temperature > 0 && hi > lo && std::isfinite(hi - lo)) {
    // Softmax over normalised costs: p_i ∝ exp(-(cost_i - min) / ((max - min) * T)).
    std::vector<double> w(cands.size());
    double total = 0;
    for (std::size_t i = 0; i < cands.size(); ++i) {
      w[i] = std::exp(-(cost[i] - lo) / ((hi - lo) * p.temperature));
      if (!std::isfinite(w[i])) w[i] = 0;
      total += w[i];
    }
    if (total > 0 && std::isfinite(total)) return std::discrete_distribution<std::size_t>(w.begin(), w.end())(rng);
  }
  // Lowest cost, ties broken uniformly at random (also the all-equal case with T > 0).
  std::vector<std::size_t> best;
  for (std::size_t i = 0; i < cands.size(); ++i) {
    if (cost[i] == lo) best.push_back(i);
  }
  return best[TieDraw(best.size(), rng)];
}

std::size_t Selector::LeastLoaded(std::span<const Candidate> cands, const std::vector<std::size_t>& among,
                                  std::mt19937_64& rng) {
  std::uint32_t fewest = std::numeric_limits<std::uint32_t>::max();
  std::vector<std::size_t> best;
  for (std::size_t i : among) {
    if (cands[i].active_requests < fewest) {
      fewest = cands[i].active_requests;
      best.clear();
    }
    if (cands[i].active_requests == fewest) best.push_back(i);
  }
  return best[Uniform(best.size(), rng)];
}

std::size_t Selector::Pick(RouterMode mode, const SelectionRequest& req, std::span<const Candidate> cands,
                           const CostParams& params, std::mt19937_64& rng) {
  const std::size_t n = cands.size();
  if (n == 1) return 0;
  std::vector<std::size_t> all(n);
  for (std::size_t i = 0; i < n; ++i) all[i] = i;
  switch (mode) {
    case RouterMode::kKv: return PickKv(req, cands, params, rng);
    case RouterMode::kRoundRobin: return round_robin_++ % n;
    case RouterMode::kRandom: return Uniform(n, rng);
    case RouterMode::kPowerOfTwo: {
      const std::size_t a = Uniform(n, rng);
      std::size_t b = Uniform(n - 1, rng);
      if (b >= a) ++b;
      if (cands[a].active_requests != cands[b].active_requests) {
        return cands[a].active_requests < cands[b].active_requests ? a : b;
      }
      return rng() & 1 ? a : b;
    }
    case RouterMode::kLeastLoaded: return LeastLoaded(cands, all, rng);
    case RouterMode::kDeviceAwareWeighted: {
      std::vector<std::size_t> cpu, accel;
      double cpu_cap = 0, accel_cap = 0;
      for (std::size_t i = 0; i < n; ++i) {
        (cands[i].is_cpu ? cpu : accel).push_back(i);
        (cands[i].is_cpu ? cpu_cap : accel_cap) += std::max<std::uint32_t>(1, cands[i].capacity);
      }
      if (cpu.empty() || accel.empty()) return LeastLoaded(cands, all, rng);
      // Accelerators get device_ratio times their capacity's share of the traffic.
      const double accel_weight = params.device_ratio * accel_cap;
      const bool pick_accel = std::uniform_real_distribution<double>(0, accel_weight + cpu_cap)(rng) < accel_weight;
      return LeastLoaded(cands, pick_accel ? accel : cpu, rng);
    }
    case RouterMode::kDirect: return 0;
  }
  return 0;
}

}  // namespace kvrouter
