// Prometheus metrics (docs/protocol.md section 10), text exposition for /metrics.
//
// MetricSet builds families at scrape time from a snapshot (the service's counters, every rank's
// load; kvmocker's engines). RouterMetrics adds what must be observed as it happens - route
// latency, the KV hit rate of each decision, queue waits (histograms) and NATS reconnects - and
// renders both. Names follow Dynamo's where Dynamo has the quantity
// (dynamo_component_router_requests_started_total, dynamo_component_router_kv_hit_rate,
// dynamo_component_kv_cache_events_applied{status}, dynamo_frontend_router_queue_pending_requests,
// dynamo_frontend_router_queue_wait_seconds); the rest are kvrouter_*. Per-rank series carry
// worker_id and dp_rank (decimal); at most kMaxRankSeries ranks are exported.
//
// Thread contract: RouterMetrics' Observe/Count are thread-safe (prometheus-cpp's atomics);
// Render may run concurrently with them. MetricSet is single-threaded.
//
//   RouterMetrics m;  m.ObserveRoute("route", 0.0002);  std::string text = m.Render(stats, info);
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "events/router_endpoints_codec.h"

namespace kvrouter {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class MetricSet {
 public:
  void Counter(std::string_view name, std::string_view help, double value, const MetricLabels& labels = {});
  void Gauge(std::string_view name, std::string_view help, double value, const MetricLabels& labels = {});
  // Every family added, in the order of first use.
  std::vector<prometheus::MetricFamily> Take() { return std::move(families_); }

 private:
  prometheus::MetricFamily& Family(std::string_view name, std::string_view help, prometheus::MetricType type);
  std::vector<prometheus::MetricFamily> families_;
  std::map<std::string, std::size_t, std::less<>> index_;
};

// Renders families (and more families) as Prometheus text.
std::string RenderMetrics(std::vector<prometheus::MetricFamily> families);

// What the router is doing, for kvrouter_info and the approximate-mode gauge.
struct RouterInfo {
  std::string mode;          // --router-mode
  bool kv_events = true;     // false: approximate mode (--no-router-kv-events)
  bool approximate = false;  // predicting caches from its own decisions
  bool recovery = true;
  bool replica_sync = false;
};

class RouterMetrics {
 public:
  static constexpr std::uint32_t kMaxRankSeries = 10000;

  RouterMetrics();
  // A request handled by a route endpoint (RouteKindName, events/subjects.h) in `seconds`.
  void ObserveRoute(std::string_view endpoint, double seconds);
  // A decision: its KV hit rate (overlap / request blocks) and, if it was queued, its wait.
  void ObserveDecision(const RouteReply& reply);
  // A NATS connection ("requests", "events") came back.
  void CountReconnect(std::string_view connection);

  // The observed families plus those made from `stats` (every rank, from the service).
  std::string Render(const StatsReply& stats, const RouterInfo& info) const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::map<std::string, prometheus::Histogram*, std::less<>> route_seconds_;
  prometheus::Histogram* hit_rate_ = nullptr;
  prometheus::Histogram* queue_wait_ = nullptr;
  std::map<std::string, prometheus::Counter*, std::less<>> reconnects_;
};

}  // namespace kvrouter
