#include "router/common/metrics.h"

#include <fmt/format.h>
#include <prometheus/text_serializer.h>

#include <sstream>

#include "events/subjects.h"

namespace kvrouter {
namespace {

using prometheus::MetricType;

std::uint64_t CounterOf(const StatsReply& s, const std::string& name) {
  auto it = s.counters.find(name);
  return it == s.counters.end() ? 0 : it->second;
}

const std::map<std::string, std::uint64_t>& BreakdownOf(const StatsReply& s, const std::string& name) {
  static const std::map<std::string, std::uint64_t> kEmpty;
  auto it = s.breakdowns.find(name);
  return it == s.breakdowns.end() ? kEmpty : it->second;
}

// The event path: what arrives, what is applied, what is lost, what recovery does.
void AddEvents(MetricSet& m, const StatsReply& s) {
  const char* applied = "dynamo_component_kv_cache_events_applied";
  const char* applied_help = "KV cache events by status: ok (applied to the index) or the reason it was dropped";
  m.Counter(applied, applied_help, static_cast<double>(CounterOf(s, "events_applied")), {{"status", "ok"}});
  for (const auto& [reason, n] : BreakdownOf(s, "events_dropped")) {
    m.Counter(applied, applied_help, static_cast<double>(n), {{"status", reason}});
  }
  m.Counter("kvrouter_event_gaps_total", "gaps in a worker's event ids",
            static_cast<double>(CounterOf(s, "event_gaps")));
  m.Counter("kvrouter_event_restarts_total", "worker event streams that started over",
            static_cast<double>(CounterOf(s, "event_restarts")));
  const char* rec = "kvrouter_recoveries_total";
  const char* rec_help = "recoveries (docs/protocol.md section 6) by result";
  for (const char* r : {"started", "succeeded", "failed", "restarted", "backed_off"}) {
    const std::string key = fmt::format("recoveries_{}", r);
    m.Counter(rec, rec_help, static_cast<double>(CounterOf(s, key)), {{"result", r}});
  }
  m.Counter("kvrouter_recovery_dumps_total", "tree dumps asked", static_cast<double>(CounterOf(s, "recovery_dumps")));
  m.Counter("kvrouter_events_recovered_total", "events learned from recovery replies",
            static_cast<double>(CounterOf(s, "events_recovered")));
  m.Gauge("kvrouter_recoveries_in_flight", "recoveries waiting for a reply",
          static_cast<double>(CounterOf(s, "recoveries_in_flight")));
}

// Requests by endpoint and result ("requests" breakdown: "<endpoint>" and "<endpoint>.<result>").
void AddRequests(MetricSet& m, const StatsReply& s) {
  for (const auto& [key, n] : BreakdownOf(s, "requests")) {
    const auto dot = key.find('.');
    if (dot == std::string::npos) {
      m.Counter("dynamo_component_router_requests_started_total", "requests received, by endpoint",
                static_cast<double>(n), {{"endpoint", key}});
    } else {
      m.Counter("kvrouter_requests_total", "requests answered, by endpoint and result (ok or an error code)",
                static_cast<double>(n), {{"endpoint", key.substr(0, dot)}, {"result", key.substr(dot + 1)}});
    }
  }
  // Section 13: the route decisions of requests with a prefill and a decode pool, by path.
  for (const auto& [path, n] : BreakdownOf(s, "disagg_decisions")) {
    m.Counter("kvrouter_disagg_decisions_total",
              "route decisions of requests with prefill and decode workers: disaggregated, local or fallback",
              static_cast<double>(n), {{"path", path}});
  }
}

void AddQueueAndLoad(MetricSet& m, const StatsReply& s) {
  m.Gauge("dynamo_frontend_router_queue_pending_requests", "requests held back in the queue",
          static_cast<double>(CounterOf(s, "queue_length")));
  const char* rej = "kvrouter_queue_rejected_total";
  const char* rej_help = "queued requests that never got a worker, by reason";
  m.Counter(rej, rej_help, static_cast<double>(CounterOf(s, "queue_refused")), {{"reason", "full"}});
  m.Counter(rej, rej_help, static_cast<double>(CounterOf(s, "queue_timed_out")), {{"reason", "timeout"}});
  m.Counter("kvrouter_queue_admitted_total", "queued requests that got a worker",
            static_cast<double>(CounterOf(s, "queue_admitted")));
  m.Gauge("kvrouter_active_requests", "booked requests (all workers)",
          static_cast<double>(CounterOf(s, "active_requests")));
  m.Gauge("kvrouter_approx_predicted_blocks", "approximate mode: blocks predicted cached (0 otherwise)",
          static_cast<double>(CounterOf(s, "predicted_blocks")));
  m.Gauge("kvrouter_worker_ranks", "(worker, dp_rank) pairs known", static_cast<double>(s.workers_total));
  m.Gauge("kvrouter_workers_without_events",
          "registered workers routed requests but with no KV event 30 s after registering, while the router reads events",
          static_cast<double>(CounterOf(s, "workers_without_events")));
  m.Counter("kvrouter_leases_expired_total", "workers forgotten because their lease ran out",
            static_cast<double>(CounterOf(s, "leases_expired")));
  std::size_t n = 0;
  for (const WorkerStats& w : s.workers) {
    if (++n > RouterMetrics::kMaxRankSeries) break;
    const MetricLabels l = {{"worker_id", std::to_string(w.worker_id)}, {"dp_rank", std::to_string(w.dp_rank)}};
    m.Gauge("kvrouter_worker_active_blocks", "blocks of the requests booked on the rank",
            static_cast<double>(w.active_blocks), l);
    m.Gauge("kvrouter_worker_active_prefill_tokens", "prompt tokens booked on the rank and not yet prefilled",
            static_cast<double>(w.active_prefill_tokens), l);
    m.Gauge("kvrouter_worker_active_requests", "requests booked on the rank", static_cast<double>(w.active_requests),
            l);
    m.Gauge("kvrouter_worker_cached_blocks", "blocks the router believes cached on the rank",
            static_cast<double>(w.blocks), l);
    m.Counter("kvrouter_worker_routed_requests_total", "requests routed to the rank",
              static_cast<double>(w.routed_requests), l);
    if (w.prefill_tokens_per_second <= 0) continue;  // a router that learns no rates
    m.Gauge("kvrouter_worker_prefill_tokens_per_second",
            "the rank's learned prefill rate (the prior's marginal rate over its learned prefill factor)",
            w.prefill_tokens_per_second, l);
    m.Gauge("kvrouter_worker_decode_step_seconds", "the rank's learned decode step at low load", w.decode_step_seconds,
            l);
  }
}

}  // namespace

prometheus::MetricFamily& MetricSet::Family(std::string_view name, std::string_view help, MetricType type) {
  auto it = index_.find(name);
  if (it != index_.end()) return families_[it->second];
  index_.emplace(std::string(name), families_.size());
  families_.push_back({.name = std::string(name), .help = std::string(help), .type = type, .metric = {}});
  return families_.back();
}

void MetricSet::Counter(std::string_view name, std::string_view help, double value, const MetricLabels& labels) {
  prometheus::ClientMetric c;
  for (const auto& [k, v] : labels) c.label.push_back({k, v});
  c.counter.value = value;
  Family(name, help, MetricType::Counter).metric.push_back(std::move(c));
}

void MetricSet::Gauge(std::string_view name, std::string_view help, double value, const MetricLabels& labels) {
  prometheus::ClientMetric c;
  for (const auto& [k, v] : labels) c.label.push_back({k, v});
  c.gauge.value = value;
  Family(name, help, MetricType::Gauge).metric.push_back(std::move(c));
}

std::string RenderMetrics(std::vector<prometheus::MetricFamily> families) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

RouterMetrics::RouterMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  auto& route = prometheus::BuildHistogram()
                    .Name("kvrouter_route_duration_seconds")
                    .Help("time from a route request's arrival to its answer (or its place in the queue), by endpoint")
                    .Register(*registry_);
  const prometheus::Histogram::BucketBoundaries latency = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                           0.01,   0.025,   0.05,   0.1,   0.25,   1.0};
  for (const RouteEndpoint& e : kRouteEndpoints) {
    route_seconds_[std::string(e.name)] = &route.Add({{"endpoint", std::string(e.name)}}, latency);
  }
  hit_rate_ =
      &prometheus::BuildHistogram()
           .Name("dynamo_component_router_kv_hit_rate")
           .Help("share of a routed request's blocks already cached on the chosen worker, per decision")
           .Register(*registry_)
           .Add({}, prometheus::Histogram::BucketBoundaries{0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0});
  queue_wait_ =
      &prometheus::BuildHistogram()
           .Name("dynamo_frontend_router_queue_wait_seconds")
           .Help("time a request waited in the router's queue before a worker had room")
           .Register(*registry_)
           .Add({}, prometheus::Histogram::BucketBoundaries{0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60});
  auto& reconnects = prometheus::BuildCounter()
                         .Name("kvrouter_nats_reconnects_total")
                         .Help("NATS reconnections, by connection")
                         .Register(*registry_);
  for (const char* c : {"requests", "events"}) reconnects_[c] = &reconnects.Add({{"connection", c}});
}

