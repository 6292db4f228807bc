// kvbench's online mode: replays a trace through a running router's `generate` endpoint
// (which forwards to running workers, e.g. kvmocker) over NATS, on real time. Requests leave
// at their trace time (divided by the speedup) with at most `concurrency` in flight; responses
// stream back on this client's inbox. Per-worker spread and the P/D decision counts come from
// the router's stats; the engines' steps are not seen, so the summary has no busy times
// (worker_busy_ms stays empty). TPOT is from each request's first and last message; ITL from
// the messages' arrival gaps only when every message after a request's first carries one token
// (workers that answer the later tokens in one message, as kvmocker over NATS does, give none).
//
//   auto s = RunOnline(trace, {.nats_url = "nats://127.0.0.1:4222", .concurrency = 64});
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "router/kvbench/report.h"
#include "router/kvbench/trace.h"
#include "transport/nats_client.h"

namespace kvrouter::bench {

struct OnlineOptions {
  std::string label = "online";
  std::string nats_url = "nats://127.0.0.1:4222";
  NatsSecurity nats_security;  // --nats-creds, --nats-user, ... --nats-tls-*
  std::string ns = "dynamo";
  std::size_t concurrency = 64;  // requests in flight at most
  double timeout_s = 600;        // give up on requests still open after this long
  bool progress = true;          // progress lines on stderr
  std::size_t wait_workers = 0;  // first wait (up to 30 s) until the router knows this many ranks
  double request_timeout_s = 0;  // > 0: a request silent this long is tried again (or fails)
  std::uint32_t retries = 0;     // attempts after the first, on no responders / no_workers /
                                 //   timeout / silence
  // > 0: a P/D fleet; the wait for wait_workers ranks (> prefill_workers) also waits until this
  // many of them have role prefill.
  std::size_t prefill_workers = 0;
  SloTargets slo;  // what SLO goodput counts
  // HTTP mode (router/kvbench/http_replay.h) when set: kvgateway's base URL ("http://host:port").
  std::string gateway_url;
  std::string model = "mock";  // HTTP mode: the model asked for
  double abort_fraction = 0;   // HTTP mode: the share of requests their client abandons, in [0, 1)
  std::uint64_t seed = 1;      // HTTP mode: which requests abort, and where
};

Result<Summary> RunOnline(const std::vector<TraceRequest>& trace, const OnlineOptions& options);

}  // namespace kvrouter::bench
