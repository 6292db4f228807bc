// The monitoring files of deploy/ against the programs that feed them: every metric that a panel
// of deploy/grafana/kvrouter.json or a rule of deploy/prometheus/kvrouter-rules.yml queries is
// exported by a running program (nats-server, kvrouter, kvgateway, a prefill and a decode
// kvmocker with HTTP faces, kvrelay), scraped after one request took both P/D legs; the dashboard
// reads every panel through its ${datasource} variable; and Debian's promtool, when installed,
// accepts the configs and passes the rules' unit tests (skipped, loudly, when it is not).
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>

#include <cctype>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "tests/integration/gateway_fixture.h"

namespace kvrouter::testing {
namespace {

const std::string kDeploy = KVROUTER_DEPLOY_DIR;
const std::string kDashboard = kDeploy + "/grafana/kvrouter.json";
const std::string kRules = kDeploy + "/prometheus/kvrouter-rules.yml";

// Series Prometheus makes itself for every target: a rule may query them, no program exports them.
const std::set<std::string> kPrometheusOwnSeries = {"up"};

// One PromQL expression of the deploy files and where it stands.
struct Query {
  std::string where;  // "dashboard panel 'Title'" or "rule KvrouterNoWorkers"
  std::string expr;
};

bool IsNameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':'; }
bool IsNameChar(char c) { return IsNameStart(c) || std::isdigit(static_cast<unsigned char>(c)); }

// The metric names a PromQL expression selects: every bare identifier that is not a function or
// aggregation (followed by '('), not a keyword or modifier, and not a label name (inside {...} or
// the label list of by / without / on / ignoring / group_left / group_right). Strings, ranges
// ([5m], [$__rate_interval]), numbers, durations and Grafana variables ($x, ${x}) are skipped. A
// histogram's series are queried by their sample names (x_bucket, x_sum, x_count), which is what
// /metrics exports, so names are kept whole. Returns an error for an unbalanced expression.
Result<std::set<std::string>> PromqlMetricNames(std::string_view e) {
  static const std::set<std::string, std::less<>> kKeywords = {
      "and",      "or",         "unless",      "bool",  "offset", "by",  "without", "on",
      "ignoring", "group_left", "group_right", "start", "end",    "inf", "nan",     "atan2"};
  static const std::set<std::string, std::less<>> kLabelLists = {"by",       "without",    "on",
                                                                 "ignoring", "group_left", "group_right"};
  std::set<std::string> names;
  const auto skip_string = [&](std::size_t i) {  // i at a quote -> index after the closing quote
    const char q = e[i++];
    while (i < e.size() && e[i] != q) i += (e[i] == '\\' && q != '`') ? 2 : 1;
    return i + 1;
  };
  const auto skip_until = [&](std::size_t i, char close) -> std::size_t {  // past `close`, npos if none
    for (; i < e.size(); ++i) {
      if (e[i] == '"' || e[i] == '\'' || e[i] == '`') {
        i = skip_string(i) - 1;
      } else if (e[i] == close) {
        return i + 1;
      }
    }
    return std::string_view::npos;
  };
  const auto word_at = [&](std::size_t i) {  // the identifier starting at i ("" if none)
    std::size_t end = i;
    if (end < e.size() && IsNameStart(e[end])) {
      while (end < e.size() && IsNameChar(e[end])) ++end;
    }
    return e.substr(i, end - i);
  };
  std::size_t i = 0;
  int depth = 0;  // open parentheses
  while (i < e.size()) {
    const char c = e[i];
    if (c == '(' || c == ')') {
      depth += c == '(' ? 1 : -1;
      if (depth < 0) return InvalidArgument(fmt::format("unbalanced ')' in {}", e));
      ++i;
    } else if (c == '"' || c == '\'' || c == '`') {
      i = skip_string(i);
    } else if (c == '{' || c == '[') {
      i = skip_until(i + 1, c == '{' ? '}' : ']');
      if (i == std::string_view::npos) return InvalidArgument(fmt::format("unbalanced '{}' in {}", c, e));
    } else if (c == '$') {  // a Grafana variable: $name or ${name}
      ++i;
      if (i < e.size() && e[i] == '{') {
        i = skip_until(i, '}');
        if (i == std::string_view::npos) return InvalidArgument(fmt::format("unbalanced '${{' in {}", e));
      } else {
        while (i < e.size() && IsNameChar(e[i])) ++i;
      }
    } else if (std::isdigit(static_cast<unsigned char>(c)) ||
               (c == '.' && i + 1 < e.size() && std::isdigit(static_cast<unsigned char>(e[i + 1])))) {
      while (i < e.size() && (IsNameChar(e[i]) || e[i] == '.')) ++i;  // 0.99, 1e3, 5m, 1h30m
    } else if (IsNameStart(c)) {
      const std::size_t start = i;
      while (i < e.size() && IsNameChar(e[i])) ++i;
      const std::string word(e.substr(start, i - start));
      std::size_t next = i;
      while (next < e.size() && std::isspace(static_cast<unsigned char>(e[next]))) ++next;
      const bool call = next < e.size() && e[next] == '(';
      // An aggregation with its grouping first: `sum by (le) (...)`, `count without (a) (...)`.
      const std::string_view after = word_at(next);
      const bool grouped = !kKeywords.contains(word) && (after == "by" || after == "without");
      if (call && kLabelLists.contains(word)) {
        i = skip_until(next + 1, ')');
        if (i == std::string_view::npos || e.substr(next + 1, i - next - 2).find('(') != std::string_view::npos) {
          return InvalidArgument(fmt::format("unbalanced '{}(' in {}", word, e));
        }
      } else if (!call && !grouped && !kKeywords.contains(word)) {
        names.insert(word);
      }
    } else {
      ++i;
    }
  }
  if (depth != 0) return InvalidArgument(fmt::format("unbalanced '(' in {}", e));
  return names;
}

// Every query of a Grafana dashboard: the targets of every panel, rows' panels included.
void CollectDashboardQueries(const json& panels, std::vector<Query>& out) {
  if (!panels.is_array()) return;
  for (const json& p : panels) {
    const std::string title = p.value("title", std::string("(untitled)"));
    if (p.contains("targets")) {
      for (const json& t : p["targets"]) {
        out.push_back({fmt::format("dashboard panel '{}' target {}", title, t.value("refId", "?")),
                       t.value("expr", std::string())});
      }
    }
    if (p.contains("panels")) CollectDashboardQueries(p["panels"], out);
  }
}

json ReadJson(const std::string& path) { return json::parse(ReadFile(path), nullptr, /*allow_exceptions=*/false); }

std::size_t Indent(const std::string& line) { return line.find_first_not_of(' '); }

// The `expr:` of every rule in a Prometheus rules file, with the alert (or record) it belongs
// to. Reads the YAML the rules file uses: `expr:` with a plain value on its line, or a block
// scalar (`>-`, `|`) on the more indented lines below it.
std::vector<Query> RuleExpressions(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  std::vector<Query> out;
  std::string rule = "(unnamed)";
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    const std::size_t at = Indent(l);
    if (at == std::string::npos) continue;
    std::string_view body = std::string_view(l).substr(at);
    if (body.starts_with("- ")) body.remove_prefix(2);
    for (const char* key : {"alert: ", "record: "}) {
      if (body.starts_with(key)) rule = std::string(body.substr(std::string_view(key).size()));
    }
    if (!body.starts_with("expr:")) continue;
    std::string value(body.substr(5));
    value.erase(0, value.find_first_not_of(' '));
    if (value.empty() || value[0] == '>' || value[0] == '|') {
      value.clear();
      for (; i + 1 < lines.size(); ++i) {
        const std::size_t next = Indent(lines[i + 1]);
        if (next != std::string::npos && next <= at) break;
        value += lines[i + 1] + " ";
      }
    }
    out.push_back({"rule " + rule, value});
  }
  return out;
}

