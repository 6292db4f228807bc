#include "tests/integration/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/close_range.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <fmt/format.h>

extern char** environ;

namespace kvrouter::testing {

namespace {

constexpr auto kPoll = std::chrono::milliseconds(10);
constexpr auto kServerReadyTimeout = std::chrono::seconds(10);

std::string ErrnoText(const char* what) { return fmt::format("{}: {}", what, std::strerror(errno)); }

bool IsExecutable(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// Whether the file has `needle` somewhere after byte `offset`.
bool FileContainsAfter(const std::string& path, uintmax_t offset, std::string_view needle) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  in.seekg(static_cast<std::streamoff>(offset));
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return content.find(needle) != std::string::npos;
}

}  // namespace

bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds timeout, std::chrono::milliseconds poll) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(poll);
  }
  return cond();
}

std::string FindExecutable(const std::string& name, const std::vector<std::string>& fallback_dirs) {
  if (name.find('/') != std::string::npos) return IsExecutable(name) ? name : "";
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH")) {
    std::stringstream ss(path);
    std::string dir;
    while (std::getline(ss, dir, ':')) {
      if (!dir.empty()) dirs.push_back(dir);
    }
  }
  dirs.insert(dirs.end(), fallback_dirs.begin(), fallback_dirs.end());
  for (const auto& dir : dirs) {
    std::string candidate = dir + "/" + name;
    if (IsExecutable(candidate)) return candidate;
  }
  return "";
}

Result<std::unique_ptr<ChildProcess>> ChildProcess::Start(std::vector<std::string> argv, std::string log_path,
                                                          std::vector<std::pair<std::string, std::string>> extra_env) {
  if (argv.empty()) return InvalidArgument("empty argv");
  const std::string exe = FindExecutable(argv[0], {});
  if (exe.empty()) return NotFound(fmt::format("executable '{}' not found", argv[0]));

  // Everything the child needs is prepared before fork: between fork and exec the child of a
  // multi-threaded parent may only make async-signal-safe calls.
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
  }
  for (auto& [k, v] : extra_env) env[k] = v;
  std::vector<std::string> env_strings;
  env_strings.reserve(env.size());
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);

  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return Internal(ErrnoText(("open " + log_path).c_str()));
  const pid_t parent = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) {
    const Status st = Internal(ErrnoText("fork"));
    ::close(log_fd);
    return st;
  }
  if (pid == 0) {
    // Child: async-signal-safe calls only.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl took effect
    ::setpgid(0, 0);                          // own process group: a terminal's Ctrl-C goes to the test, not to it
    const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    // Nothing else crosses the exec: a descriptor the test opened without close-on-exec (Asio's
    // sockets, e.g. an HttpListener's acceptor) would keep its port bound in the child after the
    // test closed it.
    ::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
    ::execve(exe.c_str(), args.data(), envp.data());
    ::_exit(127);
  }
  ::close(log_fd);
  return std::unique_ptr<ChildProcess>(new ChildProcess(pid, std::move(log_path)));
}

ChildProcess::~ChildProcess() { Stop(); }

bool ChildProcess::Running() {
  if (pid_ <= 0) return false;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exit_status_ = status;
    pid_ = -1;
    return false;
  }
  return r == 0;
}

void ChildProcess::Stop(std::chrono::milliseconds grace) {
  if (!Running()) return;
  ::kill(pid_, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (!Running()) return;
    std::this_thread::sleep_for(kPoll);
  }
  Kill();
}

void ChildProcess::Kill() {
  if (!Running()) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {}
  exit_status_ = status;
  pid_ = -1;
}

Result<int> PickFreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Internal(ErrnoText("socket"));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const Status st = Internal(ErrnoText("bind/getsockname"));
    ::close(fd);
    return st;
  }
  ::close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

