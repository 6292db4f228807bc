// The OpenAI API as the gateway needs it (docs/protocol.md section 11): just enough of a request
// body to route it (model, stream, the prompt for rendering), the answers of vLLM's render and
// /tokenize endpoints, and OpenAI-shaped errors. The body itself goes to an aggregated engine
// unchanged; the legs of a disaggregated request (section 13) get it with the fields their
// protocol adds, every other field kept as it was. The two bodies read on every request (the
// client's and the render answer) are read with simdjson On-Demand, each thread with a parser of
// its own; a body it cannot read plainly goes to nlohmann-json, which decides what is wrong.
// Everything else is nlohmann-json's. No hand parsing; nothing here throws. Thread-safe.
//
//   auto req = ParseOpenAiRequest(ApiKind::kChat, body);  // InvalidArgument names what is wrong
//   auto ids = ParseRenderAnswer(ApiKind::kChat, render_body);
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "events/base/status.h"
#include "events/block_hash.h"
#include "events/router_endpoints_codec.h"

namespace kvrouter {

enum class ApiKind { kChat, kCompletions };

struct OpenAiRequest {
  ApiKind kind = ApiKind::kChat;
  std::string model;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a streamed answer ends with usage
  // vLLM's `cache_salt` (empty: none): the engine keeps salted prefixes apart, and so does the
  // router, with the salt as an item of the first block (docs/protocol.md section 12).
  std::string cache_salt;
  // max_completion_tokens, else max_tokens, when a whole number (nullopt: none, or another form:
  // the engine judges it).
  std::optional<std::uint64_t> max_tokens;

  bool operator==(const OpenAiRequest&) const = default;
};

// 400-worthy problems (not JSON, not an object, no string `model`, chat without a `messages`
// array, completions without a `prompt`, a `cache_salt` that is not a string) are InvalidArgument
// with a message for the client.
Result<OpenAiRequest> ParseOpenAiRequest(ApiKind kind, std::string_view body);
// The body of a /tokenize call for a request, built only on that fallback: {"model", "messages"}
// (chat) or {"model", "prompt"} (completions) as JSON text, from a `body` ParseOpenAiRequest took.
std::string TokenizeBody(const OpenAiRequest& request, std::string_view body);

// A prompt as an engine rendered it: its token ids and its multimodal items (docs/protocol.md
// section 12), from the render answer's features.
struct RenderedPrompt {
  std::vector<std::uint32_t> token_ids;
  std::vector<MmItem> mm_items;

  bool operator==(const RenderedPrompt&) const = default;
};

// The render endpoints' answers: chat {"token_ids": [...], "features"?: {...}}, completions
// [{"token_ids": [...], ...}, ...] (the first prompt's); /tokenize's {"tokens": [...]}.
// features = {"mm_hashes": {modality: [identifier, ...]}, "mm_placeholders": {modality:
// [{"offset", "length"}, ...]}}: the k-th identifier of a modality with the k-th placeholder of
// it is one item (MmItemHash of the identifier). InvalidArgument when malformed, or when the
// features do not pair up or hold more than kMaxMmItems items.
Result<RenderedPrompt> ParseRenderAnswer(ApiKind kind, std::string_view body);
// The items a route carries for a rendered prompt: its multimodal items, and the request's
// cache_salt as an item of the first block when there is one.
std::vector<MmItem> RouteItems(const OpenAiRequest& request, const RenderedPrompt& rendered);
Result<std::vector<std::uint32_t>> ParseTokenizeAnswer(std::string_view body);

// Section 13, the legs of a disaggregated request.
//
// The body of a vLLM (NixlConnector) prefill leg: the client's with kv_transfer_params asking for
// a remote decode, stream false, max_tokens 1 (and max_completion_tokens 1 when present), without
// stream_options, min_tokens and min_completion_tokens. The client's fields keep their order and
// values. InvalidArgument when `body` is not a JSON object.
Result<std::string> NixlPrefillBody(std::string_view body);
// `body` (a JSON object) with each (name, JSON text) of `fields` set: appended after its last
// field, the client's bytes unchanged, when it has none of those names; else edited in place.
// InvalidArgument when `body` is not a JSON object or a value is not JSON.
Result<std::string> WithFields(std::string_view body,
                               const std::vector<std::pair<std::string, std::string>>& fields);
// A prefill leg's answer, as the gateway reads it.
struct PrefillAnswer {
  // Its top-level kv_transfer_params object as JSON text ("" when absent or null: the engine
  // stopped at its one token and the answer is the client's).
  std::string kv_transfer_params;
  // usage.prompt_tokens_details.cached_tokens, when the answer carries it.
  std::optional<std::uint32_t> cached_tokens;
  // A choice ended at its token limit (finish_reason "length"): vLLM's NixlConnector then always
  // answers with kv_transfer_params, so an answer without them comes from an engine without it.
  bool stopped_at_length = false;
};
// InvalidArgument when `body` is not a JSON object or kv_transfer_params is neither an object
// nor null.
Result<PrefillAnswer> ParsePrefillAnswer(std::string_view body);
// usage.prompt_tokens_details.cached_tokens of a plain (non-streamed) answer set to
// `cached_tokens`, the answer's fields keeping their order; nullopt when `body` is no JSON
// object with a `usage` object (nothing to set).
std::optional<std::string> WithCachedTokens(std::string_view body, std::uint32_t cached_tokens);
// A plain answer in a streamed client's form (server-sent events): one chunk holding each
// choice's text (chat.completion.chunk with choices[i].delta.content, or text_completion with
// choices[i].text) and its finish_reason, a chunk with the usage and no choices when
// `include_usage`, then `data: [DONE]`. InvalidArgument when `body` is no JSON object.
Result<std::string> AsEventStream(ApiKind kind, std::string_view body, bool include_usage);

// JSON text of a document whose strings may hold invalid UTF-8 (a client's or an engine's bytes
// cut anywhere, a model name from a registration): such bytes become U+FFFD instead of throwing.
std::string DumpJson(const nlohmann::json& doc);

// {"error": {"message", "type", "code"}} as JSON text (DumpJson). `type` follows OpenAI
// ("invalid_request_error", ...); `code` is a short machine-readable reason.
std::string OpenAiError(std::string_view message, std::string_view type, std::string_view code);

// The parsers the functions above put in front of each other, apart for the tests and the fuzz
// target, which check that the fast one answers as the reference does whenever it answers.
namespace openai_parsers {
// simdjson On-Demand over the whole body (every value validated); nullopt when the body is not
// JSON, not plainly shaped (a field the gateway reads is repeated, or of an unexpected type), or
// holds what the reference would refuse: the reference then decides.
std::optional<OpenAiRequest> FastOpenAiRequest(ApiKind kind, std::string_view body);
std::optional<RenderedPrompt> FastRenderAnswer(ApiKind kind, std::string_view body);
// nlohmann-json: the answer and the error message for any body.
Result<OpenAiRequest> ReferenceOpenAiRequest(ApiKind kind, std::string_view body);
Result<RenderedPrompt> ReferenceRenderAnswer(ApiKind kind, std::string_view body);
}  // namespace openai_parsers

// The render endpoint of a kind: "/v1/chat/completions/render" or "/v1/completions/render".
std::string_view RenderPath(ApiKind kind);
std::string_view ApiPath(ApiKind kind);  // "/v1/chat/completions" or "/v1/completions"

}  // namespace kvrouter
