// The integration-test harness itself: child processes are stopped, reaped and escalated to
// SIGKILL as documented, and a nats-server is only reported ready when it is ours.
#include "tests/integration/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

namespace kvrouter::testing {
namespace {

using namespace std::chrono_literals;

std::string TempLog(const std::string& name) {
  auto path =
      std::filesystem::temp_directory_path() / ("kvrouter-harness-" + name + "-" + std::to_string(::getpid()) + ".log");
  std::filesystem::remove(path);
  return path.string();
}

TEST(ChildProcessTest, ExitedChildIsReapedWithItsStatus) {
  const std::string log = TempLog("exit");
  auto child = ChildProcess::Start({"sh", "-c", "exit 3"}, log);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return !(*child)->Running(); }, 5s));
  ASSERT_TRUE(WIFEXITED((*child)->exit_status()));
  EXPECT_EQ(WEXITSTATUS((*child)->exit_status()), 3);
  (*child)->Stop();  // no-op: never signals a reaped pid
  std::filesystem::remove(log);
}

TEST(ChildProcessTest, OutputAndExtraEnvironmentGoToTheLog) {
  const std::string log = TempLog("env");
  auto child = ChildProcess::Start({"sh", "-c", "echo out=$KV_HARNESS_VAR; echo err >&2"}, log,
                                   {{"KV_HARNESS_VAR", "forty-two"}});
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return !(*child)->Running(); }, 5s));
  const std::string text = ReadFile(log);
  EXPECT_NE(text.find("out=forty-two"), std::string::npos) << text;
  EXPECT_NE(text.find("err"), std::string::npos) << text;
  std::filesystem::remove(log);
}

TEST(ChildProcessTest, AChildInheritsNoDescriptorButItsStandardOnes) {
  const std::string log = TempLog("fds");
  // A listening socket without close-on-exec, as Asio opens them, at a number the shell never uses.
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(s, 0);
  const int high = ::fcntl(s, F_DUPFD, 100);
  ASSERT_GE(high, 100);
  auto child = ChildProcess::Start(
      {"sh", "-c", "if [ -e /proc/$$/fd/" + std::to_string(high) + " ]; then echo inherited; else echo closed; fi"},
      log);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return !(*child)->Running(); }, 5s));
  const std::string text = ReadFile(log);
  EXPECT_NE(text.find("closed"), std::string::npos) << text;
  ::close(high);
  ::close(s);
  std::filesystem::remove(log);
}

TEST(ChildProcessTest, StopEscalatesToSigkillWhenSigtermIsIgnored) {
  const std::string log = TempLog("kill");
  // `exec sleep`: the ignored SIGTERM disposition survives exec, and the pid stays the same.
  auto child = ChildProcess::Start({"sh", "-c", "trap '' TERM; echo armed; exec sleep 30"}, log);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return ReadFile(log).find("armed") != std::string::npos; }, 5s));
  const auto start = std::chrono::steady_clock::now();
  (*child)->Stop(200ms);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  EXPECT_FALSE((*child)->Running());
  ASSERT_TRUE(WIFSIGNALED((*child)->exit_status()));
  EXPECT_EQ(WTERMSIG((*child)->exit_status()), SIGKILL);
  std::filesystem::remove(log);
}

TEST(ChildProcessTest, MissingExecutableIsNotFound) {
  auto child = ChildProcess::Start({"kvrouter-no-such-program"}, TempLog("missing"));
  ASSERT_FALSE(child.ok());
  EXPECT_EQ(child.status().code(), StatusCode::kNotFound);
}

TEST(WaitForTest, ReturnsFalseWhenTheConditionNeverHolds) {
  int calls = 0;
  EXPECT_FALSE(WaitFor([&] { return ++calls < 0; }, 50ms));
  EXPECT_GT(calls, 1);
  EXPECT_TRUE(WaitFor([] { return true; }, 0ms));
}

TEST(NatsServerProcessTest, StartsStopsAndRestartsOnTheSamePort) {
  auto server = NatsServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const int port = (*server)->port();
  EXPECT_TRUE(CanConnect(port));
  EXPECT_EQ((*server)->url(), "nats://127.0.0.1:" + std::to_string(port));
  (*server)->Stop();
  EXPECT_FALSE((*server)->Running());
  EXPECT_FALSE(CanConnect(port));
  ASSERT_TRUE((*server)->Restart().ok());
  EXPECT_EQ((*server)->port(), port);
  EXPECT_TRUE((*server)->Running());
  EXPECT_TRUE(CanConnect(port));
}

TEST(NatsServerProcessTest, PortHeldBySomeoneElseIsNotMistakenForOurServer) {
  // Someone else listens on the port: a TCP connect succeeds, but our server cannot bind.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 8), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);

  auto server = NatsServerProcess::Start(port);
  EXPECT_FALSE(server.ok());
  ::close(fd);
  // The failed start keeps its log (it says why); clean it up here.
  std::filesystem::remove(std::filesystem::temp_directory_path() /
                          ("kvrouter-nats-" + std::to_string(port) + "-" + std::to_string(::getpid()) + ".log"));
}

}  // namespace
}  // namespace kvrouter::testing
