#include "router/kvgateway/gateway.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <mutex>
#include <random>
#include <utility>

#include "router/common/metrics.h"

namespace kvrouter {

namespace {

constexpr std::size_t kMaxIdBytes = 256;  // request and session ids, as the router bounds them

std::string_view ErrorType(int status) {
  if (status == 429) return "rate_limit_error";
  return status >= 500 ? "server_error" : "invalid_request_error";
}

double Seconds(SteadyTime::duration d) { return std::chrono::duration<double>(d).count(); }

// The client's x-request-id when it has a usable one (non-empty, at most kMaxIdBytes).
std::optional<std::string> ClientRequestId(const HttpRequest& request) {
  auto id = request.Header("x-request-id");
  if (!id || id->empty() || id->size() > kMaxIdBytes) return std::nullopt;
  return std::string(*id);
}

// The client's headers an engine needs as well: its API key (vLLM's --api-key) and the formats
// it accepts.
void PassClientHeaders(const HttpRequest& request, HttpHeaders& to) {
  for (std::string_view name : {"authorization", "accept"}) {
    if (auto v = request.Header(name)) to.emplace_back(std::string(name), std::string(*v));
  }
}

}  // namespace

struct Gateway::Exchange {
  std::mutex mu;
  std::shared_ptr<HttpReply> reply;
  HttpRequest http;
  OpenAiRequest request;
  std::string endpoint;      // "chat" or "completions", for the counters
  std::string request_id;    // the client's x-request-id, or ours (echoed, sent to the engine)
  std::string booking_base;  // ours, unique per exchange: the router's request id
  std::string session_id;
  std::vector<std::uint32_t> token_ids;
  std::vector<MmItem> mm_items;         // the render answer's features, and the cache_salt
  std::vector<std::uint64_t> allowed;   // workers serving the model
  std::vector<std::uint64_t> excluded;  // workers that failed this request
  std::vector<HttpEndpoint> render_at;
  SteadyTime arrival;
  // The current attempt.
  std::uint32_t attempt = 0;
  std::string booking;  // request id of the attempt's booking: booking_base, "#n" on a retry
  bool booked = false;  // a route reply booked `booking` and it is not freed yet
  RouteReply routed;
  std::shared_ptr<HttpCall> call;  // the engine call running now (render or completion)
  std::uint64_t call_seq = 0;      // of the latest call started
  int engine_status = 0;
  HttpHeaders engine_headers;
  std::string engine_error;  // the body of a 5xx answer, for the message
  bool first_byte = false;   // the engine's first response byte came (this attempt)
  std::string held;          // a plain response's body so far, sent whole when it ends
  bool began = false;        // the response head went to the client
  bool done = false;         // answered, failed or gone: nothing more is sent
  SteadyTime called;         // the engine call started
  SteadyTime last_chunk;
  ResponseTiming timing;       // of the engine's response so far (ttfb_ms once its first byte came)
  bool ttfb_observed = false;  // in the ttfb histogram (once per request, whatever the retries)
  // Render.
  int render_status = 0;
  std::string render_body;
};

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
  slow_clients_ = counter("kvgateway_slow_clients_total", "clients cut off for letting a streamed response pile up");
  render_fallbacks_ = counter("kvgateway_render_fallbacks_total",
                              "token ids taken from /tokenize because the render endpoint was missing");
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
}

HttpRequestHandler Gateway::Handler() {
  return
      [this](HttpRequest request, std::shared_ptr<HttpReply> reply) { Handle(std::move(request), std::move(reply)); };
}

bool Gateway::Ready(SteadyTime now) const {
  return nats_connected_.load() && link_.Answering(now) && directory_.size() > 0;
}

void Gateway::SetNatsConnected(bool connected) {
  nats_connected_ = connected;
  if (connected) {
    directory_.Resume(std::chrono::steady_clock::now());
  } else {
    directory_.Pause();
  }
  link_.SetConnected(connected);
}

