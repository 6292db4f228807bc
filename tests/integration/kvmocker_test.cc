// Tests of the real `kvmocker` binary against a real nats-server on a free 127.0.0.1 port, with
// this test acting as the router and client: registrations, generate streams, KV events in both
// formats, recovery, shutdown. (Its flag parsing: tests/router/kvmocker/config_test.cc.)
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>

#include "events/block_hash.h"
#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "events/msgpack_reader.h"
#include "events/vllm_codec.h"
#include "events/worker_codec.h"
#include "router/engine/mock_engine.h"
#include "tests/integration/kvrouter_fixture.h"

namespace kvrouter::testing {
namespace {

// ---------------------------------------------------------------------------------------------
// The kvmocker process.

constexpr std::uint64_t kBase = 1000;  // worker ids 1000, 1001

struct Received {
  std::string subject;
  std::vector<std::byte> data;
  std::optional<std::string> kv_seq;
};

// Messages from one subscription, copied out of the handler.
class Inbox {
 public:
  MessageHandler Handler() {
    return [this](const IncomingMessage& m) {
      std::lock_guard g(mu_);
      messages_.push_back({std::string(m.subject), {m.data.begin(), m.data.end()}, m.Header("Kv-Seq")});
    };
  }
  std::vector<Received> Snapshot() const {
    std::lock_guard g(mu_);
    return messages_;
  }
  std::size_t size() const {
    std::lock_guard g(mu_);
    return messages_.size();
  }

 private:
  mutable std::mutex mu_;
  std::vector<Received> messages_;
};

class KvMockerProcessTest : public NatsServerTest {
 protected:
  void SetUp() override {
    NatsServerTest::SetUp();
    if (HasFatalFailure()) return;
    nc_ = Connect({.name = "kvmocker-test", .send_asap = true});
    ASSERT_NE(nc_, nullptr);
    // Subscribed before kvmocker starts, so its first messages are seen.
    Listen(kComp + "instances", instances_);
    Listen(kComp + "kv-events", dynamo_events_);
    Listen(kComp + "vllm-kv-events.>", vllm_events_);
    ASSERT_TRUE(nc_->Flush(2s).ok());
  }

  void TearDown() override {
    if (mocker_) mocker_->Stop();
    subs_.clear();
    nc_.reset();
    if (!log_.empty() && !HasFailure() && std::getenv("KVROUTER_KEEP_TEST_LOGS") == nullptr) {
      std::remove(log_.c_str());
    }
  }

  void Listen(const std::string& subject, Inbox& inbox) {
    auto sub = nc_->Subscribe(subject, "", inbox.Handler());
    ASSERT_TRUE(sub.ok()) << sub.status().ToString();
    subs_.push_back(std::move(sub).value());
  }

