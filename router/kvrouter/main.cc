// kvrouter: the KV-cache-aware router service. Parses flags (and DYN_* environment), connects
// to NATS, serves docs/protocol.md sections 2-5 until SIGINT/SIGTERM, then drains and exits 0.
// Exit codes: 0 clean shutdown or --help, 2 bad flags or a refused configuration, 1 NATS failure.
#include <malloc.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <random>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "events/subjects.h"
#include "router/common/http_server.h"
#include "router/service/kv_router_service.h"
#include "transport/nats_bus.h"
#include "transport/nats_client.h"
#include "transport/stop_signals.h"

namespace {

using namespace kvrouter;

// The event connection's callbacks reach the service once it exists (and not after it stops).
std::atomic<KvRouterService*> g_live{nullptr};

Result<std::unique_ptr<NatsClient>> ConnectRequests(const RouterConfig& cfg) {
  return NatsClient::Connect(
      {.url = cfg.nats_server,
       .name = "kvrouter-requests",
       .send_asap = true,  // replies without delay
       .security = cfg.nats_security},
      {.on_reconnected =
           [] {
             fmt::print(stderr, "kvrouter I request connection up\n");
             if (auto* s = g_live.load()) {
               s->CountReconnect("requests");
               s->OnRequestsReconnected();
             }
           },
       .on_disconnected = [] { fmt::print(stderr, "kvrouter W lost the request connection; reconnecting\n"); }});
}

// Its state drives lease pausing and recovery.
Result<std::unique_ptr<NatsClient>> ConnectEvents(const RouterConfig& cfg) {
  return NatsClient::Connect({.url = cfg.nats_server,
                              .name = "kvrouter-events",
                              .pending_msgs_limit = 262144,      // events waiting for the decoder, at most
                              .pending_bytes_limit = 256 << 20,  // (an overflow is counted and answered with dumps)
                              .security = cfg.nats_security},
                             {.on_reconnected =
                                  [] {
                                    fmt::print(stderr, "kvrouter I event connection up\n");
                                    if (auto* s = g_live.load()) {
                                      s->CountReconnect("events");
                                      s->OnEventsReconnected();
                                    }
                                  },
                              .on_disconnected =
                                  [] {
                                    fmt::print(stderr,
                                               "kvrouter W lost the event connection; leases paused, reconnecting\n");
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

// This process's threads (Linux: /proc/self/task).
std::set<int> ThreadIds() {
  std::set<int> ids;
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    ids.insert(std::atoi(t.path().filename().c_str()));
  }
  return ids;
}

// Runs thread `tid` as ingestion, as the shard threads and the event delivery thread do
// (ShardedIndex::MarkIngestThread), named `name` for top -H and perf.
void MarkIngestThread(int tid, std::string_view name) {
  (void)ShardedIndex::MarkIngestThread(tid);
  std::ofstream(fmt::format("/proc/self/task/{}/comm", tid)) << name;
}

// The threads started since `before`: those of the event connection (its socket reader;
// nats.c's reconnect thread and the reader it starts inherit the class). Waking up on every
// burst of events, they would otherwise preempt the thread answering a route.
void MarkIngestThreadsSince(const std::set<int>& before, std::string_view name) {
  for (int tid : ThreadIds()) {
    if (!before.contains(tid)) MarkIngestThread(tid, name);
  }
}

// nats.c's message collector, which frees every delivered message and is woken for them: in
// the default class it preempted the event thread at almost every wake-up (on 2 cores, ~30,000
// times in 3 s of an event flood). nats_Open starts three threads, in this order in every
// nats.c release: timers, callbacks, collector; Linux numbers a process's threads in the order
// they start, so the collector is the last. Only it: the timers thread starts a connection's
// reconnect thread after unanswered pings, and the request connection's threads must keep the
// default class. Any other count of threads (another nats.c) is left as it is.
void MarkNatsCollector(const std::set<int>& before) {
  std::vector<int> started;
  for (int tid : ThreadIds()) {
    if (!before.contains(tid)) started.push_back(tid);
  }
  if (started.size() == 3) MarkIngestThread(*std::max_element(started.begin(), started.end()), "nats-gc");
}

// Says where the caches come from, so that nobody runs approximate mode by mistake.
void LogEventSource(const RouterConfig& cfg) {
  if (cfg.load_aware) {
    fmt::print(stderr, "kvrouter I load-aware: no KV events, no cache credit\n");
  } else if (!cfg.use_kv_events) {
    fmt::print(stderr,
               "kvrouter W APPROXIMATE MODE (--no-router-kv-events / DYN_ROUTER_USE_KV_EVENTS=false): no KV events are "
               "read; caches are predicted from this router's own decisions for {} s\n",
               cfg.ttl_secs);
  } else {
    fmt::print(stderr, "kvrouter I KV events: reading {} (and {}*)\n", KvEventsSubject(cfg.ns, cfg.component),
               VllmEventsPrefix(cfg.ns, cfg.component));
  }
}

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

  // nats.c allocates each message on its reader thread and frees it on its collector thread:
  // with glibc's default trim threshold the reader's heap is returned to the kernel and grown
  // again, page fault by page fault, all through an event flood (a visible share of the
  // router's CPU per event). Keep up to 64 MiB free per heap. Setting it fixes glibc's mmap threshold too (no
  // longer adapted), so blocks up to 4 MiB (large payloads, results) stay on the heap as well.
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  mallopt(M_MMAP_THRESHOLD, 4 << 20);

  StopSignals stop;  // before any thread starts: they inherit the blocked mask

  // Two connections: requests and replies on one, KV events and registrations on the other, so
  // that a request never waits in the socket behind an event flood.
  const std::set<int> threads_before_library = ThreadIds();
  if (NatsClient::OpenLibrary().ok()) MarkNatsCollector(threads_before_library);
  auto requests = ConnectRequests(cfg);
  const std::set<int> threads_before_events = ThreadIds();  // nats.c's library threads exist by now
  auto events = requests.ok() ? ConnectEvents(cfg) : Result<std::unique_ptr<NatsClient>>(requests.status());
  MarkIngestThreadsSince(threads_before_events, "nats-events");
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
  fmt::print(stderr, "kvrouter I serving namespace '{}' component '{}' on {} (mode {}, block size {})\n", cfg.ns,
             cfg.component, cfg.nats_server, RouterModeName(cfg.mode), cfg.block_size);
  LogEventSource(cfg);
  if (cfg.mode == RouterMode::kKv) {
    if (cfg.cost_model == CostModel::kPredicted) {
      fmt::print(stderr,
                 "kvrouter I kv cost: predicted time (the default; set --router-prefill-load-scale or "
                 "--router-kv-overlap-score-credit for Dynamo's formula)\n");
    } else {
      fmt::print(stderr, "kvrouter I kv cost: Dynamo's formula, overlap credit {}, prefill load scale {}\n",
                 cfg.overlap_score_credit, cfg.prefill_load_scale);
    }
  }
  std::unique_ptr<HttpServer> http;
  if (cfg.metrics_port > 0) {
    KvRouterService* svc = service.get();
    auto started = StartMetricsServer(
        cfg.metrics_host, static_cast<int>(cfg.metrics_port), [svc] { return svc->MetricsText(); },
        [svc] { return svc->Ready(); });
    if (!started.ok()) {
      fmt::print(stderr, "kvrouter: --metrics-port {}: {}\n", cfg.metrics_port, started.status().message());
      service->Stop();
      g_live.store(nullptr);
      (*events)->Drain(std::chrono::seconds(1));
      return 2;
    }
    http = std::move(started).value();
    fmt::print(stderr, "kvrouter I metrics on http://{}:{}/metrics (/health, /ready)\n", cfg.metrics_host,
               cfg.metrics_port);
  }
  {
    Ticker ticker(*service);
    const int sig = stop.Wait();
    fmt::print(stderr, "kvrouter I signal {}: draining\n", sig);
  }
  http.reset();  // no scrape reaches the service after this
  service->Stop();
  g_live.store(nullptr);
  (*events)->Drain(std::chrono::seconds(2));
  (*requests)->Drain(std::chrono::seconds(2));
  service.reset();
  return 0;
}
