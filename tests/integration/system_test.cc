// The whole system in processes: nats-server, kvrouter and kvmocker on a free 127.0.0.1 port,
// with this test as the client of router.generate.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>

#include "events/message_codec.h"
#include "events/msgpack_reader.h"
#include "events/worker_codec.h"
#include "tests/integration/process.h"
#include "transport/nats_client.h"

namespace kvrouter {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::NatsServerProcess;
using testing::WaitFor;

class SystemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto nats = NatsServerProcess::Start();
    ASSERT_TRUE(nats.ok()) << nats.status().ToString();
    nats_ = std::move(nats).value();
    const std::string tag = std::to_string(nats_->port());
    auto router = ChildProcess::Start({KVROUTER_BIN, "--nats-server", nats_->url(), "--router-mode", "kv"},
                                      ::testing::TempDir() + "system-kvrouter-" + tag + ".log");
    ASSERT_TRUE(router.ok());
    router_ = std::move(router).value();
    auto mocker = ChildProcess::Start({KVMOCKER_BIN, "--nats-server", nats_->url(), "--num-workers", "3",
                                       "--num-gpu-blocks", "1024", "--speedup-ratio", "50", "--worker-id-base", "10"},
                                      ::testing::TempDir() + "system-kvmocker-" + tag + ".log");
    ASSERT_TRUE(mocker.ok());
    mocker_ = std::move(mocker).value();
    auto nc = NatsClient::Connect({.url = nats_->url(), .name = "system-test", .send_asap = true}, {});
    ASSERT_TRUE(nc.ok());
    nc_ = std::move(nc).value();
    ASSERT_TRUE(WaitFor([&] { return RouterWorkers() == 3; }, 15s)) << "workers never registered";
  }
  void TearDown() override {
    nc_.reset();
    if (mocker_) mocker_->Stop();
    if (router_) router_->Stop();
  }

  std::optional<StatsReply> Stats() {
    auto reply = nc_->Request("namespace.dynamo.router.stats", AsBytes(EncodeStatsRequest({})), 500ms);
    if (!reply.ok()) return std::nullopt;
    auto stats = DecodeStatsReply(*reply);
    return stats.ok() ? std::optional<StatsReply>(std::move(stats).value()) : std::nullopt;
  }
  std::size_t RouterWorkers() {
    auto s = Stats();
    return s ? s->workers_total : 0;
  }
  std::uint64_t ActiveRequests() {
    auto s = Stats();
    return s ? s->counters.at("active_requests") : ~0ull;
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
    RouteRequest req{.request_id = id, .token_ids = tokens, .has_token_ids = true,
                     .isl = static_cast<std::uint32_t>(tokens.size()), .max_tokens = 8};
    EXPECT_TRUE(nc_->PublishRequest("namespace.dynamo.router.generate", inbox, AsBytes(EncodeRouteRequest(req))).ok());
    std::unique_lock lk(mu);
    EXPECT_TRUE(cv.wait_for(lk, 10s, [&] { return final; })) << id;
    return got;
  }

  std::unique_ptr<NatsServerProcess> nats_;
  std::unique_ptr<ChildProcess> router_, mocker_;
  std::unique_ptr<NatsClient> nc_;
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
  ASSERT_TRUE(WaitFor([&] {
    auto second = Generate("turn-2-" + std::to_string(++probes), prompt);
    return !second.empty() && second.back().cached_tokens >= 640;
  }, 10s));
  ASSERT_TRUE(WaitFor([&] { return ActiveRequests() == 0; }, 5s));  // every booking freed
}

}  // namespace
}  // namespace kvrouter
