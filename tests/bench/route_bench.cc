// Route round-trip latency over NATS on loopback (issue 3): a real nats-server and the real
// kvrouter binary (both started here on a free port), 64 registered workers with 1,024 indexed
// blocks each, then sequential `route` requests of 256 tokens, idle and while a publisher
// thread sends KV events at a fixed rate. Reports p50/p99 per request as counters.
// Run: build/bin/route_bench (see docs/performance.md).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string_view>
#include <thread>

#include <unistd.h>

#include "events/block_hash.h"
#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "router/service/config.h"
#include "router/service/kv_router_service.h"
#include "tests/integration/process.h"
#include "transport/memory_bus.h"
#include "transport/nats_client.h"

namespace kvrouter {
namespace {

using namespace std::chrono_literals;
constexpr std::uint32_t kBs = 64;
constexpr int kWorkers = 64;
const std::string kComp = "namespace.dynamo.component.backend.";

struct Rig {
  std::unique_ptr<testing::NatsServerProcess> nats;
  std::unique_ptr<testing::ChildProcess> router;
  std::unique_ptr<NatsClient> nc;         // the client sending route requests
  std::unique_ptr<NatsClient> publisher;  // the workers' events, on their own connection
  std::vector<std::vector<std::uint32_t>> prompts;
  bool ok = false;
};

KvEventBatch Stored(std::uint64_t worker, std::uint64_t event_id, const std::vector<std::uint32_t>& tokens) {
  return StoredPromptBatch(worker, event_id, tokens, kBs);
}

// Answers every request on bench.echo with a body of a route reply's size.
Result<std::unique_ptr<Subscription>> ServeEcho(NatsClient& nc) {
  static const msgpack::sbuffer reply = EncodeRouteReply(RouteReply{.worker_id = 1, .overlap_blocks = 4});
  return nc.Subscribe("bench.echo", "", [&nc](const IncomingMessage& m) { (void)nc.Respond(m, AsBytes(reply)); });
}

Rig& TheRig() {
  static Rig rig;
  static bool tried = false;
  if (tried) return rig;
  tried = true;
  auto nats = testing::NatsServerProcess::Start();
  if (!nats.ok()) return rig;
  rig.nats = std::move(nats).value();
  // To compare routers in one build: ROUTE_BENCH_KVROUTER, another kvrouter binary;
  // ROUTE_BENCH_ROUTER_ARGS, more kvrouter flags (space-separated).
  const char* bin = std::getenv("ROUTE_BENCH_KVROUTER");
  std::vector<std::string> argv = {bin != nullptr ? bin : KVROUTER_BIN, "--nats-server", rig.nats->url(),
                                   "--router-mode", "kv"};
  if (const char* extra = std::getenv("ROUTE_BENCH_ROUTER_ARGS"); extra != nullptr) {
    std::istringstream words(extra);
    for (std::string w; words >> w;) argv.push_back(w);
  }
  auto router = testing::ChildProcess::Start(argv, "/tmp/route_bench_kvrouter.log");
  if (!router.ok()) return rig;
  rig.router = std::move(router).value();
  auto nc = NatsClient::Connect({.url = rig.nats->url(), .name = "route-bench", .send_asap = true}, {});
  if (!nc.ok()) return rig;
  rig.nc = std::move(nc).value();
  auto pub = NatsClient::Connect({.url = rig.nats->url(), .name = "route-bench-workers"}, {});
  if (!pub.ok()) return rig;
  rig.publisher = std::move(pub).value();
  const std::string stats = "namespace.dynamo.router.stats";
  if (!testing::WaitFor([&] { return rig.nc->Request(stats, AsBytes(std::string_view("\x80", 1)), 200ms).ok(); }, 10s))
    return rig;
  std::mt19937 rng(3);
  for (int p = 0; p < 64; ++p) {
    std::vector<std::uint32_t> t(1024 * kBs / 16);  // 64 blocks
    for (auto& x : t) x = rng();
    rig.prompts.push_back(std::move(t));
  }
  for (int w = 0; w < kWorkers; ++w) {
    WorkerRegistration r{.worker_id = static_cast<std::uint64_t>(w), .block_size = kBs, .lease_ms = 600000};
    (void)rig.nc->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r)));
    // 16 prompts of 64 blocks = 1,024 blocks per worker; prompts shared by several workers.
    for (int k = 0; k < 16; ++k) {
      (void)rig.nc->Publish(kComp + "kv-events",
                            AsBytes(EncodeDynamoEnvelope(Stored(w, k + 1, rig.prompts[(w + k * 7) % 64]), {})));
    }
  }
  (void)rig.nc->Flush(5s);
  rig.ok = testing::WaitFor(
      [&] {
        auto reply = rig.nc->Request(stats, AsBytes(std::string_view("\x80", 1)), 1s);
        if (!reply.ok()) return false;
        auto page = DecodeStatsReply(*reply);
        return page.ok() && page->counters["events_applied"] >= kWorkers * 16;
      },
      30s);
  return rig;
}