// The sample names of a /metrics page (Prometheus text format): a histogram's x_bucket, x_sum
// and x_count, every other family's own name.
std::set<std::string> ExportedNames(const std::string& page) {
  std::set<std::string> names;
  std::istringstream in(page);
  for (std::string l; std::getline(in, l);) {
    if (l.empty() || l[0] == '#') continue;
    names.insert(l.substr(0, l.find_first_of("{ ")));
  }
  return names;
}

TEST(PromqlMetricNames, KeepsMetricsAndSkipsFunctionsLabelsKeywordsStringsAndDurations) {
  auto names = PromqlMetricNames(
      R"(histogram_quantile(0.99, sum by (le, endpoint) (rate(kvrouter_route_duration_seconds_bucket{endpoint=~"route|x{1}"}[$__rate_interval])))
         / on (job, instance) group_left (mode) kvrouter_info offset 5m > bool 1e3
         or sum(rate(foo:recorded[1h30m])) without (status) unless absent(bar_total{a='b)'}) and ${var} * inf)");
  ASSERT_TRUE(names.ok()) << names.status().ToString();
  EXPECT_EQ(*names, (std::set<std::string>{"kvrouter_route_duration_seconds_bucket", "kvrouter_info", "foo:recorded",
                                           "bar_total"}));
  auto agg = PromqlMetricNames("sum(rate(a_total[5m])) by (code) / ignoring(code) group_right b");
  ASSERT_TRUE(agg.ok());
  EXPECT_EQ(*agg, (std::set<std::string>{"a_total", "b"}));
  EXPECT_FALSE(PromqlMetricNames("rate(a_total{code=\"5\"[5m])").ok());
  EXPECT_FALSE(PromqlMetricNames("sum by (le (rate(a[5m]))").ok());
  EXPECT_FALSE(PromqlMetricNames("sum(rate(a[5m])").ok());
  EXPECT_FALSE(PromqlMetricNames("sum(rate(a[5m])))").ok());
}

