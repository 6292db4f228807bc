// HttpClient: asynchronous HTTP/1.1 requests (Boost.Beast) with a keep-alive pool of idle
// connections per endpoint, for a proxy in front of engines and for health checks. A response
// is handed over as it arrives: its head, then body bytes as the socket delivers them (a chunked
// body de-chunked; server-sent events are never held back), then its end. Cancel closes the
// connection, so the engine sees its client go away and can abort. A connection taken from the
// pool that turns out closed (the engine dropped it while idle) is replaced once, before any
// byte of the response came, by a fresh one.
//
// Thread contract: Start, Fetch and Cancel may be called from any thread (Fetch not from an
// HttpIo thread: it waits). Callbacks run on an HttpIo thread, one at a time per call, and must
// not block. Ownership: a call keeps itself alive until on_done has run; the client must outlive
// its calls (stop HttpIo first).
//
//   auto url = ParseHttpUrl("http://127.0.0.1:8000");
//   client.Start(*url, {.target = "/v1/completions", .body = json}, {.on_data = ..., .on_done = ...});
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "events/base/status.h"
#include "transport/http_io.h"
#include "transport/http_listener.h"

namespace kvrouter {

// An engine's base URL: "http://host[:port]" (port 80 by default; an IPv6 address in [ ]),
// without a path, query, fragment or user information; the scheme in any case.
struct HttpEndpoint {
  std::string host;
  std::uint16_t port = 80;
  std::string Key() const;  // "host:port" ("[v6]:port"), the pool's key and the Host header
};
Result<HttpEndpoint> ParseHttpUrl(std::string_view url);

struct HttpCallSpec {
  std::string method = "POST";
  std::string target = "/";  // path and query
  HttpHeaders headers;       // Host, Content-Length and Connection are set by the client
  std::string body;
  std::chrono::milliseconds head_timeout{60'000};  // connect + send + the response head
  std::chrono::milliseconds read_timeout{60'000};  // between two reads of the body
};

struct HttpCallbacks {
  std::function<void(int status, const HttpHeaders& headers)> on_head;  // names in lower case
  std::function<void(std::string_view data)> on_data;
  // Once, last: OK when the whole response came; Timeout; Internal (connect refused, reset,
  // malformed response, cancelled: `message` says which).
  std::function<void(const Status& status)> on_done;
};

class HttpCall {
 public:
  virtual ~HttpCall() = default;
  // Closes the connection (not returned to the pool); on_done follows with "cancelled" unless
  // it already ran.
  virtual void Cancel() = 0;
};

class HttpClient {
 public:
  struct Options {
    std::size_t max_idle_per_endpoint = 64;          // pooled connections kept per engine
    std::chrono::milliseconds max_idle{30'000};      // a pooled connection unused this long is closed
    std::size_t max_response_header_bytes = 64 * 1024;
  };
  HttpClient(HttpIo& io, Options options);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  std::shared_ptr<HttpCall> Start(const HttpEndpoint& endpoint, HttpCallSpec spec, HttpCallbacks callbacks);
  // Cancels every call not yet done and (off the HttpIo threads) waits until their on_done ran.
  // Before HttpIo::Stop; the destructor does it too.
  void Stop();

  // The whole response, waiting for it (not on an HttpIo thread).
  struct Response {
    int status = 0;
    HttpHeaders headers;
    std::string body;
  };
  Result<Response> Fetch(const HttpEndpoint& endpoint, HttpCallSpec spec);

  struct Counters {
    std::uint64_t connects = 0;  // new connections made
    std::uint64_t reused = 0;    // calls that took a pooled connection
    std::uint64_t retried = 0;   // pooled connections found closed and replaced
    std::uint64_t failed = 0;    // calls that ended with an error (cancels included)
  };
  Counters counters() const;

  struct Pool;  // http_client.cc

 private:
  std::shared_ptr<Pool> pool_;
};

}  // namespace kvrouter
