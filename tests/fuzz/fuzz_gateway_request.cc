// The gateway's request-parsing path on arbitrary bytes: the HTTP request parser (with the
// gateway's limits), then the OpenAI body parsing of both endpoints, and the render and
// tokenize answers an engine could send back. None may crash, hang or read out of bounds.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "router/kvgateway/openai.h"
#include "transport/http_listener.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvrouter;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (auto req = ParseHttpRequest(bytes, 16 * 1024, 1 << 20); req.ok()) {
    (void)req->Header("x-request-id");
    (void)req->Path();
    (void)ParseOpenAiRequest(ApiKind::kChat, req->body);
    (void)ParseOpenAiRequest(ApiKind::kCompletions, req->body);
  }
  (void)ParseOpenAiRequest(ApiKind::kChat, bytes);
  (void)ParseRenderAnswer(ApiKind::kChat, bytes);
  (void)ParseRenderAnswer(ApiKind::kCompletions, bytes);
  (void)ParseTokenizeAnswer(bytes);
  return 0;
}
