// kvrelay: stands beside one live vLLM engine rank and puts its ZMQ KV event stream (docs/protocol.md
// section 9) on NATS as Dynamo RouterEvents (sections 2, 4, 6), so that kvrouter routes to it.
// Exit codes: 0 clean shutdown (SIGINT/SIGTERM: `leaving` is published) or --help, 2 bad flags
// or metrics port, 1 NATS or ZMQ failure at start.
#include <atomic>
#include <cstdlib>
#include <stop_token>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "router/common/http_server.h"
#include "router/kvrelay/config.h"
#include "router/kvrelay/engine_watch.h"
#include "router/kvrelay/health_check.h"
#include "router/kvrelay/relay.h"
#include "router/common/metrics.h"
#include "transport/nats_bus.h"
#include "transport/nats_client.h"
#include "transport/stop_signals.h"
#include "transport/zmq_stream.h"

namespace {

using namespace kvrouter;

// `watch`: the engine's health watch (--engine-url), or null.
std::string MetricsText(const KvRelay& relay, const EngineWatch* watch, std::uint64_t stream_errors) {
  const KvRelay::Counters c = relay.counters();
  MetricSet m;
  m.Counter("kvrelay_batches_total", "engine batches applied", static_cast<double>(c.batches));
  m.Counter("kvrelay_events_published_total", "RouterEvents published on NATS", static_cast<double>(c.events));
  m.Counter("kvrelay_batches_replayed_total", "batches recovered from the engine's replay socket",
            static_cast<double>(c.replayed));
  m.Counter("kvrelay_gaps_total", "jumps in the engine's seq", static_cast<double>(c.gaps));
  m.Counter("kvrelay_gaps_unrepaired_total", "gaps that could not be replayed (the rank was cleared)",
            static_cast<double>(c.gaps_unrepaired));
  m.Counter("kvrelay_engine_restarts_total", "engine restarts (seq went back)", static_cast<double>(c.restarts));
  m.Counter("kvrelay_bad_batches_total", "undecodable batches", static_cast<double>(c.bad_batches));
  m.Counter("kvrelay_block_size_mismatches_total", "stored events not in blocks of --block-size",
            static_cast<double>(c.block_size_mismatches));
  m.Counter("kvrelay_bad_messages_total", "ZMQ messages that are not [topic, seq, payload]",
            static_cast<double>(stream_errors));
  m.Counter("kvrelay_publish_failures_total", "NATS publishes that failed", static_cast<double>(c.publish_failures));
  m.Gauge("kvrelay_last_seq", "the engine's last seq applied (-1: none yet)", static_cast<double>(relay.last_seq()));
  if (watch != nullptr) {
    const EngineWatch::Counters w = watch->counters();
    m.Gauge("kvrelay_engine_up", "1 while the engine answers its health checks and the worker is registered",
            relay.registered() ? 1.0 : 0.0);
    m.Counter("kvrelay_engine_transitions_total", "the engine found up (the first time included) or down",
              static_cast<double>(w.ups), {{"to", "up"}});
    m.Counter("kvrelay_engine_transitions_total", "the engine found up (the first time included) or down",
              static_cast<double>(w.downs), {{"to", "down"}});
    m.Counter("kvrelay_engine_health_checks_total", "GET /health checks started", static_cast<double>(w.checks));
    m.Counter("kvrelay_engine_health_checks_failed_total", "checks refused, timed out or answered other than 2xx",
              static_cast<double>(w.checks_failed));
    m.Counter("kvrelay_batches_dropped_engine_down_total",
              "engine batches dropped while the engine was not up (replayed from seq 0 once it is)",
              static_cast<double>(c.batches_engine_down));
  }
  return RenderMetrics(m.Take());
}

}  // namespace

