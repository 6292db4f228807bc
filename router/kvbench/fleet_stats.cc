#include "router/kvbench/fleet_stats.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include "events/msgpack_reader.h"
#include "events/router_endpoints_codec.h"
#include "events/subjects.h"

namespace kvrouter::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Polling a remote service: there is no condition to wait on.
void PollPause() { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }

}  // namespace

Result<FleetStats> ReadFleetStats(NatsClient& nc, const std::string& ns) {
  FleetStats out;
  std::optional<std::uint64_t> next = 0;
  while (next) {
    auto reply = nc.Request(RouterEndpointSubject(ns, router_endpoint::kStats),
                            AsBytes(EncodeStatsRequest({.offset = *next, .limit = StatsRequest::kMaxLimit})),
                            std::chrono::seconds(5));
    if (!reply.ok()) return reply.status();
    auto stats = DecodeStatsReply(*reply);
    if (!stats.ok()) return stats.status();
    for (const WorkerStats& w : stats->workers) {
      out.routed[{w.worker_id, w.dp_rank}] = w.routed_requests;
      out.prefill_ranks += w.role == "prefill";
      out.bookings.requests += w.active_requests;
      out.bookings.prefill_tokens += w.active_prefill_tokens;
      out.bookings.blocks += w.active_blocks;
    }
    if (const auto it = stats->breakdowns.find(std::string(kDisaggDecisions)); it != stats->breakdowns.end()) {
      out.disagg_decisions = it->second;
    }
    next = stats->next_offset;
  }
  return out;
}

Status AwaitWorkers(NatsClient& nc, const std::string& ns, std::size_t n, std::size_t prefill) {
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (true) {
    auto known = ReadFleetStats(nc, ns);
    if (known.ok() && known->routed.size() >= n && known->prefill_ranks >= prefill) return Status::Ok();
    if (Clock::now() > deadline) {
      return Status(StatusCode::kNoWorkers, fmt::format("the router did not see {} workers ({} of them prefill "
                                                        "workers) within 30 s",
                                                        n, prefill));
    }
    PollPause();
  }
}

Result<BookingsLeft> AwaitBookingsReleased(NatsClient& nc, const std::string& ns, double wait_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait_s));
  while (true) {
    auto stats = ReadFleetStats(nc, ns);
    if (!stats.ok()) return stats.status();
    if (stats->bookings == BookingsLeft{} || Clock::now() > deadline) return stats->bookings;
    PollPause();
  }
}

namespace {

// What the run added to the counters: per rank the requests routed between `before` and `after`
// (in rank order) and the decision counts.
void SetFleetDelta(Summary& s, const FleetStats& before, const FleetStats& after) {
  for (const auto& [w, n] : after.routed) {
    const auto b = before.routed.find(w);
    s.worker_requests.push_back(n - (b == before.routed.end() ? 0 : std::min(n, b->second)));
  }
  for (const auto& [path, n] : after.disagg_decisions) {
    const auto b = before.disagg_decisions.find(path);
    s.disagg_decisions[path] = n - (b == before.disagg_decisions.end() ? 0 : std::min(n, b->second));
  }
}

}  // namespace

bool AwaitRoom(KvMutex& mu, std::condition_variable_any& cv, const std::size_t& in_flight, const OnlineOptions& o) {
  if (cv.wait_for(mu, std::chrono::duration<double>(o.timeout_s), [&] { return in_flight < o.concurrency; })) {
    return true;
  }
  fmt::print(stderr, "kvbench {}: no request ended for {} s with {} in flight; giving up\n", o.label, o.timeout_s,
             in_flight);
  return false;
}

Result<Summary> RunWithFleetStats(const std::vector<TraceRequest>& trace, const OnlineOptions& o,
                                  const std::function<Result<ReplayOutcome>(NatsClient&)>& replay) {
  auto nc = NatsClient::Connect({.url = o.nats_url,
                                 .name = "kvbench",
                                 .retry_on_failed_connect = false,
                                 .send_asap = true,
                                 .security = o.nats_security},
                                {});
  if (!nc.ok()) return nc.status();
  NatsClient& client = **nc;
  if (o.wait_workers > 0) {
    if (Status s = AwaitWorkers(client, o.ns, o.wait_workers, o.prefill_workers); !s.ok()) return s;
  }
  auto before = ReadFleetStats(client, o.ns);
  if (!before.ok()) return Status(before.status().code(), "router stats: " + before.status().message());
  if (trace.empty()) return Summarize(o.label, {}, {}, o.slo);
  auto outcome = replay(client);
  if (!outcome.ok()) return outcome.status();
  Summary s = Summarize(o.label, outcome->records, {}, o.slo);
  s.retries = outcome->retries;
  SetTokenGaps(s, outcome->gaps);
  auto after = ReadFleetStats(client, o.ns);
  if (!after.ok()) {
    fmt::print(stderr, "kvbench: router stats after the run: {}\n", after.status().message());
    return s;
  }
  SetFleetDelta(s, *before, *after);
  if (auto left = AwaitBookingsReleased(client, o.ns, 5); left.ok()) s.bookings_left = *left;
  return s;
}

}  // namespace kvrouter::bench
