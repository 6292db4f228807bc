// router.generate (docs/protocol.md sections 5 and 7). GenerateRelayTest: the relay on its own,
// on an in-memory bus with a scripted worker, a Routing that books its requests and a clock the
// test moves. GenerateTest: through the service (routed, forwarded, relayed, freed, timed out,
// queued).
#include "router/service/generate_relay.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "events/base/log.h"
#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "events/worker_codec.h"
#include "tests/router/service/service_fixture.h"
#include "transport/memory_bus.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
using testing::kTwelve;
using testing::ServiceTest;

// ---- the relay on its own -----------------------------------------------------------------

class GenerateRelayTest : public ::testing::Test {
 protected:
  static constexpr std::uint64_t kWorker = 1;
  static constexpr const char* kWorkerSubject = "worker.generate.1";

  GenerateRelayTest() {
    EXPECT_EQ(
        registry_.Register({.worker_id = kWorker, .block_size = testing::kBs, .lease_ms = 1u << 30}, now_).outcome,
        WorkerRegistry::Outcome::kNew);
    // The worker records what it is asked and where to answer; the test answers.
    worker_sub_ = std::move(bus_.Subscribe(kWorkerSubject, "", [this](const BusMessage& m) {
                    auto req = GenerateRequest::Decode(m.data);
                    ASSERT_TRUE(req.ok()) << req.status().ToString();
                    asked_.push_back(*req);
                    reply_to_.emplace_back(m.reply);
                  })).value();
    relay_sub_ = std::move(bus_.Subscribe(relay_.subject_pattern(), "", [this](const BusMessage& m) {
                   relay_.OnResponse(m, out_);
                 })).value();
    callers_sub_ = std::move(bus_.Subscribe("caller.>", "", [this](const BusMessage& m) {
                     relayed_[std::string(m.subject)].emplace_back(m.data.begin(), m.data.end());
                   })).value();
  }

  // Routes `id` as router.generate does (booked on the worker) and returns its forward.
  Outbox::Forward Routed(const std::string& id, std::optional<std::uint32_t> timeout_ms = std::nullopt) {
    RouteRequest r;
    r.request_id = id;
    r.token_ids = kTwelve;
    r.has_token_ids = true;
    r.isl = static_cast<std::uint32_t>(kTwelve.size());
    r.timeout_ms = timeout_ms;
    Outbox out;
    routing_.Route(r, Routing::Kind::kGenerate, "caller." + id, out);
    EXPECT_EQ(out.forwards.size(), 1u);
    return out.forwards.empty() ? Outbox::Forward{} : std::move(out.forwards.front());
  }
  // Routes and forwards `id`; returns the subject its worker answers on.
  std::string Forwarded(const std::string& id, std::optional<std::uint32_t> timeout_ms = std::nullopt) {
    Outbox out;
    relay_.Forward(Routed(id, timeout_ms), kWorkerSubject, out);
    EXPECT_TRUE(out.errors.empty());
    return reply_to_.empty() ? "" : reply_to_.back();
  }
  void Respond(const std::string& reply_to, const GenerateResponse& r) {
    ASSERT_TRUE(bus_.Publish(reply_to, AsBytes(r.Encode())).ok());
  }
  static GenerateResponse Token(std::string id, std::uint32_t index) {
    return {.request_id = std::move(id), .token_ids = {7}, .index = index};
  }
  static GenerateResponse Final(std::string id) {
    return {.request_id = std::move(id), .token_ids = {8}, .index = 1, .finish_reason = "length"};
  }
  // The worker's load as routing books it.
  WorkerStats Load() {
    StatsReply r;
    r.workers.push_back({.worker_id = kWorker});
    routing_.FillStats(r);
    return r.workers.at(0);
  }
  std::vector<StatusCode> ErrorCodesTo(const std::string& caller) const {
    std::vector<StatusCode> codes;
    for (const auto& [to, status] : out_.errors) {
      if (to == caller) codes.push_back(status.code());
    }
    return codes;
  }

  InMemoryBus bus_;
  SteadyTime now_{};  // the test's thread alone reads and moves it
  std::vector<std::string> log_lines_;
  RateLimitedLog log_{std::chrono::seconds(10), [this] { return now_; },
                      [this](LogLevel, std::string_view line) { log_lines_.emplace_back(line); }};
  RouterConfig config_ = [] {
    RouterConfig c;
    c.block_size = testing::kBs;
    return c;
  }();
  ShardedIndex index_{{.num_shards = 1}};
  WorkerRegistry registry_{{.block_size = testing::kBs}};
  Routing routing_{config_, registry_, index_, [this] { return now_; }, 7, 1, log_};
  GenerateRelay relay_{bus_, routing_, "_KVR.7.", [this] { return now_; }, log_};
  Outbox out_;  // what the relay's responses left to send (errors)
  std::vector<GenerateRequest> asked_;
  std::vector<std::string> reply_to_;
  std::map<std::string, std::vector<std::vector<std::byte>>> relayed_;  // caller -> bodies
  std::unique_ptr<BusSubscription> worker_sub_, relay_sub_, callers_sub_;
};

