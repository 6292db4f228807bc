// Gateway: kvgateway's request path (docs/protocol.md section 11, docs/design.md "Gateway"):
// gateway.cc the request path and the pass-through, gateway_disagg.cc a disaggregated request's
// two legs, gateway_admin.cc metrics and the admin endpoints; exchange.h one request's state.
// For POST /v1/chat/completions and /v1/completions: parse just enough of the body (model,
// stream, the prompt), get the engine's exact token ids from a render endpoint (falling back to
// /tokenize), ask the router (`route`, with the request id, the session, the workers serving the
// model and the ones already tried), forward the body unchanged to the chosen engine over a
// pooled keep-alive connection, and pass a streamed response through as it arrives (a plain one
// goes whole when it ends, in one write, up to kMaxHeldBody; chunked past it). mark_prefill goes
// at the engine's first response byte, free when the response ends, fails or the client goes
// away (the engine connection is then closed, so the engine aborts). A failure before the first
// byte reached the client frees the booking and routes again away from that worker, at most
// --retries times; but an engine that has the request (HttpClient's kTimeout: delivered, then
// silent past --engine-timeout-ms, as a long plain generation is) is not asked again elsewhere:
// 504. A client that lets kClientHighWater of its response pile up pauses the engine's read
// until it drains. Also GET /v1/models, /health and /ready (/metrics: MetricsText, served by
// kvgateway on --metrics-port only).
// A route reply that is `disaggregated` (section 13) runs two legs in the engines' protocol:
// `nixl` (vLLM) a prefill leg to the prefill engine, then (prefill_done sent) the decode leg
// with the prefill answer's kv_transfer_params, or that answer itself, in the client's form,
// when it carries none; `sglang` one body with the bootstrap fields to both engines at once, the
// decode answer being the client's and the prefill answer's end sending prefill_done. A leg that
// fails before the client got a byte closes the other and routes again away from its worker; a
// client going away closes both (and starts no decode leg).
// While no router answers (RouterDown) and --router-fallback is least-loaded, a completion request
// is not rendered: it goes whole to the engine serving its model (a decode or aggregated one
// before a prefill one) with the fewest of this gateway's calls in flight (EngineLoad), books
// nothing, and its response says so (x-kvrouter-fallback); a route that fails because no router
// answers falls back likewise.
//
// Thread contract: Handle runs on HTTP threads; OnRegistration on a NATS thread; Tick on the
// caller's timer. Each request's state lives on its client connection's thread, unlocked
// (exchange.h), which needs the listener and the HttpClient on one HttpIo; callbacks never
// block. Ownership:
// borrows the HttpClient and the RouterLink, which must outlive it.
//
//   Gateway gw(config, client, link);  listener = HttpListener::Start(io, opts, gw.Handler());
#pragma once

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "events/base/clock.h"
#include "events/base/log.h"
#include "router/kvgateway/config.h"
#include "router/kvgateway/engine_load.h"
#include "router/kvgateway/openai.h"
#include "router/kvgateway/router_link.h"
#include "router/kvgateway/worker_directory.h"
#include "transport/http_client.h"
#include "transport/http_listener.h"

namespace kvrouter {

class Gateway {
 public:
  // Back-pressure: when a client lets this much of a response pile up unsent, the engine's
  // response is no longer read (its TCP window fills and its writes block) until the client has
  // taken all but kClientLowWater. A slow client is slowed down, not cut off; a stream holds at
  // most about this much (and one read) in the gateway.
  static constexpr std::size_t kClientHighWater = 256 << 10;
  static constexpr std::size_t kClientLowWater = 64 << 10;
  // A plain (non-streamed) response up to this size is held and sent whole, in one write, with
  // its Content-Length; a larger one goes out chunked as it comes.
  static constexpr std::size_t kMaxHeldBody = 1 << 20;
  // A render or /tokenize answer larger than this is refused (a prompt's ids, not a stream).
  static constexpr std::size_t kMaxRenderBytes = 64 << 20;

  Gateway(const GatewayConfig& config, HttpClient& client, RouterLink& link);

