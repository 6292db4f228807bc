#include "router/kvmocker/openai_face.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <chrono>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>

#include "events/base/status.h"
#include "events/router_endpoints_codec.h"
#include "events/worker_codec.h"

namespace kvrouter {

namespace {

using Json = nlohmann::json;

constexpr std::string_view kChatPath = "/v1/chat/completions";
constexpr std::string_view kCompletionsPath = "/v1/completions";
constexpr std::string_view kChatRenderPath = "/v1/chat/completions/render";
constexpr std::string_view kCompletionsRenderPath = "/v1/completions/render";
constexpr std::string_view kTokenizePath = "/tokenize";
constexpr std::string_view kModelsPath = "/v1/models";
constexpr std::string_view kHealthPath = "/health";

// Strings from a client may hold anything: invalid UTF-8 is replaced, never thrown about.
std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

FaceResponse JsonResponse(const Json& j) { return {.status = 200, .body = Dump(j)}; }

std::int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// What the client asked, as OpenAI's APIs name things. A field that is null counts as absent
// (clients send "max_tokens": null).
const Json* Field(const Json& object, std::string_view key) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

Result<bool> BoolField(const Json& object, std::string_view key, bool absent) {
  const Json* v = Field(object, key);
  if (v == nullptr) return absent;
  if (!v->is_boolean()) return InvalidArgument(fmt::format("'{}' must be a boolean", key));
  return v->get<bool>();
}

Result<std::uint32_t> MaxTokens(const Json& request, OpenAiApi api) {
  const Json* v = api == OpenAiApi::kChat ? Field(request, "max_completion_tokens") : nullptr;
  std::string_view key = "max_completion_tokens";
  if (v == nullptr) {
    v = Field(request, "max_tokens");
    key = "max_tokens";
  }
  if (v == nullptr) return 16u;
  if (!v->is_number_integer()) return InvalidArgument(fmt::format("'{}' must be an integer", key));
  // The parser stores a non-negative integer as unsigned: a signed one is negative.
  if (!v->is_number_unsigned() || v->get<std::uint64_t>() < 1 || v->get<std::uint64_t>() > kMaxGenerateTokens) {
    return InvalidArgument(fmt::format("'{}' must be in [1, {}]", key, kMaxGenerateTokens));
  }
  return static_cast<std::uint32_t>(v->get<std::uint64_t>());
}

// The model named by the request: absent = the served one (as vLLM); another name is not found.
Status CheckModel(const Json& request, const std::string& served) {
  const Json* v = Field(request, "model");
  if (v == nullptr) return Status::Ok();
  if (!v->is_string()) return InvalidArgument("'model' must be a string");
  if (v->get_ref<const std::string&>() != served) {
    return NotFound(fmt::format("The model `{}` does not exist.", v->get_ref<const std::string&>()));
  }
  return Status::Ok();
}

// The chat template's pieces (RenderChat and ChatPrompt): a message is its head, its content and
// kMessageEnd; the generation prompt follows the last one.
std::string MessageHead(std::string_view role) { return fmt::format("<|{}|>\n", role); }
constexpr std::string_view kMessageEnd = "\n";
constexpr std::string_view kGenerationPrompt = "<|assistant|>\n";

// An image identifier of vLLM's shape (64 hex digits) whose MmItemHash is `hash`.
std::string HexIdentifier(std::uint64_t hash) { return fmt::format("{:016x}{}", hash, std::string(48, '0')); }

// A rendered prompt: its tokens and its images.
struct FacePrompt {
  std::vector<std::uint32_t> tokens;
  std::vector<MmItem> items;
};

void AppendBytes(std::vector<std::uint32_t>& to, std::string_view text) {
  for (const char c : text) to.push_back(static_cast<unsigned char>(c));
}

// An image part's URL: {"image_url": {"url": str}} or {"image_url": str}.
Result<std::string> ImageUrl(const Json& part, std::size_t index) {
  const Json* image = Field(part, "image_url");
  if (image != nullptr && image->is_object()) image = Field(*image, "url");
  if (image == nullptr || !image->is_string()) {
    return InvalidArgument(fmt::format("messages[{}].content has an image_url part without a string url", index));
  }
  return image->get<std::string>();
}

// A message's content appended to `to`: a string, null, or a list of parts; `text` parts are
// joined with "\n", each `image_url` part is kImageTokens placeholder tokens and an item (other
// part types carry nothing the mock tokenizer reads).
Status AppendContent(const Json& message, std::size_t index, FacePrompt& to) {
  const Json* content = Field(message, "content");
  if (content == nullptr) return Status::Ok();
  if (content->is_string()) {
    AppendBytes(to.tokens, content->get_ref<const std::string&>());
    return Status::Ok();
  }
  if (!content->is_array()) {
    return InvalidArgument(fmt::format("messages[{}].content must be a string or a list of parts", index));
  }
  bool first = true;
  for (const Json& part : *content) {
    if (!part.is_object())
      return InvalidArgument(fmt::format("messages[{}].content has a part that is not an object", index));
    const Json* type = Field(part, "type");
    if (type == nullptr || !type->is_string()) {
      return InvalidArgument(fmt::format("messages[{}].content has a part without a 'type'", index));
    }
    const std::string& kind = type->get_ref<const std::string&>();
    if (kind == "image_url") {
      auto url = ImageUrl(part, index);
      if (!url.ok()) return url.status();
      if (to.items.size() == kMaxMmItems) return InvalidArgument(fmt::format("more than {} images", kMaxMmItems));
      if (!first) to.tokens.push_back('\n');
      to.items.push_back({.hash = MmItemHash(MockImageIdentifier(*url)),
                          .offset = static_cast<std::uint32_t>(to.tokens.size()),
                          .length = kImageTokens});
      to.tokens.insert(to.tokens.end(), kImageTokens, kImageToken);
      first = false;
      continue;
    }
    if (kind != "text") continue;
    const Json* text = Field(part, "text");
    if (text == nullptr || !text->is_string()) {
      return InvalidArgument(fmt::format("messages[{}].content has a text part without a string 'text'", index));
    }
    if (!first) to.tokens.push_back('\n');
    AppendBytes(to.tokens, text->get_ref<const std::string&>());
    first = false;
  }
  return Status::Ok();
}

// A chat request's prompt: its messages rendered as RenderChat says (add_generation_prompt,
// default true), as bytes, images as placeholder runs.
Result<FacePrompt> ChatPrompt(const Json& request) {
  const Json* messages = Field(request, "messages");
  if (messages == nullptr) return InvalidArgument("'messages' is required");
  if (!messages->is_array() || messages->empty()) return InvalidArgument("'messages' must be a non-empty list");
  FacePrompt out;
  for (std::size_t i = 0; i < messages->size(); ++i) {
    const Json& m = (*messages)[i];
    if (!m.is_object()) return InvalidArgument(fmt::format("messages[{}] must be an object", i));
    const Json* role = Field(m, "role");
    if (role == nullptr || !role->is_string()) {
      return InvalidArgument(fmt::format("messages[{}] needs a string 'role'", i));
    }
    AppendBytes(out.tokens, MessageHead(role->get_ref<const std::string&>()));
    if (Status s = AppendContent(m, i, out); !s.ok()) return s;
    AppendBytes(out.tokens, kMessageEnd);
  }
  auto add = BoolField(request, "add_generation_prompt", true);
  if (!add.ok()) return add.status();
  if (*add) AppendBytes(out.tokens, kGenerationPrompt);
  return out;
}

// A completions request's prompt: a string (its bytes) or a list of token ids.
Result<std::vector<std::uint32_t>> CompletionsPrompt(const Json& request) {
  const Json* prompt = Field(request, "prompt");
  if (prompt == nullptr) return InvalidArgument("'prompt' is required");
  std::vector<std::uint32_t> tokens;
  if (prompt->is_string()) {
    tokens = ByteTokens(prompt->get_ref<const std::string&>());
  } else if (prompt->is_array()) {
    tokens.reserve(prompt->size());
    for (const Json& t : *prompt) {
      if (!t.is_number_unsigned() || t.get<std::uint64_t>() > std::numeric_limits<std::uint32_t>::max()) {
        return InvalidArgument("'prompt' must be a string or a list of token ids (integers in [0, 2^32))");
      }
      tokens.push_back(static_cast<std::uint32_t>(t.get<std::uint64_t>()));
    }
  } else {
    return InvalidArgument("'prompt' must be a string or a list of token ids");
  }
  if (tokens.empty()) return InvalidArgument("'prompt' must not be empty");
  return tokens;
}

Result<FacePrompt> Prompt(const Json& request, OpenAiApi api) {
  if (api == OpenAiApi::kChat) return ChatPrompt(request);
  auto tokens = CompletionsPrompt(request);
  if (!tokens.ok()) return tokens.status();
  return FacePrompt{.tokens = std::move(tokens).value()};
}

Result<Json> ParseObject(std::string_view body) {
  Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument("the body is not valid JSON");
  if (!j.is_object()) return InvalidArgument("the body must be a JSON object");
  return j;
}

FaceResponse Refusal(const Status& s) {
  if (s.code() == StatusCode::kNotFound) return OpenAiError(404, "model_not_found", s.message());
  return OpenAiError(400, "invalid_argument", s.message());
}

Json UsageJson(const OpenAiUsage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", std::uint64_t{u.prompt_tokens} + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

}  // namespace

std::string MockImageIdentifier(std::string_view url) {
  return HexIdentifier(XXH3_64bits_withSeed(url.data(), url.size(), 0));
}

std::vector<std::uint32_t> ByteTokens(std::string_view text) {
  std::vector<std::uint32_t> tokens(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

char GeneratedTokenChar(std::uint32_t k) { return static_cast<char>('a' + k % 26); }

FaceResponse OpenAiError(int status, std::string_view code, std::string_view message) {
  const std::string_view type = status == 503                   ? "service_unavailable_error"
                                : status >= 400 && status < 500 ? "invalid_request_error"
                                                                : "server_error";
  FaceResponse r{.status = status, .body = Dump({{"error", {{"message", message}, {"type", type}, {"code", code}}}})};
  if (status == 503) r.headers.emplace_back("retry-after", "1");
  return r;
}

std::pair<std::string, std::string> ListenerErrorBody(int status, std::string_view message) {
  const std::string_view code = status == 413   ? "body_too_large"
                                : status == 431 ? "headers_too_large"
                                                : "invalid_argument";
  FaceResponse r = OpenAiError(status, code, message);
  return {r.content_type, std::move(r.body)};
}

// ---------------------------------------------------------------------------------------------
// OpenAiAnswer.

OpenAiAnswer::OpenAiAnswer(OpenAiApi api, std::string id, std::int64_t created, std::string_view model,
                           Delivery delivery, bool include_usage)
    : api_(api),
      id_(std::move(id)),
      delivery_(delivery),
      include_usage_(include_usage),
      created_(created),
      model_(model) {
  const Json head = {{"id", id_},
                     {"object", api_ == OpenAiApi::kChat ? "chat.completion.chunk" : "text_completion"},
                     {"created", created_},
                     {"model", model_}};
  chunk_head_ = Dump(head);
  chunk_head_.pop_back();  // the closing brace: each chunk appends its choices
}

std::string OpenAiAnswer::Body(const OpenAiUsage& usage, const KvTransferParams* kv_transfer_params) const {
  std::string text(usage.completion_tokens, ' ');
  for (std::uint32_t k = 0; k < usage.completion_tokens; ++k) text[k] = GeneratedTokenChar(k);
  Json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", "length"}};
  if (api_ == OpenAiApi::kChat) {
    choice["message"] = {{"role", "assistant"}, {"content", std::move(text)}};
  } else {
    choice["text"] = std::move(text);
  }
  Json body = {{"id", id_},
               {"object", api_ == OpenAiApi::kChat ? "chat.completion" : "text_completion"},
               {"created", created_},
               {"model", model_},
               {"choices", Json::array({std::move(choice)})},
               {"usage", UsageJson(usage)}};
  if (kv_transfer_params != nullptr)
    body["kv_transfer_params"] = Json::parse(KvTransferParamsJson(*kv_transfer_params));
  return Dump(body);
}

std::string OpenAiAnswer::TokenEvent(std::uint32_t k, bool last) const {
  const char c = GeneratedTokenChar(k);  // a letter: nothing to escape
  const std::string_view finish = last ? "\"length\"" : "null";
  if (api_ == OpenAiApi::kChat) {
    return fmt::format(R"(data: {},"choices":[{{"index":0,"delta":{{{}"content":"{}"}},"logprobs":null,)"
                       R"("finish_reason":{}}}]}})"
                       "\n\n",
                       chunk_head_, k == 0 ? R"("role":"assistant",)" : "", c, finish);
  }
  return fmt::format(R"(data: {},"choices":[{{"index":0,"text":"{}","logprobs":null,"finish_reason":{}}}]}})"
                     "\n\n",
                     chunk_head_, c, finish);
}

std::string OpenAiAnswer::UsageEvent(const OpenAiUsage& usage) const {
  return fmt::format("data: {},\"choices\":[],\"usage\":{}}}\n\n", chunk_head_, Dump(UsageJson(usage)));
}

std::string OpenAiAnswer::ErrorEvent(std::string_view code, std::string_view message) {
  return fmt::format("data: {}\n\n", OpenAiError(500, code, message).body);
}

// ---------------------------------------------------------------------------------------------
// OpenAiFace.

OpenAiFace::OpenAiFace(OpenAiFaceOptions options)
    : options_(std::move(options)), id_tag_([] {
        std::random_device rd;
        return (static_cast<std::uint64_t>(rd()) << 32) | rd();
      }()) {}

std::string OpenAiFace::FreshId() { return fmt::format("{:016x}{:08x}", id_tag_, next_id_.fetch_add(1) + 1); }

std::string OpenAiFace::RenderChat(const std::vector<std::pair<std::string, std::string>>& messages,
                                   bool add_generation_prompt) {
  std::string out;
  for (const auto& [role, content] : messages) out += MessageHead(role) + content + std::string(kMessageEnd);
  if (add_generation_prompt) out += kGenerationPrompt;
  return out;
}

std::variant<FaceResponse, OpenAiGeneration> OpenAiFace::Handle(std::string_view method, std::string_view path,
                                                                std::string_view body, std::string_view request_id) {
  const auto only = [&](std::string_view allowed) -> std::optional<FaceResponse> {
    if (method == allowed) return std::nullopt;
    FaceResponse r = OpenAiError(405, "method_not_allowed", fmt::format("{} takes {} only", path, allowed));
    r.headers.emplace_back("allow", std::string(allowed));
    return r;
  };
  if (path == kHealthPath) {
    if (auto r = only("GET")) return *r;
    return FaceResponse{.status = 200, .content_type = "text/plain; charset=utf-8", .body = ""};
  }
  if (path == kModelsPath) {
    if (auto r = only("GET")) return *r;
    return JsonResponse({{"object", "list"},
                         {"data", Json::array({{{"id", options_.model},
                                                {"object", "model"},
                                                {"created", UnixSeconds()},
                                                {"owned_by", "kvmocker"},
                                                {"root", options_.model},
                                                {"max_model_len", options_.max_model_len}}})}});
  }
  const bool generate = path == kChatPath || path == kCompletionsPath;
  const bool render = path == kChatRenderPath || path == kCompletionsRenderPath;
  const bool tokenize = path == kTokenizePath;
  if (!generate && !render && !tokenize) {
    return OpenAiError(404, "not_found", fmt::format("no such path: {}", path));
  }
  if (auto r = only("POST")) return *r;

  try {
    auto request = ParseObject(body);
    if (!request.ok()) return Refusal(request.status());
    if (Status s = CheckModel(*request, options_.model); !s.ok()) return Refusal(s);
    OpenAiApi api = path == kChatPath || path == kChatRenderPath ? OpenAiApi::kChat : OpenAiApi::kCompletions;
    if (tokenize) api = Field(*request, "messages") != nullptr ? OpenAiApi::kChat : OpenAiApi::kCompletions;
    auto prompt = Prompt(*request, api);
    if (!prompt.ok()) return Refusal(prompt.status());

    if (tokenize) {
      const std::size_t n = prompt->tokens.size();
      return JsonResponse(
          {{"tokens", std::move(prompt->tokens)}, {"count", n}, {"max_model_len", options_.max_model_len}});
    }
    if (render) {
      Json ids = {{"token_ids", std::move(prompt->tokens)}};
      if (!prompt->items.empty()) {
        Json hashes = Json::array();
        Json places = Json::array();
        for (const MmItem& item : prompt->items) {
          hashes.push_back(HexIdentifier(item.hash));
          places.push_back({{"offset", item.offset}, {"length", item.length}});
        }
        ids["features"] = {{"mm_hashes", {{"image", std::move(hashes)}}},
                           {"mm_placeholders", {{"image", std::move(places)}}}};
      }
      return JsonResponse(api == OpenAiApi::kChat ? ids : Json::array({std::move(ids)}));
    }

    if (prompt->tokens.size() > options_.max_model_len) {
      return Refusal(InvalidArgument(
          fmt::format("This model's maximum context length is {} tokens. However, your request has {} input tokens.",
                      options_.max_model_len, prompt->tokens.size())));
    }
    auto max_tokens = MaxTokens(*request, api);
    if (!max_tokens.ok()) return Refusal(max_tokens.status());
    auto stream = BoolField(*request, "stream", false);
    if (!stream.ok()) return Refusal(stream.status());
    bool include_usage = false;
    if (const Json* options = Field(*request, "stream_options")) {
      if (!options->is_object()) return Refusal(InvalidArgument("'stream_options' must be an object"));
      auto usage = BoolField(*options, "include_usage", false);
      if (!usage.ok()) return Refusal(usage.status());
      include_usage = *usage;
    }
    Json leg_fields = Json::object();
    for (const std::string_view key : kLegFieldNames) {
      if (const auto it = request->find(key); it != request->end()) leg_fields[std::string(key)] = *it;
    }
    auto legs = ParseLegFields(Dump(leg_fields));
    if (!legs.ok()) return Refusal(legs.status());
    const std::string suffix = request_id.empty() ? FreshId() : std::string(request_id);
    return OpenAiGeneration{
        .prompt = std::move(prompt->tokens),
        .mm_items = std::move(prompt->items),
        .max_tokens = *max_tokens,
        .answer =
            OpenAiAnswer(api, (api == OpenAiApi::kChat ? "chatcmpl-" : "cmpl-") + suffix, UnixSeconds(), options_.model,
                         *stream ? OpenAiAnswer::Delivery::kStream : OpenAiAnswer::Delivery::kWhole, include_usage),
        .legs = std::move(legs).value()};
  } catch (const Json::exception& e) {  // a check above missed a type: still the client's fault
    return OpenAiError(400, "invalid_argument", e.what());
  }
}

}  // namespace kvrouter
