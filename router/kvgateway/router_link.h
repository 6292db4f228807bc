// RouterLink: the gateway's side of the router's NATS endpoints (docs/protocol.md section 5):
// `route` asked asynchronously (one inbox subscription for every answer, no thread waiting per
// request), `mark_prefill`, `prefill_done` (section 13) and `free` published without waiting, and
// whether the router has answered lately (for /ready). A route request carries the timeout as
// its `timeout_ms` (the router's queue gives up then too); one left unanswered past it fails with
// `timeout` on Tick, and a booking the router answers after that is freed here, so nothing stays
// booked for a request nobody waits for. At most kMaxPending wait at once (more fail with `overloaded` at once).
// With NatsLoops, what a caller on one of their loops sends (route requests, frees, lifecycle
// messages) goes over that loop's connection, and the answers come back on that loop (no thread
// hand-off); what other threads send goes over the one NatsClient. Each connection is a lane:
// one connection keeps the order of what it carries, so a stats probe sent on a lane confirms
// the frees sent on that lane before it, and each lane is probed.
// Thread contract: every method may be called from any thread; `done` callbacks run on the
// thread that received the answer (the NATS delivery thread of the inbox, or the loop the
// request was made on), or on the thread calling Route, Tick or SetConnected, never under the
// link's lock.
// Ownership: borrows the NatsClient and the NatsLoops, which must outlive it.
//
//   link.Route(req, [](Result<RouteReply> r) { ... });  link.Free("req-1");  link.Tick(now);
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "events/base/clock.h"
#include "events/base/status.h"
#include "events/base/thread_annotations.h"
#include "events/router_endpoints_codec.h"
#include "transport/nats_client.h"
#include "transport/nats_loops.h"

namespace kvrouter {

class RouterLink {
 public:
  static constexpr std::size_t kMaxPending = 1 << 16;
  // Why a request fails while the connection is down (SetConnected).
  static constexpr std::string_view kNotConnected =
      "the gateway is not connected to NATS: no router can be reached now";
  using Done = std::function<void(Result<RouteReply>)>;

  // `ns`: the namespace whose router endpoints (events/subjects.h) the link asks. `loops`
  // (optional): connections of the event loops the link's callers run on.
  RouterLink(NatsClient& nats, std::string_view ns, std::chrono::milliseconds timeout, NatsLoops* loops = nullptr);
  // Unsubscribes the inbox first: no answer is handled once the members it touches are going.
  ~RouterLink();
  RouterLink(const RouterLink&) = delete;
  RouterLink& operator=(const RouterLink&) = delete;
  // Subscribes the inboxes.
  Status Start();

  void Route(RouteRequest request, Done done);
  void MarkPrefill(const std::string& request_id);
  // A disaggregated request's prefill leg answered: the router releases its prefill rank's part.
  void PrefillDone(const std::string& request_id);
  // With the engine's timing when the response came (it goes to the router with the free).
  void Free(const std::string& request_id, const std::optional<ResponseTiming>& timing = std::nullopt);
  // The NATS connection went down (false) or came back (true). While it is down Route fails at
  // once with kNoWorkers, and on the way down so does every request waiting for its answer (the
  // answer would come over the connection that is gone); a booking the router made for one of
  // those is freed (a free now, and a late answer is freed as after a timeout). NATS delivers at
  // most once: frees sent into a connection that was dying, or before a router subscribed again,
  // are lost. So every free no stats answer has confirmed when the connection goes, and every
  // one sent until the first router answer after it, is sent again at that answer and once more
  // 5 s later (for replicas that subscribe again later). A loop's connection lost on its own
  // (seen by Tick) is handled alike for what went over it.
  void SetConnected(bool connected);
  // The gateway stops: as a loss of the connection, every request waiting for its answer fails
  // now and its booking is freed, and Route fails at once from now on; an answer that comes
  // later is freed, and no callback runs for it.
  void Stop();
  // Fails the requests older than the timeout, asks the router for its stats now and then on
  // every lane to know it answers (for Answering) and what it got, and notices a loop's
  // connection lost since the last Tick.
  void Tick(SteadyTime now);
  // The router answered something within the last few seconds, and since the connection was
  // last lost, and NATS has not said since that no router subscribes (no responders).
  bool Answering(SteadyTime now) const;
  std::size_t pending() const;
  // Frees sent that no router answer has confirmed yet.
  std::size_t unconfirmed() const;

