#include "router/kvgateway/openai.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <limits>
#include <utility>

namespace kvrouter {

using json = nlohmann::json;
// Bodies the gateway edits keep their fields in the client's (or the engine's) order.
using ordered_json = nlohmann::ordered_json;

namespace {

Result<std::vector<std::uint32_t>> TokenIds(const json& array, std::string_view field) {
  if (!array.is_array()) return InvalidArgument(fmt::format("'{}' is not an array", field));
  std::vector<std::uint32_t> ids;
  ids.reserve(array.size());
  for (const json& t : array) {
    if (!t.is_number_unsigned() || t.get<std::uint64_t>() > std::numeric_limits<std::uint32_t>::max()) {
      return InvalidArgument(fmt::format("'{}' holds something other than a token id", field));
    }
    ids.push_back(t.get<std::uint32_t>());
  }
  return ids;
}

}  // namespace

Result<OpenAiRequest> ParseOpenAiRequest(ApiKind kind, std::string_view body) {
  const json doc = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return InvalidArgument("the body is not valid JSON");
  if (!doc.is_object()) return InvalidArgument("the body must be a JSON object");
  OpenAiRequest r{.kind = kind};
  const auto model = doc.find("model");
  if (model == doc.end() || !model->is_string() || model->get_ref<const std::string&>().empty()) {
    return InvalidArgument("'model' is required (a non-empty string)");
  }
  r.model = model->get<std::string>();
  if (const auto stream = doc.find("stream"); stream != doc.end() && !stream->is_null()) {
    if (!stream->is_boolean()) return InvalidArgument("'stream' must be true or false");
    r.stream = stream->get<bool>();
  }
  if (const auto options = doc.find("stream_options"); options != doc.end() && options->is_object()) {
    const auto usage = options->find("include_usage");
    r.include_usage = usage != options->end() && usage->is_boolean() && usage->get<bool>();
  }
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {  // the latter wins, as in vLLM
    if (const auto m = doc.find(key); m != doc.end() && m->is_number_unsigned()) r.max_tokens = m->get<std::uint64_t>();
  }
  if (const auto salt = doc.find("cache_salt"); salt != doc.end() && !salt->is_null()) {
    if (!salt->is_string()) return InvalidArgument("'cache_salt' must be a string");
    r.cache_salt = salt->get<std::string>();
  }
  json tokenize{{"model", r.model}};
  if (kind == ApiKind::kChat) {
    const auto messages = doc.find("messages");
    if (messages == doc.end() || !messages->is_array() || messages->empty()) {
      return InvalidArgument("'messages' is required (a non-empty array)");
    }
    tokenize["messages"] = *messages;
  } else {
    const auto prompt = doc.find("prompt");
    if (prompt == doc.end() || prompt->is_null()) return InvalidArgument("'prompt' is required");
    if (!prompt->is_string() && !prompt->is_array()) {
      return InvalidArgument("'prompt' must be a string or an array");
    }
    tokenize["prompt"] = *prompt;
  }
  r.tokenize_body = DumpJson(tokenize);
  return r;
}

namespace {

Result<std::vector<MmItem>> MmItems(const json& features) {
  std::vector<MmItem> items;
  if (!features.is_object()) return InvalidArgument("the render answer's 'features' is not an object");
  const auto hashes = features.find("mm_hashes");
  const auto places = features.find("mm_placeholders");
  if (hashes == features.end() || hashes->is_null()) return items;
  if (!hashes->is_object() || places == features.end() || !places->is_object()) {
    return InvalidArgument("the render answer's 'mm_hashes' come without 'mm_placeholders'");
  }
  for (const auto& [modality, ids] : hashes->items()) {
    const auto at = places->find(modality);
    if (!ids.is_array() || at == places->end() || !at->is_array() || at->size() != ids.size()) {
      return InvalidArgument(fmt::format("the render answer's '{}' hashes and placeholders do not pair up", modality));
    }
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const json& place = (*at)[k];
      if (!ids[k].is_string() || !place.is_object()) {
        return InvalidArgument("the render answer holds a malformed multimodal item");
      }
      const auto offset = place.find("offset");
      const auto length = place.find("length");
      if (offset == place.end() || length == place.end() || !offset->is_number_unsigned() ||
          !length->is_number_unsigned() || offset->get<std::uint64_t>() > 0xffffffffu ||
          length->get<std::uint64_t>() > 0xffffffffu) {
        return InvalidArgument("the render answer holds a placeholder without a u32 offset and length");
      }
      if (items.size() == kMaxMmItems) return InvalidArgument("the render answer holds too many multimodal items");
      items.push_back({.hash = MmItemHash(ids[k].get<std::string>()),
                       .offset = offset->get<std::uint32_t>(),
                       .length = length->get<std::uint32_t>()});
    }
  }
  return items;
}

}  // namespace

