// A replica started with --router-replica-sync warms its index from a live peer's router.dump
// (docs/protocol.md section 12) on an in-memory bus: the ranks the peer holds are not asked of
// their workers, a rank split across pages comes back whole, live events go on from the peer's
// ids, ranks the peer lacks are asked of their workers, and a lone replica stops waiting.
#include <gtest/gtest.h>

#include "events/subjects.h"
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
  // Replica A (svc_): alone, nobody serves router.dump ("no responders"): ready at once.
  void StartPeer() {
    StartWith({"--router-mode", "kv", "--router-replica-sync", "--router-id", std::to_string(kA)});
    EXPECT_TRUE(svc_->Ready());
    EXPECT_EQ(CounterOf(kA, "warmup_done"), 1u);
    EXPECT_EQ(CounterOf(kA, "warmup_complete"), 0u);
  }
  // Every reply to one router.dump ask of max_parts parts from `offset`.
  std::vector<DumpReply> AskDump(std::uint64_t offset, std::uint32_t max_parts) {
    std::vector<DumpReply> got;
    auto sub = bus_.Subscribe("_TEST.dump", "", [&](const BusMessage& m) {
      auto r = DecodeDumpReply(m.data);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (r.ok()) got.push_back(std::move(r).value());
    });
    const DumpRequest req{.router_id = 7, .offset = offset, .max_parts = max_parts};
    EXPECT_TRUE(bus_.PublishRequest(svc_->subjects().dump, "_TEST.dump", AsBytes(EncodeDumpRequest(req))).ok());
    return got;  // the bus is synchronous: every part came inside PublishRequest
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
  svc_->index().Flush();  // both replicas serve router.dump: each has taken worker 3's dump
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

TEST_F(PeerWarmupTest, AReplicaThatDoesNotAnswerIsWaitedForOneSecond) {
  auto silent = bus_.Subscribe(RouterEndpointSubject("dynamo", router_endpoint::kDump), "", [](const BusMessage&) {});
  ASSERT_TRUE(silent.ok());
  StartWith({"--router-mode", "kv", "--router-replica-sync", "--router-id", std::to_string(kA)});
  EXPECT_FALSE(svc_->Ready());
  now_ += milliseconds(999);
  svc_->Tick();
  EXPECT_FALSE(svc_->Ready());
  now_ += milliseconds(2);
  svc_->Tick();
  EXPECT_TRUE(svc_->Ready());
  EXPECT_EQ(CounterOf(kA, "warmup_complete"), 0u);
}

// A rank larger than a part: an ask of several parts ends only where the rank does; an ask of
// one part ends inside it, and its next_offset (a cursor) goes on from there.
TEST_F(PeerWarmupTest, AnAskOfSeveralPartsEndsAtARanksEndAndOneOfOnePartAtACursor) {
  StartPeer();
  FakeWorker w1(bus_, 1), w2(bus_, 2);
  Register(1);
  Register(2);
  for (std::uint32_t p = 0; p < 6; ++p) w1.Store(PromptTokens(p, 10'000), &bus_);  // about 3 parts
  w2.Store(PromptTokens(7), &bus_);
  svc_->index().Flush();
  std::vector<DumpReply> parts = AskDump(0, 2);
  ASSERT_GE(parts.size(), 3u);  // past max_parts, to the end of worker 1's rank
  std::uint64_t blocks = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    ASSERT_FALSE(parts[i].workers.empty());
    EXPECT_EQ(parts[i].workers.front().worker_id, 1u);
    for (const DumpedChain& c : parts[i].workers.front().chains) blocks += c.stored.blocks.size();
  }
  EXPECT_EQ(blocks, w1.publisher().held_blocks());
  EXPECT_FALSE(parts.back().workers.front().partial);
  // The part past max_parts finishes worker 1's rank and nothing more: worker 2 is the next ask's.
  EXPECT_EQ(parts.back().workers.size(), 1u);
  EXPECT_TRUE(parts.back().more);
  EXPECT_EQ(parts.back().next_offset, 1u);
  EXPECT_EQ(parts.back().next_chain, 0u);
  // One part at a time: each next_offset goes on where the last stopped.
  std::uint64_t offset = 0, one_by_one = 0;
  for (int asks = 0; asks < 10; ++asks) {
    std::vector<DumpReply> one = AskDump(offset, 1);
    ASSERT_EQ(one.size(), 1u);
    for (const DumpedRank& d : one[0].workers) {
      if (d.worker_id != 1) continue;
      for (const DumpedChain& c : d.chains) one_by_one += c.stored.blocks.size();
    }
    if (!one[0].more) break;
    offset = one[0].next_offset;
  }
  EXPECT_EQ(one_by_one, w1.publisher().held_blocks());
}

}  // namespace
}  // namespace kvrouter
