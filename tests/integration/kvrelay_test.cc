// kvrelay end to end: a fake vLLM engine on real ZMQ sockets (docs/protocol.md section 9), the real
// kvrelay and kvrouter binaries and a real nats-server. What the engine stores, removes and
// clears reaches the router's index; a batch the relay never got is replayed; an engine restart
// clears; without a replay socket a lost batch clears the rank; SIGTERM says `leaving` at once.
// With --engine-url (an HttpListener in this process stands in for the engine's HTTP face) the
// registration carries the URL and models, and follows the engine's GET /health: `leaving` when
// it stops answering, `up` again, with a fresh cache, when it answers again.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>

#include "events/base/clock.h"
#include "events/registration_codec.h"
#include "events/router_endpoints_codec.h"
#include "transport/http_io.h"
#include "transport/http_listener.h"

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
  // kvrelay on a fresh fake engine (its ZMQ sockets), with `extra` flags; waits for its
  // registration unless told not to.
  void StartRelay(bool with_replay, std::vector<std::string> extra = {}, bool await_registration = true) {
    engine_ = std::make_unique<FakeVllmEngine>(with_replay);
    std::vector<std::string> args = {"--zmq-endpoint", engine_->endpoint(), "--worker-id", std::to_string(kWorker)};
    args.insert(args.end(),
                {"--block-size", std::to_string(kBs), "--total-kv-blocks", "1000", "--heartbeat-ms", "100"});
    if (with_replay) args.insert(args.end(), {"--zmq-replay-endpoint", engine_->replay_endpoint()});
    if (std::find(extra.begin(), extra.end(), "--lease-ms") == extra.end()) {
      args.insert(args.end(), {"--lease-ms", "2000"});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    auto relay = StartOnNats(KVRELAY_BIN, nats_->url(), std::move(args), LogPath("kvrelay"), Metrics::kOnFreePort);
    ASSERT_TRUE(relay.ok()) << relay.status().ToString();
    relay_ = std::move(relay->process);
    relay_metrics_port_ = relay->metrics_port;
    if (await_registration) {
      ASSERT_TRUE(AwaitWorkers(1)) << "kvrelay never registered";
    }
  }
  // A counter of kvrelay's /metrics (with its labels, e.g. `x{to="up"}`); -1 when absent.
  long RelayCounter(const std::string& series) {
    auto m = HttpGet(relay_metrics_port_, "/metrics");
    if (!m.ok()) return -1;
    const auto at = m->body.find("\n" + series + " ");
    return at == std::string::npos ? -1 : std::stol(m->body.substr(at + series.size() + 2));
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

// Multimodal items through kvrelay (protocol.md section 12): vLLM's extra_keys name the image
// of a block; the relay hashes it into that block, so a route with the image as an mm_item
// matches the whole prompt and one without it only the block before the image.
TEST_F(KvRelayProcessTest, AnImageInExtraKeysIsPartOfTheBlocksHash) {
  StartRelay(true);
  VllmStoredEvent a = StoredPrompt(100, 3, 5000);
  const std::string image(64, 'd');
  a.extra_keys = {{}, {image}, {}};
  RouteRequest with_image{.token_ids = a.token_ids, .has_token_ids = true};
  with_image.isl = static_cast<std::uint32_t>(a.token_ids.size());
  with_image.mm_items = {{.hash = MmItemHash(image), .offset = kBs, .length = kBs}};
  auto overlap = [&](const RouteRequest& req) {
    auto r = RequestRoute("best_worker", EncodeRouteRequest(req));
    return r.ok() && r->worker_id == kWorker ? r->overlap_blocks : 0u;
  };
  ASSERT_TRUE(WaitFor(
      [&] {
        engine_->Publish({a});
        return overlap(with_image) == 3;
      },
      10s, 200ms));
  EXPECT_EQ(Overlap(a.token_ids), 1u);
  with_image.mm_items[0].hash = MmItemHash("another image");
  EXPECT_EQ(overlap(with_image), 1u);
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
  EXPECT_GE(RelayCounter("kvrelay_batches_replayed_total"), 1) << m->body;
  EXPECT_GE(RelayCounter("kvrelay_batches_replayed_total"), RelayCounter("kvrelay_gaps_total")) << m->body;
  EXPECT_EQ(RelayCounter("kvrelay_gaps_unrepaired_total"), 0) << m->body;
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

// The HTTP face of an engine as kvrelay sees it: GET /health answered 200 on 127.0.0.1, until
// Stop; Start again on the same port (the engine back, as a restarted engine comes back).
class EngineHealthStandIn {
 public:
  ~EngineHealthStandIn() {
    Stop();
    io_.Stop();
  }
  // On `port` (0: a free one); false when the port is not free (yet).
  bool Start(std::uint16_t port = 0) {
    auto l = HttpListener::Start(io_, {.host = "127.0.0.1", .port = port},
                                 [this](HttpRequest req, std::shared_ptr<HttpReply> reply) {
                                   if (req.Path() == "/health") ++health_checks_;
                                   reply->Send(req.Path() == "/health" ? 200 : 404, {}, "");
                                 });
    if (!l.ok()) return false;
    listener_ = std::move(l).value();
    port_ = listener_->port();
    return true;
  }
  void Stop() {
    if (listener_) listener_->Stop();
    listener_.reset();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::uint16_t port() const { return port_; }
  int health_checks() const { return health_checks_.load(); }

 private:
  HttpIo io_{1};
  std::unique_ptr<HttpListener> listener_;
  std::uint16_t port_ = 0;
  std::atomic<int> health_checks_{0};
};

// Registrations of kWorker as they reach this test, in order.
class Registrations {
 public:
  MessageHandler Handler() {
    return [this](const IncomingMessage& m) {
      auto reg = DecodeWorkerRegistration(m.data);
      if (!reg.ok() || reg->worker_id != kWorker) return;
      std::lock_guard g(mu_);
      regs_.push_back(std::move(reg).value());
    };
  }
  std::vector<WorkerRegistration> Snapshot() const {
    std::lock_guard g(mu_);
    return regs_;
  }
  // The number of `leaving` ones, and of `up` ones after the last `leaving`.
  std::size_t Leaving() const {
    std::lock_guard g(mu_);
    return std::count_if(regs_.begin(), regs_.end(), [](const WorkerRegistration& r) { return r.leaving; });
  }
  std::size_t UpSinceLastLeaving() const {
    std::lock_guard g(mu_);
    std::size_t n = 0;
    for (const WorkerRegistration& r : regs_) n = r.leaving ? 0 : n + 1;
    return n;
  }

 private:
  mutable std::mutex mu_;
  std::vector<WorkerRegistration> regs_;
};

class KvRelayEngineTest : public KvRelayProcessTest {
 protected:
  void SetUp() override {
    KvRelayProcessTest::SetUp();
    if (HasFatalFailure()) return;
    auto sub = nc_->Subscribe(kComp + "instances", "", regs_.Handler());
    ASSERT_TRUE(sub.ok()) << sub.status().ToString();
    sub_ = std::move(sub).value();
    ASSERT_TRUE(nc_->Flush(2s).ok());
  }
  void TearDown() override {
    sub_.reset();
    KvRelayProcessTest::TearDown();
  }
  // kvrelay watching `http`, checking every 100 ms, down after 2 failures. The lease is long, so
  // that only `leaving` can make the router forget the worker.
  void StartWatchingRelay() {
    StartRelay(true,
               {"--engine-url", http_.url(), "--model", "llama", "--model", "qwen,mistral", "--health-interval-ms",
                "100", "--health-failures", "2", "--lease-ms", "600000"},
               /*await_registration=*/false);
  }

  EngineHealthStandIn http_;
  Registrations regs_;
  std::unique_ptr<Subscription> sub_;
};

TEST_F(KvRelayEngineTest, TheRegistrationCarriesTheEnginesUrlAndModels) {
  ASSERT_TRUE(http_.Start());
  StartWatchingRelay();
  ASSERT_TRUE(AwaitWorkers(1)) << ReadFile(relay_->log_path());
  const std::vector<WorkerRegistration> regs = regs_.Snapshot();
  ASSERT_FALSE(regs.empty());
  EXPECT_FALSE(regs.front().leaving);
  EXPECT_EQ(regs.front().http_url, http_.url());
  EXPECT_EQ(regs.front().models, (std::vector<std::string>{"llama", "qwen", "mistral"}));
  EXPECT_GE(http_.health_checks(), 1);
  auto r = BestWorker(Tokens(1, 8));  // the router hands the URL on
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->worker_id, kWorker);
  EXPECT_EQ(r->http_url, http_.url());
}

TEST_F(KvRelayEngineTest, AnEngineThatStopsAnsweringLeavesAndComesBackAfresh) {
  ASSERT_TRUE(http_.Start());
  StartWatchingRelay();
  ASSERT_TRUE(AwaitWorkers(1)) << ReadFile(relay_->log_path());
  const VllmStoredEvent before = StoredPrompt(100, 3, 5000);
  ASSERT_TRUE(PublishUntilIndexed(before, 3));

  // The engine dies: `leaving`, and the router forgets the worker (its lease has minutes to go).
  http_.Stop();
  engine_->Restart();  // what the engine knew is gone with it
  ASSERT_TRUE(WaitFor([&] { return regs_.Leaving() == 1; }, 10s)) << ReadFile(relay_->log_path());
  EXPECT_TRUE(AwaitWorkers(0));
  const std::size_t regs_when_down = regs_.Snapshot().size();
  EXPECT_EQ(RelayCounter("kvrelay_engine_transitions_total{to=\"down\"}"), 1);
  EXPECT_EQ(RelayCounter("kvrelay_engine_up"), 0);
  // No heartbeat while it is down: the relay's checks go on, its registrations do not.
  const int checks = http_.health_checks();
  ASSERT_TRUE(WaitFor([&] { return RelayCounter("kvrelay_engine_health_checks_total") >= checks + 5; }, 10s));
  EXPECT_EQ(regs_.Snapshot().size(), regs_when_down);

  // It comes back on the same port: `up` again, and the router knows the worker again with none
  // of the old cache.
  ASSERT_TRUE(WaitFor([&] { return http_.Start(http_.port()); }, 10s)) << "port " << http_.port() << " stays taken";
  ASSERT_TRUE(WaitFor([&] { return regs_.UpSinceLastLeaving() >= 1; }, 10s)) << ReadFile(relay_->log_path());
  EXPECT_TRUE(AwaitWorkers(1));
  EXPECT_EQ(regs_.Snapshot().back().http_url, http_.url());
  const VllmStoredEvent after = StoredPrompt(400, 2, 8000);
  ASSERT_TRUE(PublishUntilIndexed(after, 2));
  EXPECT_EQ(Overlap(before.token_ids), 0u);
  EXPECT_EQ(RelayCounter("kvrelay_engine_transitions_total{to=\"up\"}"), 2);
  EXPECT_EQ(RelayCounter("kvrelay_engine_transitions_total{to=\"down\"}"), 1);
  EXPECT_EQ(RelayCounter("kvrelay_engine_up"), 1);
}

TEST_F(KvRelayEngineTest, ABadEngineUrlIsRefusedAtStart) {
  auto relay = StartOnNats(KVRELAY_BIN, nats_->url(),
                           {"--zmq-endpoint", "tcp://127.0.0.1:5557", "--worker-id", "1", "--block-size", "4",
                            "--engine-url", "http://127.0.0.1:8001/v1", "--model", "m"},
                           LogPath("kvrelay-bad-url"));
  ASSERT_TRUE(relay.ok()) << relay.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return !relay->process->Running(); }, 10s));
  EXPECT_TRUE(WIFEXITED(relay->process->exit_status()));
  EXPECT_EQ(WEXITSTATUS(relay->process->exit_status()), 2);
  EXPECT_NE(ReadFile(relay->process->log_path()).find("--engine-url"), std::string::npos);
}

}  // namespace
}  // namespace kvrouter::testing
