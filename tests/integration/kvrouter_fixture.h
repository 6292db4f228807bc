// The integration tests' one fixture: a nats-server of the test's own, the programs under test
// (kvrouter, kvmocker, kvrelay) on it, and router.stats asked over NATS.
//
// NatsServerTest starts a nats-server on a free 127.0.0.1 port before each test and connects
// clients to it. KvRouterProcessTest adds the real kvrouter (--router-mode kv, block size kBs,
// plus ExtraArgs()), answering stats when SetUp returns, and the client nc_ that plays workers
// and clients. StartOnNats starts any of the programs on a server; StatsClient asks router.stats
// (or one replica's router.stats.<id>) over any connection and waits on what it answers. One test
// thread owns each object; Stats, Route and StatsClient may also be called from helper threads
// (NatsClient's requests are thread-safe). The programs' paths come from CMake (KVROUTER_BIN ...).
//
//   class QueueTest : public KvRouterProcessTest { std::vector<std::string> ExtraArgs() const override; };
//   TEST_F(QueueTest, X) { Register(1); ASSERT_TRUE(AwaitWorkers(1)); auto r = Route(Tokens(1, 12)); }
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "events/base/status.h"
#include "events/router_endpoints_codec.h"
#include "tests/integration/process.h"
#include "transport/nats_client.h"

namespace kvrouter::testing {

using namespace std::chrono_literals;

inline constexpr std::uint32_t kBs = 4;  // the block size of KvRouterProcessTest's router
inline const std::string kComp = "namespace.dynamo.component.backend.";
inline const std::string kRouter = "namespace.dynamo.router.";

// n consecutive token ids from `first`.
std::vector<std::uint32_t> Tokens(std::uint32_t first, std::size_t n);

// Where a program started by StartOnNats serves /metrics.
enum class Metrics {
  kOff,         // --metrics-port 0: many programs run at once under ctest
  kOnFreePort,  // a port free right now, on 127.0.0.1
};

struct ProgramOnNats {
  std::unique_ptr<ChildProcess> process;
  int metrics_port = 0;  // 0 with Metrics::kOff
};

// Starts `program` (KVROUTER_BIN, KVMOCKER_BIN, KVRELAY_BIN) as
// `program --nats-server nats_url args... <metrics flags>`, its output appended to `log`.
// `args` must not name a metrics port: `metrics` chooses it.
Result<ProgramOnNats> StartOnNats(const std::string& program, const std::string& nats_url,
                                  std::vector<std::string> args, const std::string& log,
                                  Metrics metrics = Metrics::kOff);

struct StatsEndpoint {
  std::string subject = kRouter + "stats";  // one replica's own: kRouter + "stats.<router id>"
  std::chrono::milliseconds timeout = 2s;   // of each request
};

// router.stats asked over a connection it borrows (which must outlive it).
class StatsClient {
 public:
  explicit StatsClient(NatsClient& nc, StatsEndpoint endpoint = {}) : nc_(&nc), endpoint_(std::move(endpoint)) {}

  // One page; nullopt when no answer came in time or it is not a stats reply.
  std::optional<StatsReply> Get(const StatsRequest& page = {}) const;
  // Polls (every `poll`) until an answer satisfies `cond` (true) or `timeout` passes (false).
  // `cond` may read the answer's maps with [] (a counter it lacks reads 0).
  bool Await(const std::function<bool(StatsReply&)>& cond, std::chrono::milliseconds timeout,
             std::chrono::milliseconds poll = 10ms) const;
  // The router answers at all (it is up and subscribed).
  bool AwaitAnswer(std::chrono::milliseconds timeout) const;
  // Exactly n worker ranks known (workers_total).
  bool AwaitWorkers(std::uint64_t n, std::chrono::milliseconds timeout = 5s) const;

 private:
  NatsClient* nc_;
  StatsEndpoint endpoint_;
};

// A nats-server of this test's own (NatsServerArgs() added to its command line), started in
// SetUp and stopped when the test ends.
class NatsServerTest : public ::testing::Test {
 protected:
  void SetUp() override;
  virtual std::vector<std::string> NatsServerArgs() const { return {}; }

  // A client of this test's server (options.url is replaced by the server's); nullptr, and a
  // test failure, when it cannot connect.
  std::unique_ptr<NatsClient> Connect(NatsOptions options = {}, NatsClient::Callbacks callbacks = {});
  // <test temp dir>/<program>-<server port>.log: the place for a program's output.
  std::string LogPath(const std::string& program) const;

  std::unique_ptr<NatsServerProcess> nats_;
};

// The real kvrouter on this test's server: --router-mode kv --block-size RouterBlockSize() plus
// ExtraArgs(), with /metrics as RouterMetrics() says; and nc_, a client that plays workers and
// clients.
class KvRouterProcessTest : public NatsServerTest {
 protected:
  void SetUp() override;
  void TearDown() override;
  virtual std::vector<std::string> ExtraArgs() const { return {}; }
  virtual Metrics RouterMetrics() const { return Metrics::kOff; }
  // Register, StoreDynamo and StoreVllm assume kBs: a test that gives the router another block
  // size brings its own workers (SystemTest: kvmocker's).
  virtual std::uint32_t RouterBlockSize() const { return kBs; }

  // Starts kvrouter (again after a Kill: the same log) and waits until it answers stats.
  void StartRouter();

  // What a worker sends: a registration, a stored prompt in Dynamo's format or vLLM's.
  void Register(std::uint64_t id, std::uint32_t lease_ms = 60000, bool leaving = false, std::uint32_t block_size = kBs,
                std::uint32_t max_num_batched_tokens = 8192);
  void StoreDynamo(std::uint64_t worker, std::uint64_t event_id, const std::vector<std::uint32_t>& tokens);
  void StoreVllm(std::uint64_t worker, std::uint32_t rank, std::uint64_t kv_seq,
                 const std::vector<std::uint32_t>& tokens);

  // route (books the request) and best_worker (does not), and any body to any such endpoint.
  Result<RouteReply> Route(const std::vector<std::uint32_t>& tokens, std::string request_id = "",
                           std::int64_t priority = 0);
  Result<RouteReply> BestWorker(const std::vector<std::uint32_t>& tokens);
  Result<RouteReply> RequestRoute(const std::string& endpoint, const msgpack::sbuffer& body);

  std::optional<StatsReply> Stats(const StatsRequest& page = {}) { return StatsClient(*nc_).Get(page); }
  bool AwaitStats(const std::function<bool(StatsReply&)>& cond, std::chrono::milliseconds timeout) {
    return StatsClient(*nc_).Await(cond, timeout);
  }
  // Registrations and events arrive on different subscriptions (no order between them).
  bool AwaitWorkers(std::uint64_t n, std::chrono::milliseconds timeout = 5s) {
    return StatsClient(*nc_).AwaitWorkers(n, timeout);
  }
  bool AwaitEventsApplied(std::uint64_t n);

  std::unique_ptr<ChildProcess> router_;
  int metrics_port_ = 0;  // the router's /metrics with Metrics::kOnFreePort
  std::unique_ptr<NatsClient> nc_;
  std::string log_;  // the router's output
};

}  // namespace kvrouter::testing
