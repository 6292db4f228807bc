#include "router/common/http_server.h"

#include <civetweb.h>
#include <fmt/format.h>

#include <cstring>
#include <mutex>

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
  if (ctx_) mg_stop(ctx_);
}

}  // namespace kvrouter
