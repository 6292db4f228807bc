// warmup_bench: how long a new kvrouter replica takes to learn a fleet's caches, from a running
// replica's router.dump (--router-replica-sync, docs/protocol.md section 12) against a dump from
// every worker (section 6). Real processes on one nats-server (1 MiB max payload): this program
// plays the fleet (--workers ranks of --blocks blocks each, chains of --chain blocks, each
// worker's recovery endpoint answered from a KvEventPublisher on one connection), and starts:
//   1. replica A, cold: it asks every worker for a dump (the fleet registers once A answers);
//   2. replica C, cold, beside A: the same storm of worker dumps (the baseline);
//   3. replica B with --router-replica-sync beside A: it warms from A's dump.
// For C and B: start -> index complete (every block of every rank in the replica's own stats),
// B's start -> /ready, and the dumps the workers served meanwhile.
//   warmup_bench --workers 1000 --blocks 10000 [--json out.json]
// Exit 1 when a replica never completes (or B asks any worker), 2 on bad flags or setup.
#include <fmt/format.h>

#include <atomic>
#include <boost/program_options.hpp>
#include <charconv>
#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "events/registration_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"
#include "tests/integration/process.h"
#include "transport/nats_client.h"

namespace kvrouter {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
namespace po = boost::program_options;

constexpr std::uint32_t kBs = 16;
const std::string kComp = "namespace.dynamo.component.backend.";
const std::string kRouter = "namespace.dynamo.router.";

struct Options {
  std::uint64_t workers = 1000;
  std::uint64_t blocks = 10000;
  std::uint64_t chain = 100;
  std::string json;
};

// The fleet: one publisher per worker, its recovery endpoint served on one connection.
class Fleet {
 public:
  explicit Fleet(const Options& o) {
    pubs_.reserve(o.workers);
    for (std::uint64_t w = 0; w < o.workers; ++w) {
      auto& pub = pubs_.emplace_back(
          std::make_unique<KvEventPublisher>(PublisherConfig{.worker_id = w + 1, .event_buffer = 0}));
      BlockHash next = (w + 1) << 32;
      for (std::uint64_t held = 0; held < o.blocks; held += o.chain) {
        KvStored chain;
        for (std::uint64_t i = 0; i < o.chain; ++i)
          chain.blocks.push_back({next + i, (next + i) * 0x9E3779B97F4A7C15ULL});
        next += o.chain;
        (void)pub->Publish(std::move(chain));
      }
    }
  }
  Status Serve(NatsClient& nc) {
    auto sub = nc.Subscribe(kComp + "kv_indexer_query.*.*", "", [this, &nc](const IncomingMessage& m) {
      // ...kv_indexer_query.<worker>.<rank>
      const std::string_view s = m.subject;
      const std::size_t rank_dot = s.rfind('.');
      const std::size_t worker_dot = s.rfind('.', rank_dot - 1);
      std::uint64_t worker = 0;
      const std::string_view id = s.substr(worker_dot + 1, rank_dot - worker_dot - 1);
      if (std::from_chars(id.data(), id.data() + id.size(), worker).ec != std::errc() || worker == 0 ||
          worker > pubs_.size())
        return;
      auto parts = EncodeRecoveryReplyParts(pubs_[worker - 1]->Answer(RecoveryQuery::Decode(m.data)), 1 << 20);
      if (!parts.ok()) return;
      ++dumps_;
      for (const auto& part : *parts) (void)nc.Respond(m, AsBytes(part));
    });
    if (!sub.ok()) return sub.status();
    sub_ = std::move(sub).value();
    return Status::Ok();
  }
  void Register(NatsClient& nc) {
    for (std::uint64_t w = 1; w <= pubs_.size(); ++w) {
      const WorkerRegistration r{.worker_id = w, .block_size = kBs, .lease_ms = 600000};
      (void)nc.Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r)));
    }
    (void)nc.Flush(5s);
  }
  std::uint64_t dumps() const { return dumps_.load(); }

 private:
  std::vector<std::unique_ptr<KvEventPublisher>> pubs_;
  std::unique_ptr<Subscription> sub_;
  std::atomic<std::uint64_t> dumps_{0};
};

// Blocks in a replica's index, from its own stats subject (every page); nullopt: no answer.
std::optional<std::uint64_t> IndexedBlocks(NatsClient& nc, std::uint64_t router_id) {
  std::uint64_t total = 0;
  StatsRequest page{.offset = 0, .limit = StatsRequest::kMaxLimit};
  for (;;) {
    auto reply = nc.Request(fmt::format("{}stats.{}", kRouter, router_id), AsBytes(EncodeStatsRequest(page)), 2s);
    if (!reply.ok()) return std::nullopt;
    auto stats = DecodeStatsReply(*reply);
    if (!stats.ok()) return std::nullopt;
    for (const WorkerStats& w : stats->workers) total += w.blocks;
    if (!stats->next_offset) return total;
    page.offset = *stats->next_offset;
  }
}

struct Replica {
  std::unique_ptr<testing::ChildProcess> process;
  int metrics_port = 0;
  Clock::time_point started;
};