TEST_F(GenerateRelayTest, AForwardAsksTheWorkerWithTheRequestAndAReplySubjectOfTheRelays) {
  Outbox::Forward f = Routed("g1");
  f.request.max_tokens = 7;
  Outbox out;
  relay_.Forward(std::move(f), kWorkerSubject, out);
  EXPECT_TRUE(out.errors.empty());
  ASSERT_EQ(asked_.size(), 1u);
  EXPECT_EQ(asked_[0], (GenerateRequest{.request_id = "g1", .token_ids = kTwelve, .max_tokens = 7, .dp_rank = 0}));
  ASSERT_EQ(reply_to_.size(), 1u);
  EXPECT_TRUE(reply_to_[0].starts_with("_KVR.7.")) << reply_to_[0];
  EXPECT_TRUE(InMemoryBus::Matches(relay_.subject_pattern(), reply_to_[0]));
  EXPECT_EQ(relay_.in_flight(), 1u);
}

TEST_F(GenerateRelayTest, MaxTokensDefaultsToTheExpectedOutputThenTo16) {
  Outbox out;
  Outbox::Forward expected = Routed("expected");
  expected.request.expected_output_tokens = 5;
  relay_.Forward(std::move(expected), kWorkerSubject, out);
  relay_.Forward(Routed("neither"), kWorkerSubject, out);
  ASSERT_EQ(asked_.size(), 2u);
  EXPECT_EQ(asked_[0].max_tokens, 5u);
  EXPECT_EQ(asked_[1].max_tokens, 16u);
}

TEST_F(GenerateRelayTest, EachForwardHasItsOwnReplySubjectAndItsResponsesGoToItsOwnCaller) {
  const std::string a = Forwarded("a");
  const std::string b = Forwarded("b");
  EXPECT_NE(a, b);
  Respond(b, Token("b", 0));
  Respond(a, Token("a", 0));
  Respond(a, Final("a"));
  EXPECT_EQ(relayed_["caller.a"].size(), 2u);
  EXPECT_EQ(relayed_["caller.b"].size(), 1u);
  EXPECT_EQ(relay_.in_flight(), 1u);  // b is still generating
}

TEST_F(GenerateRelayTest, ResponsesAreRelayedUnchangedTheFirstEndsThePrefillAndTheFinalFreesTheBooking) {
  const std::string reply_to = Forwarded("g1");
  EXPECT_EQ(Load().active_requests, 1u);
  EXPECT_EQ(Load().active_prefill_tokens, 12u);
  const msgpack::sbuffer first = Token("g1", 0).Encode();
  ASSERT_TRUE(bus_.Publish(reply_to, AsBytes(first)).ok());
  ASSERT_EQ(relayed_["caller.g1"].size(), 1u);
  const auto first_bytes = AsBytes(first);
  EXPECT_EQ(relayed_["caller.g1"][0], std::vector<std::byte>(first_bytes.begin(), first_bytes.end()));
  EXPECT_EQ(Load().active_prefill_tokens, 0u);  // prefill done
  EXPECT_EQ(Load().active_requests, 1u);        // still booked
  Respond(reply_to, Token("g1", 1));
  EXPECT_EQ(Load().active_requests, 1u);
  Respond(reply_to, Final("g1"));
  EXPECT_EQ(relayed_["caller.g1"].size(), 3u);
  EXPECT_EQ(Load().active_requests, 0u);
  EXPECT_EQ(relay_.in_flight(), 0u);
  EXPECT_TRUE(out_.errors.empty());
  // A response after the final one is not relayed.
  Respond(reply_to, Token("g1", 2));
  EXPECT_EQ(relayed_["caller.g1"].size(), 3u);
}