  // Starts kvmocker (2 workers from id 1000, block size 4, 64 blocks, speedup `speedup_ratio`,
  // heartbeat 100 ms, /metrics on a free port) and waits for the first registration of each worker.
  void StartMocker(std::vector<std::string> extra = {}, std::string speedup_ratio = "100") {
    log_ = LogPath("kvmocker");
    std::vector<std::string> args = {"--worker-id-base",
                                     std::to_string(kBase),
                                     "--num-workers",
                                     "2",
                                     "--dp-size",
                                     "2",
                                     "--block-size",
                                     std::to_string(kBs),
                                     "--num-gpu-blocks",
                                     "64",
                                     "--max-num-seqs",
                                     "8",
                                     "--max-num-batched-tokens",
                                     "512",
                                     "--speedup-ratio",
                                     speedup_ratio,
                                     "--heartbeat-ms",
                                     "100",
                                     "--lease-ms",
                                     "1000",
                                     "--device",
                                     "cpu"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = StartOnNats(KVMOCKER_BIN, nats_->url(), std::move(args), log_, Metrics::kOnFreePort);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    mocker_ = std::move(p->process);
    metrics_port_ = p->metrics_port;
    ASSERT_TRUE(WaitFor([&] { return Registrations().size() >= 2; }, 10s))
        << "kvmocker did not register; log: " << log_ << "\n"
        << Log();
  }

  std::string Log() const { return ReadFile(log_); }

  std::vector<WorkerRegistration> Registrations() const {
    std::vector<WorkerRegistration> out;
    for (const Received& m : instances_.Snapshot()) {
      auto r = DecodeWorkerRegistration(m.data);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (r.ok()) out.push_back(*r);
    }
    return out;
  }

  // Sends a generate request to `worker` and returns every response once the final one came
  // (or what came within 5 s).
  std::vector<GenerateResponse> Generate(std::uint64_t worker, std::span<const std::byte> body) {
    const std::string inbox_subject = "_INBOX.kvmocker-test." + std::to_string(++inbox_seq_);
    Inbox inbox;
    auto sub = nc_->Subscribe(inbox_subject, "", inbox.Handler());
    EXPECT_TRUE(sub.ok());
    if (!sub.ok()) return {};
    EXPECT_TRUE(nc_->PublishRequest(kComp + "generate." + std::to_string(worker), inbox_subject, body).ok());
    std::vector<GenerateResponse> out;
    WaitFor(
        [&] {
          out.clear();
          for (const Received& m : inbox.Snapshot()) {
            auto r = GenerateResponse::Decode(m.data);
            EXPECT_TRUE(r.ok()) << r.status().ToString();
            if (r.ok()) out.push_back(*r);
          }
          return !out.empty() && out.back().is_final();
        },
        5s);
    return out;
  }
  std::vector<GenerateResponse> Generate(std::uint64_t worker, const GenerateRequest& req) {
    return Generate(worker, AsBytes(req.Encode()));
  }

  Result<RecoveryReply> Recover(std::uint64_t worker, std::uint32_t rank, RecoveryQuery q) {
    auto reply = nc_->Request(kComp + "kv_indexer_query." + std::to_string(worker) + "." + std::to_string(rank),
                              AsBytes(q.Encode()), 2s);
    if (!reply.ok()) return reply.status();
    return DecodeRecoveryReply(*reply, worker);
  }

  std::vector<KvEventBatch> DynamoEvents() const {
    std::vector<KvEventBatch> out;
    for (const Received& m : dynamo_events_.Snapshot()) {
      auto b = DecodeDynamoEvent(m.data);
      EXPECT_TRUE(b.ok()) << b.status().ToString();
      if (b.ok()) out.push_back(std::move(b).value());
    }
    return out;
  }

  std::unique_ptr<NatsClient> nc_;
  std::vector<std::unique_ptr<Subscription>> subs_;
  Inbox instances_, dynamo_events_, vllm_events_;
  std::unique_ptr<ChildProcess> mocker_;
  int metrics_port_ = 0;
  std::string log_;
  int inbox_seq_ = 0;
};

TEST_F(KvMockerProcessTest, RegistrationHeartbeatsCarryTheFlagValues) {
  StartMocker();
  // Heartbeats every 100 ms: three per worker arrive well within the wait.
  ASSERT_TRUE(WaitFor([&] { return Registrations().size() >= 6; }, 3s));
  std::map<std::uint64_t, int> per_worker;
  for (const WorkerRegistration& r : Registrations()) {
    ++per_worker[r.worker_id];
    EXPECT_EQ(r.dp_start, 0u);
    EXPECT_EQ(r.dp_size, 2u);
    EXPECT_EQ(r.block_size, kBs);
    EXPECT_EQ(r.total_kv_blocks, 64u);
    EXPECT_EQ(r.max_num_seqs, 8u);
    EXPECT_EQ(r.max_num_batched_tokens, 512u);
    EXPECT_EQ(r.device, "cpu");
    EXPECT_EQ(r.lease_ms, 1000u);
    EXPECT_FALSE(r.leaving);
  }
  EXPECT_EQ(per_worker.size(), 2u);
  EXPECT_GE(per_worker[kBase], 2);
  EXPECT_GE(per_worker[kBase + 1], 2);
}

TEST_F(KvMockerProcessTest, RegistrationsAnnounceTheRoleAndKvConnector) {
  StartMocker({"--role", "prefill", "--kv-connector", "sglang"});
  for (const WorkerRegistration& r : Registrations()) {
    EXPECT_EQ(r.role, WorkerRole::kPrefill) << r.worker_id;
    EXPECT_EQ(r.kv_connector, KvConnector::kSglang) << r.worker_id;
  }
  auto m = HttpGet(metrics_port_, "/metrics");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_NE(m->body.find(fmt::format("\nkvmocker_pinned_blocks{{worker_id=\"{}\",dp_rank=\"1\"}} 0\n", kBase + 1)),
            std::string::npos)
      << m->body;
}

TEST_F(KvMockerProcessTest, WorkersAreAggregatedByDefault) {
  StartMocker();
  for (const WorkerRegistration& r : Registrations()) {
    EXPECT_EQ(r.role, WorkerRole::kBoth) << r.worker_id;
    EXPECT_EQ(r.kv_connector, KvConnector::kNixl) << r.worker_id;
  }
}

TEST_F(KvMockerProcessTest, GenerateStreamsFirstAndFinalResponsesAndTheRepeatHitsTheCache) {
  StartMocker();
  const auto prompt = Tokens(1, 10);  // two full blocks + a partial one
  auto first = Generate(kBase, GenerateRequest{.request_id = "a", .token_ids = prompt, .max_tokens = 4});
  ASSERT_EQ(first.size(), 2u) << Log();
  EXPECT_FALSE(first[0].is_final());
  EXPECT_EQ(first[0].request_id, "a");
  EXPECT_EQ(first[0].index, 0u);
  EXPECT_EQ(first[0].token_ids.size(), 1u);
  const GenerateResponse& fin = first[1];
  EXPECT_EQ(fin.request_id, "a");
  EXPECT_EQ(fin.finish_reason, "length");
  EXPECT_EQ(fin.index, 1u);
  EXPECT_EQ(fin.token_ids.size(), 3u);  // max_tokens 4, one came first
  EXPECT_EQ(fin.prompt_tokens, 10u);
  EXPECT_EQ(fin.cached_tokens, 0u);
  EXPECT_GT(fin.ttft_ms, 0);

  auto again = Generate(kBase, GenerateRequest{.request_id = "b", .token_ids = prompt, .max_tokens = 1});
  ASSERT_EQ(again.size(), 2u);
  EXPECT_EQ(again[1].finish_reason, "length");
  EXPECT_TRUE(again[1].token_ids.empty());
  EXPECT_EQ(again[1].cached_tokens, 8u);

  // The other rank (and the other worker) has its own cache.
  auto other_rank =
      Generate(kBase, GenerateRequest{.request_id = "c", .token_ids = prompt, .max_tokens = 1, .dp_rank = 1});
  ASSERT_EQ(other_rank.size(), 2u);
  EXPECT_EQ(other_rank[1].cached_tokens, 0u);
  auto other_worker = Generate(kBase + 1, GenerateRequest{.request_id = "d", .token_ids = prompt, .max_tokens = 1});
  ASSERT_EQ(other_worker.size(), 2u);
  EXPECT_EQ(other_worker[1].cached_tokens, 0u);
}

TEST_F(KvMockerProcessTest, EachWorkerRunsAtItsOwnSpeedupRatio) {
  StartMocker({}, "0.1,100");
  // The same uncached prompt on each worker: a prefill takes at least 16.5 ms / speedup.
  const auto prompt = Tokens(1, 12 * kBs);
  auto slow = Generate(kBase, GenerateRequest{.request_id = "slow", .token_ids = prompt, .max_tokens = 1});
  auto fast = Generate(kBase + 1, GenerateRequest{.request_id = "fast", .token_ids = prompt, .max_tokens = 1});
  ASSERT_EQ(slow.size(), 2u) << Log();
  ASSERT_EQ(fast.size(), 2u) << Log();
  EXPECT_EQ(slow[1].cached_tokens, 0u);
  EXPECT_EQ(fast[1].cached_tokens, 0u);
  EXPECT_GE(slow[1].ttft_ms, MockPrefillMs(12 * kBs, 0.1));
  EXPECT_LT(fast[1].ttft_ms, slow[1].ttft_ms);
  EXPECT_NE(Log().find("speedup 0.1,100"), std::string::npos) << Log();
}

TEST_F(KvMockerProcessTest, MetricsShowEachRanksEngine) {
  StartMocker();
  const std::vector<std::uint32_t> prompt = Tokens(1, 3 * kBs);
  ASSERT_EQ(Generate(kBase, GenerateRequest{.request_id = "m", .token_ids = prompt, .max_tokens = 1}).size(), 2u);
  auto health = HttpGet(metrics_port_, "/health");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->status, 200);
  auto m = HttpGet(metrics_port_, "/metrics");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->status, 200);
  const auto has = [&](const std::string& line) { return m->body.find("\n" + line + "\n") != std::string::npos; };
  EXPECT_TRUE(has("kvmocker_requests_total 1")) << m->body;
  EXPECT_TRUE(has(fmt::format(R"(kvmocker_cached_blocks{{worker_id="{}",dp_rank="0"}} 3)", kBase))) << m->body;
  EXPECT_TRUE(has(fmt::format(R"(kvmocker_cached_blocks{{worker_id="{}",dp_rank="1"}} 0)", kBase))) << m->body;
  EXPECT_TRUE(has(fmt::format(R"(kvmocker_running_requests{{worker_id="{}",dp_rank="0"}} 0)", kBase + 1))) << m->body;
}

TEST_F(KvMockerProcessTest, BadRequestsGetOneErrorResponse) {
  StartMocker();
  msgpack::sbuffer no_tokens;
  msgpack::packer<msgpack::sbuffer> pk(no_tokens);
  pk.pack_map(1);
  PackKey(pk, "request_id");
  pk.pack("bad");
  auto r = Generate(kBase, AsBytes(no_tokens));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].request_id, "bad");
  EXPECT_EQ(r[0].finish_reason, "error");
  EXPECT_NE(r[0].message.find("token_ids"), std::string::npos) << r[0].message;
  EXPECT_NE(Log().find("kvmocker W [generate-bad] bad generate request"), std::string::npos) << Log();

  auto rank = Generate(kBase, GenerateRequest{.request_id = "r", .token_ids = Tokens(1, 4), .dp_rank = 2});
  ASSERT_EQ(rank.size(), 1u);
  EXPECT_EQ(rank[0].finish_reason, "error");

  auto garbage = Generate(kBase, AsBytes(std::string_view("\xc1", 1)));
  ASSERT_EQ(garbage.size(), 1u);
  EXPECT_EQ(garbage[0].finish_reason, "error");

  // A prompt with more full blocks than the cache is rejected by the engine.
  auto huge = Generate(kBase, GenerateRequest{.request_id = "h", .token_ids = Tokens(1, 65 * kBs)});
  ASSERT_EQ(huge.size(), 1u);
  EXPECT_EQ(huge[0].finish_reason, "error");
  EXPECT_EQ(huge[0].prompt_tokens, 65 * kBs);

  // Still serving.
  auto ok = Generate(kBase, GenerateRequest{.request_id = "ok", .token_ids = Tokens(1, 4), .max_tokens = 1});
  ASSERT_EQ(ok.size(), 2u);
  EXPECT_EQ(ok[1].finish_reason, "length");
}