void Gateway::Count(std::string_view endpoint, int status) {
  requests_->Add({{"endpoint", std::string(endpoint)}, {"code", std::to_string(status)}}).Increment();
}

void Gateway::Models(const std::shared_ptr<HttpReply>& reply) const {
  nlohmann::json data = nlohmann::json::array();
  for (const std::string& m : directory_.Models()) {
    data.push_back({{"id", m}, {"object", "model"}, {"owned_by", "kvrouter"}});
  }
  reply->Send(200, {{"content-type", "application/json"}},
              DumpJson(nlohmann::json{{"object", "list"}, {"data", std::move(data)}}));
}

void Gateway::Handle(HttpRequest request, std::shared_ptr<HttpReply> reply) {
  const std::string_view path = request.Path();
  const bool get = request.method == "GET";
  const bool post = request.method == "POST";
  auto error = [&](int status, std::string_view code, std::string_view message, HttpHeaders h = {}) {
    h.emplace_back("content-type", "application/json");
    if (auto id = ClientRequestId(request)) h.emplace_back("x-request-id", *id);
    reply->Send(status, std::move(h), OpenAiError(message, ErrorType(status), code));
  };
  if (path == "/health") return reply->Send(get ? 200 : 405, {{"content-type", "text/plain"}}, "ok\n");
  if (path == "/ready") {
    const bool ready = Ready(std::chrono::steady_clock::now());
    return reply->Send(ready ? 200 : 503, {{"content-type", "text/plain"}}, ready ? "ready\n" : "not ready\n");
  }
  if (path == "/metrics") {
    return reply->Send(200, {{"content-type", "text/plain; version=0.0.4"}},
                       MetricsText(http_counters_ ? http_counters_() : HttpListener::Counters{}));
  }
  if (path == "/v1/models") {
    if (!get) return error(405, "method_not_allowed", "use GET");
    return Models(reply);
  }
  ApiKind kind;
  if (path == ApiPath(ApiKind::kChat)) {
    kind = ApiKind::kChat;
  } else if (path == ApiPath(ApiKind::kCompletions)) {
    kind = ApiKind::kCompletions;
  } else {
    return error(404, "not_found", fmt::format("no route for {}", path.substr(0, 128)));
  }
  const std::string endpoint = kind == ApiKind::kChat ? "chat" : "completions";
  if (!post) {
    Count(endpoint, 405);
    return error(405, "method_not_allowed", "use POST");
  }
  auto parsed = ParseOpenAiRequest(kind, request.body);
  if (!parsed.ok()) {
    Count(endpoint, 400);
    return error(400, "invalid_request", parsed.status().message());
  }
  if (!nats_connected_.load()) {  // before the render call: no router could take the request
    Count(endpoint, 503);
    return error(503, "no_workers", RouterLink::kNotConnected, {{"retry-after", "1"}});
  }
  auto x = std::make_shared<Exchange>();
  x->allowed = directory_.Serving(parsed->model);
  if (x->allowed.empty()) {
    Count(endpoint, 404);
    return error(404, "model_not_found",
                 fmt::format("no registered worker serves the model '{}'", parsed->model.substr(0, 256)));
  }
  x->reply = std::move(reply);
  x->request = std::move(parsed).value();
  x->endpoint = endpoint;
  x->arrival = std::chrono::steady_clock::now();
  x->booking_base = id_prefix_ + std::to_string(++next_id_);
  x->request_id = ClientRequestId(request).value_or(x->booking_base);
  auto session = request.Header("x-session-id");
  if (!session) session = request.Header("x-dynamo-session-id");
  if (session && session->size() <= kMaxIdBytes) x->session_id = std::string(*session);
  x->http = std::move(request);
  if (render_endpoint_) {
    x->render_at.push_back(*render_endpoint_);
  } else {
    // The engines serving the model, starting at a different one each time.
    const std::size_t n = x->allowed.size();
    const std::size_t start = next_id_.load() % n;
    for (std::size_t k = 0; k < n; ++k) {
      if (auto url = directory_.HttpUrl(x->allowed[(start + k) % n])) {
        if (auto e = ParseHttpUrl(*url); e.ok()) x->render_at.push_back(*e);
      }
    }
  }
  in_flight_->Increment();
  std::weak_ptr<Exchange> weak = x;
  x->reply->OnClientGone([this, weak] {
    auto ex = weak.lock();
    if (!ex) return;
    std::shared_ptr<HttpCall> call;
    {
      std::lock_guard g(ex->mu);
      if (ex->done) return;
      ex->done = true;
      call = ex->call;
    }
    clients_gone_->Increment();
    if (call) call->Cancel();  // the engine sees its client go and aborts
    Free(ex);
    Count(ex->endpoint, 499);
    in_flight_->Decrement();
  });
  if (x->render_at.empty())
    return Fail(x, 503, "no_workers", "no engine serving the model has a usable http_url", {{"retry-after", "1"}});
  Render(x, 0, false);
}

