#include "router/scheduling/worker_rates.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "events/router_endpoints_codec.h"
#include "router/scheduling/cost_predicted.h"

namespace kvrouter {
namespace {

// One step of log-space learning toward `observed` (a ratio, clipped to the factor bounds).
void Learn(double& log_factor, double observed) {
  const double target = std::log(std::clamp(observed, WorkerRates::kMinFactor, WorkerRates::kMaxFactor));
  const double jump = std::clamp(target - log_factor, -WorkerRates::kMaxJump, WorkerRates::kMaxJump);
  log_factor += WorkerRates::kLearnRate * jump;
}

double Median(std::vector<double>& v) {
  if (v.empty()) return 0;
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  if (v.size() % 2 == 1) return *mid;
  return (*mid + *std::max_element(v.begin(), mid)) / 2;  // an even count: the two middle ones
}

bool Positive(double v) { return std::isfinite(v) && v > 0; }

}  // namespace

WorkerRates::Rates WorkerRates::Of(WorkerKey worker) const {
  const auto it = ranks_.find(worker);
  if (it == ranks_.end()) return typical_;
  return {std::exp(it->second.log_prefill), std::exp(it->second.log_decode), it->second.observations};
}

bool WorkerRates::Observe(WorkerKey worker, const PriorTtft& prior, const ResponseTiming& timing, SteadyTime now) {
  if (!Positive(timing.ttfb_ms) || !Positive(prior.prefill_ms)) return false;
  auto [it, fresh] = ranks_.try_emplace(worker);
  Learned& l = it->second;
  if (fresh) {
    l.log_prefill = std::log(typical_.prefill);
    l.log_decode = std::log(typical_.decode);
  }
  // A few chunks at least: a response's first and last chunks (a role, usage, [DONE]) come
  // close together and say little of a step.
  if (timing.chunks >= kMinChunks && Positive(timing.inter_chunk_ms_mean) && Positive(prior.decode_step_ms)) {
    Learn(l.log_decode, timing.inter_chunk_ms_mean / prior.decode_step_ms);
    l.has_decode = true;
  }
  // The whole time to first token against the prior's: a step's decode work and the prefills
  // batched with it are not told apart by what a caller sees (a step that decodes also prefills
  // others' chunks), so the observed inter-chunk time cannot be taken out of it.
  Learn(l.log_prefill, timing.ttfb_ms / (prior.prefill_ms + std::max(0.0, prior.decode_ms)));
  ++l.observations;
  l.last = now;
  ++observations_;
  return true;
}

void WorkerRates::UpdateTypical() {
  std::vector<double> prefill, decode;
  prefill.reserve(ranks_.size());
  for (const auto& [k, l] : ranks_) {
    if (l.observations == 0) continue;
    prefill.push_back(l.log_prefill);
    if (l.has_decode) decode.push_back(l.log_decode);
  }
  typical_.prefill = prefill.empty() ? 1.0 : std::exp(Median(prefill));
  typical_.decode = decode.empty() ? 1.0 : std::exp(Median(decode));
}

void WorkerRates::Drift(SteadyTime now) {
  if (!last_drift_) last_drift_ = now;
  const double dt = std::chrono::duration<double>(now - *last_drift_).count();
  if (dt < 1.0) return;
  last_drift_ = now;
  UpdateTypical();
  const double half_life = std::chrono::duration<double>(kDriftHalfLife).count();
  const double log_prefill = std::log(typical_.prefill);
  const double log_decode = std::log(typical_.decode);
  for (auto& [k, l] : ranks_) {
    if (now - l.last < kDriftAfter) continue;
    // Only the time it has been unheard of past kDriftAfter counts (Drift may run rarely).
    const double quiet = std::chrono::duration<double>(now - l.last - kDriftAfter).count();
    const double keep = std::exp2(-std::min({dt, quiet, 3600.0}) / half_life);
    l.log_prefill = log_prefill + (l.log_prefill - log_prefill) * keep;
    l.log_decode = log_decode + (l.log_decode - log_decode) * keep;
  }
}

void WorkerRates::RemoveWorker(std::uint64_t worker_id) {
  std::erase_if(ranks_, [&](const auto& e) { return e.first.worker_id == worker_id; });
  UpdateTypical();  // without it: what a new rank starts at
}

double PrefillTokensPerSecond(double prefill_factor) { return 1000.0 / (prior::kPrefillMsPerToken * prefill_factor); }

double DecodeStepSeconds(double decode_factor) { return prior::DecodeStepMs(0) * decode_factor / 1000.0; }

}  // namespace kvrouter
