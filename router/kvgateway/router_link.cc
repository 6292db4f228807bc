#include "router/kvgateway/router_link.h"

#include <fmt/format.h>

#include <charconv>
#include <random>
#include <vector>

#include "events/msgpack_reader.h"
#include "events/subjects.h"

namespace kvrouter {

namespace {
constexpr std::chrono::seconds kAnsweringWindow{5};
constexpr std::chrono::seconds kProbeEvery{1};
// Inbox ids: route requests count up from 1, stats probes from kProbeBase (each its own id, so
// that a late answer confirms only what its own probe covers).
constexpr std::uint64_t kProbeBase = std::uint64_t{1} << 63;
constexpr std::size_t kMaxProbes = 16;  // probes awaiting an answer that are remembered
}  // namespace

RouterLink::RouterLink(NatsClient& nats, std::string_view ns, std::chrono::milliseconds timeout, NatsLoops* loops)
    : nats_(nats),
      loops_(loops),
      route_subject_(RouterEndpointSubject(ns, router_endpoint::kRoute)),
      mark_prefill_subject_(RouterEndpointSubject(ns, router_endpoint::kMarkPrefill)),
      prefill_done_subject_(RouterEndpointSubject(ns, router_endpoint::kPrefillDone)),
      free_subject_(RouterEndpointSubject(ns, router_endpoint::kFree)),
      stats_subject_(RouterEndpointSubject(ns, router_endpoint::kStats)),
      inbox_(fmt::format("_KVGW.{:x}.", std::random_device{}() * 0x9E3779B97F4A7C15ULL ^ std::random_device{}())),
      timeout_(timeout) {
  for (std::size_t i = 0; loops_ != nullptr && i < loops_->size(); ++i) {
    loop_inboxes_.push_back(fmt::format("{}L{}.", inbox_, i));
  }
}

RouterLink::~RouterLink() {
  loop_subs_.clear();
  sub_.reset();
}

Status RouterLink::Start() {
  auto sub = nats_.Subscribe(inbox_ + "*", "", [this](const IncomingMessage& m) { OnAnswer(m, kMainConnection); });
  if (!sub.ok()) return sub.status();
  sub_ = std::move(sub).value();
  for (std::size_t i = 0; i < loop_inboxes_.size(); ++i) {
    auto loop_sub =
        loops_->at(i).Subscribe(loop_inboxes_[i] + "*", "", [this, i](const IncomingMessage& m) { OnAnswer(m, i); });
    if (!loop_sub.ok()) return loop_sub.status();
    loop_subs_.push_back(std::move(loop_sub).value());
  }
  return Status::Ok();
}

void RouterLink::Route(const RouteRequest& request, Done done) {
  std::size_t loop = kMainConnection;
  if (loops_ != nullptr) loop = loops_->Current().value_or(kMainConnection);
  std::uint64_t id = 0;
  {
    KvMutexLock g(mu_);
    if (!connected_) {
      g.Unlock();
      return done(Status(StatusCode::kNoWorkers, std::string(kNotConnected)));
    }
    if (pending_.size() >= kMaxPending) {
      g.Unlock();
      return done(Status(StatusCode::kOverloaded, "too many requests wait for the router"));
    }
    id = ++next_;
    pending_.emplace(id,
                     Pending{std::move(done), std::chrono::steady_clock::now() + timeout_, request.request_id, loop});
  }
  RouteRequest timed = request;
  timed.timeout_ms = static_cast<std::uint32_t>(timeout_.count());
  const auto body = EncodeRouteRequest(timed);
  const bool on_loop = loop != kMainConnection;
  NatsClient& via = on_loop ? loops_->at(loop) : nats_;
  const std::string reply = (on_loop ? loop_inboxes_[loop] : inbox_) + std::to_string(id);
  if (Status s = via.PublishRequest(route_subject_, reply, AsBytes(body)); !s.ok()) {
    Done failed;
    {
      KvMutexLock g(mu_);
      if (auto it = pending_.find(id); it != pending_.end()) {
        failed = std::move(it->second.done);
        pending_.erase(it);
      }
    }
    if (failed) failed(Status(StatusCode::kNoWorkers, "cannot reach the router: " + s.message()));
  }
}

void RouterLink::MarkPrefill(const std::string& request_id) {
  (void)nats_.Publish(mark_prefill_subject_, AsBytes(EncodeLifecycleRequest(request_id)));
}

void RouterLink::PrefillDone(const std::string& request_id) {
  (void)nats_.Publish(prefill_done_subject_, AsBytes(EncodeLifecycleRequest(request_id)));
}

void RouterLink::Free(const std::string& request_id, const std::optional<ResponseTiming>& timing) {
  {
    KvMutexLock g(mu_);
    if (unconfirmed_.size() < kMaxPending) unconfirmed_.push_back(request_id);
  }
  (void)nats_.Publish(free_subject_, AsBytes(timing ? EncodeLifecycleRequest(request_id, *timing)
                                                    : EncodeLifecycleRequest(request_id)));
}

void RouterLink::OnAnswer(const IncomingMessage& m, std::size_t loop) {
  if (m.no_responders && m.subject.empty()) return FailLoopNoResponders(loop);
  const std::string_view tail = m.subject.substr(m.subject.rfind('.') + 1);
  std::uint64_t id = 0;
  if (std::from_chars(tail.data(), tail.data() + tail.size(), id).ec != std::errc()) return;
  const bool no_responders = m.data.empty();  // NATS' 503: no router subscribes
  const bool probe = id >= kProbeBase;
  if (!no_responders) {
    const SteadyTime now = std::chrono::steady_clock::now();
    std::vector<std::string> again;
    {
      KvMutexLock g(mu_);
      if (unsure_ && connected_) {
        // The first answer since the loss: a router subscribes again. Every free not confirmed
        // before the loss or sent since goes again, now and once more later (another replica
        // may subscribe again later than this one). They stay unconfirmed until a probe sent
        // after this answers.
        unsure_ = false;
        probes_.clear();
        again.assign(unconfirmed_.begin(), unconfirmed_.end());
        resend_later_ = again;
        resend_at_ = now + kAnsweringWindow;
      } else if (probe && !unsure_) {
        // The router got every free sent before this probe (one connection keeps their order).
        if (auto it = probes_.find(id - kProbeBase); it != probes_.end()) {
          const std::uint64_t covered = it->second > confirmed_ ? it->second - confirmed_ : 0;
          const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(covered, unconfirmed_.size()));
          unconfirmed_.erase(unconfirmed_.begin(), unconfirmed_.begin() + static_cast<std::ptrdiff_t>(n));
          confirmed_ += n;
          probes_.erase(probes_.begin(), std::next(it));
        }
      }
    }
    last_answer_ = now.time_since_epoch().count();  // after the bookkeeping: Answering follows it
    PublishFrees(again);
  } else {
    // No router subscribes now: not answering, until one answers again (a probe a second later).
    last_answer_ = std::numeric_limits<SteadyTime::rep>::min();
  }
  if (probe) return;
  Done done;
  std::string late;
  {
    KvMutexLock g(mu_);
    if (auto it = pending_.find(id); it != pending_.end()) {
      done = std::move(it->second.done);
      pending_.erase(it);
    } else if (auto e = expired_.find(id); e != expired_.end()) {
      late = std::move(e->second.request_id);
      expired_.erase(e);
    } else {
      return;
    }
  }
  if (!done) {  // its caller gave up: a booking made anyway is freed
    if (!no_responders && DecodeRouteReply(m.data).ok()) Free(late);
    return;
  }
  if (no_responders) return done(Status(StatusCode::kNoWorkers, "no router answers"));
  done(DecodeRouteReply(m.data));
}