void Gateway::Render(const std::shared_ptr<Exchange>& x, std::size_t candidate, bool tokenize) {
  HttpCallSpec spec{.method = "POST",
                    .target = std::string(tokenize ? std::string_view("/tokenize") : RenderPath(x->request.kind)),
                    .headers = {{"content-type", "application/json"}},
                    .body = tokenize ? x->request.tokenize_body : x->http.body,
                    .head_timeout = std::chrono::milliseconds(config_.engine_timeout_ms),
                    .read_timeout = std::chrono::milliseconds(config_.engine_timeout_ms)};
  PassClientHeaders(x->http, spec.headers);
  std::uint64_t seq = 0;
  {
    std::lock_guard g(x->mu);
    if (x->done) return;
    x->render_status = 0;
    x->render_body.clear();
    seq = ++x->call_seq;
  }
  // The callbacks own the exchange while the call runs (the call drops them when it is done).
  auto call = client_.Start(
      x->render_at[candidate], std::move(spec),
      {.on_head =
           [x](int status, const HttpHeaders&) {
             std::lock_guard g(x->mu);
             x->render_status = status;
           },
       .on_data =
           [x](std::string_view d) {
             std::lock_guard g(x->mu);
             if (x->render_body.size() + d.size() <= kMaxRenderBytes) x->render_body.append(d);
           },
       .on_done =
           [this, ex = x, candidate, tokenize](const Status& s) {
             int status = 0;
             std::string body;
             {
               std::lock_guard g(ex->mu);
               if (ex->done) return;
               ex->call.reset();
               status = ex->render_status;
               body = std::move(ex->render_body);
             }
             if (!s.ok() || status >= 500) {  // that engine cannot render now: another one may
               if (candidate + 1 < ex->render_at.size() && !stopping_.load())
                 return Render(ex, candidate + 1, tokenize);
               return Fail(ex, 502, "render_failed",
                           fmt::format("no engine could render the prompt: {}",
                                       s.ok() ? fmt::format("status {}", status) : s.message()));
             }
             if (status == 404 && !tokenize) {
               render_fallbacks_->Increment();
               return Render(ex, candidate, true);
             }
             if (status != 200) {
               return Fail(ex, status == 404 ? 502 : 400, "invalid_request",
                           fmt::format("the engine refused the prompt ({}): {}", status, body.substr(0, 512)));
             }
             auto rendered = [&]() -> Result<RenderedPrompt> {
               if (!tokenize) return ParseRenderAnswer(ex->request.kind, body);
               auto ids = ParseTokenizeAnswer(body);
               if (!ids.ok()) return ids.status();
               return RenderedPrompt{.token_ids = std::move(ids).value()};
             }();
             if (!rendered.ok()) return Fail(ex, 502, "render_failed", rendered.status().message());
             ex->mm_items = RouteItems(ex->request, *rendered);
             ex->token_ids = std::move(rendered->token_ids);
             Route(ex);
           }});
  KeepCall(x, seq, std::move(call));
}

