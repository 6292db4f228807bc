// Gateway's set-up, metrics and admin endpoints (gateway.h).
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <random>

#include "router/common/metrics.h"
#include "router/kvgateway/exchange.h"

namespace kvrouter {

Gateway::Gateway(const GatewayConfig& config, HttpClient& client, RouterLink& link)
    : config_(config),
      client_(client),
      link_(link),
      id_prefix_(fmt::format("gw-{:x}-", std::random_device{}())),
      registry_(std::make_shared<prometheus::Registry>()) {
  if (!config_.render_url.empty()) {
    if (auto e = ParseHttpUrl(config_.render_url); e.ok()) render_endpoint_ = *e;
  }
  requests_ = &prometheus::BuildCounter()
                   .Name("kvgateway_requests_total")
                   .Help("requests answered, by endpoint and HTTP status")
                   .Register(*registry_);
  auto counter = [&](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_).Add({});
  };
  retries_ = counter("kvgateway_retries_total",
                     "requests routed again after an engine failed before its answer reached the client");
  clients_gone_ = counter("kvgateway_clients_gone_total",
                          "clients that went away before their response ended (the engine connection is closed)");
  slow_clients_ = counter("kvgateway_slow_clients_total",
                          "responses whose engine read was paused for a client that let kClientHighWater pile up");
  render_fallbacks_ = counter("kvgateway_render_fallbacks_total",
                              "token ids taken from /tokenize because the render endpoint was missing");
  router_fallbacks_ = counter("kvgateway_router_fallbacks_total",
                              "requests sent to the least loaded engine unrendered because no router answered "
                              "(--router-fallback least-loaded)");
  in_flight_ = &prometheus::BuildGauge()
                    .Name("kvgateway_requests_in_flight")
                    .Help("completion requests being served")
                    .Register(*registry_)
                    .Add({});
  const prometheus::Histogram::BucketBoundaries latency = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                           0.1,    0.25,  0.5,    1,     2.5,  5,     10};
  auto histogram = [&](const char* name, const char* help) {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_).Add({}, latency);
  };
  ttfb_ = histogram("kvgateway_time_to_first_byte_seconds",
                    "from a completion request's arrival to the engine's first response byte");
  route_time_ =
      histogram("kvgateway_route_seconds", "from a completion request's arrival to the engine call: render and route");
  inter_chunk_ = histogram("kvgateway_inter_chunk_seconds", "time between two response chunks of an engine");
  disagg_requests_ = &prometheus::BuildCounter()
                          .Name("kvgateway_disagg_requests_total")
                          .Help("route answers of requests to a fleet with prefill and decode workers, by path: "
                                "disaggregated (two legs), local (whole to a decode worker), fallback (whole, every "
                                "prefill worker excluded)")
                          .Register(*registry_);
  disagg_disaggregated_ = &disagg_requests_->Add({{"path", "disaggregated"}});
  disagg_local_ = &disagg_requests_->Add({{"path", "local"}});
  disagg_fallback_ = &disagg_requests_->Add({{"path", "fallback"}});
  prefill_leg_ = histogram("kvgateway_prefill_leg_seconds",
                           "a disaggregated request's prefill leg, from its call to its whole answer");
  decode_wait_ = histogram("kvgateway_decode_wait_seconds",
                           "from a prefill leg's answer to its decode leg's first response byte");
}

HttpRequestHandler Gateway::Handler() {
  return
      [this](HttpRequest request, std::shared_ptr<HttpReply> reply) { Handle(std::move(request), std::move(reply)); };
}

bool Gateway::Ready(SteadyTime now) const {
  // With the fallback, a router going away does not take every gateway out of a load balancer
  // at once: they go on serving by load.
  if (draining_.load() || directory_.size() == 0) return false;
  if (!RouterDown(now)) return true;
  // Only the start's grace counts here: after a NATS restart every gateway waits for a router at
  // once, and none turns 503 for it (requests are served meanwhile: routed, or falling back).
  if (config_.router_fallback != RouterFallback::kLeastLoaded || now - started_ < kRouterGrace) return false;
  // While NATS is down the directory keeps every engine: ready while one the fallback may pick
  // has not just failed.
  std::vector<std::uint64_t> alone;
  for (std::uint64_t id : directory_.Ids()) {
    if (directory_.ServesAlone(id)) alone.push_back(id);
  }
  return engine_load_.AnyHealthy(alone, now);
}

