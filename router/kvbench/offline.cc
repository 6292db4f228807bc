#include "router/kvbench/offline.h"

#include <fmt/format.h>

#include <limits>
#include <list>
#include <map>
#include <queue>
#include <unordered_map>

#include "events/block_hash.h"
#include "events/event_codec.h"
#include "events/message_codec.h"
#include "events/msgpack_reader.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"
#include "router/kv_router_service.h"
#include "transport/memory_bus.h"

namespace kvrouter::bench {

Result<Summary> RunOffline(const std::vector<TraceRequest>& trace, const OfflineOptions& o) {
  std::vector<std::string> args = {"kvbench", "--block-size", std::to_string(o.engine.block_size)};
  args.insert(args.end(), o.router_flags.begin(), o.router_flags.end());
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  auto cfg = ParseRouterConfig(static_cast<int>(argv.size()), argv.data(), [](const char*) { return nullptr; });
  if (!cfg.ok()) return cfg.status();

  double now_ms = 0;
  InMemoryBus bus;
  KvRouterService svc(
      cfg->config, bus,
      [&] { return SteadyTime{} + std::chrono::duration_cast<SteadyTime::duration>(std::chrono::duration<double, std::milli>(now_ms)); },
      o.seed);
  if (Status s = svc.Start(); !s.ok()) return s;
  const Subjects& subj = svc.subjects();

  // Engines, registered as workers 1..N, publishing their events through the bus. A publisher
  // per worker numbers them and serves the recovery endpoint (PROTOCOL.md section 6), as kvmocker
  // does over NATS.
  std::vector<std::unique_ptr<KvEventPublisher>> publishers;
  std::vector<std::unique_ptr<MockEngine>> engines;
  std::vector<std::unique_ptr<BusSubscription>> recovery;  // before publishers in destruction
  std::vector<std::uint64_t> worker_ids;
  const MockEngineConfig& ec = o.engine;
  for (std::uint32_t w = 0; w < o.workers; ++w) {
    const std::uint64_t worker_id = w + 1;
    worker_ids.push_back(worker_id);
    KvEventPublisher& pub =
        *publishers.emplace_back(std::make_unique<KvEventPublisher>(PublisherConfig{.worker_id = worker_id}));
    engines.push_back(std::make_unique<MockEngine>(ec, [&bus, &subj, &pub](KvEventData&& d) {
      (void)bus.Publish(subj.kv_events, AsBytes(EncodeDynamoEnvelope(pub.Publish(std::move(d)), {})));
    }));
    auto sub = bus.Subscribe(RecoverySubject(cfg->config.ns, cfg->config.component, worker_id, 0), "",
                             [&bus, &pub](const BusMessage& m) {
                               if (m.reply.empty()) return;
                               const RecoveryReply r = pub.Answer(RecoveryQuery::Decode(m.data));
                               (void)bus.Publish(m.reply, AsBytes(EncodeRecoveryReply(r)));
                             });
    if (!sub.ok()) return sub.status();
    recovery.push_back(std::move(sub).value());
    WorkerRegistration reg{.worker_id = worker_id,
                           .block_size = ec.block_size,
                           .total_kv_blocks = ec.num_gpu_blocks,
                           .max_num_seqs = ec.max_num_seqs,
                           .max_num_batched_tokens = ec.max_num_batched_tokens,
                           .lease_ms = std::numeric_limits<std::uint32_t>::max()};
    (void)bus.Publish(subj.instances, AsBytes(EncodeWorkerRegistration(reg)));
  }

  std::vector<RequestRecord> records(trace.size());
  std::unordered_map<std::string, std::size_t> index_of;
  const double t0 = trace.empty() ? 0 : trace.front().timestamp_ms;

  // Step ends, earliest first: (time, engine).
  using StepEnd = std::pair<double, std::size_t>;
  std::priority_queue<StepEnd, std::vector<StepEnd>, std::greater<StepEnd>> steps;
  std::vector<bool> stepping(engines.size(), false);
  std::vector<std::vector<EngineOutput>> outputs(engines.size());
  auto start_step = [&](std::size_t e) {
    if (stepping[e] || engines[e]->Idle()) return;
    outputs[e].clear();
    const double d = engines[e]->Step(now_ms, outputs[e]);
    if (d <= 0) return;  // nothing could run (a prompt larger than the whole cache waits forever)
    stepping[e] = true;
    steps.push({now_ms + d, e});
  };
  auto dispatch = [&](std::size_t i, const RouteReply& reply) {
    const std::size_t e = static_cast<std::size_t>(reply.worker_id - 1);
    records[i].worker_id = reply.worker_id;
    engines[e]->Add({fmt::format("r{}", i), TokensFor(trace[i]), std::max<std::uint32_t>(1, trace[i].output_length), ""});
    start_step(e);
  };
  std::map<std::size_t, InMemoryBus::PendingRequest> waiting;  // queued in the router
  auto collect_replies = [&] {
    for (auto it = waiting.begin(); it != waiting.end();) {
      if (!it->second.reply->has_value()) {
        ++it;
        continue;
      }
      auto r = DecodeRouteReply(**it->second.reply);
      if (r.ok()) dispatch(it->first, *r);
      else records[it->first].error = true;
      it = waiting.erase(it);
    }
  };

  std::size_t next = 0;
  std::size_t done = 0;
  const std::size_t report_every = std::max<std::size_t>(1, trace.size() / 10);
  while (true) {
    const double t_arrival = next < trace.size() ? trace[next].timestamp_ms - t0 : std::numeric_limits<double>::infinity();
    const double t_step = steps.empty() ? std::numeric_limits<double>::infinity() : steps.top().first;
    if (t_arrival == std::numeric_limits<double>::infinity() && t_step == std::numeric_limits<double>::infinity()) break;
    if (t_arrival <= t_step) {
      now_ms = t_arrival;
      const std::size_t i = next++;
      records[i].arrival_ms = now_ms;
      records[i].prompt_tokens = trace[i].input_length;
      svc.index().Flush();  // every event published so far is in the index
      RouteRequest req{.request_id = fmt::format("r{}", i), .token_ids = TokensFor(trace[i]), .has_token_ids = true};
      req.isl = static_cast<std::uint32_t>(req.token_ids.size());
      index_of[req.request_id] = i;
      waiting.emplace(i, bus.RequestAsync(subj.route, AsBytes(EncodeRouteRequest(req))));
      collect_replies();
      continue;
    }
    const auto [t, e] = steps.top();
    steps.pop();
    now_ms = t;
    stepping[e] = false;
    for (const EngineOutput& out : outputs[e]) {
      const std::size_t i = index_of[out.id];
      if (out.kind == EngineOutput::kFirstToken) {
        records[i].first_token_ms = out.at_ms;
        records[i].cached_tokens = out.cached_tokens;
        (void)bus.Request(subj.mark_prefill, AsBytes(EncodeLifecycleRequest(out.id)));
      } else {
        if (out.kind == EngineOutput::kRejected) records[i].error = true;  // larger than the whole cache
        else records[i].finished_ms = out.at_ms;
        (void)bus.Request(subj.free, AsBytes(EncodeLifecycleRequest(out.id)));
        if (o.progress && ++done % report_every == 0) {
          fmt::print(stderr, "kvbench {}: {}/{} requests done\n", o.label, done, trace.size());
        }
      }
    }
    collect_replies();
    start_step(e);
  }
  for (auto& [i, p] : waiting) records[i].error = true;  // still queued when everything stopped
  return Summarize(o.label, records, worker_ids);
}

double PooledLruHitRate(const std::vector<TraceRequest>& trace, std::uint64_t total_blocks, std::uint32_t block_size) {
  std::list<SequenceHash> lru;  // front = least recently used
  std::unordered_map<SequenceHash, std::list<SequenceHash>::iterator> where;
  double prompt = 0, cached = 0;
  for (const TraceRequest& r : trace) {
    const auto seq = ComputeSequenceHashes(ComputeLocalHashes(TokensFor(r), block_size));
    std::size_t hits = 0;
    while (hits < seq.size() && where.count(seq[hits])) ++hits;
    prompt += r.input_length;
    cached += static_cast<double>(hits) * block_size;
    for (SequenceHash h : seq) {
      auto it = where.find(h);
      if (it != where.end()) {
        lru.splice(lru.end(), lru, it->second);
        continue;
      }
      lru.push_back(h);
      where[h] = std::prev(lru.end());
      if (lru.size() > total_blocks) {
        where.erase(lru.front());
        lru.pop_front();
      }
    }
  }
  return prompt > 0 ? cached / prompt : 0;
}

}  // namespace kvrouter::bench
