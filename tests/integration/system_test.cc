// The whole system in processes: nats-server, kvrouter and kvmocker on a free 127.0.0.1 port,
// with this test as the client of router.generate.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <thread>
#include <map>
#include <mutex>

#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "events/worker_codec.h"
#include "tests/integration/kvrouter_fixture.h"

namespace kvrouter::testing {
namespace {

// kvmocker's default block size, which the router is given too: the prompts below count their
// blocks in it (640 tokens: 10 blocks).
constexpr std::uint32_t kBlockSize = 64;

class SystemTest : public KvRouterProcessTest {
 protected:
  std::uint32_t RouterBlockSize() const override { return kBlockSize; }
  void SetUp() override {
    KvRouterProcessTest::SetUp();
    if (HasFatalFailure()) return;
    auto mocker = StartOnNats(
        KVMOCKER_BIN, nats_->url(),
        {"--num-workers", "3", "--num-gpu-blocks", "1024", "--speedup-ratio", "50", "--worker-id-base", "10"},
        LogPath("system-kvmocker"));
    ASSERT_TRUE(mocker.ok()) << mocker.status().ToString();
    mocker_ = std::move(mocker->process);
    ASSERT_TRUE(AwaitWorkers(3, 15s)) << "workers never registered";
  }
  void TearDown() override {
    if (mocker_) mocker_->Stop();
    KvRouterProcessTest::TearDown();
  }

  std::size_t RouterWorkers() {
    auto s = Stats();
    return s ? s->workers_total : 0;
  }
  std::uint64_t ActiveRequests() {
    auto s = Stats();
    return s ? s->counters.at("active_requests") : ~0ull;
  }
  // What the router credits for a prompt: (worker, overlap) from best_worker; {0, 0} without
  // an answer.
  std::pair<std::uint64_t, std::uint32_t> Decision(const std::vector<std::uint32_t>& tokens) {
    auto r = BestWorker(tokens);
    return r.ok() ? std::make_pair(r->worker_id, r->overlap_blocks) : std::make_pair(std::uint64_t{0}, 0u);
  }

  // Sends one generate request and collects its responses until the final one.
  std::vector<GenerateResponse> Generate(const std::string& id, const std::vector<std::uint32_t>& tokens) {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<GenerateResponse> got;
    bool final = false;
    const std::string inbox = "_TEST." + id;
    auto sub = nc_->Subscribe(inbox, "", [&](const IncomingMessage& m) {
      auto r = GenerateResponse::Decode(m.data);
      std::lock_guard g(mu);
      if (!r.ok()) {
        final = true;  // an error reply
      } else {
        final = r->is_final();
        got.push_back(std::move(r).value());
      }
      cv.notify_all();
    });
    EXPECT_TRUE(sub.ok());
    RouteRequest req{.request_id = id,
                     .token_ids = tokens,
                     .has_token_ids = true,
                     .isl = static_cast<std::uint32_t>(tokens.size()),
                     .max_tokens = 8};
    EXPECT_TRUE(nc_->PublishRequest(kRouter + "generate", inbox, AsBytes(EncodeRouteRequest(req))).ok());
    std::unique_lock lk(mu);
    EXPECT_TRUE(cv.wait_for(lk, 10s, [&] { return final; })) << id;
    return got;
  }

  std::unique_ptr<ChildProcess> mocker_;
};

TEST_F(SystemTest, GenerateStreamsThroughTheRouterAndTheSecondTurnHitsTheCache) {
  std::vector<std::uint32_t> prompt(640);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::uint32_t>(i * 7 + 3);
  auto first = Generate("turn-1", prompt);
  ASSERT_GE(first.size(), 2u);
  EXPECT_EQ(first.back().finish_reason, std::optional<std::string>("length"));
  EXPECT_EQ(first.back().prompt_tokens, 640u);
  EXPECT_EQ(first.back().cached_tokens, 0u);
  // The router learns the cache from the worker's events; the next turn extends the prompt.
  prompt.resize(1024, 5);
  int probes = 0;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto second = Generate("turn-2-" + std::to_string(++probes), prompt);
        return !second.empty() && second.back().cached_tokens >= 640;
      },
      10s));
  ASSERT_TRUE(WaitFor([&] { return ActiveRequests() == 0; }, 5s));  // every booking freed
}