Result<RenderedPrompt> ParseRenderAnswer(ApiKind kind, std::string_view body) {
  const json doc = json::parse(body, nullptr, false);
  if (doc.is_discarded()) return InvalidArgument("the render answer is not JSON");
  const json* holder = &doc;
  if (kind == ApiKind::kCompletions) {
    if (!doc.is_array() || doc.empty()) return InvalidArgument("the render answer is not a non-empty array");
    holder = &doc.front();
  }
  if (!holder->is_object()) return InvalidArgument("the render answer holds no object");
  const auto ids = holder->find("token_ids");
  if (ids == holder->end()) return InvalidArgument("the render answer has no 'token_ids'");
  auto tokens = TokenIds(*ids, "token_ids");
  if (!tokens.ok()) return tokens.status();
  RenderedPrompt r{.token_ids = std::move(tokens).value()};
  if (const auto features = holder->find("features"); features != holder->end() && !features->is_null()) {
    auto items = MmItems(*features);
    if (!items.ok()) return items.status();
    r.mm_items = std::move(items).value();
  }
  return r;
}

std::vector<MmItem> RouteItems(const OpenAiRequest& request, const RenderedPrompt& rendered) {
  std::vector<MmItem> items = rendered.mm_items;
  if (!request.cache_salt.empty() && items.size() < kMaxMmItems) {
    items.push_back({.hash = MmItemHash(request.cache_salt), .offset = 0, .length = 1});
  }
  return items;
}

