// RecoveryPart: one part of a worker's docs/protocol.md section 6 reply, as the index applies it
// (RecoveryClient decodes it, ShardedIndex::Recovered queues it for the rank's shard,
// EventStreams judges it, the shard applies its events). RecoveryNeeded: how the index asks for
// one. Plain values: no threads; a part owns its events.
//
//   index.Recovered({.worker = w, .kind = RecoveryPart::Kind::kDump, .last_event_id = 7, .generation = g});
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "events/kv_event.h"
#include "router/index/worker_key.h"

namespace kvrouter {

struct RecoveryPart {
  WorkerKey worker;
  SequenceKind numbering = SequenceKind::kEventId;  // what last_event_id counts
  enum class Kind { kEvents, kDump, kFailed } kind = Kind::kFailed;
  std::vector<KvEventBatch> events;  // in order; a dump's are stored chains
  std::uint64_t last_event_id = 0;   // the worker's newest id when it answered
  bool final = true;                 // the last part of the reply
  std::uint64_t generation = 0;      // the ask it answers (EventStreams ignores older ones)
  bool too_new = false;              // kFailed because the worker's ids are behind the cursor:
                                     // it restarted; a dump follows instead of giving up
  // From a peer replica's dump (docs/protocol.md section 12), not an answer to an ask: taken
  // only for a rank this replica has no cursor for yet (generation is ignored). kFailed: the
  // peer's dump of the rank broke off; its worker is asked instead.
  bool from_peer = false;
};

// Called when a rank needs recovering: start nullopt = a tree dump, else the first §6 event id
// wanted. `generation` names this ask; its reply parts must carry it back. For a vLLM-numbered
// rank (Kv-Seq from 0, one batch per number) §6 ids count its batches from 1: id = Kv-Seq + 1.
using RecoveryNeeded =
    std::function<void(WorkerKey, SequenceKind, std::optional<std::uint64_t> start, std::uint64_t generation)>;

}  // namespace kvrouter
