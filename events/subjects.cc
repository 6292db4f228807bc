#include "events/subjects.h"

#include <fmt/format.h>

namespace kvrouter {

std::string ComponentPrefix(std::string_view ns, std::string_view component) {
  return fmt::format("namespace.{}.component.{}.", ns, component);
}

std::string RouterPrefix(std::string_view ns) { return fmt::format("namespace.{}.router.", ns); }

std::string KvEventsSubject(std::string_view ns, std::string_view component) {
  return ComponentPrefix(ns, component) + "kv-events";
}

std::string VllmEventsPrefix(std::string_view ns, std::string_view component) {
  return ComponentPrefix(ns, component) + "vllm-kv-events.";
}

std::string VllmEventsSubject(std::string_view ns, std::string_view component, std::uint64_t worker_id,
                              std::uint32_t dp_rank) {
  return fmt::format("{}{}.{}", VllmEventsPrefix(ns, component), worker_id, dp_rank);
}

std::string InstancesSubject(std::string_view ns, std::string_view component) {
  return ComponentPrefix(ns, component) + "instances";
}

std::string RouterEndpointSubject(std::string_view ns, std::string_view endpoint) {
  return fmt::format("namespace.{}.router.{}", ns, endpoint);
}

std::string ReplicaEndpointSubject(std::string_view endpoint_subject, std::uint64_t router_id) {
  return fmt::format("{}.{}", endpoint_subject, router_id);
}

std::string GenerateReplyPrefix(std::uint64_t router_id) { return fmt::format("_KVR.{:x}.", router_id); }
std::string RecoveryReplyPrefix(std::uint64_t router_id) { return fmt::format("_KVR.{:x}.rec.", router_id); }
std::string WarmupReplyPrefix(std::uint64_t router_id) { return fmt::format("_KVR.{:x}.warm.", router_id); }

std::string RecoverySubject(std::string_view ns, std::string_view component, std::uint64_t worker_id,
                            std::uint32_t dp_rank) {
  return fmt::format("{}kv_indexer_query.{}.{}", ComponentPrefix(ns, component), worker_id, dp_rank);
}

std::string WorkerGeneratePrefix(std::string_view ns, std::string_view component) {
  return ComponentPrefix(ns, component) + "generate.";
}

std::string WorkerGenerateSubject(std::string_view worker_generate_prefix, std::uint64_t worker_id) {
  return fmt::format("{}{}", worker_generate_prefix, worker_id);
}

std::string WorkerGenerateSubject(std::string_view ns, std::string_view component, std::uint64_t worker_id) {
  return WorkerGenerateSubject(WorkerGeneratePrefix(ns, component), worker_id);
}

std::string ActiveSequencesSubject(std::string_view ns, std::string_view component) {
  return ComponentPrefix(ns, component) + "active_sequences_events";
}

std::string RouterHeartbeatsSubject(std::string_view ns, std::string_view component) {
  return ComponentPrefix(ns, component) + "router_heartbeats";
}

std::string KvMetricsSubject(std::string_view ns) { return fmt::format("namespace.{}.kv_metrics", ns); }

Subjects::Subjects(std::string_view ns, std::string_view comp)
    : kv_events(KvEventsSubject(ns, comp)),
      vllm_events_prefix(VllmEventsPrefix(ns, comp)),
      instances(InstancesSubject(ns, comp)),
      active_sequences(ActiveSequencesSubject(ns, comp)),
      router_heartbeats(RouterHeartbeatsSubject(ns, comp)),
      route(RouterEndpointSubject(ns, router_endpoint::kRoute)),
      best_worker(RouterEndpointSubject(ns, router_endpoint::kBestWorker)),
      mark_prefill(RouterEndpointSubject(ns, router_endpoint::kMarkPrefill)),
      prefill_done(RouterEndpointSubject(ns, router_endpoint::kPrefillDone)),
      free(RouterEndpointSubject(ns, router_endpoint::kFree)),
      stats(RouterEndpointSubject(ns, router_endpoint::kStats)),
      overlap_scores(RouterEndpointSubject(ns, router_endpoint::kOverlapScores)),
      dump(RouterEndpointSubject(ns, router_endpoint::kDump)),
      kv_metrics(KvMetricsSubject(ns)),
      generate(RouterEndpointSubject(ns, router_endpoint::kGenerate)),
      worker_generate_prefix(WorkerGeneratePrefix(ns, comp)) {}

}  // namespace kvrouter
