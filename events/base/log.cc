#include "events/base/log.h"

#include <cstdio>

namespace kvrouter {

std::string_view LogLevelLetter(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo: return "I";
    case LogLevel::kWarning: return "W";
    case LogLevel::kError: return "E";
  }
  return "?";
}

RateLimitedLog::RateLimitedLog(std::chrono::milliseconds interval, Clock clock, Sink sink)
    : interval_(interval),
      clock_(clock ? std::move(clock) : Clock([] { return std::chrono::steady_clock::now(); })),
      sink_(sink ? std::move(sink) : Sink([](LogLevel, std::string_view line) {
        // One fwrite per line so concurrent lines do not interleave mid-line.
        std::string out(line);
        out.push_back('\n');
        std::fwrite(out.data(), 1, out.size(), stderr);
      })) {}

bool RateLimitedLog::Admit(std::string_view key, uint64_t* suppressed) {
  const auto now = clock_();
  KvMutexLock lock(mu_);
  auto it = keys_.find(std::string(key));
  if (it == keys_.end() && keys_.size() >= kMaxKeys) it = keys_.find(std::string(kOverflowKey));
  if (it == keys_.end()) {
    keys_.emplace(keys_.size() >= kMaxKeys ? std::string(kOverflowKey) : std::string(key), KeyState{now, 0});
    if (suppressed != nullptr) *suppressed = 0;
    return true;
  }
  KeyState& state = it->second;
  if (now - state.last_written < interval_) {
    ++state.suppressed;
    ++suppressed_total_;
    return false;
  }
  if (suppressed != nullptr) *suppressed = state.suppressed;
  state.suppressed = 0;
  state.last_written = now;
  return true;
}

uint64_t RateLimitedLog::suppressed_total() const {
  KvMutexLock lock(mu_);
  return suppressed_total_;
}

void RateLimitedLog::Emit(LogLevel level, std::string_view key, const std::string& message, uint64_t suppressed) {
  std::string line = fmt::format("kvrouter {} [{}] {}", LogLevelLetter(level), key, message);
  if (suppressed > 0) line += fmt::format(" ({} similar suppressed)", suppressed);
  sink_(level, line);
}

}  // namespace kvrouter