void RouterMetrics::ObserveRoute(std::string_view endpoint, double seconds) {
  if (auto it = route_seconds_.find(endpoint); it != route_seconds_.end()) it->second->Observe(seconds);
}

void RouterMetrics::ObserveDecision(const RouteReply& reply) {
  if (reply.request_blocks > 0) {
    hit_rate_->Observe(static_cast<double>(reply.overlap_blocks) / static_cast<double>(reply.request_blocks));
  }
  if (reply.queued_ms > 0) queue_wait_->Observe(reply.queued_ms / 1000.0);
}

void RouterMetrics::CountReconnect(std::string_view connection) {
  if (auto it = reconnects_.find(connection); it != reconnects_.end()) it->second->Increment();
}

std::string RouterMetrics::Render(const StatsReply& stats, const RouterInfo& info) const {
  MetricSet m;
  m.Gauge("kvrouter_info", "what this router does (labels); always 1", 1,
          {{"mode", info.mode},
           {"kv_events", info.kv_events ? "true" : "false"},
           {"recovery", info.recovery ? "true" : "false"},
           {"replica_sync", info.replica_sync ? "true" : "false"}});
  m.Gauge("kvrouter_approximate_mode",
          "1: no KV events are read; caches are predicted from the router's own decisions (--no-router-kv-events)",
          info.approximate ? 1 : 0);
  AddRequests(m, stats);
  AddEvents(m, stats);
  AddQueueAndLoad(m, stats);
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (auto& f : m.Take()) families.push_back(std::move(f));
  return RenderMetrics(std::move(families));
}

}  // namespace kvrouter
