// The kvrouter binary against hostile and oversized peers, over a real nats-server: every case
// of the issue "one message takes the router down". After each case the router must still give
// a routing decision and a stats reply within 500 ms (2 s in the Debug + ASan build), an honest
// worker's cache must be intact, and (outside sanitizer builds) the router's resident memory must have grown by < 200 MB.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <mutex>

#include "events/event_codec.h"
#include "events/kv_event.h"
#include "events/registration_codec.h"
#include "events/replica_sync_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "tests/sanitized.h"
#include "tests/integration/kvrouter_fixture.h"

namespace kvrouter::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kHonest = 7;
// The Debug + ASan run checks memory safety, not scale: it sends a quarter of each flood (the
// plain build sends the full numbers), against a booking bound scaled the same way.
constexpr std::size_t kScale = kSanitized ? 4 : 1;
constexpr std::size_t kBookingBound = 65536 / kScale;
// The bound; Debug + ASan code is several times slower, so it gets four times as long.
constexpr auto kAnswerWithin = kSanitized ? std::chrono::milliseconds(2000) : std::chrono::milliseconds(500);
constexpr std::size_t kMaxGrowthBytes = 200u << 20;

// Resident set size of a process, from /proc (0 when unreadable).
std::size_t ResidentBytes(pid_t pid) { return static_cast<std::size_t>(std::max(0L, ProcStatusKb(pid, "VmRSS"))) * 1024; }

class HostileTest : public KvRouterProcessTest {
 protected:
  // Each case runs within the router's first second, when routes deliberately wait (up to
  // --router-recovery-wait-ms) for start-up dumps; the answer times measured here are the
  // steady state's.
  std::vector<std::string> ExtraArgs() const override {
    return {"--router-recovery-wait-ms", "0", "--router-max-active-requests", std::to_string(kBookingBound)};
  }
  void SetUp() override {
    KvRouterProcessTest::SetUp();
    if (HasFatalFailure()) return;
    Register(kHonest);
    ASSERT_TRUE(AwaitWorkers(1));
    StoreDynamo(kHonest, 1, Tokens(1, 12));
    ASSERT_TRUE(AwaitEventsApplied(1));
    rss_before_ = ResidentBytes(router_->pid());
  }

  // The checks every case ends with.
  void ExpectHealthy() {
    ASSERT_TRUE(router_->Running()) << "kvrouter died; log: " << log_;
    const auto t0 = Clock::now();
    auto decision = Route(Tokens(500, 8));
    const auto route_time = Clock::now() - t0;
    ASSERT_TRUE(decision.ok()) << decision.status().ToString();
    EXPECT_LT(route_time, kAnswerWithin);
    const auto t1 = Clock::now();
    auto stats = Stats();
    const auto stats_time = Clock::now() - t1;
    ASSERT_TRUE(stats.has_value()) << "no stats reply";
    EXPECT_LT(stats_time, kAnswerWithin);
    // The honest worker still holds its prompt.
    RouteRequest q{.token_ids = Tokens(1, 12),
                   .has_token_ids = true,
                   .isl = 12,
                   .update_states = false,
                   .allowed_worker_ids = std::vector<std::uint64_t>{kHonest}};
    auto honest = RequestRoute("route", EncodeRouteRequest(q));
    ASSERT_TRUE(honest.ok()) << honest.status().ToString();
    EXPECT_EQ(honest->worker_id, kHonest);
    EXPECT_EQ(honest->overlap_blocks, 3u);
    if (!kSanitized) {
      const std::size_t after = ResidentBytes(router_->pid());
      EXPECT_LT(after, rss_before_ + kMaxGrowthBytes) << "RSS " << rss_before_ << " -> " << after;
    }
  }

