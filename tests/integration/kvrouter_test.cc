// End-to-end tests of the kvrouter binary: a real nats-server on a free 127.0.0.1 port, the
// real `kvrouter` process, and this test acting as workers (both event formats) and clients.
#include <gtest/gtest.h>

#include <sched.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <sys/wait.h>

#include "events/overlap_scores_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "events/vllm_codec.h"
#include "tests/integration/kvrouter_fixture.h"

namespace kvrouter::testing {
namespace {

TEST_F(KvRouterProcessTest, RoutesByCachedPrefixFromBothEventFormats) {
  for (std::uint64_t id : {1, 2, 3}) Register(id);
  ASSERT_TRUE(AwaitWorkers(3));
  StoreDynamo(2, 1, Tokens(1, 8));      // 2 blocks of prompt A
  StoreVllm(3, 0, 0, Tokens(100, 12));  // 3 blocks of prompt B
  ASSERT_TRUE(AwaitEventsApplied(2));
  auto a = Route(Tokens(1, 12));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->worker_id, 2u);
  EXPECT_EQ(a->overlap_blocks, 2u);
  EXPECT_EQ(a->cached_tokens, 8u);
  EXPECT_EQ(a->request_blocks, 3u);
  auto b = Route(Tokens(100, 16));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->worker_id, 3u);
  EXPECT_EQ(b->overlap_blocks, 3u);
}

// overlap_scores over NATS: 20,000 ranks paged at the largest limit (each page trimmed under
// the max payload), every rank once and in order, with the overlap of the ranks holding the prompt.
TEST_F(KvRouterProcessTest, OverlapScoresPageThroughTwentyThousandRanks) {
  constexpr std::uint64_t kRanks = 20000;
  for (std::uint64_t id = 1; id <= kRanks; ++id) Register(id);
  ASSERT_TRUE(AwaitWorkers(kRanks, 30s));
  std::uint64_t events = 0;
  for (std::uint64_t id = 1000; id <= kRanks; id += 1000) {
    StoreDynamo(id, 1, Tokens(1, id % 3000 == 0 ? 12 : 8));  // 3 blocks on every third, else 2
    ++events;
  }
  ASSERT_TRUE(AwaitEventsApplied(events));
  const OverlapScoresRequest first{.prompt = {.token_ids = Tokens(1, 16), .has_token_ids = true, .isl = 16},
                                   .limit = StatsRequest::kMaxLimit};
  std::uint64_t next_id = 1;
  std::uint64_t pages = 0;
  std::optional<std::uint64_t> offset = 0;
  while (offset) {
    OverlapScoresRequest page = first;
    page.offset = *offset;
    auto reply = nc_->Request(kRouter + "overlap_scores", AsBytes(EncodeOverlapScoresRequest(page)), 5s);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    auto scores = DecodeOverlapScoresReply(*reply);
    ASSERT_TRUE(scores.ok()) << scores.status().ToString();
    ASSERT_EQ(scores->workers_total, kRanks);
    ASSERT_EQ(scores->offset, *offset);
    ASSERT_FALSE(scores->scores.empty());
    for (const RankOverlap& o : scores->scores) {
      ASSERT_EQ(o.worker_id, next_id);
      const std::uint32_t want = o.worker_id % 1000 != 0 ? 0 : o.worker_id % 3000 == 0 ? 3 : 2;
      EXPECT_EQ(o.overlap_blocks, want) << o.worker_id;
      EXPECT_EQ(o.overlap_by_tier.any_tier, want) << o.worker_id;
      ++next_id;
    }
    offset = scores->next_offset;
    ++pages;
  }
  EXPECT_EQ(next_id, kRanks + 1);
  EXPECT_GE(pages, 2u);
}

