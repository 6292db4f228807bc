#include "router/kvbench/http_replay.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "events/base/thread_annotations.h"
#include "router/kvbench/fleet_stats.h"
#include "transport/http_client.h"
#include "transport/http_io.h"

namespace kvrouter::bench {

void SseDataReader::Feed(std::string_view bytes, const std::function<void(std::string_view)>& on_data) {
  buffer_.append(bytes);
  // Line by line (each byte looked at once per Feed): an empty line, after a trailing CR is
  // dropped, ends an event, whatever mix of line endings the server uses.
  std::size_t start = 0;    // the first byte of the event not yet dispatched
  std::size_t line = 0;     // the first byte of the line being read
  std::vector<std::string_view> data;
  while (true) {
    const std::size_t nl = buffer_.find('\n', line);
    if (nl == std::string::npos) break;
    std::string_view text(buffer_.data() + line, nl - line);
    line = nl + 1;
    if (text.ends_with('\r')) text.remove_suffix(1);
    if (text.empty()) {  // the event is complete
      for (std::string_view d : data) on_data(d);
      data.clear();
      start = line;
      continue;
    }
    if (!text.starts_with("data:")) continue;  // comments, event names, ids
    text.remove_prefix(5);
    if (text.starts_with(' ')) text.remove_prefix(1);
    data.push_back(text);
  }
  buffer_.erase(0, start);
}

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr double kTimedAbortWindowMs = 1000;  // a timed abort falls within a request's first second
constexpr std::size_t kErrorsLogged = 5;      // error messages printed per run; the rest are counted

std::optional<std::uint64_t> HeaderNumber(const HttpHeaders& headers, std::string_view name) {
  for (const auto& [k, v] : headers) {
    if (k != name) continue;
    std::uint64_t n = 0;
    if (std::from_chars(v.data(), v.data() + v.size(), n).ec == std::errc()) return n;
  }
  return std::nullopt;
}

// Where a client abandons its request: after a time, or after some tokens.
struct AbortPlan {
  double after_ms = -1;          // >= 0: this long after sending
  std::uint32_t after_tokens = 0;  // > 0: once this many tokens came
};

// One HTTP replay: requests posted to the gateway on the trace's schedule, at most `concurrency`
// open, their streams read on the HttpIo thread; a timer thread carries out timed aborts.
class HttpReplay {
 public:
  HttpReplay(const std::vector<TraceRequest>& trace, const OnlineOptions& o, HttpEndpoint gateway)
      : trace_(trace),
        o_(o),
        gateway_(std::move(gateway)),
        io_(1),
        client_(io_, {.max_idle_per_endpoint = std::max<std::size_t>(o.concurrency, 1)}),
        start_(Clock::now()),
        requests_(trace.size()) {
    std::mt19937_64 rng(o.seed);
    std::uniform_real_distribution<double> unit(0, 1);
    for (std::size_t i = 0; i < trace.size(); ++i) {
      if (!(unit(rng) < o.abort_fraction)) continue;
      AbortPlan& plan = requests_[i].abort.emplace();
      const std::uint32_t out = std::max<std::uint32_t>(1, trace[i].output_length);
      if (out < 2 || unit(rng) < 0.5) {
        plan.after_ms = unit(rng) * kTimedAbortWindowMs;
      } else {
        plan.after_tokens = 1 + static_cast<std::uint32_t>(unit(rng) * (out - 1));
      }
    }
  }

  ~HttpReplay() {
    client_.Stop();
    io_.Stop();
  }