// A publisher thread of KV events on the workers' own connection: `workers` event-only workers
// (ids 1000+) store and then drop chains of `blocks` blocks, `rate` messages per second (0: as
// fast as it can), until `total` messages (0: until stopped).
class EventFlood {
 public:
  EventFlood(Rig& rig, std::int64_t rate, std::uint64_t total, std::uint64_t workers = 16, std::uint32_t blocks = 1)
      : thread_([this, &rig, rate, total, workers, blocks] {
          std::vector<std::uint64_t> next_id(workers, 1);
          std::vector<std::uint32_t> tokens(std::size_t{kBs} * blocks);
          const auto start = std::chrono::steady_clock::now();
          std::uint64_t n = 0;
          while (!stop_.load(std::memory_order_relaxed) && (total == 0 || n < total)) {
            if (rate > 0) {
              const auto due = start + std::chrono::nanoseconds(static_cast<std::int64_t>(n * 1e9 / rate));
              if (std::chrono::steady_clock::now() < due) std::this_thread::sleep_until(due);
            }
            const std::uint64_t w = n % workers;
            tokens[0] = static_cast<std::uint32_t>(n);
            KvEventBatch b = Stored(1000 + w, next_id[w]++, tokens);
            (void)rig.publisher->Publish(kComp + "kv-events", AsBytes(EncodeDynamoEnvelope(b, {})));
            KvEventBatch r{.worker_id = 1000 + w, .sequence = {SequenceKind::kEventId, next_id[w]++}};
            KvRemoved removed;
            for (const auto& blk : std::get<KvStored>(b.ops[0].data).blocks)
              removed.block_hashes.push_back(blk.block_hash);
            r.ops.push_back({StorageTier::kDevice, std::move(removed)});
            (void)rig.publisher->Publish(kComp + "kv-events", AsBytes(EncodeDynamoEnvelope(r, {})));
            n += 2;
            sent_.store(n, std::memory_order_relaxed);
          }
          done_.store(true);
        }) {}
  ~EventFlood() {
    stop_.store(true);
    thread_.join();
  }
  bool done() const { return done_.load(); }
  std::uint64_t sent() const { return sent_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> stop_{false}, done_{false};
  std::atomic<std::uint64_t> sent_{0};
  std::thread thread_;  // last: starts after the flags exist
};

// One timed route (or best_worker) round trip of 4 cached blocks; false when it failed.
bool TimedRoute(Rig& rig, std::size_t i, std::vector<double>& us, const char* endpoint = "route") {
  const auto& p = rig.prompts[i % rig.prompts.size()];
  std::vector<std::uint32_t> tokens(p.begin(), p.begin() + 256);  // 4 blocks of a cached prompt
  RouteRequest req{.token_ids = std::move(tokens), .has_token_ids = true, .isl = 256};
  const auto body = EncodeRouteRequest(req);
  const auto a = std::chrono::steady_clock::now();
  auto reply = rig.nc->Request(std::string("namespace.dynamo.router.") + endpoint, AsBytes(body), 2s);
  const auto b = std::chrono::steady_clock::now();
  if (!reply.ok() || !DecodeRouteReply(*reply).ok()) return false;
  us.push_back(std::chrono::duration<double, std::micro>(b - a).count());
  return true;
}

void Report(benchmark::State& state, std::vector<double>& us) {
  if (us.empty()) return;
  std::sort(us.begin(), us.end());
  state.counters["routes"] = static_cast<double>(us.size());
  state.counters["p50_us"] = us[us.size() / 2];
  state.counters["p99_us"] = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  state.counters["max_us"] = us.back();
}

// The route round trip's baseline: the same request body to a bare nats.c responder on its own
// connection that answers with a reply of a route reply's size. Compare with BM_RouteRoundTrip/0.
// Arg 0: the responder is a thread of this process; arg 1: it is a process of its own, as
// kvrouter is (this binary run with --echo-responder), so its wake-ups cross processes too.
void BM_EchoRoundTrip(benchmark::State& state) {
  Rig& rig = TheRig();
  if (!rig.ok) {
    state.SkipWithError("could not start nats-server + kvrouter");
    return;
  }
  std::unique_ptr<NatsClient> responder;
  std::unique_ptr<Subscription> sub;
  std::unique_ptr<testing::ChildProcess> child;
  if (state.range(0) == 0) {
    auto nc = NatsClient::Connect({.url = rig.nats->url(), .name = "route-bench-echo", .send_asap = true}, {});
    if (!nc.ok()) {
      state.SkipWithError("no responder connection");
      return;
    }
    responder = std::move(nc).value();
    auto s = ServeEcho(*responder);
    if (!s.ok() || !responder->Flush(2s).ok()) {
      state.SkipWithError("no echo subscription");
      return;
    }
    sub = std::move(s).value();
  } else {
    auto c = testing::ChildProcess::Start({"/proc/self/exe", "--echo-responder", rig.nats->url()},
                                          "/tmp/route_bench_echo.log");
    if (!c.ok()) {
      state.SkipWithError("could not start the echo process");
      return;
    }
    child = std::move(c).value();
    const auto probe = EncodeRouteReply({});
    if (!testing::WaitFor([&] { return rig.nc->Request("bench.echo", AsBytes(probe), 200ms).ok(); }, 10s)) {
      state.SkipWithError("the echo process never answered");
      return;
    }
  }
  std::vector<double> us;
  std::size_t i = 0;
  for (auto _ : state) {
    const auto& p = rig.prompts[i++ % rig.prompts.size()];
    RouteRequest req{
        .token_ids = std::vector<std::uint32_t>(p.begin(), p.begin() + 256), .has_token_ids = true, .isl = 256};
    const auto body = EncodeRouteRequest(req);
    const auto a = std::chrono::steady_clock::now();
    auto got = rig.nc->Request("bench.echo", AsBytes(body), 2s);
    const auto b = std::chrono::steady_clock::now();
    if (!got.ok()) {
      state.SkipWithError("echo failed");
      break;
    }
    us.push_back(std::chrono::duration<double, std::micro>(b - a).count());
  }
  Report(state, us);
}
BENCHMARK(BM_EchoRoundTrip)->Arg(0)->Arg(1)->Iterations(5000)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The route request's decoding alone (256 tokens, as in the round trips): part of what a route
// costs beyond an echo.
void BM_DecodeRouteRequest(benchmark::State& state) {
  std::mt19937 rng(5);
  RouteRequest req{.request_id = "bench-request-1", .has_token_ids = true, .isl = 256};
  for (int i = 0; i < 256; ++i) req.token_ids.push_back(rng() % 150000);
  const msgpack::sbuffer body = EncodeRouteRequest(req);
  for (auto _ : state) {
    auto r = DecodeRouteRequest(AsBytes(body));
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_DecodeRouteRequest);

// One event of the ingest benchmark below (a Dynamo envelope of 4 stored blocks with its header
// fields), decoded into a recycled batch as the router's event thread does.
void BM_DecodeDynamoEvent(benchmark::State& state) {
  std::vector<std::uint32_t> tokens(std::size_t{kBs} * 4);
  for (std::size_t k = 0; k < tokens.size(); ++k) tokens[k] = static_cast<std::uint32_t>(k * 2654435761u);
  const msgpack::sbuffer body = EncodeDynamoEnvelope(
      Stored(5000, 12345, tokens),
      {.publisher_id = 77, .sequence = 123456, .published_at_ms = 1764700000000, .topic = "kv-events"});
  KvEventBatch batch;
  for (auto _ : state) {
    Status s = DecodeDynamoEventInto(AsBytes(body), batch);
    benchmark::DoNotOptimize(s);
    benchmark::DoNotOptimize(batch);
  }
  if (batch.ops.size() != 1 || std::get<KvStored>(batch.ops[0].data).blocks.size() != 4) {
    state.SkipWithError("the event did not decode as 4 stored blocks");
  }
}
BENCHMARK(BM_DecodeDynamoEvent);

// The route against the echo in one run, taking turns request by request (the echo a process
// of its own), so that both see the same minutes of this VM: its speed drifts by 2x between runs
// a minute apart, more than the difference measured. Counters: each one's p50/p99 and the ratios.
void BM_RouteVsEcho(benchmark::State& state) {
  Rig& rig = TheRig();
  if (!rig.ok) {
    state.SkipWithError("could not start nats-server + kvrouter");
    return;
  }
  auto child = testing::ChildProcess::Start({"/proc/self/exe", "--echo-responder", rig.nats->url()},
                                            "/tmp/route_bench_echo.log");
  const auto probe = EncodeRouteReply({});
  if (!child.ok() ||
      !testing::WaitFor([&] { return rig.nc->Request("bench.echo", AsBytes(probe), 200ms).ok(); }, 10s)) {
    state.SkipWithError("the echo process never answered");
    return;
  }
  std::vector<double> route_us, echo_us;
  std::size_t i = 0;
  for (auto _ : state) {
    if (!TimedRoute(rig, i, route_us)) {
      state.SkipWithError("route failed");
      break;
    }
    const auto& p = rig.prompts[i++ % rig.prompts.size()];
    RouteRequest req{
        .token_ids = std::vector<std::uint32_t>(p.begin(), p.begin() + 256), .has_token_ids = true, .isl = 256};
    const auto body = EncodeRouteRequest(req);
    const auto a = std::chrono::steady_clock::now();
    if (!rig.nc->Request("bench.echo", AsBytes(body), 2s).ok()) {
      state.SkipWithError("echo failed");
      break;
    }
    echo_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
  }
  if (route_us.empty() || echo_us.empty()) return;
  std::sort(route_us.begin(), route_us.end());
  std::sort(echo_us.begin(), echo_us.end());
  auto at = [](const std::vector<double>& v, std::size_t permille) {
    return v[std::min(v.size() - 1, v.size() * permille / 1000)];
  };
  state.counters["route_p50_us"] = at(route_us, 500);
  state.counters["route_p99_us"] = at(route_us, 990);
  state.counters["echo_p50_us"] = at(echo_us, 500);
  state.counters["echo_p99_us"] = at(echo_us, 990);
  state.counters["p50_ratio"] = at(route_us, 500) / at(echo_us, 500);
  state.counters["p99_ratio"] = at(route_us, 990) / at(echo_us, 990);
}
BENCHMARK(BM_RouteVsEcho)->Iterations(5000)->Unit(benchmark::kMicrosecond)->UseRealTime();

// One route in this process, no NATS: KvRouterService on the in-memory bus with the round trips'
// fleet (64 workers x 1,024 blocks) and requests (256 tokens, 4 cached blocks, nothing booked).
// Decoding, hashing, find_matches, selection and the encoded reply: what a route adds to an echo.
void BM_RouteInProcess(benchmark::State& state) {
  InMemoryBus bus;
  const char* argv[] = {"kvrouter", "--router-mode", "kv", "--block-size", "64"};
  auto cfg = ParseRouterConfig(5, argv, [](const char*) { return nullptr; });
  if (!cfg.ok()) {
    state.SkipWithError("config");
    return;
  }
  KvRouterService svc(cfg->config, bus);
  if (!svc.Start().ok()) {
    state.SkipWithError("start");
    return;
  }
  std::mt19937 rng(3);
  std::vector<std::vector<std::uint32_t>> prompts;
  for (int p = 0; p < 64; ++p) {
    std::vector<std::uint32_t> t(1024 * kBs / 16);
    for (auto& x : t) x = rng();
    prompts.push_back(std::move(t));
  }
  for (int w = 0; w < kWorkers; ++w) {
    WorkerRegistration r{.worker_id = static_cast<std::uint64_t>(w), .block_size = kBs, .lease_ms = 600000};
    (void)bus.Publish(svc.subjects().instances, AsBytes(EncodeWorkerRegistration(r)));
    for (int k = 0; k < 16; ++k) {
      (void)bus.Publish(svc.subjects().kv_events,
                        AsBytes(EncodeDynamoEnvelope(Stored(w, k + 1, prompts[(w + k * 7) % 64]), {})));
    }
  }
  svc.index().Flush();
  std::vector<msgpack::sbuffer> bodies;
  for (const auto& p : prompts) {
    RouteRequest req{
        .token_ids = std::vector<std::uint32_t>(p.begin(), p.begin() + 256), .has_token_ids = true, .isl = 256};
    bodies.push_back(EncodeRouteRequest(req));
  }
  std::size_t i = 0;
  for (auto _ : state) {
    auto reply = bus.Request(svc.subjects().route, AsBytes(bodies[i++ % bodies.size()]));
    if (!reply || !DecodeRouteReply(*reply).ok()) {
      state.SkipWithError("route failed");
      break;
    }
  }
  svc.Stop();
}
BENCHMARK(BM_RouteInProcess)->Unit(benchmark::kMicrosecond);

// Arg: KV events per second published meanwhile (stored 1-block chains, then their removal).
void BM_RouteRoundTrip(benchmark::State& state) {
  Rig& rig = TheRig();
  if (!rig.ok) {
    state.SkipWithError("could not start nats-server + kvrouter");
    return;
  }
  const std::int64_t rate = state.range(0);
  std::optional<EventFlood> flood;
  if (rate > 0) flood.emplace(rig, rate, 0);
  std::vector<double> us;
  std::size_t i = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (!TimedRoute(rig, i++, us)) {
      state.SkipWithError("route failed");
      break;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (flood) state.counters["events_per_s"] = flood->sent() / secs;
  flood.reset();
  Report(state, us);
}
BENCHMARK(BM_RouteRoundTrip)->Arg(0)->Arg(100000)->Iterations(5000)->Unit(benchmark::kMicrosecond)->UseRealTime();

// Sequential `endpoint` requests timed from the start of a flood of `messages` event messages
// (chains of `blocks` blocks from `workers` workers, as fast as one connection can) to its end.
void TimeDuringFlood(benchmark::State& state, const char* endpoint, std::uint64_t workers, std::uint32_t blocks) {
  Rig& rig = TheRig();
  if (!rig.ok) {
    state.SkipWithError("could not start nats-server + kvrouter");
    return;
  }
  std::vector<double> us;
  for (auto _ : state) {
    EventFlood flood(rig, 0, static_cast<std::uint64_t>(state.range(0)), workers, blocks);
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; !flood.done(); ++i) {
      if (!TimedRoute(rig, i, us, endpoint)) {
        state.SkipWithError("request failed");
        break;
      }
    }
    state.counters["events_per_s"] =
        flood.sent() / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  Report(state, us);
}

// Routes during 300,000 single-block event messages from 16 workers (the structure issue's
// before / after of the event path leaving the routing mutex).
void BM_RouteDuringFlood(benchmark::State& state) { TimeDuringFlood(state, "route", 16, 1); }
BENCHMARK(BM_RouteDuringFlood)->Arg(300000)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// The faults issue's goal: best_worker during a flood of 300,000 event messages of 4 blocks each
// from 64 workers (p99 < 20 ms, p50 < 1 ms).
void BM_BestWorkerDuringFlood(benchmark::State& state) { TimeDuringFlood(state, "best_worker", 64, 4); }
BENCHMARK(BM_BestWorkerDuringFlood)->Arg(300000)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- baselines in the same run: a bare nats.c echo, a bare nats.c counting subscriber ----------

// The counters only: a page past the last rank (none listed), since each listed rank's block
// counts take the shard locks while the events being measured are applied.
std::optional<std::uint64_t> RouterCounter(Rig& rig, const std::string& name) {
  static const msgpack::sbuffer counters_only = EncodeStatsRequest({.offset = std::uint64_t{1} << 62, .limit = 1});
  auto reply = rig.nc->Request("namespace.dynamo.router.stats", AsBytes(counters_only), 2s);
  if (!reply.ok()) return std::nullopt;
  auto page = DecodeStatsReply(*reply);
  if (!page.ok()) return std::nullopt;
  return page->counters[name];
}
std::uint64_t EventsApplied(Rig& rig) { return RouterCounter(rig, "events_applied").value_or(0); }

// CPU time a process has run, all its threads (the first field of each thread's schedstat, ns);
// 0 when unreadable.
std::uint64_t ProcessCpuNs(pid_t pid) {
  std::uint64_t total = 0;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "schedstat");
    std::uint64_t ns = 0;
    if (in >> ns) total += ns;
  }
  return total;
}

// The whole machine's CPU time so far, all CPUs (/proc/stat, in ns): busy (user, nice, system,
// irq, softirq) and taken by the host (steal).
struct MachineCpu {
  double busy_ns = 0, steal_ns = 0;
};
MachineCpu ReadMachineCpu() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  std::uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  const double tick_ns = 1e9 / static_cast<double>(sysconf(_SC_CLK_TCK));
  return {static_cast<double>(user + nice + system + irq + softirq) * tick_ns, static_cast<double>(steal) * tick_ns};
}

