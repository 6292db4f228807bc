#include "router/kvgateway/openai.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <limits>

namespace kvrouter {

using json = nlohmann::json;

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

Result<std::vector<std::uint32_t>> ParseRenderAnswer(ApiKind kind, std::string_view body) {
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
  return TokenIds(*ids, "token_ids");
}

Result<std::vector<std::uint32_t>> ParseTokenizeAnswer(std::string_view body) {
  const json doc = json::parse(body, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return InvalidArgument("the tokenize answer is not a JSON object");
  const auto tokens = doc.find("tokens");
  if (tokens == doc.end()) return InvalidArgument("the tokenize answer has no 'tokens'");
  return TokenIds(*tokens, "tokens");
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