TEST_F(KvMockerProcessTest, PublishesDynamoStoredEventsForThePrompt) {
  StartMocker();
  const auto prompt = Tokens(1, 10);
  ASSERT_EQ(Generate(kBase + 1, GenerateRequest{.request_id = "a", .token_ids = prompt, .max_tokens = 1, .dp_rank = 1})
                .size(),
            2u);
  ASSERT_TRUE(WaitFor([&] { return dynamo_events_.size() >= 1; }, 2s));
  const auto events = DynamoEvents();
  ASSERT_EQ(events.size(), 1u);
  const KvEventBatch& b = events[0];
  EXPECT_EQ(b.worker_id, kBase + 1);
  EXPECT_EQ(b.dp_rank, 1u);
  EXPECT_EQ(b.sequence, (EventSequence{SequenceKind::kEventId, 1}));
  ASSERT_EQ(b.ops.size(), 1u);
  const auto* stored = std::get_if<KvStored>(&b.ops[0].data);
  ASSERT_NE(stored, nullptr);
  EXPECT_FALSE(stored->parent_hash.has_value());
  const auto local = ComputeLocalHashes(prompt, kBs);
  const auto seq = ComputeSequenceHashes(local);
  ASSERT_EQ(stored->blocks.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(stored->blocks[i].tokens_hash, local[i]);
    EXPECT_EQ(stored->blocks[i].block_hash, seq[i]);
  }
  // The envelope names the publisher and counts from 0.
  const auto raw = dynamo_events_.Snapshot();  // the parsed envelope points into these bytes
  auto env = ParseMsgpack(raw[0].data);
  ASSERT_TRUE(env.ok());
  auto field = [&](std::string_view key) {
    auto v = ReadU64(FindKey(env->get(), key), key);
    EXPECT_TRUE(v.ok()) << v.status().ToString();
    return v.ok() ? *v : ~0ull;
  };
  EXPECT_EQ(field("publisher_id"), kBase + 1);
  EXPECT_EQ(field("sequence"), 0u);
  EXPECT_GT(field("published_at"), 1600000000000u);

  // A second prompt sharing the first block chains below it.
  const auto second = [&] {
    auto t = Tokens(1, 4);
    for (auto x : Tokens(500, 4)) t.push_back(x);
    return t;
  }();
  ASSERT_EQ(Generate(kBase + 1, GenerateRequest{.request_id = "b", .token_ids = second, .max_tokens = 1, .dp_rank = 1})
                .size(),
            2u);
  ASSERT_TRUE(WaitFor([&] { return dynamo_events_.size() >= 2; }, 2s));
  const auto events2 = DynamoEvents();
  ASSERT_EQ(events2.size(), 2u);
  ASSERT_TRUE(std::holds_alternative<KvStored>(events2[1].ops.at(0).data)) << events2[1].ops[0].data.index();
  const auto& s2 = std::get<KvStored>(events2[1].ops[0].data);
  EXPECT_EQ(events2[1].sequence.value, 2u);
  EXPECT_EQ(s2.parent_hash, seq[0]);
  ASSERT_EQ(s2.blocks.size(), 1u);
  EXPECT_EQ(s2.blocks[0].tokens_hash, ComputeLocalHashes(second, kBs)[1]);
}

