// gateway_bench: what kvgateway adds in front of engines, each number beside a baseline measured
// in the same run (scripts/bench.sh starts the processes; docs/performance.md has the goals):
//   added latency  short non-streamed chat requests one at a time, alternating between the
//                  gateway and the engine the router chose for the same prompt (direct): p50 and
//                  p99 of each, and the difference of the p50s;
//   streaming      streamed chat requests of --stream-tokens tokens, alternating gateway/direct:
//                  the mean gap between chunks at the client on each path, and the difference
//                  (the gateway's cost per chunk);
//   idle memory    --idle-connections TCP connections opened to the gateway and left idle: its
//                  RSS (from /proc/PID/status, --gateway-pid) after minus before, per connection.
// Throughput at 32 connections is wrk's (scripts/bench.sh), against nginx in the same run.
//   gateway_bench --gateway http://127.0.0.1:8000 --gateway-pid PID --model mock --json out.json
// Exit 2 on bad flags, 1 when a request fails.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <fstream>
#include <future>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "transport/http_client.h"

namespace {

using namespace kvrouter;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

std::string ChatBody(const std::string& model, int i, bool stream, int max_tokens) {
  return json{{"model", model},
              {"stream", stream},
              {"max_tokens", max_tokens},
              {"messages", {{{"role", "user"}, {"content", fmt::format("request {} of the benchmark: hello", i)}}}}}
      .dump();
}

struct Timed {
  double total_ms = 0;
  std::vector<double> gaps_ms;  // between body chunks
  std::string worker;           // x-kvrouter-worker-id (through the gateway)
  int status = 0;
};

// One request, timed at the client: the whole answer and the gaps between its chunks.
Timed Call(HttpClient& client, const HttpEndpoint& at, const std::string& body) {
  Timed t;
  std::promise<Status> done;
  auto future = done.get_future();
  const auto start = Clock::now();
  auto last = start;
  bool first = true;
  client.Start(at, {.target = "/v1/chat/completions", .headers = {{"content-type", "application/json"}}, .body = body},
               {.on_head =
                    [&](int status, const HttpHeaders& h) {
                      t.status = status;
                      for (const auto& [k, v] : h) {
                        if (k == "x-kvrouter-worker-id") t.worker = v;
                      }
                    },
                .on_data =
                    [&](std::string_view) {
                      const auto now = Clock::now();
                      if (!first) t.gaps_ms.push_back(std::chrono::duration<double, std::milli>(now - last).count());
                      first = false;
                      last = now;
                    },
                .on_done = [&](const Status& s) { done.set_value(s); }});
  const Status s = future.get();
  t.total_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  if (!s.ok()) t.status = -1;
  return t;
}

long RssKb(int pid) {
  std::ifstream f(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  namespace po = boost::program_options;
  po::options_description desc("gateway_bench options");
  // clang-format off
  desc.add_options()
    ("help,h", "this help")
    ("gateway", po::value<std::string>()->required(), "the gateway's base URL")
    ("gateway-pid", po::value<int>()->default_value(0), "the gateway's process id, for its memory (0: skip)")
    ("engines", po::value<std::vector<std::string>>()->multitoken()->required(), "engine base URLs, worker i at index i-base")
    ("worker-id-base", po::value<std::uint64_t>()->default_value(1), "worker id of the first engine URL")
    ("model", po::value<std::string>()->default_value("mock"), "model name")
    ("requests", po::value<int>()->default_value(400), "plain requests per path (added latency)")
    ("streams", po::value<int>()->default_value(40), "streamed requests per path")
    ("stream-tokens", po::value<int>()->default_value(100), "tokens per streamed request")
    ("idle-connections", po::value<int>()->default_value(10000), "idle connections for the memory measure (0: skip)")
    ("json", po::value<std::string>(), "write the results here");
  // clang-format on
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("help")) {
      std::cout << desc;
      return 0;
    }
    po::notify(vm);
  } catch (const std::exception& e) {
    fmt::print(stderr, "gateway_bench: {}\n", e.what());
    return 2;
  }
  auto gateway = ParseHttpUrl(vm["gateway"].as<std::string>());
  if (!gateway.ok()) return fmt::print(stderr, "{}\n", gateway.status().message()), 2;
  std::vector<HttpEndpoint> engines;
  for (const auto& u : vm["engines"].as<std::vector<std::string>>()) {
    auto e = ParseHttpUrl(u);
    if (!e.ok()) return fmt::print(stderr, "{}\n", e.status().message()), 2;
    engines.push_back(*e);
  }
  const std::uint64_t base = vm["worker-id-base"].as<std::uint64_t>();
  const std::string model = vm["model"].as<std::string>();
  HttpIo io(1);
  HttpClient client(io, {});
  json out;

