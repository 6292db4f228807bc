// EngineTiming: docs/design.md's timing model of a vLLM-like engine (Dynamo's mocker fit), in ms.
// The simulated engines run on it (MockEngine: kvmocker, kvbench --offline). The router's prior
// (router/scheduling/cost_predicted.h, namespace prior) starts from the same fit but is kept
// apart: editing this simulator does not move the router it is used to judge. Pure functions.
//
//   double ms = PrefillMs(6000) + DecodeStepMs(0.4);
#pragma once

#include <algorithm>

namespace kvrouter {

// Prefill of n uncached prompt tokens in one step: 4.21e-7 n^2 + 0.0152 n + 16.5.
inline constexpr double kPrefillMsPerToken = 0.0152;
inline constexpr double kPrefillMsPerTokenSquared = 4.21e-7;
inline constexpr double kStepOverheadMs = 16.5;

inline double PrefillMs(double n) {
  return kPrefillMsPerTokenSquared * n * n + kPrefillMsPerToken * n + kStepOverheadMs;
}

// A chunk of a prompt's prefill, uncached tokens [a, b), without the step overhead: one prompt
// prefilled whole, PrefillMs(n), is PrefillChunkMs(0, n) + kStepOverheadMs, and chunks add up to
// the whole (each chunk's tokens attend to every earlier token of the prompt).
inline double PrefillChunkMs(double a, double b) {
  return kPrefillMsPerTokenSquared * (b * b - a * a) + kPrefillMsPerToken * (b - a);
}

// One decode step at KV-cache utilisation u in [0, 1]: max(1, -25.74 u^2 + 54.01 u + 5.74).
inline double DecodeStepMs(double u) { return std::max(1.0, -25.74 * u * u + 54.01 * u + 5.74); }

}  // namespace kvrouter