TEST_F(KvMockerProcessTest, RecoveryServesADumpAndEventRanges) {
  StartMocker();
  // Three prompts on worker 1000 rank 0; the cache of 64 blocks holds them all.
  for (std::uint32_t i = 0; i < 3; ++i) {
    ASSERT_EQ(
        Generate(kBase,
                 GenerateRequest{.request_id = std::to_string(i), .token_ids = Tokens(100 * i, 12), .max_tokens = 1})
            .size(),
        2u);
  }
  auto dump = Recover(kBase, 0, {});
  ASSERT_TRUE(dump.ok()) << dump.status().ToString();
  EXPECT_EQ(dump->kind, "tree_dump");
  EXPECT_EQ(dump->last_event_id, 3u);
  std::size_t blocks = 0;
  for (const KvEventBatch& b : dump->events) {
    EXPECT_EQ(b.worker_id, kBase);
    blocks += std::get<KvStored>(b.ops.at(0).data).blocks.size();
  }
  EXPECT_EQ(blocks, 9u);

  auto range = Recover(kBase, 0, {.start_event_id = 1, .end_event_id = dump->last_event_id});
  ASSERT_TRUE(range.ok()) << range.status().ToString();
  EXPECT_EQ(range->kind, "events");
  ASSERT_EQ(range->events.size(), 3u);
  for (std::uint64_t i = 0; i < 3; ++i) EXPECT_EQ(range->events[i].sequence.value, i + 1);
  EXPECT_EQ(range->events, DynamoEvents());  // what was published live

  auto too_new = Recover(kBase, 0, {.start_event_id = 4});
  ASSERT_TRUE(too_new.ok());
  EXPECT_EQ(too_new->kind, "too_new");
  auto empty_rank = Recover(kBase, 1, {});
  ASSERT_TRUE(empty_rank.ok());
  EXPECT_EQ(empty_rank->kind, "tree_dump");
  EXPECT_TRUE(empty_rank->events.empty());
  auto bad = nc_->Request(kComp + "kv_indexer_query." + std::to_string(kBase) + ".0",
                          AsBytes(std::string_view("\x91\x01", 2)), 2s);
  ASSERT_TRUE(bad.ok());
  auto bad_reply = DecodeRecoveryReply(*bad, kBase);
  ASSERT_TRUE(bad_reply.ok());
  EXPECT_EQ(bad_reply->kind, "error");
}

TEST_F(KvMockerProcessTest, VllmFormatPublishesOnTheRankSubjectWithKvSeq) {
  StartMocker({"--event-format", "vllm"});
  const auto prompt = Tokens(1, 10);
  ASSERT_EQ(
      Generate(kBase, GenerateRequest{.request_id = "a", .token_ids = prompt, .max_tokens = 1, .dp_rank = 1}).size(),
      2u);
  const auto second = [&] {
    auto t = Tokens(1, 8);
    for (auto x : Tokens(500, 4)) t.push_back(x);
    return t;
  }();
  ASSERT_EQ(
      Generate(kBase, GenerateRequest{.request_id = "b", .token_ids = second, .max_tokens = 1, .dp_rank = 1}).size(),
      2u);
  ASSERT_TRUE(WaitFor([&] { return vllm_events_.size() >= 2; }, 2s));
  const auto msgs = vllm_events_.Snapshot();
  ASSERT_EQ(msgs.size(), 2u);
  EXPECT_EQ(dynamo_events_.size(), 0u);
  const auto local = ComputeLocalHashes(second, kBs);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(msgs[i].subject, kComp + "vllm-kv-events." + std::to_string(kBase) + ".1");
    ASSERT_TRUE(msgs[i].kv_seq.has_value());
    EXPECT_EQ(*msgs[i].kv_seq, std::to_string(i));
    auto d = DecodeVllmBatch(
        msgs[i].data,
        {.worker_id = kBase, .dp_rank = 1, .kv_seq = ParseKvSeqHeader(*msgs[i].kv_seq), .block_size = kBs});
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->block_size_mismatches, 0u);
    ASSERT_EQ(d->batch.ops.size(), 1u);
    const auto& stored = std::get<KvStored>(d->batch.ops[0].data);
    if (i == 0) {
      EXPECT_FALSE(stored.parent_hash.has_value());
      ASSERT_EQ(stored.blocks.size(), 2u);
      EXPECT_EQ(stored.blocks[0].tokens_hash, local[0]);
      EXPECT_EQ(stored.blocks[1].tokens_hash, local[1]);
    } else {  // only the new third block, tokens 500..503, below the shared two
      EXPECT_EQ(stored.parent_hash, ComputeSequenceHashes(local)[1]);
      ASSERT_EQ(stored.blocks.size(), 1u);
      EXPECT_EQ(stored.blocks[0].tokens_hash, local[2]);
    }
  }
}