bool Gateway::SkipsRouter(SteadyTime now) const {
  if (!FallsBack(now)) return false;
  if (!nats_connected_.load()) return true;
  return now - SteadyTime(SteadyTime::duration(grace_from_.load())) >= kRouterGrace;
}

void Gateway::SetNatsConnected(bool connected) {
  // The grace starts before a request can see NATS up (SkipsRouter reads them in that order).
  if (connected) grace_from_ = std::chrono::steady_clock::now().time_since_epoch().count();
  nats_connected_ = connected;
  if (connected) {
    directory_.Resume(std::chrono::steady_clock::now());
  } else {
    directory_.Pause();
  }
  link_.SetConnected(connected);
}

void Gateway::DropPools(const std::vector<std::string>& urls) {
  for (const std::string& url : urls) {
    if (auto e = ParseHttpUrl(url); e.ok()) client_.DropIdle(*e);
  }
}

void Gateway::Count(std::string_view endpoint, int status) {
  auto add = [&] { return &requests_->Add({{"endpoint", std::string(endpoint)}, {"code", std::to_string(status)}}); };
  if (status < 100 || status >= 600) return add()->Increment();
  auto& slot = requests_by_code_[endpoint == "chat"][static_cast<std::size_t>(status - 100)];
  prometheus::Counter* c = slot.load(std::memory_order_acquire);
  if (c == nullptr) {
    c = add();  // the family gives every caller the same series
    slot.store(c, std::memory_order_release);
  }
  c->Increment();
}

void Gateway::Models(const std::shared_ptr<HttpReply>& reply) const {
  nlohmann::json data = nlohmann::json::array();
  for (const std::string& m : directory_.Models()) {
    data.push_back({{"id", m}, {"object", "model"}, {"owned_by", "kvrouter"}});
  }
  reply->Send(200, {{"content-type", "application/json"}},
              DumpJson(nlohmann::json{{"object", "list"}, {"data", std::move(data)}}));
}

std::string Gateway::MetricsText(const HttpListener::Counters& http) const {
  MetricSet m;
  m.Counter("kvgateway_connections_total", "client connections accepted", double(http.connections));
  m.Gauge("kvgateway_connections_open", "client connections open", double(http.open));
  m.Gauge("kvgateway_requests_under_way", "requests handed to the handler whose response has not ended",
          double(http.under_way));
  m.Counter("kvgateway_memory_releases_total", "free memory given back to the system after a burst of requests",
            double(http.memory_releases));
  m.Counter("kvgateway_connections_refused_total", "connections closed at accept (--max-connections)",
            double(http.refused));
  m.Counter("kvgateway_bad_requests_total", "requests refused before the handler (400, 413, 431)",
            double(http.bad_requests));
  m.Counter("kvgateway_timeouts_total", "connections cut off: slow headers, body or writes, or idle",
            double(http.timeouts));
  m.Gauge("kvgateway_engines", "engines with an http_url known from registrations", double(directory_.size()));
  m.Gauge("kvgateway_router_pending", "route requests waiting for the router", double(link_.pending()));
  m.Gauge("kvgateway_router_up",
          "whether a router answers (1) or none does (0: requests go by --router-fallback, or get 503)",
          RouterDown(std::chrono::steady_clock::now()) ? 0.0 : 1.0);
  m.Gauge("kvgateway_frees_unconfirmed",
          "frees sent that no router answer has confirmed yet (sent again after a NATS loss)",
          double(link_.unconfirmed()));
  auto families = registry_->Collect();
  for (auto& f : m.Take()) families.push_back(std::move(f));
  return RenderMetrics(std::move(families));
}


}  // namespace kvrouter
