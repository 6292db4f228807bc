// ServiceTest: a KvRouterService on an InMemoryBus with a fake clock, and the client calls its
// tests make (register, store a prompt, route, stats). Shared by the service's test files.
// Single-threaded: the bus delivers synchronously on the test's thread.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "events/event_codec.h"
#include "events/overlap_scores_codec.h"
#include "events/registration_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "router/service/kv_router_service.h"
#include "transport/memory_bus.h"

namespace kvrouter::testing {

inline constexpr std::uint32_t kBs = 4;

class ServiceTest : public ::testing::Test {
 protected:
  // `event_bus`: the service's event connection (the test's bus when null).
  void StartWith(std::vector<std::string> flags, MessageBus* event_bus = nullptr) {
    std::vector<const char*> argv = {"kvrouter", "--block-size", "4"};
    for (auto& f : flags) argv.push_back(f.c_str());
    auto cfg = ParseRouterConfig(static_cast<int>(argv.size()), argv.data(), [](const char*) { return nullptr; });
    ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
    svc_ = std::make_unique<KvRouterService>(
        cfg->config, bus_, [this] { return now_.now(); }, 42, event_bus);
    ASSERT_TRUE(svc_->Start().ok());
  }

  void Register(std::uint64_t id, WorkerRegistration reg = {}) {
    reg.worker_id = id;
    if (!reg.block_size) reg.block_size = kBs;
    (void)bus_.Publish(svc_->subjects().instances, AsBytes(EncodeWorkerRegistration(reg)));
  }

  // Stores the prompt's full blocks on worker `id` as one Dynamo event, then waits until applied.
  void StorePrompt(std::uint64_t id, std::uint64_t event_id, std::vector<std::uint32_t> tokens) {
    const KvEventBatch b = StoredPromptBatch(id, event_id, tokens, kBs);
    (void)bus_.Publish(svc_->subjects().kv_events, AsBytes(EncodeDynamoEnvelope(b, {})));
    svc_->index().Flush();
  }

  Result<RouteReply> Route(RouteRequest req, bool best_worker = false) {
    auto reply = bus_.Request(best_worker ? svc_->subjects().best_worker : svc_->subjects().route,
                              AsBytes(EncodeRouteRequest(req)));
    if (!reply) return Internal("no reply");
    return DecodeRouteReply(*reply);
  }

  static RouteRequest Prompt(std::vector<std::uint32_t> tokens, std::string id = "") {
    RouteRequest r;
    r.request_id = std::move(id);
    r.token_ids = std::move(tokens);
    r.has_token_ids = true;
    r.isl = static_cast<std::uint32_t>(r.token_ids.size());
    return r;
  }

  // The stats reply, decoded by the one stats decoder (events/router_endpoints_codec.h).
  StatsReply Stats(StatsRequest page = {}) {
    auto reply = bus_.Request(svc_->subjects().stats, AsBytes(EncodeStatsRequest(page)));
    EXPECT_TRUE(reply.has_value());
    if (!reply) return {};
    auto stats = DecodeStatsReply(*reply);
    EXPECT_TRUE(stats.ok()) << stats.status().ToString();
    return stats.ok() ? std::move(stats).value() : StatsReply{};
  }
  // One page of overlap_scores for the prompt.
  Result<OverlapScoresReply> OverlapScoresOf(RouteRequest prompt, std::uint64_t offset = 0,
                                             std::uint32_t limit = StatsRequest::kDefaultLimit) {
    const OverlapScoresRequest req{.prompt = std::move(prompt), .offset = offset, .limit = limit};
    auto reply = bus_.Request(svc_->subjects().overlap_scores, AsBytes(EncodeOverlapScoresRequest(req)));
    if (!reply) return Internal("no reply");
    return DecodeOverlapScoresReply(*reply);
  }
  std::uint64_t Counter(std::string_view name) {
    StatsReply s = Stats();
    auto it = s.counters.find(std::string(name));
    EXPECT_NE(it, s.counters.end()) << name;
    return it == s.counters.end() ? ~0ull : it->second;
  }
  std::uint64_t Dropped(std::string_view reason) { return Stats().breakdowns["events_dropped"][std::string(reason)]; }

  InMemoryBus bus_;
  // The tests' clock: advanced by the test thread, read by the service's threads too (a shard
  // asking for a recovery reads it), so an atomic underneath.
  class FakeClock {
   public:
    FakeClock& operator+=(SteadyTime::duration d) {
      ticks_ += d.count();
      return *this;
    }
    SteadyTime now() const { return SteadyTime(SteadyTime::duration(ticks_.load())); }

   private:
    std::atomic<SteadyTime::rep> ticks_{0};
  };
  FakeClock now_;
  std::unique_ptr<KvRouterService> svc_;
};

inline const std::vector<std::uint32_t> kTwelve = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};

}  // namespace kvrouter::testing
