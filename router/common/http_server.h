// HttpServer: the small HTTP/1.1 server behind --metrics-port (/metrics, /health, /ready), on
// civetweb from Debian. Each path has a handler that returns the whole response; GET only.
//
// Thread contract: handlers run on civetweb's worker threads (two), concurrently with the rest
// of the program: they must be thread-safe. Destruction stops the server and waits for handlers
// in progress (promptly: it wakes civetweb's listener, which would otherwise notice the stop
// only at its next poll timeout). Ownership: the handlers are owned by the server.
//
//   auto http = HttpServer::Start("0.0.0.0", 9091, {{"/health", [] { return HttpResponse{200, "ok\n"}; }}});
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "events/base/status.h"

struct mg_context;

namespace kvrouter {

struct HttpResponse {
  int status = 200;
  std::string body;
  std::string content_type = "text/plain; charset=utf-8";
};
using HttpHandler = std::function<HttpResponse()>;

class HttpServer {
 public:
  // Listens on host:port (port > 0). A port in use or a bad host is an error naming them.
  static Result<std::unique_ptr<HttpServer>> Start(const std::string& host, int port,
                                                   std::vector<std::pair<std::string, HttpHandler>> routes);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

 private:
  HttpServer() = default;
  std::vector<std::unique_ptr<HttpHandler>> handlers_;  // stable addresses for civetweb
  mg_context* ctx_ = nullptr;
  std::string host_;  // as listened on
  int port_ = 0;
};

// A program's /metrics (Prometheus text from `metrics`), /health (200 while it runs) and /ready
// (200 when `ready` says so, else 503).
Result<std::unique_ptr<HttpServer>> StartMetricsServer(const std::string& host, int port,
                                                       std::function<std::string()> metrics,
                                                       std::function<bool()> ready);

}  // namespace kvrouter