// A vLLM engine offloads a prompt from GPU to CPU: BlockRemoved on `GPU` and BlockStored on
// `CPU` in one batch. The router keeps crediting it at the host weight: overlap_scores and
// best_worker report it on host, not on device, and it still beats a cold worker.
TEST_F(KvRouterProcessTest, AVllmPromptMovedFromGpuToCpuStaysCreditedAtTheHostWeight) {
  Register(1);
  Register(2);
  ASSERT_TRUE(AwaitWorkers(2));
  StoreVllm(1, 0, 0, Tokens(1, 12));  // engine hashes 7000, 7001, 7002
  ASSERT_TRUE(AwaitEventsApplied(1));
  VllmRemovedEvent gone{.block_hashes = {7000, 7001, 7002}, .medium = "GPU"};
  VllmStoredEvent offloaded{
      .block_hashes = {7000, 7001, 7002}, .token_ids = Tokens(1, 12), .block_size = kBs, .medium = "CPU"};
  ASSERT_TRUE(nc_->PublishWithHeaders(kComp + "vllm-kv-events.1.0", AsBytes(EncodeVllmBatch(2.0, {gone, offloaded}, 0)),
                                      {{"Kv-Seq", "1"}})
                  .ok());
  ASSERT_TRUE(AwaitEventsApplied(3));
  const OverlapScoresRequest q{.prompt = {.token_ids = Tokens(1, 16), .has_token_ids = true, .isl = 16}};
  auto reply = nc_->Request(kRouter + "overlap_scores", AsBytes(EncodeOverlapScoresRequest(q)), 5s);
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  auto scores = DecodeOverlapScoresReply(*reply);
  ASSERT_TRUE(scores.ok()) << scores.status().ToString();
  ASSERT_EQ(scores->scores.size(), 2u);
  EXPECT_EQ(scores->scores[0].overlap_blocks, 0u);
  EXPECT_EQ(scores->scores[0].overlap_by_tier, (OverlapByTier{.device = 0, .host_pinned = 3, .any_tier = 3}));
  EXPECT_EQ(scores->scores[1].overlap_by_tier, (OverlapByTier{}));
  auto best = BestWorker(Tokens(1, 16));
  ASSERT_TRUE(best.ok()) << best.status().ToString();
  EXPECT_EQ(best->worker_id, 1u);  // the host copy beats the cold worker 2
  EXPECT_EQ(best->overlap_blocks, 0u);
  EXPECT_EQ(best->overlap_by_tier, (OverlapByTier{.device = 0, .host_pinned = 3, .any_tier = 3}));
  EXPECT_EQ(Stats()->breakdowns["events_dropped"]["parent_block_not_found"], 0u);
}

// Ingestion yields to routes: the shard threads, the thread delivering Dynamo events, the
// event connection's own threads (its socket reader) and nats.c's message collector run in the
// batch scheduling class; the rest (main, the request connection, the route subscription's
// thread, nats.c's timers, which may start the request connection's reconnect) keep the
// default one.
TEST_F(KvRouterProcessTest, IngestionThreadsRunAsBatchAndTheRequestPathDoesNot) {
  Register(1);
  ASSERT_TRUE(AwaitWorkers(1));
  StoreDynamo(1, 1, Tokens(1, 8));
  ASSERT_TRUE(AwaitEventsApplied(1));
  ASSERT_TRUE(Route(Tokens(1, 12)).ok());
  int batch = 0, other = 0;
  std::multiset<std::string> batch_names;
  const std::string tasks = "/proc/" + std::to_string(router_->pid()) + "/task";
  for (const auto& t : std::filesystem::directory_iterator(tasks)) {
    const int policy = sched_getscheduler(std::stoi(t.path().filename().string()));
    batch += policy == SCHED_BATCH;
    other += policy == SCHED_OTHER;
    std::ifstream comm(t.path() / "comm");
    std::string name;
    if (policy == SCHED_BATCH && std::getline(comm, name)) batch_names.insert(name);
  }
  // 2 shards, 1 event delivery thread, the event connection's reader, nats.c's collector.
  EXPECT_GE(batch, 5);
  EXPECT_GE(other, 3);
  // Named for top -H and perf; the process keeps its own name.
  for (const char* n : {"kv-shard-0", "kv-shard-1", "kv-events"}) EXPECT_EQ(batch_names.count(n), 1u) << n;
  EXPECT_GE(batch_names.count("nats-events"), 1u);
  EXPECT_EQ(batch_names.count("nats-gc"), 1u);
  std::ifstream comm("/proc/" + std::to_string(router_->pid()) + "/comm");
  std::string process;
  std::getline(comm, process);
  EXPECT_EQ(process, "kvrouter");
}

TEST_F(KvRouterProcessTest, BookedLoadSpreadsIdenticalRequestsAndFreeReleasesIt) {
  Register(1);
  Register(2);
  ASSERT_TRUE(AwaitWorkers(2));
  auto first = Route(Tokens(1, 64), "r1");
  auto second = Route(Tokens(1, 64), "r2");
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(first->worker_id, second->worker_id);
  for (const char* id : {"r1", "r2"}) {
    auto reply = nc_->Request(kRouter + "free", AsBytes(EncodeLifecycleRequest(id)), 2s);
    ASSERT_TRUE(reply.ok());
    EXPECT_TRUE(DecodeErrorReply(*reply).ok());
  }
  auto s = Stats();
  ASSERT_TRUE(s);
  EXPECT_EQ(s->counters.at("active_requests"), 0u);
}