void RouterLink::FailLoopNoResponders(std::size_t loop) {
  last_answer_ = std::numeric_limits<SteadyTime::rep>::min();  // as for any "no responders"
  std::vector<Done> failed;
  {
    KvMutexLock g(mu_);
    const SteadyTime forget_at = std::chrono::steady_clock::now() + timeout_;
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.loop != loop) {
        ++it;
        continue;
      }
      failed.push_back(std::move(it->second.done));
      if (expired_.size() < kMaxPending)
        expired_.emplace(it->first, Expired{std::move(it->second.request_id), forget_at});
      it = pending_.erase(it);
    }
  }
  for (Done& done : failed) done(Status(StatusCode::kNoWorkers, "no router answers"));
}

void RouterLink::PublishFrees(const std::vector<std::string>& request_ids) {
  for (const std::string& request_id : request_ids) {
    (void)nats_.Publish(free_subject_, AsBytes(EncodeLifecycleRequest(request_id)));
  }
}

void RouterLink::SetConnected(bool connected) {
  {
    KvMutexLock g(mu_);
    connected_ = connected;
    if (connected) {
      next_probe_ = {};  // the next Tick asks at once whether a router answers again
      return;
    }
    unsure_ = true;
    probes_.clear();
    resend_later_.clear();  // still unconfirmed: they go again after this loss
  }
  FailWaiting("the gateway lost its NATS connection to the router");
}

