#include "router/index/event_stream.h"

#include <algorithm>

namespace kvrouter {

void EventStreams::Ask(WorkerKey worker, Stream& s, AskFor what, std::uint64_t past_cursor) {
  s.recovering = true;
  s.dump_started = false;
  s.generation = ++next_generation_;
  std::optional<std::uint64_t> start;
  if (what == AskFor::kRange && s.cursor) {
    // The id `past_cursor` after the cursor, in §6 terms (vLLM: Kv-Seq + 1).
    start = *s.cursor + past_cursor + (s.numbering == SequenceKind::kVllmSeq ? 1 : 0);
  }
  on_recovery_(worker, s.numbering, start, s.generation);
}

std::optional<std::uint64_t> EventStreams::CursorOf(const Stream& s, std::uint64_t id) {
  if (s.numbering != SequenceKind::kVllmSeq) return id;
  return id == 0 ? std::nullopt : std::optional<std::uint64_t>(id - 1);
}

EventStreams::Verdict EventStreams::Live(KvEventBatch& b) {
  if (b.sequence.kind == SequenceKind::kNone) return Verdict::kApply;
  const WorkerKey key{b.worker_id, b.dp_rank};
  Stream& s = streams_[key];
  if (s.numbering != b.sequence.kind) {  // a publisher that changed format starts over
    s.numbering = b.sequence.kind;
    s.cursor.reset();
  }
  const std::uint64_t id = b.sequence.value;
  auto hold = [&] {
    if (s.held.size() >= options_.max_held) {  // the reply will not be enough: dump after it
      counters_.held_dropped += s.held.size();
      s.held.clear();
      s.dump_pending = true;
    }
    s.held.push_back(std::move(b));
    return Verdict::kHeld;
  };
  if (s.recovering) return hold();
  if (!s.cursor) {
    if (options_.recover && !s.asked_once) {
      hold();
      Ask(key, s, AskFor::kDump);  // first sight: what did it hold before?
      return Verdict::kHeld;
    }
    s.cursor = id;
    return Verdict::kApply;
  }
  if (id == *s.cursor + 1) {
    s.cursor = id;
    return Verdict::kApply;
  }
  if (id > *s.cursor) {
    ++counters_.gaps;
    if (options_.recover) {
      hold();
      Ask(key, s, AskFor::kRange);
      return Verdict::kHeld;
    }
    s.cursor = id;
    return Verdict::kApply;
  }
  if (id == FirstId(s.numbering) && *s.cursor > id) {
    ++counters_.restarts;
    s.cursor = id;
    return Verdict::kClearThenApply;
  }
  ++counters_.duplicates;
  if (id < *s.cursor && options_.recover) {
    // Not the last id again but an older one: a late event (events and replies travel apart),
    // or a restarted publisher whose first event was lost. A range from the cursor itself
    // settles it cheaply: a worker that did not restart sends a few events (the late one is
    // covered and dropped); a restarted one answers too_new, and a dump follows.
    hold();
    Ask(key, s, AskFor::kRange, /*past_cursor=*/0);
    return Verdict::kHeld;
  }
  return Verdict::kDrop;
}

void EventStreams::RequestDump(WorkerKey worker, SequenceKind numbering, bool first_sight) {
  if (!options_.recover) return;
  if (first_sight && streams_.contains(worker)) return;
  Stream& s = streams_[worker];
  if (s.numbering == SequenceKind::kNone) s.numbering = numbering;
  if (s.recovering) {
    s.dump_pending = true;
    return;
  }
  Ask(worker, s, AskFor::kDump);
}

std::optional<EventStreams::Position> EventStreams::PositionOf(WorkerKey worker) const {
  auto it = streams_.find(worker);
  if (it == streams_.end() || it->second.recovering) return std::nullopt;
  const Stream& s = it->second;
  Position p{.numbering = s.numbering};
  // The §6 id of the cursor (vLLM: Kv-Seq + 1).
  if (s.cursor) p.last_event_id = *s.cursor + (s.numbering == SequenceKind::kVllmSeq ? 1 : 0);
  return p;
}

bool EventStreams::TakePeerPart(RecoveryPart& part, Outcome& out) {
  auto [it, created] = streams_.try_emplace(part.worker);
  Stream& s = it->second;
  const bool numbering_agrees =
      s.numbering == SequenceKind::kNone || part.numbering == SequenceKind::kNone || s.numbering == part.numbering;
  if (part.kind == RecoveryPart::Kind::kFailed) {
    // The peer's dump broke off in the middle of this rank: ask its worker instead.
    if (!s.warming) {
      if (created) streams_.erase(it);
      return false;
    }
    s.warming = false;
    part.events.clear();
    Ask(part.worker, s, AskFor::kDump);
    return false;
  }
  if (s.warming) {
    part.generation = s.generation;
    return true;
  }
  if (s.cursor || s.asked_once || (s.recovering && s.dump_started) || !numbering_agrees) {
    if (created) streams_.erase(it);
    return false;  // this replica knows the rank already (or is taking its worker's dump)
  }
  if (s.numbering == SequenceKind::kNone) s.numbering = part.numbering;
  if (s.recovering) {
    out.superseded = s.generation;  // the first-sight ask, still waiting to be made
  } else {
    s.recovering = true;
    s.dump_started = false;
  }
  s.generation = ++next_generation_;
  s.warming = true;
  part.generation = s.generation;
  return true;
}

EventStreams::Outcome EventStreams::Recovered(RecoveryPart& part) {
  Outcome out;
  if (part.from_peer && !TakePeerPart(part, out)) {
    part.events.clear();
    return out;
  }
  if (part.from_peer) part.kind = RecoveryPart::Kind::kDump;
  auto it = streams_.find(part.worker);
  if (it == streams_.end() || !it->second.recovering || it->second.generation != part.generation) {
    part.events.clear();  // the worker is gone, or the reply answers an older ask
    return out;
  }
  Stream& s = it->second;
  if (part.kind == RecoveryPart::Kind::kFailed && part.too_new) {
    // The worker's ids are behind the cursor: it restarted. Start over from a dump. What is held
    // arrived before the dump is asked, so the dump covers it (or it is from before the restart,
    // and stale): judged again after the dump, an old high id would look like a gap forever.
    part.events.clear();
    s.held.clear();
    s.cursor.reset();
    Ask(part.worker, s, AskFor::kDump);
    return out;
  }
  if (part.kind == RecoveryPart::Kind::kFailed) {
    // Apply what was held as it is, accepting the gap; the next gap asks again.
    s.recovering = false;
    s.asked_once = true;
    part.events.clear();
    for (KvEventBatch& b : s.held) {
      const std::uint64_t id = b.sequence.value;
      if (s.cursor && id <= *s.cursor) {
        ++counters_.duplicates;
        continue;
      }
      s.cursor = id;
      out.apply.push_back(std::move(b));
    }
    s.held.clear();
    if (s.dump_pending) {
      s.dump_pending = false;
      Ask(part.worker, s, AskFor::kDump);
    }
    return out;
  }
  if (part.kind == RecoveryPart::Kind::kDump) {
    out.clear_first = !s.dump_started;
    s.dump_started = true;
  } else {
    // A range: only what comes after the cursor, in order.
    std::erase_if(part.events, [&](const KvEventBatch& b) {
      const std::optional<std::uint64_t> id = CursorOf(s, b.sequence.value);
      if (!id || (s.cursor && *id <= *s.cursor)) return true;
      s.cursor = id;
      return false;
    });
  }
  if (!part.final) return out;
  const std::optional<std::uint64_t> last = CursorOf(s, part.last_event_id);
  if (part.kind == RecoveryPart::Kind::kDump || !s.cursor || (last && *last > *s.cursor)) s.cursor = last;
  s.recovering = false;
  s.asked_once = true;
  s.dump_started = false;
  s.warming = false;
  if (s.dump_pending) {  // held batches overflowed meanwhile: a dump covers them
    s.dump_pending = false;
    Ask(part.worker, s, AskFor::kDump);
    return out;
  }
  // What the reply covered goes (judged again, an old id 1 would look like a restart); the rest
  // is judged again.
  for (KvEventBatch& b : s.held) {
    if (!s.cursor || b.sequence.value > *s.cursor) out.rejudge.push_back(std::move(b));
  }
  s.held.clear();
  return out;
}

void EventStreams::RemoveWorker(std::uint64_t worker_id) {
  for (auto it = streams_.lower_bound({worker_id, 0}); it != streams_.end() && it->first.worker_id == worker_id;) {
    it = streams_.erase(it);
  }
}

bool EventStreams::Recovering(WorkerKey worker) const {
  auto it = streams_.find(worker);
  return it != streams_.end() && it->second.recovering;
}

}  // namespace kvrouter
