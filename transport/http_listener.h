// HttpListener: an asynchronous HTTP/1.1 server (Boost.Beast) for the gateway and the mock
// engines' HTTP face. One session object per connection, all on HttpIo's threads; keep-alive;
// limits set before anything is read: headers above max_header_bytes get 431, a Content-Length
// above max_body_bytes gets 413 before the body is read, a malformed request 400; a client that
// is slow to send its headers or body is cut off after its timeout, an idle keep-alive
// connection after idle_timeout, and connections past max_connections are closed at once.
// `Expect: 100-continue` is answered before the body is read. Requests on one connection are
// answered in order, one at a time. A connection the listener ends after a response (its own
// 400 / 413 / 431, Connection: close, HTTP/1.0, draining) is closed lingering: the write side is
// shut, and what the client still sends is dropped for a bounded time and amount before the
// close, so that a client still uploading reads the answer instead of a reset. Drain() stops
// accepting and lets the requests under way finish, each closing its connection. After a burst
// (release_memory_burst requests under way at once) that has been over for
// release_memory_after, the allocator's free memory goes back to the system (glibc's
// malloc_trim, or tcmalloc's ReleaseFreeMemory where the program is linked with it): what a burst
// freed is otherwise kept resident in the arenas of the threads that served it.
//
// Thread contract: the handler runs on an HttpIo thread and must not block; it answers through
// its HttpReply, from any thread, now or later. Ownership: the listener owns its sessions; a
// session lives until its reply is finished and the connection closes. Stop() closes the
// acceptor and every connection (their replies see the client gone).
//
//   auto l = HttpListener::Start(io, {.port = 8000}, [](HttpRequest req, std::shared_ptr<HttpReply> r) {
//     r->Send(200, {{"content-type", "text/plain"}}, "ok\n"); });
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "events/base/status.h"
#include "transport/http_io.h"

namespace kvrouter {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;   // "GET", "POST", ...
  std::string target;   // path and query, as sent
  HttpHeaders headers;  // names in lower case, in the order sent
  std::string body;
  // The first header of that name (lower case), if any.
  std::optional<std::string_view> Header(std::string_view name) const;
  std::string_view Path() const;  // target without its query
};

// The answer to one request. Any thread may call any method; calls made from one thread take
// effect in the order they are made, on the connection's loop: at once when made on its thread
// with nothing of it queued (or from its own callbacks), else queued. No method calls back into
// its caller (the callbacks below run later, on their own).
// Either Send once, or Begin, Write..., End. A reply dropped without either closes the
// connection (the client sees it end).
class HttpReply {
 public:
  virtual ~HttpReply() = default;
  // The whole response, with Content-Length.
  virtual void Send(int status, HttpHeaders headers, std::string body) = 0;
  // A streamed response: the head now (Transfer-Encoding: chunked), each Write a chunk sent as
  // soon as the socket takes it, End the last chunk.
  virtual void Begin(int status, HttpHeaders headers) = 0;
  virtual void Write(std::string chunk) = 0;
  virtual void End() = 0;
  // Closes the connection, mid-response or not.
  virtual void Abort() = 0;
  // `gone` runs once, on an HttpIo thread, if the client closes the connection (or a write to it
  // fails) before the response is finished. Set it before the first Write.
  virtual void OnClientGone(std::function<void()> gone) = 0;
  // Bytes passed to Write (counted when Write is called) and not yet taken by the socket, nor
  // dropped: a slow client's backlog.
  virtual std::size_t Backlog() const = 0;
  // Back-pressure: `drained` runs once, on an HttpIo thread, when the backlog is `low_water`
  // bytes or less (soon, if it is already). It is dropped unrun if the connection closes or
  // the response ends first. A later call replaces a callback not yet run.
  virtual void OnDrained(std::size_t low_water, std::function<void()> drained) = 0;
  // Runs `task` on the connection's thread, after what is queued there (also once the
  // connection has closed, while HttpIo runs): work that belongs to this request, continued
  // there rather than on the thread an answer arrived on. An HttpClient call started from it
  // runs on that thread too.
  virtual void Defer(std::function<void()> task) = 0;
};