TEST_F(SystemTest, RouterKilledAndStartedAgainKnowsEveryCacheBeforeAnyNewEvent) {
  std::vector<std::vector<std::uint32_t>> prompts;
  for (std::uint32_t p = 0; p < 6; ++p) {
    std::vector<std::uint32_t> t(640);
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::uint32_t>(p * 10000 + i * 3 + 1);
    prompts.push_back(std::move(t));
    ASSERT_FALSE(Generate("warm-" + std::to_string(p), prompts.back()).empty());
  }
  ASSERT_TRUE(WaitFor([&] { return ActiveRequests() == 0; }, 5s));
  // What the router knew before it died: blocks per worker, and its decision for every prompt.
  std::map<std::uint64_t, std::uint64_t> blocks_before;
  ASSERT_TRUE(AwaitStats(
      [&](const StatsReply& s) {
        blocks_before.clear();
        std::uint64_t total = 0;
        for (const WorkerStats& w : s.workers) total += blocks_before[w.worker_id] = w.blocks;
        return total >= 6 * 10;  // every prompt's 10 blocks are indexed
      },
      5s));
  std::vector<std::pair<std::uint64_t, std::uint32_t>> decisions;
  for (const auto& p : prompts) decisions.push_back(Decision(p));

  router_->Kill();  // kill -9: nothing saved, nothing said
  StartRouter();
  // Up again, and recovered from the workers' dumps (no new traffic meanwhile).
  ASSERT_TRUE(AwaitStats(
      [](StatsReply& s) {
        return s.workers_total == 3 && s.counters["recovery_dumps"] >= 3 && s.counters["recoveries_in_flight"] == 0 &&
               s.counters["recoveries_waiting"] == 0;
      },
      15s));
  auto s = Stats();
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->counters.at("recoveries_failed"), 0u);
  std::map<std::uint64_t, std::uint64_t> blocks_after;
  for (const WorkerStats& w : s->workers) blocks_after[w.worker_id] = w.blocks;
  EXPECT_EQ(blocks_after, blocks_before);
  for (std::size_t p = 0; p < prompts.size(); ++p) {
    EXPECT_EQ(Decision(prompts[p]), decisions[p]) << "prompt " << p;
  }
}

// A second replica started with --router-replica-sync learns every cache from the running one's
// router.dump, asks no worker for a dump, and only then reports /ready.
TEST_F(SystemTest, ASecondReplicaWarmsFromTheFirstAndAsksNoWorkerBeforeItIsReady) {
  for (std::uint32_t p = 0; p < 6; ++p) {
    std::vector<std::uint32_t> t(640);
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::uint32_t>(p * 10000 + i * 3 + 1);
    ASSERT_FALSE(Generate("fill-" + std::to_string(p), t).empty());
  }
  ASSERT_TRUE(WaitFor([&] { return ActiveRequests() == 0; }, 5s));
  std::map<std::uint64_t, std::uint64_t> first_blocks;
  std::uint64_t first_id = 0;
  ASSERT_TRUE(AwaitStats(
      [&](const StatsReply& s) {
        first_blocks.clear();
        std::uint64_t total = 0;
        for (const WorkerStats& w : s.workers) total += first_blocks[w.worker_id] = w.blocks;
        first_id = s.counters.at("router_id");
        return total >= 6 * 10;
      },
      5s));

  auto second = StartOnNats(
      KVROUTER_BIN, nats_->url(),
      {"--router-mode", "kv", "--block-size", std::to_string(kBlockSize), "--router-replica-sync", "--router-id", "77"},
      LogPath("system-second-router"), Metrics::kOnFreePort);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  const int port = second->metrics_port;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto ready = HttpGet(port, "/ready");
        return ready.ok() && ready->status == 200;
      },
      15s))
      << ReadFile(LogPath("system-second-router"));
  // Ready: its index is the first replica's already, from the peer's dump and no worker's.
  const StatsClient own(*nc_, {.subject = kRouter + "stats.77"});
  auto s = own.Get();
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->counters.at("warmup_complete"), 1u);
  EXPECT_EQ(s->counters.at("warmup_peer"), first_id);
  EXPECT_EQ(s->counters.at("recovery_dumps"), 0u);
  std::map<std::uint64_t, std::uint64_t> second_blocks;
  for (const WorkerStats& w : s->workers) second_blocks[w.worker_id] = w.blocks;
  EXPECT_EQ(second_blocks, first_blocks);
  EXPECT_EQ(s->workers_total, 3u);
  second->process->Stop();
}

