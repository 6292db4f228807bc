#include "router/kvrelay/config.h"

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <limits>
#include <string_view>
#include <vector>

#include "events/registration_codec.h"
#include "events/msgpack_reader.h"
#include "transport/http_client.h"

namespace kvrouter {
namespace po = boost::program_options;

namespace {

po::options_description Describe() {
  const RelayConfig d;
  po::options_description desc(
      "kvrelay options (each also read from DYN_<FLAG> in the environment, NATS_SERVER for --nats-server)");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("nats-server", po::value<std::string>()->default_value(d.nats_server), "NATS server URL")
    ("zmq-endpoint", po::value<std::string>(), "the engine's ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557 (required)")
    ("zmq-replay-endpoint", po::value<std::string>(), "the engine's ZMQ ROUTER replay endpoint, e.g. tcp://127.0.0.1:5558")
    ("zmq-topic", po::value<std::string>()->default_value(""), "topic prefix to subscribe to (vLLM's \"topic\"; \"\" = all)")
    ("worker-id", po::value<std::uint64_t>(), "the worker id this engine rank is known by (required, >= 1)")
    ("dp-rank", po::value<std::uint32_t>()->default_value(0), "the engine's data-parallel rank")
    ("block-size", po::value<std::uint32_t>(), "the engine's KV block size in tokens; the router's must match (required)")
    ("total-kv-blocks", po::value<std::uint64_t>()->default_value(0), "KV blocks of the engine, announced to the router (0 = unknown)")
    ("max-num-seqs", po::value<std::uint32_t>()->default_value(d.relay.max_num_seqs), "announced to the router")
    ("max-num-batched-tokens", po::value<std::uint32_t>()->default_value(d.relay.max_num_batched_tokens), "announced to the router")
    ("namespace", po::value<std::string>()->default_value(d.relay.ns), "namespace of the subjects")
    ("component", po::value<std::string>()->default_value(d.relay.component), "worker component name")
    ("device", po::value<std::string>()->default_value(d.relay.device), "device announced to the router")
    ("heartbeat-ms", po::value<std::uint32_t>()->default_value(d.relay.heartbeat_ms), "registration period in ms (>= 10)")
    ("lease-ms", po::value<std::uint32_t>()->default_value(d.relay.lease_ms), "lease announced to the router in ms (> heartbeat-ms)")
    ("engine-url", po::value<std::string>(), "the engine's OpenAI base URL, http://host:port (no path), announced to the router")
    ("model", po::value<std::vector<std::string>>()->composing(), "a model the engine serves, announced with --engine-url (required with it): repeat the flag or separate names with commas")
    ("health-interval-ms", po::value<std::uint32_t>()->default_value(static_cast<std::uint32_t>(d.health.interval.count())), "with --engine-url: a GET {engine-url}/health starts this often, in ms (>= 10)")
    ("health-timeout-ms", po::value<std::uint32_t>(), "with --engine-url: a health check not answered (2xx) within this many ms fails (>= 10; default: --health-interval-ms)")
    ("health-failures", po::value<std::uint32_t>()->default_value(d.health.failures), "with --engine-url: failed health checks in a row after which the worker says `leaving` until the engine answers again (>= 1)")
    ("metrics-port", po::value<std::uint32_t>()->default_value(d.metrics_port), "HTTP port of /metrics, /health and /ready (0 turns it off)")
    ("metrics-host", po::value<std::string>()->default_value(d.metrics_host), "address the metrics port listens on")
    ("bootstrap-port", po::value<std::uint32_t>()->default_value(d.relay.bootstrap_port), "an SGLang prefill engine's bootstrap port, announced to the router [1, 65535]");
  // clang-format on
  AddWorkerRoleFlags(desc, "the engine");
  AddNatsSecurityFlags(desc);
  return desc;
}

// --model NAME, any number of times, each a comma-separated list: the names in order, blanks
// around them trimmed, each once.
Result<std::vector<std::string>> ReadModels(const std::vector<std::string>& given) {
  std::vector<std::string> models;
  for (const std::string& list : given) {
    std::string_view rest = list;
    while (true) {
      const std::size_t comma = rest.find(',');
      std::string_view name = rest.substr(0, comma);
      while (!name.empty() && std::isspace(static_cast<unsigned char>(name.front()))) name.remove_prefix(1);
      while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.remove_suffix(1);
      if (name.empty()) return FlagOutOfRange("model", "a non-empty name (or comma-separated names)");
      if (name.size() > kMaxNameBytes) {
        return FlagOutOfRange("model", fmt::format("at most {} bytes per name", kMaxNameBytes));
      }
      if (std::find(models.begin(), models.end(), name) == models.end()) models.emplace_back(name);
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }
  if (models.size() > kMaxModels) return FlagOutOfRange("model", fmt::format("at most {} names", kMaxModels));
  return models;
}

// --engine-url and --model: both or neither; the --health-* flags only with them.
Status ReadEngine(const po::variables_map& vm, RelayConfig& c) {
  const bool has_models = vm.count("model") > 0;
  if (!vm.count("engine-url")) {
    if (has_models) return InvalidArgument("--model needs --engine-url (the engine that serves it)");
    for (const char* flag : {"health-interval-ms", "health-timeout-ms", "health-failures"}) {
      if (vm.count(flag) && !vm[flag].defaulted()) {
        return InvalidArgument(fmt::format("--{} needs --engine-url (the engine whose health is checked)", flag));
      }
    }
    return Status::Ok();
  }
  constexpr std::uint32_t kMaxMs = 3'600'000;
  const std::uint32_t interval = vm["health-interval-ms"].as<std::uint32_t>();
  if (interval < 10 || interval > kMaxMs) return FlagOutOfRange("health-interval-ms", "in [10, 3600000]");
  const std::uint32_t timeout = vm.count("health-timeout-ms") ? vm["health-timeout-ms"].as<std::uint32_t>() : interval;
  if (timeout < 10 || timeout > kMaxMs) return FlagOutOfRange("health-timeout-ms", "in [10, 3600000]");
  const std::uint32_t failures = vm["health-failures"].as<std::uint32_t>();
  if (failures < 1 || failures > 1000) return FlagOutOfRange("health-failures", "in [1, 1000]");
  c.health = {.interval = std::chrono::milliseconds(interval),
              .timeout = std::chrono::milliseconds(timeout),
              .failures = failures};
  std::string url = vm["engine-url"].as<std::string>();
  while (url.ends_with('/')) url.pop_back();  // protocol.md section 4: no trailing slash
  if (auto endpoint = ParseHttpUrl(url); !endpoint.ok()) {
    return InvalidArgument(fmt::format("--engine-url: {}", endpoint.status().message()));
  }
  if (url.size() > kMaxUrlBytes) {
    return FlagOutOfRange("engine-url", fmt::format("at most {} bytes", kMaxUrlBytes));
  }
  if (!has_models) return InvalidArgument("--engine-url needs --model (the names the engine serves)");
  auto models = ReadModels(vm["model"].as<std::vector<std::string>>());
  if (!models.ok()) return models.status();
  c.relay.http_url = std::move(url);
  c.relay.models = std::move(models).value();
  c.relay.register_when = RegisterWhen::kEngineUp;
  return Status::Ok();
}

Status ReadRelayConfig(const po::variables_map& vm, RelayConfig& c) {
  c.nats_server = vm["nats-server"].as<std::string>();
  c.nats_security = ReadNatsSecurity(vm);
  if (!vm.count("zmq-endpoint") || vm["zmq-endpoint"].as<std::string>().empty()) {
    return InvalidArgument("--zmq-endpoint is required (the engine's ZMQ PUB endpoint)");
  }
  c.zmq_endpoint = vm["zmq-endpoint"].as<std::string>();
  if (vm.count("zmq-replay-endpoint") && !vm["zmq-replay-endpoint"].as<std::string>().empty()) {
    c.zmq_replay_endpoint = vm["zmq-replay-endpoint"].as<std::string>();
  }
  c.zmq_topic = vm["zmq-topic"].as<std::string>();
  if (!vm.count("worker-id") || vm["worker-id"].as<std::uint64_t>() == 0) {
    return InvalidArgument("--worker-id is required (>= 1)");
  }
  c.relay.worker_id = vm["worker-id"].as<std::uint64_t>();
  c.relay.dp_rank = vm["dp-rank"].as<std::uint32_t>();
  if (!vm.count("block-size")) return InvalidArgument("--block-size is required (the engine's KV block size)");
  c.relay.block_size = vm["block-size"].as<std::uint32_t>();
  if (c.relay.block_size < 1 || c.relay.block_size > 65536) return FlagOutOfRange("block-size", "in [1, 65536]");
  c.relay.total_kv_blocks = vm["total-kv-blocks"].as<std::uint64_t>();
  c.relay.max_num_seqs = vm["max-num-seqs"].as<std::uint32_t>();
  c.relay.max_num_batched_tokens = vm["max-num-batched-tokens"].as<std::uint32_t>();
  c.relay.ns = vm["namespace"].as<std::string>();
  c.relay.component = vm["component"].as<std::string>();
  if (c.relay.ns.empty()) return FlagOutOfRange("namespace", "non-empty");
  if (c.relay.component.empty()) return FlagOutOfRange("component", "non-empty");
  c.relay.device = vm["device"].as<std::string>();
  c.relay.heartbeat_ms = vm["heartbeat-ms"].as<std::uint32_t>();
  c.relay.lease_ms = vm["lease-ms"].as<std::uint32_t>();
  if (c.relay.heartbeat_ms < 10) return FlagOutOfRange("heartbeat-ms", ">= 10");
  if (c.relay.lease_ms <= c.relay.heartbeat_ms) return FlagOutOfRange("lease-ms", "> --heartbeat-ms");
  if (Status s = ReadEngine(vm, c); !s.ok()) return s;
  if (Status s = ReadWorkerRoleFlags(vm, c.relay.role, c.relay.kv_connector); !s.ok()) return s;
  c.relay.bootstrap_port = vm["bootstrap-port"].as<std::uint32_t>();
  if (c.relay.bootstrap_port < 1 || c.relay.bootstrap_port > 65535) return FlagOutOfRange("bootstrap-port", "in [1, 65535]");
  c.metrics_port = vm["metrics-port"].as<std::uint32_t>();
  if (c.metrics_port > 65535) return FlagOutOfRange("metrics-port", "in [0, 65535]");
  c.metrics_host = vm["metrics-host"].as<std::string>();
  return Status::Ok();
}

}  // namespace

Result<ParsedRelayArgs> ParseRelayConfig(int argc, const char* const* argv, const EnvLookup& env) {
  return ParseProgram<RelayConfig>(Describe(), argc, argv, env, {}, ReadRelayConfig);
}

}  // namespace kvrouter
