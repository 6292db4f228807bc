// Writes a small seed corpus for the fuzz targets: `fuzz_seedgen DIR` creates DIR/<target>/
// with a few valid messages per decoder, made with the encoders plus hand-packed forms the
// encoders never write (vLLM map form, bin hashes, agent hints). Single-threaded, run once.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <msgpack.hpp>

#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "events/replica_sync_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "events/vllm_codec.h"
#include "events/worker_codec.h"

namespace kvrouter {
namespace {

namespace fs = std::filesystem;
using Packer = msgpack::packer<msgpack::sbuffer>;

class SeedWriter {
 public:
  explicit SeedWriter(fs::path root) : root_(std::move(root)) {}

  bool Write(std::string_view target, const msgpack::sbuffer& body) {
    return Write(target, std::string_view(body.data(), body.size()));
  }
  bool Write(std::string_view target, std::string_view body) {
    const fs::path dir = root_ / target;
    std::error_code ec;
    fs::create_directories(dir, ec);
    std::ofstream out(dir / ("seed_" + std::to_string(count_++)), std::ios::binary);
    out.write(body.data(), static_cast<std::streamsize>(body.size()));
    return static_cast<bool>(out);
  }

 private:
  fs::path root_;
  int count_ = 0;
};

KvEventBatch DynamoBatch(StorageTier tier, KvEventData data) {
  KvEventBatch b{.worker_id = 5, .dp_rank = 1, .sequence = {SequenceKind::kEventId, 9}, .ops = {}};
  b.ops.push_back({tier, std::move(data)});
  return b;
}

// A vLLM batch in map form with one map-form BlockStored event whose hash is a 32-byte bin.
msgpack::sbuffer VllmMapFormBatch() {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(3);
  PackKey(pk, "ts");
  pk.pack_double(1.0);
  PackKey(pk, "events");
  pk.pack_array(1);
  pk.pack_map(6);
  PackKey(pk, "type");
  pk.pack("BlockStored");
  PackKey(pk, "block_hashes");
  pk.pack_array(1);
  const std::string hash(32, '\x11');
  pk.pack_bin(static_cast<std::uint32_t>(hash.size()));
  pk.pack_bin_body(hash.data(), static_cast<std::uint32_t>(hash.size()));
  PackKey(pk, "parent_block_hash");
  pk.pack_int64(-7);
  PackKey(pk, "token_ids");
  pk.pack(std::vector<std::uint32_t>{1, 2, 3, 4});
  PackKey(pk, "block_size");
  pk.pack(4);
  PackKey(pk, "medium");
  pk.pack("CPU");
  PackKey(pk, "data_parallel_rank");
  pk.pack_nil();
  return buf;
}

// A route request carrying its priority and osl in nvext.agent_hints.
msgpack::sbuffer RouteRequestWithAgentHints() {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(2);
  PackKey(pk, "token_ids");
  pk.pack(std::vector<std::uint32_t>{1, 2, 3, 4, 5});
  PackKey(pk, "nvext");
  pk.pack_map(1);
  PackKey(pk, "agent_hints");
  pk.pack_map(2);
  PackKey(pk, "priority");
  pk.pack(-2);
  PackKey(pk, "osl");
  pk.pack(64);
  return buf;
}

bool WriteAll(SeedWriter& w) {
  bool ok = true;
  const KvEventBatch stored = DynamoBatch(StorageTier::kDevice, KvStored{3, {{10, 20}, {11, 21}}});
  ok &= w.Write("fuzz_dynamo_event", EncodeDynamoEnvelope(stored, {.publisher_id = 5}));
  ok &= w.Write("fuzz_dynamo_event", EncodeRouterEvent(stored));
  ok &= w.Write("fuzz_dynamo_event", EncodeRouterEvent(DynamoBatch(StorageTier::kDisk, KvRemoved{{10, 11}})));
  ok &= w.Write("fuzz_dynamo_event", EncodeRouterEvent(DynamoBatch(StorageTier::kDevice, KvCleared{})));

  VllmStoredEvent vllm_stored{.block_hashes = {1, 2},
                              .parent_block_hash = 9,
                              .token_ids = {1, 2, 3, 4, 5, 6, 7, 8},
                              .block_size = 4,
                              .lora_name = "my-adapter",
                              .medium = std::nullopt};
  ok &= w.Write("fuzz_vllm_batch",
                EncodeVllmBatch(1.5, {vllm_stored, VllmRemovedEvent{{1}, "GPU"}, VllmClearedEvent{}}, 0));
  ok &= w.Write("fuzz_vllm_batch", EncodeVllmBatch(2.0, {VllmClearedEvent{}}, std::nullopt));
  ok &= w.Write("fuzz_vllm_batch", VllmMapFormBatch());

  ok &= w.Write("fuzz_registration", EncodeWorkerRegistration({.worker_id = 1,
                                                               .dp_start = 0,
                                                               .dp_size = 2,
                                                               .block_size = 64,
                                                               .total_kv_blocks = 1000,
                                                               .max_num_seqs = 256,
                                                               .max_num_batched_tokens = 8192,
                                                               .device = "gpu",
                                                               .lease_ms = 3000,
                                                               .leaving = false}));
  ok &= w.Write("fuzz_registration", EncodeWorkerRegistration({.worker_id = 2,
                                                               .dp_start = 0,
                                                               .dp_size = 1,
                                                               .block_size = std::nullopt,
                                                               .total_kv_blocks = 0,
                                                               .max_num_seqs = 1,
                                                               .max_num_batched_tokens = 1,
                                                               .device = "cpu",
                                                               .lease_ms = 1,
                                                               .leaving = true}));

  RouteRequest tokens;
  tokens.request_id = "r1";
  tokens.token_ids = {1, 2, 3, 4, 5, 6, 7, 8};
  tokens.has_token_ids = true;
  tokens.isl = 8;
  tokens.lora_name = "my-adapter";
  tokens.priority = 3;
  tokens.worker_id = 5;
  tokens.dp_rank = 0;
  tokens.allowed_worker_ids = std::vector<std::uint64_t>{5, 6};
  tokens.config_override.overlap_score_credit = 1.0;
  tokens.config_override.router_temperature = 0.5;
  tokens.timeout_ms = 1000;
  ok &= w.Write("fuzz_route_request", EncodeRouteRequest(tokens));
  RouteRequest hashes;
  hashes.block_hashes = {0xffffffffffffffffull, 1};
  hashes.isl = 130;
  hashes.update_states = false;
  ok &= w.Write("fuzz_route_request", EncodeRouteRequest(hashes));
  ok &= w.Write("fuzz_route_request", RouteRequestWithAgentHints());
  ok &= w.Write("fuzz_route_request", EncodeRouteReply({.worker_id = 5,
                                                        .dp_rank = 0,
                                                        .overlap_blocks = 2,
                                                        .request_blocks = 3,
                                                        .cached_tokens = 128,
                                                        .queued_ms = 0.5}));
  ok &= w.Write("fuzz_route_request", EncodeErrorReply(Status(StatusCode::kTimeout, "late")));
  ok &= w.Write("fuzz_route_request", EncodeLifecycleRequest("r1"));

  ok &= w.Write("fuzz_worker_codec", RecoveryQuery{.start_event_id = 3, .end_event_id = 9}.Encode());
  ok &= w.Write("fuzz_worker_codec", RecoveryQuery{}.Encode());
  const KvEventBatch chain = DynamoBatch(StorageTier::kDevice, KvStored{std::nullopt, {{10, 20}, {11, 21}}});
  const KvEventBatch child = DynamoBatch(StorageTier::kDevice, KvStored{11, {{12, 22}}});
  ok &= w.Write("fuzz_worker_codec",
                EncodeRecoveryReply({.kind = "tree_dump", .events = {chain, child}, .last_event_id = 9}));
  ok &= w.Write("fuzz_worker_codec", EncodeRecoveryReply({.kind = "events",
                                                          .events = {DynamoBatch(StorageTier::kDevice, KvRemoved{{10}}),
                                                                     DynamoBatch(StorageTier::kDevice, KvCleared{})},
                                                          .last_event_id = 9}));
  ok &= w.Write("fuzz_worker_codec", EncodeRecoveryReply({.kind = "too_new", .last_event_id = 2, .message = "later"}));
  const GenerateRequest generate{.request_id = "g1", .token_ids = {1, 2, 3}, .max_tokens = 4, .dp_rank = 1};
  ok &= w.Write("fuzz_worker_codec", generate.Encode());
  ok &= w.Write("fuzz_worker_codec", GenerateResponse{.request_id = "g1", .token_ids = {5}}.Encode());
  const GenerateResponse final_response{.request_id = "g1",
                                        .token_ids = {6, 7},
                                        .index = 1,
                                        .finish_reason = "length",
                                        .cached_tokens = 64,
                                        .prompt_tokens = 70,
                                        .ttft_ms = 3.5};
  ok &= w.Write("fuzz_worker_codec", final_response.Encode());
  ok &= w.Write(
      "fuzz_worker_codec",
      EncodeKvMetrics({.worker_id = 5, .dp_rank = 1, .active_decode_blocks = 300, .active_prefill_tokens = 4096}));
  // The gateway: whole HTTP requests as clients send them, and engines' render answers.
  ok &= w.Write("fuzz_gateway_request",
                std::string_view("POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                                 "x-request-id: r1\r\nContent-Length: 71\r\n\r\n"
                                 "{\"model\":\"m\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}"));
  ok &= w.Write("fuzz_gateway_request",
                std::string_view("POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 "1b\r\n{\"model\":\"m\",\"prompt\":\"ab\"}\r\n0\r\n\r\n"));
  ok &= w.Write("fuzz_gateway_request", std::string_view("{\"token_ids\":[1,2,3]}"));
  ok &= w.Write("fuzz_gateway_request", std::string_view("[{\"token_ids\":[4]}]"));
  // Bodies whose every field the fast parsers read, to grow differences from.
  ok &= w.Write("fuzz_gateway_request",
                std::string_view("{\"model\":\"m\",\"stream\":false,\"stream_options\":{\"include_usage\":true},"
                                 "\"max_tokens\":3,\"max_completion_tokens\":-0,\"cache_salt\":\"s\",\"n\":[1.5,null,\"\\u00e9\"],"
                                 "\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"prompt\":[1,2]}"));
  ok &= w.Write("fuzz_gateway_request",
                std::string_view("{\"token_ids\":[0,4294967295],\"features\":null,\"request_id\":\"r\"}"));
  return ok;
}

}  // namespace
}  // namespace kvrouter

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_DIR\n", argv[0]);
    return 2;
  }
  kvrouter::SeedWriter writer{std::filesystem::path(argv[1])};
  if (!kvrouter::WriteAll(writer)) {
    std::fprintf(stderr, "fuzz_seedgen: could not write every seed under %s\n", argv[1]);
    return 1;
  }
  return 0;
}
