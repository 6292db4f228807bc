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
constexpr std::size_t kMaxProbes = 16;  // probes awaiting an answer that are remembered, per lane
}  // namespace

RouterLink::RouterLink(NatsClient& nats, std::string_view ns, std::chrono::milliseconds timeout, NatsLoops* loops)
    : nats_(nats),
      loops_(loops),
      main_lane_(loops != nullptr ? loops->size() : 0),
      route_subject_(RouterEndpointSubject(ns, router_endpoint::kRoute)),
      mark_prefill_subject_(RouterEndpointSubject(ns, router_endpoint::kMarkPrefill)),
      prefill_done_subject_(RouterEndpointSubject(ns, router_endpoint::kPrefillDone)),
      free_subject_(RouterEndpointSubject(ns, router_endpoint::kFree)),
      stats_subject_(RouterEndpointSubject(ns, router_endpoint::kStats)),
      inbox_(fmt::format("_KVGW.{:x}.", std::random_device{}() * 0x9E3779B97F4A7C15ULL ^ std::random_device{}())),
      timeout_(timeout),
      loop_disconnects_(main_lane_, 0),
      lanes_(main_lane_ + 1) {
  for (std::size_t i = 0; i < main_lane_; ++i) lane_inboxes_.push_back(fmt::format("{}L{}.", inbox_, i));
  lane_inboxes_.push_back(inbox_);
}

RouterLink::~RouterLink() { subs_.clear(); }

Status RouterLink::Start() {
  for (std::size_t lane = 0; lane <= main_lane_; ++lane) {
    auto sub = LaneClient(lane).Subscribe(lane_inboxes_[lane] + "*", "",
                                          [this, lane](const IncomingMessage& m) { OnAnswer(m, lane); });
    if (!sub.ok()) return sub.status();
    subs_.push_back(std::move(sub).value());
  }
  for (std::size_t i = 0; i < main_lane_; ++i) loop_disconnects_[i] = loops_->at(i).Stats().disconnects;
  return Status::Ok();
}

std::size_t RouterLink::CurrentLane() const {
  if (loops_ == nullptr) return main_lane_;
  const std::optional<std::size_t> loop = loops_->Current();
  if (!loop || !loops_->at(*loop).IsConnected()) return main_lane_;
  return *loop;
}

void RouterLink::Route(RouteRequest request, Done done) {
  const std::size_t lane = CurrentLane();
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
                     Pending{std::move(done), std::chrono::steady_clock::now() + timeout_, request.request_id, lane});
  }
  request.timeout_ms = static_cast<std::uint32_t>(timeout_.count());
  const auto body = EncodeRouteRequest(request);
  if (Status s =
          LaneClient(lane).PublishRequest(route_subject_, lane_inboxes_[lane] + std::to_string(id), AsBytes(body));
      !s.ok()) {
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
  (void)LaneClient(CurrentLane()).Publish(mark_prefill_subject_, AsBytes(EncodeLifecycleRequest(request_id)));
}

void RouterLink::PrefillDone(const std::string& request_id) {
  (void)LaneClient(CurrentLane()).Publish(prefill_done_subject_, AsBytes(EncodeLifecycleRequest(request_id)));
}

void RouterLink::Free(const std::string& request_id, const std::optional<ResponseTiming>& timing) {
  const std::size_t lane = CurrentLane();
  {
    KvMutexLock g(mu_);
    if (lanes_[lane].unconfirmed.size() < kMaxPending) lanes_[lane].unconfirmed.push_back(request_id);
  }
  (void)LaneClient(lane).Publish(free_subject_, AsBytes(timing ? EncodeLifecycleRequest(request_id, *timing)
                                                               : EncodeLifecycleRequest(request_id)));
}

