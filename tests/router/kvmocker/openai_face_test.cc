#include "router/kvmocker/openai_face.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "events/worker_codec.h"

namespace kvrouter {
namespace {

using Json = nlohmann::json;

// The answer a request gets at once (the test fails when it is a generation).
FaceResponse Answer(OpenAiFace& face, std::string_view method, std::string_view path, std::string_view body = "") {
  auto r = face.Handle(method, path, body, "");
  EXPECT_TRUE(std::holds_alternative<FaceResponse>(r)) << path << " " << body;
  if (!std::holds_alternative<FaceResponse>(r)) return {};
  return std::get<FaceResponse>(std::move(r));
}

OpenAiGeneration Generation(OpenAiFace& face, std::string_view path, const Json& body,
                            std::string_view request_id = "") {
  auto r = face.Handle("POST", path, body.dump(), request_id);
  if (auto* refused = std::get_if<FaceResponse>(&r)) {
    ADD_FAILURE() << path << " " << body.dump() << " -> " << refused->status << " " << refused->body;
    return {.answer = OpenAiAnswer(OpenAiApi::kChat, "", 0, "", OpenAiAnswer::Delivery::kWhole, false)};
  }
  return std::get<OpenAiGeneration>(std::move(r));
}

Json Parse(const std::string& s) {
  Json j = Json::parse(s, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << s;
  return j;
}

// The JSON of one "data: {...}\n\n" event.
Json EventJson(const std::string& event) {
  EXPECT_TRUE(event.starts_with("data: ")) << event;
  EXPECT_TRUE(event.ends_with("\n\n")) << event;
  return Parse(event.substr(6, event.size() - 8));
}

// Expects an OpenAI-shaped error with this status and code.
void ExpectError(const FaceResponse& r, int status, std::string_view code) {
  EXPECT_EQ(r.status, status) << r.body;
  EXPECT_EQ(r.content_type, "application/json");
  const Json j = Parse(r.body);
  ASSERT_TRUE(j.contains("error")) << r.body;
  EXPECT_EQ(j["error"]["code"], code) << r.body;
  EXPECT_TRUE(j["error"]["message"].is_string()) << r.body;
  EXPECT_TRUE(j["error"]["type"].is_string()) << r.body;
}

std::vector<std::uint32_t> Bytes(std::string_view s) { return ByteTokens(s); }

const Json kChat = {{"model", "mock"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}};

// ---- Tokenizer and renderer ----

TEST(ByteTokensTest, OneTokenPerUtf8ByteWithTheByteAsItsId) {
  EXPECT_EQ(ByteTokens("ab"), (std::vector<std::uint32_t>{97, 98}));
  EXPECT_EQ(ByteTokens("é"), (std::vector<std::uint32_t>{0xc3, 0xa9}));  // two bytes, two tokens
  EXPECT_TRUE(ByteTokens("").empty());
}

TEST(RenderChatTest, EachMessageThenTheAssistantPromptUnlessTurnedOff) {
  EXPECT_EQ(OpenAiFace::RenderChat({{"system", "be brief"}, {"user", "hi"}}, true),
            "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
  EXPECT_EQ(OpenAiFace::RenderChat({{"user", "hi"}}, false), "<|user|>\nhi\n");
}

TEST(OpenAiFaceTest, ChatPromptIsTheRenderedConversationsBytes) {
  OpenAiFace face({});
  const Json body = {{"model", "mock"},
                     {"messages",
                      {{{"role", "system"}, {"content", "sys"}},
                       {{"role", "user"},
                        {"content",
                         {{{"type", "text"}, {"text", "one"}},
                          {{"type", "image_url"}, {"image_url", {{"url", "x"}}}},
                          {{"type", "text"}, {"text", "two"}}}}},
                       {{"role", "assistant"}, {"content", nullptr}}}}};
  const OpenAiGeneration g = Generation(face, "/v1/chat/completions", body);
  // The image is kImageTokens placeholder tokens between the text parts, and one item.
  std::vector<std::uint32_t> want = Bytes("<|system|>\nsys\n<|user|>\none\n");
  const auto at = static_cast<std::uint32_t>(want.size());
  want.insert(want.end(), kImageTokens, kImageToken);
  const auto rest = Bytes("\ntwo\n<|assistant|>\n\n<|assistant|>\n");
  want.insert(want.end(), rest.begin(), rest.end());
  EXPECT_EQ(g.prompt, want);
  EXPECT_EQ(g.mm_items, (std::vector<MmItem>{{MmItemHash(MockImageIdentifier("x")), at, kImageTokens}}));
  EXPECT_EQ(g.max_tokens, 16u);  // the default
  EXPECT_EQ(g.answer.api(), OpenAiApi::kChat);
  EXPECT_EQ(g.answer.delivery(), OpenAiAnswer::Delivery::kWhole);
  EXPECT_FALSE(g.answer.include_usage());

  Json no_prompt = kChat;
  no_prompt["add_generation_prompt"] = false;
  EXPECT_EQ(Generation(face, "/v1/chat/completions", no_prompt).prompt, Bytes("<|user|>\nhi\n"));
}

TEST(OpenAiFaceTest, CompletionsPromptIsAStringsBytesOrAListOfTokenIds) {
  OpenAiFace face({});
  EXPECT_EQ(Generation(face, "/v1/completions", {{"model", "mock"}, {"prompt", "hello"}}).prompt, Bytes("hello"));
  const OpenAiGeneration ids =
      Generation(face, "/v1/completions", {{"model", "mock"}, {"prompt", {1, 2, 4294967295u}}, {"max_tokens", 3}});
  EXPECT_EQ(ids.prompt, (std::vector<std::uint32_t>{1, 2, 4294967295u}));
  EXPECT_EQ(ids.max_tokens, 3u);
  EXPECT_EQ(ids.answer.api(), OpenAiApi::kCompletions);
}

TEST(OpenAiFaceTest, MaxTokensStreamAndUsageOptionsAreRead) {
  OpenAiFace face({});
  Json chat = kChat;
  chat["max_tokens"] = 5;
  chat["max_completion_tokens"] = 7;  // wins for chat, as in vLLM
  chat["stream"] = true;
  chat["stream_options"] = {{"include_usage", true}};
  const OpenAiGeneration g = Generation(face, "/v1/chat/completions", chat);
  EXPECT_EQ(g.max_tokens, 7u);
  EXPECT_EQ(g.answer.delivery(), OpenAiAnswer::Delivery::kStream);
  EXPECT_TRUE(g.answer.include_usage());

  Json nulls = kChat;  // clients send null for "not given"
  nulls["max_tokens"] = nullptr;
  nulls["stream"] = nullptr;
  nulls["stream_options"] = nullptr;
  nulls["model"] = nullptr;  // the served model, as vLLM
  const OpenAiGeneration d = Generation(face, "/v1/chat/completions", nulls);
  EXPECT_EQ(d.max_tokens, 16u);
  EXPECT_EQ(d.answer.delivery(), OpenAiAnswer::Delivery::kWhole);

  Json top = {{"prompt", "x"}, {"max_tokens", kMaxGenerateTokens}};
  EXPECT_EQ(Generation(face, "/v1/completions", top).max_tokens, kMaxGenerateTokens);
}

TEST(OpenAiFaceTest, ResponseIdsFollowTheRequestIdHeaderOrAreFreshAndDistinct) {
  OpenAiFace face({});
  EXPECT_EQ(Generation(face, "/v1/chat/completions", kChat, "abc").answer.id(), "chatcmpl-abc");
  EXPECT_EQ(Generation(face, "/v1/completions", {{"prompt", "x"}}, "abc").answer.id(), "cmpl-abc");
  const std::string a = Generation(face, "/v1/chat/completions", kChat).answer.id();
  const std::string b = Generation(face, "/v1/chat/completions", kChat).answer.id();
  EXPECT_TRUE(a.starts_with("chatcmpl-")) << a;
  EXPECT_NE(a, b);
}

TEST(OpenAiFaceTest, BadRequestsAre400WithTheOpenAiErrorShape) {
  OpenAiFace face({});
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/v1/chat/completions", "{not json"},
      {"/v1/chat/completions", "[1, 2]"},
      {"/v1/chat/completions", R"({"model": "mock"})"},
      {"/v1/chat/completions", R"({"messages": []})"},
      {"/v1/chat/completions", R"({"messages": "hi"})"},
      {"/v1/chat/completions", R"({"messages": [{"content": "no role"}]})"},
      {"/v1/chat/completions", R"({"messages": [{"role": 1, "content": "x"}]})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": 7}]})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": [{"text": "untyped"}]}]})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 1})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "model": 3})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 65537})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "stream": "yes"})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "stream_options": 1})"},
      {"/v1/completions", R"({"model": "mock"})"},
      {"/v1/completions", R"({"prompt": ""})"},
      {"/v1/completions", R"({"prompt": []})"},
      {"/v1/completions", R"({"prompt": ["a", "b"]})"},
      {"/v1/completions", R"({"prompt": [1, -2]})"},
      {"/v1/completions", R"({"prompt": [4294967296]})"},
      {"/v1/completions", R"({"prompt": [1.0]})"},
      {"/v1/completions", R"({"prompt": 12})"},
      {"/v1/completions/render", R"({"prompt": {}})"},
      {"/tokenize", R"({"model": "mock"})"},
  };
  for (const auto& [path, body] : cases) {
    SCOPED_TRACE(path + " " + body);
    ExpectError(Answer(face, "POST", path, body), 400, "invalid_argument");
  }
}