TEST_F(SystemTest, NatsRestartUnderLoadLosesNoCacheAndLeaksNoBooking) {
  std::vector<std::uint32_t> warm(640);
  for (std::size_t i = 0; i < warm.size(); ++i) warm[i] = static_cast<std::uint32_t>(i * 5 + 2);
  ASSERT_FALSE(Generate("warm", warm).empty());
  ASSERT_TRUE(WaitFor([&] { return Decision(warm).second == 10; }, 5s));
  const auto before = Decision(warm);
  const std::uint64_t dumps_before = Stats().value().counters["recovery_dumps"];
  // Load: generate requests, each given 3 s, sent without pause from another thread; those that
  // meet the outage fail, the rest must go through.
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::thread load([&] {
    auto client = NatsClient::Connect({.url = nats_->url(), .name = "load", .send_asap = true}, {});
    if (!client.ok()) return;
    for (int i = 0; !stop; ++i) {
      std::vector<std::uint32_t> t(256);
      for (std::size_t k = 0; k < t.size(); ++k) t[k] = static_cast<std::uint32_t>(i * 1000 + k);
      RouteRequest r{.request_id = "load-" + std::to_string(i),
                     .token_ids = t,
                     .has_token_ids = true,
                     .isl = 256,
                     .timeout_ms = 3000,
                     .max_tokens = 4};
      (void)(*client)->PublishRequest(kRouter + "generate", "_LOAD." + std::to_string(i),
                                      AsBytes(EncodeRouteRequest(r)));
      ++sent;
      std::this_thread::sleep_for(5ms);  // a steady request rate, not a wait for a condition
    }
  });
  ASSERT_TRUE(WaitFor([&] { return sent.load() > 50; }, 5s));
  nats_->Stop();
  std::this_thread::sleep_for(1s);  // the outage itself
  ASSERT_TRUE(nats_->Restart().ok());
  ASSERT_TRUE(WaitFor([&] { return Stats().has_value(); }, 5s));
  const int resumed = sent.load();
  ASSERT_TRUE(WaitFor([&] { return sent.load() > resumed + 100; }, 10s));
  stop = true;
  load.join();
  // Every worker was dumped again after the reconnect, the cache from before is still known,
  // and every booking ends (answered, or freed by its 3 s timeout).
  ASSERT_TRUE(AwaitStats(
      [&](StatsReply& s) {
        return s.counters["recovery_dumps"] >= dumps_before + 3 && s.counters["recoveries_in_flight"] == 0;
      },
      10s));
  // Asked of the worker that held it before, the router still credits the whole prefix there.
  // (Which worker it would choose now may differ: the outage slowed the responses it learned
  // worker speeds from.)
  RouteRequest pinned{.token_ids = warm, .has_token_ids = true, .isl = static_cast<std::uint32_t>(warm.size())};
  pinned.allowed_worker_ids = std::vector<std::uint64_t>{before.first};
  auto again = RequestRoute("best_worker", EncodeRouteRequest(pinned));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(std::make_pair(again->worker_id, again->overlap_blocks), before);
  EXPECT_TRUE(WaitFor([&] { return ActiveRequests() == 0; }, 10s)) << ActiveRequests() << " bookings left";
  EXPECT_EQ(RouterWorkers(), 3u);
}

}  // namespace
}  // namespace kvrouter::testing
