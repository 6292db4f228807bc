// HttpHealthChecks: EngineWatch's checks over HTTP. Each check is GET {engine}{path} (vLLM's
// /health) through the project's asynchronous client (transport/http_client.h: HttpClient, one
// pooled keep-alive connection) on one HttpIo thread of its own. Healthy = a 2xx answer, body
// and all, within the timeout; connect refused, a reset, a non-2xx status or no answer in time is
// a failure whose message says which.
// The header shows none of transport/http_*, so that a file may include it beside
// router/common/http_server.h (both name a type HttpHandler in namespace kvrouter).
//
// Thread contract: check() and the checks it returns may be used from any thread; the checks'
// `done` runs on the HttpIo thread. Ownership: owns the thread and the client; destroying it
// stops the thread first, after which no `done` runs, and the checks it handed out must not be
// started any more.
//
//   auto checks = HttpHealthChecks::Create("http://127.0.0.1:8001", 1s);
//   EngineWatch watch(options, (*checks)->check(), log, url);
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "events/base/status.h"
#include "router/kvrelay/engine_watch.h"

namespace kvrouter {

class HttpHealthChecks {
 public:
  // InvalidArgument when `engine_url` is not what ParseHttpUrl takes (http://host:port).
  static Result<std::unique_ptr<HttpHealthChecks>> Create(std::string_view engine_url,
                                                          std::chrono::milliseconds timeout,
                                                          std::string path = "/health");
  ~HttpHealthChecks();
  HttpHealthChecks(const HttpHealthChecks&) = delete;
  HttpHealthChecks& operator=(const HttpHealthChecks&) = delete;

  EngineWatch::Check check();

  struct Impl;  // health_check.cc

 private:
  explicit HttpHealthChecks(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrouter
