// Many routers on many NATS servers (the faults issue): a 3-node nats-server cluster on loopback,
// three kvrouter replicas (queue group `kvrouter`, --router-replica-sync) each on its own node,
// kvmocker workers, and kvbench replaying the shared trace through router.generate with retries.
// Mid-replay one router is killed with SIGKILL and one NATS node dies. Afterwards: every request
// was answered (retries allowed, and counted), no booking is left on a surviving replica, and the
// survivors know the workers' caches alike.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "tests/integration/kvrouter_fixture.h"

namespace kvrouter::testing {
namespace {

constexpr int kNodes = 3;
constexpr std::size_t kRequests = 240;
constexpr int kWorkers = 4;

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<int> cluster_ports;
    for (int i = 0; i < kNodes; ++i) {
      auto p = PickFreePort();
      ASSERT_TRUE(p.ok());
      cluster_ports.push_back(*p);
    }
    for (int i = 0; i < kNodes; ++i) {
      std::string routes;
      for (int j = 0; j < kNodes; ++j) {
        if (j == i) continue;
        routes += std::string(routes.empty() ? "" : ",") + fmt::format("nats://127.0.0.1:{}", cluster_ports[j]);
      }
      auto node =
          NatsServerProcess::Start(0, {"--cluster_name", "kvrouter-test", "--cluster",
                                       fmt::format("nats://127.0.0.1:{}", cluster_ports[i]), "--routes", routes});
      ASSERT_TRUE(node.ok()) << node.status().ToString();
      nodes_.push_back(std::move(node).value());
    }
    tag_ = std::to_string(nodes_[0]->port());
    // The test's client sits on node 2, which survives.
    auto nc = NatsClient::Connect({.url = nodes_[1]->url(), .name = "cluster-test"}, {});
    ASSERT_TRUE(nc.ok()) << nc.status().ToString();
    nc_ = std::move(nc).value();
    ASSERT_TRUE(WaitFor([&] { return ClusterFormed(); }, 15s)) << "the three nodes never formed a cluster";
  }

  void TearDown() override {
    nc_.reset();
    for (auto& r : routers_) {
      if (r) r->Stop();
    }
    if (mocker_) mocker_->Stop();
  }

  std::string Log(const std::string& what) const {
    return ::testing::TempDir() + "cluster-" + what + "-" + tag_ + ".log";
  }

  // A message published on each node reaches a subscriber on every other node.
  bool ClusterFormed() {
    std::atomic<int> got{0};
    std::vector<std::unique_ptr<NatsClient>> clients;
    std::vector<std::unique_ptr<Subscription>> subs;
    const std::string subject = "cluster.probe." + tag_;
    for (auto& n : nodes_) {
      auto c = NatsClient::Connect({.url = n->url(), .name = "probe"}, {});
      if (!c.ok()) return false;
      auto s = (*c)->Subscribe(subject, "", [&](const IncomingMessage&) { ++got; });
      if (!s.ok() || !(*c)->Flush(1s).ok()) return false;
      subs.push_back(std::move(s).value());
      clients.push_back(std::move(c).value());
    }
    for (auto& c : clients) (void)c->Publish(subject, AsBytes(std::string_view("x")));
    for (auto& c : clients) (void)c->Flush(1s);
    const bool all = WaitFor([&] { return got.load() == kNodes * kNodes; }, 500ms);
    subs.clear();
    return all;
  }

  void StartRouter(int i) {
    auto r = StartOnNats(KVROUTER_BIN, nodes_[i]->url(),
                         {"--router-mode", "kv", "--router-replica-sync", "--router-id", std::to_string(i + 1)},
                         Log(fmt::format("kvrouter{}", i + 1)));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    routers_.push_back(std::move(r->process));
  }

  // Replica `id`'s own stats (router.stats.<id>).
  StatsClient ReplicaStats(int id) {
    return StatsClient(*nc_, {.subject = kRouter + "stats." + std::to_string(id), .timeout = 1s});
  }
  // Every page of them, the workers of all in one reply.
  std::optional<StatsReply> Stats(int id) {
    std::optional<StatsReply> all;
    std::optional<std::uint64_t> next = 0;
    while (next) {
      auto s = ReplicaStats(id).Get({.offset = *next});
      if (!s) return std::nullopt;
      next = s->next_offset;
      if (!all) {
        all = std::move(s).value();
      } else {
        all->workers.insert(all->workers.end(), s->workers.begin(), s->workers.end());
      }
    }
    return all;
  }
  std::uint64_t Routed(int id) {
    auto s = Stats(id);
    if (!s) return 0;
    std::uint64_t n = 0;
    for (const auto& [mode, count] : s->breakdowns["routed"]) n += count;
    return n;
  }
  // Cached blocks per worker as replica `id` knows them.
  std::map<std::uint64_t, std::uint64_t> Blocks(int id) {
    std::map<std::uint64_t, std::uint64_t> out;
    if (auto s = Stats(id)) {
      for (const WorkerStats& w : s->workers) out[w.worker_id] += w.blocks;
    }
    return out;
  }

  std::vector<std::unique_ptr<NatsServerProcess>> nodes_;
  std::vector<std::unique_ptr<ChildProcess>> routers_;
  std::unique_ptr<ChildProcess> mocker_;
  std::unique_ptr<NatsClient> nc_;
  std::string tag_;
};

TEST_F(ClusterTest, ARouterAndANatsNodeKilledMidReplayLoseNoRequestAndLeakNoBooking) {
  for (int i = 0; i < kNodes; ++i) StartRouter(i);
  for (int id = 1; id <= kNodes; ++id) {
    ASSERT_TRUE(WaitFor([&] { return Stats(id).has_value(); }, 15s)) << "replica " << id << " never answered";
  }
  // The workers live on node 3; kvbench and replica 1 on node 1, which will die.
  auto mocker = StartOnNats(KVMOCKER_BIN, nodes_[2]->url(),
                            {"--num-workers", std::to_string(kWorkers), "--num-gpu-blocks", "4096", "--speedup-ratio",
                             "20", "--worker-id-base", "100"},
                            Log("kvmocker"));
  ASSERT_TRUE(mocker.ok()) << mocker.status().ToString();
  mocker_ = std::move(mocker->process);
  for (int id = 1; id <= kNodes; ++id) {
    ASSERT_TRUE(WaitFor([&] { return Blocks(id).size() == kWorkers; }, 15s)) << "replica " << id;
  }

  const std::string json = Log("kvbench") + ".json";
  std::vector<std::string> bench = {KVBENCH_BIN,
                                    "--nats-server",
                                    nodes_[0]->url(),
                                    "--max-requests",
                                    std::to_string(kRequests),
                                    "--concurrency",
                                    "32",
                                    "--request-timeout",
                                    "10",
                                    "--retries",
                                    "5",
                                    "--timeout",
                                    "120",
                                    "--label",
                                    "cluster",
                                    "--json",
                                    json};
  if (std::filesystem::exists(KVROUTER_TRACE)) {
    bench.insert(bench.end(), {"--trace", KVROUTER_TRACE, "--speedup", "8"});
  } else {  // a checkout without the shared trace: the synthetic conversations
    bench.insert(bench.end(), {"--synthetic", "--sessions", "60", "--turns", "4", "--rate", "16"});
  }
  auto replay = ChildProcess::Start(bench, Log("kvbench"));
  ASSERT_TRUE(replay.ok());

  // Mid-replay: replica 3 dies with SIGKILL, then node 1 (kvbench's and replica 1's server).
  ASSERT_TRUE(WaitFor([&] { return Routed(1) + Routed(2) + Routed(3) >= kRequests / 3; }, 60s)) << "the replay stalled";
  routers_[2]->Kill();
  nodes_[0]->Stop();

  ASSERT_TRUE(WaitFor([&] { return !(*replay)->Running(); }, 150s)) << "kvbench did not finish";
  EXPECT_EQ((*replay)->exit_status(), 0) << "kvbench log: " << Log("kvbench");
  std::ifstream in(json);
  ASSERT_TRUE(in) << json;
  const auto report = nlohmann::json::parse(in);
  EXPECT_EQ(report.at("requests").get<std::size_t>(), kRequests);
  EXPECT_EQ(report.at("errors").get<std::size_t>(), 0u) << "every request is answered, after retries";
  const std::size_t retries = report.at("retries").get<std::size_t>();
  RecordProperty("retries", static_cast<int>(retries));
  std::printf("kvbench: %zu requests, %zu retries\n", kRequests, retries);

  // No booking leaked on the survivors: the dead replica's are released once its heartbeats
  // stop, and relays cut off by the lost node end at the request's timeout.
  for (int id : {1, 2}) {
    EXPECT_TRUE(ReplicaStats(id).Await([](const StatsReply& s) { return s.counters.at("active_requests") == 0; }, 30s))
        << "replica " << id << " still holds bookings";
  }
  auto s2 = Stats(2);
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->counters.at("replica_peers_dead"), 1u);  // replica 3, and only it
  // Both survivors know every worker's cache, and know it alike (replica 1 missed the events
  // sent while its node was gone and recovered them with dumps).
  EXPECT_TRUE(WaitFor(
      [&] {
        auto a = Blocks(1), b = Blocks(2);
        return a.size() == kWorkers && a == b &&
               std::all_of(a.begin(), a.end(), [](const auto& w) { return w.second > 0; });
      },
      20s))
      << "replica 1 and 2 disagree on the caches";
}

}  // namespace
}  // namespace kvrouter::testing
