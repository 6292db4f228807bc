#include "router/kvgateway/config.h"

#include <boost/program_options.hpp>

#include "transport/http_client.h"

namespace kvrouter {
namespace po = boost::program_options;

namespace {

po::options_description Describe() {
  const GatewayConfig d;
  po::options_description desc(
      "kvgateway options (each also read from DYN_<FLAG> in the environment, NATS_SERVER for --nats-server)");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("http-port", po::value<std::uint32_t>()->default_value(d.http_port), "port of the OpenAI-compatible API [0, 65535] (0: any free port)")
    ("http-host", po::value<std::string>()->default_value(d.http_host), "address the API listens on")
    ("nats-server", po::value<std::string>()->default_value(d.nats_server), "NATS server URL")
    ("namespace", po::value<std::string>()->default_value(d.ns), "namespace of the subjects")
    ("component", po::value<std::string>()->default_value(d.component), "worker component name")
    ("metrics-port", po::value<std::uint32_t>()->default_value(d.metrics_port), "HTTP port of /metrics, /health and /ready (0 turns it off)")
    ("metrics-host", po::value<std::string>()->default_value(d.metrics_host), "address the metrics port listens on")
    ("render-url", po::value<std::string>()->default_value(d.render_url), "base URL that renders prompts to token ids (default: an engine serving the model)")
    ("retries", po::value<std::uint32_t>()->default_value(d.retries), "other workers tried when an engine fails before its answer reached the client [0, 16]")
    ("max-body-bytes", po::value<std::uint64_t>()->default_value(d.max_body_bytes), "largest request body (>= 1); larger is 413, refused from Content-Length")
    ("route-timeout-ms", po::value<std::uint32_t>()->default_value(d.route_timeout_ms), "longest wait for the router's answer, its queue included (>= 1)")
    ("engine-timeout-ms", po::value<std::uint32_t>()->default_value(d.engine_timeout_ms), "an engine silent this long (before or between chunks) fails the request (>= 1); once the engine has the request it is not sent to another one: 504")
    ("engine-connect-timeout-ms", po::value<std::uint32_t>()->default_value(d.engine_connect_timeout_ms), "longest TCP connect to an engine; one that times out is that engine's failure and the request goes to another (>= 1)")
    ("render-timeout-ms", po::value<std::uint32_t>()->default_value(d.render_timeout_ms), "a render (or /tokenize) call silent this long is given up for the next engine serving the model (>= 1)")
    ("engine-idle-timeout-ms", po::value<std::uint32_t>()->default_value(d.engine_idle_timeout_ms), "a pooled engine connection unused this long is closed; keep it below the engines' keep-alive (>= 1)")
    ("io-threads", po::value<std::uint32_t>()->default_value(d.io_threads), "threads serving every HTTP connection [1, 64]")
    ("max-connections", po::value<std::uint32_t>()->default_value(d.max_connections), "client connections open at once; more are closed at accept (>= 1)")
    ("drain-timeout-secs", po::value<std::uint32_t>()->default_value(d.drain_timeout_secs), "on SIGTERM, how long requests under way (streams included) may take to finish before their connections are closed [0, 3600]")
    ("router-fallback", po::value<std::string>()->default_value("least-loaded"), "while no router answers: least-loaded (each request, unrendered, to the engine serving its model with the fewest of this gateway's requests in flight) or none (503 no_workers)");
  // clang-format on
  AddNatsSecurityFlags(desc);
  return desc;
}

Status ReadGatewayConfig(const po::variables_map& vm, GatewayConfig& c) {
  c.http_port = vm["http-port"].as<std::uint32_t>();
  if (c.http_port > 65535) return FlagOutOfRange("http-port", "in [0, 65535]");
  c.http_host = vm["http-host"].as<std::string>();
  c.nats_server = vm["nats-server"].as<std::string>();
  c.nats_security = ReadNatsSecurity(vm);
  c.ns = vm["namespace"].as<std::string>();
  c.component = vm["component"].as<std::string>();
  if (c.ns.empty()) return FlagOutOfRange("namespace", "non-empty");
  if (c.component.empty()) return FlagOutOfRange("component", "non-empty");
  c.metrics_port = vm["metrics-port"].as<std::uint32_t>();
  if (c.metrics_port > 65535) return FlagOutOfRange("metrics-port", "in [0, 65535]");
  c.metrics_host = vm["metrics-host"].as<std::string>();
  c.render_url = vm["render-url"].as<std::string>();
  while (c.render_url.ends_with('/')) c.render_url.pop_back();
  if (!c.render_url.empty() && !ParseHttpUrl(c.render_url).ok()) {
    return FlagOutOfRange("render-url", "an http://host[:port] base URL without a path");
  }
  c.retries = vm["retries"].as<std::uint32_t>();
  if (c.retries > 16) return FlagOutOfRange("retries", "in [0, 16]");
  c.max_body_bytes = vm["max-body-bytes"].as<std::uint64_t>();
  if (c.max_body_bytes < 1) return FlagOutOfRange("max-body-bytes", ">= 1");
  c.route_timeout_ms = vm["route-timeout-ms"].as<std::uint32_t>();
  if (c.route_timeout_ms < 1) return FlagOutOfRange("route-timeout-ms", ">= 1");
  c.engine_timeout_ms = vm["engine-timeout-ms"].as<std::uint32_t>();
  if (c.engine_timeout_ms < 1) return FlagOutOfRange("engine-timeout-ms", ">= 1");
  c.engine_connect_timeout_ms = vm["engine-connect-timeout-ms"].as<std::uint32_t>();
  if (c.engine_connect_timeout_ms < 1) return FlagOutOfRange("engine-connect-timeout-ms", ">= 1");
  c.render_timeout_ms = vm["render-timeout-ms"].as<std::uint32_t>();
  if (c.render_timeout_ms < 1) return FlagOutOfRange("render-timeout-ms", ">= 1");
  c.engine_idle_timeout_ms = vm["engine-idle-timeout-ms"].as<std::uint32_t>();
  if (c.engine_idle_timeout_ms < 1) return FlagOutOfRange("engine-idle-timeout-ms", ">= 1");
  c.io_threads = vm["io-threads"].as<std::uint32_t>();
  if (c.io_threads < 1 || c.io_threads > 64) return FlagOutOfRange("io-threads", "in [1, 64]");
  c.max_connections = vm["max-connections"].as<std::uint32_t>();
  if (c.max_connections < 1) return FlagOutOfRange("max-connections", ">= 1");
  c.drain_timeout_secs = vm["drain-timeout-secs"].as<std::uint32_t>();
  if (c.drain_timeout_secs > 3600) return FlagOutOfRange("drain-timeout-secs", "in [0, 3600]");
  const auto fallback = vm["router-fallback"].as<std::string>();
  if (fallback == "least-loaded") {
    c.router_fallback = RouterFallback::kLeastLoaded;
  } else if (fallback == "none") {
    c.router_fallback = RouterFallback::kNone;
  } else {
    return FlagOutOfRange("router-fallback", "least-loaded or none");
  }
  return Status::Ok();
}

}  // namespace

Result<ParsedGatewayArgs> ParseGatewayConfig(int argc, const char* const* argv, const EnvLookup& env) {
  return ParseProgram<GatewayConfig>(Describe(), argc, argv, env, {}, ReadGatewayConfig);
}

}  // namespace kvrouter