  std::vector<RequestRecord> Run() {
    std::thread timer([this] { AbortOnTime(); });
    // Whatever ends Run (an exception included) stops and joins the timer first.
    struct StopTimer {
      HttpReplay* self;
      std::thread& timer;
      void Now() {
        {
          KvMutexLock lk(self->mu_);
          self->stopping_ = true;
          self->cv_.notify_all();
        }
        if (timer.joinable()) timer.join();
      }
      ~StopTimer() { Now(); }
    } stop_timer{this, timer};
    for (std::size_t i = 0; i < trace_.size(); ++i) {
      if (!Send(i)) break;
      if (o_.progress && (i + 1) % std::max<std::size_t>(1, trace_.size() / 10) == 0) {
        fmt::print(stderr, "kvbench {}: {}/{} sent\n", o_.label, i + 1, trace_.size());
      }
    }
    std::vector<std::shared_ptr<HttpCall>> open;
    {
      KvMutexLock lk(mu_);
      const bool all = cv_.wait_for(mu_, std::chrono::duration<double>(o_.timeout_s), [&] {
        mu_.AssertHeld();
        return done_ == trace_.size();
      });
      if (!all) {
        fmt::print(stderr, "kvbench {}: {} requests still open after {} s; closing them as errors\n", o_.label,
                   trace_.size() - done_, o_.timeout_s);
        for (Request& r : requests_) {
          if (r.call && !r.closed) open.push_back(r.call);
        }
      }
    }
    stop_timer.Now();
    for (auto& call : open) call->Cancel();  // on_done closes each as an error
    client_.Stop();
    KvMutexLock lk(mu_);
    std::vector<RequestRecord> out;
    out.reserve(requests_.size());
    for (Request& r : requests_) {
      if (!r.closed && !r.record.aborted) r.record.error = true;
      out.push_back(r.record);
    }
    return out;
  }

  TokenGaps token_gaps() {
    KvMutexLock g(mu_);
    return gaps_;
  }

  std::size_t errors_unlogged() {
    KvMutexLock g(mu_);
    return errors_seen_ > kErrorsLogged ? errors_seen_ - kErrorsLogged : 0;
  }

 private:
  struct Request {
    RequestRecord record;
    std::optional<AbortPlan> abort;
    std::shared_ptr<HttpCall> call;
    int status = 0;
    SseDataReader sse;
    std::string error_body;         // a non-200 answer's body, for the log
    std::string head_bytes;         // the first bytes of a 200 answer, for the log when it never streams
    std::vector<double> gaps;       // between this request's token events, in ms
    double last_token_ms = -1;
    std::uint32_t token_events = 0;  // events that carried generated text
    std::optional<std::uint32_t> usage_tokens;
    bool done_event = false;  // data: [DONE] came
    bool closed = false;      // counted in done_
  };

  double MsSinceStart() const { return std::chrono::duration<double, std::milli>(Clock::now() - start_).count(); }

  // Waits for request i's time and for room, then posts it; false when the run gives up.
  bool Send(std::size_t i) {
    SleepUntilDue(trace_, i, start_);
    {
      KvMutexLock lk(mu_);
      if (!AwaitRoom(mu_, cv_, in_flight_, o_)) {  // the rest of the trace counts as errors
        for (std::size_t k = i; k < requests_.size(); ++k) {
          requests_[k].record.error = true;
          requests_[k].closed = true;
          ++done_;
        }
        return false;
      }
      ++in_flight_;
      Request& r = requests_[i];
      r.record.arrival_ms = MsSinceStart();
      r.record.prompt_tokens = trace_[i].input_length;
      if (r.abort && r.abort->after_ms >= 0) {
        timed_aborts_.emplace(r.record.arrival_ms + r.abort->after_ms, i);
        cv_.notify_all();
      }
    }
    const json body{{"model", o_.model},
                    {"prompt", TextFor(trace_[i])},
                    {"max_tokens", std::max<std::uint32_t>(1, trace_[i].output_length)},
                    {"stream", true},
                    {"stream_options", {{"include_usage", true}}}};
    const auto limit = std::chrono::milliseconds(static_cast<std::int64_t>(o_.timeout_s * 1000));
    HttpCallSpec spec{.method = "POST",
                      .target = "/v1/completions",
                      .headers = {{"content-type", "application/json"}},
                      .body = body.dump(-1, ' ', false, json::error_handler_t::replace),
                      .head_timeout = limit,
                      .read_timeout = limit};
    auto call = client_.Start(gateway_, std::move(spec),
                              {.on_head = [this, i](int status, const HttpHeaders& h) { OnHead(i, status, h); },
                               .on_data = [this, i](std::string_view d) { OnData(i, d); },
                               .on_done = [this, i](const Status& s) { OnDone(i, s); }});
    bool cancel = false;
    {
      KvMutexLock g(mu_);
      Request& r = requests_[i];
      if (!r.closed) r.call = call;
      cancel = !r.closed && r.record.aborted;  // its abort came before the call was stored
    }
    if (cancel) call->Cancel();
    return true;
  }