 private:
  struct Pending {
    Done done;
    SteadyTime deadline;
    std::string request_id;
    std::size_t lane;  // whose connection asked
  };
  // Timed out here, kept one more timeout for a late answer to free (bounded by kMaxPending).
  struct Expired {
    std::string request_id;
    SteadyTime forget_at;
  };
  // Frees sent on a lane that no router answer has confirmed yet (at most kMaxPending), oldest
  // first; `confirmed` counts those confirmed before them.
  struct Lane {
    std::deque<std::string> unconfirmed;
    std::uint64_t confirmed = 0;
  };
  // A stats probe awaiting its answer, which confirms the frees recorded on its lane before it
  // was sent: `mark` is that lane's confirmed + unconfirmed.size() at its sending.
  struct Probe {
    std::size_t lane;
    std::uint64_t mark;
    std::uint64_t disconnects;  // its lane's connection's at its sending: a loss since voids it
  };
  using LaneFree = std::pair<std::size_t, std::string>;  // a free and the lane it went on

  // The calling thread's lane: its loop's while that connection is up (a connection that is
  // down would hold what is sent until it is back), else the NatsClient's (main_lane_).
  std::size_t CurrentLane() const;
  std::uint64_t LaneDisconnects(std::size_t lane) { return LaneClient(lane).Stats().disconnects; }
  NatsClient& LaneClient(std::size_t lane) { return lane == main_lane_ ? nats_ : loops_->at(lane); }
  void OnAnswer(const IncomingMessage& m, std::size_t lane);
  // NATS said "no responders" to a request of `lane`'s connection without saying which (see
  // IncomingMessage::no_responders): no router subscribes, so every request waiting on that
  // connection fails as not answered (a router that answers one later gets its booking freed).
  void FailLaneNoResponders(std::size_t lane);
  // Fails every request waiting for its answer (on `lane` only, unless nullopt) with kNoWorkers
  // `why`, freeing its booking (a free now unless !free_now, when no router got it; an answer
  // that comes later is freed as after a timeout).
  void FailWaiting(std::string_view why, std::optional<std::size_t> lane = std::nullopt, bool free_now = true);
  // A connection was lost: every free not confirmed is unsure until the router's next answer.
  void BecomeUnsure() KV_REQUIRES(mu_);
  void PublishFree(std::size_t lane, const std::string& request_id);
  void PublishFrees(const std::vector<LaneFree>& frees);

  NatsClient& nats_;
  NatsLoops* const loops_;
  const std::size_t main_lane_;  // lanes 0 .. main_lane_ - 1 are the loops'
  const std::string route_subject_, mark_prefill_subject_, prefill_done_subject_, free_subject_, stats_subject_;
  const std::string inbox_;  // "_KVGW.<random>."
  // Each lane's: "_KVGW.<random>.L<loop>." for a loop's, inbox_ for the main one.
  std::vector<std::string> lane_inboxes_;
  const std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Subscription>> subs_;  // each lane's inbox
  // The disconnects of each loop's connection as the last Tick saw them (the ticker's only).
  std::vector<std::uint64_t> loop_disconnects_;
  mutable KvMutex mu_;
  std::unordered_map<std::uint64_t, Pending> pending_ KV_GUARDED_BY(mu_);
  std::unordered_map<std::uint64_t, Expired> expired_ KV_GUARDED_BY(mu_);
  std::uint64_t next_ KV_GUARDED_BY(mu_) = 0;
  bool connected_ KV_GUARDED_BY(mu_) = true;
  // From a loss of a connection to the first router answer after it.
  bool unsure_ KV_GUARDED_BY(mu_) = false;
  std::vector<Lane> lanes_ KV_GUARDED_BY(mu_);
  // Forgotten at a loss and at the re-send.
  std::map<std::uint64_t, Probe> probes_ KV_GUARDED_BY(mu_);
  std::uint64_t probe_seq_ KV_GUARDED_BY(mu_) = 0;
  // The frees sent again at the first answer after a loss, to send once more at resend_at_.
  std::vector<LaneFree> resend_later_ KV_GUARDED_BY(mu_);
  SteadyTime resend_at_ KV_GUARDED_BY(mu_){};
  SteadyTime next_probe_ KV_GUARDED_BY(mu_){};
  std::atomic<SteadyTime::rep> last_answer_{std::numeric_limits<SteadyTime::rep>::min()};
  // When NATS last said no router subscribes. An answer to a request sent before then says
  // nothing of a router now: answers on different connections arrive in no common order, so a
  // router's last answers can come after the "no responders" that followed its end.
  std::atomic<SteadyTime::rep> refused_at_{std::numeric_limits<SteadyTime::rep>::min()};
  std::map<std::uint64_t, SteadyTime> probe_sent_ KV_GUARDED_BY(mu_);  // each probe awaiting its answer
};

}  // namespace kvrouter
