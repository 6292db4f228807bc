// The choices that select scheduling behaviour (docs/design.md "Selection", "Queue"): the router
// mode, the queue's order and the kv cost model, with their flag spellings. Plain values.
//
//   auto mode = RouterModeFromName("kv");  // RouterMode::kKv; nullopt for an unknown name
#pragma once

#include <optional>
#include <string_view>

namespace kvrouter {

enum class RouterMode {
  kKv,  // KV-cache-aware cost (docs/design.md "Selection")
  kRoundRobin,
  kRandom,
  kPowerOfTwo,           // two random candidates, fewer active requests wins
  kLeastLoaded,          // fewest active requests
  kDeviceAwareWeighted,  // CPU vs accelerator split by --device-ratio, then least-loaded
  kDirect,               // the request pins worker_id
};
std::string_view RouterModeName(RouterMode mode);
std::optional<RouterMode> RouterModeFromName(std::string_view name);

enum class QueuePolicy { kFcfs, kWspt, kLcfs };
std::string_view QueuePolicyName(QueuePolicy policy);

// kKvBlocks: Dynamo's block formula (cost_kv_blocks.h KvBlocksCost), chosen whenever
// --router-kv-overlap-score-credit or --router-prefill-load-scale is set explicitly.
// kPredicted: the router's default (cost_predicted.h PredictedTimeCost).
enum class CostModel { kKvBlocks, kPredicted };

}  // namespace kvrouter
