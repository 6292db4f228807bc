// kvgateway: an OpenAI-compatible HTTP front for a fleet of engines behind kvrouter
// (docs/protocol.md section 11). Clients call /v1/chat/completions or /v1/completions as they
// would call vLLM; each request is routed by kvrouter (over NATS) and proxied to the chosen
// engine. SIGINT/SIGTERM drain: /ready answers 503, no connection is accepted, the requests
// under way (streams included) finish for up to --drain-timeout-secs, and what is left is closed
// (at once on a second SIGINT/SIGTERM).
// Exit codes: 0 clean shutdown (SIGINT/SIGTERM) or --help, 2 bad flags or ports, 1 NATS failure
// at start.
#include <pthread.h>
#include <sys/resource.h>

#include <csignal>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "events/subjects.h"
#include "router/common/http_server.h"
#include "router/kvgateway/config.h"
#include "router/kvgateway/gateway.h"
#include "router/kvgateway/openai.h"
#include "router/kvgateway/router_link.h"
#include "transport/http_client.h"
#include "transport/http_io.h"
#include "transport/http_listener.h"
#include "transport/nats_client.h"
#include "transport/nats_loops.h"
#include "transport/stop_signals.h"

namespace {

using namespace kvrouter;

// Every client connection is a descriptor: takes the hard limit, and returns how many client
// connections fit beside the engine connections and the process's own.
std::uint32_t RaiseDescriptorLimit(std::uint32_t wanted) {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return wanted;
  if (r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &r);
    (void)getrlimit(RLIMIT_NOFILE, &r);
  }
  if (r.rlim_cur == RLIM_INFINITY) return wanted;
  // An eighth of the descriptors (256 to 4096) stays for engine connections, NATS and files: the
  // accept loop then meets --max-connections before EMFILE.
  const rlim_t reserve = std::clamp<rlim_t>(r.rlim_cur / 8, 256, 4096);
  const rlim_t fit = r.rlim_cur > 2 * reserve ? r.rlim_cur - reserve : r.rlim_cur / 2;
  return static_cast<std::uint32_t>(std::min<rlim_t>(wanted, fit));
}

}  // namespace