TEST(RuleExpressions, ReadsPlainAndBlockExpressionsWithTheirAlert) {
  const std::string rules =
      "groups:\n"
      "  - name: g\n"
      "    rules:\n"
      "      - alert: One\n"
      "        expr: a_total > 0\n"
      "        for: 1m\n"
      "      - alert: Two\n"
      "        expr: >-\n"
      "          sum(b)\n"
      "            / sum(c) > 0.05\n"
      "        labels:\n"
      "          severity: critical\n";
  auto q = RuleExpressions(rules);
  ASSERT_EQ(q.size(), 2u);
  EXPECT_EQ(q[0].where, "rule One");
  EXPECT_EQ(q[0].expr, "a_total > 0");
  EXPECT_EQ(q[1].where, "rule Two");
  auto names = PromqlMetricNames(q[1].expr);
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::set<std::string>{"b", "c"}));
}

// A histogram is queried by its samples' names: x_bucket, x_sum, x_count exist, x alone does not;
// a counter that happens to end in _count keeps its name.
TEST(ExportedNames, AreTheSampleNamesOfAPage) {
  const std::string page =
      "# HELP h_seconds a histogram\n"
      "# TYPE h_seconds histogram\n"
      "h_seconds_bucket{le=\"0.1\"} 1\n"
      "h_seconds_bucket{le=\"+Inf\"} 2\n"
      "h_seconds_sum 0.3\n"
      "h_seconds_count 2\n"
      "# TYPE retries_count counter\n"
      "retries_count 4\n"
      "# TYPE empty_family_total counter\n"
      "g{worker_id=\"1\",dp_rank=\"0\"} 7\n";
  EXPECT_EQ(ExportedNames(page),
            (std::set<std::string>{"h_seconds_bucket", "h_seconds_sum", "h_seconds_count", "retries_count", "g"}));
}

// Grafana's import asks for a Prometheus data source and every panel reads it.
TEST(DeployFiles, DashboardReadsEveryPanelThroughItsDatasourceVariable) {
  const json d = ReadJson(kDashboard);
  ASSERT_TRUE(d.is_object()) << kDashboard << " is not JSON";
  EXPECT_GE(d.value("schemaVersion", 0), 39);
  bool variable = false;
  for (const json& v : d["templating"]["list"]) {
    if (v.value("name", "") == "datasource") {
      variable = v.value("type", "") == "datasource" && v.value("query", "") == "prometheus";
    }
  }
  EXPECT_TRUE(variable) << "no template variable `datasource` of type datasource, query prometheus";
  std::set<int> ids;
  std::set<std::string> rows;
  std::function<void(const json&)> check = [&](const json& panels) {
    for (const json& p : panels) {
      const std::string title = p.value("title", "");
      EXPECT_TRUE(ids.insert(p.value("id", -1)).second) << "panel '" << title << "' repeats id " << p.value("id", -1);
      EXPECT_EQ(p["datasource"].value("uid", ""), "${datasource}") << "panel '" << title << "'";
      if (p.value("type", "") == "row") {
        rows.insert(title);
        check(p["panels"]);
        continue;
      }
      ASSERT_TRUE(p.contains("targets") && !p["targets"].empty()) << "panel '" << title << "' queries nothing";
      for (const json& t : p["targets"]) {
        EXPECT_EQ(t["datasource"].value("uid", ""), "${datasource}") << "panel '" << title << "'";
        EXPECT_FALSE(t.value("expr", "").empty()) << "panel '" << title << "'";
      }
    }
  };
  check(d["panels"]);
  EXPECT_EQ(rows, (std::set<std::string>{"Router", "Per worker", "Events", "Gateway", "Disaggregated"}));
}

