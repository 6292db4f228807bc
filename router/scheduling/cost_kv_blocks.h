// KvBlocksCost: Dynamo's block formula (docs/design.md "Selection"), CostModel::kKvBlocks. It
// prices a candidate in blocks of work, and declares what it reads of a rank so that a pick
// over the whole fleet (Scheduler::PickFromFleet) can price idle ranks by class. Stateless;
// every function is pure and may be called from any thread.
//
//   double blocks = KvBlocksCost::Price(candidate, request, params);
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "router/scheduling/candidate.h"

namespace kvrouter {

struct KvBlocksCost {
  static constexpr CostModel kModel = CostModel::kKvBlocks;
  // Whether the price reads what a rank did lately (its recent requests, its learned rates):
  // no. It reads only the active load, so a rank whose requests have ended prices as an idle one.
  static constexpr bool kReadsHistory = false;
  // What an idle rank's price reads of its registration: nothing.
  static IdleKey IdleKeyOf(const RankInfo&) { return {}; }

  // P * max(prefill_blocks - C * overlap, 0) + decode_blocks, with overlap = CreditedBlocks,
  // prefill_blocks = (active prefill tokens, if tracked, + isl) / block_size and decode_blocks
  // = active blocks + the request's blocks not already active there.
  static double Price(const Candidate& c, const SelectionRequest& req, const CostParams& p) {
    const double bs = p.block_size;
    const double prefill_tokens =
        (p.track_prefill_tokens ? static_cast<double>(c.active_prefill_tokens) : 0.0) + req.isl;
    const double prefill_blocks = prefill_tokens / bs;
    const double adjusted = std::max(prefill_blocks - p.overlap_score_credit * CreditedBlocks(c, p), 0.0);
    const double decode_blocks = static_cast<double>(c.active_blocks) + req.request_blocks -
                                 std::min(c.active_prefix_blocks, req.request_blocks);
    return p.prefill_load_scale * adjusted + decode_blocks;
  }

  // A pick's shared pricing: none.
  static KvPricing PricingOf(const SelectionRequest&, const CostParams&, double /*recent_sum*/,
                             std::size_t /*candidates*/) {
    return {};
  }
  // What a pick compares: Price; NaN (extreme weights a request may set) as infinity.
  static double PickPrice(const Candidate& c, const SelectionRequest& req, const CostParams& p, const KvPricing&) {
    const double cost = Price(c, req, p);
    return std::isnan(cost) ? std::numeric_limits<double>::infinity() : cost;
  }
};

}  // namespace kvrouter
