// Every kv cost, and the one dispatch from CostModel to its type (docs/design.md "Selection";
// cost, idle key, rank class in "Glossary").
// A pick resolves the model once, at its top, and runs as a template on the cost: no virtual
// call and no branch on the model per candidate. A cost type provides kModel, kReadsHistory,
// IdleKeyOf(RankInfo), PricingOf and PickPrice (cost_kv_blocks.h, cost_predicted.h). Pure.
//
//   double cost = WithCost(params.model, [&]<class Cost>() { return Cost::PickPrice(c, req, params, {}); });
#pragma once

#include <utility>

#include "router/scheduling/cost_kv_blocks.h"
#include "router/scheduling/cost_predicted.h"

namespace kvrouter {

// Calls f.template operator()<Cost>() with the cost type of `model` (every CostModel has a case:
// -Wswitch names one left out; a value outside the enum falls to KvBlocksCost).
template <typename F>
decltype(auto) WithCost(CostModel model, F&& f) {
  switch (model) {
    case CostModel::kPredicted: return std::forward<F>(f).template operator()<PredictedTimeCost>();
    case CostModel::kKvBlocks: break;
  }
  return std::forward<F>(f).template operator()<KvBlocksCost>();
}

// The class of a rank for a pick over the whole fleet, whatever cost a request uses: the idle
// keys of every cost. Ranks of one class price alike when idle under each of them.
struct RankClassKey {
  IdleKey kv_blocks;
  IdleKey predicted;
  auto operator<=>(const RankClassKey&) const = default;
};
inline RankClassKey RankClassKeyOf(const RankInfo& r) {
  return {KvBlocksCost::IdleKeyOf(r), PredictedTimeCost::IdleKeyOf(r)};
}

// The cost a kv pick compares for c (the model's PickPrice).
inline double PickCost(const Candidate& c, const SelectionRequest& req, const CostParams& p, const KvPricing& pricing) {
  return WithCost(p.model, [&]<class Cost>() { return Cost::PickPrice(c, req, p, pricing); });
}
// A pick's shared pricing under p's model.
inline KvPricing KvPricingOf(const SelectionRequest& req, const CostParams& p, double recent_sum,
                             std::size_t candidates) {
  return WithCost(p.model, [&]<class Cost>() { return Cost::PricingOf(req, p, recent_sum, candidates); });
}

}  // namespace kvrouter
