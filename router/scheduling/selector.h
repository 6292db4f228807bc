// Worker selection for every router mode (docs/design.md "Selection"). Pure decision logic over a
// list of candidates that the service assembles (overlap from the index, load from ActiveLoad,
// limits from registrations); mode kv prices them with the request's cost (costs.h). Randomness
// comes from the caller's seeded generator, so decisions are reproducible in tests. Not
// thread-safe (round-robin keeps a cursor); the service calls it under its routing lock.
//
//   Selector sel;  std::size_t i = sel.Pick(RouterMode::kKv, request, candidates, params, rng);
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "router/scheduling/candidate.h"
#include "router/scheduling/costs.h"
#include "router/scheduling/policy.h"

namespace kvrouter {

// The draw that breaks a tie among n candidates of equal cost: the index of the one taken, in
// candidate order.
std::size_t TieDraw(std::size_t n, std::mt19937_64& rng);

class Selector {
 public:
  // Index into candidates (non-empty) of the chosen one. kDirect is the caller's business
  // (the pin is resolved before selection) and picks the first candidate.
  std::size_t Pick(RouterMode mode, const SelectionRequest& req, std::span<const Candidate> cands,
                   const CostParams& params, std::mt19937_64& rng);

 private:
  template <typename Cost>
  std::size_t PickKv(const SelectionRequest& req, std::span<const Candidate> cands, const CostParams& params,
                     std::mt19937_64& rng) const;
  static std::size_t LeastLoaded(std::span<const Candidate> cands, const std::vector<std::size_t>& among,
                                 std::mt19937_64& rng);
  std::uint64_t round_robin_ = 0;
};

}  // namespace kvrouter
