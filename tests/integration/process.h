// Integration-test harness: child processes (a real nats-server, kvrouter, kvmocker) and
// condition polling.
//
// ChildProcess runs one program with its output in a log file and only ever signals its own
// pid, which it reaps; NatsServerProcess is a nats-server on a free 127.0.0.1 port, ready when
// Start returns. WaitFor polls a condition instead of sleeping a fixed time. Not thread-safe:
// one test thread owns each object. Children get SIGKILL if the thread that started them dies
// (PR_SET_PDEATHSIG), so a crashed test leaves no stray servers; start them from the test's
// main thread, not from a short-lived helper thread.
//
//   auto nats = NatsServerProcess::Start();  ASSERT_TRUE(nats.ok());  (*nats)->url();
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "events/base/status.h"

namespace kvrouter::testing {

// Polls `cond` every `poll` until it returns true (-> true) or `timeout` passes (-> false; the
// condition is evaluated one last time at the deadline).
bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds timeout,
             std::chrono::milliseconds poll = std::chrono::milliseconds(10));

class ChildProcess {
 public:
  // Starts argv[0] (a path; looked up in PATH when it has no '/') with the current environment
  // plus `extra_env` (NAME, value; overrides). stdout and stderr are appended to `log_path`; stdin
  // is /dev/null, and no other descriptor of the test reaches the child.
  static Result<std::unique_ptr<ChildProcess>> Start(std::vector<std::string> argv, std::string log_path,
                                                     std::vector<std::pair<std::string, std::string>> extra_env = {});

  // Stops the process (Stop()).
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // SIGTERM, then SIGKILL if it is still alive after `grace`; reaps it. Idempotent.
  void Stop(std::chrono::milliseconds grace = std::chrono::seconds(3));
  // SIGKILL at once (kill -9: no chance to clean up); reaps it. Idempotent.
  void Kill();
  // Alive and not yet reaped. Reaps (and records the exit) if it has exited.
  bool Running();
  // Wait status from waitpid once reaped, else -1.
  int exit_status() const { return exit_status_; }
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }

 private:
  ChildProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  pid_t pid_ = -1;  // -1 once reaped: never signal a pid that may have been recycled
  int exit_status_ = -1;
  std::string log_path_;
};

// Finds an executable: `name` if it contains '/', else the first match in PATH, then in the
// extra `fallback_dirs`. Empty when not found.
std::string FindExecutable(const std::string& name, const std::vector<std::string>& fallback_dirs);

// A free TCP port on 127.0.0.1 right now (bind to port 0, read it, close).
Result<int> PickFreePort();
// The first of n consecutive ports free on 127.0.0.1 right now (kvmocker's worker i listens on
// the first + i), taken at random below the kernel's ephemeral range so that no client socket of
// a test running beside it takes one before the program binds it.
Result<int> PickFreePortRun(int n);

// A field of /proc/PID/status in kB (VmRSS: resident memory now; VmHWM: its peak), -1 when
// unreadable.
long ProcStatusKb(pid_t pid, const std::string& field);

// TCP connections on this host (IPv4) whose remote end is `port` and that a process still holds
// open (ESTABLISHED or CLOSE_WAIT, with a socket inode in /proc/net/tcp): a proxy's connections
// to a server, counted from the client's side.
std::size_t OpenConnectionsTo(int port);

// The whole text of a file ("" when it cannot be read): a program's log in a failure message.
std::string ReadFile(const std::string& path);

// True when a TCP connect to 127.0.0.1:port succeeds.
bool CanConnect(int port);

// GET http://127.0.0.1:port/path (HTTP/1.0, the whole answer read until the server closes):
// the status code and the body. Fails when nothing listens or the answer is not HTTP.
struct HttpAnswer {
  int status = 0;
  std::string body;
};
Result<HttpAnswer> HttpGet(int port, const std::string& path,
                           std::chrono::milliseconds timeout = std::chrono::seconds(5));

class NatsServerProcess {
 public:
  // Starts nats-server on a free port (or `port` when > 0) and waits until it accepts TCP
  // connections (up to 10 s). Log: <temp dir>/kvrouter-nats-<port>-<pid>.log, kept when the
  // server fails to start or when KVROUTER_KEEP_TEST_LOGS is set, else removed on destruction.
  // Readiness is read from that log ("Server is ready"), so extra_args must not redirect it
  // (no -l / --log).
  static Result<std::unique_ptr<NatsServerProcess>> Start(int port = 0, std::vector<std::string> extra_args = {});

  // Stops the server; removes its log (see Start).
  ~NatsServerProcess();

  std::string url() const;
  int port() const { return port_; }
  bool Running() { return process_ != nullptr && process_->Running(); }
  const std::string& log_path() const { return log_path_; }
  pid_t pid() const { return process_ != nullptr ? process_->pid() : 0; }  // 0: not running

  // Stops the server (clients see a disconnect); the port stays reserved for Restart in name
  // only, nothing holds it.
  void Stop();
  // Stop (if running), then start again on the same port and wait until it accepts.
  Status Restart();

 private:
  NatsServerProcess(int port, std::vector<std::string> extra_args, std::string log_path)
      : port_(port), extra_args_(std::move(extra_args)), log_path_(std::move(log_path)) {}
  Status Launch();

  int port_;
  std::vector<std::string> extra_args_;
  std::string log_path_;
  std::unique_ptr<ChildProcess> process_;
  bool keep_log_ = false;  // a start failed: the log explains why
};

}  // namespace kvrouter::testing
