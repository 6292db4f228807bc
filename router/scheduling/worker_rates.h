// WorkerRates: each rank's speed learned online (docs/design.md "Learned rates"). The predicted
// cost (cost_predicted.h) prices a rank's time with the router's prior of engine timing; here two
// factors per rank scale that prior to what the rank really does:
//   prefill factor: observed time to first token / the prior's (its prefill and decode parts:
//                   a caller cannot tell a step's decode work from the prefills batched with it);
//   decode factor:  observed time between response chunks / the predicted decode step (reported;
//                   the time-to-first-token cost uses the prefill factor only).
// An observation is the `free` of a request booked here with the engine's timing (the gateway's
// ResponseTiming of a streamed 200, or the generate relay's own of a response that did not end
// in an error): the prediction made when it was booked (its PriorTtft: what it had to wait for
// and prefill there) against what the caller saw.
//
// Learning is in log space: each observation moves log(factor) a fraction kLearnRate of the way
// to the observed log ratio, the move clipped to kMaxJump, so one stalled or cancelled request
// moves a rank's factor by at most exp(kLearnRate * kMaxJump) (about 15 %), and a rank 4x off
// its prior converges within about 30 requests. Ranks without observations for a while drift
// back toward the fleet's typical factor (half-life kDriftHalfLife): a rank that recovered is
// tried again and re-learned, a new rank starts at what the fleet does (not the prior, which may
// be wrong for the whole fleet). Factors stay in [kMinFactor, kMaxFactor].
//
// Not thread-safe: the Scheduler's owner (Routing) holds its mutex.
//
//   rates.Observe({7, 0}, prior, timing, now);  double f = rates.Of({7, 0}).prefill;
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>

#include "events/base/clock.h"
#include "router/index/worker_key.h"

namespace kvrouter {

struct ResponseTiming;

// What the prior predicted for a request on the rank it was booked on, in the prior's
// milliseconds (cost_predicted.h PriorTtftOf).
struct PriorTtft {
  double prefill_ms = 0;      // its prefill and the prefills queued ahead of it, step overheads included
  double decode_ms = 0;       // the decode work interleaved with those prefill steps
  double decode_step_ms = 0;  // one decode step at the rank's load then
};

class WorkerRates {
 public:
  static constexpr double kLearnRate = 0.2;
  static constexpr double kMaxJump = 0.693;  // ln 2
  static constexpr double kMinFactor = 1.0 / 64;
  static constexpr double kMaxFactor = 64;
  static constexpr std::uint32_t kMinChunks = 4;  // fewer teach no decode factor
  static constexpr std::chrono::seconds kDriftAfter{10};
  static constexpr std::chrono::seconds kDriftHalfLife{30};

  struct Rates {
    double prefill = 1;  // times the prior's prefill time
    double decode = 1;   // times the prior's decode step
    std::uint64_t observations = 0;
  };

  // The rank's factors (the fleet's typical ones for a rank never observed).
  Rates Of(WorkerKey worker) const;
  // Learns from one finished request. Returns false (nothing learned) when the timing says
  // nothing usable (no first byte, non-finite or non-positive times, a prior of zero).
  bool Observe(WorkerKey worker, const PriorTtft& prior, const ResponseTiming& timing, SteadyTime now);
  // Ranks unobserved for kDriftAfter drift toward the fleet's typical factors. Call now and then.
  void Drift(SteadyTime now);
  void RemoveWorker(std::uint64_t worker_id);
  std::uint64_t observations() const { return observations_; }
  // Ranks learned individually: 0 means Of(any rank) is Typical().
  std::size_t ranks() const { return ranks_.size(); }
  // Calls f(rank) for every rank learned individually: those whose Of may differ from Typical().
  template <typename F>
  void ForEachRank(F&& f) const {
    for (const auto& entry : ranks_) f(entry.first);
  }

  // The fleet's typical factors: the median over the ranks observed (1, 1 before any).
  Rates Typical() const { return typical_; }

 private:
  struct Learned {
    double log_prefill = 0;
    double log_decode = 0;
    std::uint64_t observations = 0;
    SteadyTime last{};
    bool has_decode = false;
  };
  void UpdateTypical();

  std::unordered_map<WorkerKey, Learned, WorkerKeyHash> ranks_;
  Rates typical_;
  std::uint64_t observations_ = 0;
  std::optional<SteadyTime> last_drift_;
};

// Reported forms of a rank's factors (stats, /metrics): the prior's marginal prefill rate and
// its decode step at low load, scaled.
double PrefillTokensPerSecond(double prefill_factor);
double DecodeStepSeconds(double decode_factor);

}  // namespace kvrouter
