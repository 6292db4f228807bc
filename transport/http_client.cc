#include "transport/http_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <future>
#include <iterator>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "events/base/clock.h"
#include "events/base/thread_annotations.h"
#include "transport/http_io_impl.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <optional>
#include <unordered_set>

namespace kvrouter {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

std::string HttpEndpoint::Key() const {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

Result<HttpEndpoint> ParseHttpUrl(std::string_view url) {
  constexpr std::string_view kScheme = "http://";
  const auto bad = [&](std::string_view why) { return InvalidArgument(fmt::format("'{}' {}", url.substr(0, 256), why)); };
  const std::string_view scheme = url.substr(0, kScheme.size());
  if (!beast::iequals(beast::string_view(scheme.data(), scheme.size()), beast::string_view(kScheme.data(), kScheme.size()))) {
    return bad("is not an http:// URL");
  }
  std::string_view rest = url.substr(kScheme.size());
  while (rest.ends_with('/')) rest.remove_suffix(1);
  if (rest.find_first_of("/?#") != std::string_view::npos) {
    return bad("has a path, query or fragment; give the base URL, http://host:port");
  }
  if (rest.find('@') != std::string_view::npos) return bad("has user information");
  HttpEndpoint e;
  std::string_view host = rest;
  std::optional<std::string_view> port;
  if (rest.starts_with('[')) {  // [v6]:port
    const auto close = rest.find(']');
    if (close == std::string_view::npos) return bad("has an unclosed [");
    host = rest.substr(1, close - 1);
    if (close + 1 < rest.size()) {
      if (rest[close + 1] != ':') return bad("has something after ] that is not :port");
      port = rest.substr(close + 2);
    }
  } else if (const auto colon = rest.find(':'); colon != std::string_view::npos) {
    if (rest.find(':', colon + 1) != std::string_view::npos) return bad("has an IPv6 address without [ ]");
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  if (host.empty()) return bad("has no host");
  e.host = std::string(host);
  if (port) {
    unsigned p = 0;
    const auto [end, ec] = std::from_chars(port->data(), port->data() + port->size(), p);
    if (port->empty() || ec != std::errc() || end != port->data() + port->size() || p == 0 || p > 65535) {
      return bad("has a bad port");
    }
    e.port = static_cast<std::uint16_t>(p);
  }
  return e;
}

namespace {
// Typed on their loop's executor rather than type-erased (beast::tcp_stream, net::steady_timer):
// an asynchronous operation then copies no executor onto the heap.
using Executor = HttpIo::Impl::Executor;
using Stream = beast::basic_stream<tcp, Executor>;
using Timer =
    net::basic_waitable_timer<std::chrono::steady_clock, net::wait_traits<std::chrono::steady_clock>, Executor>;
}  // namespace

struct HttpClient::Pool {
  struct Idle {
    std::unique_ptr<Stream> stream;
    SteadyTime since;
  };

  Pool(HttpIo::Impl& i, Options o) : io(i), options(o), idle(i.loops.size()), reaper(i.executor(0)) {}

  // The loop a call to `key` runs on, and a pooled connection of it to reuse (or null): the
  // calling thread's loop, or else one with a connection to `key` pooled, or else the next in
  // turn. A connection pooled longer than max_idle is closed, not reused.
  std::pair<std::size_t, std::unique_ptr<Stream>> Claim(const std::string& key) {
    const std::optional<std::size_t> here = io.Current();
    const std::size_t loops = io.loops.size(), start = here ? *here : io.Next(), n = here ? 1 : loops;
    std::vector<std::unique_ptr<Stream>> stale;
    std::pair<std::size_t, std::unique_ptr<Stream>> claim{start, nullptr};
    {
      KvMutexLock g(mu);
      const SteadyTime now = std::chrono::steady_clock::now();
      for (std::size_t k = 0; k < n && !claim.second; ++k) {
        auto& pool = idle[(start + k) % loops];
        auto it = pool.find(key);
        if (it == pool.end()) continue;
        while (!it->second.empty() && !claim.second) {
          Idle i = std::move(it->second.back());
          it->second.pop_back();
          if (now - i.since < options.max_idle) {
            claim = {(start + k) % loops, std::move(i.stream)};
          } else {
            stale.push_back(std::move(i.stream));
          }
        }
        if (it->second.empty()) pool.erase(it);
      }
    }
    reaped += stale.size();
    for (auto& st : stale) CloseIdle(*st);
    return claim;
  }
  void Give(std::size_t loop, const std::string& key, std::unique_ptr<Stream> stream) {
    stream->expires_never();
    {
      KvMutexLock g(mu);
      auto& q = idle[loop][key];
      if (q.size() < options.max_idle_per_endpoint && !stopped.load()) {
        q.push_back({std::move(stream), std::chrono::steady_clock::now()});
        return;
      }
    }
    CloseIdle(*stream);
  }
  // Closes the pooled connections unused for max_idle at `now` (every one with `all`) and
  // forgets the pools left empty; only those of `key` when it is given.
  void Reap(SteadyTime now, bool all, const std::string* key = nullptr) {
    std::vector<std::unique_ptr<Stream>> closing;
    {
      KvMutexLock g(mu);
      for (auto& pool : idle) {
        for (auto it = pool.begin(); it != pool.end();) {
          if (key && it->first != *key) {
            ++it;
            continue;
          }
          auto& q = it->second;  // oldest first: a pick takes the newest, from the back
          auto keep = all ? q.end() : std::find_if(q.begin(), q.end(), [&](const Idle& i) {
            return now - i.since < options.max_idle;
          });
          for (auto j = q.begin(); j != keep; ++j) closing.push_back(std::move(j->stream));
          q.erase(q.begin(), keep);
          it = q.empty() ? pool.erase(it) : std::next(it);
        }
      }
    }
    if (!all) reaped += closing.size();
    for (auto& s : closing) CloseIdle(*s);
  }
  std::size_t IdleCount() {
    KvMutexLock g(mu);
    std::size_t n = 0;
    for (const auto& pool : idle) {
      for (const auto& [key, q] : pool) n += q.size();
    }
    return n;
  }
  // A pooled connection has no operation pending and no other owner: any thread may close it.
  static void CloseIdle(Stream& s) {
    beast::error_code ignored;
    s.socket().shutdown(tcp::socket::shutdown_both, ignored);
    s.socket().close(ignored);
  }

  HttpIo::Impl& io;
  const Options options;
  KvMutex mu;
  // Per loop (a connection's operations run on the loop it was made on), per endpoint key.
  std::vector<std::unordered_map<std::string, std::vector<Idle>>> idle KV_GUARDED_BY(mu);
  // Calls not yet done (for Stop); `no_calls` is signalled when it empties.
  std::unordered_map<HttpCall*, std::weak_ptr<HttpCall>> live KV_GUARDED_BY(mu);
  std::condition_variable_any no_calls;
  std::atomic<bool> stopped{false};
  // Wakes every max_idle / 8 to Reap; touched only on the first loop (ArmReaper, its handler and
  // the cancel Stop posts).
  Timer reaper;
  std::atomic<std::uint64_t> connects{0}, reused{0}, retried{0}, failed{0}, reaped{0};
};

namespace {

// On the reaper's loop: the next sweep of the idle pool.
void ArmReaper(const std::shared_ptr<HttpClient::Pool>& pool) {
  if (pool->stopped.load()) return;
  pool->reaper.expires_after(std::max<std::chrono::milliseconds>(pool->options.max_idle / 8, std::chrono::milliseconds(1)));
  pool->reaper.async_wait([weak = std::weak_ptr<HttpClient::Pool>(pool)](beast::error_code ec) {
    auto p = weak.lock();
    if (!p || ec) return;
    p->Reap(std::chrono::steady_clock::now(), false);
    ArmReaper(p);
  });
}

// Sockets are not handed to programs this one starts (Asio opens them without FD_CLOEXEC).
void CloseOnExec(int fd) {
  if (fd >= 0) (void)::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC);
}

// Whether the peer's TCP acknowledged every byte written to `fd` (Linux's TCP_INFO); true where
// that cannot be told, so a whole request written counts as delivered.
bool PeerAcknowledgedAll(int fd) {
#if defined(__linux__)
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return true;
  return info.tcpi_state == TCP_ESTABLISHED && info.tcpi_unacked == 0;
#else
  (void)fd;
  return true;
#endif
}

// Read buffers of ended calls, kept for the next calls on this thread: a 16 KB allocation per
// call made glibc merge its small free chunks (malloc_consolidate) every time.
constexpr std::size_t kReadPiece = 16 * 1024;  // the most one read takes
constexpr std::size_t kSpareBuffers = 64;
thread_local std::vector<beast::flat_buffer> t_spare_buffers;

beast::flat_buffer TakeReadBuffer() {
  if (t_spare_buffers.empty()) return beast::flat_buffer();
  beast::flat_buffer b = std::move(t_spare_buffers.back());
  t_spare_buffers.pop_back();
  return b;
}

void KeepReadBuffer(beast::flat_buffer&& b) {
  if (t_spare_buffers.size() >= kSpareBuffers || b.capacity() < kReadPiece || b.capacity() > 4 * kReadPiece) return;
  b.clear();
  t_spare_buffers.push_back(std::move(b));
}

// One request, on the loop the pool's Claim gave it (a proxy's engine call runs on its client
// connection's thread), with the pooled connection it gave, if any. Every member is touched only
// on that loop, but for the constant ones.
class Call final : public HttpCall, public std::enable_shared_from_this<Call> {
 public:
  Call(std::shared_ptr<HttpClient::Pool> pool, HttpEndpoint endpoint, std::string key,
       std::pair<std::size_t, std::unique_ptr<Stream>> claim, HttpCallSpec spec, HttpCallbacks cb)
      : pool_(std::move(pool)),
        endpoint_(std::move(endpoint)),
        key_(std::move(key)),
        spec_(std::move(spec)),
        cb_(std::move(cb)),
        loop_(claim.first),
        stream_(std::move(claim.second)),
        exec_(pool_->io.executor(loop_)),
        timer_(exec_) {
    reused_ = stream_ != nullptr;
    if (reused_) {
      ++pool_->reused;
    } else {
      stream_ = std::make_unique<Stream>(exec_);
    }
  }

  ~Call() override { KeepReadBuffer(std::move(buffer_)); }

  void Run() {
    {
      KvMutexLock g(pool_->mu);
      pool_->live.emplace(this, weak_from_this());
    }
    // At once when called on the call's loop: nothing below calls back before an operation
    // completes, so the caller is never re-entered.
    net::dispatch(exec_, [self = shared_from_this()] {
      if (self->reused_) {
        self->Send();
      } else {
        self->Resolve();
      }
    });
  }

  void Cancel() override {
    net::post(exec_, [self = shared_from_this()] { self->Fail(Internal("cancelled")); });
  }

  void Pause() override {
    // At once only from inside on_data: elsewhere on this loop a Resume queued before it would
    // run after it.
    if (exec_.running_in_this_thread() && in_data_) {
      paused_ = true;
      return;
    }
    net::post(exec_, [self = shared_from_this()] { self->paused_ = true; });
  }

  void Resume() override {
    net::post(exec_, [self = shared_from_this()] {
      self->paused_ = false;
      if (std::exchange(self->stalled_, false)) self->ReadBody();
    });
  }

 private:
  void Resolve() {
    // An address needs no lookup; a name is looked up within the connect timeout too.
    beast::error_code ec;
    const auto address = net::ip::make_address(endpoint_.host, ec);
    if (!ec) return Connect(tcp::resolver::results_type::create(tcp::endpoint(address, endpoint_.port), endpoint_.host,
                                                                std::to_string(endpoint_.port)));
    resolver_.emplace(exec_);
    timer_.expires_after(spec_.connect_timeout);
    timer_.async_wait([self = shared_from_this()](beast::error_code e) {
      if (!e && self->resolver_) self->resolver_->cancel();
    });
    resolver_->async_resolve(endpoint_.host, std::to_string(endpoint_.port),
                             [self = shared_from_this()](beast::error_code e, tcp::resolver::results_type results) {
                               self->timer_.cancel();
                               if (self->done_) return;
                               if (e == net::error::operation_aborted) {
                                 return self->Fail(Internal("cannot resolve " + self->endpoint_.host + " in time"));
                               }
                               if (e) return self->Fail(Internal("cannot resolve " + self->endpoint_.host + ": " + e.message()));
                               self->Connect(std::move(results));
                             });
  }

  void Connect(tcp::resolver::results_type results) {
    stream_->expires_after(spec_.connect_timeout);
    stream_->async_connect(results, [self = shared_from_this()](beast::error_code e, const tcp::endpoint&) {
      if (self->done_) return;
      if (e == beast::error::timeout) {
        return self->Fail(Internal(fmt::format("cannot connect to {} within {} ms", self->key_,
                                               self->spec_.connect_timeout.count())));
      }
      if (e) return self->Fail(self->ErrorOf("cannot connect to", e));
      ++self->pool_->connects;
      CloseOnExec(self->stream_->socket().native_handle());
      beast::error_code ignored;
      self->stream_->socket().set_option(tcp::no_delay(true), ignored);
      self->Send();
    });
  }

  // The head is written here and goes with the body in one gathered write: Beast's fields take
  // an allocation per header, and its serializer walks them as a chain of buffer views.
  void Send() {
    if (HasLineBreak(spec_.method) || HasLineBreak(spec_.target)) {
      return FailLater(InvalidArgument("a line break in the request line"));
    }
    request_head_.clear();
    request_head_.append(spec_.method).append(" ").append(spec_.target).append(" HTTP/1.1\r\nHost: ").append(key_);
    request_head_.append("\r\n");
    for (const auto& [k, v] : spec_.headers) {  // a header given twice goes twice
      if (HasLineBreak(k) || HasLineBreak(v))
        return FailLater(InvalidArgument(fmt::format("header '{}' has a line break", k)));
      request_head_.append(k).append(": ").append(v).append("\r\n");
    }
    // As Beast's prepare_payload: a length for a body, or for a method that expects one.
    if (!spec_.body.empty() || spec_.method == "POST" || spec_.method == "PUT" || spec_.method == "PATCH") {
      fmt::format_to(std::back_inserter(request_head_), "Content-Length: {}\r\n", spec_.body.size());
    }
    request_head_.append("\r\n");
    head_deadline_ = std::chrono::steady_clock::now() + spec_.head_timeout;
    stream_->expires_at(head_deadline_);
    const std::array<net::const_buffer, 2> request{net::buffer(request_head_), net::buffer(spec_.body)};
    net::async_write(*stream_, request, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (self->done_) return;
      if (ec) return self->RetryOrFail(ec);
      self->ReadHead();
    });
  }

  // Fails from a handler of its own: Send may run inside Run, whose caller is not re-entered.
  void FailLater(Status s) {
    net::post(exec_, [self = shared_from_this(), s = std::move(s)] { self->Fail(s); });
  }

  // The head's wait is timed by timer_, not the stream: at its end the socket must still be
  // open to ask whether the peer acknowledged the request (whether it was delivered).
  void ReadHead() {
    stream_->expires_never();
    awaiting_head_ = true;
    timer_.expires_at(head_deadline_);
    timer_.async_wait([self = shared_from_this()](beast::error_code e) {
      // (A wait that ended as the read did, queued behind it, finds awaiting_head_ false.)
      if (e || self->done_ || !self->awaiting_head_) return;
      self->head_timed_out_ = true;
      self->delivered_ = PeerAcknowledgedAll(self->stream_->socket().native_handle());
      beast::error_code ignored;
      self->stream_->socket().cancel(ignored);
    });
    // Beast reads what the buffer has room for, and at least 512 bytes: a buffer grown one read
    // at a time reads a response 512 bytes per system call.
    buffer_.reserve(kReadPiece);
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(pool_->options.max_response_header_bytes));
    parser_->body_limit(std::numeric_limits<std::uint64_t>::max());  // a stream may be long
    http::async_read_header(*stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, std::size_t n) {
      self->awaiting_head_ = false;
      if (self->done_) return;
      if (ec && self->head_timed_out_) {
        const std::string m = fmt::format("{} sent no response head within {} ms", self->key_,
                                          self->spec_.head_timeout.count());
        if (self->delivered_) return self->Fail(Status(StatusCode::kTimeout, m + " (it has the request)"));
        return self->Fail(Internal(m + " and did not acknowledge the request"));
      }
      self->timer_.cancel();
      if (ec) return n == 0 ? self->RetryOrFail(ec) : self->Fail(self->ErrorOf("bad response from", ec));
      self->head_ = true;
      const auto& res = self->parser_->get();
      HttpHeaders headers;
      for (const auto& f : res) {
        std::string name(f.name_string());
        std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
        headers.emplace_back(std::move(name), std::string(f.value()));
      }
      if (self->cb_.on_head) self->cb_.on_head(static_cast<int>(res.result_int()), headers);
      self->ReadBody();
    });
  }

