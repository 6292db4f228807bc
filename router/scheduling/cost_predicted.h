// PredictedTimeCost: the router's default cost (docs/design.md "Selection"), CostModel::kPredicted:
// the milliseconds of the fleet's time a request costs on a candidate, from the router's prior
// of an engine's timing (namespace prior below) scaled by what was learned of the rank
// (WorkerRates). It prices a candidate and declares what it reads of a rank, so that a pick over
// the whole fleet (Scheduler::PickFromFleet) can price idle ranks by class. Stateless; every
// function is pure and may be called from any thread.
//
//   double ms = PredictedCostMs(candidate, request, params);
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "router/scheduling/candidate.h"
#include "router/scheduling/worker_rates.h"

namespace kvrouter {

// The router's prior of an engine's timing, in milliseconds: how long a rank takes to prefill and
// to decode a step before anything is learned of it. It starts from the fit of Dynamo's mocker,
// as router/engine/engine_model.h's simulated engine does, but it is the router's own: editing
// the simulator does not move the router. WorkerRates learns its factors against it.
namespace prior {

// Prefill of n uncached prompt tokens in one step: 4.21e-7 n^2 + 0.0152 n + 16.5.
inline constexpr double kPrefillMsPerToken = 0.0152;
inline constexpr double kPrefillMsPerTokenSquared = 4.21e-7;
inline constexpr double kStepOverheadMs = 16.5;

inline double PrefillMs(double n) {
  return kPrefillMsPerTokenSquared * n * n + kPrefillMsPerToken * n + kStepOverheadMs;
}

// One decode step at KV-cache utilisation u in [0, 1]: max(1, -25.74 u^2 + 54.01 u + 5.74).
inline constexpr double kDecodeMsPerUtilSquared = -25.74;
inline constexpr double kDecodeMsPerUtil = 54.01;
inline constexpr double kDecodeIdleMs = 5.74;

inline double DecodeStepMs(double u) {
  return std::max(1.0, kDecodeMsPerUtilSquared * u * u + kDecodeMsPerUtil * u + kDecodeIdleMs);
}

// The cache size, in blocks, assumed for a rank that announced none (total_kv_blocks 0).
inline constexpr double kUnannouncedKvBlocks = 16384;

}  // namespace prior

namespace predicted_cost {

// The price of one request above the candidates' mean of recent requests: a tie breaker that
// spreads new sessions, far below what a cache hit saves. It is a fraction of the whole prompt's
// prefill, at most kSpreadMs, so that tiny prompts still follow their cache.
inline constexpr double kSpreadMs = 10;
inline constexpr double kSpreadOfPrefill = 0.15;
// An idle worker that got fewer than this fraction of the candidates' mean of recent requests is
// priced below the others by its shortfall, at the spread's price, up to kMaxShortfall requests'
// worth. Otherwise a worker left cold while the first sessions arrive stays cold: its peers hold
// the prompts' shared prefix (a system prompt), whose hit outweighs their few requests of excess,
// and the sessions, once placed, keep their cache (docs/performance.md, agentic). Only idle
// workers: in an overloaded fleet few recent requests mean long prompts running, not room. The
// bound keeps the credit a tie breaker's size however fast requests come: without it a slow
// rank of a mixed fleet, idle, would draw sessions from their caches at a high request rate.
inline constexpr double kUnderusedOfMean = 0.5;
inline constexpr double kMaxShortfall = 3;
// And a worker that got more than the mean is priced above the others by at most this many
// requests' worth: a tie breaker, never the price of a cache hit. A mixed fleet's fast ranks
// serve most requests, tens of requests over the mean: priced whole, that excess sends questions
// to idle slow ranks away from their prefix being prefilled on a fast one (docs/performance.md,
// "Mixed fleets and learned rates"). A smaller bound costs an overloaded slow fleet hit rate.
inline constexpr double kMaxExcess = 5;
// RecentWeight: a rank's factor within this ratio of the typical one is the learning's scatter.
inline constexpr double kFasterThanScatter = 1.5;
inline constexpr double kMinRecentWeight = 0.25;
// The waits a request inflicts on those running at a worker count up to this many times its own
// predicted time to first token. A prompt that takes long to prefill everywhere would otherwise
// be placed by who it stalls alone, behind a long queue (docs/performance.md, engines slower
// than the prior). Short prompts stay far below the cap, so a cache hit keeps its whole worth.
inline constexpr double kInflictedOfTtft = 8;
// And to this many milliseconds whatever the request: where the waits a request would inflict
// pass it, the request is long everywhere and every worker it could go to is busy, and its own
// start decides.
inline constexpr double kInflictedMaxMs = 12000;

// A count as a double in one instruction (an unsigned 64-bit conversion takes a branch); counts
// stay far below 2^63.
inline double AsDouble(std::uint64_t v) { return static_cast<double>(static_cast<std::int64_t>(v)); }

// The price of one request of recent excess for this request (the same for every candidate).
inline double SpreadPriceMs(const SelectionRequest& req, const CostParams& p) {
  return p.spread_scale * std::min(kSpreadMs, kSpreadOfPrefill * (prior::PrefillMs(req.isl) - prior::kStepOverheadMs));
}

struct Prediction {
  PriorTtft prior;
  double uncached = 0;  // prompt tokens to prefill there
};

inline Prediction Predict(const Candidate& c, const SelectionRequest& req, const CostParams& p) {
  const double bs = p.block_size;
  const std::uint32_t active_prefix = std::min(c.active_prefix_blocks, req.request_blocks);
  const double cached_blocks =
      std::min<double>(std::max<double>(CreditedBlocks(c, p), active_prefix), req.request_blocks);
  const double uncached = std::max(static_cast<double>(req.isl) - cached_blocks * bs, 0.0);
  const double queued = p.track_prefill_tokens ? AsDouble(c.active_prefill_tokens) : 0.0;
  const double queued_squares = p.track_prefill_tokens ? AsDouble(c.active_prefill_squares) : 0.0;
  const double budget = std::max<std::uint32_t>(1, c.max_num_batched_tokens);
  const double steps = std::max(1.0, std::ceil((queued + uncached) / budget));
  const double capacity = c.total_kv_blocks > 0 ? AsDouble(c.total_kv_blocks) : prior::kUnannouncedKvBlocks;
  const double decode_blocks = AsDouble(c.active_blocks) + req.request_blocks - active_prefix;
  const double u = std::min(1.0, decode_blocks / capacity);
  const double step = prior::DecodeStepMs(u);
  return {.prior = {.prefill_ms = prior::kPrefillMsPerToken * (queued + uncached) +
                                  prior::kPrefillMsPerTokenSquared * (queued_squares + uncached * uncached) +
                                  steps * prior::kStepOverheadMs,
                    .decode_ms = steps * step,
                    .decode_step_ms = step},
          .uncached = uncached};
}

// The request's predicted time to first token on c, and the waits it inflicts there (capped).
struct TimeOnRank {
  double ttft = 0;
  double inflicted = 0;
};
inline TimeOnRank TimeOn(const Candidate& c, const SelectionRequest& req, const CostParams& p) {
  const Prediction x = Predict(c, req, p);
  const double ttft = c.prefill_factor * (x.prior.prefill_ms + x.prior.decode_ms);
  // Each request running there waits out this prefill.
  const double inflicted =
      c.active_requests * c.prefill_factor * (prior::PrefillMs(x.uncached) - prior::kStepOverheadMs);
  return {.ttft = ttft, .inflicted = std::min({inflicted, kInflictedOfTtft * ttft, kInflictedMaxMs})};
}

// PredictedCostMs with its spread term already priced.
inline double PricedMs(const Candidate& c, const SelectionRequest& req, const CostParams& p, double spread) {
  const TimeOnRank t = TimeOn(c, req, p);
  return t.ttft + (t.inflicted + spread);
}

}  // namespace predicted_cost

// How many requests of recent excess the spread prices c at: recent_requests - mean, between 0
// and 5 (a tie breaker's size: a fast rank of a mixed fleet serves far more than the mean), or,
// for an idle candidate that got less than half the mean, recent_requests - mean / 2, at least
// -3 (< 0: it draws new sessions rather than stay cold while its peers hold their shared prefix).
inline double RecentExcess(const Candidate& c, double mean_recent) {
  using namespace predicted_cost;
  if (c.active_requests == 0 && c.recent_requests < kUnderusedOfMean * mean_recent) {
    return std::max(c.recent_requests - kUnderusedOfMean * mean_recent, -kMaxShortfall);
  }
  return std::min(std::max(0.0, c.recent_requests - mean_recent), kMaxExcess);
}

// What one request booked lately on a rank counts in its recent_requests: 1, or for a rank
// learned more than 1.5x faster than the fleet's typical factor, its factor over the typical one
// (at least 1/4). A request keeps a fast rank busy for less time: counted whole, a mixed fleet's
// fast ranks look overused and new sessions go to its slow ones. Within 1.5x the factors are the
// learning's scatter, which must not move a uniform fleet's ties. Slower ranks count 1: their
// slowness is priced in their ttft already, and in an overloaded fleet the busiest ranks learn
// slow factors (docs/performance.md, "Mixed fleets and learned rates").
inline double RecentWeight(double prefill_factor, double typical_prefill) {
  using namespace predicted_cost;
  const double ratio = prefill_factor / typical_prefill;
  return ratio < 1 / kFasterThanScatter ? std::max(ratio, kMinRecentWeight) : 1;  // NaN: 1
}

// The predicted cost, in milliseconds of the fleet's time, of sending the request to c:
//   cached    = max(CreditedBlocks, active prefix) blocks (a prefix being prefilled there now will be
//               cached by the time this request runs), U = isl - cached * bs uncached tokens
//   Q         = active prefill tokens queued there; steps = ceil((Q + U) / max_num_batched_tokens)
//   u         = KV utilisation with this request: (decode blocks) / total_kv_blocks
//   ttft      = 0.0152 (Q + U) + 4.21e-7 (sum of queued prefills' squares + U^2)
//               + steps * (16.5 + DecodeStepMs(u))
//   inflicted = min(active_requests * (PrefillMs(U) - 16.5), 8 ttft, 12,000): each running
//               request waits out this prefill; capped, so a prompt long to prefill anywhere is
//               not placed behind a long queue by whom it stalls alone
//   spread    = recent_excess * min(10, 0.15 * (PrefillMs(isl) - 16.5)) * p.spread_scale:
//               recent_excess = how many more requests than the candidates' mean it got lately
//               (recent_requests; RecentExcess, negative for a cold idle worker); it spreads new
//               sessions at equal cost, and tiny prompts barely pay it
//   cost      = ttft + inflicted + spread
// with the prior above, scaled per rank by what was learned of it (WorkerRates): ttft and
// `inflicted` by c.prefill_factor (learned from observed times to first token). A pick passes
// RecentExcess(c, mean over the candidates).
inline double PredictedCostMs(const Candidate& c, const SelectionRequest& req, const CostParams& p,
                              double recent_excess = 0) {
  return predicted_cost::PricedMs(c, req, p, recent_excess * predicted_cost::SpreadPriceMs(req, p));
}

// The prior's parts of `ttft` above for c (unscaled): what WorkerRates compares the observed
// time to first token and decode steps with.
inline PriorTtft PriorTtftOf(const Candidate& c, const SelectionRequest& req, const CostParams& p) {
  return predicted_cost::Predict(c, req, p).prior;
}

struct PredictedTimeCost {
  static constexpr CostModel kModel = CostModel::kPredicted;
  // Whether the price reads what a rank did lately: yes, its recent requests (the spread) and its
  // learned prefill factor, so only a rank never booked and never learned prices as an idle one.
  static constexpr bool kReadsHistory = true;
  // What an idle rank's price reads of its registration: its prefill budget per step (steps) and
  // its cache size (u).
  static IdleKey IdleKeyOf(const RankInfo& r) { return {{r.total_kv_blocks, r.max_num_batched_tokens}}; }
  // The spread's scale (CostParams::spread_scale) on a fleet whose typical learned prefill factor
  // is `typical_prefill`: that factor, at most 1 (a slow fleet's hits are worth more, and the tie
  // breaker stays as it is) and at least half: the spread also keeps sessions spread over the
  // fleet's caches, which the fleet's speed does not change; scaled by the whole factor, a fleet
  // much faster than the prior loses hit rate (docs/performance.md, "Other measurements").
  static double SpreadScaleOf(double typical_prefill) { return std::clamp(typical_prefill, 0.5, 1.0); }

  static double Price(const Candidate& c, const SelectionRequest& req, const CostParams& p, double recent_excess = 0) {
    return PredictedCostMs(c, req, p, recent_excess);
  }
  // A pick's shared pricing: the candidates' mean of recent requests, the spread's price.
  static KvPricing PricingOf(const SelectionRequest& req, const CostParams& p, double recent_sum,
                             std::size_t candidates) {
    return {.mean_recent = recent_sum / static_cast<double>(candidates),
            .spread_price = predicted_cost::SpreadPriceMs(req, p)};
  }
  // What a pick compares: the cost with c's recent excess over the mean; NaN (extreme weights a
  // request may set) as infinity.
  static double PickPrice(const Candidate& c, const SelectionRequest& req, const CostParams& p,
                          const KvPricing& pricing) {
    const double cost =
        predicted_cost::PricedMs(c, req, p, RecentExcess(c, pricing.mean_recent) * pricing.spread_price);
    return std::isnan(cost) ? std::numeric_limits<double>::infinity() : cost;
  }
};

}  // namespace kvrouter
