// Recovery time of a worker holding 1,000,000 blocks (the faults issue: under 2 s; Dynamo's users
// report 50 s for 2.28 M dump events). In one process: the kvrouter service on an in-memory bus
// with NATS's 1 MiB max payload, and a worker whose KvEventPublisher holds the blocks and serves
// docs/protocol.md section 6 in parts. Timed: from the worker's registration (the router's first
// sight: it asks for a tree dump) until every block is in the router's index.
// Run: build/bin/recovery_bench (see docs/performance.md).
#include <benchmark/benchmark.h>

#include <chrono>

#include "events/event_codec.h"
#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"
#include "router/service/kv_router_service.h"
#include "transport/memory_bus.h"

namespace kvrouter {
namespace {

constexpr std::uint32_t kBs = 16;

// Arg 0: blocks held; arg 1: blocks per sequence (chains of that length under a shared root).
void BM_DumpRecovery(benchmark::State& state) {
  const auto blocks = static_cast<std::uint64_t>(state.range(0));
  const auto per_sequence = static_cast<std::uint64_t>(state.range(1));
  KvEventPublisher pub({.worker_id = 1});
  BlockHash next = 1;
  for (std::uint64_t held = 0; held < blocks; held += per_sequence) {
    KvStored chain;
    for (std::uint64_t i = 0; i < per_sequence; ++i)
      chain.blocks.push_back({next + i, (next + i) * 0x9E3779B97F4A7C15ULL});
    next += per_sequence;
    (void)pub.Publish(std::move(chain));
  }
  double seconds = 0, parts = 0;
  for (auto _ : state) {
    InMemoryBus bus;  // 1 MiB messages, like a default nats-server
    const char* argv[] = {"kvrouter", "--router-mode", "kv", "--block-size", "16"};
    auto cfg = ParseRouterConfig(5, argv, [](const char*) { return nullptr; });
    KvRouterService svc(cfg->config, bus);
    if (!svc.Start().ok()) {
      state.SkipWithError("service did not start");
      return;
    }
    auto endpoint = bus.Subscribe(RecoverySubject("dynamo", "backend", 1, 0), "", [&](const BusMessage& m) {
      auto reply = EncodeRecoveryReplyParts(pub.Answer(RecoveryQuery::Decode(m.data)), bus.MaxPayload());
      if (!reply.ok()) return;
      parts = static_cast<double>(reply->size());
      for (const auto& part : *reply) (void)bus.Publish(m.reply, AsBytes(part));
    });
    const auto t0 = std::chrono::steady_clock::now();
    WorkerRegistration reg{.worker_id = 1, .block_size = kBs, .lease_ms = 600000};
    (void)bus.Publish(svc.subjects().instances, AsBytes(EncodeWorkerRegistration(reg)));
    svc.index().Flush();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (svc.index().TreeSize({1, 0}) != blocks) {
      state.SkipWithError("the index does not hold every block");
      return;
    }
    state.SetIterationTime(seconds);
  }
  state.counters["seconds"] = seconds;
  state.counters["blocks_per_s"] = static_cast<double>(blocks) / seconds;
  state.counters["parts"] = parts;
}
BENCHMARK(BM_DumpRecovery)
    ->Args({1000000, 1000})
    ->Args({1000000, 1000000})
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvrouter

BENCHMARK_MAIN();
