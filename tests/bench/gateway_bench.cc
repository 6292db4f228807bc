// gateway_bench: what kvgateway adds in front of engines, each number beside a baseline measured
// in the same run (scripts/gateway-bench.sh starts the processes; docs/performance.md has the goals):
//   added latency  short non-streamed chat requests one at a time, alternating between the
//                  gateway and the engine the router chose for the same prompt (direct): p50 and
//                  p99 of each, and the difference of the p50s;
//   streaming      streamed chat requests of --stream-tokens tokens, alternating gateway/direct:
//                  the mean gap between chunks at the client on each path, and the difference
//                  (the gateway's cost per chunk);
//   idle memory    --idle-connections TCP connections opened to the gateway and left idle: its
//                  RSS (from /proc/PID/status, --gateway-pid) after minus before, per connection
//                  (once its /metrics, on --gateway-metrics, shows them open).
// With --prefill-engines the fleet is disaggregated (--engines are then the decode engines) and
// the first two become the P/D measurement: each request through the gateway, and direct, where
// this program runs the two legs of docs/protocol.md section 13 (the `nixl` connector) itself
// against the prefill and decode engines the gateway used (see PdDirect); plain requests (the
// whole answer) and streamed ones (the first byte of the answer).
// Throughput at 32 connections is wrk's (scripts/gateway-bench.sh), against nginx in the same run.
//   gateway_bench --gateway http://127.0.0.1:8000 --gateway-metrics http://127.0.0.1:9094 --gateway-pid PID
//       --model mock --json out.json
//   gateway_bench --gateway URL --engines DECODE_URLS --worker-id-base 11
//       --prefill-engines PREFILL_URLS --prefill-worker-id-base 1 --idle-connections 0
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
#include <functional>
#include <future>
#include <iostream>
#include <optional>
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
  double first_byte_ms = 0;     // the first body byte (a head alone does not count)
  std::vector<double> gaps_ms;  // between body chunks
  std::string worker;           // x-kvrouter-worker-id (through the gateway)
  std::string prefill_worker;   // x-kvrouter-prefill-worker-id (a disaggregated answer)
  std::string body;             // the answer, when asked for
  int status = 0;
};

enum class KeepBody { kNo, kYes };

// Starts one request, timed from now into `t` (written on the HttpIo thread until `then` runs
// there, last): the whole answer, its first body byte and the gaps between its chunks.
void StartTimed(HttpClient& client, const HttpEndpoint& at, std::string body, HttpHeaders headers, KeepBody keep,
                Timed& t, std::function<void(const Status&)> then) {
  headers.emplace_back("content-type", "application/json");
  struct Clocks {
    Clock::time_point start = Clock::now(), last = start;
    bool first = true;
  };
  auto c = std::make_shared<Clocks>();
  client.Start(at, {.target = "/v1/chat/completions", .headers = std::move(headers), .body = std::move(body)},
               {.on_head =
                    [&t](int status, const HttpHeaders& h) {
                      t.status = status;
                      for (const auto& [k, v] : h) {
                        if (k == "x-kvrouter-worker-id") t.worker = v;
                        if (k == "x-kvrouter-prefill-worker-id") t.prefill_worker = v;
                      }
                    },
                .on_data =
                    [&t, c, keep](std::string_view d) {
                      const auto now = Clock::now();
                      if (c->first) {
                        t.first_byte_ms = std::chrono::duration<double, std::milli>(now - c->start).count();
                      } else {
                        t.gaps_ms.push_back(std::chrono::duration<double, std::milli>(now - c->last).count());
                      }
                      c->first = false;
                      c->last = now;
                      if (keep == KeepBody::kYes) t.body.append(d);
                    },
                .on_done =
                    [&t, c, then = std::move(then)](const Status& s) {
                      t.total_ms = std::chrono::duration<double, std::milli>(Clock::now() - c->start).count();
                      if (!s.ok()) t.status = -1;
                      then(s);
                    }});
}

