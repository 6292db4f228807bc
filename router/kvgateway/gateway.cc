#include "router/kvgateway/gateway.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <mutex>
#include <random>
#include <utility>

#include "router/common/metrics.h"
#include "router/kvgateway/headers.h"

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

// 504's message: the engine has the request (`s` is HttpClient's kTimeout) and is not answering;
// another engine is not asked, which would run it a second time.
std::string EngineTimeoutMessage(std::uint64_t worker, std::uint32_t timeout_ms, const Status& s) {
  return fmt::format("worker {} took the request and did not answer within {} ms (--engine-timeout-ms); it is not "
                     "sent to another engine, which would run it again: {}",
                     worker, timeout_ms, s.message());
}

// The client's end-to-end headers go to the engine: its API key (vLLM's --api-key), the
// formats it accepts, the trace context (traceparent, tracestate, baggage), ...
void PassClientHeaders(const HttpRequest& request, HttpHeaders& to) { ForwardRequestHeaders(request.headers, to); }

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
  bool fallback = false;  // no router answered: the gateway picks the engines (Fallback), nothing is booked
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
  bool engine_broke = false;   // the engine's response broke off: its timing is not its speed
  bool read_paused = false;    // the engine call is paused until the client drains (back-pressure)
  bool slowed = false;         // it was paused at least once (kvgateway_slow_clients_total)
  // Section 13: the legs of a disaggregated attempt (routed.disaggregated).
  std::string leg_body;                    // the decode leg's body ("": the client's, unchanged)
  std::shared_ptr<HttpCall> prefill_call;  // the prefill leg running now
  std::uint64_t prefill_seq = 0;           // of the latest prefill leg started
  int prefill_status = 0;
  HttpHeaders prefill_headers;  // its answer's headers a client gets, when that answer is the client's
  std::string prefill_body;     // its answer so far, up to kMaxHeldBody
  bool prefill_overflow = false;  // its answer went past kMaxHeldBody
  bool prefill_answered = false;  // its answer came whole (prefill_done sent)
  std::optional<std::uint32_t> prefill_cached;  // the prefill engine's usage cached_tokens
  SteadyTime prefill_called;
  SteadyTime prefill_end;  // when its answer came
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
  return config_.router_fallback == RouterFallback::kLeastLoaded && now - started_ >= kRouterGrace;
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

void Gateway::Handle(HttpRequest request, std::shared_ptr<HttpReply> reply) {
  const std::string_view path = request.Path();
  const bool get = request.method == "GET";
  const bool post = request.method == "POST";
  auto error = [&](int status, std::string_view code, std::string_view message, HttpHeaders h = {}) {
    h.emplace_back("content-type", "application/json");
    if (auto id = ClientRequestId(request)) h.emplace_back("x-request-id", *id);
    reply->Send(status, std::move(h), OpenAiError(message, ErrorType(status), code));
  };
  // /health and /ready stay on the API port as well: a load balancer probes the port it sends
  // to, and /ready's 503 while draining must reach it there. /metrics (the fleet's insides) is
  // only on --metrics-port, which need not be reachable from where the clients are.
  if (path == "/health") return reply->Send(get ? 200 : 405, {{"content-type", "text/plain"}}, "ok\n");
  if (path == "/ready") {
    const bool ready = Ready(std::chrono::steady_clock::now());
    return reply->Send(ready ? 200 : 503, {{"content-type", "text/plain"}}, ready ? "ready\n" : "not ready\n");
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
  const bool fallback = FallsBack(std::chrono::steady_clock::now());
  if (!nats_connected_.load() && !fallback) {  // before the render call: no router could take the request
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
    std::shared_ptr<HttpCall> call, prefill;
    {
      std::lock_guard g(ex->mu);
      if (ex->done) return;
      ex->done = true;
      call = ex->call;
      prefill = ex->prefill_call;
    }
    clients_gone_->Increment();
    if (call) call->Cancel();  // the engine sees its client go and aborts
    if (prefill) prefill->Cancel();  // and so does a prefill engine (no decode leg starts after it)
    Free(ex);
    Count(ex->endpoint, 499);
    in_flight_->Decrement();
  });
  if (fallback) return Fallback(x);  // no render call: its token ids would serve no router
  if (x->render_at.empty())
    return Fail(x, 503, "no_workers", "no engine serving the model has a usable http_url", {{"retry-after", "1"}});
  Render(x, 0, false);
}

