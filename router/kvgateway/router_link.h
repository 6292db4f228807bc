// RouterLink: the gateway's side of the router's NATS endpoints (docs/protocol.md section 5):
// `route` asked asynchronously (one inbox subscription for every answer, no thread waiting per
// request), `mark_prefill`, `prefill_done` (section 13) and `free` published without waiting, and
// whether the router has answered lately (for /ready). A route request carries the timeout as
// its `timeout_ms` (the router's queue gives up then too); one left unanswered past it fails with
// `timeout` on Tick, and a booking the router answers after that is freed here, so nothing stays
// booked for a request nobody waits for. At most kMaxPending wait at once (more fail with `overloaded` at once).
// With NatsLoops, a route request made on one of their loops goes over that loop's connection,
// and its answer is handled on that loop (no thread hand-off); the rest (frees, probes, requests
// from other threads) goes over the one NatsClient, whose single connection keeps the frees and
// the probes that confirm them in order.
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

  void Route(const RouteRequest& request, Done done);
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
  // 5 s later (for replicas that subscribe again later).
  void SetConnected(bool connected);
  // The gateway stops: as a loss of the connection, every request waiting for its answer fails
  // now and its booking is freed, and Route fails at once from now on; an answer that comes
  // later is freed, and no callback runs for it.
  void Stop();
  // Fails the requests older than the timeout, and asks the router for its stats now and then to
  // know it answers (for Answering).
  void Tick(SteadyTime now);
  // The router answered something within the last few seconds, and since the connection was
  // last lost, and NATS has not said since that no router subscribes (no responders).
  bool Answering(SteadyTime now) const;
  std::size_t pending() const;
  // Frees sent that no router answer has confirmed yet.
  std::size_t unconfirmed() const;

 private:
  static constexpr std::size_t kMainConnection = std::numeric_limits<std::size_t>::max();
  struct Pending {
    Done done;
    SteadyTime deadline;
    std::string request_id;
    std::size_t loop;  // whose connection asked (kMainConnection: the NatsClient's)
  };
  // Timed out here, kept one more timeout for a late answer to free (bounded by kMaxPending).
  struct Expired {
    std::string request_id;
    SteadyTime forget_at;
  };
  // `loop`: the connection it came over (kMainConnection: the NatsClient's).
  void OnAnswer(const IncomingMessage& m, std::size_t loop);
  // NATS said "no responders" to a request of `loop`'s connection without saying which (see
  // IncomingMessage::no_responders): no router subscribes, so every request waiting on that
  // connection fails as not answered (a router that answers one later gets its booking freed).
  void FailLoopNoResponders(std::size_t loop);
  // Fails every request waiting for its answer with kNoWorkers `why`, freeing its booking (a free
  // now; an answer that comes later is freed as after a timeout).
  void FailWaiting(std::string_view why);
  void PublishFrees(const std::vector<std::string>& request_ids);

  NatsClient& nats_;
  NatsLoops* const loops_;
  const std::string route_subject_, mark_prefill_subject_, prefill_done_subject_, free_subject_, stats_subject_;
  const std::string inbox_;  // "_KVGW.<random>."
  std::vector<std::string> loop_inboxes_;  // "_KVGW.<random>.L<loop>."
  const std::chrono::milliseconds timeout_;
  std::unique_ptr<Subscription> sub_;
  std::vector<std::unique_ptr<Subscription>> loop_subs_;
  mutable KvMutex mu_;
  std::unordered_map<std::uint64_t, Pending> pending_ KV_GUARDED_BY(mu_);
  std::unordered_map<std::uint64_t, Expired> expired_ KV_GUARDED_BY(mu_);
  std::uint64_t next_ KV_GUARDED_BY(mu_) = 0;
  bool connected_ KV_GUARDED_BY(mu_) = true;
  // From a loss of the connection to the first router answer after it.
  bool unsure_ KV_GUARDED_BY(mu_) = false;
  // Frees sent that no router answer has confirmed yet (at most kMaxPending), oldest first;
  // confirmed_ counts those confirmed before them. A stats probe's answer confirms the frees
  // recorded before the probe was sent: probes_ maps each probe awaiting its answer to
  // confirmed_ + unconfirmed_.size() at its sending (forgotten at a loss and at the re-send).
  std::deque<std::string> unconfirmed_ KV_GUARDED_BY(mu_);
  std::uint64_t confirmed_ KV_GUARDED_BY(mu_) = 0;
  std::map<std::uint64_t, std::uint64_t> probes_ KV_GUARDED_BY(mu_);
  std::uint64_t probe_seq_ KV_GUARDED_BY(mu_) = 0;
  // The frees sent again at the first answer after a loss, to send once more at resend_at_.
  std::vector<std::string> resend_later_ KV_GUARDED_BY(mu_);
  SteadyTime resend_at_ KV_GUARDED_BY(mu_){};
  SteadyTime next_probe_ KV_GUARDED_BY(mu_){};
  std::atomic<SteadyTime::rep> last_answer_{std::numeric_limits<SteadyTime::rep>::min()};
};

}  // namespace kvrouter