// One request, waited for.
Timed Call(HttpClient& client, const HttpEndpoint& at, const std::string& body) {
  Timed t;
  std::promise<void> done;
  StartTimed(client, at, body, {}, KeepBody::kNo, t, [&](const Status&) { done.set_value(); });
  done.get_future().wait();
  return t;
}

// The engine of worker `id` among `engines` (the first being worker `base`); nullptr when the id
// (a header's text) names none of them.
const HttpEndpoint* EngineOf(const std::vector<HttpEndpoint>& engines, std::uint64_t base, const std::string& id) {
  std::uint64_t w = 0;
  try {
    w = std::stoull(id);
  } catch (const std::exception&) {
    return nullptr;
  }
  return w < base || w - base >= engines.size() ? nullptr : &engines[w - base];
}

// Added latency: `requests` short plain prompts through the gateway, each then straight to the
// engine the gateway chose, with the same prompt.
Result<json> MeasureAdded(HttpClient& client, const HttpEndpoint& gateway, const std::vector<HttpEndpoint>& engines,
                          std::uint64_t base, const std::string& model, int requests) {
  std::vector<double> via, direct;
  for (int i = 0; i < requests; ++i) {
    const std::string body = ChatBody(model, i, false, 1);
    const Timed g = Call(client, gateway, body);
    if (g.status != 200) return Internal(fmt::format("gateway answered {}", g.status));
    const HttpEndpoint* engine = EngineOf(engines, base, g.worker);
    if (engine == nullptr) return Internal(fmt::format("unknown worker '{}'", g.worker));
    const Timed d = Call(client, *engine, body);
    if (d.status != 200) return Internal(fmt::format("engine answered {}", d.status));
    if (i >= 10) {  // the first ones warm the pools
      via.push_back(g.total_ms);
      direct.push_back(d.total_ms);
    }
  }
  return json{{"gateway_p50_ms", Percentile(via, 0.5)},   {"gateway_p99_ms", Percentile(via, 0.99)},
              {"direct_p50_ms", Percentile(direct, 0.5)}, {"direct_p99_ms", Percentile(direct, 0.99)},
              {"added_p50_ms", Percentile(via, 0.5) - Percentile(direct, 0.5)}};
}

// Streaming: the mean gap between chunks at the client, each path, over `streams` prompts.
Result<json> MeasureStreaming(HttpClient& client, const HttpEndpoint& gateway, const std::vector<HttpEndpoint>& engines,
                              std::uint64_t base, const std::string& model, int streams, int tokens) {
  std::vector<double> gaps_via, gaps_direct;
  for (int i = 0; i < streams; ++i) {
    const std::string body = ChatBody(model, 100000 + i, true, tokens);
    const Timed g = Call(client, gateway, body);
    if (g.status != 200) return Internal(fmt::format("gateway stream answered {}", g.status));
    const HttpEndpoint* engine = EngineOf(engines, base, g.worker);
    if (engine == nullptr) return Internal(fmt::format("unknown worker '{}'", g.worker));
    const Timed d = Call(client, *engine, body);
    if (d.status != 200) return Internal(fmt::format("engine stream answered {}", d.status));
    gaps_via.insert(gaps_via.end(), g.gaps_ms.begin(), g.gaps_ms.end());
    gaps_direct.insert(gaps_direct.end(), d.gaps_ms.begin(), d.gaps_ms.end());
  }
  return json{{"chunks", gaps_via.size()},
              {"gateway_gap_mean_ms", Mean(gaps_via)},
              {"direct_gap_mean_ms", Mean(gaps_direct)},
              {"overhead_per_chunk_us", (Mean(gaps_via) - Mean(gaps_direct)) * 1000}};
}

// A chat body whose prompt is `bytes` bytes long (kvmocker's tokenizer: one token per byte) and
// starts with `tag` and `i`, so that no two prompts share a first block: every prompt is new to
// every engine's cache, prefilled whole and pulled whole.
std::string PdChatBody(const std::string& model, char tag, int i, bool stream, int max_tokens, int bytes) {
  std::string text = fmt::format("{} {:09d} ", tag, i);
  text.resize(std::max<std::size_t>(text.size(), static_cast<std::size_t>(bytes)), 'x');
  return json{{"model", model},
              {"stream", stream},
              {"max_tokens", max_tokens},
              {"messages", {{{"role", "user"}, {"content", text}}}}}
      .dump();
}

