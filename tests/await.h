// AwaitTrue: for unit tests that wait for another thread to reach a state. Spins (yielding the
// CPU) until pred() holds or 10 s pass, and returns pred(): a condition awaited, not a sleep.
#pragma once

#include <chrono>
#include <thread>

namespace kvrouter {

template <typename Pred>
bool AwaitTrue(Pred&& pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!pred() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  return pred();
}

}  // namespace kvrouter