void Gateway::Route(const std::shared_ptr<Exchange>& x) {
  RouteRequest r;
  {
    std::lock_guard g(x->mu);
    if (x->done) return;
    x->booking = x->attempt == 0 ? x->booking_base : fmt::format("{}#{}", x->booking_base, x->attempt);
    r.request_id = x->booking;
    r.token_ids = x->token_ids;
    r.mm_items = x->mm_items;
    r.has_token_ids = true;
    r.isl = static_cast<std::uint32_t>(r.token_ids.size());
    r.allowed_worker_ids = x->allowed;
    if (!x->excluded.empty()) r.excluded_worker_ids = x->excluded;
    r.session_id = x->session_id;
  }
  const std::string booking = r.request_id;
  link_.Route(r, [this, ex = x, booking](Result<RouteReply> routed) {
    bool gone = false;
    {
      std::lock_guard g(ex->mu);
      gone = ex->done;
      if (!gone && routed.ok()) {
        ex->booked = true;
        ex->routed = *routed;
      }
    }
    if (gone) {
      if (routed.ok()) link_.Free(booking);  // the client left while the router decided
      return;
    }
    if (routed.ok()) {
      if (stopping_.load()) return Fail(ex, 503, "shutting_down", "the gateway is stopping");
      route_time_->Observe(Seconds(std::chrono::steady_clock::now() - ex->arrival));
      return Forward(ex);
    }
    const Status& s = routed.status();
    switch (s.code()) {
      case StatusCode::kOverloaded:
      case StatusCode::kTimeout:
        return Fail(ex, 429, "overloaded", "every worker is busy: " + s.message(), {{"retry-after", "1"}});
      case StatusCode::kInvalidArgument: return Fail(ex, 400, "invalid_request", s.message());
      case StatusCode::kNoWorkers:
      case StatusCode::kNotFound:
        if (ex->attempt > 0 && nats_connected_.load()) {
          return Fail(ex, 502, "engine_failed", "every engine tried failed: " + s.message());
        }
        return Fail(ex, 503, "no_workers", s.message(), {{"retry-after", "1"}});
      default: return Fail(ex, 502, "router_error", s.message());
    }
  });
}

namespace {

// The engine's headers passed on, with the request id and the router's choice (under ex.mu).
HttpHeaders ResponseHead(const Gateway::Exchange& ex) {
  HttpHeaders h = ex.engine_headers;
  h.emplace_back("x-request-id", ex.request_id);
  h.emplace_back("x-kvrouter-worker-id", std::to_string(ex.routed.worker_id));
  h.emplace_back("x-kvrouter-cached-tokens", std::to_string(ex.routed.cached_tokens));
  return h;
}

}  // namespace

