// EngineLoad: the gateway's own count of engine calls in flight per worker, for
// --router-fallback least-loaded (docs/protocol.md section 11): while no router answers, a
// request goes to the engine serving its model with the fewest of this gateway's calls under way.
// Every completion call (a leg of a disaggregated request too) is counted from its start until
// the Hold returned by Add is dropped: the call's callbacks own it, and HttpClient drops them
// when the call is done, however it ends.
// An engine whose call just failed (refused, 5xx, broken off) is passed over for kFailedPause
// unless every candidate is: one that fails fast would otherwise hold no calls and be chosen
// first each time.
// Thread contract: every method may be called from any thread (one mutex, held for a map
// lookup). A Hold may outlive the EngineLoad (the counts are shared with it).
//
//   auto hold = load.Add(worker);  ...  auto pick = load.Least(candidates, rotation);
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>

#include "events/base/clock.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

class EngineLoad {
 public:
  using Hold = std::shared_ptr<void>;
  static constexpr std::chrono::seconds kFailedPause{5};

  // Counts one call to `worker` until the returned Hold (and every copy of it) is gone.
  Hold Add(std::uint64_t worker);
  std::uint32_t InFlight(std::uint64_t worker) const;
  // A call to `worker` failed at `now`.
  void Failed(std::uint64_t worker, SteadyTime now);
  // Some of `workers` did not fail within kFailedPause of `now`.
  bool AnyHealthy(std::span<const std::uint64_t> workers, SteadyTime now) const;
  // The candidate with the fewest calls in flight, among those that did not fail within
  // kFailedPause of `now` (among all when every one did); among equals, the first from index
  // `rotation % size` on, so that equal engines take turns. nullopt when there is none.
  std::optional<std::uint64_t> Least(std::span<const std::uint64_t> candidates, std::size_t rotation,
                                     SteadyTime now) const;

 private:
  struct Counts {
    mutable KvMutex mu;
    std::unordered_map<std::uint64_t, std::uint32_t> in_flight KV_GUARDED_BY(mu);  // no zeros kept
    std::unordered_map<std::uint64_t, SteadyTime> failed KV_GUARDED_BY(mu);  // the latest failure; old ones dropped
  };
  std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();
};

}  // namespace kvrouter
