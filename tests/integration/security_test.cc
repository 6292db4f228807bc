// NATS security end to end: nats-server with the repo's least-privilege users
// (scripts/nats-auth.conf) and TLS from a CA this test makes with openssl; the real kvrouter and
// kvmocker log in as `router` and `worker`, this test as `client`. The system routes; a worker's
// login may not call route; a client's may not publish KV events; a wrong password or CA stops a
// program at start with a message naming the flag.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "events/event_codec.h"
#include "events/kv_event.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "events/worker_codec.h"
#include "tests/await.h"
#include "tests/integration/kvrouter_fixture.h"
#include "transport/http_client.h"

namespace kvrouter::testing {
namespace {

// Runs a command to completion; its exit status (0 = success).
int RunToEnd(std::vector<std::string> argv, const std::string& log) {
  auto p = ChildProcess::Start(std::move(argv), log);
  if (!p.ok()) return -1;
  if (!WaitFor([&] { return !(*p)->Running(); }, 30s)) return -1;
  return (*p)->exit_status();
}

class SecurityTest : public NatsServerTest {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "kvrouter-security-" + std::to_string(::getpid());
    std::filesystem::create_directories(dir_);
    const std::string log = dir_ + "/openssl.log";
    const std::vector<std::string> ec = {"-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"};
    auto req = [&](std::vector<std::string> args) {
      std::vector<std::string> argv = {"openssl", "req"};
      argv.insert(argv.end(), ec.begin(), ec.end());
      argv.insert(argv.end(), args.begin(), args.end());
      return RunToEnd(argv, log);
    };
    ASSERT_EQ(req({"-x509", "-keyout", dir_ + "/ca.key", "-out", dir_ + "/ca.pem", "-days", "2", "-subj",
                   "/CN=kvrouter-test-ca"}),
              0)
        << ReadFile(log);
    ASSERT_EQ(req({"-keyout", dir_ + "/server.key", "-out", dir_ + "/server.csr", "-subj", "/CN=127.0.0.1"}), 0)
        << ReadFile(log);
    std::ofstream(dir_ + "/ext.cnf") << "subjectAltName=IP:127.0.0.1\n";
    ASSERT_EQ(RunToEnd({"openssl", "x509", "-req", "-in", dir_ + "/server.csr", "-CA", dir_ + "/ca.pem", "-CAkey",
                        dir_ + "/ca.key", "-CAcreateserial", "-out", dir_ + "/server.pem", "-days", "2", "-extfile",
                        dir_ + "/ext.cnf"},
                       log),
              0)
        << ReadFile(log);
    // The repo's users, beside a TLS block (includes are relative to the including file).
    std::filesystem::copy_file(KVROUTER_NATS_AUTH_CONF, dir_ + "/nats-auth.conf",
                               std::filesystem::copy_options::overwrite_existing);
    std::ofstream(dir_ + "/server.conf") << "tls {\n  cert_file: \"" << dir_ << "/server.pem\"\n  key_file: \"" << dir_
                                         << "/server.key\"\n}\ninclude \"nats-auth.conf\"\n";
    ::setenv("KVROUTER_NATS_ROUTER_PASSWORD", "router-secret", 1);
    ::setenv("KVROUTER_NATS_WORKER_PASSWORD", "worker-secret", 1);
    ::setenv("KVROUTER_NATS_CLIENT_PASSWORD", "client-secret", 1);
    NatsServerTest::SetUp();
  }
  std::vector<std::string> NatsServerArgs() const override { return {"-c", dir_ + "/server.conf"}; }
  void TearDown() override {
    client_.reset();
    if (mocker_) mocker_->Stop();
    if (router_) router_->Stop();
    nats_.reset();
    std::filesystem::remove_all(dir_);
  }