void Gateway::Render(const std::shared_ptr<Exchange>& x, std::size_t candidate, bool tokenize) {
  HttpCallSpec spec{.method = "POST",
                    .target = std::string(tokenize ? std::string_view("/tokenize") : RenderPath(x->request.kind)),
                    .headers = {{"content-type", "application/json"}},
                    .body = tokenize ? x->request.tokenize_body : x->http.body,
                    .connect_timeout = std::chrono::milliseconds(config_.engine_connect_timeout_ms),
                    .head_timeout = std::chrono::milliseconds(config_.render_timeout_ms),
                    .read_timeout = std::chrono::milliseconds(config_.render_timeout_ms)};
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
  KeepCall(x, 0, seq, std::move(call));  // rendering comes before the first route
}

void Gateway::Route(const std::shared_ptr<Exchange>& x) {
  RouteRequest r;
  std::uint32_t attempt = 0;
  {
    std::lock_guard g(x->mu);
    if (x->done) return;
    attempt = x->attempt;
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
  link_.Route(r, [this, ex = x, booking, attempt](Result<RouteReply> routed) {
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
      CountDisaggPath(ex);
      return routed->disaggregated ? Disaggregate(ex, attempt) : Forward(ex, attempt);
    }
    const Status& s = routed.status();
    const bool router_gone = s.code() == StatusCode::kNoWorkers || s.code() == StatusCode::kTimeout;
    if (router_gone && FallsBack(std::chrono::steady_clock::now()) && !stopping_.load()) return Fallback(ex);
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
  if (ex.routed.disaggregated) {
    h.emplace_back("x-kvrouter-prefill-worker-id", std::to_string(ex.routed.prefill_worker_id));
  }
  if (ex.fallback) {
    h.emplace_back("x-kvrouter-fallback", "least-loaded");
  } else {
    h.emplace_back("x-kvrouter-cached-tokens", std::to_string(ex.routed.cached_tokens));
  }
  return h;
}

}  // namespace

Result<HttpEndpoint> Gateway::EngineEndpoint(std::uint64_t worker, std::string url) const {
  if (url.empty()) url = directory_.HttpUrl(worker).value_or("");
  return ParseHttpUrl(url);
}

HttpCallSpec Gateway::EngineCall(const Exchange& x, std::string body) const {
  HttpCallSpec spec{.method = "POST",
                    .target = x.http.target,
                    .headers = {{"content-type", "application/json"}, {"x-request-id", x.request_id}},
                    .body = std::move(body),
                    .connect_timeout = std::chrono::milliseconds(config_.engine_connect_timeout_ms),
                    .head_timeout = std::chrono::milliseconds(config_.engine_timeout_ms),
                    .read_timeout = std::chrono::milliseconds(config_.engine_timeout_ms)};
  PassClientHeaders(x.http, spec.headers);
  return spec;
}

void Gateway::Forward(const std::shared_ptr<Exchange>& x, std::uint32_t attempt) {
  std::string url;
  std::uint64_t worker = 0;
  std::string body;
  {
    std::lock_guard g(x->mu);
    if (x->done || x->attempt != attempt) return;
    worker = x->routed.worker_id;
    url = x->routed.http_url;
    body = x->leg_body.empty() ? x->http.body : x->leg_body;
  }
  auto endpoint = EngineEndpoint(worker, std::move(url));
  if (!endpoint.ok()) return Retry(x, attempt, worker, fmt::format("worker {} has no usable http_url", worker));
  HttpCallSpec spec = EngineCall(*x, std::move(body));
  std::uint64_t seq = 0;
  {
    std::lock_guard g(x->mu);
    if (x->done || x->attempt != attempt) return;
    x->called = std::chrono::steady_clock::now();
    x->timing = {};
    seq = ++x->call_seq;
  }
  EngineLoad::Hold load = engine_load_.Add(worker);  // until the call's callbacks are dropped
  auto call = client_.Start(
      *endpoint, std::move(spec),
      {.on_head =
           [ex = x, attempt](int status, const HttpHeaders& headers) {
             std::lock_guard g(ex->mu);
             if (ex->attempt != attempt) return;  // a leg closed by a retry
             ex->engine_status = status;
             ex->engine_headers.clear();
             ForwardResponseHeaders(headers, ex->engine_headers);
           },
       .on_data =
           [this, ex = x, attempt, seq](std::string_view d) {
             bool mark = false;
             std::shared_ptr<HttpCall> pause;  // this call, to pause until the client drains
             bool first_pause = false;
             {
               std::lock_guard g(ex->mu);
               if (ex->done || ex->attempt != attempt) return;
               if (ex->engine_status >= 500) {  // not for the client: the request goes elsewhere
                 if (ex->engine_error.size() < 4096) ex->engine_error.append(d.substr(0, 4096));
                 return;
               }
               const SteadyTime now = std::chrono::steady_clock::now();
               if (!ex->first_byte) {
                 ex->first_byte = true;
                 // A plain answer's first byte is (nearly) its end: free says it all, and a
                 // mark_prefill there would teach the router a prefill (or KV transfer) as long
                 // as the whole generation. Nothing is booked when the gateway fell back.
                 mark = ex->booked && ex->request.stream;
                 if (!std::exchange(ex->ttfb_observed, true)) ttfb_->Observe(Seconds(now - ex->arrival));
                 ex->timing.ttfb_ms = Seconds(now - ex->called) * 1000;
                 if (ex->prefill_answered) decode_wait_->Observe(Seconds(now - ex->prefill_end));
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
               // The call is known once KeepCall kept it; a chunk before that is not paused on
               // (the next one is).
               if (ex->began && !ex->read_paused && ex->call && ex->call_seq == seq &&
                   ex->reply->Backlog() > kClientHighWater) {
                 ex->read_paused = true;
                 first_pause = !std::exchange(ex->slowed, true);
                 pause = ex->call;
               }
             }
             if (mark) link_.MarkPrefill(ex->booking);
             if (pause) {
               if (first_pause) slow_clients_->Increment();
               pause->Pause();  // here, on the call's own thread: before its next read
               std::weak_ptr<Exchange> weak = ex;
               ex->reply->OnDrained(kClientLowWater, [weak, call = std::weak_ptr<HttpCall>(pause)] {
                 if (auto e = weak.lock()) {
                   std::lock_guard g(e->mu);
                   e->read_paused = false;
                 }
                 if (auto c = call.lock()) c->Resume();
               });
             }
           },
       .on_done =
           [this, ex = x, attempt, worker, load](const Status& s) {
             bool began = false;
             int status = 0;
             std::string error;
             std::shared_ptr<HttpCall> prefill_call;
             {
               std::lock_guard g(ex->mu);
               if (ex->done || ex->attempt != attempt) return;
               ex->call.reset();
               began = ex->began;
               status = ex->engine_status;
               error = std::move(ex->engine_error);
             }
             if (!began && s.code() == StatusCode::kTimeout) {
               return Fail(ex, 504, "engine_timeout", EngineTimeoutMessage(worker, config_.engine_timeout_ms, s));
             }
             if (!began && (!s.ok() || status >= 500)) {
               // Nothing reached the client. A client error the engine broke off in the middle of
               // is not another engine's to answer.
               if (!s.ok() && status >= 400 && status < 500) {
                 return Fail(ex, 502, "engine_failed", "the engine's answer broke off: " + s.message());
               }
               return Retry(
                   ex, attempt, worker,
                   s.ok() ? fmt::format("the engine answered {}: {}", status, error.substr(0, 256)) : s.message());
             }
             // The booking is freed before the client has its answer: a client's next turn,
             // sent the moment this one ends, must not find it still booked (a plain answer sends
             // no mark_prefill, so the router holds its prefill tokens until this free).
             std::optional<std::pair<HttpHeaders, std::string>> whole;
             bool end = false;
             {
               std::lock_guard g(ex->mu);
               ex->done = true;  // from here no other path touches ex->reply
               prefill_call = std::move(ex->prefill_call);  // an SGLang prefill leg not ended yet
               if (!s.ok()) {
                 ex->engine_broke = true;
                 ex->reply->Abort();  // cut off mid-response: the client sees the connection end
               } else if (!ex->began) {  // a plain response (or an empty body): whole
                 // A disaggregated answer's prompt cache is the prefill engine's, not the decode
                 // engine's (which received every block).
                 if (ex->prefill_cached && status == 200) {
                   if (auto patched = WithCachedTokens(ex->held, *ex->prefill_cached)) ex->held = std::move(*patched);
                 }
                 whole.emplace(ResponseHead(*ex), std::exchange(ex->held, {}));
               } else {
                 end = true;
               }
             }
             if (prefill_call) prefill_call->Cancel();
             Free(ex);
             if (whole) ex->reply->Send(status, std::move(whole->first), std::move(whole->second));
             if (end) ex->reply->End();
             Count(ex->endpoint, s.ok() ? status : 502);
             in_flight_->Decrement();
           }});
  KeepCall(x, attempt, seq, std::move(call));
}

void Gateway::CountDisaggPath(const std::shared_ptr<Exchange>& x) {
  bool disaggregated = false;
  std::vector<std::uint64_t> allowed, excluded;
  {
    std::lock_guard g(x->mu);
    disaggregated = x->routed.disaggregated;
    if (!disaggregated) {
      allowed = x->allowed;
      excluded = x->excluded;
    }
  }
  prometheus::Counter* path = disagg_disaggregated_;
  if (!disaggregated) {
    // Eligible (protocol.md section 13): the candidates hold prefill and decode workers. Whole
    // to a decode worker with every prefill candidate excluded is the fallback; otherwise the
    // router chose a local prefill (a prefill pool full under --router-queue-threshold reads as
    // local here: the reply does not say which).
    bool decode = false, prefill = false, prefill_usable = false;
    for (std::uint64_t id : allowed) {
      const WorkerRole role = directory_.Role(id);
      decode = decode || role == WorkerRole::kDecode;
      if (role != WorkerRole::kPrefill) continue;
      prefill = true;
      prefill_usable = prefill_usable || std::find(excluded.begin(), excluded.end(), id) == excluded.end();
    }
    if (!decode || !prefill) return;
    path = prefill_usable ? disagg_local_ : disagg_fallback_;
  }
  path->Increment();
}

void Gateway::Disaggregate(const std::shared_ptr<Exchange>& x, std::uint32_t attempt) {
  RouteReply routed;
  {
    std::lock_guard g(x->mu);
    if (x->done || x->attempt != attempt) return;
    routed = x->routed;
  }
  if (routed.kv_connector == "sglang") {
    // One body for both engines, sent to both at once: SGLang's decode engine and prefill engine
    // meet by bootstrap_room, and either waiting for the other's answer could deadlock the
    // transfer.
    auto body = WithFields(x->http.body, {{"bootstrap_host", DumpJson(nlohmann::json(routed.bootstrap_host))},
                                          {"bootstrap_port", std::to_string(routed.bootstrap_port)},
                                          {"bootstrap_room", std::to_string(routed.bootstrap_room)}});
    if (!body.ok()) return Fail(x, 400, "invalid_request", body.status().message());
    {
      std::lock_guard g(x->mu);
      x->leg_body = *body;
    }
    if (!StartPrefillLeg(x, attempt, std::move(body).value())) return;
    return Forward(x, attempt);
  }
  // vLLM's NixlConnector (pull): the prefill leg first, the decode leg with its answer.
  auto body = NixlPrefillBody(x->http.body);
  if (!body.ok()) return Fail(x, 400, "invalid_request", body.status().message());
  StartPrefillLeg(x, attempt, std::move(body).value());
}

bool Gateway::StartPrefillLeg(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, std::string body) {
  std::uint64_t worker = 0;
  std::string url;
  bool sglang = false;
  {
    std::lock_guard g(x->mu);
    if (x->done || x->attempt != attempt) return false;
    worker = x->routed.prefill_worker_id;
    url = x->routed.prefill_http_url;
    sglang = x->routed.kv_connector == "sglang";
  }
  auto endpoint = EngineEndpoint(worker, std::move(url));
  if (!endpoint.ok()) {
    Retry(x, attempt, worker, fmt::format("prefill worker {} has no usable http_url", worker));
    return false;
  }
  HttpCallSpec spec = EngineCall(*x, std::move(body));
  std::uint64_t seq = 0;
  {
    std::lock_guard g(x->mu);
    if (x->done || x->attempt != attempt) return false;
    x->prefill_called = std::chrono::steady_clock::now();
    seq = ++x->prefill_seq;
  }
  EngineLoad::Hold load = engine_load_.Add(worker);
  auto call = client_.Start(
      *endpoint, std::move(spec),
      {.on_head =
           [ex = x, attempt](int status, const HttpHeaders& headers) {
             std::lock_guard g(ex->mu);
             if (ex->attempt != attempt) return;
             ex->prefill_status = status;
             ex->prefill_headers.clear();
             ForwardResponseHeaders(headers, ex->prefill_headers);
           },
       .on_data =
           [ex = x, attempt](std::string_view d) {
             std::lock_guard g(ex->mu);
             if (ex->done || ex->attempt != attempt) return;
             if (ex->prefill_body.size() + d.size() <= kMaxHeldBody) {
               ex->prefill_body.append(d);
             } else {
               ex->prefill_overflow = true;
             }
           },
       .on_done =
           [this, ex = x, attempt, sglang, load](const Status& s) {
             if (sglang) return OnSglangPrefillEnd(ex, attempt, s);
             OnNixlPrefillAnswer(ex, attempt, s);
           }});
  {
    std::lock_guard g(x->mu);
    if (!x->done && x->attempt == attempt) {
      if (x->prefill_seq == seq) x->prefill_call = std::move(call);
      return true;
    }
  }
  call->Cancel();  // the client went (or the attempt was retried) while the leg was being started
  return false;
}

namespace {

// A prefill leg's end as its handler reads it.
struct PrefillEnd {
  int status = 0;
  HttpHeaders headers;  // for the client (ForwardResponseHeaders)
  std::string body;
  bool overflow = false;
  bool began = false;  // the client has the response head
  std::uint64_t worker = 0;
  std::string booking;
  SteadyTime called;
};

// The prefill leg's end, taken from the exchange; nullopt when it is no longer at `attempt`
// (ended, or retried: a leg closed then ends unheard).
std::optional<PrefillEnd> TakePrefillEnd(Gateway::Exchange& x, std::uint32_t attempt) {
  std::lock_guard g(x.mu);
  if (x.done || x.attempt != attempt) return std::nullopt;
  x.prefill_call.reset();
  return PrefillEnd{.status = x.prefill_status,
                    .headers = std::move(x.prefill_headers),
                    .body = std::move(x.prefill_body),
                    .overflow = x.prefill_overflow,
                    .began = x.began,
                    .worker = x.routed.prefill_worker_id,
                    .booking = x.booking,
                    .called = x.prefill_called};
}

std::string PrefillFailure(const Status& s, const PrefillEnd& end) {
  if (!s.ok()) return fmt::format("prefill worker {} failed: {}", end.worker, s.message());
  return fmt::format("prefill worker {} answered {}: {}", end.worker, end.status, end.body.substr(0, 256));
}

}  // namespace

void Gateway::OnNixlPrefillAnswer(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, const Status& s) {
  const SteadyTime now = std::chrono::steady_clock::now();
  auto taken = TakePrefillEnd(*x, attempt);
  if (!taken) return;
  PrefillEnd& end = *taken;
  if (s.code() == StatusCode::kTimeout) {
    return Fail(x, 504, "engine_timeout", EngineTimeoutMessage(end.worker, config_.engine_timeout_ms, s));
  }
  if (!s.ok() || end.status >= 500) return Retry(x, attempt, end.worker, PrefillFailure(s, end));
  if (end.overflow) {
    return Fail(x, 502, "engine_failed", "the prefill engine's answer is larger than the gateway holds");
  }
  // The engine refused the request itself (a 4xx): another engine would too; its answer is the client's.
  if (end.status != 200) {
    return AnswerWhole(x, end.status, "application/json", std::move(end.body), std::move(end.headers));
  }
  auto answer = ParsePrefillAnswer(end.body);
  if (!answer.ok()) return Retry(x, attempt, end.worker, answer.status().message());
  prefill_leg_->Observe(Seconds(now - end.called));
  if (answer->kv_transfer_params.empty() && answer->stopped_at_length && x->request.max_tokens.value_or(2) > 1) {
    // It stopped at the leg's one-token limit yet names no KV to pull: an engine without vLLM's
    // NixlConnector (no --kv-transfer-config). Its one token is not the client's answer.
    return Retry(x, attempt, end.worker,
                 fmt::format("prefill worker {} answered without kv_transfer_params: is its engine started with "
                             "--kv-transfer-config (NixlConnector)?",
                             end.worker));
  }
  if (answer->kv_transfer_params.empty()) {
    // The engine stopped at its one token (end of sequence, a stop string, max_tokens 1): there
    // is nothing to decode, and its answer is the client's.
    if (!x->request.stream) return AnswerWhole(x, 200, "application/json", std::move(end.body), std::move(end.headers));
    auto events = AsEventStream(x->request.kind, end.body, x->request.include_usage);
    if (!events.ok()) return Fail(x, 502, "engine_failed", events.status().message());
    return AnswerWhole(x, 200, "text/event-stream", std::move(events).value(), std::move(end.headers));
  }
  auto body = WithFields(x->http.body, {{"kv_transfer_params", answer->kv_transfer_params}});
  if (!body.ok()) return Fail(x, 400, "invalid_request", body.status().message());
  {
    std::lock_guard g(x->mu);
    if (x->done || x->attempt != attempt) return;
    x->leg_body = std::move(body).value();
    x->prefill_answered = true;
    x->prefill_end = now;
    x->prefill_cached = answer->cached_tokens;
  }
  link_.PrefillDone(end.booking);
  Forward(x, attempt);
}

void Gateway::OnSglangPrefillEnd(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, const Status& s) {
  const SteadyTime now = std::chrono::steady_clock::now();
  auto taken = TakePrefillEnd(*x, attempt);
  if (!taken) return;
  PrefillEnd& end = *taken;
  if (!s.ok() || end.status != 200) {
    // The decode engine would wait for KV that never comes. Before the client has a byte the
    // request goes elsewhere (a failure) or gets the engine's refusal (a 4xx); after it the
    // decode leg, which has its KV, goes on.
    if (end.began) {
      log_.Log(LogLevel::kWarning, "prefill-failed", "request {}: after the decode leg began: {}", x->request_id,
               PrefillFailure(s, end));
      return;
    }
    if (s.code() == StatusCode::kTimeout) {
      return Fail(x, 504, "engine_timeout", EngineTimeoutMessage(end.worker, config_.engine_timeout_ms, s));
    }
    if (!s.ok() || end.status >= 500) return Retry(x, attempt, end.worker, PrefillFailure(s, end));
    return AnswerWhole(x, end.status, "application/json", std::move(end.body), std::move(end.headers));
  }
  prefill_leg_->Observe(Seconds(now - end.called));
  std::optional<std::uint32_t> cached;
  if (!x->request.stream && !end.overflow) {
    if (auto answer = ParsePrefillAnswer(end.body); answer.ok()) cached = answer->cached_tokens;
  }
  {
    std::lock_guard g(x->mu);
    if (x->done || x->attempt != attempt) return;
    x->prefill_answered = true;
    x->prefill_end = now;
    x->prefill_cached = cached;
  }
  link_.PrefillDone(end.booking);
}

void Gateway::AnswerWhole(const std::shared_ptr<Exchange>& x, int status, std::string content_type,
                          std::string body, HttpHeaders engine_headers) {
  Finish(x, status, [&](Exchange& e) {
    e.engine_headers = {{"content-type", std::move(content_type)}};
    for (auto& h : engine_headers) {
      if (h.first != "content-type") e.engine_headers.push_back(std::move(h));
    }
    e.reply->Send(status, ResponseHead(e), std::move(body));
  });
}

void Gateway::Finish(const std::shared_ptr<Exchange>& x, int status, const std::function<void(Exchange&)>& answer) {
  std::shared_ptr<HttpCall> call, prefill_call;
  {
    std::lock_guard g(x->mu);
    if (x->done) return;
    x->done = true;
    call = std::move(x->call);
    prefill_call = std::move(x->prefill_call);
    answer(*x);
  }
  if (call) call->Cancel();
  if (prefill_call) prefill_call->Cancel();
  Free(x);
  Count(x->endpoint, status);
  in_flight_->Decrement();
}

void Gateway::KeepCall(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, std::uint64_t seq,
                       std::shared_ptr<HttpCall> call) {
  {
    std::lock_guard g(x->mu);
    if (!x->done && x->attempt == attempt) {
      // A later call started meanwhile (this one ended already and the exchange went on): that
      // one is the call to cancel.
      if (x->call_seq == seq) x->call = std::move(call);
      return;
    }
  }
  call->Cancel();  // the client went (or the exchange ended or was retried) while the call was being started
}

void Gateway::Retry(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, std::uint64_t worker,
                    const std::string& why) {
  std::shared_ptr<HttpCall> call, prefill_call;
  std::uint32_t next = 0;
  {
    std::lock_guard g(x->mu);
    if (x->done || x->attempt != attempt) return;
    x->excluded.push_back(worker);
    next = ++x->attempt;
    x->engine_status = 0;
    x->engine_headers.clear();
    x->first_byte = false;
    x->held.clear();
    x->leg_body.clear();
    x->prefill_status = 0;
    x->prefill_headers.clear();
    x->prefill_body.clear();
    x->prefill_overflow = false;
    x->prefill_answered = false;
    x->prefill_cached.reset();
    call = std::move(x->call);  // the other leg of a disaggregated attempt
    prefill_call = std::move(x->prefill_call);
  }
  if (call) call->Cancel();
  if (prefill_call) prefill_call->Cancel();
  Free(x);
  if (stopping_.load()) return Fail(x, 503, "shutting_down", "the gateway is stopping");
  log_.Log(LogLevel::kWarning, "engine-failed", "request {}: worker failed before its answer reached the client: {}",
           x->request_id, why);
  if (next > config_.retries) {
    return Fail(x, 502, "engine_failed", fmt::format("the engine failed after {} tries: {}", next, why));
  }
  retries_->Increment();
  bool fallback = false;
  {
    std::lock_guard g(x->mu);
    fallback = x->fallback;
  }
  fallback ? Fallback(x) : Route(x);  // a request the gateway never rendered is not the router's to route
}

void Gateway::Fallback(const std::shared_ptr<Exchange>& x) {
  std::vector<std::uint64_t> usable, prefill;
  std::uint32_t attempt = 0;
  bool first = false;
  {
    std::lock_guard g(x->mu);
    if (x->done) return;
    first = !std::exchange(x->fallback, true);
    attempt = x->attempt;
    for (std::uint64_t id : x->allowed) {
      if (std::find(x->excluded.begin(), x->excluded.end(), id) != x->excluded.end()) continue;
      // Prefill engines only when nothing else is left: the decode pool is sized for generating.
      (directory_.Role(id) == WorkerRole::kPrefill ? prefill : usable).push_back(id);
    }
  }
  if (usable.empty()) usable = std::move(prefill);
  if (stopping_.load()) return Fail(x, 503, "shutting_down", "the gateway is stopping");
  const auto worker = engine_load_.Least(usable, next_id_.load());
  if (!worker) {
    return Fail(x, 503, "no_workers", "no router answers, and no engine serving the model is left to try",
                {{"retry-after", "1"}});
  }
  if (first) {
    router_fallbacks_->Increment();
    log_.Log(LogLevel::kWarning, "router-fallback",
             "no router answers: request {} goes to the least loaded engine, worker {} (--router-fallback)",
             x->request_id, *worker);
  }
  {
    std::lock_guard g(x->mu);
    if (x->done || x->attempt != attempt) return;
    x->routed = RouteReply{};
    x->routed.worker_id = *worker;
  }
  Forward(x, attempt);
}

void Gateway::Fail(const std::shared_ptr<Exchange>& x, int status, std::string_view code, const std::string& message,
                   HttpHeaders extra) {
  Finish(x, status, [&](Exchange& e) {
    if (e.began) return e.reply->Abort();
    extra.emplace_back("content-type", "application/json");
    extra.emplace_back("x-request-id", e.request_id);
    e.reply->Send(status, std::move(extra), OpenAiError(message, ErrorType(status), code));
  });
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
    // error's says nothing of the engine's speed, nor does a response the engine broke off (a
    // dying engine's stall). A client going away leaves what was measured true.
    if (x->began && x->request.stream && x->engine_status == 200 && !x->engine_broke) timing = x->timing;
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
  m.Gauge("kvgateway_router_up",
          "1 while a router answers, 0 while none does (requests then go by --router-fallback, or get 503)",
          RouterDown(std::chrono::steady_clock::now()) ? 0.0 : 1.0);
  m.Gauge("kvgateway_frees_unconfirmed",
          "frees sent that no router answer has confirmed yet (sent again after a NATS loss)",
          double(link_.unconfirmed()));
  auto families = registry_->Collect();
  for (auto& f : m.Take()) families.push_back(std::move(f));
  return RenderMetrics(std::move(families));
}

}  // namespace kvrouter
