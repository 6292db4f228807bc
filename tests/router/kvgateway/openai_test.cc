#include "router/kvgateway/openai.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <random>
#include <string>
#include <vector>

namespace kvrouter {
namespace {

using json = nlohmann::json;

TEST(OpenAiRequest, AChatRequestGivesItsModelStreamAndATokenizeBody) {
  const std::string body = R"({"model":"llama","stream":true,"messages":[{"role":"user","content":"hi"}],"n":1})";
  auto r = ParseOpenAiRequest(ApiKind::kChat, body);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "llama");
  EXPECT_TRUE(r->stream);
  const json t = json::parse(TokenizeBody(*r, body));
  EXPECT_EQ(t["model"], "llama");
  EXPECT_EQ(t["messages"][0]["content"], "hi");
  EXPECT_FALSE(t.contains("n"));  // only what /tokenize takes
}

TEST(OpenAiRequest, ACompletionsPromptMayBeAStringOrAnArray) {
  const std::string body = R"({"model":"m","prompt":"once upon"})";
  auto s = ParseOpenAiRequest(ApiKind::kCompletions, body);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->stream);
  EXPECT_EQ(json::parse(TokenizeBody(*s, body)), json::parse(R"({"model":"m","prompt":"once upon"})"));
  EXPECT_TRUE(ParseOpenAiRequest(ApiKind::kCompletions, R"({"model":"m","prompt":[1,2,3]})").ok());
  EXPECT_EQ(ParseOpenAiRequest(ApiKind::kCompletions, R"({"model":"m","prompt":7})").status().code(),
            StatusCode::kInvalidArgument);
}

