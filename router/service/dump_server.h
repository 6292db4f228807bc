// DumpServer: this replica's side of router.dump (docs/protocol.md section 12): it answers a
// peer's ask with pages of its index, each rank read back as stored chains (ShardedIndex::DumpRank)
// and dumped once however many pages it spans. An asker of several parts gets whole ranks (an
// ask ends at a rank's end), so a rank never spans two moments of the index.
// Thread contract: Serve may be called from any thread, concurrently (each ask is read and
// answered on its caller's thread; the index's reads are its own). Ownership: borrows the index,
// the bus and the log, which must outlive it.
//
//   DumpServer dumps(index, event_bus, router_id, log, reply_error);  dumps.Serve(msg, Warmth::kWarm);
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "events/base/log.h"
#include "events/base/status.h"
#include "router/index/sharded_index.h"
#include "transport/message_bus.h"

namespace kvrouter {

// Whether this replica holds the fleet's index yet: a replica warming up from a peer does not.
enum class Warmth { kWarming, kWarm };

class DumpServer {
 public:
  // How an ask that cannot be answered is refused (the service's error reply).
  using ReplyError = std::function<void(const BusMessage&, const Status&)>;

  DumpServer(const ShardedIndex& index, MessageBus& bus, std::uint64_t router_id, RateLimitedLog& log, ReplyError reply_error);

  // Answers the ask `m` (on `m.reply`, in pages of at most the bus's max payload). Its own
  // asks are ignored, and so is every ask while it is kWarming.
  void Serve(const BusMessage& m, Warmth warmth);
  // Pages published so far (the stats counter dump_pages_served).
  std::uint64_t pages_served() const { return pages_served_.load(std::memory_order_relaxed); }

 private:
  const ShardedIndex& index_;
  MessageBus& bus_;
  const std::uint64_t router_id_;
  RateLimitedLog& log_;
  const ReplyError reply_error_;
  std::atomic<std::uint64_t> pages_served_{0};
};

}  // namespace kvrouter
