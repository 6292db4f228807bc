// A replica started with --router-replica-sync warms its index from a live peer's router.dump
// (docs/protocol.md section 12) on an in-memory bus: the ranks the peer holds are not asked of
// their workers, a rank split across pages comes back whole, live events go on from the peer's
// ids, ranks the peer lacks are asked of their workers, and a lone replica stops waiting.
#include <gtest/gtest.h>

#include "events/worker_codec.h"
#include "tests/router/service/fake_worker.h"
#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
using testing::FakeWorker;
using testing::kBs;
using testing::PromptTokens;

class PeerWarmupTest : public testing::ServiceTest {
 protected:
  static constexpr std::uint64_t kA = 1001, kB = 1002;
  // Replica A (svc_): alone, nobody answers its warm-up; a second later it asks the workers.
  void StartPeer() {
    StartWith({"--router-mode", "kv", "--router-replica-sync", "--router-id", std::to_string(kA)});
    EXPECT_FALSE(svc_->Ready());
    now_ += milliseconds(1100);
    svc_->Tick();
    EXPECT_TRUE(svc_->Ready());
    EXPECT_EQ(CounterOf(kA, "warmup_complete"), 0u);
  }
  // Another replica, on the same bus and clock.
  std::unique_ptr<KvRouterService> StartReplica(std::uint64_t id) {
    const std::string id_flag = std::to_string(id);
    const char* argv[] = {"kvrouter", "--block-size",          "4",           "--router-mode",
                          "kv",       "--router-replica-sync", "--router-id", id_flag.c_str()};
    auto cfg = ParseRouterConfig(8, argv, [](const char*) { return nullptr; });
    EXPECT_TRUE(cfg.ok());
    auto r = std::make_unique<KvRouterService>(
        cfg->config, bus_, [this] { return now_.now(); }, id);
    EXPECT_TRUE(r->Start().ok());
    r->index().Flush();
    return r;
  }
  // A counter of the replica `id` (its own stats subject).
  std::uint64_t CounterOf(std::uint64_t id, const std::string& name) {
    auto reply = bus_.Request(fmt::format("{}.{}", svc_->subjects().stats, id), AsBytes(EncodeStatsRequest({})));
    EXPECT_TRUE(reply.has_value());
    if (!reply) return ~0ull;
    auto stats = DecodeStatsReply(*reply);
    EXPECT_TRUE(stats.ok());
    return stats.ok() ? stats->counters.at(name) : ~0ull;
  }
};

TEST_F(PeerWarmupTest, AReplicaWarmsFromAPeerAndAsksNoWorkerThePeerCovers) {
  StartPeer();
  FakeWorker w1(bus_, 1), w2(bus_, 2);
  Register(1);
  Register(2);
  svc_->index().Flush();
  // Worker 1 holds more than a 1 MiB page can carry (about 25,000 blocks a page).
  for (std::uint32_t p = 0; p < 4; ++p) w1.Store(PromptTokens(p, 10'000), &bus_);
  w2.Store(PromptTokens(7), &bus_);
  svc_->index().Flush();
  ASSERT_EQ(svc_->index().TreeSize({1, 0}), w1.publisher().held_blocks());
  const std::uint64_t a_dumps = CounterOf(kA, "recovery_dumps");

  std::unique_ptr<KvRouterService> b = StartReplica(kB);
  EXPECT_TRUE(b->Ready());  // on a synchronous bus the whole dump came inside Start
  EXPECT_EQ(b->index().TreeSize({1, 0}), w1.publisher().held_blocks());
  EXPECT_EQ(b->index().TreeSize({2, 0}), w2.publisher().held_blocks());
  EXPECT_EQ(CounterOf(kB, "warmup_complete"), 1u);
  EXPECT_EQ(CounterOf(kB, "warmup_peer"), kA);
  EXPECT_GE(CounterOf(kB, "warmup_pages"), 2u);
  EXPECT_EQ(CounterOf(kB, "recovery_dumps"), 0u);  // no worker was asked
  EXPECT_GE(CounterOf(kA, "dump_pages_served"), 2u);
  EXPECT_EQ(CounterOf(kA, "recovery_dumps"), a_dumps);

  // The workers' next heartbeats and events: nothing asked, the events follow on.
  Register(1);
  Register(2);
  w1.Store(PromptTokens(9), &bus_);
  b->index().Flush();
  EXPECT_EQ(b->index().TreeSize({1, 0}), w1.publisher().held_blocks());
  EXPECT_EQ(CounterOf(kB, "recovery_dumps"), 0u);
  EXPECT_EQ(b->index().Counters().gaps, 0u);
  // A worker the peer never knew is asked as before.
  FakeWorker w3(bus_, 3);
  w3.Store(PromptTokens(11), nullptr);  // from before either replica listened
  Register(3);
  b->index().Flush();
  EXPECT_EQ(CounterOf(kB, "recovery_dumps"), 1u);
  EXPECT_EQ(b->index().TreeSize({3, 0}), w3.publisher().held_blocks());
  // And B, warm, serves the next replica in turn.
  std::unique_ptr<KvRouterService> c = StartReplica(1003);
  EXPECT_EQ(c->index().TreeSize({1, 0}), w1.publisher().held_blocks());
  EXPECT_EQ(c->index().TreeSize({3, 0}), w3.publisher().held_blocks());
}

TEST_F(PeerWarmupTest, ARankThePeerIsStillRecoveringIsAskedOfItsWorker) {
  StartPeer();
  FakeWorker w1(bus_, 1);
  w1.set_answer(false);  // A's first-sight dump of worker 1 hangs
  w1.Store(PromptTokens(1), nullptr);
  Register(1);
  svc_->index().Flush();
  std::unique_ptr<KvRouterService> b = StartReplica(kB);
  EXPECT_TRUE(b->Ready());
  EXPECT_EQ(b->index().TreeSize({1, 0}), 0u);
  w1.set_answer(true);
  Register(1);  // B's first sight of the worker: asked, since the peer could not say
  b->index().Flush();
  EXPECT_EQ(b->index().TreeSize({1, 0}), w1.publisher().held_blocks());
  EXPECT_EQ(CounterOf(kB, "recovery_dumps"), 1u);
}

}  // namespace
}  // namespace kvrouter