TEST(OpenAiRequest, WhatIsMissingOrMalformedIsNamed) {
  auto expect = [](ApiKind kind, std::string_view body, std::string_view says) {
    auto r = ParseOpenAiRequest(kind, body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().message();
  };
  expect(ApiKind::kChat, "{", "JSON");
  expect(ApiKind::kChat, "[1]", "object");
  expect(ApiKind::kChat, R"({"messages":[{"role":"user","content":"x"}]})", "'model'");
  expect(ApiKind::kChat, R"({"model":"","messages":[{"role":"user","content":"x"}]})", "'model'");
  expect(ApiKind::kChat, R"({"model":"m"})", "'messages'");
  expect(ApiKind::kChat, R"({"model":"m","messages":[]})", "'messages'");
  expect(ApiKind::kChat, R"({"model":"m","messages":[{}],"stream":"yes"})", "'stream'");
  expect(ApiKind::kCompletions, R"({"model":"m"})", "'prompt'");
  // What the gateway does not read must be JSON too, and nothing may follow the object.
  expect(ApiKind::kChat, R"({"model":"m","messages":[{}],"n":[1,2,]})", "JSON");
  expect(ApiKind::kChat, R"({"model":"m","messages":[{}],"user":"\x"})", "JSON");
  expect(ApiKind::kChat, R"({"model":"m","messages":[{}],"seed":01})", "JSON");
  expect(ApiKind::kChat, R"({"model":"m","messages":[{}],"logprobs":nul})", "JSON");
  expect(ApiKind::kChat, "{\"model\":\"m\",\"messages\":[{}],\"user\":\"a\x01\"}", "JSON");
  expect(ApiKind::kChat, R"({"model":"m","messages":[{}]} {"model":"m"})", "JSON");
  expect(ApiKind::kChat, R"({"model":"m","messages":[{}]} x)", "JSON");
  expect(ApiKind::kChat, "{\"model\":\"m\",\"messages\":[{\"content\":\"\xff\"}]}", "JSON");
}

// Read as nlohmann-json reads them: the last of repeated fields wins; a whole number too large
// for 64 bits is a number (not a token limit); an escaped key is the key it spells.
TEST(OpenAiRequest, RepeatedFieldsHugeNumbersAndEscapedKeysReadAsJsonDoes) {
  auto r = ParseOpenAiRequest(ApiKind::kChat, R"({"model":"a","model":"b","messages":[{}],"max_tokens":5,)"
                                              R"("max_tokens":18446744073709551616,"seed":1e300,"str\u0065am":true})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "b");
  EXPECT_EQ(r->max_tokens, std::nullopt);
  EXPECT_TRUE(r->stream);
  EXPECT_FALSE(ParseOpenAiRequest(ApiKind::kChat, R"({"model":"m","messages":[{}],"messages":[]})").ok());
  auto usage = ParseOpenAiRequest(
      ApiKind::kChat, R"({"model":"m","messages":[{}],"stream_options":{"include_usage":true,"include_usage":false}})");
  ASSERT_TRUE(usage.ok());
  EXPECT_FALSE(usage->include_usage);
}

// The tokenize body is {"model", "messages"} or {"model", "prompt"}, whatever else the body holds.
TEST(OpenAiRequest, TheTokenizeBodyHoldsOnlyWhatTokenizeTakes) {
  const std::string body =
      R"({"n":2,"messages":[{"role":"user","content":"a\u00e9"}],"model":"m","stream":true,"max_tokens":3})";
  auto r = ParseOpenAiRequest(ApiKind::kChat, body);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(json::parse(TokenizeBody(*r, body)),
            json::parse(R"({"model":"m","messages":[{"role":"user","content":"a\u00e9"}]})"));
}

// `fast` answers each body itself, and as `reference` does.
template <typename Fast, typename Reference>
void ExpectAgreement(Fast fast, Reference reference, const std::vector<std::pair<ApiKind, std::string>>& bodies) {
  for (const auto& [kind, body] : bodies) {
    auto answer = fast(kind, body);
    ASSERT_TRUE(answer.has_value()) << body;
    auto expected = reference(kind, body);
    ASSERT_TRUE(expected.ok()) << body;
    EXPECT_EQ(*answer, *expected) << body;
  }
}

// The fast parser answers plain bodies itself, and whenever it answers, it answers as the
// reference does; what it leaves (multimodal features, repeated fields) the reference decides.
TEST(OpenAiParsers, TheFastParserAgreesWithTheReference) {
  using namespace openai_parsers;
  const std::vector<std::pair<ApiKind, std::string>> requests = {
      {ApiKind::kChat, R"({"model":"m","messages":[{"role":"user","content":"hi \"there\" \u00e9"}]})"},
      {ApiKind::kChat, R"( {"model":"m","stream":null,"stream_options":{"include_usage":true,"x":[{}]},)"
                       R"("max_tokens":-0,"max_completion_tokens":7,"cache_salt":"s","messages":[{},[],"",1.5e3,true,false,null]} )"},
      {ApiKind::kChat, R"({"model":"m","messages":[{}],"max_tokens":9,"max_completion_tokens":1.0,"stream_options":7})"},
      {ApiKind::kChat, R"({"model":"m","messages":[{}],"stream":false,"cache_salt":null,"stream_options":{"include_usage":1}})"},
      {ApiKind::kCompletions, R"({"model":"m","prompt":[1,2,3],"messages":7,"max_tokens":4})"},
      {ApiKind::kCompletions, R"({"model":"m","prompt":"p","stream":true,"stream_options":{"include_usage":false}})"},
  };
  ExpectAgreement(FastOpenAiRequest, ReferenceOpenAiRequest, requests);
  for (const char* bad : {R"({"model":"m","model":"n","messages":[{}]})", R"({"model":7,"messages":[{}]})",
                          R"({"model":"m","messages":[{}],"stream":"yes"})", R"({"model":"m","messages":[]})",
                          "", "[]", "{"}) {
    EXPECT_FALSE(FastOpenAiRequest(ApiKind::kChat, bad).has_value()) << bad;
  }
  const std::vector<std::pair<ApiKind, std::string>> answers = {
      {ApiKind::kChat, R"({"request_id":"r","token_ids":[0,1,4294967295],"features":null,"x":{"y":[1]}})"},
      {ApiKind::kChat, R"({"token_ids":[]})"},
      {ApiKind::kChat, R"( { "request_id" : "chatcmpl-7", "token_ids" : [ 3 , 4 ] , "features" : null } )"},
      {ApiKind::kChat, R"({"request_id":"caf\u00e9","token_ids":[5],"note":"\u00e9t\u00e9"})"},
      {ApiKind::kChat, "{\"request_id\":\"caf\xc3\xa9\",\"token_ids\":[6,7]}"},
      {ApiKind::kChat, R"({"token_ids":[8],"request_id":null})"},
      {ApiKind::kCompletions, R"([{"token_ids":[4,5]},{"token_ids":[6]},7])"},
  };
  ExpectAgreement(FastRenderAnswer, ReferenceRenderAnswer, answers);
  for (const char* bad : {R"({"token_ids":[1],"features":{"mm_hashes":null}})", R"({"token_ids":[1,-1]})",
                          R"({"token_ids":[1],"features":"x"})", R"({"token_ids":[1]}})", R"({"token_ids":[1],})",
                          R"({"token_ids":[1] "x":null})", R"({"token_ids":[1],"x":nul})", R"({"token_ids":[1],"x":"a)",
                          R"({"token_ids":[1.0]})", R"({"token_ids":[1],"token_ids":[2]})", R"({"token_ids":[1]} 2)"}) {
    EXPECT_FALSE(FastRenderAnswer(ApiKind::kChat, bad).has_value()) << bad;
  }
}