  // Added latency: the same prompt through the gateway, then straight to the engine it chose.
  std::vector<double> via, direct;
  for (int i = 0; i < vm["requests"].as<int>(); ++i) {
    const std::string body = ChatBody(model, i, false, 1);
    const Timed g = Call(client, *gateway, body);
    if (g.status != 200) return fmt::print(stderr, "gateway answered {}\n", g.status), 1;
    const std::uint64_t w = std::stoull(g.worker.empty() ? "0" : g.worker);
    if (w < base || w - base >= engines.size()) return fmt::print(stderr, "unknown worker '{}'\n", g.worker), 1;
    const Timed d = Call(client, engines[w - base], body);
    if (d.status != 200) return fmt::print(stderr, "engine answered {}\n", d.status), 1;
    if (i >= 10) {  // the first ones warm the pools
      via.push_back(g.total_ms);
      direct.push_back(d.total_ms);
    }
  }
  out["latency"] = {{"gateway_p50_ms", Percentile(via, 0.5)},  {"gateway_p99_ms", Percentile(via, 0.99)},
                    {"direct_p50_ms", Percentile(direct, 0.5)}, {"direct_p99_ms", Percentile(direct, 0.99)},
                    {"added_p50_ms", Percentile(via, 0.5) - Percentile(direct, 0.5)}};

  // Streaming: mean gap between chunks at the client, each path.
  std::vector<double> gaps_via, gaps_direct;
  for (int i = 0; i < vm["streams"].as<int>(); ++i) {
    const std::string body = ChatBody(model, 100000 + i, true, vm["stream-tokens"].as<int>());
    const Timed g = Call(client, *gateway, body);
    if (g.status != 200) return fmt::print(stderr, "gateway stream answered {}\n", g.status), 1;
    const std::uint64_t w = std::stoull(g.worker.empty() ? "0" : g.worker);
    if (w < base || w - base >= engines.size()) return 1;
    const Timed d = Call(client, engines[w - base], body);
    if (d.status != 200) return 1;
    gaps_via.insert(gaps_via.end(), g.gaps_ms.begin(), g.gaps_ms.end());
    gaps_direct.insert(gaps_direct.end(), d.gaps_ms.begin(), d.gaps_ms.end());
  }
  out["streaming"] = {{"chunks", gaps_via.size()},
                      {"gateway_gap_mean_ms", Mean(gaps_via)},
                      {"direct_gap_mean_ms", Mean(gaps_direct)},
                      {"overhead_per_chunk_us", (Mean(gaps_via) - Mean(gaps_direct)) * 1000}};

  // Idle connections: the gateway's memory for each.
  const int pid = vm["gateway-pid"].as<int>();
  const int idle = vm["idle-connections"].as<int>();
  if (pid > 0 && idle > 0) {
    const long before = RssKb(pid);
    std::vector<int> fds;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(gateway->port);
    inet_pton(AF_INET, gateway->host.c_str(), &a.sin_addr);
    for (int i = 0; i < idle; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
        if (fd >= 0) ::close(fd);
        break;
      }
      fds.push_back(fd);
    }
    // Measured once the gateway shows them all open (its /metrics), well within its 10 s header
    // timeout that would close them.
    double open = 0;
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (open < static_cast<double>(fds.size()) && Clock::now() < deadline) {
      auto m = client.Fetch(*gateway, {.method = "GET", .target = "/metrics"});
      if (!m.ok()) break;
      const auto at = m->body.find("\nkvgateway_connections_open ");
      if (at != std::string::npos) open = std::stod(m->body.substr(at + 28));
    }
    const long after = RssKb(pid);
    const Timed probe = Call(client, *gateway, ChatBody(model, -1, false, 1));
    out["idle"] = {{"connections", fds.size()},
                   {"seen_open", open},
                   {"rss_before_kb", before},
                   {"rss_after_kb", after},
                   {"bytes_per_connection", fds.empty() ? 0.0 : (after - before) * 1024.0 / double(fds.size())},
                   {"probe_status", probe.status}};
    for (int fd : fds) ::close(fd);
  }
  io.Stop();
  std::cout << out.dump(2) << "\n";
  if (vm.count("json")) std::ofstream(vm["json"].as<std::string>()) << out.dump(2) << "\n";
  return 0;
}