  void OnHead(std::size_t i, int status, const HttpHeaders& headers) {
    KvMutexLock g(mu_);
    Request& r = requests_[i];
    r.status = status;
    if (auto w = HeaderNumber(headers, "x-kvrouter-worker-id")) r.record.worker_id = *w;
    if (auto c = HeaderNumber(headers, "x-kvrouter-cached-tokens")) {
      r.record.cached_tokens = static_cast<std::uint32_t>(std::min<std::uint64_t>(*c, r.record.prompt_tokens));
    }
  }

  void OnData(std::size_t i, std::string_view bytes) {
    const double now = MsSinceStart();
    std::shared_ptr<HttpCall> abandon;
    {
      KvMutexLock g(mu_);
      Request& r = requests_[i];
      if (r.closed || r.record.aborted) return;
      if (r.status != 200) {
        if (r.error_body.size() < 512) r.error_body.append(bytes.substr(0, 512 - r.error_body.size()));
        return;
      }
      if (r.token_events == 0 && r.error_body.size() < 512) {  // what a stream that never parses said
        r.head_bytes.append(bytes.substr(0, 512 - std::min<std::size_t>(512, r.head_bytes.size())));
      }
      r.sse.Feed(bytes, [&](std::string_view data) {
        mu_.AssertHeld();
        OnEvent(r, data, now);
      });
      if (r.abort && r.abort->after_tokens > 0 && r.token_events >= r.abort->after_tokens) abandon = AbortLocked(i);
    }
    if (abandon) abandon->Cancel();
  }

  // One `data:` payload of request r's stream.
  void OnEvent(Request& r, std::string_view data, double now) KV_REQUIRES(mu_) {
    if (data == "[DONE]") {
      r.done_event = true;
      return;
    }
    const json chunk = json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (!chunk.is_object()) {
      r.error_body = fmt::format("a stream event that is no JSON object: {}", data.substr(0, 200));
      return;
    }
    if (chunk.contains("error")) {
      r.error_body = chunk["error"].dump().substr(0, 512);
      return;
    }
    if (const auto u = chunk.find("usage"); u != chunk.end() && u->is_object()) {
      if (const auto n = u->find("completion_tokens"); n != u->end() && n->is_number_unsigned()) {
        r.usage_tokens = n->get<std::uint32_t>();
      }
      if (const auto n = u->find("prompt_tokens"); n != u->end() && n->is_number_unsigned()) {
        r.record.prompt_tokens = n->get<std::uint32_t>();
      }
    }
    const auto choices = chunk.find("choices");
    if (choices == chunk.end() || !choices->is_array() || choices->empty()) return;
    const json& c = (*choices)[0];
    const auto text = c.find("text");
    if (text == c.end() || !text->is_string() || text->get_ref<const std::string&>().empty()) return;
    if (r.record.first_token_ms < 0) r.record.first_token_ms = now;
    if (r.last_token_ms >= 0) r.gaps.push_back(now - r.last_token_ms);
    r.last_token_ms = now;
    ++r.token_events;
  }

  void OnDone(std::size_t i, const Status& s) {
    const double now = MsSinceStart();
    KvMutexLock g(mu_);
    Request& r = requests_[i];
    if (r.closed) return;
    r.call.reset();
    // An answer that had already failed stays an error when its client then goes away.
    const bool failed_before = (r.status != 0 && r.status != 200) || !r.error_body.empty();
    if (failed_before) r.record.aborted = false;
    if (!r.record.aborted) {
      const bool ok = s.ok() && r.status == 200 && r.done_event && r.token_events > 0 && r.error_body.empty();
      if (ok) {
        // Its last token, as NATS mode's last message: TPOT and the end to end time do not
        // count the usage chunk, [DONE] and the chunked terminator after it.
        r.record.finished_ms = r.last_token_ms >= 0 ? r.last_token_ms : now;
        r.record.output_tokens = r.usage_tokens.value_or(r.token_events);
        // One token per event: the gaps between events are the gaps between tokens.
        if (r.usage_tokens == r.token_events) {
          for (double gap : r.gaps) gaps_.Add(gap);
        }
      } else {
        r.record.error = true;
        if (++errors_seen_ <= kErrorsLogged) {
          fmt::print(stderr, "kvbench {}: request {} failed: {} (HTTP {}) {}\n", o_.label, i,
                     s.ok() ? "the stream ended early" : s.message(), r.status,
                     r.error_body.empty() ? r.head_bytes : r.error_body);
        }
      }
    }
    r.gaps = {};
    r.closed = true;
    --in_flight_;
    ++done_;
    cv_.notify_all();
  }

