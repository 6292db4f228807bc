// The disaggregated decision (cost_disagg.h) on constructed candidates: each policy, the
// predicted policy's estimates and the transfer's price and learning.
#include "router/scheduling/cost_disagg.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

constexpr std::uint32_t kBs = 64;

SelectionRequest Request(std::uint32_t isl) { return {isl, (isl + kBs - 1) / kBs}; }

CostParams Params() {
  CostParams p;
  p.model = CostModel::kPredicted;
  p.block_size = kBs;
  return p;
}

Candidate Rank(std::uint64_t id, std::uint32_t overlap_blocks = 0) {
  return Candidate{.worker = {id, 0}, .overlap_blocks = overlap_blocks, .total_kv_blocks = 16384};
}

const KvTransfer kTransfer{131072, 400};

TEST(KvTransfer, PricesTokensFromBytesAndBandwidthAndLearnsFromObservations) {
  // 131072 bytes x 8 bits / 400e9 bit/s = 2.62144 us a token.
  EXPECT_NEAR(kTransfer.PriorMs(10000), 26.2144, 1e-9);
  KvTransfer t{131072, 400};
  EXPECT_FALSE(t.Observe(0, 10));
  EXPECT_FALSE(t.Observe(10, -1));
  EXPECT_TRUE(t.Observe(10, 30));  // 3x slower: a quarter of the way from 1 to 3
  EXPECT_DOUBLE_EQ(t.factor(), 1.5);
  EXPECT_NEAR(t.Ms(10000), 1.5 * 26.2144, 1e-9);
  EXPECT_TRUE(t.Observe(1, 1e9));  // clamped at 16
  EXPECT_DOUBLE_EQ(t.factor(), 1.5 + 0.25 * (16 - 1.5));
  EXPECT_EQ(t.observations(), 2u);
}

TEST(DisaggPolicy, NamesRoundTrip) {
  for (auto p : {DisaggPolicy::kPredicted, DisaggPolicy::kAlways, DisaggPolicy::kNever, DisaggPolicy::kIslBounding,
                 DisaggPolicy::kPrefillLoad, DisaggPolicy::kIslOrLoad}) {
    EXPECT_EQ(DisaggPolicyFromName(DisaggPolicyName(p)), p);
  }
  EXPECT_FALSE(DisaggPolicyFromName("sometimes").has_value());
}

// An idle decode rank prefills locally (the transfer only adds); one decoding many requests
// sends a long prompt to the prefill pool (its prefill would stall each of them); a prefill pool
// with a long queue keeps it local again.
TEST(PredictDisagg, WeighsTheLocalStallAgainstThePrefillQueueAndTheTransfer) {
  const SelectionRequest req = Request(8000);
  const CostParams p = Params();
  Candidate idle = Rank(3), prefill = Rank(1);
  DisaggChoice c = PredictDisagg({idle, prefill, idle}, req, p, kTransfer);
  EXPECT_FALSE(c.disaggregated);
  EXPECT_NEAR(c.transfer_ms, kTransfer.PriorMs(8000), 1e-9);
  EXPECT_NEAR(c.remote_ms - c.local_ms, c.transfer_ms, 1e-6);  // the same prefill, plus the transfer

  Candidate busy = Rank(3);
  busy.active_requests = 40;
  busy.active_blocks = 2000;
  c = PredictDisagg({busy, prefill, busy}, req, p, kTransfer);
  EXPECT_TRUE(c.disaggregated);
  EXPECT_GT(c.local_ms, c.remote_ms);

  Candidate queued = Rank(1);
  queued.active_prefill_tokens = 200000;
  queued.active_prefill_squares = 20 * std::uint64_t{10000} * 10000;
  queued.active_requests = 20;
  c = PredictDisagg({busy, queued, busy}, req, p, kTransfer);
  EXPECT_FALSE(c.disaggregated);

  // A decode rank that holds the prompt keeps it local even when busy: nothing to prefill.
  Candidate cached = busy;
  cached.overlap_blocks = req.request_blocks;
  c = PredictDisagg({cached, prefill, busy}, req, p, kTransfer);
  EXPECT_FALSE(c.disaggregated);
  // A slower transfer (learned) moves the balance: the busy rank keeps its long prompt too.
  KvTransfer slow{131072, 400};
  for (int i = 0; i < 40; ++i) slow.Observe(1, 16);
  c = PredictDisagg({busy, prefill, busy}, req, p, slow);
  EXPECT_NEAR(c.transfer_ms, slow.factor() * kTransfer.PriorMs(8000), 1e-6);
  EXPECT_GT(c.remote_ms, PredictDisagg({busy, prefill, busy}, req, p, kTransfer).remote_ms);
}

