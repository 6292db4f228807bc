#include "transport/http_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <future>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "events/base/clock.h"
#include "transport/http_io_impl.h"

#include <fcntl.h>

#include <boost/asio/steady_timer.hpp>

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

struct HttpClient::Pool {
  struct Idle {
    std::unique_ptr<beast::tcp_stream> stream;
    SteadyTime since;
  };

  Pool(net::io_context& c, Options o) : ioc(c), options(o) {}

  // A pooled connection to `key` that has not idled too long, or null.
  std::unique_ptr<beast::tcp_stream> Take(const std::string& key) {
    std::lock_guard g(mu);
    auto it = idle.find(key);
    if (it == idle.end()) return nullptr;
    const SteadyTime now = std::chrono::steady_clock::now();
    while (!it->second.empty()) {
      Idle i = std::move(it->second.back());
      it->second.pop_back();
      if (now - i.since < options.max_idle) return std::move(i.stream);
      beast::error_code ignored;
      i.stream->socket().close(ignored);
    }
    return nullptr;
  }
  void Give(const std::string& key, std::unique_ptr<beast::tcp_stream> stream) {
    std::lock_guard g(mu);
    auto& q = idle[key];
    if (q.size() >= options.max_idle_per_endpoint) {
      beast::error_code ignored;
      stream->socket().close(ignored);
      return;
    }
    stream->expires_never();
    q.push_back({std::move(stream), std::chrono::steady_clock::now()});
  }

  net::io_context& ioc;
  const Options options;
  std::mutex mu;
  std::unordered_map<std::string, std::vector<Idle>> idle;  // guarded by mu
  // Calls not yet done (for Stop), guarded by mu; `no_calls` is signalled when it empties.
  std::unordered_map<HttpCall*, std::weak_ptr<HttpCall>> live;
  std::condition_variable no_calls;
  std::atomic<std::uint64_t> connects{0}, reused{0}, retried{0}, failed{0};
};

namespace {

// Sockets are not handed to programs this one starts (Asio opens them without FD_CLOEXEC).
void CloseOnExec(int fd) {
  if (fd >= 0) (void)::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC);
}

class Call final : public HttpCall, public std::enable_shared_from_this<Call> {
 public:
  Call(std::shared_ptr<HttpClient::Pool> pool, HttpEndpoint endpoint, HttpCallSpec spec, HttpCallbacks cb)
      : pool_(std::move(pool)), endpoint_(std::move(endpoint)), spec_(std::move(spec)), cb_(std::move(cb)) {
    stream_ = pool_->Take(endpoint_.Key());
    reused_ = stream_ != nullptr;
    if (reused_) {
      ++pool_->reused;
    } else {
      stream_ = std::make_unique<beast::tcp_stream>(net::make_strand(pool_->ioc));
    }
    executor_ = stream_->get_executor();
  }

  void Run() {
    {
      std::lock_guard g(pool_->mu);
      pool_->live.emplace(this, weak_from_this());
    }
    net::post(executor_, [self = shared_from_this()] {
      self->stream_->expires_after(self->spec_.head_timeout);
      if (self->reused_) {
        self->Send();
      } else {
        self->Resolve();
      }
    });
  }

  void Cancel() override {
    net::post(executor_, [self = shared_from_this()] { self->Fail(Internal("cancelled")); });
  }

 private:
  void Resolve() {
    // An address needs no lookup; a name is looked up within the head timeout too.
    beast::error_code ec;
    const auto address = net::ip::make_address(endpoint_.host, ec);
    if (!ec) return Connect(tcp::resolver::results_type::create(tcp::endpoint(address, endpoint_.port), endpoint_.host,
                                                                std::to_string(endpoint_.port)));
    resolver_.emplace(executor_);
    resolve_timer_.emplace(executor_);
    resolve_timer_->expires_after(spec_.head_timeout);
    resolve_timer_->async_wait([self = shared_from_this()](beast::error_code e) {
      if (!e && self->resolver_) self->resolver_->cancel();
    });
    resolver_->async_resolve(endpoint_.host, std::to_string(endpoint_.port),
                             [self = shared_from_this()](beast::error_code e, tcp::resolver::results_type results) {
                               self->resolve_timer_->cancel();
                               if (self->done_) return;
                               if (e == net::error::operation_aborted) {
                                 return self->Fail(Status(StatusCode::kTimeout, "cannot resolve " + self->endpoint_.host + " in time"));
                               }
                               if (e) return self->Fail(Internal("cannot resolve " + self->endpoint_.host + ": " + e.message()));
                               self->Connect(std::move(results));
                             });
  }