  // Marks request i aborted; returns its call for the caller to cancel outside mu_.
  std::shared_ptr<HttpCall> AbortLocked(std::size_t i) KV_REQUIRES(mu_) {
    Request& r = requests_[i];
    if (r.closed || r.record.aborted) return nullptr;
    r.record.aborted = true;
    return r.call;
  }

  // Carries out the timed aborts, each at its time.
  void AbortOnTime() {
    while (true) {
      std::shared_ptr<HttpCall> call;
      {
        KvMutexLock lk(mu_);
        if (stopping_) return;
        if (timed_aborts_.empty()) {
          cv_.wait(mu_);
          continue;
        }
        const auto [at_ms, i] = *timed_aborts_.begin();
        const auto due = start_ + std::chrono::microseconds(static_cast<std::int64_t>(at_ms * 1000));
        if (Clock::now() < due) {
          cv_.wait_until(mu_, due);
          continue;
        }
        timed_aborts_.erase(timed_aborts_.begin());
        call = AbortLocked(i);
      }
      if (call) call->Cancel();
    }
  }

  const std::vector<TraceRequest>& trace_;
  const OnlineOptions& o_;
  const HttpEndpoint gateway_;
  HttpIo io_;
  HttpClient client_;
  const Clock::time_point start_;
  KvMutex mu_;
  std::condition_variable_any cv_;
  std::vector<Request> requests_ KV_GUARDED_BY(mu_);
  std::multimap<double, std::size_t> timed_aborts_ KV_GUARDED_BY(mu_);  // ms since start -> request
  TokenGaps gaps_ KV_GUARDED_BY(mu_);
  std::size_t in_flight_ KV_GUARDED_BY(mu_) = 0;
  std::size_t done_ KV_GUARDED_BY(mu_) = 0;
  std::size_t errors_seen_ KV_GUARDED_BY(mu_) = 0;
  bool stopping_ KV_GUARDED_BY(mu_) = false;
};

// The gateway answers /ready once it can route: polls it (30 s at most).
Status AwaitGateway(const HttpEndpoint& gateway) {
  HttpIo io(1);
  HttpClient client(io, {});
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  std::string last = "no answer";
  while (Clock::now() < deadline) {
    auto r = client.Fetch(gateway, {.method = "GET", .target = "/ready", .head_timeout = std::chrono::seconds(2)});
    if (r.ok() && r->status == 200) return Status::Ok();
    last = r.ok() ? fmt::format("HTTP {}", r->status) : r.status().message();
    // Polling a remote service: there is no condition to wait on.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return Status(StatusCode::kTimeout, fmt::format("kvgateway at {} not ready within 30 s: {}", gateway.Key(), last));
}

}  // namespace

Result<Summary> RunThroughGateway(const std::vector<TraceRequest>& trace, const OnlineOptions& o) {
  auto gateway = ParseHttpUrl(o.gateway_url);
  if (!gateway.ok()) return Status(StatusCode::kInvalidArgument, "--gateway: " + gateway.status().message());
  return RunWithFleetStats(trace, o, [&](NatsClient&) -> Result<ReplayOutcome> {
    if (Status s = AwaitGateway(*gateway); !s.ok()) return s;
    HttpReplay replay(trace, o, *gateway);
    ReplayOutcome out{.records = replay.Run(), .gaps = replay.token_gaps()};
    if (const std::size_t more = replay.errors_unlogged(); more > 0) {
      fmt::print(stderr, "kvbench {}: {} more requests failed\n", o.label, more);
    }
    return out;
  });
}

}  // namespace kvrouter::bench
