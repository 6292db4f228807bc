// KvRouterService in this process on a real nats-server, driven from several threads at once:
// events, heartbeats, routes, lifecycle, stats and ticks all race, as in production (nats.c
// runs each subscription on its own thread). The scripts run it under TSan too, so a data race
// in the service, the registry, the routing or the relay fails the build. A watchdog fails the
// test instead of letting a deadlock hang it.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "router/service/kv_router_service.h"
#include "tests/integration/kvrouter_fixture.h"
#include "transport/nats_bus.h"
#include "transport/nats_client.h"

namespace kvrouter::testing {
namespace {

std::vector<std::uint32_t> Prompt(std::uint32_t seed, std::size_t n) { return Tokens(seed * 1000, n); }

// Fails the test (and aborts it) if `done` is not set within `limit`: a deadlock must not hang
// the suite.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds limit)
      : thread_([this, limit] {
          std::unique_lock lk(mu_);
          if (!cv_.wait_for(lk, limit, [&] { return done_; })) {
            ADD_FAILURE() << "watchdog: the test did not finish in " << limit.count() << " s (deadlock?)";
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard g(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

class ServiceThreads : public NatsServerTest {};

TEST_F(ServiceThreads, EveryPathRacesSafelyOverRealNats) {
  Watchdog watchdog(120s);
  auto server_side = Connect({.name = "router", .send_asap = true});
  ASSERT_NE(server_side, nullptr);
  NatsBus bus(*server_side);
  const char* argv[] = {"kvrouter", "--router-mode", "kv", "--block-size", "4", "--router-queue-threshold", "4"};
  auto cfg = ParseRouterConfig(7, argv, [](const char*) { return nullptr; });
  ASSERT_TRUE(cfg.ok());
  KvRouterService svc(cfg->config, bus);
  ASSERT_TRUE(svc.Start().ok());
  auto workers = Connect({.name = "workers"});
  auto clients = Connect({.name = "clients", .send_asap = true});
  ASSERT_TRUE(workers && clients);

  constexpr int kWorkers = 8;
  auto register_all = [&] {
    for (int w = 1; w <= kWorkers; ++w) {
      WorkerRegistration r{.worker_id = static_cast<std::uint64_t>(w), .block_size = kBs, .lease_ms = 60000};
      (void)workers->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r)));
    }
  };
  register_all();
  ASSERT_TRUE(StatsClient(*clients, {.timeout = 1s}).AwaitWorkers(kWorkers, 10s));

  std::atomic<bool> stop{false};
  std::atomic<int> routed{0}, failed{0};
  std::vector<std::thread> threads;
  threads.emplace_back([&] {  // KV events and heartbeats
    std::vector<std::uint64_t> next_id(kWorkers + 1, 1);
    for (std::uint32_t i = 0; !stop; ++i) {
      const int w = 1 + static_cast<int>(i % kWorkers);
      auto b = StoredPromptBatch(w, next_id[w]++, Prompt(i % 50, 16), kBs);
      (void)workers->Publish(kComp + "kv-events", AsBytes(EncodeDynamoEnvelope(b, {})));
      if (i % 100 == 0) register_all();
    }
  });
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {  // booked routes, then their lifecycle
      for (int i = 0; i < 150; ++i) {
        const std::string id = "t" + std::to_string(t) + "-" + std::to_string(i);
        RouteRequest r{.request_id = id, .token_ids = Prompt(i % 50, 24), .has_token_ids = true, .isl = 24};
        auto reply = clients->Request(kRouter + "route", AsBytes(EncodeRouteRequest(r)), 5s);
        if (reply.ok() && DecodeRouteReply(*reply).ok()) {
          ++routed;
        } else {
          ++failed;
        }
        (void)clients->Request(kRouter + "mark_prefill", AsBytes(EncodeLifecycleRequest(id)), 5s);
        (void)clients->Request(kRouter + "free", AsBytes(EncodeLifecycleRequest(id)), 5s);
      }
    });
  }
  threads.emplace_back([&] {  // stats and best_worker meanwhile
    while (!stop) {
      (void)StatsClient(*clients, {.timeout = 5s}).Get({.offset = 2, .limit = 3});
      RouteRequest q{.token_ids = Prompt(3, 16), .has_token_ids = true, .isl = 16};
      (void)clients->Request(kRouter + "best_worker", AsBytes(EncodeRouteRequest(q)), 5s);
    }
  });
  threads.emplace_back([&] {  // the ticker
    while (!stop) {
      svc.Tick();
      std::this_thread::sleep_for(5ms);  // main's 50 ms timer, faster
    }
  });
  threads[1].join();
  threads[2].join();
  stop = true;
  for (std::size_t i = 0; i < threads.size(); ++i) {
    if (i != 1 && i != 2) threads[i].join();
  }
  EXPECT_EQ(routed.load(), 300);
  EXPECT_EQ(failed.load(), 0);
  // Every booking was freed; nothing is left queued.
  auto s = StatsClient(*clients, {.timeout = 5s}).Get();
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->counters.at("active_requests"), 0u);
  EXPECT_EQ(s->counters.at("queue_length"), 0u);
  EXPECT_GT(s->counters.at("events_applied"), 0u);
  svc.Stop();
}

}  // namespace
}  // namespace kvrouter::testing