  std::uint64_t Breakdown(const std::string& map, const std::string& key) {
    auto s = Stats();
    return s ? s->breakdowns[map][key] : 0;
  }
  bool AwaitBreakdown(const std::string& map, const std::string& key, std::uint64_t n,
                      std::chrono::milliseconds timeout = 30s) {
    return WaitFor([&] { return Breakdown(map, key) >= n; }, timeout, 20ms);
  }

  // Publishes `n` messages, pausing every `chunk` until `caught_up(sent)` says the router has
  // taken them (so the test measures the router, not a slow-consumer drop in the server).
  void PublishMany(const std::string& subject, std::size_t n, std::size_t chunk,
                   const std::function<msgpack::sbuffer(std::size_t)>& body,
                   const std::function<bool(std::size_t)>& caught_up) {
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(nc_->Publish(subject, AsBytes(body(i))).ok());
      if ((i + 1) % chunk == 0 || i + 1 == n) {
        ASSERT_TRUE(WaitFor([&] { return caught_up(i + 1); }, 60s, 20ms)) << "router stuck after " << i + 1;
      }
    }
  }

  // Sends `n` requests with at most `window` unanswered; returns replies counted by error code
  // ("ok" for a reply that is not an error).
  std::map<std::string, std::size_t> RequestMany(const std::string& subject, std::size_t n, std::size_t window,
                                                 const std::function<msgpack::sbuffer(std::size_t)>& body) {
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::string, std::size_t> codes;
    std::size_t answered = 0;
    const std::string inbox = "_HOSTILE." + std::to_string(nats_->port());
    auto sub = nc_->Subscribe(inbox + ".*", "", [&](const IncomingMessage& m) {
      const Status s = DecodeErrorReply(m.data);
      std::lock_guard g(mu);
      ++codes[std::string(StatusCodeName(s.code()))];
      ++answered;
      cv.notify_all();
    });
    EXPECT_TRUE(sub.ok());
    for (std::size_t i = 0; i < n; ++i) {
      {
        std::unique_lock lk(mu);
        if (!cv.wait_for(lk, 30s, [&] { return i - answered < window; })) {
          ADD_FAILURE() << "replies stopped after " << answered;
          return codes;
        }
      }
      EXPECT_TRUE(nc_->PublishRequest(subject, inbox + "." + std::to_string(i), AsBytes(body(i))).ok());
    }
    std::unique_lock lk(mu);
    EXPECT_TRUE(cv.wait_for(lk, 60s, [&] { return answered == n; })) << answered << " of " << n << " answered";
    return codes;
  }

  std::size_t rss_before_ = 0;
};

TEST_F(HostileTest, RegistrationWithFourBillionDpRanksIsRefused) {
  WorkerRegistration r{.worker_id = 99, .dp_size = std::numeric_limits<std::uint32_t>::max(), .block_size = kBs};
  ASSERT_TRUE(nc_->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r))).ok());
  ASSERT_TRUE(AwaitBreakdown("registrations_refused", "dp_size", 1));
  EXPECT_EQ(Stats().value().workers_total, 1u);
  ExpectHealthy();
}

TEST_F(HostileTest, LeaseOfZeroOrTwoToThe63IsClamped) {
  auto registration = [](std::uint64_t id, std::uint64_t lease_ms) {
    msgpack::sbuffer b;
    msgpack::packer<msgpack::sbuffer> pk(b);
    pk.pack_map(3);
    PackKey(pk, "worker_id");
    pk.pack(id);
    PackKey(pk, "block_size");
    pk.pack(kBs);
    PackKey(pk, "lease_ms");
    pk.pack(lease_ms);
    return b;
  };
  ASSERT_TRUE(nc_->Publish(kComp + "instances", AsBytes(registration(2, std::uint64_t{1} << 63))).ok());
  ASSERT_TRUE(AwaitWorkers(2, 60s));
  ASSERT_TRUE(nc_->Publish(kComp + "instances", AsBytes(registration(1, 0))).ok());
  // Lease 0 is read as 100 ms: worker 1 comes and goes; worker 2 (an hour) stays.
  ASSERT_TRUE(AwaitStats([](const StatsReply& s) { return s.counters.at("leases_expired") == 1; }, 5s));
  EXPECT_EQ(Stats().value().workers_total, 2u);
  ExpectHealthy();
}