  HttpRequestHandler Handler();
  // The engine connections pooled for an http_url no worker has any more are closed.
  void OnRegistration(const WorkerRegistration& reg, SteadyTime now) { DropPools(directory_.Apply(reg, now)); }
  void Tick(SteadyTime now) { DropPools(directory_.Expire(now)); }
  // An engine known, not draining, and the router answering; or SkipsRouter and an engine that
  // has not just failed (a gateway started while the router is up is ready once it can route;
  // one started without a router serves without it).
  bool Ready(SteadyTime now) const;
  static constexpr std::chrono::seconds kRouterGrace{5};
  // No router can be asked now: NATS is down, or no router has answered lately (RouterLink::Answering).
  bool RouterDown(SteadyTime now) const { return !nats_connected_.load() || !link_.Answering(now); }
  // SIGTERM's first step: /ready answers 503 from now on (load balancers stop sending); requests
  // are served as before while their connections drain.
  void Drain() { draining_ = true; }
  // While NATS is down no router can be reached: a completion request is answered 503 at once,
  // and so is each one waiting for its route answer (which is lost with the connection). Called
  // from one thread at a time (kvgateway's ticker), a loss before a reconnect.
  void SetNatsConnected(bool connected);
  bool nats_connected() const { return nats_connected_.load(); }
  // From now on nothing is routed again or forwarded: a request whose engine call ends (the
  // client's Stop cancels them) or whose route answer comes is answered 503 "shutting_down" and
  // its booking freed. Before HttpClient::Stop, while NATS is still up for the frees.
  void Stop() { stopping_ = true; }
  const WorkerDirectory& directory() const { return directory_; }

  // kvgateway_* families as Prometheus text, with the listener's counters.
  std::string MetricsText(const HttpListener::Counters& http) const;

  struct Exchange;  // one client request in flight (exchange.h)

 private:
  void Handle(HttpRequest request, std::shared_ptr<HttpReply> reply);
  void Models(const std::shared_ptr<HttpReply>& reply) const;
  void Render(const std::shared_ptr<Exchange>& x, std::size_t candidate, bool tokenize);
  // The render (or /tokenize) call's end: the token ids routed, or the next engine asked, or /tokenize.
  void OnRendered(const std::shared_ptr<Exchange>& ex, std::size_t candidate, bool tokenize, const Status& s);
  void Route(const std::shared_ptr<Exchange>& x);
  // The router's answer to attempt `attempt` (booking `booking`), on the client connection's thread.
  void OnRouted(const std::shared_ptr<Exchange>& ex, const std::string& booking, std::uint32_t attempt,
                const Result<RouteReply>& routed);
  // --router-fallback least-loaded: the gateway picks the engine itself (the exchange is marked
  // as falling back from then on, retries included).
  void Fallback(const std::shared_ptr<Exchange>& x);
  bool FallsBack(SteadyTime now) const {
    return config_.router_fallback == RouterFallback::kLeastLoaded && RouterDown(now);
  }
  // A request is not even rendered for the router: FallsBack, and the router is known to be
  // down (NATS is down, or kRouterGrace has passed since the gateway started or NATS came back
  // with no router answering). Within the grace a request is routed, and falls back only if its
  // route fails so.
  bool SkipsRouter(SteadyTime now) const;
  // The call to the reply's worker (a disaggregated request's decode leg), answered to the client.
  // The engine `worker` at `url` (its registered one when empty).
  Result<HttpEndpoint> EngineEndpoint(std::uint64_t worker, std::string url) const;
  // A completion call to an engine: the client's path and headers an engine needs, the request
  // id, `body`. (x's request and request id are set before it is shared: read without its lock.)
  HttpCallSpec EngineCall(const Exchange& x, std::string body) const;
  // Nothing happens when the exchange is no longer at `attempt` (ended, or retried meanwhile).
  void Forward(const std::shared_ptr<Exchange>& x, std::uint32_t attempt);
  // The completion call's callbacks (Forward's): the engine's response head, each piece of its
  // body (to the client as it comes, or held for a plain answer; back-pressure), and its end
  // (the whole answer or the stream's end to the client, or a retry, or 504).
  void OnEngineHead(const std::shared_ptr<Exchange>& ex, std::uint32_t attempt, int status, const HttpHeaders& headers);
  void OnEngineData(const std::shared_ptr<Exchange>& ex, std::uint32_t attempt, std::uint64_t seq,
                    std::string_view d);
  void OnEngineDone(const std::shared_ptr<Exchange>& ex, std::uint32_t attempt, std::uint64_t worker,
                    const Status& s);
  // Section 13: a disaggregated attempt's legs by its kv_connector.
  void Disaggregate(const std::shared_ptr<Exchange>& x, std::uint32_t attempt);
  // Starts the prefill leg with `body`; false when it could not (the attempt was retried or ended).
  bool StartPrefillLeg(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, std::string body);
  void OnNixlPrefillAnswer(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, const Status& s);
  void OnSglangPrefillEnd(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, const Status& s);
  // The exchange ends with this whole answer (unless it ended already): legs still running are
  // closed and the booking freed. `engine_headers`: those of the engine whose answer it is (their
  // content-type replaced by `content_type`).
  void AnswerWhole(const std::shared_ptr<Exchange>& x, int status, std::string content_type, std::string body,
                   HttpHeaders engine_headers = {});
  // Ends the exchange unless it ended already: `answer` answers the client, then the legs still
  // running are closed, the booking freed and the request counted.
  void Finish(const std::shared_ptr<Exchange>& x, int status, const std::function<void(Exchange&)>& answer);
  // kvgateway_disagg_requests_total for a route answer of a disaggregated-eligible request.
  void CountDisaggPath(const std::shared_ptr<Exchange>& x);
  // Attempt `attempt`'s leg to `worker` failed before its first byte reached the client: the
  // other leg is closed and the request routed again away from that worker, or 502. Once per
  // attempt (a second failing leg of the same attempt is ignored).
  void Retry(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, std::uint64_t worker, const std::string& why);
  // Records the engine call `seq` of attempt `attempt` as the one a client going away (or a retry)
  // cancels, or cancels it at once when the exchange ended or was retried meanwhile.
  void KeepCall(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, std::uint64_t seq,
                std::shared_ptr<HttpCall> call);
  // Answers with an OpenAI-shaped error (unless the response has begun) and frees what is booked.
  void Fail(const std::shared_ptr<Exchange>& x, int status, std::string_view code, const std::string& message,
            HttpHeaders extra = {});
  void Free(const std::shared_ptr<Exchange>& x);
  void Count(std::string_view endpoint, int status);
  void DropPools(const std::vector<std::string>& urls);

