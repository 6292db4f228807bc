// RecoveryClient: the router's side of docs/protocol.md section 6. The index's streams say which rank
// needs recovering (Need); this asks the worker's kv_indexer_query endpoint for a range or a tree
// dump and hands every reply part back to the index (ShardedIndex::Recovered). A worker that
// does not serve the endpoint - NATS "no responders", no reply (or no next part) within the
// timeout, kind error / too_new / invalid_range, an undecodable reply - fails the recovery: the
// index applies what it held and counts the failure. At most max_in_flight recoveries run at
// once; the rest wait in order. A worker whose recovery failed is not asked again before its
// backoff ends (100 ms doubling to 10 s; a success resets it): a recovery it needs meanwhile
// fails at once (counted as backed off), so its events are applied rather than held.
//
// Thread contract: every method may be called from any thread (Need from the thread that applied
// the event: a shard thread, or a delivery thread applying its own; OnReply from the bus's
// delivery thread, Tick from the timer). One mutex guards the state; it is
// never held while publishing or calling the index.
// Ownership: borrows the bus and the index, which must outlive it.
//
//   RecoveryClient rc(options, bus, index, clock, log);  bus.Subscribe(rc.subject_pattern(), ...);
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>

#include "events/base/clock.h"
#include "events/kv_event.h"
#include "router/index/recovery_part.h"
#include "router/index/sharded_index.h"
#include "events/base/log.h"
#include "transport/message_bus.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

struct RecoveryCounters {
  std::uint64_t started = 0;
  std::uint64_t succeeded = 0;
  std::uint64_t failed = 0;
  std::uint64_t restarted = 0;   // ranges answered too_new: the worker restarted, a dump follows
  std::uint64_t dumps = 0;       // of the started, tree dumps
  std::uint64_t parts = 0;       // reply messages received
  std::uint64_t in_flight = 0;   // now
  std::uint64_t waiting = 0;     // now, beyond max_in_flight
  std::uint64_t backed_off = 0;  // needed while the worker's backoff ran: not asked
  std::uint64_t cancelled = 0;   // answered by a peer's dump before they were made
  double total_ms = 0;           // summed time of finished recoveries
  double max_ms = 0;             // the longest
};

class RecoveryClient {
 public:
  using Clock = std::function<SteadyTime()>;
  struct Options {
    std::string ns = "dynamo";
    std::string component = "backend";
    std::string reply_prefix;                       // unique per router: "<prefix><n>" replies
    std::chrono::milliseconds timeout{1000};        // for the reply, and for each next part
    std::chrono::milliseconds max_duration{30000};  // a recovery however many parts it sends
    std::size_t max_in_flight = 16;
  };

  RecoveryClient(Options options, MessageBus& bus, ShardedIndex& index, Clock clock, RateLimitedLog& log);

  std::string subject_pattern() const { return options_.reply_prefix + "*"; }

  // A rank needs recovering: from `start` (a range) or a tree dump (nullopt). Every reply part
  // handed to the index carries `generation`.
  void Need(WorkerKey worker, SequenceKind numbering, std::optional<std::uint64_t> start, std::uint64_t generation);
  // While paused (a replica warming from a peer's dump, docs/protocol.md section 12), asks wait
  // and none is made; Resume makes them, but not those Cancel named (a peer's dump answered
  // them: ShardedIndex::TakeSuperseded).
  void Pause();
  void Cancel(std::span<const std::pair<WorkerKey, std::uint64_t>> asks);  // (worker, generation)
  void Resume();
  // A reply (part) on one of the reply subjects.
  void OnReply(const BusMessage& m);
  // Timeouts, backoffs, and starts what may start now.
  void Tick();
  // Waits (real time) until no recovery is in flight or waiting, or `timeout` passes; true when
  // idle. For routes that arrive while the start-up dumps are in flight.
  bool AwaitIdle(std::chrono::milliseconds timeout);

  RecoveryCounters counters() const;

 private:
  struct Ask {
    WorkerKey worker;
    SequenceKind numbering = SequenceKind::kEventId;
    std::optional<std::uint64_t> start;
    std::uint64_t generation = 0;
  };
  struct InFlight {
    Ask ask;
    SteadyTime started, deadline;  // deadline: of the next part
  };
  struct Backoff {
    std::chrono::milliseconds wait{0};
    SteadyTime until{};
  };
  // Moves what may start now from waiting_ to in_flight_; returns the queries to publish.
  std::vector<std::pair<std::uint64_t, Ask>> StartLocked(SteadyTime now) KV_REQUIRES(mu_);
  // Publishes the queries; one that cannot be sent fails its recovery, which may start others
  // (a loop, not a recursion).
  void Publish(std::vector<std::pair<std::uint64_t, Ask>> starts);
  // How a recovery ended, for the counters and the worker's backoff.
  enum class Outcome {
    kServed,     // the worker answered in full: a success, its backoff reset
    kRestarted,  // too_new to a range: neither a success nor a failure (its dump is one), no backoff
    kFailed,     // no answer, or an error: a failure, the worker's backoff grows
  };
  // Ends a recovery and counts it.
  void FinishLocked(std::uint64_t n, Outcome outcome, SteadyTime now) KV_REQUIRES(mu_);
  enum class Failure {
    kError,   // the worker could not be asked or answered with an error
    kTooNew,  // the worker answered too_new (it restarted): the index asks for a dump instead
    kLate,    // no reply in time: fails only if it is still late when the lock is taken
  };
  // Fails recovery n; returns what may start.
  std::vector<std::pair<std::uint64_t, Ask>> Fail(std::uint64_t n, const std::string& why,
                                                  Failure failure = Failure::kError);

  const Options options_;
  MessageBus& bus_;
  ShardedIndex& index_;
  const Clock clock_;
  RateLimitedLog& log_;

  mutable KvMutex mu_;
  std::condition_variable_any idle_;
  std::deque<Ask> waiting_ KV_GUARDED_BY(mu_);
  std::unordered_map<std::uint64_t, InFlight> in_flight_ KV_GUARDED_BY(mu_);  // by reply number
  std::map<std::uint64_t, Backoff> backoff_ KV_GUARDED_BY(mu_);               // by worker_id
  std::uint64_t next_ KV_GUARDED_BY(mu_) = 0;
  bool paused_ KV_GUARDED_BY(mu_) = false;
  RecoveryCounters counters_ KV_GUARDED_BY(mu_);
};

}  // namespace kvrouter
