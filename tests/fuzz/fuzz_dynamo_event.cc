// libFuzzer target for DecodeDynamoEvent (envelope or bare RouterEvent): any bytes must decode
// or fail cleanly, and whatever decodes must survive EncodeRouterEvent + decode unchanged.
#include <cstddef>
#include <cstdint>

#include "events/event_codec.h"
#include "events/msgpack_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvrouter;
  auto batch = DecodeDynamoEvent({reinterpret_cast<const std::byte*>(data), size});
  if (!batch.ok()) return 0;
  if (batch->ops.size() != 1 || batch->sequence.kind != SequenceKind::kEventId) __builtin_trap();
  auto again = DecodeDynamoEvent(AsBytes(EncodeRouterEvent(*batch)));
  if (!again.ok() || !(*again == *batch)) __builtin_trap();
  return 0;
}
