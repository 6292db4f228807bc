// SteadyTime: the one time point type of the router's bookkeeping (leases, bookings, predictions,
// queue deadlines). Components that must be testable on virtual time take a clock callback
// returning it instead of reading std::chrono::steady_clock themselves.
#pragma once

#include <chrono>

namespace kvrouter {

using SteadyTime = std::chrono::steady_clock::time_point;

}  // namespace kvrouter
