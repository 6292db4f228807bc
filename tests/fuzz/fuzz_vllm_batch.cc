// libFuzzer target for DecodeVllmBatch (and ParseKvSeqHeader): any bytes must decode or fail
// cleanly; a decoded batch has one op per event, the subject's worker and dp rank, and at most
// one block-size mismatch per op.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "events/vllm_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvrouter;
  const VllmBatchContext ctx{.worker_id = 7, .dp_rank = 1, .kv_seq = 3, .block_size = 4};
  auto r = DecodeVllmBatch({reinterpret_cast<const std::byte*>(data), size}, ctx);
  if (r.ok()) {
    const KvEventBatch& b = r->batch;
    if (b.worker_id != 7 || b.dp_rank != 1 || r->block_size_mismatches > b.ops.size() ||
        b.sequence != EventSequence{SequenceKind::kVllmSeq, 3}) {
      __builtin_trap();
    }
  }
  (void)ParseKvSeqHeader({reinterpret_cast<const char*>(data), std::min<std::size_t>(size, 32)});
  return 0;
}