TEST_F(GenerateRelayTest, AFinishedRequestTeachesItsRanksRateWithTheTimesSeenHereAnErrorDoesNot) {
  using std::chrono::milliseconds;
  const std::string a = Forwarded("g1");
  now_ += milliseconds(400);  // four times the prior for a 12-token prompt on an idle rank, about
  Respond(a, Token("g1", 0));
  for (std::uint32_t i = 1; i < 6; ++i) {
    now_ += milliseconds(20);
    Respond(a, Token("g1", i));
  }
  Respond(a, Final("g1"));
  const WorkerStats taught = Load();
  EXPECT_EQ(taught.rate_observations, 1u);
  EXPECT_LT(taught.prefill_tokens_per_second, PrefillTokensPerSecond(1));  // slower than the prior
  EXPECT_GT(taught.decode_step_seconds, DecodeStepSeconds(1));
  // A worker sending several tokens per response is timed per token: 1 + 8 tokens, 80 ms apart.
  const std::string c = Forwarded("g3");
  now_ += milliseconds(100);
  Respond(c, Token("g3", 0));
  now_ += milliseconds(80);
  Respond(c, {.request_id = "g3", .token_ids = {1, 2, 3, 4, 5, 6, 7, 8}, .index = 1, .finish_reason = "length"});
  EXPECT_EQ(Load().rate_observations, 2u);
  // A worker that fails at once must not look fast.
  const std::string b = Forwarded("g2");
  now_ += milliseconds(1);
  Respond(b, {.request_id = "g2", .finish_reason = "error", .message = "boom"});
  EXPECT_EQ(Load().rate_observations, 2u);
  EXPECT_EQ(Load().active_requests, 0u);
}

TEST_F(GenerateRelayTest, AnUndecodableResponseIsRelayedAsItCameAndEndsTheRequest) {
  const std::string reply_to = Forwarded("g1");
  ASSERT_TRUE(bus_.Publish(reply_to, AsBytes(std::string_view("\xc1", 1))).ok());
  ASSERT_EQ(relayed_["caller.g1"].size(), 1u);
  EXPECT_EQ(relayed_["caller.g1"][0], std::vector<std::byte>{std::byte{0xc1}});
  EXPECT_EQ(Load().active_requests, 0u);
  EXPECT_EQ(relay_.in_flight(), 0u);
}

TEST_F(GenerateRelayTest, AWorkerThatIsGoneFreesTheRequestAndItsCallerGetsNoWorkers) {
  Outbox out;
  relay_.Forward(Routed("g1"), "worker.generate.nobody", out);  // NATS answers "no responders"
  EXPECT_TRUE(out.errors.empty());
  EXPECT_EQ(ErrorCodesTo("caller.g1"), std::vector<StatusCode>{StatusCode::kNoWorkers});
  EXPECT_TRUE(relayed_["caller.g1"].empty());  // the empty 503 message is not relayed
  EXPECT_EQ(Load().active_requests, 0u);
  EXPECT_EQ(relay_.in_flight(), 0u);
}

TEST_F(GenerateRelayTest, AForwardThatCannotBePublishedIsReleasedAtOnceWithNoWorkers) {
  bus_.set_max_payload(8);  // the generate request does not fit
  Outbox out;
  relay_.Forward(Routed("g1"), kWorkerSubject, out);
  ASSERT_EQ(out.errors.size(), 1u);
  EXPECT_EQ(out.errors[0].first, "caller.g1");
  EXPECT_EQ(out.errors[0].second.code(), StatusCode::kNoWorkers);
  EXPECT_TRUE(asked_.empty());
  EXPECT_EQ(Load().active_requests, 0u);
  EXPECT_EQ(relay_.in_flight(), 0u);
  EXPECT_EQ(log_lines_.size(), 1u);  // a warning, rate-limited
}

TEST_F(GenerateRelayTest, AWorkerSilentForTimeoutMsIsAbandonedWithTimeoutAndItsLateResponseDropped) {
  const std::string reply_to = Forwarded("g1", 1000);
  now_ += std::chrono::milliseconds(999);
  relay_.Expire(out_);
  EXPECT_TRUE(out_.errors.empty());
  EXPECT_EQ(relay_.in_flight(), 1u);
  now_ += std::chrono::milliseconds(1);
  relay_.Expire(out_);
  EXPECT_EQ(ErrorCodesTo("caller.g1"), std::vector<StatusCode>{StatusCode::kTimeout});
  EXPECT_EQ(Load().active_requests, 0u);
  EXPECT_EQ(relay_.in_flight(), 0u);
  Respond(reply_to, Final("g1"));  // too late
  EXPECT_TRUE(relayed_["caller.g1"].empty());
  EXPECT_EQ(out_.errors.size(), 1u);
}

