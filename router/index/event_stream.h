// EventStreams: per (worker_id, dp_rank), the order of its KV events and its recovery state
// (docs/design.md "Recovery and liveness", docs/protocol.md section 6). It decides; the shard applies.
//
// A rank's cursor is the last event id (Dynamo) or Kv-Seq (vLLM) applied. With recovery on:
//   first sight of a rank          -> hold the batch, ask for a tree dump;
//   next id                        -> apply;   a repeat of the last id -> drop;
//   an id below the cursor         -> late, or the publisher restarted and its id 1 was lost:
//                                     hold it, ask for [cursor, ...] (too_new -> a dump);
//   a gap                          -> hold the batch, ask for [cursor+1, ...];
//   back to the first id           -> the publisher restarted: clear the rank, apply;
//   while a recovery is in flight  -> hold live batches (at most max_held; past it the held
//                                     ones are dropped and a fresh dump follows the reply).
// A reply part's events are applied (a dump's first part clears the rank first); its last part
// sets the cursor to last_event_id and releases the held batches, each judged again (what the
// reply covered is dropped). A failed recovery releases them as they are, accepting the gap; the
// next gap asks again. `cleared` needs nothing special: it is applied in order like any event.
// With recovery off, gaps are only counted and batches applied.
// Thread contract: owned by one shard, used under its write lock; `on_recovery` is called there
// and must not block.
//
//   EventStreams s({.recover = true}, [&](WorkerKey k, SequenceKind n, std::optional<std::uint64_t> start,
//                                         std::uint64_t generation) { asks.push_back({k, n, start, generation}); });
//   switch (s.Live(batch)) { case EventStreams::Verdict::kApply: Apply(batch); break; ... }
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <vector>

#include "events/kv_event.h"
#include "router/index/recovery_part.h"
#include "router/index/worker_key.h"

namespace kvrouter {

struct StreamCounters {
  std::uint64_t gaps = 0;
  std::uint64_t restarts = 0;
  std::uint64_t duplicates = 0;
  std::uint64_t held_dropped = 0;  // held batches dropped when the hold overflowed
};

class EventStreams {
 public:
  struct Options {
    bool recover = false;         // ask for recoveries (else only count gaps)
    std::size_t max_held = 4096;  // batches held per rank while its recovery is in flight
  };
  // `on_recovery` is called when a rank needs recovering (recovery_part.h).
  EventStreams(Options options, RecoveryNeeded on_recovery) : options_(options), on_recovery_(std::move(on_recovery)) {}

  enum class Verdict {
    kApply,           // apply it now
    kClearThenApply,  // the publisher restarted: clear the rank, then apply
    kHeld,            // kept until the rank's recovery ends
    kDrop,            // a repeat
  };
  Verdict Live(KvEventBatch& batch);  // may move the batch into the hold

  // Asks for a tree dump of the rank now (reconnect, dropped events); a rank already recovering
  // gets a dump after its current reply instead. first_sight (a worker's first registration):
  // only when nothing is known of the rank yet (no cursor, no recovery asked or ended): its
  // events, or a peer's dump, may have come first.
  void RequestDump(WorkerKey worker, SequenceKind numbering = SequenceKind::kEventId, bool first_sight = false);

  // What a reply part means for its rank. Its events are trimmed to those still to apply.
  struct Outcome {
    bool clear_first = false;           // clear the rank before applying the part's events
    std::vector<KvEventBatch> apply;    // after a failure: held batches to apply as they are
    std::vector<KvEventBatch> rejudge;  // after the last part: held batches for Live() again
    // A peer's part took the place of this ask (worker, generation), which need not be made.
    std::optional<std::uint64_t> superseded;
  };
  Outcome Recovered(RecoveryPart& part);

  // What a dump of the rank can say of it: the §6 id of the last event applied (0: none) and how
  // its ids count. Unset while the rank is recovering or unknown to the streams.
  struct Position {
    SequenceKind numbering = SequenceKind::kNone;
    std::uint64_t last_event_id = 0;
  };
  std::optional<Position> PositionOf(WorkerKey worker) const;
  bool Known(WorkerKey worker) const { return streams_.contains(worker); }
  // Calls f(WorkerKey) for every rank with a stream, in ascending order.
  template <typename F>
  void ForEachRank(F&& f) const {
    for (const auto& [key, s] : streams_) f(key);
  }

  void RemoveWorker(std::uint64_t worker_id);
  bool Recovering(WorkerKey worker) const;
  const StreamCounters& counters() const { return counters_; }

 private:
  struct Stream {
    SequenceKind numbering = SequenceKind::kNone;
    std::optional<std::uint64_t> cursor;  // last id applied
    bool recovering = false;
    bool dump_pending = false;     // a dump must follow the reply in flight (hold overflowed)
    bool dump_started = false;     // a dump reply's first part has been seen
    bool asked_once = false;       // a recovery has ended (a failed first-sight dump is not retried)
    bool warming = false;          // taking a peer's dump (its parts, whatever their generation)
    std::uint64_t generation = 0;  // of the ask in flight
    std::deque<KvEventBatch> held;
  };
  // What an ask wants: a tree dump, or the events from the id `past_cursor` after the cursor on
  // (a dump when the stream has no cursor).
  enum class AskFor : std::uint8_t { kDump, kRange };
  void Ask(WorkerKey worker, Stream& s, AskFor what, std::uint64_t past_cursor = 1);
  // Whether a peer's part is for this replica to take (RecoveryPart::from_peer); gives it the
  // generation of the rank's recovery it now is.
  bool TakePeerPart(RecoveryPart& part, Outcome& out);
  // The cursor a §6 id means for this stream (vLLM: Kv-Seq = id - 1; id 0: none yet).
  static std::optional<std::uint64_t> CursorOf(const Stream& s, std::uint64_t id);
  static std::uint64_t FirstId(SequenceKind k) { return k == SequenceKind::kVllmSeq ? 0 : 1; }

  const Options options_;
  const RecoveryNeeded on_recovery_;
  std::map<WorkerKey, Stream> streams_;  // ordered: a worker's ranks are one range
  StreamCounters counters_;
  std::uint64_t next_generation_ = 0;
};

}  // namespace kvrouter