// A body larger than a thread keeps a parser for is read the same way.
TEST(OpenAiParsers, ALargeRenderAnswerIsReadWhole) {
  std::string body = R"({"token_ids":[)";
  std::vector<std::uint32_t> ids;
  for (std::uint32_t k = 0; k < 100000; ++k) {
    body += (k ? "," : "") + std::to_string(k * 40503u);
    ids.push_back(k * 40503u);
  }
  body += "]}";
  ASSERT_GT(body.size(), 256u * 1024);
  auto r = ParseRenderAnswer(ApiKind::kChat, body);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->token_ids, ids);
  EXPECT_TRUE(openai_parsers::FastRenderAnswer(ApiKind::kChat, body).has_value());
}

// The ids are read 8 bytes at a time: every width from 1 to 8 digits, at every place a number
// can start in a word, reads as the reference reads it; what that reader leaves (whitespace
// between ids, 9 and 10 digits) the reference decides, and what JSON forbids is refused.
TEST(OpenAiParsers, TokenIdsOfEveryWidthAndPlaceReadAsTheReferenceReadsThem) {
  using namespace openai_parsers;
  std::vector<std::uint32_t> ids;
  for (std::uint32_t power = 1; power <= 10'000'000; power *= 10) {  // 1 to 8 digits
    const std::uint32_t low = power == 1 ? 0 : power, high = power * 10 - 1;
    for (std::uint32_t v : {low, high, (low + high) / 2, low + 1, high - 1}) ids.push_back(v);
  }
  std::mt19937 random(7);
  for (int k = 0; k < 2000; ++k) ids.push_back(random() % (random() % 2 ? 256u : 100'000'000u));
  // Shifted one byte at a time, each number starts at each place of an 8-byte word.
  for (int shift = 0; shift < 8; ++shift) {
    std::string body = R"({"token_ids":[)";
    std::vector<std::uint32_t> expected(ids.begin() + shift, ids.end());
    for (std::size_t k = 0; k < expected.size(); ++k) body += (k ? "," : "") + std::to_string(expected[k]);
    body += "]}";
    auto fast = FastRenderAnswer(ApiKind::kChat, body);
    ASSERT_TRUE(fast.has_value()) << shift;
    EXPECT_EQ(fast->token_ids, expected);
    EXPECT_EQ(*fast, *ReferenceRenderAnswer(ApiKind::kChat, body));
  }
  auto wide = FastRenderAnswer(ApiKind::kChat, R"({"token_ids":[123456789,4294967295,1000000000]} )");
  ASSERT_TRUE(wide.has_value());
  EXPECT_EQ(wide->token_ids, (std::vector<std::uint32_t>{123456789, 4294967295, 1000000000}));
  // Whitespace between the ids (Python's json.dumps writes ", ") is read too, a byte at a time.
  for (const char* spaced : {R"({"token_ids":[1, 2]})", R"({"token_ids":[1 ,2]})",
                             "{\"token_ids\":[ 1,\n\t2 ] ,\"x\":0}", R"({"token_ids":[1, 4294967295]})"}) {
    auto fast = FastRenderAnswer(ApiKind::kChat, spaced);
    ASSERT_TRUE(fast.has_value()) << spaced;
    EXPECT_EQ(*fast, *ReferenceRenderAnswer(ApiKind::kChat, spaced)) << spaced;
    EXPECT_EQ(fast->token_ids.size(), 2u) << spaced;
  }
  for (const char* bad : {R"({"token_ids":[01]})", R"({"token_ids":[1,,2]})", R"({"token_ids":[1,]})",
                          R"({"token_ids":[,1]})", R"({"token_ids":[1e3]})", R"({"token_ids":[1,"2"]})",
                          R"({"token_ids":[1,[2]]})", R"({"token_ids":[4294967296]})", R"({"token_ids":[-0]})",
                          R"({"token_ids":[99999999999]})", R"({"token_ids":[1, 01]})", R"({"token_ids":[1 2]})",
                          R"({"token_ids":[1, ]})", R"({"token_ids":[1, 4294967296]})", R"({"token_ids":[1, -2]})"}) {
    EXPECT_FALSE(ParseRenderAnswer(ApiKind::kChat, bad).ok()) << bad;
  }
}

