#include "router/common/flags.h"

#include <fmt/format.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <sstream>
#include <vector>

namespace kvrouter {
namespace po = boost::program_options;

std::string EnvNameForFlag(std::string_view flag) {
  if (flag.starts_with("nats-")) {  // NATS_SERVER, NATS_CREDS, NATS_TLS_CA, ...
    std::string out = "NATS_";
    for (char c : flag.substr(5))
      out += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return out;
  }
  std::string out = "DYN_";
  for (char c : flag) out += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

void AddNatsSecurityFlags(boost::program_options::options_description& desc) {
  namespace po = boost::program_options;
  // clang-format off
  desc.add_options()
    ("nats-creds", po::value<std::string>()->default_value(""), "NATS credentials file (JWT and nkey seed)")
    ("nats-user", po::value<std::string>()->default_value(""), "NATS user (or nats://user:password@host in the URL)")
    ("nats-password", po::value<std::string>()->default_value(""), "NATS password of --nats-user")
    ("nats-token", po::value<std::string>()->default_value(""), "NATS authentication token")
    ("nats-nkey-seed", po::value<std::string>()->default_value(""), "file with an nkey seed and its public key (nk -gen user -pubout)")
    ("nats-tls-ca", po::value<std::string>()->default_value(""), "CA certificates to verify the NATS server (turns TLS on)")
    ("nats-tls-cert", po::value<std::string>()->default_value(""), "client certificate for mutual TLS (with --nats-tls-key)")
    ("nats-tls-key", po::value<std::string>()->default_value(""), "client key for mutual TLS");
  // clang-format on
}

NatsSecurity ReadNatsSecurity(const boost::program_options::variables_map& vm) {
  auto get = [&](const char* flag) { return vm.count(flag) ? vm[flag].as<std::string>() : std::string(); };
  return {.creds_file = get("nats-creds"),
          .user = get("nats-user"),
          .password = get("nats-password"),
          .token = get("nats-token"),
          .nkey_seed_file = get("nats-nkey-seed"),
          .tls_ca = get("nats-tls-ca"),
          .tls_cert = get("nats-tls-cert"),
          .tls_key = get("nats-tls-key")};
}

namespace {

// The value of `flag` among `choices` (spelled by `name_of`), else an error listing them.
template <typename Enum, std::size_t N>
Result<Enum> OneOf(const boost::program_options::variables_map& vm, const char* flag, const Enum (&choices)[N],
                   std::string_view (*name_of)(Enum)) {
  const std::string value = vm[flag].as<std::string>();
  std::string names;
  for (const Enum e : choices) {
    if (value == name_of(e)) return e;
    names += names.empty() ? std::string(name_of(e)) : fmt::format(" | {}", name_of(e));
  }
  return FlagOutOfRange(flag, names);
}

}  // namespace

void AddWorkerRoleFlags(boost::program_options::options_description& desc, std::string_view what) {
  namespace po = boost::program_options;
  desc.add_options()(
      "role", po::value<std::string>()->default_value(std::string(WorkerRoleName(WorkerRole::kBoth))),
      fmt::format("both | prefill | decode: the legs {} serves, announced to the router", what).c_str())(
      "kv-connector", po::value<std::string>()->default_value(std::string(KvConnectorName(KvConnector::kNixl))),
      "nixl | sglang: how KV moves from prefill to decode engines, announced to the router");
}

Status ReadWorkerRoleFlags(const boost::program_options::variables_map& vm, WorkerRole& role, KvConnector& connector) {
  constexpr WorkerRole kRoles[] = {WorkerRole::kBoth, WorkerRole::kPrefill, WorkerRole::kDecode};
  constexpr KvConnector kConnectors[] = {KvConnector::kNixl, KvConnector::kSglang};
  auto r = OneOf(vm, "role", kRoles, WorkerRoleName);
  if (!r.ok()) return r.status();
  auto c = OneOf(vm, "kv-connector", kConnectors, KvConnectorName);
  if (!c.ok()) return c.status();
  role = *r;
  connector = *c;
  return Status::Ok();
}

Status FlagOutOfRange(std::string_view flag, std::string_view range) {
  return InvalidArgument(fmt::format("--{} must be {}", flag, range));
}

std::optional<bool> ParseBoolValue(std::string v) {
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  return std::nullopt;
}

void validate(boost::any& out, const std::vector<std::string>& tokens, NumberList*, int) {
  po::validators::check_first_occurrence(out);
  const std::string& token = po::validators::get_single_string(tokens);
  NumberList list;
  std::string_view rest = token;
  for (;;) {
    const std::size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.remove_suffix(1);
    double v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size()) {
      po::error_with_option_name e(
          "the argument ('%value%') for option '%canonical_option%' is invalid: expected a number or numbers separated "
          "by commas");
      e.set_substitute("value", token);
      throw e;
    }
    list.values.push_back(v);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  out = std::move(list);
}

std::string FormatNumberList(const std::vector<double>& values) { return fmt::format("{}", fmt::join(values, ",")); }

namespace {

// Boost converts "-1" to an unsigned type by wrapping it (4294967295); refuse it instead.
bool IsUnsigned(const po::option_description& d) {
  const po::value_semantic* v = d.semantic().get();
  return dynamic_cast<const po::typed_value<std::uint32_t>*>(v) != nullptr ||
         dynamic_cast<const po::typed_value<std::uint64_t>*>(v) != nullptr;
}

Status RefuseNegativeUnsigned(const po::options_description& desc, const po::parsed_options& parsed,
                              std::string_view source) {
  for (const po::option& o : parsed.options) {
    const po::option_description* d = desc.find_nothrow(o.string_key, false);
    if (d == nullptr || !IsUnsigned(*d)) continue;
    for (const std::string& v : o.value) {
      if (v.find('-') != std::string::npos) {
        return InvalidArgument(fmt::format("{}--{} must be a non-negative integer, not '{}'", source, o.string_key, v));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status FillFromEnvironment(const po::options_description& desc, po::variables_map& vm, const EnvLookup& env,
                           const std::map<std::string, EnvRule>& rules) {
  for (const auto& opt : desc.options()) {
    const std::string& name = opt->long_name();
    if (name == "help") continue;
    if (vm.count(name) && !vm[name].defaulted()) continue;  // given on the command line
    auto rule = rules.find(name);
    const std::string var = rule != rules.end() ? rule->second.variable : EnvNameForFlag(name);
    if (var.empty()) continue;
    const char* raw = env(var.c_str());
    if (raw == nullptr || *raw == '\0') continue;
    std::optional<std::string> arg;
    if (rule != rules.end()) {
      auto a = rule->second.to_argument(raw);
      if (!a.ok()) return InvalidArgument(fmt::format("{}={}: {}", var, raw, a.status().message()));
      arg = *a;
    } else if (opt->semantic()->max_tokens() == 0) {  // a switch
      auto b = ParseBoolValue(raw);
      if (!b) return InvalidArgument(fmt::format("{}={} must be true or false", var, raw));
      if (*b) arg = "--" + name;
    } else {
      arg = fmt::format("--{}={}", name, raw);
    }
    if (!arg) continue;
    // The flag the argument sets (a rule may set another one, e.g. --no-x for x=false).
    const std::string target =
        arg->substr(2, arg->find('=') == std::string::npos ? std::string::npos : arg->find('=') - 2);
    if (vm.count(target) && !vm[target].defaulted()) continue;  // the command line wins
    const char* eargv[] = {"env", arg->c_str()};
    po::variables_map env_vm;
    try {
      const po::parsed_options parsed = po::command_line_parser(2, eargv).options(desc).run();
      if (Status s = RefuseNegativeUnsigned(desc, parsed, fmt::format("{}={}: ", var, raw)); !s.ok()) return s;
      po::store(parsed, env_vm);
    } catch (const po::error& e) {
      return InvalidArgument(fmt::format("{}={}: {}", var, raw, e.what()));
    }
    vm.erase(target);
    vm.insert({target, env_vm[target]});
  }
  return Status::Ok();
}

Result<ParsedFlags> ParseFlags(const po::options_description& desc, int argc, const char* const* argv,
                               const EnvLookup& env, const std::map<std::string, EnvRule>& rules) {
  ParsedFlags out;
  try {
    const po::parsed_options parsed = po::command_line_parser(argc, argv).options(desc).run();
    if (Status s = RefuseNegativeUnsigned(desc, parsed, ""); !s.ok()) return s;
    po::store(parsed, out.vm);
    if (Status s = FillFromEnvironment(desc, out.vm, env, rules); !s.ok()) return s;
    po::notify(out.vm);
  } catch (const po::error& e) {
    return InvalidArgument(e.what());
  }
  if (out.vm.count("help")) {
    std::ostringstream ss;
    ss << desc;
    out.help = true;
    out.help_text = ss.str();
  }
  return out;
}

}  // namespace kvrouter
