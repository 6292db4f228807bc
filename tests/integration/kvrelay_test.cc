// kvrelay end to end: a fake vLLM engine on real ZMQ sockets (docs/protocol.md section 9), the real
// kvrelay and kvrouter binaries and a real nats-server. What the engine stores, removes and
// clears reaches the router's index; a batch the relay never got is replayed; an engine restart
// clears; without a replay socket a lost batch clears the rank.
#include <gtest/gtest.h>

#include <signal.h>

#include <mutex>
#include <optional>

#include "events/base/clock.h"
#include "events/message_codec.h"

#include "tests/integration/fake_vllm_engine.h"
#include "tests/integration/kvrouter_fixture.h"

namespace kvrouter::testing {
namespace {

constexpr std::uint64_t kWorker = 77;

// One stored event: the prompt `first..first+4n-1` as n blocks of kBs tokens, engine hashes
// `hash`, `hash`+1, ...
VllmStoredEvent StoredPrompt(std::uint32_t first, std::size_t blocks, std::uint64_t hash) {
  VllmStoredEvent e{.token_ids = Tokens(first, blocks * kBs), .block_size = kBs};
  for (std::size_t i = 0; i < blocks; ++i) e.block_hashes.push_back(hash + i);
  return e;
}

class KvRelayProcessTest : public KvRouterProcessTest {
 protected:
  void StartRelay(bool with_replay) {
    engine_ = std::make_unique<FakeVllmEngine>(with_replay);
    std::vector<std::string> args = {"--zmq-endpoint",    engine_->endpoint(),
                                     "--worker-id",       std::to_string(kWorker),
                                     "--block-size",      std::to_string(kBs),
                                     "--total-kv-blocks", "1000",
                                     "--heartbeat-ms",    "100",
                                     "--lease-ms",        "2000"};
    if (with_replay) args.insert(args.end(), {"--zmq-replay-endpoint", engine_->replay_endpoint()});
    auto relay = StartOnNats(KVRELAY_BIN, nats_->url(), std::move(args), LogPath("kvrelay"), Metrics::kOnFreePort);
    ASSERT_TRUE(relay.ok()) << relay.status().ToString();
    relay_ = std::move(relay->process);
    relay_metrics_port_ = relay->metrics_port;
    ASSERT_TRUE(AwaitWorkers(1)) << "kvrelay never registered";
  }
  void TearDown() override {
    if (relay_) relay_->Stop();
    KvRouterProcessTest::TearDown();
  }

  // The overlap the router credits worker kWorker with for `tokens`.
  std::uint32_t Overlap(const std::vector<std::uint32_t>& tokens) {
    auto r = BestWorker(tokens);
    return r.ok() && r->worker_id == kWorker ? r->overlap_blocks : 0;
  }
  // The ZMQ subscription connects in the background: publish until the router shows `tokens`
  // (an early batch the relay missed comes back by replay, or is lost without one).
  bool PublishUntilIndexed(const VllmStoredEvent& e, std::uint32_t blocks) {
    return WaitFor(
        [&] {
          engine_->Publish({e});
          return Overlap(e.token_ids) == blocks;
        },
        10s, 200ms);
  }

