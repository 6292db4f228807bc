// The router.stats reply (docs/protocol.md section 5) and the drop counters behind it.
//
// DropCounters counts input the service dropped or refused, by a reason the code chooses (a
// fixed string, never a peer's value, so the map stays small). It has its own mutex: the
// ingestion path counts here and never takes the routing mutex. BuildStats assembles one page
// from the registry (ranks in order), the routing (load, routed counts, queue), the index
// (blocks, event counters) and the drops. Both are thread-safe.
//
//   StatsReply r = BuildStats(page, registry, routing, index, drops);
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "events/router_endpoints_codec.h"
#include "router/service/routing.h"
#include "router/index/sharded_index.h"
#include "router/service/worker_registry.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

class DropCounters {
 public:
  void Add(std::string_view reason, std::uint64_t n = 1);
  std::map<std::string, std::uint64_t> Snapshot() const;

 private:
  mutable KvMutex mu_;
  std::map<std::string, std::uint64_t, std::less<>> counts_ KV_GUARDED_BY(mu_);
};

StatsReply BuildStats(const StatsRequest& page, const WorkerRegistry& registry, const Routing& routing,
                      const ShardedIndex& index, const DropCounters& drops);

}  // namespace kvrouter