  // A program's flags to log in as `user` over TLS, then `more`.
  std::vector<std::string> LoginFlags(const std::string& user, const std::vector<std::string>& more) const {
    std::vector<std::string> flags = {"--nats-user",   user, "--nats-password", user + "-secret", "--nats-tls-ca",
                                      dir_ + "/ca.pem"};
    flags.insert(flags.end(), more.begin(), more.end());
    return flags;
  }
  // This test's own client, logged in as `user` over TLS (nullptr and a failure when refused).
  std::unique_ptr<NatsClient> LogIn(const std::string& user) {
    return Connect({.name = "security-test-" + user,
                    .retry_on_failed_connect = false,
                    .security = {.user = user, .password = user + "-secret", .tls_ca = dir_ + "/ca.pem"}});
  }
  void StartSystem() {
    auto router =
        StartOnNats(KVROUTER_BIN, nats_->url(), LoginFlags("router", {"--router-mode", "kv"}), dir_ + "/kvrouter.log");
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    router_ = std::move(router->process);
    auto mocker = StartOnNats(KVMOCKER_BIN, nats_->url(),
                              LoginFlags("worker", {"--num-workers", "2", "--num-gpu-blocks", "256", "--speedup-ratio",
                                                    "50", "--worker-id-base", "500"}),
                              dir_ + "/kvmocker.log");
    ASSERT_TRUE(mocker.ok()) << mocker.status().ToString();
    mocker_ = std::move(mocker->process);
    client_ = LogIn("client");
    ASSERT_NE(client_, nullptr);
    ASSERT_TRUE(Stats().AwaitWorkers(2, 15s)) << "the system never came up; logs in " << dir_ << "\n"
                                              << ReadFile(dir_ + "/kvrouter.log") << ReadFile(dir_ + "/kvmocker.log");
  }
  // router.stats, asked with the client's login.
  StatsClient Stats() const { return StatsClient(*client_, {.timeout = 1s}); }

  std::string dir_;
  std::unique_ptr<ChildProcess> router_, mocker_;
  std::unique_ptr<NatsClient> client_;
};

TEST_F(SecurityTest, KvgatewayLoggedInAsAClientRoutesAChatCompletion) {
  auto router =
      StartOnNats(KVROUTER_BIN, nats_->url(), LoginFlags("router", {"--router-mode", "kv"}), dir_ + "/kvrouter.log");
  ASSERT_TRUE(router.ok()) << router.status().ToString();
  router_ = std::move(router->process);
  auto engine_port = PickFreePort();
  auto gateway_port = PickFreePort();
  ASSERT_TRUE(engine_port.ok() && gateway_port.ok());
  auto mocker = StartOnNats(KVMOCKER_BIN, nats_->url(),
                            LoginFlags("worker", {"--num-workers", "1", "--speedup-ratio", "50", "--http-host",
                                                  "127.0.0.1", "--http-port", std::to_string(*engine_port)}),
                            dir_ + "/kvmocker.log");
  ASSERT_TRUE(mocker.ok()) << mocker.status().ToString();
  mocker_ = std::move(mocker->process);
  // The gateway reads registrations and gets the router's answers on its own inbox (_KVGW.>).
  auto gateway =
      StartOnNats(KVGATEWAY_BIN, nats_->url(),
                  LoginFlags("client", {"--http-host", "127.0.0.1", "--http-port", std::to_string(*gateway_port)}),
                  dir_ + "/kvgateway.log");
  ASSERT_TRUE(gateway.ok()) << gateway.status().ToString();
  client_ = LogIn("client");
  ASSERT_NE(client_, nullptr);
  ASSERT_TRUE(Stats().AwaitWorkers(1, 15s));  // the router has the engine too
  HttpIo io(1);
  HttpClient http(io, {});
  const HttpEndpoint at{.host = "127.0.0.1", .port = static_cast<std::uint16_t>(*gateway_port)};
  EXPECT_TRUE(AwaitTrue([&] {
    auto ready = http.Fetch(at, {.method = "GET", .target = "/ready"});
    return ready.ok() && ready->status == 200;
  })) << ReadFile(dir_ + "/kvgateway.log");
  auto r = http.Fetch(at, {.target = "/v1/chat/completions",
                           .headers = {{"content-type", "application/json"}},
                           .body = R"({"model":"mock","messages":[{"role":"user","content":"hi"}],"max_tokens":2})"});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 200) << r->body;
  // Routed by the router, not served by the gateway's fallback (a permission the gateway lacks
  // would leave it without router answers, and still answered).
  bool routed = false, fell_back = false;
  for (const auto& [k, v] : r->headers) {
    routed = routed || k == "x-kvrouter-cached-tokens";
    fell_back = fell_back || k == "x-kvrouter-fallback";
  }
  EXPECT_TRUE(routed && !fell_back) << ReadFile(dir_ + "/kvgateway.log");
  http.Stop();
  io.Stop();
  gateway->process->Stop();
}