long ProcStatusKb(pid_t pid, const std::string& field) {
  std::ifstream f(fmt::format("/proc/{}/status", pid));
  for (std::string line; std::getline(f, line);) {
    if (line.starts_with(field + ":")) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

std::size_t OpenConnectionsTo(int port) {
  // Rows: "sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout
  // inode ...", addresses as hex "ADDR:PORT". A socket no process holds (TIME_WAIT, FIN_WAIT)
  // has inode 0.
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // the column names
  std::size_t n = 0;
  while (std::getline(in, line)) {
    std::istringstream row(line);
    std::string sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
    if (!(row >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode)) continue;
    const std::size_t colon = remote.find(':');
    if (colon == std::string::npos || std::stoi(remote.substr(colon + 1), nullptr, 16) != port) continue;
    if ((state == "01" || state == "08") && inode != "0") ++n;  // ESTABLISHED, CLOSE_WAIT
  }
  return n;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool CanConnect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

Result<HttpAnswer> HttpGet(int port, const std::string& path, std::chrono::milliseconds timeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status(StatusCode::kInternal, "socket failed");
  timeval tv{.tv_sec = static_cast<time_t>(timeout.count() / 1000),
             .tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = fmt::format("GET {} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) answer.append(buf, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  // "HTTP/1.x NNN reason\r\n...\r\n\r\nbody"
  const auto head_end = answer.find("\r\n\r\n");
  if (answer.rfind("HTTP/1.", 0) != 0 || answer.size() < 12 || head_end == std::string::npos) {
    return Status(StatusCode::kInternal, fmt::format("no HTTP answer from port {} for {}", port, path));
  }
  return HttpAnswer{std::atoi(answer.substr(9, 3).c_str()), answer.substr(head_end + 4)};
}

Result<std::unique_ptr<NatsServerProcess>> NatsServerProcess::Start(int port, std::vector<std::string> extra_args) {
  // A port picked free can be taken by someone else before the server binds it; then the
  // server exits at once and another port is tried (only when the caller did not ask for one).
  const int attempts = port > 0 ? 1 : 3;
  Status last;
  for (int i = 0; i < attempts; ++i) {
    int p = port;
    if (p <= 0) {
      Result<int> free_port = PickFreePort();
      if (!free_port.ok()) return free_port.status();
      p = *free_port;
    }
    const std::string log =
        (std::filesystem::temp_directory_path() / fmt::format("kvrouter-nats-{}-{}.log", p, ::getpid())).string();
    std::unique_ptr<NatsServerProcess> server(new NatsServerProcess(p, extra_args, log));
    last = server->Launch();
    if (last.ok()) return server;
  }
  return last;
}

std::string NatsServerProcess::url() const { return fmt::format("nats://127.0.0.1:{}", port_); }

Status NatsServerProcess::Launch() {
  const std::string exe = FindExecutable("nats-server", {"/usr/bin", "/usr/sbin", "/usr/local/bin"});
  if (exe.empty()) return NotFound("nats-server not found in PATH, /usr/bin, /usr/sbin");
  std::vector<std::string> argv = {exe, "-a", "127.0.0.1", "-p", std::to_string(port_)};
  argv.insert(argv.end(), extra_args_.begin(), extra_args_.end());
  // The log is appended to across restarts: only what this launch writes counts.
  std::error_code ec;
  uintmax_t log_offset = std::filesystem::file_size(log_path_, ec);
  if (ec) log_offset = 0;  // no log yet
  auto child = ChildProcess::Start(std::move(argv), log_path_);
  if (!child.ok()) return child.status();
  process_ = std::move(child).value();
  // Await readiness rather than sleeping: the server says it is ready and the port accepts.
  // Checking the server's own log matters when tests run in parallel: if another process took
  // the port first, a TCP connect would succeed against *that* server while ours is failing to
  // bind (it then logs a fatal error and exits).
  const auto up = [&] {
    return !process_->Running() || (FileContainsAfter(log_path_, log_offset, "Server is ready") && CanConnect(port_));
  };
  const bool ready = WaitFor(up, std::chrono::duration_cast<std::chrono::milliseconds>(kServerReadyTimeout), kPoll) &&
                     process_->Running();
  if (!ready) {
    process_->Stop();
    process_.reset();
    keep_log_ = true;
    return Internal(fmt::format("nats-server on port {} did not become ready; see {}", port_, log_path_));
  }
  return Status::Ok();
}

NatsServerProcess::~NatsServerProcess() {
  Stop();
  if (std::getenv("KVROUTER_KEEP_TEST_LOGS") == nullptr && !keep_log_) {
    std::error_code ignored;
    std::filesystem::remove(log_path_, ignored);
  }
}

void NatsServerProcess::Stop() {
  if (process_ != nullptr) process_->Stop();
  process_.reset();
}

Status NatsServerProcess::Restart() {
  Stop();
  return Launch();
}

namespace {

bool PortBindable(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// The kernel's first ephemeral port: outgoing connections take ports from there on, so a run
// picked below it cannot be taken by a client socket between the pick and the listener's bind.
int FirstEphemeralPort() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  if (in >> low && low > 2048) return low;
  return 32768;
}

}  // namespace

Result<int> PickFreePortRun(int n) {
  const int top = FirstEphemeralPort() - n;
  constexpr int kBottom = 20000;
  if (top <= kBottom) return Internal("no room for a run of ports below the ephemeral range");
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pick(kBottom, top);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int base = pick(rng);
    bool all = true;
    for (int i = 0; i < n && all; ++i) all = PortBindable(base + i);
    if (all) return base;
  }
  return Internal("no run of free ports");
}

}  // namespace kvrouter::testing