TEST(OpenAiFaceTest, PromptOverTheContextLengthIsRefused) {
  OpenAiFace face({.max_model_len = 5});
  ExpectError(Answer(face, "POST", "/v1/completions", R"({"prompt": "123456"})"), 400, "invalid_argument");
  EXPECT_TRUE(
      std::holds_alternative<OpenAiGeneration>(face.Handle("POST", "/v1/completions", R"({"prompt": "12345"})", "")));
}

TEST(OpenAiFaceTest, UnknownModelIs404OnEveryPostEndpoint) {
  OpenAiFace face({.model = "mock"});
  for (const char* path : {"/v1/chat/completions", "/v1/completions", "/v1/chat/completions/render",
                           "/v1/completions/render", "/tokenize"}) {
    SCOPED_TRACE(path);
    const FaceResponse r = Answer(face, "POST", path, R"({"model": "gpt-9", "prompt": "x"})");
    ExpectError(r, 404, "model_not_found");
    EXPECT_NE(r.body.find("gpt-9"), std::string::npos);
  }
}

TEST(OpenAiFaceTest, UnknownPathsAre404AndKnownPathsWithAnotherMethod405) {
  OpenAiFace face({});
  ExpectError(Answer(face, "GET", "/v2/things"), 404, "not_found");
  ExpectError(Answer(face, "POST", "/v1/chat"), 404, "not_found");
  const FaceResponse get_chat = Answer(face, "GET", "/v1/chat/completions");
  ExpectError(get_chat, 405, "method_not_allowed");
  ASSERT_EQ(get_chat.headers.size(), 1u);
  EXPECT_EQ(get_chat.headers[0], (std::pair<std::string, std::string>{"allow", "POST"}));
  ExpectError(Answer(face, "POST", "/v1/models"), 405, "method_not_allowed");
  ExpectError(Answer(face, "DELETE", "/health"), 405, "method_not_allowed");
}

