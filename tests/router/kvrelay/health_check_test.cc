// HttpHealthChecks against an engine stand-in on 127.0.0.1 (an HttpListener in this process):
// GET /health answered 2xx is healthy; another status, nothing listening and no answer within the
// timeout are failures that say which.
#include "router/kvrelay/health_check.h"

#include <gtest/gtest.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tests/await.h"
#include "transport/http_listener.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;

class HttpHealthChecksTest : public ::testing::Test {
 protected:
  // The stand-in answers every request with `handler`; returns its URL.
  std::string Engine(HttpRequestHandler handler) {
    auto l = HttpListener::Start(io_, {.host = "127.0.0.1"}, std::move(handler));
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    if (!l.ok()) return "";
    listener_ = std::move(l).value();
    return "http://127.0.0.1:" + std::to_string(listener_->port());
  }
  // One check of `url` with `timeout`, waited for.
  Status CheckOnce(const std::string& url, milliseconds timeout) {
    auto checks = HttpHealthChecks::Create(url, timeout);
    EXPECT_TRUE(checks.ok()) << checks.status().ToString();
    if (!checks.ok()) return checks.status();
    std::mutex mu;
    std::optional<Status> got;
    (*checks)->check()([&](const Status& s) {
      std::lock_guard g(mu);
      got = s;
    });
    EXPECT_TRUE(AwaitTrue([&] {
      std::lock_guard g(mu);
      return got.has_value();
    }));
    std::lock_guard g(mu);
    return got.value_or(Internal("no answer"));
  }
  void TearDown() override {
    if (listener_) listener_->Stop();
    io_.Stop();
  }

  HttpIo io_{1};
  std::unique_ptr<HttpListener> listener_;
};

TEST_F(HttpHealthChecksTest, A2xxAnswerToGetHealthIsHealthy) {
  std::mutex mu;
  std::vector<std::string> asked;
  const std::string url = Engine([&](HttpRequest req, std::shared_ptr<HttpReply> reply) {
    {
      std::lock_guard g(mu);
      asked.push_back(req.method + " " + req.target);
    }
    reply->Send(200, {}, "");
  });
  EXPECT_TRUE(CheckOnce(url, milliseconds(2000)).ok());
  std::lock_guard g(mu);
  EXPECT_EQ(asked, (std::vector<std::string>{"GET /health"}));
}

TEST_F(HttpHealthChecksTest, AnotherStatusIsAFailureThatNamesIt) {
  const std::string url =
      Engine([](HttpRequest, std::shared_ptr<HttpReply> reply) { reply->Send(503, {}, "engine dead"); });
  const Status s = CheckOnce(url, milliseconds(2000));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("503"), std::string::npos) << s.message();
}

TEST_F(HttpHealthChecksTest, NothingListeningIsAFailure) {
  const std::string url = Engine([](HttpRequest, std::shared_ptr<HttpReply> reply) { reply->Send(200, {}, ""); });
  listener_->Stop();
  // The listener's acceptor closes on its strand: wait until a check is refused.
  Status s;
  ASSERT_TRUE(AwaitTrue([&] {
    s = CheckOnce(url, milliseconds(2000));
    return !s.ok();
  }));
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("connect"), std::string::npos) << s.message();
}

TEST_F(HttpHealthChecksTest, NoAnswerWithinTheTimeoutIsATimeout) {
  std::mutex mu;
  std::vector<std::shared_ptr<HttpReply>> held;  // never answered
  const std::string url = Engine([&](HttpRequest, std::shared_ptr<HttpReply> reply) {
    std::lock_guard g(mu);
    held.push_back(std::move(reply));
  });
  const Status s = CheckOnce(url, milliseconds(200));
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.ToString();
  listener_->Stop();
  std::lock_guard g(mu);
  held.clear();
}

TEST_F(HttpHealthChecksTest, ABadUrlIsRefused) {
  EXPECT_EQ(HttpHealthChecks::Create("https://engine", milliseconds(100)).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvrouter
