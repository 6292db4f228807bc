// OpenAiFace: kvmocker's OpenAI-shaped HTTP API as vLLM's server answers it (docs/protocol.md
// section 11, "kvmocker's HTTP face"), without sockets: a request's method, path and body in, and
// either the answer at once (models, health, render, tokenize, errors) or a generation for an
// engine, with the OpenAiAnswer that writes its response piece by piece as tokens come.
// Thread contract: OpenAiFace::Handle may be called from any thread at once; an OpenAiAnswer is
// immutable after construction (its methods are const and thread-safe). Exceptions of the JSON
// library stay inside this file.
//
//   OpenAiFace face({.model = "mock"});
//   auto r = face.Handle("POST", "/v1/chat/completions", body, request_id_header);
//   if (auto* g = std::get_if<OpenAiGeneration>(&r)) engine.Add(g->prompt, g->max_tokens);
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "events/block_hash.h"
#include "router/kvmocker/kv_transfer.h"

namespace kvrouter {

// The mock tokenizer: one token per byte of the UTF-8 text, token id = the byte's value. An image
// (a chat content part {"type": "image_url", "image_url": {"url"} or "url"}) renders as
// kImageTokens tokens of id kImageToken (outside the bytes), one multimodal item whose
// identifier is MockImageIdentifier of its URL (a data: URL carries its bytes, so the same image
// has the same identifier).
std::vector<std::uint32_t> ByteTokens(std::string_view text);
inline constexpr std::uint32_t kImageToken = 256;
inline constexpr std::uint32_t kImageTokens = 16;
// 64 hex digits, vLLM's shape: XXH3-64 (seed 0) of the URL in the first 16, zeros after; so
// MmItemHash(identifier) is that XXH3.
std::string MockImageIdentifier(std::string_view url);
// The text of the k-th generated token (from 0): one lower-case letter, 'a' + k % 26, so the
// generated text has one byte, and so one token, per generated token.
char GeneratedTokenChar(std::uint32_t k);

enum class OpenAiApi { kChat, kCompletions };

// Usage of one generation (OpenAI's `usage`).
struct OpenAiUsage {
  std::uint32_t prompt_tokens = 0;
  std::uint32_t completion_tokens = 0;
  std::uint32_t cached_tokens = 0;  // prompt tokens found in the engine's prefix cache
};

// A whole HTTP response the face gives at once.
struct FaceResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // beyond content-type
};

// OpenAI's error shape {"error": {"message", "type", "code"}}; `type` follows from the status
// (4xx invalid_request_error, 503 service_unavailable_error, else server_error). 503 also gets
// Retry-After: 1.
FaceResponse OpenAiError(int status, std::string_view code, std::string_view message);
// For HttpListenerOptions::error_body: the listener's own 400 / 413 / 431 in the same shape.
std::pair<std::string, std::string> ListenerErrorBody(int status, std::string_view message);

// How the response to one generation is written, as the engine produces its tokens. The
// constant part of a streamed chunk is rendered once here, so a token costs a string append.
class OpenAiAnswer {
 public:
  enum class Delivery { kWhole, kStream };  // `"stream": true` is kStream
  OpenAiAnswer(OpenAiApi api, std::string id, std::int64_t created, std::string_view model, Delivery delivery,
               bool include_usage);

  OpenAiApi api() const { return api_; }
  Delivery delivery() const { return delivery_; }
  const std::string& id() const { return id_; }
  bool include_usage() const { return include_usage_; }  // stream_options.include_usage

  // kWhole: the whole body, "chat.completion" or "text_completion", finish_reason "length",
  // the text of usage.completion_tokens tokens; a prefill leg's also a top-level
  // "kv_transfer_params" (KvTransferParamsJson, kv_transfer.h).
  std::string Body(const OpenAiUsage& usage, const KvTransferParams* kv_transfer_params = nullptr) const;
  // kStream: "data: {chunk}\n\n" for generated token k (from 0); chat's first chunk carries
  // role "assistant"; `last` sets finish_reason "length".
  std::string TokenEvent(std::uint32_t k, bool last) const;
  // kStream, after the last token when include_usage(): a chunk with no choices and `usage`.
  std::string UsageEvent(const OpenAiUsage& usage) const;
  // kStream: an error after the head was sent, as vLLM sends one: data: {"error": {...}}.
  static std::string ErrorEvent(std::string_view code, std::string_view message);
  static constexpr std::string_view kDoneEvent = "data: [DONE]\n\n";
  static constexpr std::string_view kEventStreamType = "text/event-stream";

 private:
  OpenAiApi api_;
  std::string id_;
  Delivery delivery_;
  bool include_usage_;
  std::int64_t created_;
  std::string model_;
  std::string chunk_head_;  // {"created":..,"id":..,"model":..,"object":..  (no closing brace)
};

// A generation request, parsed and checked: the rendered prompt's tokens and how to answer.
struct OpenAiGeneration {
  std::vector<std::uint32_t> prompt;  // never empty, at most max_model_len tokens
  std::vector<MmItem> mm_items;       // its images
  std::uint32_t max_tokens = 16;      // in [1, kMaxGenerateTokens]
  OpenAiAnswer answer;
  LegFields legs;  // kv_transfer_params and SGLang's bootstrap fields (kv_transfer.h)
};

struct OpenAiFaceOptions {
  std::string model = "mock";             // the one served model name
  std::uint32_t max_model_len = 1 << 20;  // longest prompt in tokens (the engine's whole cache)
};

class OpenAiFace {
 public:
  explicit OpenAiFace(OpenAiFaceOptions options);

  // The answer to one request, or the generation it asks for. `request_id` is the x-request-id
  // header ("" when absent): the response id is "chatcmpl-" / "cmpl-" followed by it, or by a
  // fresh id, as vLLM names them.
  //   POST /v1/chat/completions, /v1/completions          -> a generation (or an error)
  //   POST /v1/chat/completions/render                    -> {"token_ids": [...], "features"?}
  //     (features, with images: {"mm_hashes": {"image": [id...]}, "mm_placeholders": {"image":
  //     [{"offset", "length"}...]}}, as vLLM's)
  //   POST /v1/completions/render                         -> [{"token_ids": [...]}]
  //   POST /tokenize {model?, messages | prompt}          -> {"tokens", "count", "max_model_len"}
  //   GET  /v1/models, /health
  // A generation's kv_transfer_params and bootstrap_* fields are parsed (ParseLegFields), never
  // acted on here: the fleet runs the legs.
  // Errors: 400 bad JSON, a missing or mistyped field, a prompt over max_model_len; 404 an
  // unknown model or path; 405 a known path with another method. A missing `model` means the
  // served one, as in vLLM.
  std::variant<FaceResponse, OpenAiGeneration> Handle(std::string_view method, std::string_view path,
                                                      std::string_view body, std::string_view request_id);

  // What a chat request renders to: "<|{role}|>\n{content}\n" per message, then
  // "<|assistant|>\n" when add_generation_prompt.
  static std::string RenderChat(const std::vector<std::pair<std::string, std::string>>& messages,
                                bool add_generation_prompt);

  const OpenAiFaceOptions& options() const { return options_; }

 private:
  std::string FreshId();

  const OpenAiFaceOptions options_;
  const std::uint64_t id_tag_;  // random per face, so two processes' ids differ
  std::atomic<std::uint64_t> next_id_{0};
};

}  // namespace kvrouter
