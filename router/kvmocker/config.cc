#include "router/kvmocker/config.h"

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

#include "events/msgpack_reader.h"
#include "router/common/flags.h"

namespace kvrouter {
namespace po = boost::program_options;

namespace {

Status OutOfRange(std::string_view flag, std::string_view range) { return FlagOutOfRange(flag, range); }

// An integer flag in [lo, hi] (read as int64 so "-1" is refused rather than wrapped).
Result<std::uint32_t> U32Flag(const po::variables_map& vm, const char* flag, std::int64_t lo, std::int64_t hi) {
  const std::int64_t v = vm[flag].as<std::int64_t>();
  if (v < lo || v > hi) {
    return hi == std::numeric_limits<std::uint32_t>::max() ? OutOfRange(flag, fmt::format(">= {}", lo))
                                                           : OutOfRange(flag, fmt::format("in [{}, {}]", lo, hi));
  }
  return static_cast<std::uint32_t>(v);
}

// A host name or address as it may stand in a URL: no scheme, path, user, port or spaces.
bool PlainHost(std::string_view host) {
  if (host.empty() || host.size() > 253 + 2) return false;
  if (host.find(':') != std::string_view::npos && std::count(host.begin(), host.end(), ':') < 2) {
    return false;  // host:port (an IPv6 literal has at least two colons)
  }
  return std::all_of(host.begin(), host.end(), [](unsigned char ch) {
    return std::isalnum(ch) || ch == '-' || ch == '.' || ch == '_' || ch == ':' || ch == '[' || ch == ']';
  });
}

// --http-port, --http-host, --http-advertise-host, --http-max-body-bytes, --model; after
// --num-workers is read.
Status ReadHttpFlags(const po::variables_map& vm, MockerConfig& c) {
  const std::int64_t max_base = 65535 - static_cast<std::int64_t>(c.num_workers - 1);
  auto port = U32Flag(vm, "http-port", 0, max_base);
  if (!port.ok()) {
    return OutOfRange("http-port", fmt::format("in [0, {}] (worker i listens on --http-port + i, {} workers)", max_base,
                                               c.num_workers));
  }
  c.http_port = *port;
  c.http_host = vm["http-host"].as<std::string>();
  if (c.http_host.empty()) return OutOfRange("http-host", "non-empty");
  if (vm.count("http-advertise-host")) {
    c.http_advertise_host = vm["http-advertise-host"].as<std::string>();
  } else if (c.http_host == "0.0.0.0" || c.http_host == "::" || c.http_host == "127.0.0.1") {
    c.http_advertise_host = "127.0.0.1";
  } else {
    c.http_advertise_host = c.http_host;
  }
  if (!PlainHost(c.http_advertise_host)) {
    return OutOfRange("http-advertise-host", "a host name or address (no scheme, port or path)");
  }
  const std::int64_t body = vm["http-max-body-bytes"].as<std::int64_t>();
  if (body < 1) return OutOfRange("http-max-body-bytes", ">= 1");
  c.http_max_body_bytes = static_cast<std::uint64_t>(body);
  c.model = vm["model"].as<std::string>();
  if (c.model.empty() || c.model.size() > kMaxNameBytes) {
    return OutOfRange("model", fmt::format("a name of 1 to {} bytes", kMaxNameBytes));
  }
  return Status::Ok();
}

// --role, --kv-connector, --kv-bytes-per-token, --kv-transfer-gbps, --kv-lease-ms, --bootstrap-port.
Status ReadDisaggFlags(const po::variables_map& vm, MockerConfig& c) {
  if (Status s = ReadWorkerRoleFlags(vm, c.role, c.kv_connector); !s.ok()) return s;
  const std::int64_t bytes = vm["kv-bytes-per-token"].as<std::int64_t>();
  if (bytes < 1) return OutOfRange("kv-bytes-per-token", ">= 1");
  c.kv_bytes_per_token = static_cast<std::uint64_t>(bytes);
  c.kv_transfer_gbps = vm["kv-transfer-gbps"].as<double>();
  if (!(c.kv_transfer_gbps > 0) || !std::isfinite(c.kv_transfer_gbps)) {
    return OutOfRange("kv-transfer-gbps", "a finite number > 0");
  }
  auto lease = U32Flag(vm, "kv-lease-ms", 0, std::numeric_limits<std::uint32_t>::max());
  if (!lease.ok()) return lease.status();
  c.kv_lease_ms = *lease;
  auto bootstrap = U32Flag(vm, "bootstrap-port", 1, 65535);
  if (!bootstrap.ok()) return bootstrap.status();
  c.bootstrap_port = *bootstrap;
  return Status::Ok();
}

po::options_description Describe() {
  const MockerConfig d;
  po::options_description desc(
      "kvmocker options (each also read from DYN_<FLAG> in the environment, NATS_SERVER for "
      "--nats-server)");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("nats-server", po::value<std::string>()->default_value(d.nats_server), "NATS server URL")
    ("namespace", po::value<std::string>()->default_value(d.ns), "namespace of the subjects")
    ("component", po::value<std::string>()->default_value(d.component), "worker component name")
    ("num-workers", po::value<std::int64_t>()->default_value(d.num_workers), "workers in this process [1, 1024]")
    ("worker-id-base", po::value<std::string>(), "id of the first worker (default: random in [1, 2^48))")
    ("dp-size", po::value<std::int64_t>()->default_value(d.dp_size), "data-parallel ranks per worker [1, 64], one engine each")
    ("num-gpu-blocks", po::value<std::int64_t>()->default_value(d.num_gpu_blocks), "KV cache blocks per rank (>= 1)")
    ("block-size", po::value<std::int64_t>()->default_value(d.block_size), "tokens per KV block [1, 65536]")
    ("max-num-seqs", po::value<std::int64_t>()->default_value(d.max_num_seqs), "running requests per rank (>= 1)")
    ("max-num-batched-tokens", po::value<std::int64_t>()->default_value(d.max_num_batched_tokens), "uncached prompt tokens prefilled per step (>= 1); with --chunked-prefill, the step's whole token budget")
    ("chunked-prefill", po::bool_switch(), "prefill long prompts in chunks over several steps, decode tokens first, as vLLM V1 does (default: each prompt whole in one step)")
    ("speedup-ratio", po::value<NumberList>()->default_value(NumberList{d.speedup_ratio}, FormatNumberList(d.speedup_ratio)), "divides every simulated duration (finite, > 0): one value for every worker, or one per worker separated by commas (8,8,2,2 with --num-workers 4)")
    ("event-format", po::value<std::string>()->default_value("dynamo"), "dynamo | vllm")
    ("heartbeat-ms", po::value<std::int64_t>()->default_value(d.heartbeat_ms), "registration period in ms (>= 10)")
    ("lease-ms", po::value<std::int64_t>()->default_value(d.lease_ms), "lease announced to the router in ms (> heartbeat-ms)")
    ("device", po::value<std::string>()->default_value(d.device), "device announced to the router (gpu, cpu, ...)")
    ("metrics-port", po::value<std::int64_t>()->default_value(d.metrics_port), "HTTP port of /metrics, /health and /ready (0 turns it off) [0, 65535]")
    ("metrics-host", po::value<std::string>()->default_value(d.metrics_host), "address the metrics port listens on")
    ("http-port", po::value<std::int64_t>()->default_value(d.http_port), "OpenAI HTTP port of worker 0; worker i listens on it + i (0 turns it off) [0, 65535]")
    ("http-host", po::value<std::string>()->default_value(d.http_host), "address the HTTP ports listen on")
    ("http-advertise-host", po::value<std::string>(), "host of the http_url announced to the router (default: 127.0.0.1 when --http-host is 0.0.0.0, :: or 127.0.0.1, else --http-host)")
    ("http-max-body-bytes", po::value<std::int64_t>()->default_value(static_cast<std::int64_t>(d.http_max_body_bytes)), "largest HTTP request body; larger ones get 413 (>= 1)")
    ("model", po::value<std::string>()->default_value(d.model), "model name served over HTTP and announced to the router")
    ("kv-bytes-per-token", po::value<std::int64_t>()->default_value(static_cast<std::int64_t>(d.kv_bytes_per_token)), "KV bytes of one token, priced by a decode engine's pull (>= 1)")
    ("kv-transfer-gbps", po::value<double>()->default_value(d.kv_transfer_gbps), "Gbit/s a decode engine pulls KV at (finite, > 0)")
    ("kv-lease-ms", po::value<std::int64_t>()->default_value(d.kv_lease_ms), "ms a prefill engine keeps a leg's blocks for the pull, divided by --speedup-ratio (>= 0)")
    ("bootstrap-port", po::value<std::int64_t>()->default_value(d.bootstrap_port), "SGLang bootstrap port announced by every worker; with --role prefill --kv-connector sglang and --http-port, the process listens there for the decode legs [1, 65535]");
  // clang-format on
  AddWorkerRoleFlags(desc, "every worker");
  AddNatsSecurityFlags(desc);
  return desc;
}

Status ReadMockerConfig(const po::variables_map& vm, MockerConfig& c) {
  c.nats_server = vm["nats-server"].as<std::string>();
  c.nats_security = ReadNatsSecurity(vm);
  c.ns = vm["namespace"].as<std::string>();
  c.component = vm["component"].as<std::string>();
  c.metrics_host = vm["metrics-host"].as<std::string>();
  if (c.ns.empty()) return OutOfRange("namespace", "non-empty");
  if (c.component.empty()) return OutOfRange("component", "non-empty");
  constexpr std::int64_t kU32Max = std::numeric_limits<std::uint32_t>::max();
  struct U32Field {
    const char* flag;
    std::int64_t lo, hi;
    std::uint32_t& out;
  };
  for (const U32Field& f :
       {U32Field{"num-workers", 1, kMaxMockRanks, c.num_workers}, U32Field{"dp-size", 1, 64, c.dp_size},
        U32Field{"num-gpu-blocks", 1, kU32Max, c.num_gpu_blocks}, U32Field{"block-size", 1, 65536, c.block_size},
        U32Field{"max-num-seqs", 1, kU32Max, c.max_num_seqs},
        U32Field{"max-num-batched-tokens", 1, kU32Max, c.max_num_batched_tokens},
        U32Field{"heartbeat-ms", 10, kU32Max, c.heartbeat_ms}, U32Field{"lease-ms", 1, kU32Max, c.lease_ms},
        U32Field{"metrics-port", 0, 65535, c.metrics_port}}) {
    auto v = U32Flag(vm, f.flag, f.lo, f.hi);
    if (!v.ok()) return v.status();
    f.out = *v;
  }
  if (static_cast<std::uint64_t>(c.num_workers) * c.dp_size > kMaxMockRanks) {
    return InvalidArgument(fmt::format("--num-workers * --dp-size must be at most {} (got {} * {})", kMaxMockRanks,
                                       c.num_workers, c.dp_size));
  }
  if (c.lease_ms <= c.heartbeat_ms) {
    return InvalidArgument(
        fmt::format("--lease-ms ({}) must be greater than --heartbeat-ms ({})", c.lease_ms, c.heartbeat_ms));
  }
  if (vm.count("worker-id-base")) {
    const std::string s = vm["worker-id-base"].as<std::string>();
    std::uint64_t base = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), base);
    const std::uint64_t max_base = std::numeric_limits<std::uint64_t>::max() - (c.num_workers - 1);
    if (ec != std::errc() || end != s.data() + s.size() || base > max_base) {
      return OutOfRange("worker-id-base", fmt::format("an integer in [0, {}]", max_base));
    }
    c.worker_id_base = base;
  }
  c.speedup_ratio = vm["speedup-ratio"].as<NumberList>().values;
  if (c.speedup_ratio.size() != 1 && c.speedup_ratio.size() != c.num_workers) {
    return InvalidArgument(fmt::format(
        "--speedup-ratio has {} values for {} workers (--num-workers): give one value for all of them, or one "
        "per worker",
        c.speedup_ratio.size(), c.num_workers));
  }
  for (double r : c.speedup_ratio) {
    if (!(r > 0) || !std::isfinite(r)) {
      return OutOfRange("speedup-ratio", fmt::format("a finite number > 0 for every worker (got {})", r));
    }
  }
  const std::string format = vm["event-format"].as<std::string>();
  if (format == "dynamo") {
    c.event_format = MockEventFormat::kDynamo;
  } else if (format == "vllm") {
    c.event_format = MockEventFormat::kVllm;
  } else {
    return OutOfRange("event-format", "dynamo or vllm");
  }
  c.chunked_prefill = vm["chunked-prefill"].as<bool>();
  c.device = vm["device"].as<std::string>();
  if (c.device.empty()) return OutOfRange("device", "non-empty");
  if (Status s = ReadDisaggFlags(vm, c); !s.ok()) return s;
  return ReadHttpFlags(vm, c);
}

}  // namespace

