// HttpClient: asynchronous HTTP/1.1 requests (Boost.Beast) with a keep-alive pool of idle
// connections per endpoint, for a proxy in front of engines and for health checks. A response
// is handed over as it arrives: its head, then body bytes as the socket delivers them (a chunked
// body de-chunked; server-sent events are never held back), then its end. Pause stops reading
// the body (the peer's TCP window fills and its writes block) until Resume. Cancel closes the
// connection, so the engine sees its client go away and can abort. A connection taken from the
// pool that turns out closed (the engine dropped it while idle) is replaced once, before any
// byte of the response came, by a fresh one. Idle pooled connections are closed by a timer
// once unused for Options::max_idle, which is set below the engines' own keep-alive.
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
  // A name's lookup and the TCP connect: a host that drops packets fails within this, not
  // after the kernel's SYN retries.
  std::chrono::milliseconds connect_timeout{2'000};
  std::chrono::milliseconds head_timeout{60'000};  // send + the response head, once connected
  std::chrono::milliseconds read_timeout{60'000};  // between two reads of the body
};

struct HttpCallbacks {
  std::function<void(int status, const HttpHeaders& headers)> on_head;  // names in lower case
  std::function<void(std::string_view data)> on_data;
  // Once, last: OK when the whole response came. kTimeout only for a request the peer accepted
  // (every byte of it written and, on Linux, acknowledged by the peer's TCP, or its response
  // begun) and then left unanswered past head_timeout or read_timeout: the peer may be running
  // it, so sending it elsewhere would run it twice. kInternal for everything else, the request
  // not delivered included (connect refused or timed out, a send that did not finish, a timeout
  // with bytes the peer never acknowledged), and reset, malformed response, cancelled:
  // `message` says which.
  std::function<void(const Status& status)> on_done;
};

class HttpCall {
 public:
  virtual ~HttpCall() = default;
  // Closes the connection (not returned to the pool); on_done follows with "cancelled" unless
  // it already ran.
  virtual void Cancel() = 0;
  // Back-pressure: no more of the body is read until Resume (no read timeout meanwhile). Any
  // thread; called from inside on_data it takes effect before the next read, from elsewhere
  // after at most one more on_data. Pause and Resume called from one thread take effect in the
  // order they are called.
  virtual void Pause() = 0;
  virtual void Resume() = 0;
};

class HttpClient {
 public:
  struct Options {
    std::size_t max_idle_per_endpoint = 64;  // pooled connections kept per engine
    // A pooled connection unused this long is closed, by a timer (at most max_idle / 8 late):
    // below the keep-alive of the servers it talks to (uvicorn's 5 s), so that they rarely close
    // one first and a pick rarely finds it dead.
    std::chrono::milliseconds max_idle{4'000};
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
  // Closes the idle pooled connections to `endpoint` and forgets its pool (an engine that left).
  void DropIdle(const HttpEndpoint& endpoint);

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
    std::uint64_t reaped = 0;    // pooled connections closed for idling past max_idle
    std::uint64_t idle = 0;      // pooled connections open now
  };
  Counters counters() const;

  struct Pool;  // http_client.cc

 private:
  std::shared_ptr<Pool> pool_;
};

}  // namespace kvrouter