// The prefill leg's body (docs/protocol.md section 13, `nixl`), written here from the contract and
// not from the gateway's code: the client's with kv_transfer_params asking for a remote decode,
// stream false, max_tokens 1 (and max_completion_tokens 1 when present), without stream_options,
// min_tokens and min_completion_tokens, every other field in its place.
std::string NixlPrefillLegBody(const std::string& client_body) {
  auto d = nlohmann::ordered_json::parse(client_body);
  d["kv_transfer_params"] = nlohmann::ordered_json{{"do_remote_decode", true}, {"do_remote_prefill", false},
                                                   {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                                                   {"remote_host", nullptr},      {"remote_port", nullptr}};
  d["stream"] = false;
  d["max_tokens"] = 1;
  if (d.contains("max_completion_tokens")) d["max_completion_tokens"] = 1;
  for (const char* gone : {"stream_options", "min_tokens", "min_completion_tokens"}) d.erase(gone);
  return d.dump();
}

// A disaggregated request run by the client itself, the baseline of the gateway's: the prefill
// leg (its body built before the clock starts: it depends on the client's body alone), then, on
// the HTTP thread that got the prefill answer (as the gateway does), the decode leg with that
// answer's kv_transfer_params inserted before the client body's closing brace; the same
// X-Request-Id on both. Timed from the prefill call: total_ms to the decode answer's end,
// first_byte_ms to its first byte; prefill_ms to the prefill answer's end.
struct PdTimed {
  Timed decode;
  double prefill_ms = 0;
  std::string error;  // non-empty: the legs failed
};

PdTimed PdDirect(HttpClient& client, const HttpEndpoint& prefill, const HttpEndpoint& decode,
                 const std::string& client_body, const std::string& prefill_body, const std::string& request_id) {
  PdTimed r;
  Timed p;
  std::promise<void> done;
  const auto start = Clock::now();
  Clock::time_point prefilled;
  StartTimed(client, prefill, prefill_body, {{"x-request-id", request_id}}, KeepBody::kYes, p, [&](const Status& s) {
    if (!s.ok() || p.status != 200) {
      r.error = fmt::format("prefill engine answered {}: {} {}", p.status, s.message(), p.body);
      return done.set_value();
    }
    const auto answer = nlohmann::ordered_json::parse(p.body, nullptr, /*allow_exceptions=*/false);
    const auto params = answer.is_object() ? answer.find("kv_transfer_params") : answer.end();
    if (params == answer.end() || !params->is_object()) {
      r.error = fmt::format("prefill answer without kv_transfer_params: {}", p.body);
      return done.set_value();
    }
    std::string body = client_body.substr(0, client_body.find_last_of('}'));
    body += ",\"kv_transfer_params\":";
    body += params->dump();
    body += '}';
    prefilled = Clock::now();
    StartTimed(client, decode, std::move(body), {{"x-request-id", request_id}}, KeepBody::kNo, r.decode,
               [&](const Status& d) {
                 r.decode.total_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
                 if (!d.ok() || r.decode.status != 200) {
                   r.error = fmt::format("decode engine answered {}: {}", r.decode.status, d.message());
                 }
                 done.set_value();
               });
  });
  done.get_future().wait();
  if (!r.error.empty()) return r;
  r.prefill_ms = p.total_ms;
  r.decode.first_byte_ms += std::chrono::duration<double, std::milli>(prefilled - start).count();
  return r;
}

// The P/D measurement: `requests` pairs (gateway, direct), each path with its own prompt of the
// same length, so both find every engine's cache cold (the same prompt would let the second path
// hit the prefix the first one left in both engines). The order alternates pair by pair, so
// neither path always runs in the other's wake (the router's and engines' work after an answer);
// a pair that starts direct uses the engines of the gateway's latest disaggregated answer, a
// pair that starts through the gateway those of its own answer (the engines of a role are alike).
// Pairs whose gateway answer was not disaggregated are counted and left out.
struct PdFleet {
  std::vector<HttpEndpoint> prefill;
  std::uint64_t prefill_base = 1;
  std::vector<HttpEndpoint> decode;
  std::uint64_t decode_base = 1;
};

Result<json> MeasurePd(HttpClient& client, const HttpEndpoint& gateway, const PdFleet& fleet, const std::string& model,
                       int requests, bool stream, int max_tokens, int prompt_bytes) {
  std::vector<double> via, direct, prefill_legs;
  int not_disaggregated = 0;
  const HttpEndpoint* last_prefill = nullptr;
  const HttpEndpoint* last_decode = nullptr;
  const int offset = stream ? 1'000'000 : 0;  // streamed prompts apart from plain ones
  for (int i = 0; i < requests; ++i) {
    const std::string via_body = PdChatBody(model, 'g', offset + i, stream, max_tokens, prompt_bytes);
    const std::string direct_body = PdChatBody(model, 'd', offset + i, stream, max_tokens, prompt_bytes);
    const std::string prefill_body = NixlPrefillLegBody(direct_body);
    const std::string request_id = fmt::format("gateway-bench-pd-{}-{}", stream ? "stream" : "plain", i);
    const bool direct_first = i % 2 == 1 && last_prefill != nullptr;
    PdTimed d;
    if (direct_first) {
      d = PdDirect(client, *last_prefill, *last_decode, direct_body, prefill_body, request_id);
      if (!d.error.empty()) return Internal(d.error);
    }
    const Timed g = Call(client, gateway, via_body);
    if (g.status != 200) return Internal(fmt::format("gateway answered {}", g.status));
    const HttpEndpoint* decode = EngineOf(fleet.decode, fleet.decode_base, g.worker);
    if (decode == nullptr) return Internal(fmt::format("unknown decode worker '{}'", g.worker));
    if (g.prefill_worker.empty()) {
      ++not_disaggregated;
      continue;
    }
    const HttpEndpoint* prefill = EngineOf(fleet.prefill, fleet.prefill_base, g.prefill_worker);
    if (prefill == nullptr) return Internal(fmt::format("unknown prefill worker '{}'", g.prefill_worker));
    last_prefill = prefill;
    last_decode = decode;
    if (!direct_first) {
      d = PdDirect(client, *prefill, *decode, direct_body, prefill_body, request_id);
      if (!d.error.empty()) return Internal(d.error);
    }
    if (i >= std::min(10, requests / 4)) {  // the first ones warm the pools
      via.push_back(stream ? g.first_byte_ms : g.total_ms);
      direct.push_back(stream ? d.decode.first_byte_ms : d.decode.total_ms);
      prefill_legs.push_back(d.prefill_ms);
    }
  }
  const std::string what = stream ? "first_byte" : "total";
  return json{{"pairs", via.size()},
              {"not_disaggregated", not_disaggregated},
              {"measured", what},
              {"gateway_p50_ms", Percentile(via, 0.5)},
              {"gateway_p99_ms", Percentile(via, 0.99)},
              {"direct_p50_ms", Percentile(direct, 0.5)},
              {"direct_p99_ms", Percentile(direct, 0.99)},
              {"direct_prefill_leg_p50_ms", Percentile(prefill_legs, 0.5)},
              {"added_p50_ms", Percentile(via, 0.5) - Percentile(direct, 0.5)}};
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
    ("gateway-metrics", po::value<std::string>()->default_value(""), "base URL of the gateway's --metrics-port (its /metrics tells when the idle connections are open; \"\": measured at once)")
    ("engines", po::value<std::vector<std::string>>()->multitoken()->required(), "engine base URLs, worker i at index i-base")
    ("worker-id-base", po::value<std::uint64_t>()->default_value(1), "worker id of the first engine URL")
    ("prefill-engines", po::value<std::vector<std::string>>()->multitoken(),
     "prefill engine base URLs, worker i at index i-base: the fleet is disaggregated, --engines are its decode "
     "engines, and the P/D measurement replaces the added latency and streaming ones")
    ("prefill-worker-id-base", po::value<std::uint64_t>()->default_value(1), "worker id of the first prefill engine URL")
    ("prompt-bytes", po::value<int>()->default_value(512), "P/D: prompt length (kvmocker: one token per byte)")
    ("max-tokens", po::value<int>()->default_value(4), "P/D: max_tokens of a plain request (its decode leg's)")
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
  std::optional<HttpEndpoint> gateway_metrics;
  if (const auto& m = vm["gateway-metrics"].as<std::string>(); !m.empty()) {
    auto e = ParseHttpUrl(m);
    if (!e.ok()) return fmt::print(stderr, "--gateway-metrics: {}\n", e.status().message()), 2;
    gateway_metrics = *e;
  }
  std::vector<HttpEndpoint> engines;
  for (const auto& u : vm["engines"].as<std::vector<std::string>>()) {
    auto e = ParseHttpUrl(u);
    if (!e.ok()) return fmt::print(stderr, "{}\n", e.status().message()), 2;
    engines.push_back(*e);
  }
  const std::uint64_t base = vm["worker-id-base"].as<std::uint64_t>();
  const std::string model = vm["model"].as<std::string>();
  PdFleet pd{.prefill = {},
             .prefill_base = vm["prefill-worker-id-base"].as<std::uint64_t>(),
             .decode = engines,
             .decode_base = base};
  if (vm.count("prefill-engines")) {
    for (const auto& u : vm["prefill-engines"].as<std::vector<std::string>>()) {
      auto e = ParseHttpUrl(u);
      if (!e.ok()) return fmt::print(stderr, "{}\n", e.status().message()), 2;
      pd.prefill.push_back(*e);
    }
  }
  const int prompt_bytes = vm["prompt-bytes"].as<int>();
  const int max_tokens = vm["max-tokens"].as<int>();
  if (prompt_bytes < 16 || prompt_bytes > 1'000'000 || max_tokens < 1 || vm["stream-tokens"].as<int>() < 1) {
    return fmt::print(stderr, "gateway_bench: --prompt-bytes in [16, 1000000], --max-tokens and --stream-tokens >= 1\n"), 2;
  }
  HttpIo io(1);
  HttpClient client(io, {});
  json out;

  if (!pd.prefill.empty()) {
    // Disaggregated: plain requests (the whole answer), then streamed ones (the first byte).
    auto plain = MeasurePd(client, *gateway, pd, model, vm["requests"].as<int>(), false, max_tokens, prompt_bytes);
    if (!plain.ok()) return fmt::print(stderr, "gateway_bench: {}\n", plain.status().message()), 1;
    out["pd_latency"] = *plain;
    auto streamed = MeasurePd(client, *gateway, pd, model, vm["streams"].as<int>(), true,
                              vm["stream-tokens"].as<int>(), prompt_bytes);
    if (!streamed.ok()) return fmt::print(stderr, "gateway_bench: {}\n", streamed.status().message()), 1;
    out["pd_first_byte"] = *streamed;
  } else {
    auto added = MeasureAdded(client, *gateway, engines, base, model, vm["requests"].as<int>());
    if (!added.ok()) return fmt::print(stderr, "gateway_bench: {}\n", added.status().message()), 1;
    out["latency"] = *added;
    auto streaming =
        MeasureStreaming(client, *gateway, engines, base, model, vm["streams"].as<int>(), vm["stream-tokens"].as<int>());
    if (!streaming.ok()) return fmt::print(stderr, "gateway_bench: {}\n", streaming.status().message()), 1;
    out["streaming"] = *streaming;
  }

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
    while (gateway_metrics && open < static_cast<double>(fds.size()) && Clock::now() < deadline) {
      auto m = client.Fetch(*gateway_metrics, {.method = "GET", .target = "/metrics"});
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
