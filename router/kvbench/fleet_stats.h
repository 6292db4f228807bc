// What kvbench reads from a running router's `stats` endpoint over NATS (docs/protocol.md
// section 9): requests routed per rank, the prefill ranks, the P/D decision counts and the
// bookings still held. Used by the online modes (NATS generate and HTTP through kvgateway).
// Plain functions on the caller's NatsClient; thread-compatible.
//
//   auto before = ReadFleetStats(nc, "dynamo");  ...  auto after = ReadFleetStats(nc, "dynamo");
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "events/base/status.h"
#include "events/base/thread_annotations.h"
#include "router/index/worker_key.h"
#include "router/kvbench/online.h"
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

// What one online replay gives back.
struct ReplayOutcome {
  std::vector<RequestRecord> records;
  TokenGaps gaps;
  std::size_t retries = 0;
};
// The frame of an online run: connects kvbench's NATS client (options.nats_url), waits for the
// fleet (options.wait_workers, prefill_workers), reads the router's stats, runs `replay` (given
// that client), and summarizes it with what the run added to the router's counters (per-rank
// spread, P/D decisions) and the bookings left.
Result<Summary> RunWithFleetStats(const std::vector<TraceRequest>& trace, const OnlineOptions& options,
                                  const std::function<Result<ReplayOutcome>(NatsClient&)>& replay);

// A replay's room for one more request: waits on `cv` (mu held) until fewer than
// options.concurrency are open. Answers that never come (a worker killed, messages dropped) must
// not hang the run: false after options.timeout_s without room, said on stderr.
bool AwaitRoom(KvMutex& mu, std::condition_variable_any& cv, const std::size_t& in_flight,
               const OnlineOptions& options) KV_REQUIRES(mu);

}  // namespace kvrouter::bench