TEST_F(KvRouterProcessTest, LeaseExpiresWithin250msOfItsDeadlineAndLeavingIsImmediate) {
  Register(2);
  const auto registered = std::chrono::steady_clock::now();
  // A lease long enough to see the worker even on a loaded 2-core box under ASan.
  Register(1, /*lease_ms=*/1000);
  ASSERT_TRUE(AwaitWorkers(2));
  ASSERT_TRUE(AwaitWorkers(1));
  const auto gone_after = std::chrono::steady_clock::now() - registered;
  EXPECT_GE(gone_after, 1000ms);  // never before its deadline
  // Deadline + 250 ms allowance + polling and scheduling slack (this also runs under ASan).
  EXPECT_LT(gone_after, 1000ms + 250ms + 500ms);
  Register(2, 60000, /*leaving=*/true);
  ASSERT_TRUE(AwaitWorkers(0));
  EXPECT_EQ(Route(Tokens(1, 8)).status().code(), StatusCode::kNoWorkers);
}

TEST_F(KvRouterProcessTest, GarbageOnEverySubjectGetsErrorsAndLeavesTheIndexIntact) {
  Register(1);
  Register(2);
  ASSERT_TRUE(AwaitWorkers(2));
  StoreDynamo(2, 1, Tokens(1, 12));
  ASSERT_TRUE(AwaitEventsApplied(1));
  const std::vector<std::string> junk = {std::string("\xc1", 1), std::string("\x92\x01", 2),
                                         std::string("\xdd\xff\xff\xff\xff", 5), "plain text"};
  for (const auto& j : junk) {
    for (const std::string& s : {kComp + "kv-events", kComp + "vllm-kv-events.2.0", kComp + "vllm-kv-events.a.b",
                                 kComp + "instances", kRouter + "mark_prefill", kRouter + "free"}) {
      ASSERT_TRUE(nc_->Publish(s, AsBytes(j)).ok());
    }
    for (const char* ep : {"route", "best_worker", "free"}) {
      auto reply = nc_->Request(kRouter + ep, AsBytes(j), 2s);
      ASSERT_TRUE(reply.ok()) << ep;
      EXPECT_EQ(DecodeErrorReply(*reply).code(), StatusCode::kInvalidArgument) << ep;
    }
  }
  auto r = Route(Tokens(1, 12));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->worker_id, 2u);
  EXPECT_EQ(r->overlap_blocks, 3u);
  ASSERT_TRUE(router_->Running());
}

TEST_F(KvRouterProcessTest, WorkerWithAnotherBlockSizeIsRefused) {
  Register(1, 60000, false, /*block_size=*/16);
  ASSERT_TRUE(AwaitStats([](const StatsReply& s) { return s.counters.at("workers_refused") == 1; }, 5s));
  EXPECT_EQ(Route(Tokens(1, 8)).status().code(), StatusCode::kNoWorkers);
}

TEST_F(KvRouterProcessTest, SigtermDrainsAndExitsCleanly) {
  router_->Stop();
  ASSERT_TRUE(WIFEXITED(router_->exit_status())) << router_->exit_status();
  EXPECT_EQ(WEXITSTATUS(router_->exit_status()), 0);
}

TEST_F(KvRouterProcessTest, NatsOutageLongerThanALeaseForgetsNothing) {
  Register(2, /*lease_ms=*/1500);
  ASSERT_TRUE(AwaitWorkers(1));
  StoreDynamo(2, 1, Tokens(1, 12));
  ASSERT_TRUE(AwaitEventsApplied(1));
  // The server is gone for longer than the worker's lease: the router hears nobody, and must not
  // conclude that everybody died.
  nats_->Stop();
  std::this_thread::sleep_for(2500ms);  // the outage itself is the scenario, not a wait
  ASSERT_TRUE(nats_->Restart().ok());
  const auto back = std::chrono::steady_clock::now();
  // Within one lease of the router's reconnect, and before the worker says anything: its blocks
  // are all still there.
  std::optional<StatsReply> s;
  ASSERT_TRUE(WaitFor([&] { return (s = Stats()).has_value(); }, 1200ms)) << "router not back";
  EXPECT_EQ(s->workers_total, 1u);
  EXPECT_LT(std::chrono::steady_clock::now() - back, 1500ms);
  auto r = Route(Tokens(1, 12));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->worker_id, 2u);
  EXPECT_EQ(r->overlap_blocks, 3u);
  // Silent for a whole lease after the reconnect, it is forgotten as usual.
  ASSERT_TRUE(AwaitWorkers(0));
}

