#include "tests/integration/kvrouter_fixture.h"

#include <utility>

#include "events/event_codec.h"
#include "events/kv_event.h"
#include "events/msgpack_reader.h"
#include "events/registration_codec.h"
#include "events/vllm_codec.h"

namespace kvrouter::testing {

std::vector<std::uint32_t> Tokens(std::uint32_t first, std::size_t n) {
  std::vector<std::uint32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = first + static_cast<std::uint32_t>(i);
  return t;
}

Result<ProgramOnNats> StartOnNats(const std::string& program, const std::string& nats_url,
                                  std::vector<std::string> args, const std::string& log, Metrics metrics) {
  ProgramOnNats started;
  std::vector<std::string> argv = {program, "--nats-server", nats_url};
  argv.insert(argv.end(), std::make_move_iterator(args.begin()), std::make_move_iterator(args.end()));
  if (metrics == Metrics::kOnFreePort) {
    Result<int> port = PickFreePort();
    if (!port.ok()) return port.status();
    started.metrics_port = *port;
    argv.insert(argv.end(), {"--metrics-port", std::to_string(started.metrics_port), "--metrics-host", "127.0.0.1"});
  } else {
    argv.insert(argv.end(), {"--metrics-port", "0"});
  }
  auto process = ChildProcess::Start(std::move(argv), log);
  if (!process.ok()) return process.status();
  started.process = std::move(process).value();
  return started;
}

std::optional<StatsReply> StatsClient::Get(const StatsRequest& page) const {
  auto reply = nc_->Request(endpoint_.subject, AsBytes(EncodeStatsRequest(page)), endpoint_.timeout);
  if (!reply.ok()) return std::nullopt;
  auto stats = DecodeStatsReply(*reply);
  if (!stats.ok()) return std::nullopt;
  return std::move(stats).value();
}

bool StatsClient::Await(const std::function<bool(StatsReply&)>& cond, std::chrono::milliseconds timeout,
                        std::chrono::milliseconds poll) const {
  return WaitFor(
      [&] {
        auto s = Get();
        return s.has_value() && cond(*s);
      },
      timeout, poll);
}

bool StatsClient::AwaitAnswer(std::chrono::milliseconds timeout) const {
  return Await([](const StatsReply&) { return true; }, timeout);
}

bool StatsClient::AwaitWorkers(std::uint64_t n, std::chrono::milliseconds timeout) const {
  return Await([n](const StatsReply& s) { return s.workers_total == n; }, timeout);
}

void NatsServerTest::SetUp() {
  auto nats = NatsServerProcess::Start(0, NatsServerArgs());
  ASSERT_TRUE(nats.ok()) << nats.status().ToString();
  nats_ = std::move(nats).value();
}

std::unique_ptr<NatsClient> NatsServerTest::Connect(NatsOptions options, NatsClient::Callbacks callbacks) {
  options.url = nats_->url();
  auto client = NatsClient::Connect(options, std::move(callbacks));
  EXPECT_TRUE(client.ok()) << options.name << ": " << client.status().ToString();
  if (!client.ok()) return nullptr;
  return std::move(client).value();
}

std::string NatsServerTest::LogPath(const std::string& program) const {
  return ::testing::TempDir() + program + "-" + std::to_string(nats_->port()) + ".log";
}

void KvRouterProcessTest::SetUp() {
  NatsServerTest::SetUp();
  if (HasFatalFailure()) return;
  log_ = LogPath("kvrouter");
  nc_ = Connect({.name = "kvrouter-test"});
  ASSERT_NE(nc_, nullptr);
  StartRouter();
}

void KvRouterProcessTest::StartRouter() {
  std::vector<std::string> args = {"--router-mode", "kv", "--block-size", std::to_string(RouterBlockSize())};
  for (auto& a : ExtraArgs()) args.push_back(std::move(a));
  auto router = StartOnNats(KVROUTER_BIN, nats_->url(), std::move(args), log_, RouterMetrics());
  ASSERT_TRUE(router.ok()) << router.status().ToString();
  router_ = std::move(router->process);
  metrics_port_ = router->metrics_port;
  ASSERT_TRUE(StatsClient(*nc_, {.timeout = 200ms}).AwaitAnswer(10s)) << "kvrouter did not come up; log: " << log_;
}

void KvRouterProcessTest::TearDown() {
  nc_.reset();
  if (router_) router_->Stop();
}

void KvRouterProcessTest::Register(std::uint64_t id, std::uint32_t lease_ms, bool leaving, std::uint32_t block_size,
                                   std::uint32_t max_num_batched_tokens) {
  WorkerRegistration r{.worker_id = id,
                       .block_size = block_size,
                       .max_num_batched_tokens = max_num_batched_tokens,
                       .lease_ms = lease_ms,
                       .leaving = leaving};
  ASSERT_TRUE(nc_->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r))).ok());
}

void KvRouterProcessTest::StoreDynamo(std::uint64_t worker, std::uint64_t event_id,
                                      const std::vector<std::uint32_t>& tokens) {
  const KvEventBatch b = StoredPromptBatch(worker, event_id, tokens, kBs);
  ASSERT_TRUE(nc_->Publish(kComp + "kv-events", AsBytes(EncodeDynamoEnvelope(b, {}))).ok());
}

void KvRouterProcessTest::StoreVllm(std::uint64_t worker, std::uint32_t rank, std::uint64_t kv_seq,
                                    const std::vector<std::uint32_t>& tokens) {
  VllmStoredEvent e{.token_ids = tokens, .block_size = kBs};
  for (std::size_t i = 0; i < tokens.size() / kBs; ++i) e.block_hashes.push_back(7000 + i);
  auto body = EncodeVllmBatch(1.0, {e}, rank);
  ASSERT_TRUE(nc_->PublishWithHeaders(kComp + "vllm-kv-events." + std::to_string(worker) + "." + std::to_string(rank),
                                      AsBytes(body), {{"Kv-Seq", std::to_string(kv_seq)}})
                  .ok());
}

Result<RouteReply> KvRouterProcessTest::Route(const std::vector<std::uint32_t>& tokens, std::string request_id,
                                              std::int64_t priority) {
  RouteRequest r{.request_id = std::move(request_id),
                 .token_ids = tokens,
                 .has_token_ids = true,
                 .isl = static_cast<std::uint32_t>(tokens.size()),
                 .priority = priority};
  return RequestRoute("route", EncodeRouteRequest(r));
}

Result<RouteReply> KvRouterProcessTest::BestWorker(const std::vector<std::uint32_t>& tokens) {
  RouteRequest q{.token_ids = tokens, .has_token_ids = true, .isl = static_cast<std::uint32_t>(tokens.size())};
  return RequestRoute("best_worker", EncodeRouteRequest(q));
}

Result<RouteReply> KvRouterProcessTest::RequestRoute(const std::string& endpoint, const msgpack::sbuffer& body) {
  auto reply = nc_->Request(kRouter + endpoint, AsBytes(body), 2s);
  if (!reply.ok()) return reply.status();
  return DecodeRouteReply(*reply);
}

bool KvRouterProcessTest::AwaitEventsApplied(std::uint64_t n) {
  return AwaitStats([n](const StatsReply& s) { return s.counters.at("events_applied") >= n; }, 5s);
}

}  // namespace kvrouter::testing