  void ReadBody() {
    if (done_) return;
    if (parser_->is_done()) return Finish();
    if (paused_) {
      stalled_ = true;  // Resume reads on
      return;
    }
    parser_->get().body().data = body_;
    parser_->get().body().size = sizeof(body_);
    stream_->expires_after(spec_.read_timeout);
    http::async_read_some(*stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (self->done_) return;
      if (ec && ec != http::error::need_buffer) return self->Fail(self->ErrorOf("response cut off by", ec));
      const std::size_t n = sizeof(self->body_) - self->parser_->get().body().size;
      if (n > 0 && self->cb_.on_data) {
        self->in_data_ = true;
        self->cb_.on_data(std::string_view(self->body_, n));
        self->in_data_ = false;
      }
      self->ReadBody();
    });
  }

  // Leaves the client's list of live calls (Stop waits for it to empty).
  void Settled() {
    KvMutexLock g(pool_->mu);
    pool_->live.erase(this);
    if (pool_->live.empty()) pool_->no_calls.notify_all();
  }

  void Finish() {
    done_ = true;
    if (parser_->keep_alive() && buffer_.size() == 0) {
      pool_->Give(loop_, key_, std::move(stream_));
    } else {
      Close();
    }
    if (cb_.on_done) cb_.on_done(Status::Ok());
    cb_ = {};
    Settled();
  }

  // A pooled connection the engine closed while it idled: once, a fresh connection instead.
  void RetryOrFail(beast::error_code ec) {
    const bool stale = ec == net::error::eof || ec == http::error::end_of_stream ||
                       ec == net::error::connection_reset || ec == net::error::broken_pipe;
    if (!reused_ || !stale) return Fail(ErrorOf("cannot talk to", ec));
    ++pool_->retried;
    reused_ = false;
    Close();
    stream_ = std::make_unique<Stream>(exec_);
    buffer_.clear();
    Resolve();
  }

  // A timeout is kTimeout once the response has begun (the peer has the request); before, a
  // timeout here is of a send that did not finish: not delivered.
  Status ErrorOf(std::string_view what, beast::error_code ec) const {
    const std::string m = fmt::format("{} {}: {}", what, key_, ec.message());
    return ec == beast::error::timeout && head_ ? Status(StatusCode::kTimeout, m) : Internal(m);
  }

  void Fail(Status s) {
    if (done_) return;
    done_ = true;
    ++pool_->failed;
    timer_.cancel();
    Close();
    if (cb_.on_done) cb_.on_done(s);
    cb_ = {};
    Settled();
  }

  void Close() {
    if (!stream_) return;
    beast::error_code ignored;
    stream_->socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_->close();
  }

  const std::shared_ptr<HttpClient::Pool> pool_;
  const HttpEndpoint endpoint_;
  const std::string key_;  // endpoint_.Key()
  const HttpCallSpec spec_;
  HttpCallbacks cb_;
  const std::size_t loop_;
  std::unique_ptr<Stream> stream_;
  const Executor exec_;
  Timer timer_;  // the name's lookup, then the wait for the response head
  bool reused_ = false;
  bool done_ = false;
  bool head_ = false;            // the response head came
  bool awaiting_head_ = false;   // the head's read is pending
  bool head_timed_out_ = false;  // timer_ ended the wait for it
  bool delivered_ = false;       // then: the peer had acknowledged the whole request
  bool paused_ = false;          // Pause: read no more of the body
  bool stalled_ = false;         // a read was due while paused
  bool in_data_ = false;         // on_data runs
  SteadyTime head_deadline_;
  std::optional<tcp::resolver> resolver_;
  std::string request_head_;  // the request line and headers as written
  beast::flat_buffer buffer_ = TakeReadBuffer();
  std::optional<http::response_parser<http::buffer_body>> parser_;
  char body_[16 * 1024];
};

}  // namespace