TEST_F(KvMockerProcessTest, SigtermAnnouncesLeavingAnswersInFlightRequestsAndExitsZero) {
  StartMocker();
  // A long request (65536 decode steps of >= 0.01 ms) is still running at SIGTERM.
  const std::string inbox_subject = "_INBOX.kvmocker-test.long";
  Inbox inbox;
  auto sub = nc_->Subscribe(inbox_subject, "", inbox.Handler());
  ASSERT_TRUE(sub.ok());
  const GenerateRequest long_req{.request_id = "long", .token_ids = Tokens(1, 8), .max_tokens = kMaxGenerateTokens};
  ASSERT_TRUE(
      nc_->PublishRequest(kComp + "generate." + std::to_string(kBase), inbox_subject, AsBytes(long_req.Encode())).ok());
  ASSERT_TRUE(WaitFor([&] { return inbox.size() >= 1; }, 5s));  // its first token

  mocker_->Stop();
  ASSERT_TRUE(WIFEXITED(mocker_->exit_status())) << Log();
  EXPECT_EQ(WEXITSTATUS(mocker_->exit_status()), 0);
  std::map<std::uint64_t, int> leaving;
  ASSERT_TRUE(WaitFor(
      [&] {
        leaving.clear();
        for (const WorkerRegistration& r : Registrations()) leaving[r.worker_id] += r.leaving;
        return leaving[kBase] >= 1 && leaving[kBase + 1] >= 1;
      },
      2s));
  EXPECT_EQ(leaving[kBase], 1);
  EXPECT_EQ(leaving[kBase + 1], 1);

  ASSERT_TRUE(WaitFor([&] { return inbox.size() >= 2; }, 2s));
  auto last = GenerateResponse::Decode(inbox.Snapshot()[1].data);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->request_id, "long");
  EXPECT_EQ(last->finish_reason, "error");
}

}  // namespace
}  // namespace kvrouter::testing
