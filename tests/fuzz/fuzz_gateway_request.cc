// The gateway's request-parsing path on arbitrary bytes: the HTTP request parser (with the
// gateway's limits), then the OpenAI body parsing of both endpoints, and the render and
// tokenize answers an engine could send back. None may crash, hang or read out of bounds, and
// the fast (simdjson) parsers must answer as the nlohmann-json reference does whenever they answer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
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
  for (ApiKind kind : {ApiKind::kChat, ApiKind::kCompletions}) {
    if (auto fast = openai_parsers::FastOpenAiRequest(kind, bytes)) {
      auto reference = openai_parsers::ReferenceOpenAiRequest(kind, bytes);
      if (!reference.ok() || !(*reference == *fast)) std::abort();
      (void)TokenizeBody(*fast, bytes);
    }
    if (auto fast = openai_parsers::FastRenderAnswer(kind, bytes)) {
      auto reference = openai_parsers::ReferenceRenderAnswer(kind, bytes);
      if (!reference.ok() || !(*reference == *fast)) std::abort();
    }
    (void)ParseOpenAiRequest(kind, bytes);
    (void)ParseRenderAnswer(kind, bytes);
  }
  (void)ParseTokenizeAnswer(bytes);
  return 0;
}
