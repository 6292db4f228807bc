// libFuzzer target for DecodeDynamoEvent (envelope or bare RouterEvent): any bytes must decode
// or fail cleanly, whatever its pull decoder accepts the tree decoder must accept identically,
// whatever decodes must survive EncodeRouterEvent + decode unchanged, and decoding into a batch
// used before (the ingest path's spares) must give what a fresh decode gives.
#include <cstddef>
#include <cstdint>

#include "events/event_codec.h"
#include "events/msgpack_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvrouter;
  const std::span<const std::byte> body(reinterpret_cast<const std::byte*>(data), size);
  // The pull decoder takes a subset of what the tree decoder takes, reading it the same way.
  if (auto pulled = DecodeDynamoEventPull(body)) {
    auto tree = DecodeDynamoEventTree(body);
    if (!tree.ok() || !(*tree == *pulled)) __builtin_trap();
  }
  auto batch = DecodeDynamoEvent(body);
  // The last input's batch (or a batch of several ops at first), decoded into again.
  static KvEventBatch used = [] {
    KvEventBatch b{.worker_id = 1, .dp_rank = 2, .sequence = {SequenceKind::kVllmSeq, 3}};
    b.ops.push_back({StorageTier::kDisk, KvStored{4, {{5, 6}, {7, 8}}}});
    b.ops.push_back({StorageTier::kDevice, KvRemoved{{9}}});
    return b;
  }();
  const Status into = DecodeDynamoEventInto(body, used);
  if (into.ok() != batch.ok() || (batch.ok() && !(used == *batch))) __builtin_trap();
  if (!batch.ok()) return 0;
  if (batch->ops.size() != 1 || batch->sequence.kind != SequenceKind::kEventId) __builtin_trap();
  auto again = DecodeDynamoEvent(AsBytes(EncodeRouterEvent(*batch)));
  if (!again.ok() || !(*again == *batch)) __builtin_trap();
  return 0;
}
