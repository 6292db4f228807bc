// libFuzzer target for the router endpoint codecs: DecodeRouteRequest (whose result must
// survive EncodeRouteRequest + decode unchanged), DecodeRouteReply, DecodeLifecycleRequest and
// DecodeErrorReply, all on the same bytes.
#include <cstddef>
#include <cstdint>

#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvrouter;
  const std::span<const std::byte> body(reinterpret_cast<const std::byte*>(data), size);
  auto req = DecodeRouteRequest(body);
  if (req.ok()) {
    if (req->has_token_ids && req->isl != req->token_ids.size()) __builtin_trap();
    auto again = DecodeRouteRequest(AsBytes(EncodeRouteRequest(*req)));
    if (!again.ok() || !(*again == *req)) __builtin_trap();
  }
  auto reply = DecodeRouteReply(body);
  if (!reply.ok() && reply.status().ok()) __builtin_trap();
  (void)DecodeLifecycleRequest(body);
  (void)DecodeErrorReply(body);
  return 0;
}
