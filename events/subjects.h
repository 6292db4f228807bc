// NATS subjects of docs/protocol.md, each spelled in this one place: programs and the service
// build every subject through these functions (or the Subjects set below), never by hand; tests
// that check the wire itself (the integration tests, subjects_test) spell the literals.
// Thread-safe (pure functions). Callers on a hot path keep the subject they built (Subjects is
// built once per service) rather than formatting one per message.
//   {ns}: the namespace (--namespace), {comp}: the worker component (--component).
//
//   const Subjects subjects(ns, comp);  bus.Publish(subjects.kv_events, body);
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>

namespace kvrouter {

// namespace.{ns}.component.{comp}.  (the prefix of every worker component's subject)
std::string ComponentPrefix(std::string_view ns, std::string_view component);
// namespace.{ns}.router.  (the prefix of every router endpoint)
std::string RouterPrefix(std::string_view ns);

// Section 2: namespace.{ns}.component.{comp}.kv-events
std::string KvEventsSubject(std::string_view ns, std::string_view component);
// Section 3: namespace.{ns}.component.{comp}.vllm-kv-events.{worker_id}.{dp_rank}; the prefix is
// that subject up to and including "vllm-kv-events.".
std::string VllmEventsPrefix(std::string_view ns, std::string_view component);
std::string VllmEventsSubject(std::string_view ns, std::string_view component, std::uint64_t worker_id,
                              std::uint32_t dp_rank);
// Section 4: namespace.{ns}.component.{comp}.instances
std::string InstancesSubject(std::string_view ns, std::string_view component);

// Which endpoint a route request came by (section 5): route books, best_worker only asks (and
// never waits in the queue), generate books and is forwarded to the worker.
enum class RouteKind { kRoute, kBestWorker, kGenerate };
// The route request endpoints, in RouteKind order. The service subscribes to each (replicas in
// queue group kvrouter) and hands its requests to Routing with their kind, so a new one is a kind
// and a line here, plus what it does differently in router/service/routing.cc.
struct RouteEndpoint {
  RouteKind kind;
  std::string_view name;  // namespace.{ns}.router.{name}
};
inline constexpr RouteEndpoint kRouteEndpoints[] = {
    {RouteKind::kRoute, "route"},
    {RouteKind::kBestWorker, "best_worker"},
    {RouteKind::kGenerate, "generate"},
};
constexpr std::string_view RouteKindName(RouteKind kind) {
  return kRouteEndpoints[static_cast<std::size_t>(kind)].name;
}
static_assert([] {
  for (std::size_t i = 0; i < std::size(kRouteEndpoints); ++i) {
    if (static_cast<std::size_t>(kRouteEndpoints[i].kind) != i) return false;
  }
  return true;
}());

// Sections 5 and 12: the router's endpoints, namespace.{ns}.router.{endpoint}.
namespace router_endpoint {
inline constexpr std::string_view kRoute = RouteKindName(RouteKind::kRoute);
inline constexpr std::string_view kBestWorker = RouteKindName(RouteKind::kBestWorker);
inline constexpr std::string_view kGenerate = RouteKindName(RouteKind::kGenerate);
inline constexpr std::string_view kMarkPrefill = "mark_prefill";
inline constexpr std::string_view kPrefillDone = "prefill_done";  // section 13
inline constexpr std::string_view kFree = "free";
inline constexpr std::string_view kStats = "stats";
inline constexpr std::string_view kOverlapScores = "overlap_scores";
inline constexpr std::string_view kDump = "dump";
}  // namespace router_endpoint
std::string RouterEndpointSubject(std::string_view ns, std::string_view endpoint);
// A replica's own copy of an endpoint (stats, dump): {endpoint_subject}.{router_id} in decimal.
std::string ReplicaEndpointSubject(std::string_view endpoint_subject, std::uint64_t router_id);
// The router's own reply subjects, the part before {n}: generate forwards with
// _KVR.{router_id in hex}.{n} (section 5); its recovery asks (section 6) and peer warm-up asks
// (section 12) use _KVR.{router_id in hex}.rec.{n} and .warm.{n}.
std::string GenerateReplyPrefix(std::uint64_t router_id);
std::string RecoveryReplyPrefix(std::uint64_t router_id);
std::string WarmupReplyPrefix(std::uint64_t router_id);

// Section 6: namespace.{ns}.component.{comp}.kv_indexer_query.{worker_id}.{dp_rank}
std::string RecoverySubject(std::string_view ns, std::string_view component, std::uint64_t worker_id,
                            std::uint32_t dp_rank);
// Section 7: namespace.{ns}.component.{comp}.generate.{worker_id}; the prefix is the subject up to
// and including "generate.", and WorkerGenerateSubject(prefix, id) appends the id to it.
std::string WorkerGeneratePrefix(std::string_view ns, std::string_view component);
std::string WorkerGenerateSubject(std::string_view worker_generate_prefix, std::uint64_t worker_id);
std::string WorkerGenerateSubject(std::string_view ns, std::string_view component, std::uint64_t worker_id);

// Section 8: namespace.{ns}.component.{comp}.active_sequences_events (replica sync),
// namespace.{ns}.component.{comp}.router_heartbeats (kvrouter's extension), namespace.{ns}.kv_metrics.
std::string ActiveSequencesSubject(std::string_view ns, std::string_view component);
std::string RouterHeartbeatsSubject(std::string_view ns, std::string_view component);
std::string KvMetricsSubject(std::string_view ns);

// Every subject a router serves or publishes on for one namespace / component, built once.
struct Subjects {
  Subjects(std::string_view ns, std::string_view component);
  std::string kv_events, vllm_events_prefix, instances;
  std::string active_sequences, router_heartbeats;
  std::string route, best_worker, mark_prefill, prefill_done, free, stats, overlap_scores, dump, kv_metrics, generate;
  std::string worker_generate_prefix;  // WorkerGenerateSubject(worker_generate_prefix, worker_id)
};

}  // namespace kvrouter