TEST(OpenAiFaceTest, ModelsListsTheServedModelAndHealthIs200) {
  OpenAiFace face({.model = "llama"});
  const FaceResponse models = Answer(face, "GET", "/v1/models");
  EXPECT_EQ(models.status, 200);
  const Json j = Parse(models.body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "llama");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["owned_by"], "kvmocker");
  EXPECT_EQ(Answer(face, "GET", "/health").status, 200);
}

// An image renders as vLLM's render endpoint shows one: placeholder tokens, and its identifier
// and placeholder under features; the same URL gives the same identifier, another URL another.
TEST(OpenAiFaceTest, RenderShowsImagesAsFeatures) {
  OpenAiFace face({});
  auto body = [](std::string url) {
    return Json{{"model", "mock"},
                {"messages",
                 {{{"role", "user"},
                   {"content", {{{"type", "text"}, {"text", "look"}}, {{"type", "image_url"}, {"image_url", url}}}}}}}}
        .dump();
  };
  const Json a = Parse(Answer(face, "POST", "/v1/chat/completions/render", body("data:image/png;base64,AAAA")).body);
  ASSERT_TRUE(a.contains("features")) << a.dump();
  const auto ids = a["token_ids"].get<std::vector<std::uint32_t>>();
  const Json& place = a["features"]["mm_placeholders"]["image"][0];
  const auto offset = place["offset"].get<std::uint32_t>();
  EXPECT_EQ(place["length"], kImageTokens);
  ASSERT_LE(offset + kImageTokens, ids.size());
  for (std::uint32_t k = 0; k < kImageTokens; ++k) EXPECT_EQ(ids[offset + k], kImageToken);
  const std::string id = a["features"]["mm_hashes"]["image"][0];
  EXPECT_EQ(id, MockImageIdentifier("data:image/png;base64,AAAA"));
  EXPECT_EQ(id.size(), 64u);
  const Json b = Parse(Answer(face, "POST", "/v1/chat/completions/render", body("data:image/png;base64,BBBB")).body);
  EXPECT_NE(b["features"]["mm_hashes"]["image"][0], id);
  EXPECT_EQ(b["token_ids"], a["token_ids"]);  // the same tokens: only the item tells them apart
  EXPECT_FALSE(Parse(Answer(face, "POST", "/v1/chat/completions/render", kChat.dump()).body).contains("features"));
  EXPECT_EQ(Answer(face, "POST", "/v1/chat/completions/render",
                   R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]})")
                .status,
            400);
}

