#include "events/subjects.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

// Each subject spelled as docs/protocol.md spells it: the literals are the contract.
TEST(Subjects, WorkerSubjectsAreTheProtocols) {
  EXPECT_EQ(KvEventsSubject("dynamo", "backend"), "namespace.dynamo.component.backend.kv-events");
  EXPECT_EQ(VllmEventsSubject("dynamo", "backend", 7, 1), "namespace.dynamo.component.backend.vllm-kv-events.7.1");
  EXPECT_EQ(VllmEventsPrefix("dynamo", "backend"), "namespace.dynamo.component.backend.vllm-kv-events.");
  EXPECT_EQ(InstancesSubject("ns", "comp"), "namespace.ns.component.comp.instances");
  EXPECT_EQ(RecoverySubject("ns", "comp", 42, 3), "namespace.ns.component.comp.kv_indexer_query.42.3");
  EXPECT_EQ(WorkerGenerateSubject("ns", "comp", 9), "namespace.ns.component.comp.generate.9");
  EXPECT_EQ(WorkerGenerateSubject(WorkerGeneratePrefix("ns", "comp"), 9), "namespace.ns.component.comp.generate.9");
  EXPECT_EQ(ActiveSequencesSubject("ns", "comp"), "namespace.ns.component.comp.active_sequences_events");
  EXPECT_EQ(RouterHeartbeatsSubject("ns", "comp"), "namespace.ns.component.comp.router_heartbeats");
  EXPECT_EQ(KvMetricsSubject("ns"), "namespace.ns.kv_metrics");
}

TEST(RouteKind, NamesAreTheEndpoints) {
  EXPECT_EQ(RouteKindName(RouteKind::kRoute), "route");
  EXPECT_EQ(RouteKindName(RouteKind::kBestWorker), "best_worker");
  EXPECT_EQ(RouteKindName(RouteKind::kGenerate), "generate");
}

TEST(Subjects, RouterEndpointsAreTheProtocols) {
  EXPECT_EQ(RouterEndpointSubject("dynamo", router_endpoint::kRoute), "namespace.dynamo.router.route");
  EXPECT_EQ(RouterEndpointSubject("dynamo", router_endpoint::kBestWorker), "namespace.dynamo.router.best_worker");
  EXPECT_EQ(RouterEndpointSubject("dynamo", router_endpoint::kGenerate), "namespace.dynamo.router.generate");
  EXPECT_EQ(RouterEndpointSubject("dynamo", router_endpoint::kMarkPrefill), "namespace.dynamo.router.mark_prefill");
  EXPECT_EQ(RouterEndpointSubject("dynamo", router_endpoint::kPrefillDone), "namespace.dynamo.router.prefill_done");
  EXPECT_EQ(RouterEndpointSubject("dynamo", router_endpoint::kFree), "namespace.dynamo.router.free");
  EXPECT_EQ(RouterEndpointSubject("dynamo", router_endpoint::kStats), "namespace.dynamo.router.stats");
  EXPECT_EQ(RouterEndpointSubject("dynamo", router_endpoint::kOverlapScores), "namespace.dynamo.router.overlap_scores");
  EXPECT_EQ(RouterEndpointSubject("dynamo", router_endpoint::kDump), "namespace.dynamo.router.dump");
  EXPECT_EQ(ReplicaEndpointSubject("namespace.dynamo.router.stats", 1234), "namespace.dynamo.router.stats.1234");
  EXPECT_EQ(GenerateReplyPrefix(0xab), "_KVR.ab.");
  EXPECT_EQ(RecoveryReplyPrefix(0xab), "_KVR.ab.rec.");
  EXPECT_EQ(WarmupReplyPrefix(0xab), "_KVR.ab.warm.");
}

TEST(Subjects, TheSetOfAServiceIsBuiltFromTheSameFunctions) {
  const Subjects s("ns", "comp");
  EXPECT_EQ(s.kv_events, KvEventsSubject("ns", "comp"));
  EXPECT_EQ(s.vllm_events_prefix, VllmEventsPrefix("ns", "comp"));
  EXPECT_EQ(s.instances, InstancesSubject("ns", "comp"));
  EXPECT_EQ(s.active_sequences, ActiveSequencesSubject("ns", "comp"));
  EXPECT_EQ(s.router_heartbeats, RouterHeartbeatsSubject("ns", "comp"));
  EXPECT_EQ(s.route, "namespace.ns.router.route");
  EXPECT_EQ(s.best_worker, "namespace.ns.router.best_worker");
  EXPECT_EQ(s.mark_prefill, "namespace.ns.router.mark_prefill");
  EXPECT_EQ(s.prefill_done, "namespace.ns.router.prefill_done");
  EXPECT_EQ(s.free, "namespace.ns.router.free");
  EXPECT_EQ(s.stats, "namespace.ns.router.stats");
  EXPECT_EQ(s.overlap_scores, "namespace.ns.router.overlap_scores");
  EXPECT_EQ(s.dump, "namespace.ns.router.dump");
  EXPECT_EQ(s.generate, "namespace.ns.router.generate");
  EXPECT_EQ(s.kv_metrics, KvMetricsSubject("ns"));
  EXPECT_EQ(s.worker_generate_prefix, WorkerGeneratePrefix("ns", "comp"));
}

}  // namespace
}  // namespace kvrouter
