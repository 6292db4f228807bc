// libFuzzer target for DecodeWorkerRegistration: any bytes must decode or fail cleanly, and a
// decoded registration must survive EncodeWorkerRegistration + decode unchanged.
#include <cstddef>
#include <cstdint>

#include "events/registration_codec.h"
#include "events/msgpack_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvrouter;
  auto reg = DecodeWorkerRegistration({reinterpret_cast<const std::byte*>(data), size});
  if (!reg.ok()) return 0;
  if (reg->dp_size == 0) __builtin_trap();
  auto again = DecodeWorkerRegistration(AsBytes(EncodeWorkerRegistration(*reg)));
  if (!again.ok() || !(*again == *reg)) __builtin_trap();
  return 0;
}