TEST_F(HostileTest, LargestWorkerIdIsAnOrdinaryWorker) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  Register(kMax);
  ASSERT_TRUE(AwaitWorkers(2));
  StoreDynamo(kMax, 1, Tokens(300, 8));
  ASSERT_TRUE(AwaitEventsApplied(2));
  auto r = Route(Tokens(300, 8));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->worker_id, kMax);
  EXPECT_EQ(r->overlap_blocks, 2u);
  Register(kMax, 60000, /*leaving=*/true);
  ASSERT_TRUE(AwaitWorkers(1));
  ExpectHealthy();
}

TEST_F(HostileTest, UnregisteredWorkersEventOnTheLastRankIsDropped) {
  KvEventBatch b = StoredPromptBatch(99, 1, Tokens(40, 8), kBs);
  b.dp_rank = std::numeric_limits<std::uint32_t>::max();
  ASSERT_TRUE(nc_->Publish(kComp + "kv-events", AsBytes(EncodeDynamoEnvelope(b, {}))).ok());
  ASSERT_TRUE(AwaitBreakdown("events_dropped", "dp_rank_out_of_range", 1));
  EXPECT_EQ(Stats().value().workers_total, 1u);
  ExpectHealthy();
}

TEST_F(HostileTest, StoredEventOf15000BlocksIsIndexed) {
  Register(2);
  ASSERT_TRUE(AwaitWorkers(2));
  std::vector<std::uint32_t> prompt(15000 * kBs);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::uint32_t>(1000 + i);
  StoreDynamo(2, 1, prompt);
  ASSERT_TRUE(AwaitEventsApplied(2));
  auto r = Route(prompt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->worker_id, 2u);
  EXPECT_EQ(r->overlap_blocks, 15000u);
  ExpectHealthy();
}

TEST_F(HostileTest, RouteOf250000TokensIsAnswered) {
  std::vector<std::uint32_t> prompt(250000);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::uint32_t>(i % 128);  // 1 byte each
  const auto t0 = Clock::now();
  auto r = Route(prompt, "long");
  EXPECT_LT(Clock::now() - t0, kAnswerWithin);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->request_blocks, 250000u / kBs);
  ExpectHealthy();
}

TEST_F(HostileTest, PinToTheLastRankWithTenThousandAllowedIdsIsNotFound) {
  RouteRequest q{.token_ids = Tokens(1, 12),
                 .has_token_ids = true,
                 .isl = 12,
                 .worker_id = kHonest,
                 .dp_rank = std::numeric_limits<std::uint32_t>::max()};
  q.allowed_worker_ids.emplace();
  for (std::uint64_t i = 0; i < 10000; ++i) q.allowed_worker_ids->push_back(1000000 + i);
  auto pinned = RequestRoute("route", EncodeRouteRequest(q));
  EXPECT_EQ(pinned.status().code(), StatusCode::kNotFound);
  q.worker_id.reset();
  EXPECT_EQ(RequestRoute("route", EncodeRouteRequest(q)).status().code(), StatusCode::kNoWorkers);
  ExpectHealthy();
}

TEST_F(HostileTest, HugeTemperatureAndNegativeScale) {
  Register(2);
  ASSERT_TRUE(AwaitWorkers(2));
  RouteRequest q{.token_ids = Tokens(1, 12), .has_token_ids = true, .isl = 12};
  q.config_override.router_temperature = 1e308;
  auto hot = RequestRoute("route", EncodeRouteRequest(q));
  ASSERT_TRUE(hot.ok()) << hot.status().ToString();
  msgpack::sbuffer b;
  msgpack::packer<msgpack::sbuffer> pk(b);
  pk.pack_map(2);
  PackKey(pk, "token_ids");
  pk.pack(Tokens(1, 12));
  PackKey(pk, "router_config_override");
  pk.pack_map(1);
  PackKey(pk, "prefill_load_scale");
  pk.pack_double(-2.5);
  EXPECT_EQ(RequestRoute("route", b).status().code(), StatusCode::kInvalidArgument);
  ExpectHealthy();
}

