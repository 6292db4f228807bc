#include "router/kvtop/config.h"

#include <boost/program_options.hpp>

namespace kvrouter::top {
namespace po = boost::program_options;

namespace {

po::options_description Describe() {
  const KvtopConfig d;
  po::options_description desc(
      "kvtop options (each also read from DYN_<FLAG> in the environment, NATS_SERVER for --nats-server)");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("nats-server", po::value<std::string>()->default_value(d.nats_server), "NATS server URL")
    ("namespace", po::value<std::string>()->default_value(d.ns), "the router's namespace")
    ("interval-ms", po::value<std::uint32_t>()->default_value(d.interval_ms), "time between two readings of the router's stats [100, 60000]")
    ("sort", po::value<std::string>()->default_value(std::string(SortKeyName(d.sort))), "worker rows by load (active requests, then blocks), cache (blocks held) or rate (decisions/s); keys l, c, r on screen")
    ("once", po::bool_switch(), "read the stats twice, --interval-ms apart, print the view as plain text and exit");
  // clang-format on
  AddNatsSecurityFlags(desc);
  return desc;
}

Status ReadKvtopConfig(const po::variables_map& vm, KvtopConfig& c) {
  c.nats_server = vm["nats-server"].as<std::string>();
  c.nats_security = ReadNatsSecurity(vm);
  c.ns = vm["namespace"].as<std::string>();
  if (c.ns.empty()) return FlagOutOfRange("namespace", "non-empty");
  c.interval_ms = vm["interval-ms"].as<std::uint32_t>();
  if (c.interval_ms < 100 || c.interval_ms > 60000) return FlagOutOfRange("interval-ms", "in [100, 60000]");
  const auto sort = SortKeyFromName(vm["sort"].as<std::string>());
  if (!sort) return FlagOutOfRange("sort", "load, cache or rate");
  c.sort = *sort;
  c.once = vm["once"].as<bool>();
  return Status::Ok();
}

}  // namespace

Result<ParsedKvtopArgs> ParseKvtopConfig(int argc, const char* const* argv, const EnvLookup& env) {
  return ParseProgram<KvtopConfig>(Describe(), argc, argv, env, {}, ReadKvtopConfig);
}

}  // namespace kvrouter::top