class KvRouterQueueTest : public KvRouterProcessTest {
 protected:
  std::vector<std::string> ExtraArgs() const override { return {"--router-queue-threshold", "1"}; }
};

// Two workers full above 8 prefill tokens; each 12-token request fills one. Three more wait in
// the router's queue and come out in priority order, one per mark_prefill.
TEST_F(KvRouterQueueTest, QueuedRequestsAreAdmittedInPriorityOrderAsLoadDrops) {
  Register(1, 60000, false, kBs, /*max_num_batched_tokens=*/8);
  Register(2, 60000, false, kBs, 8);
  ASSERT_TRUE(AwaitWorkers(2));
  ASSERT_TRUE(Route(Tokens(1, 12), "r1").ok());
  ASSERT_TRUE(Route(Tokens(1, 12), "r2").ok());

  std::mutex mu;
  std::vector<std::pair<std::string, Result<RouteReply>>> done;
  std::vector<std::thread> clients;
  const std::vector<std::pair<std::string, std::int64_t>> waiting = {{"low", 0}, {"high", 5}, {"mid", 2}};
  for (const auto& [id, prio] : waiting) {
    clients.emplace_back([&, id = id, prio = prio] {
      auto r = Route(Tokens(500, 12), id, prio);
      std::lock_guard g(mu);
      done.emplace_back(id, std::move(r));
    });
    // Arrival order matters only for ties; wait until each is queued before sending the next.
    const std::uint64_t n = clients.size();
    ASSERT_TRUE(AwaitStats([n](const StatsReply& s) { return s.counters.at("queue_length") == n; }, 5s));
  }
  auto admitted = [&](std::size_t n) {
    return WaitFor(
        [&] {
          std::lock_guard g(mu);
          return done.size() >= n;
        },
        5s);
  };
  auto mark_prefill = [&](const std::string& id) {
    ASSERT_TRUE(nc_->Request(kRouter + "mark_prefill", AsBytes(EncodeLifecycleRequest(id)), 2s).ok());
  };
  mark_prefill("r1");
  ASSERT_TRUE(admitted(1));
  mark_prefill("r2");
  ASSERT_TRUE(admitted(2));
  mark_prefill("high");
  ASSERT_TRUE(admitted(3));
  for (auto& t : clients) t.join();
  ASSERT_EQ(done.size(), 3u);
  EXPECT_EQ(done[0].first, "high");
  EXPECT_EQ(done[1].first, "mid");
  EXPECT_EQ(done[2].first, "low");
  for (auto& [id, r] : done) {
    ASSERT_TRUE(r.ok()) << id << ": " << r.status().ToString();
    EXPECT_GT(r->queued_ms, 0.0) << id;
  }
  auto s = Stats();
  ASSERT_TRUE(s);
  EXPECT_EQ(s->counters.at("queue_admitted"), 3u);
  EXPECT_EQ(s->counters.at("queue_length"), 0u);
}

class KvRouterApproxTest : public KvRouterProcessTest {
 protected:
  std::vector<std::string> ExtraArgs() const override { return {"--no-router-kv-events"}; }
};

TEST_F(KvRouterApproxTest, IgnoresEventsAndKeepsRepeatedPrefixesOnOneWorker) {
  for (std::uint64_t id : {1, 2, 3}) Register(id);
  ASSERT_TRUE(AwaitWorkers(3));
  StoreDynamo(3, 1, Tokens(1, 12));  // not subscribed: must not steer anything
  ASSERT_TRUE(nc_->Flush(2s).ok());
  auto first = Route(Tokens(1, 12), "a");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->overlap_blocks, 0u);
  ASSERT_TRUE(nc_->Request(kRouter + "free", AsBytes(EncodeLifecycleRequest("a")), 2s).ok());
  for (int i = 0; i < 4; ++i) {
    const std::string id = "b" + std::to_string(i);
    auto r = Route(Tokens(1, 16), id);  // the same prefix, one block longer
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->worker_id, first->worker_id);
    // The first longer prompt finds the 3 predicted blocks and adds its 4th.
    EXPECT_EQ(r->overlap_blocks, i == 0 ? 3u : 4u);
    ASSERT_TRUE(nc_->Request(kRouter + "free", AsBytes(EncodeLifecycleRequest(id)), 2s).ok());
  }
  auto s = Stats();
  ASSERT_TRUE(s);
  EXPECT_EQ(s->counters.at("events_applied"), 0u);
  EXPECT_EQ(s->counters.at("predicted_blocks"), 4u);
}

}  // namespace
}  // namespace kvrouter::testing