TEST_F(GenerateRelayTest, EachResponseGivesTheWorkerTimeoutMsAgain) {
  const std::string reply_to = Forwarded("g1", 1000);
  for (std::uint32_t i = 0; i < 3; ++i) {
    now_ += std::chrono::milliseconds(800);
    relay_.Expire(out_);
    Respond(reply_to, Token("g1", i));
  }
  EXPECT_TRUE(out_.errors.empty());
  EXPECT_EQ(relayed_["caller.g1"].size(), 3u);
  now_ += std::chrono::milliseconds(999);
  relay_.Expire(out_);
  EXPECT_TRUE(out_.errors.empty());
  now_ += std::chrono::milliseconds(1);
  relay_.Expire(out_);
  EXPECT_EQ(ErrorCodesTo("caller.g1"), std::vector<StatusCode>{StatusCode::kTimeout});
}

TEST_F(GenerateRelayTest, WithoutTimeoutMsAWorkerHasThreeHundredSeconds) {
  (void)Forwarded("g1");
  now_ += GenerateRelay::kDefaultTimeout - std::chrono::milliseconds(1);
  relay_.Expire(out_);
  EXPECT_EQ(relay_.in_flight(), 1u);
  now_ += std::chrono::milliseconds(1);
  relay_.Expire(out_);
  EXPECT_EQ(relay_.in_flight(), 0u);
  EXPECT_EQ(ErrorCodesTo("caller.g1"), std::vector<StatusCode>{StatusCode::kTimeout});
}

TEST_F(GenerateRelayTest, ResponsesOnSubjectsItNeverHandedOutAreIgnored) {
  (void)Forwarded("g1");
  for (const char* subject : {"_KVR.7.", "_KVR.7.x", "_KVR.7.999", "_KVR.7.-1"}) {
    ASSERT_TRUE(bus_.Publish(subject, AsBytes(Final("g1").Encode())).ok());
  }
  EXPECT_TRUE(relayed_["caller.g1"].empty());
  EXPECT_TRUE(out_.errors.empty());
  EXPECT_EQ(relay_.in_flight(), 1u);
  EXPECT_EQ(Load().active_requests, 1u);
}

// ---- through the service ------------------------------------------------------------------

class GenerateTest : public ServiceTest {
 protected:
  // A fake worker: records what it is asked and answers `responses` times (the last one final).
  void FakeWorker(std::uint64_t id, int responses) {
    worker_subs_.push_back(
        std::move(bus_.Subscribe(WorkerGenerateSubject("dynamo", "backend", id), "",
                                 [this, id, responses](const BusMessage& m) {
                                   auto req = GenerateRequest::Decode(m.data);
                                   ASSERT_TRUE(req.ok()) << req.status().ToString();
                                   seen_.push_back({id, req->request_id, req->max_tokens});
                                   const std::string reply(m.reply);
                                   for (int i = 0; i < responses; ++i) {
                                     GenerateResponse r{.request_id = req->request_id,
                                                        .token_ids = {7},
                                                        .index = static_cast<std::uint32_t>(i)};
                                     if (i + 1 == responses) r.finish_reason = "length";
                                     (void)bus_.Publish(reply, AsBytes(r.Encode()));
                                   }
                                 }))
            .value());
  }
  // Sends a generate request; every response lands in `got`.
  std::unique_ptr<BusSubscription> Generate(const RouteRequest& r, std::vector<std::vector<std::byte>>& got) {
    const std::string inbox = "client.inbox." + std::to_string(++inboxes_);
    auto sub = std::move(bus_.Subscribe(inbox, "", [&got](const BusMessage& m) {
                 got.emplace_back(m.data.begin(), m.data.end());
               })).value();
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

// Section 13: generate forwards one leg, so on a fleet with prefill and decode workers its
// request goes whole to a decode worker (counted local), whatever the policy; nothing is left
// booked on the prefill worker.
TEST_F(GenerateTest, OnADisaggregatedFleetGoesWholeToADecodeWorker) {
  StartWith({"--router-mode", "kv", "--router-disagg-policy", "always"});
  Register(1, {.role = WorkerRole::kPrefill});
  Register(2, {.role = WorkerRole::kDecode});
  FakeWorker(1, 1);
  FakeWorker(2, 1);
  std::vector<std::vector<std::byte>> got;
  auto sub = Generate(Prompt(kTwelve, "g1"), got);
  ASSERT_EQ(seen_.size(), 1u);
  EXPECT_EQ(seen_[0].worker, 2u);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(Counter("active_requests"), 0u);
  EXPECT_EQ(Stats().breakdowns["disagg_decisions"]["local"], 1u);
}

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
  worker_subs_.push_back(
      std::move(bus_.Subscribe(WorkerGenerateSubject("dynamo", "backend", 1), "", [this](const BusMessage& m) {
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
  worker_subs_.push_back(
      std::move(bus_.Subscribe(WorkerGenerateSubject("dynamo", "backend", 1), "", [&](const BusMessage& m) {
        relay_subject = std::string(m.reply);
      })).value());
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