  std::unique_ptr<FakeVllmEngine> engine_;
  std::unique_ptr<ChildProcess> relay_;
  int relay_metrics_port_ = 0;
};

TEST_F(KvRelayProcessTest, StoredRemovedAndClearedReachTheRouter) {
  StartRelay(true);
  const VllmStoredEvent a = StoredPrompt(100, 3, 5000);
  ASSERT_TRUE(PublishUntilIndexed(a, 3));
  engine_->Publish({VllmRemovedEvent{.block_hashes = {5002}}});
  EXPECT_TRUE(WaitFor([&] { return Overlap(a.token_ids) == 2; }, 5s));
  engine_->Publish({VllmClearedEvent{}});
  EXPECT_TRUE(WaitFor([&] { return Overlap(a.token_ids) == 0; }, 5s));
}

TEST_F(KvRelayProcessTest, ABatchTheRelayNeverGotIsReplayed) {
  StartRelay(true);
  ASSERT_TRUE(PublishUntilIndexed(StoredPrompt(100, 2, 5000), 2));
  const VllmStoredEvent lost = StoredPrompt(200, 4, 6000);
  engine_->Publish({lost}, /*deliver=*/false);
  const VllmStoredEvent next = StoredPrompt(300, 2, 7000);
  engine_->Publish({next});  // reveals the gap
  EXPECT_TRUE(WaitFor([&] { return Overlap(next.token_ids) == 2; }, 5s));
  EXPECT_EQ(Overlap(lost.token_ids), 4u);
  auto m = HttpGet(relay_metrics_port_, "/metrics");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  // The lost batch was replayed. A slow ZMQ subscriber can also miss the first publish of
  // PublishUntilIndexed (the relay then replays from seq 0 too), so: at least one batch
  // replayed per gap, and no gap left unrepaired.
  auto counter = [&](const std::string& name) -> long {
    const auto at = m->body.find("\n" + name + " ");
    return at == std::string::npos ? -1 : std::stol(m->body.substr(at + name.size() + 2));
  };
  EXPECT_GE(counter("kvrelay_batches_replayed_total"), 1) << m->body;
  EXPECT_GE(counter("kvrelay_batches_replayed_total"), counter("kvrelay_gaps_total")) << m->body;
  EXPECT_EQ(counter("kvrelay_gaps_unrepaired_total"), 0) << m->body;
}

TEST_F(KvRelayProcessTest, AnEngineRestartClearsTheRank) {
  StartRelay(true);
  const VllmStoredEvent before = StoredPrompt(100, 2, 5000);
  ASSERT_TRUE(PublishUntilIndexed(before, 2));
  engine_->Restart();  // seq 0 again, an empty cache
  const VllmStoredEvent after = StoredPrompt(400, 2, 8000);
  engine_->Publish({after});
  EXPECT_TRUE(WaitFor([&] { return Overlap(after.token_ids) == 2; }, 5s));
  EXPECT_EQ(Overlap(before.token_ids), 0u);
}

TEST_F(KvRelayProcessTest, WithoutAReplaySocketALostBatchClearsTheRank) {
  StartRelay(false);
  const VllmStoredEvent a = StoredPrompt(100, 2, 5000);
  ASSERT_TRUE(PublishUntilIndexed(a, 2));
  const VllmStoredEvent lost = StoredPrompt(200, 2, 6000);
  engine_->Publish({lost}, /*deliver=*/false);
  const VllmStoredEvent next = StoredPrompt(300, 2, 7000);
  engine_->Publish({next});
  EXPECT_TRUE(WaitFor([&] { return Overlap(next.token_ids) == 2; }, 5s));
  EXPECT_EQ(Overlap(a.token_ids), 0u);     // cleared: the router no longer trusts it
  EXPECT_EQ(Overlap(lost.token_ids), 0u);  // and never learned this one
}

TEST_F(KvRelayProcessTest, SigtermSaysLeaving) {
  StartRelay(true);
  relay_->Stop();
  EXPECT_EQ(relay_->exit_status(), 0);
  EXPECT_TRUE(AwaitWorkers(0));  // forgotten at once, not after the lease
}

// Regression: SIGTERM while the relay waited for a replay the engine never answered published
// `leaving` only when that wait ran out (2 s), so the router kept routing to a relay on its way out.
TEST_F(KvRelayProcessTest, SigtermDuringAReplaySaysLeavingAtOnce) {
  StartRelay(true);
  ASSERT_TRUE(PublishUntilIndexed(StoredPrompt(100, 2, 5000), 2));
  std::mutex mu;
  std::optional<SteadyTime> leaving_at;  // when the `leaving` registration reached this test
  auto sub = nc_->Subscribe(kComp + "instances", "", [&](const IncomingMessage& m) {
    auto reg = DecodeWorkerRegistration(m.data);
    if (!reg.ok() || reg->worker_id != kWorker || !reg->leaving) return;
    std::lock_guard g(mu);
    if (!leaving_at) leaving_at = std::chrono::steady_clock::now();
  });
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();
  ASSERT_TRUE(nc_->Flush(2s).ok());

  engine_->MuteReplays();
  const int asked = engine_->replay_requests();
  engine_->Publish({StoredPrompt(200, 2, 6000)}, /*deliver=*/false);
  engine_->Publish({StoredPrompt(300, 2, 7000)});  // reveals the gap: the relay asks, nothing comes
  ASSERT_TRUE(WaitFor([&] { return engine_->replay_requests() > asked; }, 5s)) << "the relay never asked";

  const SteadyTime signalled = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(relay_->pid(), SIGTERM), 0);
  ASSERT_TRUE(WaitFor(
      [&] {
        std::lock_guard g(mu);
        return leaving_at.has_value();
      },
      5s))
      << "no `leaving` registration";
  {
    std::lock_guard g(mu);
    EXPECT_LT(*leaving_at - signalled, 500ms);
  }
  EXPECT_TRUE(AwaitWorkers(0));
  relay_->Stop();  // reaps it
  EXPECT_EQ(relay_->exit_status(), 0);
}

}  // namespace
}  // namespace kvrouter::testing
