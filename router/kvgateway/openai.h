// The OpenAI API as the gateway needs it (docs/protocol.md section 11): just enough of a request
// body to route it (model, stream, the prompt for rendering), the answers of vLLM's render and
// /tokenize endpoints, and OpenAI-shaped errors. The body itself goes to the engine unchanged.
// JSON is nlohmann-json's (no hand parsing); nothing here throws. Thread-safe (pure functions).
//
//   auto req = ParseOpenAiRequest(ApiKind::kChat, body);  // InvalidArgument names what is wrong
//   auto ids = ParseRenderAnswer(ApiKind::kChat, render_body);
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "events/base/status.h"

namespace kvrouter {

enum class ApiKind { kChat, kCompletions };

struct OpenAiRequest {
  ApiKind kind = ApiKind::kChat;
  std::string model;
  bool stream = false;
  // For /tokenize: {"model", "messages"} (chat) or {"model", "prompt"} (completions), as JSON text.
  std::string tokenize_body;
};

// 400-worthy problems (not JSON, not an object, no string `model`, chat without a `messages`
// array, completions without a `prompt`) are InvalidArgument with a message for the client.
Result<OpenAiRequest> ParseOpenAiRequest(ApiKind kind, std::string_view body);

// The render endpoints' answers: chat {"token_ids": [...]}, completions [{"token_ids": [...]}, ...]
// (the first prompt's ids); /tokenize's {"tokens": [...]}. InvalidArgument when malformed.
Result<std::vector<std::uint32_t>> ParseRenderAnswer(ApiKind kind, std::string_view body);
Result<std::vector<std::uint32_t>> ParseTokenizeAnswer(std::string_view body);

// JSON text of a document whose strings may hold invalid UTF-8 (a client's or an engine's bytes
// cut anywhere, a model name from a registration): such bytes become U+FFFD instead of throwing.
std::string DumpJson(const nlohmann::json& doc);

// {"error": {"message", "type", "code"}} as JSON text (DumpJson). `type` follows OpenAI
// ("invalid_request_error", ...); `code` is a short machine-readable reason.
std::string OpenAiError(std::string_view message, std::string_view type, std::string_view code);

// The render endpoint of a kind: "/v1/chat/completions/render" or "/v1/completions/render".
std::string_view RenderPath(ApiKind kind);
std::string_view ApiPath(ApiKind kind);  // "/v1/chat/completions" or "/v1/completions"

}  // namespace kvrouter