TEST(OpenAiFaceTest, RenderAndTokenizeUseTheSameTokenizer) {
  OpenAiFace face({.max_model_len = 4096});
  const auto chat_ids = Bytes("<|user|>\nhi\n<|assistant|>\n");
  const FaceResponse chat = Answer(face, "POST", "/v1/chat/completions/render", kChat.dump());
  EXPECT_EQ(chat.status, 200);
  EXPECT_EQ(Parse(chat.body)["token_ids"].get<std::vector<std::uint32_t>>(), chat_ids);

  const FaceResponse completions = Answer(face, "POST", "/v1/completions/render", R"({"model":"mock","prompt":"ab"})");
  EXPECT_EQ(completions.status, 200);
  const Json c = Parse(completions.body);
  ASSERT_TRUE(c.is_array());
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0]["token_ids"].get<std::vector<std::uint32_t>>(), Bytes("ab"));

  const Json t1 = Parse(Answer(face, "POST", "/tokenize", kChat.dump()).body);
  EXPECT_EQ(t1["tokens"].get<std::vector<std::uint32_t>>(), chat_ids);
  EXPECT_EQ(t1["count"], chat_ids.size());
  EXPECT_EQ(t1["max_model_len"], 4096);
  const Json t2 = Parse(Answer(face, "POST", "/tokenize", R"({"model":"mock","prompt":"xyz"})").body);
  EXPECT_EQ(t2["tokens"].get<std::vector<std::uint32_t>>(), Bytes("xyz"));
  EXPECT_EQ(t2["count"], 3);
}

