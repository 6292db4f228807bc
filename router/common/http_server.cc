#include "router/common/http_server.h"

#include <civetweb.h>
#include <fmt/format.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

namespace kvrouter {
namespace {

std::string_view Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 503: return "Service Unavailable";
    default: return "Internal Server Error";
  }
}

void Respond(mg_connection* conn, const HttpResponse& r) {
  const std::string head = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n"
      "Connection: close\r\n\r\n",
      r.status, Reason(r.status), r.content_type, r.body.size());
  mg_write(conn, head.data(), head.size());
  mg_write(conn, r.body.data(), r.body.size());
}

int Handle(mg_connection* conn, void* data) {
  const mg_request_info* info = mg_get_request_info(conn);
  HttpResponse r;
  if (info == nullptr || std::strcmp(info->request_method, "GET") != 0) {
    r = {405, "GET only\n"};
  } else {
    try {
      r = (*static_cast<HttpHandler*>(data))();
    } catch (const std::exception& e) {
      r = {500, fmt::format("internal error: {}\n", e.what())};
    }
  }
  Respond(conn, r);
  return r.status;
}

// Opens a TCP connection to the server listening on `host`:`port` (a wildcard address: the
// loopback one) and closes it, waiting at most 50 ms for it to be accepted by the kernel.
void Poke(const std::string& host, int port) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&addr);
  std::string h = host;
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (h == "::") h = "::1";
  if (h.empty() || h == "0.0.0.0") h = "127.0.0.1";
  if (::inet_pton(AF_INET6, h.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<std::uint16_t>(port));
    len = sizeof(sockaddr_in6);
  } else {
    if (::inet_pton(AF_INET, h.c_str(), &v4->sin_addr) != 1) ::inet_pton(AF_INET, "127.0.0.1", &v4->sin_addr);
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<std::uint16_t>(port));
    len = sizeof(sockaddr_in);
  }
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 && errno == EINPROGRESS) {
    pollfd p{.fd = fd, .events = POLLOUT, .revents = 0};
    (void)::poll(&p, 1, 50);
  }
  ::close(fd);
}

}  // namespace

Result<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& host, int port,
                                                      std::vector<std::pair<std::string, HttpHandler>> routes) {
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });
  const std::string listen = fmt::format("{}:{}", host, port);
  const char* options[] = {"listening_ports", listen.c_str(), "num_threads", "2", nullptr};
  mg_callbacks callbacks{};
  // civetweb prints its own errors through log_message; keep them off stderr, we report ours.
  callbacks.log_message = [](const mg_connection*, const char*) { return 1; };
  mg_context* ctx = mg_start(&callbacks, nullptr, options);
  if (ctx == nullptr) {
    return Status(StatusCode::kInternal,
                  fmt::format("cannot listen on {} (in use, or not an address of this host)", listen));
  }
  std::unique_ptr<HttpServer> server(new HttpServer());
  server->ctx_ = ctx;
  server->host_ = host;
  server->port_ = port;
  for (auto& [path, handler] : routes) {
    server->handlers_.push_back(std::make_unique<HttpHandler>(std::move(handler)));
    mg_set_request_handler(ctx, path.c_str(), Handle, server->handlers_.back().get());
  }
  return server;
}

Result<std::unique_ptr<HttpServer>> StartMetricsServer(const std::string& host, int port,
                                                       std::function<std::string()> metrics,
                                                       std::function<bool()> ready) {
  return HttpServer::Start(host, port,
                           {{"/metrics",
                             [metrics] {
                               return HttpResponse{200, metrics(), "text/plain; version=0.0.4; charset=utf-8"};
                             }},
                            {"/health",
                             [] {
                               return HttpResponse{200, "ok\n"};
                             }},
                            {"/ready", [ready] {
                               return ready() ? HttpResponse{200, "ready\n"} : HttpResponse{503, "not ready\n"};
                             }}});
}

HttpServer::~HttpServer() {
  if (!ctx_) return;
  // civetweb's listening thread sees the stop only when its poll returns, which without a
  // connection is its timeout (seconds): connections to the port wake it while mg_stop waits.
  std::atomic<bool> stopped{false};
  std::thread waker([&] {
    while (!stopped.load()) {
      Poke(host_, port_);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the next poke's time, not a wait for a state
    }
  });
  mg_stop(ctx_);
  stopped = true;
  waker.join();
}

}  // namespace kvrouter