TEST(RenderAnswer, ChatAndCompletionsShapesAndTokenize) {
  EXPECT_EQ(ParseRenderAnswer(ApiKind::kChat, R"({"token_ids":[1,2,3],"other":0})")->token_ids,
            (std::vector<std::uint32_t>{1, 2, 3}));
  EXPECT_EQ(ParseRenderAnswer(ApiKind::kCompletions, R"([{"token_ids":[4,5]},{"token_ids":[6]}])")->token_ids,
            (std::vector<std::uint32_t>{4, 5}));
  EXPECT_EQ(*ParseTokenizeAnswer(R"({"tokens":[7],"count":1})"), std::vector<std::uint32_t>{7});
  EXPECT_FALSE(ParseRenderAnswer(ApiKind::kChat, R"({"token_ids":[-1]})").ok());
  EXPECT_FALSE(ParseRenderAnswer(ApiKind::kChat, R"({"token_ids":[4294967296]})").ok());
  EXPECT_FALSE(ParseRenderAnswer(ApiKind::kChat, R"({"token_ids":"x"})").ok());
  EXPECT_FALSE(ParseRenderAnswer(ApiKind::kCompletions, R"([])").ok());
  EXPECT_FALSE(ParseRenderAnswer(ApiKind::kCompletions, R"({"token_ids":[1]})").ok());
  EXPECT_NE(ParseRenderAnswer(ApiKind::kChat, R"({"token_ids":[1,2],"x":[})").status().message().find("not JSON"),
            std::string::npos);
  EXPECT_FALSE(ParseTokenizeAnswer(R"({"ids":[1]})").ok());
  EXPECT_FALSE(ParseTokenizeAnswer("nope").ok());
}

// vLLM's render features: per modality, the k-th hash with the k-th placeholder is one item.
TEST(RenderAnswer, MultimodalFeaturesBecomeItems) {
  const std::string image(64, 'e');
  auto r = ParseRenderAnswer(
      ApiKind::kChat,
      R"({"token_ids":[1,9,9,9,2],"features":{"mm_hashes":{"image":[")" + image +
          R"(","img-2"]},"mm_placeholders":{"image":[{"offset":1,"length":3},{"offset":4,"length":1}]}}})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->mm_items, (std::vector<MmItem>{{MmItemHash(image), 1, 3}, {MmItemHash("img-2"), 4, 1}}));
  EXPECT_TRUE(ParseRenderAnswer(ApiKind::kChat, R"({"token_ids":[1],"features":null})")->mm_items.empty());
  EXPECT_TRUE(
      ParseRenderAnswer(ApiKind::kChat, R"({"token_ids":[1],"features":{"mm_hashes":null}})")->mm_items.empty());
  for (
      const char* bad :
      {R"({"token_ids":[1],"features":{"mm_hashes":{"image":["a"]}}})",
       R"({"token_ids":[1],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[]}}})",
       R"({"token_ids":[1],"features":{"mm_hashes":{"image":["a"]},"mm_placeholders":{"image":[{"offset":-1,"length":1}]}}})",
       R"({"token_ids":[1],"features":{"mm_hashes":{"image":[7]},"mm_placeholders":{"image":[{"offset":0,"length":1}]}}})",
       R"({"token_ids":[1],"features":7})"}) {
    EXPECT_EQ(ParseRenderAnswer(ApiKind::kChat, bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

// vLLM's cache_salt keeps salted prefixes apart at the router too: an item of the first block.
TEST(RenderAnswer, ACacheSaltIsAnItemOfTheFirstBlock) {
  auto req = ParseOpenAiRequest(ApiKind::kChat,
                                R"({"model":"m","messages":[{"role":"user","content":"x"}],"cache_salt":"tenant-7"})");
  ASSERT_TRUE(req.ok()) << req.status().ToString();
  EXPECT_EQ(req->cache_salt, "tenant-7");
  const RenderedPrompt rendered{.token_ids = {1, 2, 3, 4}, .mm_items = {{.hash = 9, .offset = 2, .length = 1}}};
  EXPECT_EQ(RouteItems(*req, rendered),
            (std::vector<MmItem>{{.hash = 9, .offset = 2, .length = 1},
                                 {.hash = MmItemHash("tenant-7"), .offset = 0, .length = 1}}));
  auto plain = ParseOpenAiRequest(ApiKind::kChat, R"({"model":"m","messages":[{"role":"user","content":"x"}]})");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(RouteItems(*plain, rendered), rendered.mm_items);
  EXPECT_EQ(ParseOpenAiRequest(ApiKind::kChat, R"({"model":"m","messages":[{}],"cache_salt":7})").status().code(),
            StatusCode::kInvalidArgument);
}

TEST(OpenAiError, IsTheShapeOpenAiClientsRead) {
  const json e = json::parse(OpenAiError("bad \"thing\"", "invalid_request_error", "bad"));
  EXPECT_EQ(e["error"]["message"], "bad \"thing\"");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["code"], "bad");
}

TEST(OpenAiError, BytesThatAreNotUtf8BecomeReplacementCharactersInsteadOfThrowing) {
  // A model name or an engine's answer cut in the middle of a character.
  const std::string cut = std::string("caf\xC3", 4) + "\xFF!";
  std::string text;
  ASSERT_NO_THROW(text = OpenAiError("no model '" + cut + "'", "invalid_request_error", "model_not_found"));
  const json e = json::parse(text, nullptr, false);
  ASSERT_FALSE(e.is_discarded()) << text;
  EXPECT_EQ(e["error"]["message"], "no model 'caf\uFFFD\uFFFD!'");
  EXPECT_EQ(DumpJson(json{{"id", std::string("\x80")}}), "{\"id\":\"\xEF\xBF\xBD\"}");
}

// Section 13's legs.

TEST(DisaggLegs, TheNixlPrefillBodyChangesExactlyTheListedFieldsAndKeepsTheRestInOrder) {
  const std::string client =
      R"({"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true},)"
      R"("max_tokens":40,"max_completion_tokens":40,"min_tokens":2,"min_completion_tokens":1,"temperature":0.7,"seed":9})";
  auto body = NixlPrefillBody(client);
  ASSERT_TRUE(body.ok()) << body.status().ToString();
  EXPECT_EQ(*body,
            R"({"model":"m","messages":[{"role":"user","content":"x"}],"stream":false,"max_tokens":1,)"
            R"("max_completion_tokens":1,"temperature":0.7,"seed":9,"kv_transfer_params":{"do_remote_decode":true,)"
            R"("do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,)"
            R"("remote_port":null}})");
  // max_completion_tokens only when the client sent it; max_tokens always.
  auto bare = NixlPrefillBody(R"({"model":"m","prompt":"p"})");
  ASSERT_TRUE(bare.ok());
  const json b = json::parse(*bare);
  EXPECT_EQ(b["max_tokens"], 1);
  EXPECT_FALSE(b.contains("max_completion_tokens"));
  EXPECT_EQ(b["stream"], false);
  EXPECT_EQ(NixlPrefillBody("[1]").status().code(), StatusCode::kInvalidArgument);
}

TEST(DisaggLegs, FieldsAreAppendedToTheClientsBytesOrReplacedWhenItHasThem) {
  const std::string client = "{\"model\":\"m\",  \"prompt\":\"p\" }\n";
  auto appended = WithFields(client, {{"bootstrap_host", "\"h\""}, {"bootstrap_room", "12"}});
  ASSERT_TRUE(appended.ok());
  EXPECT_EQ(*appended, "{\"model\":\"m\",  \"prompt\":\"p\" ,\"bootstrap_host\":\"h\",\"bootstrap_room\":12}");
  auto replaced = WithFields(R"({"kv_transfer_params":{"a":1},"model":"m"})", {{"kv_transfer_params", R"({"b":2})"}});
  ASSERT_TRUE(replaced.ok());
  EXPECT_EQ(*replaced, R"({"kv_transfer_params":{"b":2},"model":"m"})");
  EXPECT_EQ(WithFields(R"({"model":"m"})", {{"x", "{"}}).status().code(), StatusCode::kInvalidArgument);
}

// A choice ended at "length" is told apart (an engine without the NixlConnector answers so), and
// a request's token limit is read (max_completion_tokens over max_tokens).
TEST(DisaggLegs, APrefillAnswerSaysWhetherItStoppedAtItsLimit) {
  auto length = ParsePrefillAnswer(R"({"choices": [{"index": 0, "finish_reason": "length"}]})");
  ASSERT_TRUE(length.ok());
  EXPECT_TRUE(length->stopped_at_length);
  auto stop = ParsePrefillAnswer(R"({"choices": [{"index": 0, "finish_reason": "stop"}]})");
  ASSERT_TRUE(stop.ok());
  EXPECT_FALSE(stop->stopped_at_length);
  auto r = ParseOpenAiRequest(ApiKind::kChat, R"({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                                                  "max_completion_tokens": 7})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->max_tokens, 7u);
  auto none = ParseOpenAiRequest(ApiKind::kCompletions, R"({"model": "m", "prompt": "p"})");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->max_tokens.has_value());
}