  const GatewayConfig& config_;
  HttpClient& client_;
  RouterLink& link_;
  WorkerDirectory directory_;
  std::optional<HttpEndpoint> render_endpoint_;  // --render-url
  std::atomic<bool> nats_connected_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> draining_{false};
  std::atomic<std::uint64_t> next_id_{0};
  EngineLoad engine_load_;
  const std::string id_prefix_;
  const SteadyTime started_ = std::chrono::steady_clock::now();  // /ready's kRouterGrace begins here
  // The gateway's start, then each time NATS came back: SkipsRouter's kRouterGrace begins here.
  std::atomic<SteadyTime::rep> grace_from_{started_.time_since_epoch().count()};
  RateLimitedLog log_;

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;  // {endpoint, code}
  // requests_'s series by [endpoint is chat][status - 100], made at their first use: a request
  // is counted without building a label set (statuses outside 100..599 are not cached).
  std::array<std::array<std::atomic<prometheus::Counter*>, 500>, 2> requests_by_code_{};
  prometheus::Counter* retries_ = nullptr;
  prometheus::Counter* clients_gone_ = nullptr;
  prometheus::Counter* slow_clients_ = nullptr;
  prometheus::Counter* render_fallbacks_ = nullptr;
  prometheus::Counter* router_fallbacks_ = nullptr;
  prometheus::Gauge* in_flight_ = nullptr;
  prometheus::Histogram* ttfb_ = nullptr;        // request arrival -> engine's first byte
  prometheus::Histogram* route_time_ = nullptr;  // render + route, before the engine is called
  prometheus::Histogram* inter_chunk_ = nullptr;
  prometheus::Family<prometheus::Counter>* disagg_requests_ = nullptr;  // {path}
  prometheus::Counter* disagg_disaggregated_ = nullptr;  // its three series
  prometheus::Counter* disagg_local_ = nullptr;
  prometheus::Counter* disagg_fallback_ = nullptr;
  prometheus::Histogram* prefill_leg_ = nullptr;                        // a prefill leg's call -> its answer's end
  prometheus::Histogram* decode_wait_ = nullptr;  // the prefill answer -> the decode leg's first byte
};

}  // namespace kvrouter