// Where one phase of BM_IngestVsBareSubscriber spent the machine's CPU, per message.
struct PhaseCpu {
  double cores_busy = 0;   // busy CPU time / wall time (at most the machine's cores)
  double steal_pct = 0;    // of the phase's wall time × cores, taken by the host
  double server_ns = 0;    // nats-server
  double bench_ns = 0;     // this process: the publisher, and the bare subscriber or stats polls
  double receiver_ns = 0;  // the router process (router phase only)
};
class PhaseMeter {
 public:
  PhaseMeter(Rig& rig, bool router) : rig_(rig), router_(router) {
    machine_ = ReadMachineCpu();
    server_ = ProcessCpuNs(rig_.nats->pid());
    bench_ = ProcessCpuNs(getpid());
    receiver_ = router_ ? ProcessCpuNs(rig_.router->pid()) : 0;
    t0_ = std::chrono::steady_clock::now();
  }
  PhaseCpu Stop(std::uint64_t n) const {
    const double wall_ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0_).count();
    const MachineCpu m = ReadMachineCpu();
    const double msgs = static_cast<double>(n);
    const double cores = static_cast<double>(std::thread::hardware_concurrency());
    return {.cores_busy = (m.busy_ns - machine_.busy_ns) / wall_ns,
            .steal_pct = 100 * (m.steal_ns - machine_.steal_ns) / (wall_ns * cores),
            .server_ns = static_cast<double>(ProcessCpuNs(rig_.nats->pid()) - server_) / msgs,
            .bench_ns = static_cast<double>(ProcessCpuNs(getpid()) - bench_) / msgs,
            .receiver_ns = router_ ? static_cast<double>(ProcessCpuNs(rig_.router->pid()) - receiver_) / msgs : 0};
  }

 private:
  Rig& rig_;
  bool router_;
  MachineCpu machine_;
  std::uint64_t server_ = 0, bench_ = 0, receiver_ = 0;
  SteadyTime t0_;
};

