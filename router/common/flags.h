// Flag helpers shared by kvrouter's and kvmocker's configuration parsers: the environment
// fallback every flag has (DYN_<FLAG_IN_UPPER_SNAKE_CASE>, NATS_SERVER for --nats-server) and
// the refusal message for out-of-range values. Thread-safe (pure; the environment is read
// through the caller's lookup).
//
//   auto flags = ParseFlags(desc, argc, argv, env);  if (!flags.ok()) return flags.status();
//   if (flags->help) { print flags->help_text; }  else read flags->vm
#pragma once

#include <boost/program_options.hpp>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "events/base/status.h"
#include "events/registration_codec.h"
#include "transport/nats_security.h"

namespace kvrouter {

using EnvLookup = std::function<const char*(const char*)>;

// DYN_ + upper snake case of the flag; NATS_SERVER for nats-server.
std::string EnvNameForFlag(std::string_view flag);
// --nats-creds, --nats-user, --nats-password, --nats-token, --nats-nkey-seed, --nats-tls-ca,
// --nats-tls-cert, --nats-tls-key (environment: NATS_CREDS, NATS_USER, ...), for every program.
void AddNatsSecurityFlags(boost::program_options::options_description& desc);
NatsSecurity ReadNatsSecurity(const boost::program_options::variables_map& vm);
// --role (both | prefill | decode) and --kv-connector (nixl | sglang), a worker's part in a
// disaggregated fleet (protocol.md section 13), for the programs that announce workers
// (kvmocker, kvrelay). Another value is an InvalidArgument naming the flag and the choices.
void AddWorkerRoleFlags(boost::program_options::options_description& desc, std::string_view what);
Status ReadWorkerRoleFlags(const boost::program_options::variables_map& vm, WorkerRole& role,
                           KvConnector& connector);

// InvalidArgument "--flag must be <range>".
Status FlagOutOfRange(std::string_view flag, std::string_view range);
// "1/true/yes/on" or "0/false/no/off" (any case); nullopt otherwise.
std::optional<bool> ParseBoolValue(std::string value);

// The value of a flag that takes one number or a comma-separated list of them ("8,8,2,2"),
// declared as po::value<NumberList>(). Every item must be a whole number (spaces around it are
// allowed); an empty item or anything else is refused while parsing, like any unparsable value,
// naming the flag (or its variable). Ranges and the length are the reading program's to check.
struct NumberList {
  std::vector<double> values;
};
// Boost.Program_options' conversion of a NumberList value (found by argument-dependent lookup).
void validate(boost::any& out, const std::vector<std::string>& tokens, NumberList*, int);
// The list as a flag would give it: "8,8,2,2".
std::string FormatNumberList(const std::vector<double>& values);

// How one flag reads the environment when the default is not right: its variable, and the
// command-line argument a value turns into (nullopt = none; an error names the variable).
struct EnvRule {
  std::string variable;
  std::function<Result<std::optional<std::string>>(std::string_view value)> to_argument;
};

// For every flag of `desc` not given on the command line (absent or defaulted in `vm`), reads
// its variable and stores the value into `vm` as if it had been given. Switches take a boolean
// ("--flag" when true); `rules` override the variable and translation per flag. Errors name
// the variable. Call before po::notify.
Status FillFromEnvironment(const boost::program_options::options_description& desc,
                           boost::program_options::variables_map& vm, const EnvLookup& env,
                           const std::map<std::string, EnvRule>& rules = {});

struct ParsedFlags {
  boost::program_options::variables_map vm;
  bool help = false;      // --help was given
  std::string help_text;  // every flag with its default
};

// The whole parse: the command line, then FillFromEnvironment, then po::notify. Unknown flags
// and unparsable values are InvalidArgument naming the flag (or the variable).
Result<ParsedFlags> ParseFlags(const boost::program_options::options_description& desc, int argc,
                               const char* const* argv, const EnvLookup& env,
                               const std::map<std::string, EnvRule>& rules = {});

// What a program's flag parser returns: its typed config, or --help's text.
template <typename Config>
struct ProgramArgs {
  Config config;
  bool help = false;      // --help was given: print help_text and exit 0
  std::string help_text;  // every flag with its default
};

// ParseFlags, then (unless --help was given) `read(vm, config)`, which validates and returns
// InvalidArgument naming the flag for a bad value.
template <typename Config, typename Read>
Result<ProgramArgs<Config>> ParseProgram(const boost::program_options::options_description& desc, int argc,
                                         const char* const* argv, const EnvLookup& env,
                                         const std::map<std::string, EnvRule>& rules, Read&& read) {
  auto flags = ParseFlags(desc, argc, argv, env, rules);
  if (!flags.ok()) return flags.status();
  ProgramArgs<Config> out;
  if (flags->help) {
    out.help = true;
    out.help_text = flags->help_text;
    return out;
  }
  if (Status s = read(flags->vm, out.config); !s.ok()) return s;
  return out;
}

}  // namespace kvrouter
