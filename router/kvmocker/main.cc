// kvmocker: N simulated vLLM-like workers on NATS (docs/design.md "Mock worker", docs/protocol.md 2-4, 6, 7),
// with --http-port each with an OpenAI HTTP face (section 11).
// Parses flags (and DYN_* environment), connects, runs a MockWorkerFleet until SIGINT/SIGTERM,
// then announces "leaving", drains and exits 0.
// Exit codes: 0 clean shutdown or --help, 2 bad flags, 1 NATS failure.
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "router/common/http_server.h"
#include "router/kvmocker/config.h"
#include "router/kvmocker/fleet.h"
#include "transport/nats_client.h"
#include "transport/stop_signals.h"

namespace {

// "7", "7, 8" or "7..38" for many.
std::string DescribeIds(const std::vector<std::uint64_t>& ids) {
  if (ids.size() <= 4) return fmt::format("{}", fmt::join(ids, ", "));
  return fmt::format("{}..{}", ids.front(), ids.back());
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvrouter;
  auto parsed = ParseMockerConfig(argc, argv, [](const char* name) { return std::getenv(name); });
  if (!parsed.ok()) {
    fmt::print(stderr, "kvmocker: {}\n(see kvmocker --help)\n", parsed.status().message());
    return 2;
  }
  if (parsed->help) {
    fmt::print("{}", parsed->help_text);
    return 0;
  }
  const MockerConfig& cfg = parsed->config;

  StopSignals stop;  // before any thread starts: they inherit the blocked mask

  auto nc =
      NatsClient::Connect({.url = cfg.nats_server,
                           .name = "kvmocker",
                           .send_asap = true,
                           .security = cfg.nats_security},  // responses without delay
                          {.on_reconnected = [] { fmt::print(stderr, "kvmocker I connected to NATS\n"); },
                           .on_disconnected = [] { fmt::print(stderr, "kvmocker W lost NATS; reconnecting\n"); }});
  if (!nc.ok()) {
    fmt::print(stderr, "kvmocker: cannot connect to {}: {}\n", cfg.nats_server, nc.status().message());
    return 1;
  }
  auto fleet = std::make_unique<MockWorkerFleet>(cfg, **nc);
  if (Status s = fleet->Start(); !s.ok()) {
    fmt::print(stderr, "kvmocker: {}\n", s.message());
    return 1;
  }
  fmt::print(stderr,
             "kvmocker I serving {} worker(s) [{}] x dp_size {} on {} namespace '{}' component '{}' "
             "({} blocks of {} tokens, speedup {}, {} events, role {}, kv connector {})\n",
             cfg.num_workers, DescribeIds(fleet->worker_ids()), cfg.dp_size, cfg.nats_server, cfg.ns, cfg.component,
             cfg.num_gpu_blocks, cfg.block_size, FormatNumberList(cfg.speedup_ratio),
             cfg.event_format == MockEventFormat::kDynamo ? "dynamo" : "vllm", WorkerRoleName(cfg.role),
             KvConnectorName(cfg.kv_connector));
  if (cfg.http_port > 0) {
    fmt::print(stderr, "kvmocker I OpenAI HTTP on {}:{}..{} as {}..., model '{}'\n", cfg.http_host, cfg.http_port,
               cfg.http_port + cfg.num_workers - 1, WorkerHttpUrl(cfg, 0), cfg.model);
    if (cfg.role == WorkerRole::kPrefill && cfg.kv_connector == KvConnector::kSglang) {
      fmt::print(stderr, "kvmocker I SGLang bootstrap on {}:{}\n", cfg.http_host, cfg.bootstrap_port);
    }
  }

  std::unique_ptr<HttpServer> http;
  if (cfg.metrics_port > 0) {
    MockWorkerFleet* f = fleet.get();
    auto started = StartMetricsServer(
        cfg.metrics_host, static_cast<int>(cfg.metrics_port), [f] { return f->MetricsText(); }, [] { return true; });
    if (!started.ok()) {
      fmt::print(stderr, "kvmocker: --metrics-port {}: {}\n", cfg.metrics_port, started.status().message());
      fleet->Stop();
      return 2;
    }
    http = std::move(started).value();
  }

  const int sig = stop.Wait();
  fmt::print(stderr, "kvmocker I signal {}: leaving\n", sig);
  // The workers leave and their clients are answered first: stopping the metrics server can
  // take its poll interval (up to 2 s).
  fleet->Stop();
  http.reset();
  const auto c = fleet->counters();
  fmt::print(stderr,
             "kvmocker I served {} requests and {} over HTTP, published {} events ({} bad requests, {} HTTP errors, "
             "{} refused, {} aborted, {} publish failures)\n",
             c.requests, c.http_requests, c.events, c.bad_requests, c.http_errors, c.inbox_full, c.aborted,
             c.publish_failures);
  (*nc)->Drain(std::chrono::seconds(2));
  fleet.reset();
  return 0;
}