// The stall a local prefill inflicts counts at kLocalStallWeight: on a slow link (25 Gbit/s) a
// 2,000-token prompt stays on a decode rank decoding 4 requests, which priced whole would send
// it to the prefill pool.
TEST(PredictDisagg, TheLocalStallCountsAtItsWeight) {
  const SelectionRequest req = Request(2000);
  const CostParams p = Params();
  const KvTransfer slow{131072, 25};
  Candidate busy = Rank(3), prefill = Rank(1);
  busy.active_requests = 4;
  const DisaggChoice c = PredictDisagg({busy, prefill, busy}, req, p, slow);
  const predicted_cost::TimeOnRank t = predicted_cost::TimeOn(busy, req, p);
  EXPECT_DOUBLE_EQ(c.local_ms, t.ttft + kLocalStallWeight * t.inflicted);
  EXPECT_FALSE(c.disaggregated);
  EXPECT_GT(t.ttft + t.inflicted, c.remote_ms);  // whole, the stall would have sent it away
}

TEST(ChooseDisagg, DynamosPoliciesFollowTheirThresholds) {
  const CostParams p = Params();
  DisaggOptions o;
  Candidate prefill = Rank(1), decode = Rank(3);
  auto choose = [&](DisaggPolicy policy, const Candidate& local, std::uint32_t isl) {
    o.policy = policy;
    return ChooseDisagg(o, {local, prefill, decode}, Request(isl), p, kTransfer).disaggregated;
  };
  EXPECT_TRUE(choose(DisaggPolicy::kAlways, decode, 64));
  EXPECT_FALSE(choose(DisaggPolicy::kNever, decode, 64000));
  // isl_bounding: skip when eff_isl < 2048 and eff_isl / isl < 0.7.
  Candidate cached = Rank(3, 40);  // 2560 tokens cached
  EXPECT_FALSE(choose(DisaggPolicy::kIslBounding, cached, 4000));  // 1440 uncached, 0.36
  EXPECT_TRUE(choose(DisaggPolicy::kIslBounding, cached, 5000));   // 2440 uncached
  EXPECT_TRUE(choose(DisaggPolicy::kIslBounding, decode, 1000));   // 1000 uncached but 100 %
  EXPECT_FALSE(choose(DisaggPolicy::kIslBounding, Rank(3, 2), 400));  // 272 / 400 = 0.68
  EXPECT_TRUE(choose(DisaggPolicy::kIslBounding, Rank(3, 1), 400));   // 336 / 400 = 0.84
  // prefill_load: skip when the prefill rank's queue passes threshold x max_num_batched_tokens.
  o.prefill_busy_threshold = 2;
  prefill.max_num_batched_tokens = 1000;
  prefill.active_prefill_tokens = 2000;
  EXPECT_TRUE(choose(DisaggPolicy::kPrefillLoad, decode, 64000));
  prefill.active_prefill_tokens = 2001;
  EXPECT_FALSE(choose(DisaggPolicy::kPrefillLoad, decode, 64000));
  // isl_or_load: either.
  EXPECT_FALSE(choose(DisaggPolicy::kIslOrLoad, decode, 64000));
  prefill.active_prefill_tokens = 0;
  EXPECT_TRUE(choose(DisaggPolicy::kIslOrLoad, decode, 64000));
  EXPECT_FALSE(choose(DisaggPolicy::kIslOrLoad, cached, 4000));
}

}  // namespace
}  // namespace kvrouter
