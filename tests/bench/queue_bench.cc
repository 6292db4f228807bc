// Queue policies under overload (issue 4), simulated on virtual time: the real KvRouterService
// (on an in-memory bus, with a virtual clock) routes a Poisson stream at twice the fleet's
// prefill capacity to 4 simulated workers. A worker prefills its requests one after another
// (docs/design.md's prefill model: 4.21e-7 N^2 + 0.0152 N + 16.5 ms for N tokens), reports
// mark_prefill when a prefill ends and free after a 2 s decode. TTFT = arrival to end of
// prefill, per priority class. Run: build/bin/queue_bench (see docs/performance.md).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <deque>
#include <map>
#include <queue>
#include <random>

#include "events/registration_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "router/service/kv_router_service.h"
#include "transport/memory_bus.h"

namespace kvrouter {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::duration;
using Ms = duration<double, std::milli>;

constexpr int kWorkers = 4;
constexpr double kArrivalSeconds = 60;
constexpr std::uint32_t kBatchedTokens = 8192;

double PrefillMs(double n) { return 4.21e-7 * n * n + 0.0152 * n + 16.5; }

struct Request {
  std::string id;
  std::int64_t priority = 0;
  std::uint32_t isl = 0;
  double arrival_ms = 0;
  double ttft_ms = -1;
};

struct Sim {
  // Events on virtual time: (time, kind, request index).
  enum Kind { kArrive, kPrefillDone, kFree, kTick };
  struct Ev {
    double t;
    Kind kind;
    std::size_t req;
    bool operator>(const Ev& o) const { return t > o.t; }
  };
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> events;
  double now_ms = 0;
  std::vector<Request> reqs;
  std::vector<double> worker_free_at = std::vector<double>(kWorkers + 1, 0);
};

// Runs the simulation; flags select the queue (none when empty).
std::vector<Request> Run(const std::vector<std::string>& queue_flags, std::uint64_t seed) {
  Sim sim;
  InMemoryBus bus;
  std::vector<std::string> args = {"kvrouter", "--router-mode", "kv", "--router-queue-max", "100000"};
  args.insert(args.end(), queue_flags.begin(), queue_flags.end());
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  auto cfg = ParseRouterConfig(static_cast<int>(argv.size()), argv.data(), [](const char*) { return nullptr; });
  if (!cfg.ok()) return {};
  KvRouterService svc(
      cfg->config, bus,
      [&] { return Clock::time_point{} + std::chrono::duration_cast<Clock::duration>(Ms(sim.now_ms)); }, seed);
  if (!svc.Start().ok()) return {};
  for (int w = 1; w <= kWorkers; ++w) {
    WorkerRegistration r{
        .worker_id = static_cast<std::uint64_t>(w), .max_num_batched_tokens = kBatchedTokens, .lease_ms = 1u << 30};
    (void)bus.Publish(svc.subjects().instances, AsBytes(EncodeWorkerRegistration(r)));
  }

  // Workload: isl uniform in [1024, 4096]; priority 0 (80%), 1 (15%), 3 (5%).
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::uint32_t> isl(1024, 4096);
  const double mean_prefill_ms = PrefillMs(2560);
  const double rate_per_ms = 2.0 * kWorkers / mean_prefill_ms;  // twice the capacity
  std::exponential_distribution<double> gap(rate_per_ms);
  for (double t = 0; t < kArrivalSeconds * 1000; t += gap(rng)) {
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    sim.reqs.push_back({"r" + std::to_string(sim.reqs.size()), u < 0.8 ? 0 : (u < 0.95 ? 1 : 3), isl(rng), t});
    sim.events.push({t, Sim::kArrive, sim.reqs.size() - 1});
  }

  sim.events.push({50, Sim::kTick, 0});
  std::map<std::size_t, InMemoryBus::PendingRequest> waiting;  // queued in the router
  auto dispatch = [&](std::size_t i, std::uint64_t worker) {
    // The worker prefills its requests in order.
    double& free_at = sim.worker_free_at[worker];
    const double start = std::max(free_at, sim.now_ms);
    free_at = start + PrefillMs(sim.reqs[i].isl);
    sim.events.push({free_at, Sim::kPrefillDone, i});
  };
  auto collect = [&] {
    for (auto it = waiting.begin(); it != waiting.end();) {
      if (it->second.reply->has_value()) {
        auto r = DecodeRouteReply(**it->second.reply);
        if (r.ok()) dispatch(it->first, r->worker_id);
        it = waiting.erase(it);
      } else {
        ++it;
      }
    }
  };
  while (!sim.events.empty()) {
    const Sim::Ev ev = sim.events.top();
    sim.events.pop();
    if (ev.kind == Sim::kTick && sim.events.empty() && waiting.empty()) break;
    sim.now_ms = ev.t;
    Request& r = sim.reqs[ev.req];
    switch (ev.kind) {
      case Sim::kArrive: {
        RouteRequest q{.request_id = r.id, .block_hashes = {}, .isl = r.isl, .priority = r.priority};
        for (std::uint32_t b = 0; b < r.isl / 64; ++b) q.block_hashes.push_back(ev.req * 4096 + b + 1);
        auto p = bus.RequestAsync(svc.subjects().route, AsBytes(EncodeRouteRequest(q)));
        waiting.emplace(ev.req, std::move(p));
        break;
      }
      case Sim::kPrefillDone:
        r.ttft_ms = sim.now_ms - r.arrival_ms;
        (void)bus.Request(svc.subjects().mark_prefill, AsBytes(EncodeLifecycleRequest(r.id)));
        sim.events.push({sim.now_ms + 2000, Sim::kFree, ev.req});
        break;
      case Sim::kFree: (void)bus.Request(svc.subjects().free, AsBytes(EncodeLifecycleRequest(r.id))); break;
      case Sim::kTick:  // the service's 50 ms timer: queue timeouts (60 s without timeout_ms)
        svc.Tick();
        if (!waiting.empty() || sim.events.size() > 0) sim.events.push({sim.now_ms + 50, Sim::kTick, 0});
        break;
    }
    collect();
  }
  return sim.reqs;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * v.size()))];
}

