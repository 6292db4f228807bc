#include "router/scheduling/cost_disagg.h"

#include <cmath>

namespace kvrouter {

namespace {
constexpr struct {
  DisaggPolicy policy;
  std::string_view name;
} kPolicies[] = {
    {DisaggPolicy::kPredicted, "predicted"},      {DisaggPolicy::kAlways, "always"},
    {DisaggPolicy::kNever, "never"},              {DisaggPolicy::kIslBounding, "isl_bounding"},
    {DisaggPolicy::kPrefillLoad, "prefill_load"}, {DisaggPolicy::kIslOrLoad, "isl_or_load"},
};
}  // namespace

std::string_view DisaggPolicyName(DisaggPolicy policy) {
  for (const auto& p : kPolicies) {
    if (p.policy == policy) return p.name;
  }
  return "predicted";
}

std::optional<DisaggPolicy> DisaggPolicyFromName(std::string_view name) {
  for (const auto& p : kPolicies) {
    if (p.name == name) return p.policy;
  }
  return std::nullopt;
}

bool KvTransfer::Observe(double predicted_ms, double observed_ms) {
  if (!(predicted_ms > 0) || !(observed_ms >= 0) || !std::isfinite(observed_ms)) return false;
  const double ratio = std::clamp(observed_ms / predicted_ms, 1 / kMaxRatio, kMaxRatio);
  factor_ += kStep * (ratio - factor_);
  ++observations_;
  return true;
}

double UncachedTokens(const Candidate& c, const SelectionRequest& req, const CostParams& p) {
  return predicted_cost::Predict(c, req, p).uncached;
}

DisaggChoice PredictDisagg(const DisaggCandidates& c, const SelectionRequest& req, const CostParams& p,
                           const KvTransfer& transfer) {
  using predicted_cost::AsDouble;
  DisaggChoice out;
  const predicted_cost::TimeOnRank local = predicted_cost::TimeOn(c.local, req, p);
  out.local_ms = local.ttft + kLocalStallWeight * local.inflicted;
  const predicted_cost::Prediction prefill = predicted_cost::Predict(c.prefill, req, p);
  const predicted_cost::Prediction decode = predicted_cost::Predict(c.remote_decode, req, p);
  out.transfer_ms = transfer.Ms(decode.uncached);
  const Candidate& d = c.remote_decode;
  const double queued_local_prefills =
      p.track_prefill_tokens ? prior::kPrefillMsPerToken * AsDouble(d.active_prefill_tokens) +
                                   prior::kPrefillMsPerTokenSquared * AsDouble(d.active_prefill_squares)
                             : 0.0;
  out.remote_ms = c.prefill.prefill_factor * prefill.prior.prefill_ms + out.transfer_ms +
                  d.prefill_factor * queued_local_prefills + d.decode_factor * decode.prior.decode_step_ms;
  out.disaggregated = out.remote_ms < out.local_ms;
  return out;
}

DisaggChoice ChooseDisagg(const DisaggOptions& o, const DisaggCandidates& c, const SelectionRequest& req,
                          const CostParams& p, const KvTransfer& transfer) {
  if (o.policy == DisaggPolicy::kPredicted) return PredictDisagg(c, req, p, transfer);
  DisaggChoice out;
  out.transfer_ms = transfer.Ms(UncachedTokens(c.remote_decode, req, p));
  // Dynamo's conditions for skipping the prefill pool.
  auto short_uncached = [&] {
    const double eff_isl = std::max(0.0, static_cast<double>(req.isl) - static_cast<double>(c.local.overlap_blocks) *
                                                                             p.block_size);
    const double ratio = req.isl > 0 ? eff_isl / req.isl : 0.0;
    return eff_isl < o.eff_isl_threshold && ratio < o.eff_isl_ratio_threshold;
  };
  auto prefill_busy = [&] {
    return o.prefill_busy_threshold &&
           static_cast<double>(c.prefill.active_prefill_tokens) >
               *o.prefill_busy_threshold * static_cast<double>(c.prefill.max_num_batched_tokens);
  };
  switch (o.policy) {
    case DisaggPolicy::kAlways: out.disaggregated = true; break;
    case DisaggPolicy::kNever: out.disaggregated = false; break;
    case DisaggPolicy::kIslBounding: out.disaggregated = !short_uncached(); break;
    case DisaggPolicy::kPrefillLoad: out.disaggregated = !prefill_busy(); break;
    case DisaggPolicy::kIslOrLoad: out.disaggregated = !(short_uncached() || prefill_busy()); break;
    case DisaggPolicy::kPredicted: break;
  }
  return out;
}

}  // namespace kvrouter