std::string WorkerHttpUrl(const MockerConfig& config, std::uint32_t worker_index) {
  if (config.http_port == 0) return {};
  const std::string& host = config.http_advertise_host;
  const bool v6 = host.find(':') != std::string::npos && !host.starts_with('[');
  return fmt::format("http://{}{}{}:{}", v6 ? "[" : "", host, v6 ? "]" : "", config.http_port + worker_index);
}

MockEngineConfig WorkerEngineConfig(const MockerConfig& config, std::uint32_t worker_index) {
  const std::vector<double>& ratios = config.speedup_ratio;
  return {.num_gpu_blocks = config.num_gpu_blocks,
          .block_size = config.block_size,
          .max_num_seqs = config.max_num_seqs,
          .max_num_batched_tokens = config.max_num_batched_tokens,
          .speedup_ratio = ratios.size() == 1 ? ratios.front() : ratios.at(worker_index),
          // Streamed HTTP answers send each token as it comes.
          .outputs = config.http_port > 0 ? EngineOutputs::kEveryToken : EngineOutputs::kFirstAndFinish,
          .chunked_prefill = config.chunked_prefill,
          .kv_bytes_per_token = config.kv_bytes_per_token,
          .kv_transfer_gbps = config.kv_transfer_gbps,
          .kv_lease_ms = config.kv_lease_ms};
}

Result<ParsedMockerArgs> ParseMockerConfig(int argc, const char* const* argv, const EnvLookup& env) {
  // The command line, then DYN_<FLAG> / NATS_SERVER for flags it does not give.
  return ParseProgram<MockerConfig>(Describe(), argc, argv, env, {}, ReadMockerConfig);
}

}  // namespace kvrouter
