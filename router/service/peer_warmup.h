// PeerWarmup: a replica started with --router-replica-sync fills its index from a live peer's
// dump (docs/protocol.md section 12, router.dump) before it reports ready, instead of asking every
// worker for one. It asks `router.dump` for two parts (every replica hears it; the first to
// answer is the peer, the others' answers are ignored), then that peer's own
// `router.dump.<router_id>` for the rest, `window` parts per ask (the peer streams them, and
// finishes the rank it is in; the next ask goes when the last of them arrives, so about a window
// waits unread, and no rank spans two asks), and hands each rank to the index as a peer
// part (RecoveryPart::from_peer): the index takes it only for a rank it knows nothing of yet.
// It ends when the peer has no more, when nobody serves router.dump (NATS "no responders"),
// when the chosen peer's page cannot be read, or when no page comes in time: the first within
// first_timeout, each next one within page_timeout (a rank the peer broke off in the middle is
// then asked of its worker). on_done runs once; a page still being handed over when a timeout
// ends the warm-up closes the rank it leaves open itself.
// Thread contract: Start, OnReply (a bus delivery thread) and Tick (the timer) from any thread.
// One mutex, never held while publishing, calling the index or on_done. A synchronous bus
// answers inside Publish: the pages are then asked in a loop, not by recursion.
// Ownership: borrows the bus and the index, which must outlive it.
//
//   PeerWarmup w(options, bus, index, clock, admit, on_done, log);
//   bus.Subscribe(w.subject_pattern(), "", [&](auto& m) { w.OnReply(m); });  w.Start();
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "events/base/clock.h"
#include "events/base/log.h"
#include "events/base/thread_annotations.h"
#include "events/peer_dump_codec.h"
#include "router/index/sharded_index.h"
#include "transport/message_bus.h"

namespace kvrouter {

struct PeerWarmupCounters {
  std::uint64_t peer = 0;     // the router_id that answered (0: none)
  std::uint64_t pages = 0;    // replies taken
  std::uint64_t ranks = 0;    // rank entries handed to the index (parts of split ranks count each)
  std::uint64_t refused = 0;  // rank entries the registry refused
  std::uint64_t chains = 0;
  std::uint64_t blocks = 0;
  std::uint64_t bytes = 0;  // of the replies taken
  bool done = false;
  bool complete = false;  // done, and the peer said there was no more
  double ms = 0;          // from Start to done
};

class PeerWarmup {
 public:
  using Clock = std::function<SteadyTime()>;
  // Whether the rank may be indexed (the registry admits it as an event's rank would be).
  using Admit = std::function<bool(WorkerKey)>;
  struct Options {
    std::string dump_subject;     // namespace.{ns}.router.dump
    std::uint64_t router_id = 0;  // this replica's (the peers never answer their own)
    std::string reply_prefix;     // unique per replica: "<prefix><ask>" replies
    std::chrono::milliseconds first_timeout{1000};
    std::chrono::milliseconds page_timeout{5000};
    std::uint32_t window = 16;  // pages per ask, in [2, kMaxDumpParts]: 16 MiB at NATS's default payload
  };

  PeerWarmup(Options options, MessageBus& bus, ShardedIndex& index, Clock clock, Admit admit,
             std::function<void()> on_done, RateLimitedLog& log);

  std::string subject_pattern() const { return options_.reply_prefix + "*"; }
  void Start();
  void OnReply(const BusMessage& m);
  void Tick();  // the timeouts
  bool done() const;
  PeerWarmupCounters counters() const;

 private:
  // Publishes the page asked for while one is pending (a loop: on a synchronous bus the answer
  // arrives, and asks for the next page, inside Publish).
  void Pump();
  // Ends the warm-up (once): a rank broken off in the middle goes to its worker, then on_done.
  void Finish(bool complete);
  // Finish's halves: under mu_, marks the end and takes the open rank; then, unlocked, hands the
  // open rank to its worker and calls on_done.
  std::optional<WorkerKey> EndLocked(bool complete) KV_REQUIRES(mu_);
  void Finished(std::optional<WorkerKey> open);

  const Options options_;
  MessageBus& bus_;
  ShardedIndex& index_;
  const Clock clock_;
  const Admit admit_;
  const std::function<void()> on_done_;
  RateLimitedLog& log_;

  mutable KvMutex mu_;
  SteadyTime started_ KV_GUARDED_BY(mu_){};
  std::optional<SteadyTime> deadline_ KV_GUARDED_BY(mu_);  // of the next page (set by Start)
  std::uint64_t ask_ KV_GUARDED_BY(mu_) = 0;               // the ask made last (its reply subject)
  std::uint32_t pages_of_ask_ KV_GUARDED_BY(mu_) = 0;      // pages it has brought so far
  std::uint32_t parts_asked_ KV_GUARDED_BY(mu_) = 1;       // its max_parts
  std::optional<DumpRequest> to_send_ KV_GUARDED_BY(mu_);  // the next ask, not yet published
  bool pumping_ KV_GUARDED_BY(mu_) = false;
  std::optional<WorkerKey> open_rank_ KV_GUARDED_BY(mu_);    // a rank whose next part is to come
  std::uint64_t open_last_event_id_ KV_GUARDED_BY(mu_) = 0;  // its first part's
  bool finished_ KV_GUARDED_BY(mu_) = false;
  PeerWarmupCounters counters_ KV_GUARDED_BY(mu_);
};

}  // namespace kvrouter
