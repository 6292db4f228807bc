// The disaggregated decision (docs/design.md "Disaggregated prefill and decode"; protocol.md
// section 13): whether a request whose candidates include a prefill pool and a decode pool goes
// through the prefill pool, or prefills locally on its decode rank. Each policy of
// --router-disagg-policy is one pure function of three candidates: the decode rank the full kv
// cost chose (local), and the prefill rank and the decode rank by load that a disaggregated
// request would use (remote). KvTransfer prices moving the KV from one to the other and learns
// its speed from observed transfers. Pure functions and a plain value; not thread-safe.
//
//   const DisaggChoice c = ChooseDisagg(options, {local, prefill, remote_decode}, req, params, transfer);
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>

#include "router/scheduling/candidate.h"
#include "router/scheduling/cost_predicted.h"

namespace kvrouter {

enum class DisaggPolicy { kPredicted, kAlways, kNever, kIslBounding, kPrefillLoad, kIslOrLoad };
std::string_view DisaggPolicyName(DisaggPolicy policy);
std::optional<DisaggPolicy> DisaggPolicyFromName(std::string_view name);

struct DisaggOptions {
  DisaggPolicy policy = DisaggPolicy::kPredicted;  // --router-disagg-policy
  bool decode_fallback = true;                     // --router-decode-fallback
  // Dynamo's conditional disaggregation: --router-conditional-disagg-eff-isl-threshold, its
  // -eff-isl-ratio-threshold and -prefill-busy-threshold (this one inherits
  // --router-queue-threshold when unset; prefill_load needs one of them).
  double eff_isl_threshold = 2048;
  double eff_isl_ratio_threshold = 0.7;
  std::optional<double> prefill_busy_threshold;
  // The transfer's prior: --router-kv-bytes-per-token, --router-kv-transfer-gbps (Gbit/s).
  double kv_bytes_per_token = 131072;
  double kv_transfer_gbps = 400;
};

// The KV transfer's time: the prior from the flags, scaled by a factor learned from transfers
// observed (from a request's prefill_done to its decode leg's first byte, against the prediction
// made when it was booked). The factor moves a quarter of the way to each observation's ratio,
// which is clamped to [1/16, 16] so one stalled transfer does not rule the next thousand.
class KvTransfer {
 public:
  KvTransfer(double bytes_per_token, double gbps) : ms_per_token_(bytes_per_token * 8 / (gbps * 1e9) * 1e3) {}
  // The prior's milliseconds for `tokens` tokens of KV.
  double PriorMs(double tokens) const { return tokens * ms_per_token_; }
  double Ms(double tokens) const { return factor_ * PriorMs(tokens); }
  // A transfer (with its first decode step) observed to take `observed_ms` where `predicted_ms`
  // was the prior's; false when nothing was learned (no prediction, or a bad figure).
  bool Observe(double predicted_ms, double observed_ms);
  double factor() const { return factor_; }
  std::uint64_t observations() const { return observations_; }

 private:
  static constexpr double kStep = 0.25;
  static constexpr double kMaxRatio = 16;
  const double ms_per_token_;
  double factor_ = 1;
  std::uint64_t observations_ = 0;
};

// The three ranks a decision compares.
struct DisaggCandidates {
  const Candidate& local;          // a decode rank by the full kv cost: where a local prefill goes
  const Candidate& prefill;        // a prefill rank by the kv cost
  const Candidate& remote_decode;  // a decode rank by load: where a disaggregated decode goes
};

struct DisaggChoice {
  bool disaggregated = false;
  // The predicted policy's estimates, in ms (0 under the others): the local prefill's first token
  // with the stall it inflicts on the requests decoding there, and the prefill pool's first token
  // with the transfer and the first decode step.
  double local_ms = 0;
  double remote_ms = 0;
  double transfer_ms = 0;  // the transfer's prediction, learned factor included (every policy)
};

// Tokens of the prompt not cached on c (by its device and tier overlap, credited as the costs do).
double UncachedTokens(const Candidate& c, const SelectionRequest& req, const CostParams& p);

// The share of the stall a local prefill inflicts on the requests decoding on its rank that the
// predicted policy weighs against the request's own first token. A stall delays each of those
// requests' next token once, over hundreds of tokens, so priced whole (as the predicted cost
// prices it among ranks of one pool) it sends nearly every long prompt to the prefill pool and
// queues the pool's first tokens behind it; priced at a quarter, the policy's goodput leads every
// fixed policy's at 1x, 2x and 4x the shared trace's rate (docs/performance.md, "measurements
// behind the code's constants").
inline constexpr double kLocalStallWeight = 0.25;

// The predicted policy's two estimates:
//   local  = ttft(local) + kLocalStallWeight * inflicted(local): the predicted cost's terms
//            (cost_predicted.h TimeOn) without its spread, the stall of every request decoding
//            there weighed at kLocalStallWeight
//   remote = prefill.prefill_factor * (queued and uncached prefill there, in steps)
//            + transfer(uncached tokens on remote_decode)
//            + remote_decode.prefill_factor * (its queued local prefills' time)
//            + remote_decode.decode_factor * DecodeStepMs(its utilisation with this request)
DisaggChoice PredictDisagg(const DisaggCandidates& c, const SelectionRequest& req, const CostParams& p,
                           const KvTransfer& transfer);

// The decision of `options.policy` (protocol.md section 13: "When to skip the prefill pool").
DisaggChoice ChooseDisagg(const DisaggOptions& options, const DisaggCandidates& c, const SelectionRequest& req,
                          const CostParams& p, const KvTransfer& transfer);

}  // namespace kvrouter
