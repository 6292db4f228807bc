#include "router/service/route_counters.h"

#include <fmt/format.h>

namespace kvrouter {

void RouteCounters::Answered(RouteKind kind, std::string_view result) {
  char key[64];
  const auto end = fmt::format_to_n(key, sizeof(key), "{}.{}", RouteKindName(kind), result).out;
  Bump({key, static_cast<std::size_t>(end - key)});
}

void RouteCounters::Failed(RouteKind kind, StatusCode code) {
  ++route_errors_[std::string(StatusCodeName(code))];
  Answered(kind, StatusCodeName(code));
}

void RouteCounters::Routed(RouterMode mode, std::optional<WorkerKey> rank, std::uint64_t request_blocks,
                           std::uint64_t cached_blocks) {
  ++routed_[std::string(RouterModeName(mode))];
  if (rank) ++routed_to_[*rank];
  request_blocks_ += request_blocks;
  cached_blocks_ += cached_blocks;
}

void RouteCounters::ForgetWorker(std::uint64_t worker_id) {
  for (auto r = routed_to_.lower_bound({worker_id, 0}); r != routed_to_.end() && r->first.worker_id == worker_id;) {
    r = routed_to_.erase(r);
  }
}

std::uint64_t RouteCounters::RoutedTo(WorkerKey worker) const {
  auto it = routed_to_.find(worker);
  return it == routed_to_.end() ? 0 : it->second;
}

std::uint64_t RouteCounters::RoutedToWorker(std::uint64_t worker_id) const {
  std::uint64_t n = 0;
  for (auto it = routed_to_.lower_bound({worker_id, 0}); it != routed_to_.end() && it->first.worker_id == worker_id; ++it) {
    n += it->second;
  }
  return n;
}

void RouteCounters::Bump(std::string_view key) {
  auto it = requests_.find(key);
  if (it == requests_.end()) it = requests_.emplace(std::string(key), 0).first;
  ++it->second;
}

void RouteCounters::Fill(StatsReply& r) const {
  r.breakdowns["routed"] = routed_;
  r.breakdowns["route_errors"] = route_errors_;
  r.breakdowns["requests"] = {requests_.begin(), requests_.end()};
  r.counters["routed_request_blocks"] = request_blocks_;
  r.counters["routed_cached_blocks"] = cached_blocks_;
}

}  // namespace kvrouter