void Gateway::Forward(const std::shared_ptr<Exchange>& x) {
  std::string url;
  std::uint64_t worker = 0;
  {
    std::lock_guard g(x->mu);
    worker = x->routed.worker_id;
    url = x->routed.http_url;
  }
  if (url.empty()) url = directory_.HttpUrl(worker).value_or("");
  auto endpoint = ParseHttpUrl(url);
  if (!endpoint.ok()) return Retry(x, fmt::format("worker {} has no usable http_url", worker));
  HttpCallSpec spec{.method = "POST",
                    .target = x->http.target,
                    .headers = {{"content-type", "application/json"}, {"x-request-id", x->request_id}},
                    .body = x->http.body,
                    .head_timeout = std::chrono::milliseconds(config_.engine_timeout_ms),
                    .read_timeout = std::chrono::milliseconds(config_.engine_timeout_ms)};
  PassClientHeaders(x->http, spec.headers);
  std::uint64_t seq = 0;
  {
    std::lock_guard g(x->mu);
    if (x->done) return;
    x->called = std::chrono::steady_clock::now();
    x->timing = {};
    seq = ++x->call_seq;
  }
  auto call = client_.Start(
      *endpoint, std::move(spec),
      {.on_head =
           [ex = x](int status, const HttpHeaders& headers) {
             std::lock_guard g(ex->mu);
             ex->engine_status = status;
             ex->engine_headers.clear();
             for (const auto& [k, v] : headers) {
               if (k == "content-type" || k == "cache-control") ex->engine_headers.emplace_back(k, v);
             }
           },
       .on_data =
           [this, ex = x](std::string_view d) {
             bool first = false;
             bool slow = false;
             std::shared_ptr<HttpCall> engine_call;
             {
               std::lock_guard g(ex->mu);
               if (ex->done) return;
               if (ex->engine_status >= 500) {  // not for the client: the request goes elsewhere
                 if (ex->engine_error.size() < 4096) ex->engine_error.append(d.substr(0, 4096));
                 return;
               }
               const SteadyTime now = std::chrono::steady_clock::now();
               if (!ex->first_byte) {
                 ex->first_byte = true;
                 first = true;
                 if (!std::exchange(ex->ttfb_observed, true)) ttfb_->Observe(Seconds(now - ex->arrival));
                 ex->timing.ttfb_ms = Seconds(now - ex->called) * 1000;
               } else {
                 const double gap = Seconds(now - ex->last_chunk);
                 inter_chunk_->Observe(gap);
                 ResponseTiming& t = ex->timing;
                 t.inter_chunk_ms_mean += (gap * 1000 - t.inter_chunk_ms_mean) / static_cast<double>(t.chunks);
                 t.inter_chunk_ms_max = std::max(t.inter_chunk_ms_max, gap * 1000);
               }
               ++ex->timing.chunks;
               ex->last_chunk = now;
               // A plain response goes to the client whole when it ends, with its length, in one
               // write; a streamed one (or a plain one past kMaxHeldBody) chunk by chunk as it comes.
               if (!ex->began && !ex->request.stream && ex->held.size() + d.size() <= kMaxHeldBody) {
                 ex->held.append(d);
               } else if (!ex->began) {
                 ex->began = true;
                 ex->reply->Begin(ex->engine_status, ResponseHead(*ex));
                 ex->held.append(d);
                 ex->reply->Write(std::exchange(ex->held, {}));
               } else {
                 ex->reply->Write(std::string(d));
               }
               if (ex->reply->Backlog() > kMaxClientBacklog) {
                 slow = true;
                 ex->done = true;
                 engine_call = ex->call;
                 ex->reply->Abort();
               }
             }
             if (first) link_.MarkPrefill(ex->booking);
             if (slow) {
               slow_clients_->Increment();
               if (engine_call) engine_call->Cancel();
               Free(ex);
               Count(ex->endpoint, 499);
               in_flight_->Decrement();
             }
           },
       .on_done =
           [this, ex = x](const Status& s) {
             bool began = false;
             int status = 0;
             std::string error;
             {
               std::lock_guard g(ex->mu);
               if (ex->done) return;
               ex->call.reset();
               began = ex->began;
               status = ex->engine_status;
               error = std::move(ex->engine_error);
             }
             if (!began && (!s.ok() || status >= 500)) {
               // Nothing reached the client. A client error the engine broke off in the middle of
               // is not another engine's to answer.
               if (!s.ok() && status >= 400 && status < 500) {
                 return Fail(ex, 502, "engine_failed", "the engine's answer broke off: " + s.message());
               }
               return Retry(
                   ex, s.ok() ? fmt::format("the engine answered {}: {}", status, error.substr(0, 256)) : s.message());
             }
             {
               std::lock_guard g(ex->mu);
               ex->done = true;
               if (!s.ok()) {
                 ex->reply->Abort();  // cut off mid-response: the client sees the connection end
               } else if (!ex->began) {  // a plain response (or an empty body): whole
                 ex->reply->Send(status, ResponseHead(*ex), std::exchange(ex->held, {}));
               } else {
                 ex->reply->End();
               }
             }
             Free(ex);
             Count(ex->endpoint, s.ok() ? status : 502);
             in_flight_->Decrement();
           }});
  KeepCall(x, seq, std::move(call));
}

