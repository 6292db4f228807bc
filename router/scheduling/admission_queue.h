// AdmissionQueue: route and generate requests held back while every rank they may use is full
// (docs/design.md "Queue"). Ordered by the queue policy (RequestQueue), bounded in entries and in
// prompt blocks, each entry with a deadline (its timeout_ms, else kDefaultWait), and findable by
// request_id, so a `free` sent while a request waits cancels it. It decides nothing about
// workers: Drain asks the caller whether the next request can go now.
// Thread contract: none; Routing holds its routing mutex around every call.
//
//   q.Push(std::move(req), std::move(prepared), best_overlap, reply, RouteKind::kRoute, now);
//   q.Drain([&](QueuedRoute& r, SteadyTime since) { return TryAdmit(r); }, [&](QueuedRoute&& r) { Answer(r); });
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <unordered_map>

#include "events/base/clock.h"
#include "events/base/status.h"
#include "events/router_endpoints_codec.h"
#include "router/scheduling/policy.h"
#include "router/scheduling/request_queue.h"
#include "router/scheduling/scheduler.h"

namespace kvrouter {

// A held-back request and where its answer goes once it leaves the queue.
struct QueuedRoute {
  RouteRequest req;  // without token_ids unless it is a generate (hashed already)
  PreparedRequest prepared;
  std::string reply;
  RouteKind kind = RouteKind::kRoute;  // kRoute or kGenerate (best_worker never waits)
};

class AdmissionQueue {
 public:
  // A queued request with no timeout_ms waits at most this long (then `timeout`), so a client
  // that went away is never booked on a worker long after.
  static constexpr std::chrono::seconds kDefaultWait{60};

  // What the caller made of the request Drain offered it.
  enum class Admission {
    kAdmitted,  // decided: taken out and handed to `taken`
    kFailed,    // cannot be decided any more (its worker left, a bound refused it): taken too
    kNoRoom,    // every rank it may use is still full: it stays
  };
  using TryAdmit = std::function<Admission(QueuedRoute&, SteadyTime enqueued)>;
  using Sink = std::function<void(QueuedRoute&&)>;

  AdmissionQueue(QueuePolicy policy, std::size_t max_requests, std::uint64_t max_blocks, std::uint32_t block_size);

  // Holds the request until Drain admits it, its deadline passes or it is cancelled.
  // best_overlap_blocks: the most blocks any candidate holds (wspt orders by what is left to
  // prefill). `overloaded` when the queue is at either bound (counted as refused).
  Status Push(RouteRequest req, PreparedRequest prepared, std::uint64_t best_overlap_blocks, std::string reply,
              RouteKind kind, SteadyTime now);

  // Offers the queued requests to `try_admit` in policy order and hands every admitted or
  // failed one to `taken`. A request that may use every rank and finds no room ends the drain
  // (nothing behind it can go either); one restricted to some ranks (worker_id, dp_rank,
  // allowed_worker_ids) is passed over.
  void Drain(const TryAdmit& try_admit, const Sink& taken);
  // Takes out every request whose deadline is before `now` (counted as timed out).
  void Expire(SteadyTime now, const Sink& expired);
  // Takes out the requests pinned (worker_id) to one of `worker_ids` (ascending).
  void FailPinned(std::span<const std::uint64_t> worker_ids, const Sink& failed);
  // Takes out the first request queued under `request_id`; false when none waits.
  bool Cancel(const std::string& request_id, const Sink& cancelled);

  bool empty() const { return queue_.empty(); }
  std::size_t size() const { return queue_.size(); }
  std::uint64_t blocks() const { return queue_.weight(); }
  std::uint64_t admitted() const { return admitted_; }
  std::uint64_t timed_out() const { return timed_out_; }
  std::uint64_t refused() const { return refused_; }

 private:
  using Queue = RequestQueue<QueuedRoute>;
  void Forget(const std::string& request_id);  // one fewer queued under request_id

  const std::uint32_t block_size_;
  Queue queue_;
  std::unordered_map<std::string, std::uint32_t> queued_ids_;  // request_id -> entries queued
  std::uint64_t admitted_ = 0;
  std::uint64_t timed_out_ = 0;
  std::uint64_t refused_ = 0;
};

}  // namespace kvrouter