void RouterLink::OnAnswer(const IncomingMessage& m, std::size_t lane) {
  if (m.no_responders && m.subject.empty()) return FailLaneNoResponders(lane);
  const std::string_view tail = m.subject.substr(m.subject.rfind('.') + 1);
  std::uint64_t id = 0;
  if (std::from_chars(tail.data(), tail.data() + tail.size(), id).ec != std::errc()) return;
  const bool no_responders = m.data.empty();  // NATS' 503: no router subscribes
  const bool probe = id >= kProbeBase;
  // A probe confirms only what went over the connection it went over.
  const std::uint64_t lane_disconnects = probe ? LaneDisconnects(lane) : 0;
  if (!no_responders) {
    const SteadyTime now = std::chrono::steady_clock::now();
    std::vector<LaneFree> again;
    SteadyTime sent = SteadyTime::min();  // when the request it answers was sent, if known
    {
      KvMutexLock g(mu_);
      if (probe) {
        if (auto ps = probe_sent_.find(id - kProbeBase); ps != probe_sent_.end()) {
          sent = ps->second;
          probe_sent_.erase(ps);
        }
      } else if (auto pe = pending_.find(id); pe != pending_.end()) {
        sent = pe->second.deadline - timeout_;
      }
      if (unsure_ && connected_) {
        // The first answer since the loss: a router subscribes again. Every free not confirmed
        // before the loss or sent since goes again on its lane, now and once more later (another
        // replica may subscribe again later than this one). They stay unconfirmed until a probe
        // sent after this answers.
        unsure_ = false;
        probes_.clear();
        for (std::size_t l = 0; l < lanes_.size(); ++l) {
          for (const std::string& request_id : lanes_[l].unconfirmed) again.emplace_back(l, request_id);
        }
        resend_later_ = again;
        resend_at_ = now + kAnsweringWindow;
      } else if (probe && !unsure_) {
        // The router got every free sent on the probe's lane before it (one connection keeps
        // their order).
        if (auto it = probes_.find(id - kProbeBase);
            it != probes_.end() && it->second.disconnects != lane_disconnects) {
          probes_.erase(it);
        } else if (it != probes_.end()) {
          const auto [probe_lane, mark, disconnects] = it->second;
          Lane& l = lanes_[probe_lane];
          const std::uint64_t covered = mark > l.confirmed ? mark - l.confirmed : 0;
          const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(covered, l.unconfirmed.size()));
          l.unconfirmed.erase(l.unconfirmed.begin(), l.unconfirmed.begin() + static_cast<std::ptrdiff_t>(n));
          l.confirmed += n;
          const std::uint64_t upto = it->first;  // this probe and the lane's older ones are done
          for (auto p = probes_.begin(); p != probes_.end() && p->first <= upto;) {
            p = p->second.lane == probe_lane ? probes_.erase(p) : std::next(p);
          }
        }
      }
    }
    // After the bookkeeping: Answering follows it. Only an answer to a request sent after the
    // last "no responders" says a router is there. A "no responders" handled meanwhile on another
    // connection's thread, after the check, still wins: the answer is undone if it came after
    // the check (with the store in between, either order leaves the router not answering).
    const auto sent_at = sent.time_since_epoch().count();
    if (sent_at > refused_at_.load()) {
      const auto stamp = now.time_since_epoch().count();
      last_answer_ = stamp;
      if (sent_at <= refused_at_.load()) {
        auto expected = stamp;
        last_answer_.compare_exchange_strong(expected, std::numeric_limits<SteadyTime::rep>::min());
      }
    }
    PublishFrees(again);
  } else {
    // No router subscribes now: not answering, until one answers again (a probe a second later).
    refused_at_ = std::chrono::steady_clock::now().time_since_epoch().count();
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

void RouterLink::FailLaneNoResponders(std::size_t lane) {
  refused_at_ = std::chrono::steady_clock::now().time_since_epoch().count();  // as for any "no responders"
  last_answer_ = std::numeric_limits<SteadyTime::rep>::min();
  FailWaiting("no router answers", lane, /*free_now=*/false);
}

void RouterLink::PublishFree(std::size_t lane, const std::string& request_id) {
  (void)LaneClient(lane).Publish(free_subject_, AsBytes(EncodeLifecycleRequest(request_id)));
}

void RouterLink::PublishFrees(const std::vector<LaneFree>& frees) {
  for (const auto& [lane, request_id] : frees) PublishFree(lane, request_id);
}

void RouterLink::BecomeUnsure() {
  unsure_ = true;
  probes_.clear();
  resend_later_.clear();  // still unconfirmed: they go again after this loss
}

void RouterLink::SetConnected(bool connected) {
  {
    KvMutexLock g(mu_);
    connected_ = connected;
    if (connected) {
      next_probe_ = {};  // the next Tick asks at once whether a router answers again
      return;
    }
    BecomeUnsure();
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

void RouterLink::FailWaiting(std::string_view why, std::optional<std::size_t> lane, bool free_now) {
  std::vector<std::pair<Done, std::string>> failed;
  {
    KvMutexLock g(mu_);
    const SteadyTime forget_at = std::chrono::steady_clock::now() + 2 * timeout_;
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (lane && it->second.lane != *lane) {
        ++it;
        continue;
      }
      if (expired_.size() < kMaxPending) expired_.emplace(it->first, Expired{it->second.request_id, forget_at});
      failed.emplace_back(std::move(it->second.done), std::move(it->second.request_id));
      it = pending_.erase(it);
    }
  }
  for (auto& [done, request_id] : failed) {
    if (free_now) Free(request_id);
    done(Status(StatusCode::kNoWorkers, std::string(why)));
  }
}

void RouterLink::Tick(SteadyTime now) {
  for (std::size_t i = 0; i < main_lane_; ++i) {  // a loop's connection lost since the last Tick
    const std::uint64_t disconnects = loops_->at(i).Stats().disconnects;
    if (std::exchange(loop_disconnects_[i], disconnects) == disconnects) continue;
    {
      KvMutexLock g(mu_);
      BecomeUnsure();
    }
    FailWaiting("the gateway lost a NATS connection to the router", i);
  }
  std::vector<Done> late;
  std::vector<LaneFree> again;
  std::vector<std::pair<std::size_t, std::uint64_t>> probes;  // each lane's probe to send
  std::vector<std::uint64_t> disconnects;                     // each lane's connection's, for its probe
  for (std::size_t lane = 0; lane <= main_lane_; ++lane) disconnects.push_back(LaneDisconnects(lane));
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
      for (std::size_t lane = 0; lane < lanes_.size(); ++lane) {
        const std::uint64_t probe = ++probe_seq_;
        probe_sent_.emplace(probe, now);
        // What an answer to it confirms: every free recorded on its lane before it.
        if (!unsure_) {
          probes_.emplace(probe,
                          Probe{lane, lanes_[lane].confirmed + lanes_[lane].unconfirmed.size(), disconnects[lane]});
        }
        probes.emplace_back(lane, probe);
      }
      while (probes_.size() > kMaxProbes * lanes_.size()) probes_.erase(probes_.begin());
      while (probe_sent_.size() > kMaxProbes * lanes_.size()) probe_sent_.erase(probe_sent_.begin());
    }
    if (!resend_later_.empty() && now >= resend_at_) again.swap(resend_later_);
  }
  PublishFrees(again);
  for (const auto& [lane, probe] : probes) {
    (void)LaneClient(lane).PublishRequest(stats_subject_, lane_inboxes_[lane] + std::to_string(kProbeBase + probe),
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
  std::size_t n = 0;
  for (const Lane& lane : lanes_) n += lane.unconfirmed.size();
  return n;
}

std::size_t RouterLink::pending() const {
  KvMutexLock g(mu_);
  return pending_.size();
}

}  // namespace kvrouter