// Event ingest against its baseline, one run: `n` Dynamo envelopes of 4 stored blocks from 64
// registered workers, published as fast as one connection can. Arg 1 of the second range: the
// blocks as a real engine (vLLM, through kvrelay) names them: engine block ids that are not the
// sequence hashes, each message continuing its worker's chain from the last one (parent_hash);
// arg 0: the block ids are the sequence hashes and every message a fresh chain (Dynamo's and
// kvmocker's workers); arg 2: an engine's steady state, engine block ids, each message a fresh
// chain, each worker filled (untimed) with 2,048 chains (524,288 blocks in all), then every other
// message of a worker removes its oldest chain, tail first (as vLLM frees a finished request's
// blocks). Sent (a) to a bare nats.c subscriber that only counts them, on a subject
// as long as the router's (time: first publish to the last message counted), then
// (b) to the router (time: first publish until its stats show every event applied). Counters:
// bare_msgs_per_s, router_msgs_per_s (medians of 5 alternating runs) and their ratio, and
// router_cpu_ns_per_msg (the router process's CPU time per event, median).
void BM_IngestVsBareSubscriber(benchmark::State& state) {
  Rig& rig = TheRig();
  if (!rig.ok) {
    state.SkipWithError("could not start nats-server + kvrouter");
    return;
  }
  const std::uint64_t n = static_cast<std::uint64_t>(state.range(0));
  const bool engine_hashes = state.range(1) == 1, evicting = state.range(1) == 2;
  constexpr std::uint64_t kIngestWorkers = 64, kFirstId = 5000;
  constexpr std::size_t kHeldChains = 2048;  // /2: chains a worker holds before each store evicts one
  // Each worker's next event id, continued across iterations and runs: no gap, so no recovery
  // (ids are taken as messages are made: a run that stops with an error leaves a gap behind).
  static std::vector<std::uint64_t> next_id(kIngestWorkers, 1);
  static std::uint64_t round = 0;  // in every engine id: each iteration's are new
  // The workers register and store a first chain; recovery of their first sight settles here.
  static bool registered = false;
  if (!registered) {
    registered = true;
    const std::uint64_t before = EventsApplied(rig);
    std::vector<std::uint32_t> first(std::size_t{kBs} * 4, 7);
    for (std::uint64_t w = 0; w < kIngestWorkers; ++w) {
      WorkerRegistration r{
          .worker_id = kFirstId + w, .block_size = kBs, .total_kv_blocks = 1u << 22, .lease_ms = 600000};
      (void)rig.nc->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r)));
      (void)rig.nc->Publish(kComp + "kv-events",
                            AsBytes(EncodeDynamoEnvelope(Stored(kFirstId + w, next_id[w]++, first), {})));
    }
    (void)rig.nc->Flush(5s);
    if (!testing::WaitFor([&] { return EventsApplied(rig) >= before + kIngestWorkers; }, 30s)) {
      state.SkipWithError("the ingest workers' first events were not applied");
      return;
    }
  }
  auto bare = NatsClient::Connect({.url = rig.nats->url(), .name = "route-bench-bare"}, {});
  if (!bare.ok()) {
    state.SkipWithError("no subscriber connection");
    return;
  }
  std::atomic<std::uint64_t> counted{0};
  // As long as the router's subject: nats-server and nats.c read a subject byte by byte on both
  // sides, and a subject 24 bytes shorter saves the bare phase about 330 ns of CPU per message
  // that has nothing to do with what the router does with an event.
  const std::string bare_subject = kComp + "bare-evts";
  static_assert(sizeof("bare-evts") == sizeof("kv-events"));
  auto sub = (*bare)->Subscribe(bare_subject, "", [&](const IncomingMessage&) {
    if (counted.fetch_add(1, std::memory_order_relaxed) + 1 == n) counted.notify_all();
  });
  if (!sub.ok() || !(*bare)->Flush(2s).ok()) {
    state.SkipWithError("no bare subscription");
    return;
  }
  std::vector<double> bare_rates, router_rates;
  std::vector<PhaseCpu> bare_cpu, router_cpu;
  double bytes = 0;
  const std::optional<std::uint64_t> gaps_before = RouterCounter(rig, "event_gaps");
  for (auto _ : state) {
    ++round;
    // Every message encoded before the clocks start: 4 fresh blocks per message.
    std::vector<msgpack::sbuffer> msgs;
    // /2: first the fill the router gets before the clocks start, each worker's chains up to
    // kHeldChains, so that what the timed messages remove is old and out of the caches.
    const std::uint64_t fill_n = evicting ? kHeldChains * kIngestWorkers : 0;
    msgs.reserve(fill_n + n);
    std::vector<std::uint32_t> tokens(std::size_t{kBs} * 4);
    std::vector<std::optional<BlockHash>> chain_end(kIngestWorkers);       // each worker starts cleared
    std::vector<std::deque<std::vector<BlockHash>>> held(kIngestWorkers);  // /2: chains stored, oldest first
    for (std::uint64_t i = 0; i < fill_n + n; ++i) {
      const std::uint64_t w = i % kIngestWorkers;
      const std::uint64_t event_id = next_id[w]++;
      if (evicting && held[w].size() > kHeldChains) {  // the oldest chain goes, tail first
        KvEventBatch b{.worker_id = kFirstId + w, .sequence = {SequenceKind::kEventId, event_id}};
        KvRemoved r;
        r.block_hashes.assign(held[w].front().rbegin(), held[w].front().rend());
        held[w].pop_front();
        b.ops.push_back({StorageTier::kDevice, std::move(r)});
        msgs.push_back(EncodeDynamoEnvelope(b, {}));
        if (i >= fill_n) bytes += static_cast<double>(msgs.back().size());
        continue;
      }
      for (std::size_t k = 0; k < tokens.size(); k += kBs) tokens[k] = static_cast<std::uint32_t>(i * 4 + k);
      KvEventBatch b = Stored(kFirstId + w, event_id, tokens);
      if (evicting) {
        auto& stored = std::get<KvStored>(b.ops[0].data);
        held[w].emplace_back();
        for (std::size_t k = 0; k < stored.blocks.size(); ++k) {
          stored.blocks[k].block_hash = (round << 32) ^ (i * 4 + k) ^ 0x2545f491'00000000ull;
          held[w].back().push_back(stored.blocks[k].block_hash);
        }
      } else if (engine_hashes) {
        auto& stored = std::get<KvStored>(b.ops[0].data);
        stored.parent_hash = chain_end[w];
        for (std::size_t k = 0; k < stored.blocks.size(); ++k) {
          stored.blocks[k].block_hash = (round << 32) ^ (i * 4 + k) ^ 0x5bd1e995'00000000ull;
        }
        chain_end[w] = stored.blocks.back().block_hash;
      }
      msgs.push_back(EncodeDynamoEnvelope(b, {}));
      if (i >= fill_n) bytes += static_cast<double>(msgs.back().size());
    }
    const std::span<const msgpack::sbuffer> timed(msgs.begin() + static_cast<std::ptrdiff_t>(fill_n), msgs.end());
    if (fill_n > 0) {
      const std::uint64_t before = EventsApplied(rig);
      for (std::uint64_t i = 0; i < fill_n; ++i) (void)rig.publisher->Publish(kComp + "kv-events", AsBytes(msgs[i]));
      if (!testing::WaitFor([&] { return EventsApplied(rig) >= before + fill_n; }, 120s, 1ms)) {
        state.SkipWithError("the router did not apply the fill");
        return;
      }
    }
    counted.store(0);
    const PhaseMeter bare_meter(rig, /*router=*/false);
    auto t0 = std::chrono::steady_clock::now();
    for (const auto& m : timed) (void)rig.publisher->Publish(bare_subject, AsBytes(m));
    for (std::uint64_t c = counted.load(); c < n; c = counted.load()) counted.wait(c);
    bare_rates.push_back(static_cast<double>(n) /
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    bare_cpu.push_back(bare_meter.Stop(n));

    const std::uint64_t before = EventsApplied(rig);
    const PhaseMeter router_meter(rig, /*router=*/true);
    t0 = std::chrono::steady_clock::now();
    for (const auto& m : timed) (void)rig.publisher->Publish(kComp + "kv-events", AsBytes(m));
    if (!testing::WaitFor([&] { return EventsApplied(rig) >= before + n; }, 120s, 1ms)) {
      state.SkipWithError("the router did not apply every event");
      return;
    }
    router_rates.push_back(static_cast<double>(n) /
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    router_cpu.push_back(router_meter.Stop(n));
    // Untimed: the workers clear their caches, so every iteration starts from the same index.
    state.PauseTiming();
    const std::uint64_t applied = EventsApplied(rig);
    for (std::uint64_t w = 0; w < kIngestWorkers; ++w) {
      KvEventBatch clear{.worker_id = kFirstId + w, .sequence = {SequenceKind::kEventId, next_id[w]++}};
      clear.ops.push_back({StorageTier::kDevice, KvCleared{}});
      (void)rig.publisher->Publish(kComp + "kv-events", AsBytes(EncodeDynamoEnvelope(clear, {})));
    }
    (void)testing::WaitFor([&] { return EventsApplied(rig) >= applied + kIngestWorkers; }, 30s);
    state.ResumeTiming();
  }
  // A gap would have the router ask the (absent) worker for the missed events meanwhile.
  const std::optional<std::uint64_t> gaps_after = RouterCounter(rig, "event_gaps");
  if (gaps_before && gaps_after && *gaps_after != *gaps_before) {
    state.SkipWithError("the router saw a gap in an event stream");
  }
  // Medians of the iterations: one run is at the mercy of the scheduler on 2 cores.
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double bare_rate = median(bare_rates), router_rate = median(router_rates);
  state.counters["msg_bytes"] = bytes / static_cast<double>(n * state.iterations());
  state.counters["bare_msgs_per_s"] = bare_rate;
  state.counters["router_msgs_per_s"] = router_rate;
  state.counters["router_vs_bare"] = router_rate / bare_rate;
  // The router's own cost, steadier than its rate on a shared machine: CPU time of all its
  // threads per event (the stats requests of the wait included, a few hundred).
  auto median_of = [&](const std::vector<PhaseCpu>& v, double PhaseCpu::*field) {
    std::vector<double> x;
    for (const PhaseCpu& p : v) x.push_back(p.*field);
    return median(std::move(x));
  };
  state.counters["router_cpu_ns_per_msg"] = median_of(router_cpu, &PhaseCpu::receiver_ns);
  // Where the machine's CPU went in each phase (medians): both phases share 2 cores with
  // nats-server and the publisher, so when both keep the cores busy, their rates are in the
  // ratio of their CPU per message.
  for (const auto& [name, phase] : {std::pair{"bare", &bare_cpu}, std::pair{"router", &router_cpu}}) {
    const std::string p(name);
    state.counters[p + "_cores_busy"] = median_of(*phase, &PhaseCpu::cores_busy);
    state.counters[p + "_steal_pct"] = median_of(*phase, &PhaseCpu::steal_pct);
    state.counters[p + "_server_ns_per_msg"] = median_of(*phase, &PhaseCpu::server_ns);
    state.counters[p + "_bench_ns_per_msg"] = median_of(*phase, &PhaseCpu::bench_ns);
  }
}
BENCHMARK(BM_IngestVsBareSubscriber)
    ->Args({300000, 0})
    ->Args({300000, 1})
    ->Args({300000, 2})
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Replies per second from `subject` with `in_flight` requests outstanding from one client for
// `seconds` (each reply sends the next request; every request is the same body).
double RequestsPerSecond(NatsClient& nc, const std::string& subject, std::span<const std::byte> body, int in_flight,
                         double seconds) {
  static std::atomic<int> inboxes{0};
  const std::string inbox = "bench.inbox." + std::to_string(inboxes.fetch_add(1));
  std::atomic<std::uint64_t> replies{0};
  std::atomic<bool> stop{false};
  std::atomic<int> outstanding{in_flight};
  auto sub = nc.Subscribe(inbox, "", [&](const IncomingMessage&) {
    replies.fetch_add(1, std::memory_order_relaxed);
    if (stop.load(std::memory_order_relaxed)) {
      outstanding.fetch_sub(1);
    } else {
      (void)nc.PublishRequest(subject, inbox, body);
    }
  });
  if (!sub.ok() || !nc.Flush(2s).ok()) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < in_flight; ++i) (void)nc.PublishRequest(subject, inbox, body);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));  // the measured window itself
  const std::uint64_t n = replies.load();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stop.store(true);
  (void)testing::WaitFor([&] { return outstanding.load() == 0; }, 5s);
  return static_cast<double>(n) / elapsed;
}