void Gateway::KeepCall(const std::shared_ptr<Exchange>& x, std::uint64_t seq, std::shared_ptr<HttpCall> call) {
  {
    std::lock_guard g(x->mu);
    if (!x->done) {
      // A later call started meanwhile (this one ended already and the exchange went on): that
      // one is the call to cancel.
      if (x->call_seq == seq) x->call = std::move(call);
      return;
    }
  }
  call->Cancel();  // the client went (or the exchange ended) while the call was being started
}

void Gateway::Retry(const std::shared_ptr<Exchange>& x, const std::string& why) {
  Free(x);
  if (stopping_.load()) return Fail(x, 503, "shutting_down", "the gateway is stopping");
  std::uint32_t attempt = 0;
  {
    std::lock_guard g(x->mu);
    if (x->done) return;
    x->excluded.push_back(x->routed.worker_id);
    attempt = ++x->attempt;
    x->engine_status = 0;
    x->engine_headers.clear();
    x->first_byte = false;
    x->held.clear();
  }
  log_.Log(LogLevel::kWarning, "engine-failed", "request {}: worker failed before its answer reached the client: {}",
           x->request_id, why);
  if (attempt > config_.retries) {
    return Fail(x, 502, "engine_failed", fmt::format("the engine failed after {} tries: {}", attempt, why));
  }
  retries_->Increment();
  Route(x);
}

void Gateway::Fail(const std::shared_ptr<Exchange>& x, int status, std::string_view code, const std::string& message,
                   HttpHeaders extra) {
  {
    std::lock_guard g(x->mu);
    if (x->done) return;
    x->done = true;
    if (x->began) {
      x->reply->Abort();
    } else {
      extra.emplace_back("content-type", "application/json");
      extra.emplace_back("x-request-id", x->request_id);
      x->reply->Send(status, std::move(extra), OpenAiError(message, ErrorType(status), code));
    }
  }
  Free(x);
  Count(x->endpoint, status);
  in_flight_->Decrement();
}

void Gateway::Free(const std::shared_ptr<Exchange>& x) {
  std::string booking;
  std::optional<ResponseTiming> timing;
  {
    std::lock_guard g(x->mu);
    if (!x->booked) return;
    x->booked = false;
    booking = x->booking;
    // A streamed 200 only: a plain response's first byte comes after the whole generation, an
    // error's says nothing of the engine's speed.
    if (x->began && x->request.stream && x->engine_status == 200) timing = x->timing;
  }
  link_.Free(booking, timing);
}

std::string Gateway::MetricsText(const HttpListener::Counters& http) const {
  MetricSet m;
  m.Counter("kvgateway_connections_total", "client connections accepted", double(http.connections));
  m.Gauge("kvgateway_connections_open", "client connections open", double(http.open));
  m.Counter("kvgateway_connections_refused_total", "connections closed at accept (--max-connections)",
            double(http.refused));
  m.Counter("kvgateway_bad_requests_total", "requests refused before the handler (400, 413, 431)",
            double(http.bad_requests));
  m.Counter("kvgateway_timeouts_total", "connections cut off: slow headers, body or writes, or idle",
            double(http.timeouts));
  m.Gauge("kvgateway_engines", "engines with an http_url known from registrations", double(directory_.size()));
  m.Gauge("kvgateway_router_pending", "route requests waiting for the router", double(link_.pending()));
  m.Gauge("kvgateway_frees_unconfirmed",
          "frees sent that no router answer has confirmed yet (sent again after a NATS loss)",
          double(link_.unconfirmed()));
  auto families = registry_->Collect();
  for (auto& f : m.Take()) families.push_back(std::move(f));
  return RenderMetrics(std::move(families));
}

}  // namespace kvrouter