TEST_F(SecurityTest, TheSystemRoutesOverTlsWithLeastPrivilegeUsers) {
  StartSystem();
  // A generate request (the client's login) goes through the router (router's) to a worker
  // (worker's) and back.
  std::vector<std::uint32_t> prompt(256);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::uint32_t>(i + 1);
  RouteRequest req{.request_id = "secure-1", .token_ids = prompt, .has_token_ids = true, .isl = 256, .max_tokens = 2};
  std::atomic<bool> final{false};
  auto sub = client_->Subscribe("_INBOX.security-test", "", [&](const IncomingMessage& m) {
    auto r = GenerateResponse::Decode(m.data);
    if (r.ok() && r->is_final()) final = true;
  });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(
      client_->PublishRequest(kRouter + "generate", "_INBOX.security-test", AsBytes(EncodeRouteRequest(req))).ok());
  EXPECT_TRUE(WaitFor([&] { return final.load(); }, 10s)) << ReadFile(dir_ + "/kvrouter.log");
  // The worker's events reached the router.
  EXPECT_TRUE(Stats().Await([](const StatsReply& s) { return s.counters.at("events_applied") > 0; }, 10s));
}

TEST_F(SecurityTest, AWorkersLoginCannotCallRouteAndAClientsCannotPublishEvents) {
  StartSystem();
  auto worker = LogIn("worker");
  ASSERT_NE(worker, nullptr);
  RouteRequest q{.token_ids = {1, 2, 3, 4}, .has_token_ids = true, .isl = 4};
  EXPECT_FALSE(worker->Request(kRouter + "route", AsBytes(EncodeRouteRequest(q)), 1s).ok());
  EXPECT_TRUE(client_->Request(kRouter + "best_worker", AsBytes(EncodeRouteRequest(q)), 2s).ok());  // the client may

  const KvEventBatch forged = StoredPromptBatch(999, 1, std::vector<std::uint32_t>(64, 7), 64);
  ASSERT_TRUE(client_->Publish(kComp + "kv-events", AsBytes(EncodeDynamoEnvelope(forged, {}))).ok());
  ASSERT_TRUE(client_->Flush(2s).ok());  // the server has judged it
  // A worker's event after it, on the same subject, reaches the router; the forged one, before
  // it, would have too had the server let it through.
  const KvEventBatch honest = StoredPromptBatch(998, 1, std::vector<std::uint32_t>(64, 8), 64);
  ASSERT_TRUE(worker->Publish(kComp + "kv-events", AsBytes(EncodeDynamoEnvelope(honest, {}))).ok());
  ASSERT_TRUE(Stats().Await(
      [](const StatsReply& s) {
        return std::any_of(s.workers.begin(), s.workers.end(), [](const WorkerStats& w) { return w.worker_id == 998; });
      },
      5s));
  auto s = Stats().Get();
  ASSERT_TRUE(s);
  for (const WorkerStats& w : s->workers) EXPECT_NE(w.worker_id, 999u);
}

TEST_F(SecurityTest, AWrongPasswordOrCaStopsAProgramNamingTheFlag) {
  std::vector<std::string> bad_password = {KVROUTER_BIN,     "--nats-server",   nats_->url(), "--nats-user",
                                           "router",         "--nats-password", "guess",      "--nats-tls-ca",
                                           dir_ + "/ca.pem", "--metrics-port",  "0"};
  EXPECT_EQ(WEXITSTATUS(RunToEnd(bad_password, dir_ + "/bad-password.log")), 1);
  EXPECT_NE(ReadFile(dir_ + "/bad-password.log").find("--nats-password"), std::string::npos)
      << ReadFile(dir_ + "/bad-password.log");
  std::vector<std::string> bad_ca = {
      KVMOCKER_BIN,    "--nats-server", nats_->url(),          "--nats-user",    "worker", "--nats-password",
      "worker-secret", "--nats-tls-ca", dir_ + "/missing.pem", "--metrics-port", "0"};
  EXPECT_NE(RunToEnd(bad_ca, dir_ + "/bad-ca.log"), 0);
  EXPECT_NE(ReadFile(dir_ + "/bad-ca.log").find("--nats-tls-ca"), std::string::npos) << ReadFile(dir_ + "/bad-ca.log");
}

}  // namespace
}  // namespace kvrouter::testing