Result<std::vector<std::uint32_t>> ParseTokenizeAnswer(std::string_view body) {
  const json doc = json::parse(body, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return InvalidArgument("the tokenize answer is not a JSON object");
  const auto tokens = doc.find("tokens");
  if (tokens == doc.end()) return InvalidArgument("the tokenize answer has no 'tokens'");
  return TokenIds(*tokens, "tokens");
}

namespace {

std::string DumpOrdered(const ordered_json& doc) { return doc.dump(-1, ' ', false, json::error_handler_t::replace); }

Result<ordered_json> ParseObject(std::string_view body, std::string_view what) {
  ordered_json doc = ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return InvalidArgument(fmt::format("{} is not a JSON object", what));
  return doc;
}

}  // namespace

Result<std::string> NixlPrefillBody(std::string_view body) {
  auto doc = ParseObject(body, "the body");
  if (!doc.ok()) return doc.status();
  ordered_json& d = *doc;
  // vLLM's NixlConnector: the prefill engine keeps the prompt's blocks for a decode engine to pull.
  d["kv_transfer_params"] = ordered_json{{"do_remote_decode", true}, {"do_remote_prefill", false},
                                         {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                                         {"remote_host", nullptr},      {"remote_port", nullptr}};
  d["stream"] = false;
  d["max_tokens"] = 1;
  if (d.contains("max_completion_tokens")) d["max_completion_tokens"] = 1;
  for (const char* gone : {"stream_options", "min_tokens", "min_completion_tokens"}) d.erase(gone);
  return DumpOrdered(d);
}

Result<std::string> WithFields(std::string_view body,
                               const std::vector<std::pair<std::string, std::string>>& fields) {
  auto doc = ParseObject(body, "the body");
  if (!doc.ok()) return doc.status();
  std::vector<ordered_json> values;
  bool present = false;
  for (const auto& [name, text] : fields) {
    values.push_back(ordered_json::parse(text, nullptr, false));
    if (values.back().is_discarded()) return InvalidArgument(fmt::format("the value of '{}' is not JSON", name));
    present = present || doc->contains(name);
  }
  if (present) {  // a field to replace: the object is edited and written anew
    for (std::size_t i = 0; i < fields.size(); ++i) (*doc)[fields[i].first] = std::move(values[i]);
    return DumpOrdered(*doc);
  }
  // A JSON object ends with '}' after optional whitespace: the fields go before it.
  std::size_t end = body.find_last_not_of(" \t\r\n");
  std::string out(body.substr(0, end));
  bool first = doc->empty();
  for (const auto& [name, text] : fields) {
    if (!std::exchange(first, false)) out += ',';
    out += DumpOrdered(ordered_json(name));
    out += ':';
    out += text;
  }
  out += '}';
  return out;
}

Result<PrefillAnswer> ParsePrefillAnswer(std::string_view body) {
  auto doc = ParseObject(body, "the prefill answer");
  if (!doc.ok()) return doc.status();
  PrefillAnswer a;
  if (const auto p = doc->find("kv_transfer_params"); p != doc->end() && !p->is_null()) {
    if (!p->is_object()) return InvalidArgument("the prefill answer's 'kv_transfer_params' is not an object");
    a.kv_transfer_params = DumpOrdered(*p);
  }
  if (const auto choices = doc->find("choices"); choices != doc->end() && choices->is_array()) {
    for (const auto& c : *choices) {
      if (c.is_object() && c.value("finish_reason", nlohmann::ordered_json()) == "length") a.stopped_at_length = true;
    }
  }
  if (const auto usage = doc->find("usage"); usage != doc->end() && usage->is_object()) {
    const auto details = usage->find("prompt_tokens_details");
    if (details != usage->end() && details->is_object()) {
      const auto cached = details->find("cached_tokens");
      if (cached != details->end() && cached->is_number_unsigned() && cached->get<std::uint64_t>() <= 0xffffffffu) {
        a.cached_tokens = cached->get<std::uint32_t>();
      }
    }
  }
  return a;
}

std::optional<std::string> WithCachedTokens(std::string_view body, std::uint32_t cached_tokens) {
  auto doc = ParseObject(body, "the answer");
  if (!doc.ok()) return std::nullopt;
  const auto usage = doc->find("usage");
  if (usage == doc->end() || !usage->is_object()) return std::nullopt;
  ordered_json& details = (*usage)["prompt_tokens_details"];
  if (!details.is_object()) details = ordered_json::object();
  details["cached_tokens"] = cached_tokens;
  return DumpOrdered(*doc);
}

Result<std::string> AsEventStream(ApiKind kind, std::string_view body, bool include_usage) {
  auto doc = ParseObject(body, "the answer");
  if (!doc.ok()) return doc.status();
  ordered_json head = ordered_json::object();
  for (const char* key : {"id", "object", "created", "model"}) {
    if (const auto v = doc->find(key); v != doc->end()) head[key] = *v;
  }
  head["object"] = kind == ApiKind::kChat ? "chat.completion.chunk" : "text_completion";
  ordered_json chunk = head;
  chunk["choices"] = ordered_json::array();
  if (const auto choices = doc->find("choices"); choices != doc->end() && choices->is_array()) {
    for (std::size_t i = 0; i < choices->size(); ++i) {
      const ordered_json& c = (*choices)[i];
      if (!c.is_object()) continue;
      ordered_json out{{"index", c.value("index", ordered_json(i))}};
      if (kind == ApiKind::kChat) {
        const auto message = c.find("message");
        const bool has = message != c.end() && message->is_object() && message->contains("content");
        out["delta"] = {{"role", "assistant"}, {"content", has ? message->at("content") : ordered_json("")}};
      } else {
        out["text"] = c.value("text", ordered_json(""));
      }
      out["finish_reason"] = c.value("finish_reason", ordered_json());
      chunk["choices"].push_back(std::move(out));
    }
  }
  std::string events = "data: " + DumpOrdered(chunk) + "\n\n";
  if (const auto usage = doc->find("usage"); include_usage && usage != doc->end()) {
    ordered_json last = head;
    last["choices"] = ordered_json::array();
    last["usage"] = *usage;
    events += "data: " + DumpOrdered(last) + "\n\n";
  }
  events += "data: [DONE]\n\n";
  return events;
}

std::string DumpJson(const json& doc) { return doc.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string OpenAiError(std::string_view message, std::string_view type, std::string_view code) {
  return DumpJson(json{{"error", {{"message", message}, {"type", type}, {"code", code}}}});
}

std::string_view RenderPath(ApiKind kind) {
  return kind == ApiKind::kChat ? "/v1/chat/completions/render" : "/v1/completions/render";
}

std::string_view ApiPath(ApiKind kind) { return kind == ApiKind::kChat ? "/v1/chat/completions" : "/v1/completions"; }

}  // namespace kvrouter
