// kvtop against a live kvrouter (nats-server and the router on free ports, workers registered by
// the test): --once lists every rank of a fleet larger than one stats page, and the screen,
// driven in tmux, shows the workers, redraws at a new size, changes its sort and quits.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "tests/integration/kvrouter_fixture.h"

namespace kvrouter::testing {
namespace {

class KvtopTest : public KvRouterProcessTest {
 protected:
  // Runs a short command to its end; its output.
  std::string Run(std::vector<std::string> argv) {
    const std::string log = LogPath(fmt::format("kvtop-cmd-{}", ++runs_));
    // Logs are appended to, and a test before this one may have had this server port and run.
    std::remove(log.c_str());
    auto p = ChildProcess::Start(std::move(argv), log);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return "";
    EXPECT_TRUE(WaitFor([&] { return !(*p)->Running(); }, 60s));
    last_status_ = (*p)->exit_status();
    return ReadFile(log);
  }
  static std::vector<std::string> Lines(const std::string& text) {
    std::vector<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  }
  int runs_ = 0;
  int last_status_ = -1;
};

TEST_F(KvtopTest, OnceListsEveryRankOfAFleetLargerThanAStatsPage) {
  constexpr std::uint64_t kRanks = StatsRequest::kMaxLimit + 50;
  for (std::uint64_t id = 1; id <= kRanks; ++id) Register(id);
  ASSERT_TRUE(AwaitWorkers(kRanks, 30s));
  StoreDynamo(7, 1, Tokens(1, 12));
  ASSERT_TRUE(AwaitEventsApplied(1));
  const std::string out = Run({KVTOP_BIN, "--nats-server", nats_->url(), "--once", "--interval-ms", "100", "--sort",
                               "cache"});
  ASSERT_EQ(last_status_, 0) << out;
  const auto lines = Lines(out);
  ASSERT_EQ(lines.size(), 4 + kRanks) << out.substr(0, 2000);  // the totals and header, then every rank
  EXPECT_NE(lines[0].find(fmt::format("{} ranks", kRanks)), std::string::npos) << lines[0];
  // Sorted by cache: worker 7, holding the prompt's 3 blocks, comes first.
  EXPECT_EQ(lines[4].substr(0, 17), fmt::format("{:>16} ", 7)) << lines[4];
  EXPECT_NE(lines[4].find("[############]"), std::string::npos) << lines[4];
}

TEST_F(KvtopTest, OnceFailsClearlyWithoutARouter) {
  router_->Stop();
  const std::string out = Run({KVTOP_BIN, "--nats-server", nats_->url(), "--once", "--interval-ms", "100"});
  EXPECT_EQ(WEXITSTATUS(last_status_), 1) << out;
  EXPECT_NE(out.find("router.stats"), std::string::npos) << out;
}

TEST_F(KvtopTest, TheScreenShowsTheWorkersRedrawsAtANewSizeAndQuits) {
  if (Run({"tmux", "-V"}).empty() || last_status_ != 0) GTEST_SKIP() << "tmux is not installed: the screen is NOT tested";
  for (std::uint64_t id = 11; id <= 30; ++id) Register(id);
  ASSERT_TRUE(AwaitWorkers(20));
  const std::string socket = fmt::format("kvtop-test-{}", getpid());
  const auto tmux = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"tmux", "-L", socket, "-f", "/dev/null"});
    return Run(std::move(args));
  };
  tmux({"new-session", "-d", "-s", "kvtop", "-x", "120", "-y", "30",
        fmt::format("{} --nats-server {} --interval-ms 200", KVTOP_BIN, nats_->url())});
  ASSERT_EQ(last_status_, 0);
  const auto screen = [&] { return tmux({"capture-pane", "-p", "-t", "kvtop"}); };
  std::string shown;
  EXPECT_TRUE(WaitFor(
      [&] {
        shown = screen();
        return shown.find("20 ranks") != std::string::npos && shown.find(fmt::format("{:>16} ", 11)) != std::string::npos &&
               shown.find(fmt::format("{:>16} ", 30)) != std::string::npos;
      },
      10s, 50ms))
      << shown;
  tmux({"send-keys", "-t", "kvtop", "c"});
  EXPECT_TRUE(WaitFor([&] { return (shown = screen()).find("sorted by cache") != std::string::npos; }, 10s, 50ms))
      << shown;
  // Narrower and shorter: redrawn for the new size (4 rows fit now, and the last line says so),
  // every line within the new width.
  tmux({"resize-window", "-t", "kvtop", "-x", "50", "-y", "10"});
  EXPECT_TRUE(WaitFor(
      [&] {
        shown = screen();
        const auto lines = Lines(shown);
        if (lines.size() > 10 || lines.empty() || lines[0].find("kvtop") == std::string::npos) return false;
        if (shown.find("ranks 1-4 of 20") == std::string::npos) return false;
        for (const auto& l : lines) {
          if (l.size() > 50) return false;
        }
        return true;
      },
      10s, 50ms))
      << shown;
  tmux({"send-keys", "-t", "kvtop", "q"});
  EXPECT_TRUE(WaitFor(
      [&] {
        tmux({"has-session", "-t", "kvtop"});
        return last_status_ != 0;  // kvtop quit, and its session with it
      },
      10s, 50ms));
  tmux({"kill-server"});  // in case it did not
}

}  // namespace
}  // namespace kvrouter::testing