TEST(DisaggLegs, APrefillAnswerGivesItsTransferParamsVerbatimAndItsCachedTokens) {
  auto a = ParsePrefillAnswer(
      R"({"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":12}},)"
      R"("kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[3,1],"ratio":0.25}})");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->kv_transfer_params, R"({"remote_engine_id":"e","remote_block_ids":[3,1],"ratio":0.25})");
  EXPECT_EQ(a->cached_tokens, 12u);
  // Absent or null: none (the engine stopped at its token).
  EXPECT_EQ(ParsePrefillAnswer(R"({"choices":[]})")->kv_transfer_params, "");
  EXPECT_EQ(ParsePrefillAnswer(R"({"kv_transfer_params":null})")->kv_transfer_params, "");
  EXPECT_FALSE(ParsePrefillAnswer(R"({"kv_transfer_params":null})")->cached_tokens);
  EXPECT_EQ(ParsePrefillAnswer(R"({"kv_transfer_params":"x"})").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParsePrefillAnswer("not json").status().code(), StatusCode::kInvalidArgument);
}

TEST(DisaggLegs, CachedTokensAreSetInAPlainAnswersUsageOnly) {
  EXPECT_EQ(WithCachedTokens(R"({"id":"x","usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":9}}})", 4),
            R"({"id":"x","usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}})");
  EXPECT_EQ(WithCachedTokens(R"({"usage":{"prompt_tokens":9,"prompt_tokens_details":null}})", 4),
            R"({"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}})");
  EXPECT_FALSE(WithCachedTokens(R"({"id":"x"})", 4));
  EXPECT_FALSE(WithCachedTokens("data: {}", 4));
}

TEST(DisaggLegs, APlainAnswerBecomesOneChunkInTheStreamedClientsForm) {
  const std::string chat =
      R"({"id":"c1","object":"chat.completion","created":5,"model":"m","choices":[{"index":0,)"
      R"("message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3}})";
  auto events = AsEventStream(ApiKind::kChat, chat, /*include_usage=*/true);
  ASSERT_TRUE(events.ok());
  EXPECT_EQ(*events,
            "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":5,\"model\":\"m\",\"choices\":"
            "[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hi\"},\"finish_reason\":\"stop\"}]}\n\n"
            "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":5,\"model\":\"m\",\"choices\":[],"
            "\"usage\":{\"prompt_tokens\":3}}\n\n"
            "data: [DONE]\n\n");
  const std::string text = R"({"id":"t1","object":"text_completion","choices":[{"index":0,"text":"Hi","finish_reason":"length"}]})";
  auto completion = AsEventStream(ApiKind::kCompletions, text, false);
  ASSERT_TRUE(completion.ok());
  EXPECT_EQ(*completion,
            "data: {\"id\":\"t1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"Hi\","
            "\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n");
  EXPECT_EQ(AsEventStream(ApiKind::kChat, "[]", false).status().code(), StatusCode::kInvalidArgument);
}

TEST(OpenAiRequest, StreamOptionsIncludeUsageIsRead) {
  EXPECT_TRUE(ParseOpenAiRequest(ApiKind::kCompletions,
                                 R"({"model":"m","prompt":"p","stream":true,"stream_options":{"include_usage":true}})")
                  ->include_usage);
  EXPECT_FALSE(ParseOpenAiRequest(ApiKind::kCompletions, R"({"model":"m","prompt":"p","stream":true})")->include_usage);
}

TEST(OpenAiRequest, ADeeplyNestedBodyIsReadWithoutExhaustingTheStack) {
  // 200,000 levels in a field the gateway does not read: left to the reference parser.
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  auto r = ParseOpenAiRequest(ApiKind::kChat, R"({"model":"m","messages":[{}],"x":)" + deep + "}");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "m");
}

TEST(OpenAiRequest, ARawNulByteIsNotJson) {
  const std::string body = std::string(R"({"model":"m","messages":[{}]})") + '\0' + "garbage";
  auto r = ParseOpenAiRequest(ApiKind::kChat, body);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not valid JSON"), std::string::npos);
}

}  // namespace
}  // namespace kvrouter