int main(int argc, char** argv) {
  auto parsed = ParseGatewayConfig(argc, argv, [](const char* name) { return std::getenv(name); });
  if (!parsed.ok()) {
    fmt::print(stderr, "kvgateway: {}\n(see kvgateway --help)\n", parsed.status().message());
    return 2;
  }
  if (parsed->help) {
    fmt::print("{}", parsed->help_text);
    return 0;
  }
  GatewayConfig& cfg = parsed->config;
  StopSignals stop;  // before any thread starts
  if (const std::uint32_t fit = RaiseDescriptorLimit(cfg.max_connections); fit < cfg.max_connections) {
    fmt::print(stderr, "kvgateway W --max-connections {} lowered to {}: the descriptor limit allows no more\n",
               cfg.max_connections, fit);
    cfg.max_connections = fit;
  }

  // The connection's state reaches the gateway from one thread only (sync_nats, on the ticker),
  // so that two transitions never interleave.
  auto nc = NatsClient::Connect(
      {.url = cfg.nats_server, .name = "kvgateway", .send_asap = true, .security = cfg.nats_security},
      {.on_reconnected = [] { fmt::print(stderr, "kvgateway I NATS connection up\n"); },
       .on_disconnected = [] { fmt::print(stderr, "kvgateway W lost NATS; reconnecting\n"); }});
  if (!nc.ok()) {
    fmt::print(stderr, "kvgateway: cannot connect to {}: {}\n", cfg.nats_server, nc.status().message());
    return 1;
  }
  HttpIo io(cfg.io_threads);
  // A route request and its answer go over the connection of the loop serving the request. Not
  // with TLS (nats.c would block the loop inside a TLS read): everything goes over `nc` then.
  std::unique_ptr<NatsLoops> loop_nats;
  if (!cfg.nats_security.tls()) {
    auto loops = NatsLoops::Connect(io, {.url = cfg.nats_server, .name = "kvgateway", .security = cfg.nats_security});
    if (!loops.ok()) {
      fmt::print(stderr, "kvgateway: cannot connect to {}: {}\n", cfg.nats_server, loops.status().message());
      return 1;
    }
    loop_nats = std::move(loops).value();
  }
  RouterLink link(**nc, cfg.ns, std::chrono::milliseconds(cfg.route_timeout_ms), loop_nats.get());
  if (Status s = link.Start(); !s.ok()) {
    fmt::print(stderr, "kvgateway: {}\n", s.message());
    return 1;
  }
  HttpClient client(io, {.max_idle = std::chrono::milliseconds(cfg.engine_idle_timeout_ms)});
  Gateway gw(cfg, client, link);
  // A loss since the last look (even one already over: a reconnect between two looks) is applied
  // before the state now.
  std::uint64_t disconnects_seen = (*nc)->Stats().disconnects;
  auto sync_nats = [&] {
    const std::uint64_t disconnects = (*nc)->Stats().disconnects;
    const bool up = (*nc)->IsConnected();
    if (disconnects != disconnects_seen) {
      disconnects_seen = disconnects;
      if (gw.nats_connected()) gw.SetNatsConnected(false);
    }
    if (up != gw.nats_connected()) gw.SetNatsConnected(up);
  };
  sync_nats();
  auto registrations = (*nc)->Subscribe(InstancesSubject(cfg.ns, cfg.component), "",
                                        [&](const IncomingMessage& m) {
                                          if (auto reg = DecodeWorkerRegistration(m.data); reg.ok())
                                            gw.OnRegistration(*reg, std::chrono::steady_clock::now());
                                        });
  if (!registrations.ok()) {
    fmt::print(stderr, "kvgateway: {}\n", registrations.status().message());
    return 1;
  }
  auto listener =
      HttpListener::Start(io,
                          {.host = cfg.http_host,
                           .port = static_cast<std::uint16_t>(cfg.http_port),
                           .max_body_bytes = cfg.max_body_bytes,
                           .max_connections = cfg.max_connections,
                           .server_name = "kvgateway",
                           .error_body =
                               [](int status, std::string_view message) {
                                 const std::string_view code = status == 413   ? "body_too_large"
                                                               : status == 431 ? "headers_too_large"
                                                                               : "bad_request";
                                 return std::pair<std::string, std::string>(
                                     "application/json", OpenAiError(message, "invalid_request_error", code));
                               }},
                          gw.Handler());
  if (!listener.ok()) {
    fmt::print(stderr, "kvgateway: --http-port {}: {}\n", cfg.http_port, listener.status().message());
    return 2;
  }
  HttpListener* http = listener->get();
  std::unique_ptr<HttpServer> metrics;
  if (cfg.metrics_port > 0) {
    auto started = StartMetricsServer(
        cfg.metrics_host, static_cast<int>(cfg.metrics_port), [&] { return gw.MetricsText(http->counters()); },
        [&] { return gw.Ready(std::chrono::steady_clock::now()); });
    if (!started.ok()) {
      fmt::print(stderr, "kvgateway: --metrics-port {}: {}\n", cfg.metrics_port, started.status().message());
      return 2;
    }
    metrics = std::move(started).value();
  }
  fmt::print(stderr, "kvgateway I listening on {}:{} (router over {})\n", cfg.http_host, http->port(), cfg.nats_server);

  std::atomic<bool> stopping{false};
  std::thread ticker([&] {
    while (!stopping.load()) {
      const SteadyTime now = std::chrono::steady_clock::now();
      sync_nats();
      link.Tick(now);
      gw.Tick(now);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the timer's period, not a wait for a state
    }
  });
  const int sig = stop.Wait();
  // The ticker (NATS state, route timeouts, engine leases) and the metrics port (/ready's 503)
  // go on while the requests under way finish.
  fmt::print(stderr, "kvgateway I signal {}: draining {} connections (at most {} s)\n", sig, http->counters().open,
             cfg.drain_timeout_secs);
  gw.Drain();
  http->Drain();
  // A second signal ends the drain: the connections close, so AwaitClosed returns. The waiting
  // thread is woken by a signal of our own once the drain is over.
  std::atomic<bool> drained{false};
  std::thread second([&] {
    const int again = stop.Wait();
    if (drained.load()) return;
    fmt::print(stderr, "kvgateway W signal {} again: closing {} connections now\n", again, http->counters().open);
    http->Stop();
  });
  if (!http->AwaitClosed(std::chrono::seconds(cfg.drain_timeout_secs))) {
    fmt::print(stderr, "kvgateway W drain timeout: closing {} connections\n", http->counters().open);
  }
  drained = true;
  pthread_kill(second.native_handle(), SIGTERM);  // blocked in every thread: taken by its sigwait
  second.join();
  stopping = true;
  ticker.join();
  metrics.reset();
  gw.Stop();
  (*listener)->Stop();
  client.Stop();
  // While the loops still run: the route requests still waiting fail (their bookings freed over
  // the main connection, which Drain flushes), and no router answer reaches a loop after this
  // (each is continued on one); what the requests that ended on the loops sent (their frees) is
  // written, and the loops' connections are closed (a close waits for the server's answer to a
  // last flush, which only a running loop reads).
  link.Stop();
  if (loop_nats) {
    loop_nats->Flush(std::chrono::seconds(2));
    loop_nats->Close();
  }
  io.Stop();
  registrations->reset();
  (*nc)->Drain(std::chrono::seconds(2));
  return 0;
}
