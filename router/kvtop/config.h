// kvtop's flags (docs/operations.md "kvtop"; each also from DYN_<FLAG>, NATS_SERVER for
// --nats-server), parsed once into KvtopConfig:
//   kvtop [--nats-server URL] [--namespace dynamo] [--interval-ms 1000] [--sort load|cache|rate]
//         [--once] [--nats-creds ... --nats-tls-*]
// Plain value; ParseKvtopConfig is thread-safe (reads the environment through a callback).
//
//   auto parsed = ParseKvtopConfig(argc, argv, getenv);  if (!parsed.ok()) { print; exit(2); }
#pragma once

#include <cstdint>
#include <string>

#include "router/common/flags.h"
#include "router/kvtop/fleet_view.h"

namespace kvrouter::top {

struct KvtopConfig {
  std::string nats_server = "nats://127.0.0.1:4222";  // --nats-server / NATS_SERVER
  NatsSecurity nats_security;                         // --nats-creds, --nats-user, ... --nats-tls-*
  std::string ns = "dynamo";                          // --namespace
  std::uint32_t interval_ms = 1000;                   // --interval-ms [100, 60000]: between samples
  SortKey sort = SortKey::kLoad;                      // --sort
  bool once = false;                                  // --once: two samples, the view as text, exit
};

using ParsedKvtopArgs = ProgramArgs<KvtopConfig>;
Result<ParsedKvtopArgs> ParseKvtopConfig(int argc, const char* const* argv, const EnvLookup& env);

}  // namespace kvrouter::top