  void Connect(tcp::resolver::results_type results) {
    stream_->async_connect(results, [self = shared_from_this()](beast::error_code e, const tcp::endpoint&) {
      if (self->done_) return;
      if (e) return self->Fail(self->ErrorOf("cannot connect to", e));
      ++self->pool_->connects;
      CloseOnExec(self->stream_->socket().native_handle());
      beast::error_code ignored;
      self->stream_->socket().set_option(tcp::no_delay(true), ignored);
      self->Send();
    });
  }

  void Send() {
    req_.method_string(spec_.method);
    req_.target(spec_.target);
    req_.version(11);
    req_.set(http::field::host, endpoint_.Key());
    for (const auto& [k, v] : spec_.headers) req_.set(k, v);
    req_.keep_alive(true);
    req_.body() = spec_.body;
    req_.prepare_payload();
    http::async_write(*stream_, req_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (self->done_) return;
      if (ec) return self->RetryOrFail(ec);
      self->ReadHead();
    });
  }

  void ReadHead() {
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(pool_->options.max_response_header_bytes));
    parser_->body_limit(std::numeric_limits<std::uint64_t>::max());  // a stream may be long
    http::async_read_header(*stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, std::size_t n) {
      if (self->done_) return;
      if (ec) return n == 0 ? self->RetryOrFail(ec) : self->Fail(self->ErrorOf("bad response from", ec));
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
    parser_->get().body().data = body_;
    parser_->get().body().size = sizeof(body_);
    stream_->expires_after(spec_.read_timeout);
    http::async_read_some(*stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (self->done_) return;
      if (ec && ec != http::error::need_buffer) return self->Fail(self->ErrorOf("response cut off by", ec));
      const std::size_t n = sizeof(self->body_) - self->parser_->get().body().size;
      if (n > 0 && self->cb_.on_data) self->cb_.on_data(std::string_view(self->body_, n));
      self->ReadBody();
    });
  }

  // Leaves the client's list of live calls (Stop waits for it to empty).
  void Settled() {
    std::lock_guard g(pool_->mu);
    pool_->live.erase(this);
    if (pool_->live.empty()) pool_->no_calls.notify_all();
  }

  void Finish() {
    done_ = true;
    if (parser_->keep_alive() && buffer_.size() == 0) {
      pool_->Give(endpoint_.Key(), std::move(stream_));
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
    stream_ = std::make_unique<beast::tcp_stream>(executor_);
    buffer_.clear();
    req_ = {};
    stream_->expires_after(spec_.head_timeout);
    Resolve();
  }

  Status ErrorOf(std::string_view what, beast::error_code ec) const {
    const std::string m = fmt::format("{} {}: {}", what, endpoint_.Key(), ec.message());
    return ec == beast::error::timeout ? Status(StatusCode::kTimeout, m) : Internal(m);
  }

  void Fail(Status s) {
    if (done_) return;
    done_ = true;
    ++pool_->failed;
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
  const HttpCallSpec spec_;
  HttpCallbacks cb_;
  std::unique_ptr<beast::tcp_stream> stream_;
  net::any_io_executor executor_;
  bool reused_ = false;
  bool done_ = false;
  std::optional<tcp::resolver> resolver_;
  std::optional<net::steady_timer> resolve_timer_;
  http::request<http::string_body> req_;
  beast::flat_buffer buffer_;
  std::optional<http::response_parser<http::buffer_body>> parser_;
  char body_[16 * 1024];
};

}  // namespace

HttpClient::HttpClient(HttpIo& io, Options options) : pool_(std::make_shared<Pool>(io.impl().ioc, options)) {}

HttpClient::~HttpClient() {
  Stop();
  std::lock_guard g(pool_->mu);
  for (auto& [key, q] : pool_->idle) {
    for (auto& i : q) {
      beast::error_code ignored;
      i.stream->socket().close(ignored);
    }
  }
  pool_->idle.clear();
}

void HttpClient::Stop() {
  std::vector<std::shared_ptr<HttpCall>> calls;
  {
    std::lock_guard g(pool_->mu);
    for (auto& [raw, weak] : pool_->live) {
      if (auto c = weak.lock()) calls.push_back(std::move(c));
    }
  }
  for (auto& c : calls) c->Cancel();
  calls.clear();
  if (pool_->ioc.get_executor().running_in_this_thread() || pool_->ioc.stopped()) return;
  std::unique_lock g(pool_->mu);
  pool_->no_calls.wait_for(g, std::chrono::seconds(5), [&] { return pool_->live.empty(); });
}

std::shared_ptr<HttpCall> HttpClient::Start(const HttpEndpoint& endpoint, HttpCallSpec spec, HttpCallbacks callbacks) {
  auto call = std::make_shared<Call>(pool_, endpoint, std::move(spec), std::move(callbacks));
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
          .failed = pool_->failed.load()};
}

}  // namespace kvrouter