// promtool runs `args`; its output is on the failure message.
void ExpectPromtoolAccepts(const std::string& promtool, std::vector<std::string> args, const std::string& log) {
  std::vector<std::string> argv = {promtool};
  argv.insert(argv.end(), args.begin(), args.end());
  auto p = ChildProcess::Start(argv, log);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return !(*p)->Running(); }, std::chrono::seconds(60))) << ReadFile(log);
  const int st = (*p)->exit_status();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0)
      << fmt::format("promtool {}:\n", fmt::join(args, " ")) << ReadFile(log);
}

TEST(DeployFiles, PromtoolAcceptsTheConfigsAndTheRulesFire) {
  const std::string promtool = FindExecutable("promtool", {});
  if (promtool.empty()) {
    GTEST_SKIP() << "\n!!!!!!!! promtool not found: deploy/prometheus was NOT checked by promtool "
                    "(apt-get install prometheus; scripts/compose-check.sh checks it in its image) !!!!!!!!";
  }
  const std::string log = ::testing::TempDir() + "promtool.log";
  for (const char* config : {"prometheus.yml", "compose.yml"}) {
    ExpectPromtoolAccepts(promtool, {"check", "config", kDeploy + "/prometheus/" + config}, log);
  }
  ExpectPromtoolAccepts(promtool, {"check", "rules", kRules}, log);
  ExpectPromtoolAccepts(promtool, {"test", "rules", kDeploy + "/prometheus/kvrouter-rules.test.yml"}, log);
}

// The whole fleet the files watch: kvrouter deciding P/D, kvgateway, a prefill and a decode
// kvmocker, and kvrelay (its engine absent: its counters are exported all the same).
class DeployTest : public GatewayTest {
 protected:
  std::vector<std::string> ExtraArgs() const override { return {"--router-disagg-policy", "always"}; }
  Metrics RouterMetrics() const override { return Metrics::kOnFreePort; }
  void TearDown() override {
    // Each program takes a moment to leave (a kvmocker says goodbye to the router): all are told
    // at once, then each is reaped.
    for (auto& p : programs_) {
      if (p->Running()) ::kill(p->pid(), SIGTERM);
    }
    programs_.clear();
    GatewayTest::TearDown();
  }

  // Starts `program` with /metrics on a free port; returns that port (0 on failure).
  int Start(const std::string& program, const std::string& name, std::vector<std::string> args) {
    auto p = StartOnNats(program, nats_->url(), std::move(args), LogPath(name), Metrics::kOnFreePort);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return 0;
    programs_.push_back(std::move(p->process));
    scrapes_[name] = p->metrics_port;
    return p->metrics_port;
  }
  void StartMocker(const std::string& role, std::uint64_t id, std::vector<std::string> extra = {}) {
    auto port = PickFreePortRun(1);
    ASSERT_TRUE(port.ok());
    std::vector<std::string> args = {"--num-workers",    "1",
                                     "--worker-id-base", std::to_string(id),
                                     "--block-size",     std::to_string(kBs),
                                     "--speedup-ratio",  "100",
                                     "--http-port",      std::to_string(*port),
                                     "--http-host",      "127.0.0.1",
                                     "--model",          "mock",
                                     "--role",           role,
                                     "--kv-connector",   "nixl"};
    args.insert(args.end(), extra.begin(), extra.end());
    Start(KVMOCKER_BIN, "kvmocker-" + role, std::move(args));
  }
  Result<std::string> Scrape(int port) {
    auto r = client_->Fetch({.host = "127.0.0.1", .port = static_cast<std::uint16_t>(port)},
                            {.method = "GET", .target = "/metrics"});
    if (!r.ok()) return r.status();
    if (r->status != 200) return Internal(fmt::format("/metrics answered {}", r->status));
    return std::move(r->body);
  }

  std::vector<std::unique_ptr<ChildProcess>> programs_;
  std::map<std::string, int> scrapes_;  // program name -> its /metrics port
};

