// RateLimitedLog: levelled log lines to stderr, at most one line per key per interval.
//
// Anything a bad peer or a flaky network can trigger (malformed messages, slow consumers,
// reconnect storms) logs through one of these: the first line for a key is written at once,
// later ones inside the interval are only counted, and the next line written for that key says
// how many were suppressed. Keys should be fixed strings, never a peer's value; even so the key
// table is bounded (kMaxKeys): past it, new keys share one rate limit. Thread-safe: any thread
// may call Log concurrently (one mutex; lines are rare by construction). The clock and the sink are injectable so tests
// need neither sleeps nor stderr.
//
//   RateLimitedLog log(std::chrono::seconds(10));
//   log.Log(LogLevel::kWarning, "decode", "dropped undecodable event from {}", subject);
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "events/base/clock.h"
#include "events/base/thread_annotations.h"

#include <fmt/format.h>

namespace kvrouter {

enum class LogLevel { kInfo, kWarning, kError };

// "I", "W", "E".
std::string_view LogLevelLetter(LogLevel level);

class RateLimitedLog {
 public:
  using Clock = std::function<SteadyTime()>;
  // Receives one finished line without a trailing newline.
  using Sink = std::function<void(LogLevel, std::string_view line)>;

  // interval: minimum time between two lines of the same key (default 10 s).
  // clock: defaults to std::chrono::steady_clock::now. sink: defaults to stderr.
  explicit RateLimitedLog(std::chrono::milliseconds interval = std::chrono::seconds(10), Clock clock = nullptr,
                          Sink sink = nullptr);

  // Formats and writes the line if `key` has not been written within the interval, else counts
  // it as suppressed. Returns whether the line was written. The formatting cost is paid only
  // for lines that are written.
  template <typename... Args>
  bool Log(LogLevel level, std::string_view key, fmt::format_string<Args...> format, Args&&... args) {
    uint64_t suppressed = 0;
    if (!Admit(key, &suppressed)) return false;
    Emit(level, key, fmt::format(format, std::forward<Args>(args)...), suppressed);
    return true;
  }

  // The gate on its own: true when a line for `key` may be written now (and records that it
  // was); `*suppressed` gets the number of lines refused for `key` since the last admitted one.
  bool Admit(std::string_view key, uint64_t* suppressed);

  // Lines refused since construction, all keys together.
  uint64_t suppressed_total() const;

  // Distinct keys kept; beyond it new keys are limited together under kOverflowKey.
  static constexpr std::size_t kMaxKeys = 256;
  static constexpr std::string_view kOverflowKey = "(other keys)";

 private:
  struct KeyState {
    SteadyTime last_written;
    uint64_t suppressed = 0;
  };

  void Emit(LogLevel level, std::string_view key, const std::string& message, uint64_t suppressed);

  const std::chrono::milliseconds interval_;
  const Clock clock_;
  const Sink sink_;
  mutable KvMutex mu_;
  std::unordered_map<std::string, KeyState> keys_ KV_GUARDED_BY(mu_);  // at most kMaxKeys + 1
  uint64_t suppressed_total_ KV_GUARDED_BY(mu_) = 0;
};

}  // namespace kvrouter