TEST(OpenAiFaceTest, ErrorsOfTheListenerHaveTheSameShape) {
  const auto [type, body] = ListenerErrorBody(413, "the body is over the limit");
  EXPECT_EQ(type, "application/json");
  const Json j = Parse(body);
  EXPECT_EQ(j["error"]["code"], "body_too_large");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["message"], "the body is over the limit");
  EXPECT_EQ(Parse(ListenerErrorBody(431, "big").second)["error"]["code"], "headers_too_large");
  EXPECT_EQ(Parse(ListenerErrorBody(400, "bad").second)["error"]["code"], "invalid_argument");

  const FaceResponse busy = OpenAiError(503, "overloaded", "busy");
  EXPECT_EQ(Parse(busy.body)["error"]["type"], "service_unavailable_error");
  ASSERT_EQ(busy.headers.size(), 1u);
  EXPECT_EQ(busy.headers[0].first, "retry-after");
}

// ---- Answers ----

TEST(OpenAiAnswerTest, WholeChatCompletionCarriesTheTextAndUsage) {
  const OpenAiAnswer a(OpenAiApi::kChat, "chatcmpl-1", 1700000000, "mock", OpenAiAnswer::Delivery::kWhole, false);
  const Json j = Parse(a.Body({.prompt_tokens = 30, .completion_tokens = 28, .cached_tokens = 16}));
  EXPECT_EQ(j["id"], "chatcmpl-1");
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["created"], 1700000000);
  EXPECT_EQ(j["model"], "mock");
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "abcdefghijklmnopqrstuvwxyzab");  // a letter per token
  EXPECT_EQ(j["usage"]["prompt_tokens"], 30);
  EXPECT_EQ(j["usage"]["completion_tokens"], 28);
  EXPECT_EQ(j["usage"]["total_tokens"], 58);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 16);
}

TEST(OpenAiAnswerTest, WholeTextCompletionCarriesTheText) {
  const OpenAiAnswer a(OpenAiApi::kCompletions, "cmpl-1", 1, "mock", OpenAiAnswer::Delivery::kWhole, false);
  const Json j = Parse(a.Body({.prompt_tokens = 2, .completion_tokens = 3}));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "abc");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(j["choices"][0].contains("message"));
}

TEST(OpenAiAnswerTest, ChatChunksCarryTheRoleFirstThenContentAndTheLastTheFinishReason) {
  const OpenAiAnswer a(OpenAiApi::kChat, "chatcmpl-\"q\"", 5, "m", OpenAiAnswer::Delivery::kStream, true);
  const Json first = EventJson(a.TokenEvent(0, false));
  EXPECT_EQ(first["id"], "chatcmpl-\"q\"");  // escaped in the rendered head
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["created"], 5);
  EXPECT_EQ(first["model"], "m");
  EXPECT_EQ(first["choices"][0]["index"], 0);
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "a");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  const Json second = EventJson(a.TokenEvent(1, true));
  EXPECT_FALSE(second["choices"][0]["delta"].contains("role"));
  EXPECT_EQ(second["choices"][0]["delta"]["content"], "b");
  EXPECT_EQ(second["choices"][0]["finish_reason"], "length");

  const Json usage = EventJson(a.UsageEvent({.prompt_tokens = 4, .completion_tokens = 2, .cached_tokens = 0}));
  EXPECT_EQ(usage["object"], "chat.completion.chunk");
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 6);
  EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(OpenAiAnswer::kDoneEvent, "data: [DONE]\n\n");
}

TEST(OpenAiAnswerTest, CompletionChunksCarryTheText) {
  const OpenAiAnswer a(OpenAiApi::kCompletions, "cmpl-1", 5, "m", OpenAiAnswer::Delivery::kStream, false);
  const Json j = EventJson(a.TokenEvent(27, false));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "b");
  EXPECT_TRUE(j["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(EventJson(a.TokenEvent(28, true))["choices"][0]["finish_reason"], "length");
}

TEST(OpenAiAnswerTest, AStreamedErrorIsAnErrorEvent) {
  const Json j = EventJson(OpenAiAnswer::ErrorEvent("unavailable", "worker shutting down"));
  EXPECT_EQ(j["error"]["code"], "unavailable");
  EXPECT_EQ(j["error"]["message"], "worker shutting down");
}

}  // namespace
}  // namespace kvrouter