HttpClient::HttpClient(HttpIo& io, Options options) : pool_(std::make_shared<Pool>(io.impl(), options)) {
  net::post(pool_->reaper.get_executor(), [pool = pool_] { ArmReaper(pool); });
}

HttpClient::~HttpClient() {
  Stop();
  pool_->Reap(std::chrono::steady_clock::now(), true);
}

void HttpClient::Stop() {
  if (!pool_->stopped.exchange(true)) {
    net::post(pool_->reaper.get_executor(), [weak = std::weak_ptr<Pool>(pool_)] {
      if (auto p = weak.lock()) p->reaper.cancel();
    });
  }
  std::vector<std::shared_ptr<HttpCall>> calls;
  {
    KvMutexLock g(pool_->mu);
    for (auto& [raw, weak] : pool_->live) {
      if (auto c = weak.lock()) calls.push_back(std::move(c));
    }
  }
  for (auto& c : calls) c->Cancel();
  calls.clear();
  if (pool_->io.OnLoop() || pool_->io.stopped()) return;
  KvMutexLock g(pool_->mu);
  pool_->no_calls.wait_for(pool_->mu, std::chrono::seconds(5), [&] {
    pool_->mu.AssertHeld();
    return pool_->live.empty();
  });
}

void HttpClient::DropIdle(const HttpEndpoint& endpoint) {
  const std::string key = endpoint.Key();
  pool_->Reap(std::chrono::steady_clock::now(), true, &key);
}

