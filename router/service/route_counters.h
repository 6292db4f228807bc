// RouteCounters: what the stats reply and /metrics say about routing (docs/protocol.md section 5
// `stats`): requests by endpoint and by result, errors by code, decisions by mode, and the
// requests routed to each rank.
// Thread contract: none; Routing holds its routing mutex around every call.
//
//   c.Received(RouteKind::kRoute);  c.Answered(RouteKind::kRoute, "ok");  c.Fill(reply);
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "events/base/status.h"
#include "events/router_endpoints_codec.h"
#include "router/index/worker_key.h"
#include "router/scheduling/policy.h"
#include "router/scheduling/scheduler.h"

namespace kvrouter {

class RouteCounters {
 public:
  // A request came in by `kind`'s endpoint.
  void Received(RouteKind kind) { Bump(RouteKindName(kind)); }
  // It was answered with `result` ("ok" or an error code's name); a queued request is counted
  // when it leaves the queue.
  void Answered(RouteKind kind, std::string_view result);
  // It failed on arrival with `code` (also counted by code in route_errors).
  void Failed(RouteKind kind, StatusCode code);
  // A decision in `mode` for a prompt of `request_blocks` blocks, `cached_blocks` of them cached
  // where it prefills; one that updates states (route, generate) names its rank, whose count
  // goes up.
  void Routed(RouterMode mode, std::optional<WorkerKey> rank, std::uint64_t request_blocks = 0,
              std::uint64_t cached_blocks = 0);
  // The worker left: its ranks' counts go.
  void ForgetWorker(std::uint64_t worker_id);

  std::uint64_t RoutedTo(WorkerKey worker) const;
  // Summed over the worker's ranks.
  std::uint64_t RoutedToWorker(std::uint64_t worker_id) const;
  // The breakdowns "routed", "route_errors" and "requests" of a stats reply, and its counters
  // routed_request_blocks and routed_cached_blocks (their ratio is the decisions' KV hit rate).
  void Fill(StatsReply& reply) const;

 private:
  void Bump(std::string_view key);  // ++requests_[key], no allocation once the key is known

  std::map<std::string, std::uint64_t> routed_;        // mode -> count
  std::map<WorkerKey, std::uint64_t> routed_to_;       // ordered: a worker's ranks are a range
  std::map<std::string, std::uint64_t> route_errors_;  // code -> count
  std::uint64_t request_blocks_ = 0, cached_blocks_ = 0;  // summed over decisions
  // "<endpoint>" -> received, "<endpoint>.<result>" -> answered so.
  std::map<std::string, std::uint64_t, std::less<>> requests_;
};

}  // namespace kvrouter
