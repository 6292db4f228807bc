#include "router/kvgateway/openai.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <simdjson.h>

#include <bit>
#include <cstring>
#include <limits>
#include <memory>
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

namespace openai_parsers {

Result<OpenAiRequest> ReferenceOpenAiRequest(ApiKind kind, std::string_view body) {
  // JSON has no raw NUL byte anywhere, and nlohmann-json would end its input at one (taking
  // what precedes it): the body is forwarded unchanged, so it must be JSON whole.
  if (body.find('\0') != std::string_view::npos) return InvalidArgument("the body is not valid JSON");
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
  if (kind == ApiKind::kChat) {
    const auto messages = doc.find("messages");
    if (messages == doc.end() || !messages->is_array() || messages->empty()) {
      return InvalidArgument("'messages' is required (a non-empty array)");
    }
  } else {
    const auto prompt = doc.find("prompt");
    if (prompt == doc.end() || prompt->is_null()) return InvalidArgument("'prompt' is required");
    if (!prompt->is_string() && !prompt->is_array()) {
      return InvalidArgument("'prompt' must be a string or an array");
    }
  }
  return r;
}

}  // namespace openai_parsers

std::string TokenizeBody(const OpenAiRequest& request, std::string_view body) {
  const char* key = request.kind == ApiKind::kChat ? "messages" : "prompt";
  json tokenize{{"model", request.model}};
  const json doc = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (doc.is_object()) {
    if (const auto field = doc.find(key); field != doc.end()) tokenize[key] = *field;
  }
  return DumpJson(tokenize);
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

namespace openai_parsers {

Result<RenderedPrompt> ReferenceRenderAnswer(ApiKind kind, std::string_view body) {
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

}  // namespace openai_parsers

namespace {

namespace od = simdjson::ondemand;

// A thread keeps its parser and padded copy between calls for bodies up to this size; a larger
// body gets its own for the one call, so what a thread keeps stays bounded.
constexpr std::size_t kKeptParserBytes = 256 * 1024;

struct ParserAndCopy {
  od::parser parser;
  std::string padded;  // the body and SIMDJSON_PADDING spaces: simdjson reads past the end
};

// `read(document)` over `body`; nullopt when simdjson cannot start on it.
template <typename T, typename Read>
std::optional<T> WithDocument(std::string_view body, Read&& read) {
  auto run = [&](ParserAndCopy& p) -> std::optional<T> {
    p.padded.assign(body);
    p.padded.append(simdjson::SIMDJSON_PADDING, ' ');
    od::document doc;
    if (p.parser.iterate(p.padded.data(), body.size(), p.padded.size()).get(doc)) return std::nullopt;
    std::optional<T> out = read(doc);
    // Nothing may follow the top-level value: a location inside the body means something does.
    const char* rest = nullptr;
    if (out && !doc.current_location().get(rest)) return std::nullopt;
    return out;
  };
  if (body.size() <= kKeptParserBytes) {
    thread_local ParserAndCopy kept;
    return run(kept);
  }
  ParserAndCopy once;
  return run(once);
}

// Values nested deeper than this are left to the reference parser: Valid recurses once per
// level, and a small body can nest deep enough to overflow the stack.
constexpr int kMaxFastDepth = 128;

// Reads a value whole (every string unescaped, every number and literal checked): On-Demand
// skips what is not read without checking it, and a body it takes must be JSON to nlohmann too.
bool Valid(od::value v, int depth = 0) {
  if (depth > kMaxFastDepth) return false;
  od::json_type type{};
  if (v.type().get(type)) return false;
  switch (type) {
    case od::json_type::object: {
      od::object object;
      if (v.get_object().get(object)) return false;
      for (auto f : object) {
        od::field field;
        std::string_view key;
        if (std::move(f).get(field) || field.unescaped_key().get(key) || !Valid(field.value(), depth + 1)) return false;
      }
      return true;
    }
    case od::json_type::array: {
      od::array array;
      if (v.get_array().get(array)) return false;
      for (auto e : array) {
        od::value element;
        if (std::move(e).get(element) || !Valid(element, depth + 1)) return false;
      }
      return true;
    }
    case od::json_type::number: {
      od::number n;
      return !v.get_number().get(n);
    }
    case od::json_type::string: {
      std::string_view s;
      return !v.get_string().get(s);
    }
    case od::json_type::boolean: {
      bool b = false;
      return !v.get_bool().get(b);
    }
    case od::json_type::null: {
      bool is = false;
      return !v.is_null().get(is) && is;
    }
  }
  return false;
}

// A whole number the reference calls unsigned (no sign, no fraction, no exponent); nullopt for
// any other number; false when `v` (a number) is malformed.
bool UnsignedNumber(od::value v, std::optional<std::uint64_t>& out) {
  const bool negative = v.is_negative();
  od::number n;
  if (v.get_number().get(n)) return false;
  out.reset();
  if (n.get_number_type() == od::number_type::unsigned_integer) {
    out = n.get_uint64();
  } else if (n.get_number_type() == od::number_type::signed_integer && !negative) {
    out = static_cast<std::uint64_t>(n.get_int64());
  }
  return true;
}

// The fields of a client body the gateway reads; each may appear once for the fast path.
enum ClientField : unsigned {
  kModel, kStream, kStreamOptions, kMaxTokens, kMaxCompletionTokens, kCacheSalt, kMessages, kPrompt, kOther
};

ClientField ClientFieldOf(std::string_view key) {
  static constexpr std::pair<std::string_view, ClientField> kNames[] = {
      {"model", kModel},           {"stream", kStream},
      {"stream_options", kStreamOptions}, {"max_tokens", kMaxTokens},
      {"max_completion_tokens", kMaxCompletionTokens}, {"cache_salt", kCacheSalt},
      {"messages", kMessages},     {"prompt", kPrompt}};
  for (const auto& [name, field] : kNames) {
    if (key == name) return field;
  }
  return kOther;
}

// stream_options: include_usage when it is an object holding include_usage true once.
bool ReadStreamOptions(od::value v, bool& include_usage) {
  od::json_type type{};
  if (v.type().get(type)) return false;
  if (type != od::json_type::object) return Valid(v);
  od::object object;
  if (v.get_object().get(object)) return false;
  bool seen = false;
  for (auto f : object) {
    od::field field;
    std::string_view key;
    if (std::move(f).get(field) || field.unescaped_key().get(key)) return false;
    if (key != "include_usage") {
      if (!Valid(field.value())) return false;
      continue;
    }
    if (std::exchange(seen, true)) return false;
    od::value usage = field.value();
    if (usage.type().get(type)) return false;
    if (type != od::json_type::boolean) {
      if (!Valid(usage)) return false;
      continue;
    }
    if (usage.get_bool().get(include_usage)) return false;
  }
  return true;
}

// One field of a client body into `r`; false when the reference is to decide.
bool ReadClientField(ClientField which, od::value v, OpenAiRequest& r,
                     std::optional<std::uint64_t> (&max_tokens)[2]) {
  od::json_type type{};
  if (v.type().get(type)) return false;
  switch (which) {
    case kModel: {
      std::string_view model;
      if (type != od::json_type::string || v.get_string().get(model) || model.empty()) return false;
      r.model = model;
      return true;
    }
    case kStream:
      if (type == od::json_type::boolean) return !v.get_bool().get(r.stream);
      return type == od::json_type::null && Valid(v);
    case kStreamOptions:
      return ReadStreamOptions(v, r.include_usage);
    case kMaxTokens:
    case kMaxCompletionTokens:
      if (type != od::json_type::number) return Valid(v);
      return UnsignedNumber(v, max_tokens[which == kMaxCompletionTokens]);
    case kCacheSalt: {
      if (type == od::json_type::null) return Valid(v);
      std::string_view salt;
      if (type != od::json_type::string || v.get_string().get(salt)) return false;
      r.cache_salt = salt;
      return true;
    }
    case kMessages: {
      if (r.kind != ApiKind::kChat) return Valid(v);
      od::array messages;
      if (type != od::json_type::array || v.get_array().get(messages)) return false;
      std::size_t n = 0;
      for (auto e : messages) {
        od::value message;
        if (std::move(e).get(message) || !Valid(message)) return false;
        ++n;
      }
      return n > 0;
    }
    case kPrompt:
      if (r.kind != ApiKind::kCompletions) return Valid(v);
      return (type == od::json_type::string || type == od::json_type::array) && Valid(v);
    case kOther:
      return Valid(v);
  }
  return false;
}

bool IsJsonSpace(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

constexpr std::uint64_t kOnes = 0x0101010101010101ull;

// The high bit of each byte of `w` that is zero.
std::uint64_t ZeroBytes(std::uint64_t w) { return ~(((w & 0x7F * kOnes) + 0x7F * kOnes) | w) & 0x80 * kOnes; }

// The value of the `digits` (1 to 8) ASCII digits that begin `w` (the first in its low byte):
// moved to the high end, leading zeros below them, then summed in pairs, fours and eights.
std::uint32_t DigitsValue(std::uint64_t w, unsigned digits) {
  std::uint64_t v = (w << (8 * (8 - digits))) & 0x0F * kOnes;
  v = (v * 2561) >> 8;
  v = ((v & 0x00FF00FF00FF00FFull) * 6553601) >> 16;
  return static_cast<std::uint32_t>(((v & 0x0000FFFF0000FFFFull) * 42949672960001ull) >> 32);
}

// The numbers of an array of token ids as engines write it, "1,2,3" from `start` to `end` (its
// ']'): the separators found 8 bytes at a time, each number read from its own 8 bytes (no number
// waits for the one before it to be read). 8 bytes are readable from any place up to `end`
// (the document is padded). False for anything else, `out` untouched.
bool ReadCompactIds(const char* start, const char* const end, std::vector<std::uint32_t>& out) {
  static_assert(std::endian::native == std::endian::little, "a number's first digit is the low byte");
  // Filled here and copied once: the count is known only at the end (at most one a comma).
  thread_local std::unique_ptr<std::uint32_t[]> ids;  // not zeroed, unlike a vector's resize
  thread_local std::size_t room = 0;
  if (const std::size_t most = static_cast<std::size_t>(end - start) / 2 + 1; most > room) {
    ids.reset(new std::uint32_t[most]);
    room = most;
  }
  std::size_t n = 0;
  const auto take = [&](const char* at) {  // the number from `start` to `at`
    const auto digits = static_cast<std::size_t>(at - start);
    if (digits - 1 >= 10 || (digits > 1 && *start == '0')) return false;
    std::uint64_t w;
    std::memcpy(&w, start, 8);
    if (digits <= 8) {
      ids[n++] = DigitsValue(w, static_cast<unsigned>(digits));
    } else {  // 9 or 10: the first 8, then the rest one by one
      std::uint64_t v = DigitsValue(w, 8);
      for (const char* d = start + 8; d < at; ++d) v = v * 10 + static_cast<std::uint64_t>(*d - '0');
      if (v > std::numeric_limits<std::uint32_t>::max()) return false;
      ids[n++] = static_cast<std::uint32_t>(v);
    }
    start = at + 1;
    return true;
  };
  const auto read = [&] {
    for (const char* p = start; p < end; p += 8) {
      std::uint64_t w;
      std::memcpy(&w, p, 8);
      // The bytes that are not '0'..'9' ('9' + 6 still has 3 as its high half; a carry out of a
      // byte over 0xF9 changes only bytes after it), of those before the ']'.
      std::uint64_t other =
          ~ZeroBytes(((w & 0xF0 * kOnes) ^ 0x30 * kOnes) | (((w + 6 * kOnes) & 0xF0 * kOnes) ^ 0x30 * kOnes)) &
          0x80 * kOnes;
      if (end - p < 8) other &= (std::uint64_t{1} << (8 * (end - p))) - 1;
      if ((other & ~ZeroBytes(w ^ ',' * kOnes)) != 0) return false;  // not a comma
      for (; other != 0; other &= other - 1) {
        if (!take(p + std::countr_zero(other) / 8)) return false;
      }
    }
    return take(end);
  };
  const bool ok = read();
  if (ok) out.insert(out.end(), ids.get(), ids.get() + n);
  if (room > (std::size_t{1} << 20)) {  // a huge prompt's room is not kept, read or not
    ids.reset();
    room = 0;
  }
  return ok;
}

// The same numbers with whitespace around them and their commas, a byte at a time. False for
// anything else, `out` as it was.
bool ReadSpacedIds(const char* p, const char* const end, std::vector<std::uint32_t>& out) {
  const std::size_t had = out.size();
  for (;;) {
    while (p < end && IsJsonSpace(*p)) ++p;
    const char* const first = p;
    std::uint64_t v = 0;
    while (p < end && *p >= '0' && *p <= '9' && p - first <= 10) v = v * 10 + static_cast<std::uint64_t>(*p++ - '0');
    const auto digits = p - first;
    if (digits == 0 || digits > 10 || (digits > 1 && *first == '0') || v > std::numeric_limits<std::uint32_t>::max()) {
      break;
    }
    out.push_back(static_cast<std::uint32_t>(v));
    while (p < end && IsJsonSpace(*p)) ++p;
    if (p == end) return true;
    if (*p++ != ',') break;
  }
  out.resize(had);
  return false;
}

// An array of token ids: `raw` is its text (whitespace may follow it) inside a padded document.
// False for anything but whole numbers below 2^32 (a sign, a fraction, a leading zero): the
// reference parser decides those.
bool ReadIdArray(std::string_view raw, std::vector<std::uint32_t>& out) {
  while (!raw.empty() && IsJsonSpace(raw.back())) raw.remove_suffix(1);
  if (raw.size() < 2 || raw.front() != '[' || raw.back() != ']') return false;
  const char* const end = raw.data() + raw.size() - 1;  // the ']'
  const char* start = raw.data() + 1;
  while (start < end && IsJsonSpace(*start)) ++start;
  if (start == end) return true;
  return ReadCompactIds(start, end, out) || ReadSpacedIds(start, end, out);
}

// A chat render answer as engines write it: {"token_ids":[...]} with at most other keys whose
// values are null or plain strings (vLLM's request_id, a null features), read without simdjson's
// pass over the whole body (the ids in place, or copied with padding when the body ends within 8
// bytes of their ']', as it usually does). Nullopt for anything else, an escape or a byte outside
// printable ASCII in a string included: On-Demand and the reference decide those.
std::optional<RenderedPrompt> PlainChatRenderAnswer(std::string_view body) {
  const char* p = body.data();
  const char* const end = p + body.size();
  const auto space = [&] {
    while (p < end && IsJsonSpace(*p)) ++p;
  };
  const auto plain_string = [&]() -> std::optional<std::string_view> {  // at its opening quote
    if (p == end || *p != '"') return std::nullopt;
    const char* const first = ++p;
    while (p < end && *p != '"') {
      if (*p < 0x20 || *p > 0x7E || *p == '\\') return std::nullopt;
      ++p;
    }
    if (p == end) return std::nullopt;
    return std::string_view(first, static_cast<std::size_t>(p++ - first));
  };
  RenderedPrompt r;
  bool has_ids = false;
  space();
  if (p == end || *p++ != '{') return std::nullopt;
  for (;;) {
    space();
    const auto key = plain_string();
    if (!key) return std::nullopt;
    space();
    if (p == end || *p++ != ':') return std::nullopt;
    space();
    if (*key == "token_ids") {
      if (std::exchange(has_ids, true) || p == end || *p != '[') return std::nullopt;
      const auto* close = static_cast<const char*>(std::memchr(p, ']', static_cast<std::size_t>(end - p)));
      if (close == nullptr) return std::nullopt;
      std::string_view array(p, static_cast<std::size_t>(close + 1 - p));
      // The id reader loads 8 bytes at a time, up to 7 past the ']': a copy when the body ends
      // sooner.
      thread_local std::string padded;
      if (end - close < 8) {
        padded.assign(array).append(8, ' ');
        array = std::string_view(padded.data(), array.size());
      }
      const bool read = ReadIdArray(array, r.token_ids);
      if (padded.capacity() > (std::size_t{1} << 20)) padded = {};  // a huge prompt's room is not kept
      if (!read) return std::nullopt;
      p = close + 1;
    } else if (end - p >= 4 && std::string_view(p, 4) == "null") {
      p += 4;
    } else if (!plain_string() || *key == "features") {  // features other than null: multimodal items
      return std::nullopt;
    }
    space();
    if (p == end) return std::nullopt;
    if (*p == '}') break;
    if (*p++ != ',') return std::nullopt;
  }
  ++p;
  space();
  if (p != end || !has_ids) return std::nullopt;
  return r;
}

// A render answer's object: token_ids read into `r`; a features other than null is left to the
// reference (multimodal items).
bool ReadRenderObject(od::object object, RenderedPrompt& r) {
  bool has_ids = false;
  for (auto f : object) {
    od::field field;
    std::string_view key;
    if (std::move(f).get(field) || field.unescaped_key().get(key)) return false;
    od::value v = field.value();
    if (key == "features") {
      bool is_null = false;
      if (v.is_null().get(is_null) || !is_null) return false;
    } else if (key == "token_ids") {
      if (std::exchange(has_ids, true)) return false;
      od::array ids;
      std::string_view raw;
      if (v.get_array().get(ids) || ids.raw_json().get(raw) || !ReadIdArray(raw, r.token_ids)) return false;
    } else if (!Valid(v)) {
      return false;
    }
  }
  return has_ids;
}

}  // namespace

namespace openai_parsers {

std::optional<OpenAiRequest> FastOpenAiRequest(ApiKind kind, std::string_view body) {
  return WithDocument<OpenAiRequest>(body, [kind](od::document& doc) -> std::optional<OpenAiRequest> {
    od::object top;
    if (doc.get_object().get(top)) return std::nullopt;
    OpenAiRequest r{.kind = kind};
    std::optional<std::uint64_t> max_tokens[2];  // max_tokens, max_completion_tokens
    unsigned seen = 0;
    for (auto f : top) {
      od::field field;
      std::string_view key;
      if (std::move(f).get(field) || field.unescaped_key().get(key)) return std::nullopt;
      const ClientField which = ClientFieldOf(key);
      if (which != kOther && (std::exchange(seen, seen | 1u << which) & 1u << which)) return std::nullopt;
      if (!ReadClientField(which, field.value(), r, max_tokens)) return std::nullopt;
    }
    if (!(seen & 1u << kModel) || !(seen & 1u << (kind == ApiKind::kChat ? kMessages : kPrompt))) return std::nullopt;
    r.max_tokens = max_tokens[1] ? max_tokens[1] : max_tokens[0];  // the latter wins, as in vLLM
    return r;
  });
}

std::optional<RenderedPrompt> FastRenderAnswer(ApiKind kind, std::string_view body) {
  if (kind == ApiKind::kChat) {
    if (auto plain = PlainChatRenderAnswer(body)) return plain;
  }
  return WithDocument<RenderedPrompt>(body, [kind](od::document& doc) -> std::optional<RenderedPrompt> {
    RenderedPrompt r;
    if (kind == ApiKind::kChat) {
      od::object object;
      if (doc.get_object().get(object) || !ReadRenderObject(object, r)) return std::nullopt;
      return r;
    }
    od::array prompts;  // completions: the first prompt's
    if (doc.get_array().get(prompts)) return std::nullopt;
    bool first = true;
    for (auto e : prompts) {
      od::value prompt;
      if (std::move(e).get(prompt)) return std::nullopt;
      if (std::exchange(first, false)) {
        od::object object;
        if (prompt.get_object().get(object) || !ReadRenderObject(object, r)) return std::nullopt;
      } else if (!Valid(prompt)) {
        return std::nullopt;
      }
    }
    if (first) return std::nullopt;
    return r;
  });
}

}  // namespace openai_parsers

Result<OpenAiRequest> ParseOpenAiRequest(ApiKind kind, std::string_view body) {
  if (auto fast = openai_parsers::FastOpenAiRequest(kind, body)) return *std::move(fast);
  return openai_parsers::ReferenceOpenAiRequest(kind, body);
}

Result<RenderedPrompt> ParseRenderAnswer(ApiKind kind, std::string_view body) {
  if (auto fast = openai_parsers::FastRenderAnswer(kind, body)) return *std::move(fast);
  return openai_parsers::ReferenceRenderAnswer(kind, body);
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
