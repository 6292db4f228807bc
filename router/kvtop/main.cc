// kvtop: a live terminal view of a routing fleet (docs/operations.md "kvtop"). Every
// --interval-ms it reads the router's `stats` over NATS (every page) and shows the fleet totals
// and a line per worker rank (router/kvtop/fleet_view.h). Keys: q quits; l, c, r sort by load,
// cache, rate; arrows, Page Up/Down, Home and End scroll; a resized terminal is redrawn.
// --once prints the view as plain text (two readings --interval-ms apart) and exits.
//
//   kvtop --nats-server nats://127.0.0.1:4222          kvtop --once --sort cache
// Exit codes: 0 quit, 1 NATS or the router unreachable (--once), 2 bad flags.
#include <fmt/format.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <optional>
#include <thread>

#include "events/base/clock.h"
#include "router/kvtop/config.h"
#include "router/kvtop/fleet_view.h"
#include "transport/nats_client.h"

#define NCURSES_NOMACROS  // ncurses' move(), clear() and timeout() macros would shadow C++ names
#include <curses.h>

namespace {

using namespace kvrouter;
using namespace kvrouter::top;

std::atomic<bool> g_stop{false};

int RunOnce(NatsClient& nc, const KvtopConfig& c) {
  auto first = ReadFleet(nc, c.ns, std::chrono::steady_clock::now());
  if (!first.ok()) {
    fmt::print(stderr, "kvtop: {}\n", first.status().message());
    return 1;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(c.interval_ms));  // a rate needs two readings
  auto second = ReadFleet(nc, c.ns, std::chrono::steady_clock::now());
  if (!second.ok()) {
    fmt::print(stderr, "kvtop: {}\n", second.status().message());
    return 1;
  }
  const FleetView view = MakeView(&*first, *second, c.sort);
  for (const std::string& line : RenderLines(view, 160, 0, view.rows.size())) fmt::print("{}\n", line);
  return 0;
}

// The screen: redrawn after every reading, key and resize. Readings are taken on this thread
// between keys (getch waits at most 100 ms), so the screen never blocks on NATS for long.
int RunScreen(NatsClient& nc, const KvtopConfig& c) {
  initscr();
  cbreak();
  noecho();
  keypad(stdscr, TRUE);
  curs_set(0);
  wtimeout(stdscr, 100);
  SortKey sort = c.sort;
  std::optional<FleetSample> prev, cur;
  std::string error;
  std::size_t first_row = 0;
  SteadyTime next = std::chrono::steady_clock::now();
  bool dirty = true;
  while (!g_stop.load()) {
    const SteadyTime now = std::chrono::steady_clock::now();
    if (now >= next) {
      next = now + std::chrono::milliseconds(c.interval_ms);
      auto sample = ReadFleet(nc, c.ns, now);
      if (sample.ok()) {
        prev = std::exchange(cur, std::move(sample).value());
        error.clear();
      } else {
        error = sample.status().message();
      }
      dirty = true;
    }
    const int rows = std::max(getmaxy(stdscr), 1);
    const int cols = std::max(getmaxx(stdscr), 1);
    const std::size_t body = rows > static_cast<int>(kHeaderLines) + 2 ? rows - kHeaderLines - 2 : 1;
    const int key = wgetch(stdscr);
    switch (key) {
      case 'q': case 'Q': g_stop = true; break;
      case 'l': sort = SortKey::kLoad; break;
      case 'c': sort = SortKey::kCache; break;
      case 'r': sort = SortKey::kRate; break;
      case KEY_DOWN: ++first_row; break;
      case KEY_UP: first_row -= first_row > 0; break;
      case KEY_NPAGE: first_row += body; break;
      case KEY_PPAGE: first_row -= std::min(first_row, body); break;
      case KEY_HOME: first_row = 0; break;
      case KEY_END: first_row = cur ? cur->ranks.size() : 0; break;
      case KEY_RESIZE: break;
      case ERR: if (!dirty) continue; break;
      default: continue;
    }
    dirty = false;
    werase(stdscr);
    std::vector<std::string> lines;
    if (cur) {
      const FleetView view = MakeView(prev ? &*prev : nullptr, *cur, sort);
      first_row = std::min(first_row, view.rows.size() > body ? view.rows.size() - body : 0);
      lines = RenderLines(view, static_cast<std::size_t>(cols), first_row, body);
    } else {
      lines.push_back("kvtop: waiting for the router's stats ...");
    }
    if (!error.empty()) lines.push_back(fmt::format("kvtop: {} (retrying)", error));
    for (int y = 0; y < rows && y < static_cast<int>(lines.size()); ++y) mvwaddnstr(stdscr, y, 0, lines[y].c_str(), cols);
    wrefresh(stdscr);
  }
  endwin();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto parsed = ParseKvtopConfig(argc, argv, [](const char* name) { return std::getenv(name); });
  if (!parsed.ok()) {
    fmt::print(stderr, "kvtop: {}\n(see kvtop --help)\n", parsed.status().message());
    return 2;
  }
  if (parsed->help) {
    fmt::print("{}", parsed->help_text);
    return 0;
  }
  const KvtopConfig& c = parsed->config;
  auto nc = NatsClient::Connect(
      {.url = c.nats_server, .name = "kvtop", .retry_on_failed_connect = !c.once, .security = c.nats_security}, {});
  if (!nc.ok()) {
    fmt::print(stderr, "kvtop: {}\n", nc.status().message());
    return 1;
  }
  if (c.once) return RunOnce(**nc, c);
  std::signal(SIGINT, [](int) { g_stop = true; });
  std::signal(SIGTERM, [](int) { g_stop = true; });
  return RunScreen(**nc, c);
}