TEST_F(DeployTest, EveryMetricTheDashboardAndTheRulesQueryIsExportedByARunningProgram) {
  // The prefill engine's lease on pulled blocks outlasts the test: only the pull's end unpins.
  StartMocker("prefill", 1, {"--kv-lease-ms", "60000000"});
  StartMocker("decode", 2);
  auto relay_zmq = PickFreePort();
  auto relay_engine = PickFreePort();  // nothing listens: kvrelay_engine_up reads 0
  ASSERT_TRUE(relay_zmq.ok() && relay_engine.ok());
  Start(KVRELAY_BIN, "kvrelay",
        {"--zmq-endpoint", fmt::format("tcp://127.0.0.1:{}", *relay_zmq), "--worker-id", "99", "--block-size",
         std::to_string(kBs), "--engine-url", fmt::format("http://127.0.0.1:{}", *relay_engine), "--model", "relay"});
  scrapes_["kvrouter"] = metrics_port_;
  scrapes_["kvgateway"] = metrics_endpoint_.port;  // its --metrics-port: /metrics is only there
  ASSERT_TRUE(AwaitReady(2)) << ReadFile(LogPath("kvmocker-prefill")) << ReadFile(LogPath("kvmocker-decode"));

  // One request through both legs: the gateway's P/D series exist once a request took a path.
  const std::string prompt(200, 'p');
  auto answer =
      Post(json{{"model", "mock"}, {"max_tokens", 4}, {"messages", {{{"role", "user"}, {"content", prompt}}}}}.dump());
  ASSERT_TRUE(answer.ok()) << answer.status().ToString();
  ASSERT_EQ(answer->status, 200) << answer->body;

  std::map<std::string, std::string> exporter;  // metric name -> a program that exports it
  for (const auto& [program, metrics_port] : scrapes_) {
    const int port = metrics_port;  // clang before 16 refuses a structured binding in a lambda
    Result<std::string> page = NotFound("not scraped");
    ASSERT_TRUE(WaitFor([&] { return (page = Scrape(port)).ok(); }, 10s))
        << program << " /metrics on port " << port << ": " << page.status().ToString() << ReadFile(LogPath(program));
    for (const std::string& name : ExportedNames(*page)) exporter.emplace(name, program);
  }
  for (const std::string& name : kPrometheusOwnSeries) exporter.emplace(name, "Prometheus (per target)");

  std::vector<Query> queries;
  const json d = ReadJson(kDashboard);
  ASSERT_TRUE(d.is_object()) << kDashboard << " is not JSON";
  CollectDashboardQueries(d["panels"], queries);
  const std::string rules_text = ReadFile(kRules);
  const std::vector<Query> rules = RuleExpressions(rules_text);
  std::size_t alerts = 0;
  for (std::size_t at = rules_text.find("- alert:"); at != std::string::npos;
       at = rules_text.find("- alert:", at + 1)) {
    ++alerts;
  }
  ASSERT_GT(alerts, 0u);
  EXPECT_EQ(rules.size(), alerts) << "every alert in " << kRules << " has one expr";
  queries.insert(queries.end(), rules.begin(), rules.end());

  std::set<std::string> queried;
  for (const Query& q : queries) {
    auto names = PromqlMetricNames(q.expr);
    ASSERT_TRUE(names.ok()) << q.where << ": " << names.status().ToString();
    EXPECT_FALSE(names->empty()) << q.where << " queries no metric: " << q.expr;
    for (const std::string& name : *names) {
      queried.insert(name);
      EXPECT_TRUE(exporter.contains(name))
          << q.where << " queries " << name << ", which no running program exports (" << q.expr << ")";
    }
  }
  // The sections the dashboard and rules watch, each read from the program that exports it.
  for (const auto& [name, program] :
       std::map<std::string, std::string>{{"kvrouter_requests_total", "kvrouter"},
                                          {"kvrouter_worker_cached_blocks", "kvrouter"},
                                          {"kvrouter_workers_without_events", "kvrouter"},
                                          {"dynamo_component_kv_cache_events_applied", "kvrouter"},
                                          {"kvgateway_requests_total", "kvgateway"},
                                          {"kvgateway_disagg_requests_total", "kvgateway"},
                                          {"kvgateway_decode_wait_seconds_bucket", "kvgateway"}}) {
    EXPECT_TRUE(queried.contains(name)) << name << " is not queried by the dashboard or the rules";
    EXPECT_EQ(exporter[name], program) << name;
  }
}

}  // namespace
}  // namespace kvrouter::testing
