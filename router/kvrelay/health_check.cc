#include "router/kvrelay/health_check.h"

#include <fmt/format.h>

#include <utility>

#include "transport/http_client.h"
#include "transport/http_io.h"

namespace kvrouter {

struct HttpHealthChecks::Impl {
  Impl(HttpEndpoint e, std::chrono::milliseconds t, std::string p)
      : endpoint(std::move(e)), timeout(t), path(std::move(p)) {}

  const HttpEndpoint endpoint;
  const std::chrono::milliseconds timeout;
  const std::string path;
  HttpIo io{1};  // declared before the client: it outlives it
  // One check at a time (EngineWatch): one pooled connection is all it reuses.
  HttpClient client{io, {.max_idle_per_endpoint = 1}};
};

Result<std::unique_ptr<HttpHealthChecks>> HttpHealthChecks::Create(std::string_view engine_url,
                                                                   std::chrono::milliseconds timeout,
                                                                   std::string path) {
  auto endpoint = ParseHttpUrl(engine_url);
  if (!endpoint.ok()) return endpoint.status();
  return std::unique_ptr<HttpHealthChecks>(
      new HttpHealthChecks(std::make_unique<Impl>(std::move(endpoint).value(), timeout, std::move(path))));
}

HttpHealthChecks::HttpHealthChecks(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpHealthChecks::~HttpHealthChecks() {
  impl_->io.Stop();  // no callback runs after this; calls still queued die with the io context
}

EngineWatch::Check HttpHealthChecks::check() {
  return [impl = impl_.get()](EngineWatch::Done done) -> std::function<void()> {
    // on_head and on_done of one call run one after the other on its loop.
    auto status = std::make_shared<int>(0);
    std::shared_ptr<HttpCall> call = impl->client.Start(
        impl->endpoint,
        {.method = "GET", .target = impl->path, .head_timeout = impl->timeout, .read_timeout = impl->timeout},
        {.on_head = [status](int s, const HttpHeaders&) { *status = s; },
         .on_data = nullptr,
         .on_done =
             [status, done = std::move(done), path = impl->path](const Status& s) {
               if (!s.ok()) return done(s);
               if (*status < 200 || *status > 299) return done(Internal(fmt::format("{} answered {}", path, *status)));
               done(Status::Ok());
             }});
    return [call] { call->Cancel(); };
  };
}

}  // namespace kvrouter