std::shared_ptr<HttpCall> HttpClient::Start(const HttpEndpoint& endpoint, HttpCallSpec spec, HttpCallbacks callbacks) {
  std::string key = endpoint.Key();
  auto claim = pool_->Claim(key);
  auto call = std::make_shared<Call>(pool_, endpoint, std::move(key), std::move(claim), std::move(spec),
                                     std::move(callbacks));
  call->Run();
  return call;
}

Result<HttpClient::Response> HttpClient::Fetch(const HttpEndpoint& endpoint, HttpCallSpec spec) {
  auto response = std::make_shared<Response>();
  std::promise<Status> done;
  auto future = done.get_future();
  Start(endpoint, std::move(spec),
        {.on_head = [response](int status, const HttpHeaders& headers) {
           response->status = status;
           response->headers = headers;
         },
         .on_data = [response](std::string_view data) { response->body.append(data); },
         .on_done = [&done](const Status& s) { done.set_value(s); }});
  const Status s = future.get();
  if (!s.ok()) return s;
  return std::move(*response);
}

HttpClient::Counters HttpClient::counters() const {
  return {.connects = pool_->connects.load(),
          .reused = pool_->reused.load(),
          .retried = pool_->retried.load(),
          .failed = pool_->failed.load(),
          .reaped = pool_->reaped.load(),
          .idle = pool_->IdleCount()};
}

}  // namespace kvrouter