void Report(benchmark::State& state, const std::vector<Request>& reqs) {
  std::map<std::int64_t, std::vector<double>> by_class;
  std::vector<double> all;
  for (const auto& r : reqs) {
    if (r.ttft_ms < 0) continue;
    by_class[r.priority].push_back(r.ttft_ms);
    all.push_back(r.ttft_ms);
  }
  double sum = 0;
  for (double x : all) sum += x;
  state.counters["served"] = static_cast<double>(all.size());
  state.counters["timed_out"] = static_cast<double>(reqs.size() - all.size());
  state.counters["mean_s"] = all.empty() ? 0 : sum / all.size() / 1000;
  for (auto& [prio, v] : by_class) {
    state.counters["p" + std::to_string(prio) + "_p50_s"] = Percentile(v, 0.5) / 1000;
    state.counters["p" + std::to_string(prio) + "_p99_s"] = Percentile(v, 0.99) / 1000;
  }
}

void BM_QueuePolicy(benchmark::State& state, std::vector<std::string> flags) {
  for (auto _ : state) Report(state, Run(flags, 17));
}
BENCHMARK_CAPTURE(BM_QueuePolicy, no_queue, std::vector<std::string>{})->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_QueuePolicy, fcfs,
                  std::vector<std::string>{"--router-queue-threshold", "1", "--router-queue-policy", "fcfs"})
    ->Iterations(1)
    ->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_QueuePolicy, wspt,
                  std::vector<std::string>{"--router-queue-threshold", "1", "--router-queue-policy", "wspt"})
    ->Iterations(1)
    ->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_QueuePolicy, lcfs,
                  std::vector<std::string>{"--router-queue-threshold", "1", "--router-queue-policy", "lcfs"})
    ->Iterations(1)
    ->Unit(benchmark::kSecond);

}  // namespace
}  // namespace kvrouter

BENCHMARK_MAIN();
