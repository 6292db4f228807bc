// router.generate (docs/protocol.md sections 5 and 7): through the service on an in-memory bus
// (GenerateTest: routed, forwarded, relayed, freed, timed out, queued).
#include "router/service/generate_relay.h"

#include <gtest/gtest.h>

#include "events/msgpack_reader.h"
#include "events/worker_codec.h"
#include "tests/router/service/service_fixture.h"
#include "transport/memory_bus.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
using testing::ServiceTest;
using testing::kTwelve;

class GenerateTest : public ServiceTest {
 protected:
  // A fake worker: records what it is asked and answers `responses` times (the last one final).
  void FakeWorker(std::uint64_t id, int responses) {
    worker_subs_.push_back(std::move(bus_.Subscribe(
        "namespace.dynamo.component.backend.generate." + std::to_string(id), "", [this, id, responses](const BusMessage& m) {
          auto req = GenerateRequest::Decode(m.data);
          ASSERT_TRUE(req.ok()) << req.status().ToString();
          seen_.push_back({id, req->request_id, req->max_tokens});
          const std::string reply(m.reply);
          for (int i = 0; i < responses; ++i) {
            GenerateResponse r{.request_id = req->request_id, .token_ids = {7}, .index = static_cast<std::uint32_t>(i)};
            if (i + 1 == responses) r.finish_reason = "length";
            (void)bus_.Publish(reply, AsBytes(r.Encode()));
          }
        })).value());
  }
  // Sends a generate request; every response lands in `got`.
  std::unique_ptr<BusSubscription> Generate(const RouteRequest& r, std::vector<std::vector<std::byte>>& got) {
    const std::string inbox = "client.inbox." + std::to_string(++inboxes_);
    auto sub = std::move(bus_.Subscribe(inbox, "", [&got](const BusMessage& m) { got.emplace_back(m.data.begin(), m.data.end()); })).value();
    (void)bus_.PublishRequest(svc_->subjects().generate, inbox, AsBytes(EncodeRouteRequest(r)));
    return sub;
  }
  struct Seen {
    std::uint64_t worker;
    std::string request_id;
    std::uint32_t max_tokens;
  };
  std::vector<Seen> seen_;
  std::vector<std::unique_ptr<BusSubscription>> worker_subs_;
  int inboxes_ = 0;
};

TEST_F(GenerateTest, ForwardsToTheChosenWorkerRelaysEveryResponseAndFreesAtTheLast) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  FakeWorker(1, 3);
  RouteRequest r = Prompt(kTwelve, "g1");
  r.max_tokens = 7;
  std::vector<std::vector<std::byte>> got;
  auto sub = Generate(r, got);
  ASSERT_EQ(seen_.size(), 1u);
  EXPECT_EQ(seen_[0].request_id, "g1");
  EXPECT_EQ(seen_[0].max_tokens, 7u);
  ASSERT_EQ(got.size(), 3u);
  auto last = ParseMsgpack(got.back());
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(*ReadStr(FindKey(last->get(), "finish_reason"), "finish_reason"), "length");
  EXPECT_EQ(Counter("active_requests"), 0u);
}

TEST_F(GenerateTest, UnfinishedGenerationTimesOutAndReleasesItsBooking) {
  StartWith({"--router-mode", "kv"});
  Register(1, {.lease_ms = 1u << 30});
  // Answers once, never with finish_reason.
  worker_subs_.push_back(std::move(bus_.Subscribe("namespace.dynamo.component.backend.generate.1", "",
                                                  [this](const BusMessage& m) {
                                                    const std::string reply(m.reply);
                                                    (void)bus_.Publish(reply, AsBytes(EncodeOkReply()));
                                                  })).value());
  RouteRequest r = Prompt(kTwelve);  // no request_id: the router names it
  r.timeout_ms = 1000;
  std::vector<std::vector<std::byte>> got;
  auto sub = Generate(r, got);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(Counter("active_requests"), 1u);
  now_ += milliseconds(1000);
  svc_->Tick();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(DecodeErrorReply(got.back()).code(), StatusCode::kTimeout);
  EXPECT_EQ(Counter("active_requests"), 0u);
}

TEST_F(GenerateTest, AWorkerThatKeepsAnsweringIsNotCutOffAtTimeoutMs) {
  StartWith({"--router-mode", "kv"});
  Register(1, {.lease_ms = 1u << 30});
  std::string relay_subject;
  worker_subs_.push_back(std::move(bus_.Subscribe("namespace.dynamo.component.backend.generate.1", "",
                                                  [&](const BusMessage& m) { relay_subject = std::string(m.reply); }))
                             .value());
  RouteRequest r = Prompt(kTwelve, "long");
  r.timeout_ms = 1000;  // at most 1 s without a response
  std::vector<std::vector<std::byte>> got;
  auto sub = Generate(r, got);
  ASSERT_FALSE(relay_subject.empty());
  for (std::uint32_t i = 0; i < 3; ++i) {  // a token every 800 ms: 2.4 s in all
    now_ += milliseconds(800);
    svc_->Tick();
    GenerateResponse token{.request_id = "long", .token_ids = {7}, .index = i};
    (void)bus_.Publish(relay_subject, AsBytes(token.Encode()));
  }
  EXPECT_EQ(got.size(), 3u);  // all relayed, no timeout
  EXPECT_EQ(Counter("active_requests"), 1u);
  now_ += milliseconds(1000);  // then silence
  svc_->Tick();
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(DecodeErrorReply(got.back()).code(), StatusCode::kTimeout);
  EXPECT_EQ(Counter("active_requests"), 0u);
}

TEST_F(GenerateTest, NeedsTokenIds) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  RouteRequest r;
  r.block_hashes = {1, 2};
  r.isl = 8;
  std::vector<std::vector<std::byte>> got;
  auto sub = Generate(r, got);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(DecodeErrorReply(got[0]).code(), StatusCode::kInvalidArgument);
}

TEST_F(GenerateTest, QueuedGenerateIsForwardedOnAdmission) {
  StartWith({"--router-mode", "kv", "--router-queue-threshold", "1"});
  Register(1, {.max_num_batched_tokens = 8});
  FakeWorker(1, 1);
  ASSERT_TRUE(Route(Prompt(kTwelve, "busy")).ok());  // fills worker 1
  std::vector<std::vector<std::byte>> got;
  auto sub = Generate(Prompt(kTwelve, "waiting"), got);
  EXPECT_TRUE(seen_.empty());
  (void)bus_.Request(svc_->subjects().mark_prefill, AsBytes(EncodeLifecycleRequest("busy")));
  ASSERT_EQ(seen_.size(), 1u);
  EXPECT_EQ(seen_[0].request_id, "waiting");
  EXPECT_EQ(got.size(), 1u);
}

}  // namespace
}  // namespace kvrouter