TEST_F(HostileTest, HundredThousandRegistrations) {
  constexpr std::size_t kN = 100000 / kScale;
  PublishMany(
      kComp + "instances", kN, 10000,
      [](std::size_t i) {
        return EncodeWorkerRegistration({.worker_id = 1000000 + i, .block_size = kBs, .lease_ms = 600000});
      },
      [&](std::size_t sent) {
        auto s = Stats();
        return s && s->workers_total == 1 + sent;
      });
  auto page = Stats({.offset = kN / 2, .limit = StatsRequest::kMaxLimit});
  ASSERT_TRUE(page.has_value());
  EXPECT_EQ(page->workers_total, 1 + kN);
  ASSERT_FALSE(page->workers.empty());
  EXPECT_LE(page->workers.size(), StatsRequest::kMaxLimit);
  ASSERT_TRUE(page->next_offset.has_value());
  EXPECT_EQ(*page->next_offset, kN / 2 + page->workers.size());
  ExpectHealthy();
}

TEST_F(HostileTest, FiftyThousandUnregisteredEventWorkers) {
  constexpr std::size_t kN = 50000 / kScale;
  PublishMany(
      kComp + "kv-events", kN, 10000,
      [](std::size_t i) { return EncodeDynamoEnvelope(StoredPromptBatch(2000000 + i, 1, Tokens(9000, 4), kBs), {}); },
      [&](std::size_t sent) {
        auto s = Stats();
        return s && s->workers_total == 1 + sent;
      });
  ExpectHealthy();
}

TEST_F(HostileTest, SeventyThousandBookingsNeverFreed) {
  constexpr std::size_t kN = 70000 / kScale;
  auto codes = RequestMany(kRouter + "route", kN, 2000, [](std::size_t i) {
    return EncodeRouteRequest(
        {.request_id = "leak-" + std::to_string(i), .token_ids = Tokens(700, 8), .has_token_ids = true, .isl = 8});
  });
  EXPECT_EQ(codes["ok"], kBookingBound);
  EXPECT_EQ(codes["overloaded"], kN - kBookingBound);
  EXPECT_EQ(Stats().value().counters.at("active_requests"), kBookingBound);
  ExpectHealthy();
}

class HostileReplicaTest : public HostileTest {
 protected:
  std::vector<std::string> ExtraArgs() const override {
    auto args = HostileTest::ExtraArgs();
    args.push_back("--router-replica-sync");
    return args;
  }
};

TEST_F(HostileReplicaTest, TwentyThousandReplicaAddsForUnknownWorkers) {
  constexpr std::size_t kN = 20000 / kScale;
  PublishMany(
      kComp + "active_sequences_events", kN, 5000,
      [](std::size_t i) {
        return EncodeActiveSequenceEvent({.router_id = 1234,
                                          .request_id = "phantom-" + std::to_string(i),
                                          .worker_id = 5000000 + i,
                                          .kind = ActiveSequenceEvent::Kind::kAdd,
                                          .seq_hashes = std::vector<std::uint64_t>(64, i),
                                          .isl = 256});
      },
      [&](std::size_t sent) { return Breakdown("replica_sync_refused", "unknown_worker") == sent; });
  auto s = Stats();
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->counters.at("active_requests"), 0u);
  EXPECT_EQ(s->workers_total, 1u);
  ExpectHealthy();
}

}  // namespace
}  // namespace kvrouter::testing