Result<Replica> StartReplica(const std::string& nats_url, std::uint64_t id, bool sync) {
  auto port = testing::PickFreePort();
  if (!port.ok()) return port.status();
  std::vector<std::string> argv = {
      KVROUTER_BIN,         "--nats-server",     nats_url,      "--router-mode",    "kv",
      "--block-size",       std::to_string(kBs), "--router-id", std::to_string(id), "--metrics-port",
      std::to_string(*port)};
  if (sync) argv.push_back("--router-replica-sync");
  Replica r{.metrics_port = *port, .started = Clock::now()};
  auto p = testing::ChildProcess::Start(argv, fmt::format("/tmp/warmup_bench_kvrouter_{}.log", id));
  if (!p.ok()) return p.status();
  r.process = std::move(p).value();
  return r;
}

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Seconds from the replica's start until its index holds `want` blocks (nullopt: not within 120 s).
std::optional<double> AwaitComplete(NatsClient& nc, const Replica& r, std::uint64_t id, std::uint64_t want) {
  std::optional<double> at;
  (void)testing::WaitFor(
      [&] {
        auto n = IndexedBlocks(nc, id);
        if (n && *n >= want) at = SecondsSince(r.started);
        return at.has_value();
      },
      120s, 20ms);
  return at;
}

int Run(const Options& o) {
  auto nats = testing::NatsServerProcess::Start();
  if (!nats.ok()) {
    fmt::print(stderr, "nats-server: {}\n", nats.status().ToString());
    return 2;
  }
  const std::string url = (*nats)->url();
  fmt::print("fleet: {} workers x {} blocks (chains of {}), building...\n", o.workers, o.blocks, o.chain);
  Fleet fleet(o);
  auto fleet_nc = NatsClient::Connect({.url = url, .name = "warmup-bench-fleet"}, {});
  auto nc = NatsClient::Connect({.url = url, .name = "warmup-bench"}, {});
  if (!fleet_nc.ok() || !nc.ok() || !fleet.Serve(**fleet_nc).ok()) return 2;
  const std::uint64_t total = o.workers * o.blocks;

  // 1. Replica A learns the fleet from the workers.
  auto a = StartReplica(url, 1, false);
  if (!a.ok()) return 2;
  if (!testing::WaitFor([&] { return IndexedBlocks(**nc, 1).has_value(); }, 10s)) return 2;
  fleet.Register(**fleet_nc);
  const auto a_done = AwaitComplete(**nc, *a, 1, total);
  if (!a_done) {
    fmt::print(stderr, "replica A never held every block\n");
    return 1;
  }
  fmt::print("replica A (cold): complete {:.2f} s after its start, {} worker dumps\n", *a_done, fleet.dumps());

  // 2. Replica C, cold: every worker dumped again.
  std::uint64_t dumps_before = fleet.dumps();
  auto c = StartReplica(url, 3, false);
  if (!c.ok()) return 2;
  if (!testing::WaitFor([&] { return IndexedBlocks(**nc, 3).has_value(); }, 10s)) return 2;
  const double c_subscribed = SecondsSince(c->started);
  fleet.Register(**fleet_nc);  // the fleet's next heartbeat, at once
  const auto c_done = AwaitComplete(**nc, *c, 3, total);
  const std::uint64_t c_dumps = fleet.dumps() - dumps_before;
  c->process->Stop();
  if (!c_done) {
    fmt::print(stderr, "replica C never held every block\n");
    return 1;
  }
  fmt::print("replica C (worker dumps): complete {:.2f} s after its start ({:.2f} s to answer), {} worker dumps\n",
             *c_done, c_subscribed, c_dumps);

  // 3. Replica B warms from A.
  dumps_before = fleet.dumps();
  auto b = StartReplica(url, 2, true);
  if (!b.ok()) return 2;
  std::optional<double> b_ready;
  (void)testing::WaitFor(
      [&] {
        auto r = testing::HttpGet(b->metrics_port, "/ready", 1s);
        if (r.ok() && r->status == 200) b_ready = SecondsSince(b->started);
        return b_ready.has_value();
      },
      120s, 5ms);
  const auto b_done = AwaitComplete(**nc, *b, 2, total);
  const std::uint64_t b_dumps = fleet.dumps() - dumps_before;
  if (!b_ready || !b_done) {
    fmt::print(stderr, "replica B never became ready or complete\n");
    return 1;
  }
  fmt::print("replica B (peer dump): ready {:.2f} s, complete {:.2f} s after its start, {} worker dumps\n", *b_ready,
             *b_done, b_dumps);
  fmt::print("B's start to complete / C's: {:.2f}\n", *b_done / *c_done);
  if (!o.json.empty()) {
    nlohmann::json j = {
        {"workers", o.workers},         {"blocks_per_worker", o.blocks}, {"worker_dumps_complete_s", *c_done},
        {"worker_dumps", c_dumps},      {"peer_ready_s", *b_ready},      {"peer_complete_s", *b_done},
        {"peer_worker_dumps", b_dumps}, {"ratio", *b_done / *c_done}};
    std::ofstream(o.json) << j.dump(2) << "\n";
  }
  return b_dumps == 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvrouter

int main(int argc, char** argv) {
  kvrouter::Options o;
  namespace po = boost::program_options;
  po::options_description desc("warmup_bench");
  desc.add_options()("help", "this text")("workers", po::value(&o.workers)->default_value(o.workers), "worker ranks")(
      "blocks", po::value(&o.blocks)->default_value(o.blocks), "blocks per worker")(
      "chain", po::value(&o.chain)->default_value(o.chain), "blocks per stored chain")("json", po::value(&o.json),
                                                                                       "write the results here");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    po::notify(vm);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n" << desc;
    return 2;
  }
  if (vm.count("help")) {
    std::cout << desc;
    return 0;
  }
  if (o.workers == 0 || o.blocks == 0 || o.chain == 0 || o.blocks % o.chain != 0) {
    std::cerr << "--workers, --blocks and --chain must be positive, --blocks a multiple of --chain\n";
    return 2;
  }
  return kvrouter::Run(o);
}
