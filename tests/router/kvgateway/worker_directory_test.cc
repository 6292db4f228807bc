#include "router/kvgateway/worker_directory.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
const SteadyTime kT0{};

WorkerRegistration Engine(std::uint64_t id, std::vector<std::string> models, std::string url = "http://e:8000") {
  return {.worker_id = id, .lease_ms = 1000, .http_url = std::move(url), .models = std::move(models)};
}

TEST(WorkerDirectory, FindsTheEnginesServingAModel) {
  WorkerDirectory d;
  d.Apply(Engine(2, {"llama", "qwen"}), kT0);
  d.Apply(Engine(1, {"llama"}, "http://one:1"), kT0);
  d.Apply(Engine(3, {"qwen"}), kT0);
  EXPECT_EQ(d.Serving("llama"), (std::vector<std::uint64_t>{1, 2}));
  EXPECT_TRUE(d.Serving("mistral").empty());
  EXPECT_EQ(d.HttpUrl(1), "http://one:1");
  EXPECT_EQ(d.Models(), (std::vector<std::string>{"llama", "qwen"}));
}

TEST(WorkerDirectory, KeepsEachWorkersUrlParsedAndParsesItAgainWhenItMoves) {
  WorkerDirectory d;
  d.Apply(Engine(1, {"llama"}, "http://one:1"), kT0);
  d.Apply(Engine(2, {"llama"}, "http://two:80/path"), kT0);  // kept, but no endpoint: not a base URL
  ASSERT_TRUE(d.Endpoint(1).has_value());
  EXPECT_EQ(d.Endpoint(1)->Key(), "one:1");
  EXPECT_FALSE(d.Endpoint(2).has_value());
  EXPECT_FALSE(d.Endpoint(3).has_value());
  d.Apply(Engine(1, {"llama"}, "http://[::1]:9"), kT0);
  EXPECT_EQ(d.Endpoint(1)->Key(), "[::1]:9");
}

TEST(WorkerDirectory, KeepsEachWorkersRoleAndAnUnknownOneIsBoth) {
  WorkerDirectory d;
  WorkerRegistration prefill = Engine(1, {"m"});
  prefill.role = WorkerRole::kPrefill;
  WorkerRegistration decode = Engine(2, {"m"});
  decode.role = WorkerRole::kDecode;
  d.Apply(prefill, kT0);
  d.Apply(decode, kT0);
  d.Apply(Engine(3, {"m"}), kT0);
  EXPECT_EQ(d.Role(1), WorkerRole::kPrefill);
  EXPECT_EQ(d.Role(2), WorkerRole::kDecode);
  EXPECT_EQ(d.Role(3), WorkerRole::kBoth);
  EXPECT_EQ(d.Role(4), WorkerRole::kBoth);
}

TEST(WorkerDirectory, OnlyAnSglangEngineOfAPairCannotServeAWholeRequestAlone) {
  WorkerDirectory d;
  WorkerRegistration nixl_decode = Engine(1, {"m"});
  nixl_decode.role = WorkerRole::kDecode;
  WorkerRegistration sglang_decode = Engine(2, {"m"});
  sglang_decode.role = WorkerRole::kDecode;
  sglang_decode.kv_connector = KvConnector::kSglang;
  WorkerRegistration sglang_both = Engine(3, {"m"});
  sglang_both.kv_connector = KvConnector::kSglang;
  for (const auto& r : {nixl_decode, sglang_decode, sglang_both}) d.Apply(r, kT0);
  EXPECT_TRUE(d.ServesAlone(1));
  EXPECT_FALSE(d.ServesAlone(2));
  EXPECT_TRUE(d.ServesAlone(3));
  EXPECT_EQ(d.Ids(), (std::vector<std::uint64_t>{1, 2, 3}));
}

TEST(WorkerDirectory, AWorkerWithoutHttpUrlIsNotKeptAndLeavingRemoves) {
  WorkerDirectory d;
  d.Apply(Engine(1, {"m"}, ""), kT0);
  EXPECT_EQ(d.size(), 0u);
  d.Apply(Engine(2, {"m"}), kT0);
  WorkerRegistration leaving = Engine(2, {"m"});
  leaving.leaving = true;
  d.Apply(leaving, kT0);
  EXPECT_EQ(d.size(), 0u);
  EXPECT_FALSE(d.HttpUrl(2));
}

// The URLs returned are the ones whose engine connections may be closed: no worker left has them.
TEST(WorkerDirectory, ReturnsTheUrlsNoWorkerHasAnyMore) {
  WorkerDirectory d;
  d.Apply(Engine(1, {"m"}, "http://a:1"), kT0);
  d.Apply(Engine(2, {"m"}, "http://a:1"), kT0);  // two ranks behind one server
  d.Apply(Engine(3, {"m"}, "http://b:1"), kT0);
  WorkerRegistration leaving = Engine(1, {"m"}, "http://a:1");
  leaving.leaving = true;
  EXPECT_TRUE(d.Apply(leaving, kT0).empty());  // worker 2 still has it
  EXPECT_EQ(d.Apply(Engine(2, {"m"}, "http://c:1"), kT0), std::vector<std::string>{"http://a:1"});  // moved
  EXPECT_TRUE(d.Apply(Engine(3, {"m"}, "http://b:1"), kT0 + milliseconds(800)).empty());  // a heartbeat
  EXPECT_EQ(d.Expire(kT0 + milliseconds(1500)), std::vector<std::string>{"http://c:1"});
  EXPECT_EQ(d.Expire(kT0 + milliseconds(2000)), std::vector<std::string>{"http://b:1"});
  d.Apply(Engine(4, {"m"}, "http://d:1"), kT0);
  leaving = Engine(4, {"m"}, "http://d:1");
  leaving.leaving = true;
  EXPECT_EQ(d.Apply(leaving, kT0), std::vector<std::string>{"http://d:1"});
}

TEST(WorkerDirectory, AWorkerUnheardForItsLeaseGoesAndAHeartbeatKeepsIt) {
  WorkerDirectory d;
  d.Apply(Engine(1, {"m"}), kT0);
  d.Apply(Engine(2, {"m"}), kT0);
  d.Apply(Engine(2, {"m"}), kT0 + milliseconds(800));  // heartbeat
  d.Expire(kT0 + milliseconds(1500));
  EXPECT_EQ(d.Serving("m"), std::vector<std::uint64_t>{2});
}

TEST(WorkerDirectory, ANatsOutageForgetsNothingAndAWholeLeaseFollowsIt) {
  WorkerDirectory d;
  d.Apply(Engine(1, {"m"}), kT0);  // lease to 1,000 ms
  d.Pause();
  d.Expire(kT0 + milliseconds(5000));  // the outage is longer than the lease: nobody is forgotten
  EXPECT_EQ(d.Serving("m"), std::vector<std::uint64_t>{1});
  d.Resume(kT0 + milliseconds(6000));
  d.Expire(kT0 + milliseconds(6900));  // within a lease of the reconnect
  EXPECT_EQ(d.size(), 1u);
  d.Expire(kT0 + milliseconds(7100));  // silent for a whole lease after it: gone as usual
  EXPECT_EQ(d.size(), 0u);
  // A second Resume without an outage between moves no lease.
  d.Apply(Engine(2, {"m"}), kT0 + milliseconds(8000));
  d.Resume(kT0 + milliseconds(8900));
  d.Expire(kT0 + milliseconds(9100));
  EXPECT_EQ(d.size(), 0u);
}

}  // namespace
}  // namespace kvrouter
