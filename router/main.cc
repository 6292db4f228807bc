// kvrouter: the KV-cache-aware router service. Parses flags (and DYN_* environment), connects
// to NATS, serves PROTOCOL.md sections 2-5 until SIGINT/SIGTERM, then drains and exits 0.
// Exit codes: 0 clean shutdown or --help, 2 bad flags or a refused configuration, 1 NATS failure.
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include <condition_variable>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "router/kv_router_service.h"
#include "transport/nats_bus.h"
#include "transport/nats_client.h"
#include "transport/stop_signals.h"

int main(int argc, char** argv) {
  using namespace kvrouter;
  auto parsed = ParseRouterConfig(argc, argv, [](const char* name) { return std::getenv(name); });
  if (!parsed.ok()) {
    fmt::print(stderr, "kvrouter: {}\n(see kvrouter --help)\n", parsed.status().message());
    return 2;
  }
  if (parsed->help) {
    fmt::print("{}", parsed->help_text);
    return 0;
  }
  const RouterConfig& cfg = parsed->config;

  StopSignals stop;  // before any thread starts: they inherit the blocked mask

  auto nc = NatsClient::Connect(
      {.url = cfg.nats_server, .name = "kvrouter", .send_asap = true},  // replies without delay
      {.on_reconnected = [] { fmt::print(stderr, "kvrouter I connected to NATS\n"); },
       .on_disconnected = [] { fmt::print(stderr, "kvrouter W lost NATS; reconnecting\n"); }});
  if (!nc.ok()) {
    fmt::print(stderr, "kvrouter: cannot connect to {}: {}\n", cfg.nats_server, nc.status().message());
    return 1;
  }
  NatsBus bus(**nc);
  auto service = std::make_unique<KvRouterService>(cfg, bus);
  if (Status s = service->Start(); !s.ok()) {
    fmt::print(stderr, "kvrouter: {}\n", s.message());
    return 2;
  }
  fmt::print(stderr, "kvrouter I serving namespace '{}' component '{}' on {} (mode {}, block size {})\n",
             cfg.ns, cfg.component, cfg.nats_server, RouterModeName(cfg.mode), cfg.block_size);

  // Lease expiry and the booking sweep every 50 ms (expiry lands within 250 ms of a deadline).
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::thread ticker([&] {
    std::unique_lock lk(mu);
    while (!cv.wait_for(lk, std::chrono::milliseconds(50), [&] { return stopping; })) {
      lk.unlock();
      service->Tick();
      lk.lock();
    }
  });

  const int sig = stop.Wait();
  fmt::print(stderr, "kvrouter I signal {}: draining\n", sig);
  {
    std::lock_guard g(mu);
    stopping = true;
  }
  cv.notify_all();
  ticker.join();
  service->Stop();
  (*nc)->Drain(std::chrono::seconds(2));
  service.reset();
  return 0;
}