using HttpRequestHandler = std::function<void(HttpRequest request, std::shared_ptr<HttpReply> reply)>;

// The listener's request parser over a whole buffer (for fuzzing and tests): one request, with
// the same limits. InvalidArgument for a malformed or incomplete request, kOverloaded for one
// past a limit (header or body size).
Result<HttpRequest> ParseHttpRequest(std::string_view bytes, std::size_t max_header_bytes, std::size_t max_body_bytes);

struct HttpListenerOptions {
  std::string host = "0.0.0.0";
  std::uint16_t port = 0;                       // 0: any free port (see port())
  std::size_t max_header_bytes = 16 * 1024;     // request line and headers
  std::size_t max_body_bytes = 16 << 20;
  std::chrono::milliseconds header_timeout{10'000};  // to receive a request's headers
  std::chrono::milliseconds body_timeout{30'000};    // to receive its body
  std::chrono::milliseconds idle_timeout{60'000};    // keep-alive: between requests
  std::chrono::milliseconds write_timeout{60'000};   // a client that takes no bytes this long goes
  std::size_t max_connections = 50'000;
  // A lingering close (see above) ends once the client closes, or sends nothing for
  // linger_idle (it has stopped sending: an idle keep-alive client that holds the connection in
  // its pool is not waited for), or after linger_timeout, or linger_max_bytes of its bytes: long
  // enough for a client's write to meet the answer, short of a whole upload.
  std::chrono::milliseconds linger_idle{1'000};
  std::chrono::milliseconds linger_timeout{5'000};
  std::size_t linger_max_bytes = 64 << 20;
  // The release of free memory after a burst (see above): once no request has been under way
  // for release_memory_after (zero: never) since release_memory_burst or more were at once.
  // A steady load never goes quiet and reuses what it frees; light traffic (health checks)
  // never makes a burst.
  std::chrono::milliseconds release_memory_after{1'000};
  std::size_t release_memory_burst = 32;
  std::string server_name = "kvrouter";
  // Formats the body of an error the listener answers itself (400, 413, 431): (status, message)
  // -> (content type, body). Plain text when unset.
  std::function<std::pair<std::string, std::string>(int status, std::string_view message)> error_body;
};

class HttpListener {
 public:
  // Binds and listens; InvalidArgument for a bad address, Internal when the port is taken.
  static Result<std::unique_ptr<HttpListener>> Start(HttpIo& io, HttpListenerOptions options, HttpRequestHandler handler);
  ~HttpListener();  // Stop()
  HttpListener(const HttpListener&) = delete;
  HttpListener& operator=(const HttpListener&) = delete;

  std::uint16_t port() const;  // the bound port (also after Stop)
  // Stops accepting (the port is free when it returns, unless called on an HttpIo thread) and
  // closes every connection on its loop (HttpIo::Stop afterwards: no handler runs any more).
  void Stop();
  // Drains: stops accepting (a connect is refused once it returns, unless called on an HttpIo
  // thread), closes the connections waiting for a request of which nothing has come, and lets
  // every other connection finish the request it has (streamed responses included): that
  // response says Connection: close, and its connection closes (lingering) after it.
  void Drain();
  // True once no connection is open (all closed), false when `timeout` passes first. Any thread
  // but an HttpIo one.
  bool AwaitClosed(std::chrono::milliseconds timeout);

  struct Counters {
    std::uint64_t connections = 0;      // accepted in all
    std::uint64_t open = 0;             // open now
    std::uint64_t refused = 0;          // closed at once: past max_connections
    std::uint64_t requests = 0;         // handed to the handler
    std::uint64_t bad_requests = 0;     // answered 400 / 413 / 431 by the listener
    std::uint64_t timeouts = 0;         // cut off: slow headers, body or writes, or idle
    std::uint64_t clients_gone = 0;     // closed by the client before the response ended
    std::uint64_t under_way = 0;        // handed to the handler, response not ended
    std::uint64_t memory_releases = 0;  // free memory given back after a burst
  };
  Counters counters() const;

  struct State;  // http_listener.cc

 private:
  explicit HttpListener(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace kvrouter