// best_worker's throughput as the fleet grows, against a bare nats.c echo through the same client
// and concurrency (64 requests in flight), in one run taking turns: a kvrouter of its own with
// arg workers of one rank each, every tenth holding the first 4 blocks of the 512-token prompt
// asked for (issue of decisions sublinear in the fleet). Counters: each one's requests/s
// (median of 3 turns) and their ratio.
void BM_BestWorkerThroughputVsEcho(benchmark::State& state) {
  Rig& rig = TheRig();
  if (!rig.ok) return state.SkipWithError("could not start nats-server + kvrouter");
  const auto fleet = static_cast<std::uint64_t>(state.range(0));
  const std::string ns = "scale" + std::to_string(fleet);
  const char* bin = std::getenv("ROUTE_BENCH_KVROUTER");  // another kvrouter binary, as for the rig
  auto router = testing::ChildProcess::Start(
      {bin != nullptr ? bin : KVROUTER_BIN, "--nats-server", rig.nats->url(), "--namespace", ns, "--router-mode", "kv",
       "--block-size", std::to_string(kBs), "--router-max-worker-ranks", "262144", "--router-max-workers", "262144",
       "--metrics-port", "0"},
      "/tmp/route_bench_scale.log");
  auto echo = testing::ChildProcess::Start({"/proc/self/exe", "--echo-responder", rig.nats->url()},
                                           "/tmp/route_bench_echo.log");
  if (!router.ok() || !echo.ok()) return state.SkipWithError("could not start kvrouter and the echo");
  const std::string stats = "namespace." + ns + ".router.stats";
  if (!testing::WaitFor([&] { return rig.nc->Request(stats, AsBytes(std::string_view("\x80", 1)), 200ms).ok(); }, 10s))
    return state.SkipWithError("the scale kvrouter never answered");
  const std::string comp = "namespace." + ns + ".component.backend.";
  std::vector<std::uint32_t> prompt(512);
  for (std::uint32_t k = 0; k < prompt.size(); ++k) prompt[k] = k + 1;
  const std::vector<std::uint32_t> held(prompt.begin(), prompt.begin() + 4 * kBs);  // 4 blocks
  for (std::uint64_t w = 1; w <= fleet; ++w) {
    WorkerRegistration r{.worker_id = w, .block_size = kBs, .total_kv_blocks = 16384, .lease_ms = 3600000};
    (void)rig.publisher->Publish(comp + "instances", AsBytes(EncodeWorkerRegistration(r)));
    if (w % 10 == 0)
      (void)rig.publisher->Publish(comp + "kv-events", AsBytes(EncodeDynamoEnvelope(Stored(w, 1, held), {})));
  }
  (void)rig.publisher->Flush(10s);
  const bool ready = testing::WaitFor(
      [&] {
        auto reply = rig.nc->Request(stats, AsBytes(std::string_view("\x80", 1)), 2s);
        if (!reply.ok()) return false;
        auto page = DecodeStatsReply(*reply);
        return page.ok() && page->workers_total == fleet && page->counters["events_applied"] >= fleet / 10;
      },
      60s);
  if (!ready) return state.SkipWithError("the fleet was not registered and indexed in time");
  RouteRequest req{.token_ids = prompt, .has_token_ids = true, .isl = static_cast<std::uint32_t>(prompt.size())};
  const auto body = EncodeRouteRequest(req);
  std::vector<double> routed, echoed;
  for (auto _ : state) {
    for (int turn = 0; turn < 3; ++turn) {
      echoed.push_back(RequestsPerSecond(*rig.nc, "bench.echo", AsBytes(body), 64, 1.5));
      routed.push_back(RequestsPerSecond(*rig.nc, "namespace." + ns + ".router.best_worker", AsBytes(body), 64, 1.5));
    }
  }
  std::sort(routed.begin(), routed.end());
  std::sort(echoed.begin(), echoed.end());
  const double r = routed[routed.size() / 2], e = echoed[echoed.size() / 2];
  state.counters["best_worker_per_s"] = r;
  state.counters["echo_per_s"] = e;
  state.counters["ratio"] = e > 0 ? r / e : 0;
}
BENCHMARK(BM_BestWorkerThroughputVsEcho)
    ->Arg(64)
    ->Arg(1000)
    ->Arg(10000)
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// `route_bench --echo-responder URL`: BM_EchoRoundTrip/1's responder, until it is stopped.
int RunEchoResponder(const char* url) {
  auto nc = NatsClient::Connect({.url = url, .name = "route-bench-echo", .send_asap = true}, {});
  if (!nc.ok()) return 1;
  auto sub = ServeEcho(**nc);
  if (!sub.ok()) return 1;
  pause();  // SIGTERM from ChildProcess::Stop ends it
  return 0;
}

}  // namespace
}  // namespace kvrouter

int main(int argc, char** argv) {
  if (argc == 3 && std::string_view(argv[1]) == "--echo-responder") return kvrouter::RunEchoResponder(argv[2]);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
