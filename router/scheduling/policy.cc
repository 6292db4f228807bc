#include "router/scheduling/policy.h"

#include <utility>

namespace kvrouter {
namespace {

constexpr std::pair<RouterMode, std::string_view> kModes[] = {
    {RouterMode::kKv, "kv"},
    {RouterMode::kRoundRobin, "round-robin"},
    {RouterMode::kRandom, "random"},
    {RouterMode::kPowerOfTwo, "power-of-two"},
    {RouterMode::kLeastLoaded, "least-loaded"},
    {RouterMode::kDeviceAwareWeighted, "device-aware-weighted"},
    {RouterMode::kDirect, "direct"},
};

}  // namespace

std::string_view RouterModeName(RouterMode mode) {
  for (auto& [m, name] : kModes)
    if (m == mode) return name;
  return "kv";
}

std::optional<RouterMode> RouterModeFromName(std::string_view name) {
  for (auto& [m, n] : kModes)
    if (n == name) return m;
  return std::nullopt;
}

std::string_view QueuePolicyName(QueuePolicy policy) {
  switch (policy) {
    case QueuePolicy::kFcfs: return "fcfs";
    case QueuePolicy::kWspt: return "wspt";
    case QueuePolicy::kLcfs: return "lcfs";
  }
  return "fcfs";
}

}  // namespace kvrouter
