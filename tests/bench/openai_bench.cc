// The JSON kvgateway reads on every request (router/kvgateway/openai.h): a client's chat body
// (a user message of 100 and 2,000 characters) and an engine's render answer (500 and 16,384
// token ids), each through ParseOpenAiRequest / ParseRenderAnswer (simdjson On-Demand) and
// through the nlohmann-json reference it falls back to, and the /tokenize fallback's body.
// Run: build/bin/openai_bench.
#include <benchmark/benchmark.h>

#include <string>

#include "router/kvgateway/openai.h"

namespace kvrouter {
namespace {

std::string ChatBody(std::size_t characters) {
  std::string content;
  for (int k = 0; content.size() < characters; ++k) content += " word" + std::to_string(k);
  content.resize(characters);
  return R"({"model":"mock","max_tokens":1,"stream":false,"messages":[{"role":"system","content":"be brief"},)"
         R"({"role":"user","content":")" + content + R"("}]})";
}

// Ids below `vocabulary`: a real tokenizer's (151,936, Qwen's) or kvmocker's, one per byte (256).
std::string RenderAnswer(std::size_t tokens, std::uint64_t vocabulary = 151936) {
  std::string body = R"({"request_id":"chatcmpl-render","token_ids":[)";
  for (std::size_t k = 0; k < tokens; ++k) body += (k ? "," : "") + std::to_string((k * 2654435761u) % vocabulary);
  return body + R"(],"features":null})";
}

void BM_ParseOpenAiRequest(benchmark::State& state) {
  const std::string body = ChatBody(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(ParseOpenAiRequest(ApiKind::kChat, body));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * body.size()));
}
BENCHMARK(BM_ParseOpenAiRequest)->Arg(100)->Arg(2000);

void BM_ReferenceOpenAiRequest(benchmark::State& state) {
  const std::string body = ChatBody(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(openai_parsers::ReferenceOpenAiRequest(ApiKind::kChat, body));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * body.size()));
}
BENCHMARK(BM_ReferenceOpenAiRequest)->Arg(100)->Arg(2000);

// What building the /tokenize fallback's body costs (TokenizeBody: only on that fallback).
void BM_TokenizeBody(benchmark::State& state) {
  const std::string body = ChatBody(static_cast<std::size_t>(state.range(0)));
  const OpenAiRequest request = *ParseOpenAiRequest(ApiKind::kChat, body);
  for (auto _ : state) benchmark::DoNotOptimize(TokenizeBody(request, body));
}
BENCHMARK(BM_TokenizeBody)->Arg(100)->Arg(2000);

void BM_ParseRenderAnswer(benchmark::State& state) {
  const std::string body = RenderAnswer(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(ParseRenderAnswer(ApiKind::kChat, body));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_ParseRenderAnswer)->Arg(500)->Arg(16384);

// kvmocker's render answer for a chat of 1,000 characters.
void BM_ParseRenderAnswerOfBytes(benchmark::State& state) {
  const std::string body = RenderAnswer(static_cast<std::size_t>(state.range(0)), 256);
  for (auto _ : state) benchmark::DoNotOptimize(ParseRenderAnswer(ApiKind::kChat, body));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_ParseRenderAnswerOfBytes)->Arg(1000);

void BM_ReferenceRenderAnswer(benchmark::State& state) {
  const std::string body = RenderAnswer(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(openai_parsers::ReferenceRenderAnswer(ApiKind::kChat, body));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_ReferenceRenderAnswer)->Arg(500)->Arg(16384);

}  // namespace
}  // namespace kvrouter

BENCHMARK_MAIN();
