#include "router/kvrelay/config.h"

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include <limits>

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
    ("metrics-port", po::value<std::uint32_t>()->default_value(d.metrics_port), "HTTP port of /metrics, /health and /ready (0 turns it off)")
    ("metrics-host", po::value<std::string>()->default_value(d.metrics_host), "address the metrics port listens on");
  // clang-format on
  AddNatsSecurityFlags(desc);
  return desc;
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