void RouterLink::Stop() {
  {
    KvMutexLock g(mu_);
    connected_ = false;
  }
  FailWaiting("the gateway is stopping");
}

void RouterLink::FailWaiting(std::string_view why) {
  std::vector<std::pair<Done, std::string>> failed;
  {
    KvMutexLock g(mu_);
    const SteadyTime forget_at = std::chrono::steady_clock::now() + 2 * timeout_;
    for (auto& [id, p] : pending_) {
      if (expired_.size() < kMaxPending) expired_.emplace(id, Expired{p.request_id, forget_at});
      failed.emplace_back(std::move(p.done), std::move(p.request_id));
    }
    pending_.clear();
  }
  for (auto& [done, request_id] : failed) {
    Free(request_id);
    done(Status(StatusCode::kNoWorkers, std::string(why)));
  }
}

void RouterLink::Tick(SteadyTime now) {
  std::vector<Done> late;
  std::vector<std::string> again;
  std::uint64_t probe = 0;  // the sequence number of a probe to send
  {
    KvMutexLock g(mu_);
    std::erase_if(expired_, [&](const auto& e) { return e.second.forget_at < now; });
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.deadline < now) {
        late.push_back(std::move(it->second.done));
        if (expired_.size() < kMaxPending) {
          expired_.emplace(it->first, Expired{std::move(it->second.request_id), now + timeout_});
        }
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    if (now >= next_probe_ && connected_) {
      next_probe_ = now + kProbeEvery;
      probe = ++probe_seq_;
      // What an answer to it confirms: every free recorded before it.
      if (!unsure_) probes_.emplace(probe, confirmed_ + unconfirmed_.size());
      if (probes_.size() > kMaxProbes) probes_.erase(probes_.begin());
    }
    if (!resend_later_.empty() && now >= resend_at_) again.swap(resend_later_);
  }
  PublishFrees(again);
  if (probe != 0) {
    (void)nats_.PublishRequest(stats_subject_, inbox_ + std::to_string(kProbeBase + probe),
                               AsBytes(EncodeStatsRequest({.offset = 0, .limit = 1})));
  }
  for (Done& d : late) d(Status(StatusCode::kTimeout, "the router did not answer in time"));
}

bool RouterLink::Answering(SteadyTime now) const {
  {
    KvMutexLock g(mu_);
    if (unsure_) return false;  // no answer since the connection was lost
  }
  const SteadyTime last{SteadyTime::duration(last_answer_.load())};
  return last.time_since_epoch().count() != std::numeric_limits<SteadyTime::rep>::min() &&
         now - last < kAnsweringWindow;
}

std::size_t RouterLink::unconfirmed() const {
  KvMutexLock g(mu_);
  return unconfirmed_.size();
}

std::size_t RouterLink::pending() const {
  KvMutexLock g(mu_);
  return pending_.size();
}

}  // namespace kvrouter
