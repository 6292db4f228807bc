// KvRouterProcessTest: a real nats-server on a free 127.0.0.1 port, the real `kvrouter` binary
// (KVROUTER_BIN, --router-mode kv, block size kBs, plus ExtraArgs()), and a NATS client that
// acts as workers and clients. Shared by the kvrouter integration test files. One test thread.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "events/block_hash.h"
#include "events/event_codec.h"
#include "events/message_codec.h"
#include "events/msgpack_reader.h"
#include "events/vllm_codec.h"
#include "tests/integration/process.h"
#include "transport/nats_client.h"

namespace kvrouter::testing {

using namespace std::chrono_literals;


inline constexpr std::uint32_t kBs = 4;
inline const std::string kComp = "namespace.dynamo.component.backend.";
inline const std::string kRouter = "namespace.dynamo.router.";

inline std::vector<std::uint32_t> Tokens(std::uint32_t first, std::size_t n) {
  std::vector<std::uint32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = first + static_cast<std::uint32_t>(i);
  return t;
}

class KvRouterProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto nats = NatsServerProcess::Start();
    ASSERT_TRUE(nats.ok()) << nats.status().ToString();
    nats_ = std::move(nats).value();
    log_ = ::testing::TempDir() + "kvrouter-" + std::to_string(nats_->port()) + ".log";
    std::vector<std::string> argv = {KVROUTER_BIN, "--nats-server", nats_->url(), "--router-mode", "kv",
                                     "--block-size", std::to_string(kBs)};
    const std::vector<std::string> extra = ExtraArgs();
    // Many routers run at once under ctest: no metrics port unless a test asks for one.
    if (std::find(extra.begin(), extra.end(), "--metrics-port") == extra.end()) {
      argv.insert(argv.end(), {"--metrics-port", "0"});
    }
    for (auto& a : extra) argv.push_back(a);
    auto router = ChildProcess::Start(argv, log_);
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    router_ = std::move(router).value();
    auto nc = NatsClient::Connect({.url = nats_->url(), .name = "kvrouter-test"}, {});
    ASSERT_TRUE(nc.ok()) << nc.status().ToString();
    nc_ = std::move(nc).value();
    // Ready when the stats endpoint answers.
    ASSERT_TRUE(WaitFor([&] { return nc_->Request(kRouter + "stats", AsBytes(std::string_view("\x80", 1)), 200ms).ok(); }, 10s))
        << "kvrouter did not come up; log: " << log_;
  }

  virtual std::vector<std::string> ExtraArgs() const { return {}; }

  void TearDown() override {
    nc_.reset();
    if (router_) router_->Stop();
  }

  void Register(std::uint64_t id, std::uint32_t lease_ms = 60000, bool leaving = false,
                std::uint32_t block_size = kBs, std::uint32_t max_num_batched_tokens = 8192) {
    WorkerRegistration r{.worker_id = id, .block_size = block_size,
                         .max_num_batched_tokens = max_num_batched_tokens, .lease_ms = lease_ms, .leaving = leaving};
    ASSERT_TRUE(nc_->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r))).ok());
  }

  void StoreDynamo(std::uint64_t worker, std::uint64_t event_id, const std::vector<std::uint32_t>& tokens) {
    const KvEventBatch b = StoredPromptBatch(worker, event_id, tokens, kBs);
    ASSERT_TRUE(nc_->Publish(kComp + "kv-events", AsBytes(EncodeDynamoEnvelope(b, {}))).ok());
  }

  void StoreVllm(std::uint64_t worker, std::uint32_t rank, std::uint64_t kv_seq,
                 const std::vector<std::uint32_t>& tokens) {
    VllmStoredEvent e{.token_ids = tokens, .block_size = kBs};
    for (std::size_t i = 0; i < tokens.size() / kBs; ++i) e.block_hashes.push_back(7000 + i);
    auto body = EncodeVllmBatch(1.0, {e}, rank);
    ASSERT_TRUE(nc_->PublishWithHeaders(kComp + "vllm-kv-events." + std::to_string(worker) + "." + std::to_string(rank),
                                        AsBytes(body), {{"Kv-Seq", std::to_string(kv_seq)}})
                    .ok());
  }

  Result<RouteReply> Route(const std::vector<std::uint32_t>& tokens, std::string request_id = "",
                           std::int64_t priority = 0) {
    RouteRequest r{.request_id = std::move(request_id), .token_ids = tokens, .has_token_ids = true,
                   .isl = static_cast<std::uint32_t>(tokens.size()), .priority = priority};
    auto reply = nc_->Request(kRouter + "route", AsBytes(EncodeRouteRequest(r)), 2s);
    if (!reply.ok()) return reply.status();
    return DecodeRouteReply(*reply);
  }

  std::optional<StatsReply> Stats(StatsRequest page = {}) {
    auto reply = nc_->Request(kRouter + "stats", AsBytes(EncodeStatsRequest(page)), 2s);
    if (!reply.ok()) return std::nullopt;
    auto stats = DecodeStatsReply(*reply);
    return stats.ok() ? std::optional<StatsReply>(std::move(stats).value()) : std::nullopt;
  }
  // Registrations and events arrive on different subscriptions (no order between them).
  bool AwaitWorkers(std::size_t n) {
    return WaitFor([&] { auto s = Stats(); return s && s->workers_total == n; }, 5s);
  }
  bool AwaitEventsApplied(std::uint64_t n) {
    return WaitFor([&] { auto s = Stats(); return s && s->counters.at("events_applied") >= n; }, 5s);
  }

  std::unique_ptr<NatsServerProcess> nats_;
  std::unique_ptr<ChildProcess> router_;
  std::unique_ptr<NatsClient> nc_;
  std::string log_;
};

}  // namespace kvrouter::testing
