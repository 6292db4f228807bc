// kvrouter: the KV-cache-aware router service. Parses flags (and DYN_* environment), connects
// to NATS, serves PROTOCOL.md sections 2-5 until SIGINT/SIGTERM, then drains and exits 0.
// Exit codes: 0 clean shutdown or --help, 2 bad flags or a refused configuration, 1 NATS failure.
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include <atomic>
#include <condition_variable>
#include <random>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "router/kv_router_service.h"
#include "transport/nats_bus.h"
#include "transport/nats_client.h"
#include "transport/stop_signals.h"

namespace {

using namespace kvrouter;

// The event connection's callbacks reach the service once it exists (and not after it stops).
std::atomic<KvRouterService*> g_live{nullptr};

Result<std::unique_ptr<NatsClient>> ConnectRequests(const RouterConfig& cfg) {
  return NatsClient::Connect(
      {.url = cfg.nats_server, .name = "kvrouter-requests", .send_asap = true},  // replies without delay
      {.on_reconnected = [] { fmt::print(stderr, "kvrouter I request connection up\n"); },
       .on_disconnected = [] { fmt::print(stderr, "kvrouter W lost the request connection; reconnecting\n"); }});
}

// Its state drives lease pausing and recovery.
Result<std::unique_ptr<NatsClient>> ConnectEvents(const RouterConfig& cfg) {
  return NatsClient::Connect(
      {.url = cfg.nats_server,
       .name = "kvrouter-events",
       .pending_msgs_limit = 262144,       // events waiting for the decoder, at most
       .pending_bytes_limit = 256 << 20},  // (an overflow is counted and answered with dumps)
      {.on_reconnected =
           [] {
             fmt::print(stderr, "kvrouter I event connection up\n");
             if (auto* s = g_live.load()) s->OnEventsReconnected();
           },
       .on_disconnected =
           [] {
             fmt::print(stderr, "kvrouter W lost the event connection; leases paused, reconnecting\n");
             if (auto* s = g_live.load()) s->OnEventsDisconnected();
           },
       .on_slow_consumer =
           [](std::string_view) {
             if (auto* s = g_live.load()) s->OnEventsDropped();
           }});
}

// Lease expiry, timeouts and sweeps every 50 ms (expiry lands within 250 ms of a deadline), until
// the returned stop function is called.
class Ticker {
 public:
  explicit Ticker(KvRouterService& service)
      : thread_([this, &service] {
          std::unique_lock lk(mu_);
          while (!cv_.wait_for(lk, std::chrono::milliseconds(50), [&] { return stopping_; })) {
            lk.unlock();
            service.Tick();
            lk.lock();
          }
        }) {}
  ~Ticker() {
    {
      std::lock_guard g(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the rest exists
};

}  // namespace

int main(int argc, char** argv) {
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

  // Two connections: requests and replies on one, KV events and registrations on the other, so
  // that a request never waits in the socket behind an event flood.
  auto requests = ConnectRequests(cfg);
  auto events = requests.ok() ? ConnectEvents(cfg) : Result<std::unique_ptr<NatsClient>>(requests.status());
  if (!events.ok()) {
    fmt::print(stderr, "kvrouter: cannot connect to {}: {}\n", cfg.nats_server, events.status().message());
    return 1;
  }
  NatsBus bus(**requests);
  NatsBus event_bus(**events);
  auto service = std::make_unique<KvRouterService>(cfg, bus, nullptr, std::random_device{}(), &event_bus);
  g_live.store(service.get());
  if (Status s = service->Start(); !s.ok()) {
    fmt::print(stderr, "kvrouter: {}\n", s.message());
    g_live.store(nullptr);
    (*events)->Drain(std::chrono::seconds(1));  // no callback reaches the service after this
    return 2;
  }
  fmt::print(stderr, "kvrouter I serving namespace '{}' component '{}' on {} (mode {}, block size {})\n",
             cfg.ns, cfg.component, cfg.nats_server, RouterModeName(cfg.mode), cfg.block_size);
  {
    Ticker ticker(*service);
    const int sig = stop.Wait();
    fmt::print(stderr, "kvrouter I signal {}: draining\n", sig);
  }
  service->Stop();
  g_live.store(nullptr);
  (*events)->Drain(std::chrono::seconds(2));
  (*requests)->Drain(std::chrono::seconds(2));
  service.reset();
  return 0;
}
