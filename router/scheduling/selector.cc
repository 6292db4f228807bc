#include "router/scheduling/selector.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvrouter {
namespace {

std::size_t Uniform(std::size_t n, std::mt19937_64& rng) {
  return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
}

}  // namespace

std::size_t TieDraw(std::size_t n, std::mt19937_64& rng) { return Uniform(n, rng); }

template <typename Cost>
std::size_t Selector::PickKv(const SelectionRequest& req, std::span<const Candidate> cands, const CostParams& p,
                             std::mt19937_64& rng) const {
  std::vector<double> cost(cands.size());
  double lo = std::numeric_limits<double>::infinity();
  double hi = -lo;
  double recent_sum = 0;
  if constexpr (Cost::kReadsHistory) {
    for (const Candidate& c : cands) recent_sum += c.recent_requests;
  }
  const KvPricing pricing = Cost::PricingOf(req, p, recent_sum, cands.size());
  for (std::size_t i = 0; i < cands.size(); ++i) {
    cost[i] = Cost::PickPrice(cands[i], req, p, pricing);
    lo = std::min(lo, cost[i]);
    hi = std::max(hi, cost[i]);
  }
  if (p.temperature > 0 && hi > lo && std::isfinite(hi - lo)) {
    // Softmax over normalised costs: p_i ∝ exp(-(cost_i - min) / ((max - min) * T)).
    std::vector<double> w(cands.size());
    double total = 0;
    for (std::size_t i = 0; i < cands.size(); ++i) {
      w[i] = std::exp(-(cost[i] - lo) / ((hi - lo) * p.temperature));
      if (!std::isfinite(w[i])) w[i] = 0;
      total += w[i];
    }
    if (total > 0 && std::isfinite(total)) return std::discrete_distribution<std::size_t>(w.begin(), w.end())(rng);
  }
  // Lowest cost, ties broken uniformly at random (also the all-equal case with T > 0).
  std::vector<std::size_t> best;
  for (std::size_t i = 0; i < cands.size(); ++i) {
    if (cost[i] == lo) best.push_back(i);
  }
  return best[TieDraw(best.size(), rng)];
}

std::size_t Selector::LeastLoaded(std::span<const Candidate> cands, const std::vector<std::size_t>& among,
                                  std::mt19937_64& rng) {
  std::uint32_t fewest = std::numeric_limits<std::uint32_t>::max();
  std::vector<std::size_t> best;
  for (std::size_t i : among) {
    if (cands[i].active_requests < fewest) {
      fewest = cands[i].active_requests;
      best.clear();
    }
    if (cands[i].active_requests == fewest) best.push_back(i);
  }
  return best[Uniform(best.size(), rng)];
}

std::size_t Selector::Pick(RouterMode mode, const SelectionRequest& req, std::span<const Candidate> cands,
                           const CostParams& params, std::mt19937_64& rng) {
  const std::size_t n = cands.size();
  if (n == 1) return 0;
  std::vector<std::size_t> all(n);
  for (std::size_t i = 0; i < n; ++i) all[i] = i;
  switch (mode) {
    case RouterMode::kKv:
      return WithCost(params.model, [&]<class Cost>() { return PickKv<Cost>(req, cands, params, rng); });
    case RouterMode::kRoundRobin: return round_robin_++ % n;
    case RouterMode::kRandom: return Uniform(n, rng);
    case RouterMode::kPowerOfTwo: {
      const std::size_t a = Uniform(n, rng);
      std::size_t b = Uniform(n - 1, rng);
      if (b >= a) ++b;
      if (cands[a].active_requests != cands[b].active_requests) {
        return cands[a].active_requests < cands[b].active_requests ? a : b;
      }
      return rng() & 1 ? a : b;
    }
    case RouterMode::kLeastLoaded: return LeastLoaded(cands, all, rng);
    case RouterMode::kDeviceAwareWeighted: {
      std::vector<std::size_t> cpu, accel;
      double cpu_cap = 0, accel_cap = 0;
      for (std::size_t i = 0; i < n; ++i) {
        (cands[i].is_cpu ? cpu : accel).push_back(i);
        (cands[i].is_cpu ? cpu_cap : accel_cap) += std::max<std::uint32_t>(1, cands[i].capacity);
      }
      if (cpu.empty() || accel.empty()) return LeastLoaded(cands, all, rng);
      // Accelerators get device_ratio times their capacity's share of the traffic.
      const double accel_weight = params.device_ratio * accel_cap;
      const bool pick_accel = std::uniform_real_distribution<double>(0, accel_weight + cpu_cap)(rng) < accel_weight;
      return LeastLoaded(cands, pick_accel ? accel : cpu, rng);
    }
    case RouterMode::kDirect: return 0;
  }
  return 0;
}

}  // namespace kvrouter
