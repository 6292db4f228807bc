// What kvbench reads from a running router's `stats` endpoint over NATS (docs/protocol.md
// section 9): requests routed per rank, the prefill ranks, the P/D decision counts and the
// bookings still held. Used by the online modes (NATS generate and HTTP through kvgateway).
// Plain functions on the caller's NatsClient; thread-compatible.
//
//   auto before = ReadFleetStats(nc, "dynamo");  ...  auto after = ReadFleetStats(nc, "dynamo");
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "events/base/status.h"
#include "router/index/worker_key.h"
#include "router/kvbench/report.h"
#include "transport/nats_client.h"

namespace kvrouter::bench {

struct FleetStats {
  std::map<WorkerKey, std::uint64_t> routed;              // requests routed so far per (worker, dp_rank)
  std::size_t prefill_ranks = 0;                          // ranks with role prefill
  std::map<std::string, std::uint64_t> disagg_decisions;  // the breakdown kDisaggDecisions
  BookingsLeft bookings;                                  // active requests, prefill tokens, blocks summed
};

// Every page of the router's stats.
Result<FleetStats> ReadFleetStats(NatsClient& nc, const std::string& ns);

// Workers register with heartbeats: polls the router's stats until it knows `n` ranks,
// `prefill` of them with role prefill (30 s at most).
Status AwaitWorkers(NatsClient& nc, const std::string& ns, std::size_t n, std::size_t prefill);

// Requests finish at the client a moment before the router hears `free`: polls the stats until
// the bookings are all zero or `wait_s` passed, and returns the last bookings read.
Result<BookingsLeft> AwaitBookingsReleased(NatsClient& nc, const std::string& ns, double wait_s);

// What the run added to the counters: per rank the requests routed between `before` and `after`
// (in rank order) and the decision counts.
void SetFleetDelta(Summary& s, const FleetStats& before, const FleetStats& after);

}  // namespace kvrouter::bench