int main(int argc, char** argv) {
  auto parsed = ParseRelayConfig(argc, argv, [](const char* name) { return std::getenv(name); });
  if (!parsed.ok()) {
    fmt::print(stderr, "kvrelay: {}\n(see kvrelay --help)\n", parsed.status().message());
    return 2;
  }
  if (parsed->help) {
    fmt::print("{}", parsed->help_text);
    return 0;
  }
  const RelayConfig& cfg = parsed->config;
  StopSignals stop;  // before any thread starts

  auto nc = NatsClient::Connect({.url = cfg.nats_server, .name = "kvrelay", .security = cfg.nats_security},
                                {.on_reconnected = [] { fmt::print(stderr, "kvrelay I NATS connection up\n"); },
                                 .on_disconnected = [] { fmt::print(stderr, "kvrelay W lost NATS; reconnecting\n"); }});
  if (!nc.ok()) {
    fmt::print(stderr, "kvrelay: cannot connect to {}: {}\n", cfg.nats_server, nc.status().message());
    return 1;
  }
  auto stream = ZmqEngineStream::Connect(
      {.endpoint = cfg.zmq_endpoint, .replay_endpoint = cfg.zmq_replay_endpoint, .topic = cfg.zmq_topic});
  if (!stream.ok()) {
    fmt::print(stderr, "kvrelay: {}\n", stream.status().message());
    return 1;
  }
  NatsBus bus(**nc);
  RateLimitedLog log;
  ZmqEngineStream* engine = stream->get();
  // Ends the ZMQ loop, and a replay it may be waiting for.
  std::stop_source stopping;
  KvRelay::Replay replay;
  if (engine->has_replay()) {
    replay = [engine, stop = stopping.get_token()](std::int64_t start) {
      return engine->Replay(start, std::chrono::seconds(2), stop);
    };
  } else {
    fmt::print(stderr, "kvrelay W no --zmq-replay-endpoint: a lost batch clears this rank at the router\n");
  }
  KvRelay relay(cfg.relay, bus, replay, log);
  if (Status s = relay.Start(); !s.ok()) {
    fmt::print(stderr, "kvrelay: {}\n", s.message());
    return 1;
  }
  // With --engine-url the worker is registered while the engine answers GET /health.
  std::unique_ptr<HttpHealthChecks> health_checks;
  std::unique_ptr<EngineWatch> watch;
  if (!cfg.relay.http_url.empty()) {
    auto checks = HttpHealthChecks::Create(cfg.relay.http_url, cfg.health.timeout);
    if (!checks.ok()) {  // the flag parser took it: not expected
      fmt::print(stderr, "kvrelay: --engine-url: {}\n", checks.status().message());
      return 2;
    }
    health_checks = std::move(checks).value();
    watch = std::make_unique<EngineWatch>(cfg.health, health_checks->check(), log, cfg.relay.http_url);
  }
  std::atomic<std::uint64_t> stream_errors{0};
  std::unique_ptr<HttpServer> http;
  if (cfg.metrics_port > 0) {
    auto started = StartMetricsServer(
        cfg.metrics_host, static_cast<int>(cfg.metrics_port),
        [&] { return MetricsText(relay, watch.get(), stream_errors.load()); }, [&] { return (*nc)->IsConnected(); });
    if (!started.ok()) {
      fmt::print(stderr, "kvrelay: --metrics-port {}: {}\n", cfg.metrics_port, started.status().message());
      relay.Stop();
      return 2;
    }
    http = std::move(started).value();
  }
  fmt::print(stderr, "kvrelay I worker {} rank {}: {} (replay {}) -> {} (block size {})\n", cfg.relay.worker_id,
             cfg.relay.dp_rank, cfg.zmq_endpoint, cfg.zmq_replay_endpoint.value_or("none"), cfg.nats_server,
             cfg.relay.block_size);
  if (!cfg.relay.http_url.empty()) {
    fmt::print(stderr,
               "kvrelay I engine {} serving {}: registered while GET /health answers (every {} ms, "
               "{} failures in a row = down)\n",
               cfg.relay.http_url, fmt::join(cfg.relay.models, ", "), cfg.health.interval.count(), cfg.health.failures);
  }

  // The ZMQ loop owns the sockets from here on.
  std::thread loop([&, stop = stopping.get_token()] {
    while (!stop.stop_requested()) {
      auto got = engine->Receive(std::chrono::milliseconds(100));
      if (!got.ok()) {
        ++stream_errors;
        log.Log(LogLevel::kWarning, "bad message", "dropped a ZMQ message: {}", got.status().message());
      } else if (*got) {
        relay.OnBatch(**got);
      }
      const SteadyTime now = std::chrono::steady_clock::now();
      if (watch) {
        switch (watch->Poll(now)) {
          case EngineTransition::kUp: relay.EngineUp(now); break;
          case EngineTransition::kDown: relay.EngineDown(watch->last_failure().message()); break;
          case EngineTransition::kNone: break;
        }
      }
      relay.Tick(now);
    }
  });
  const int sig = stop.Wait();
  fmt::print(stderr, "kvrelay I signal {}: leaving\n", sig);
  // `leaving` first, from this thread: the router must stop routing here at once, not when the
  // loop's replay wait for the engine (up to 2 s) or the metrics server's shutdown has ended.
  relay.Stop();
  stopping.request_stop();
  loop.join();
  http.reset();
  watch.reset();
  health_checks.reset();  // its thread stops: no check answers after this
  (*nc)->Drain(std::chrono::seconds(2));
  return 0;
}
