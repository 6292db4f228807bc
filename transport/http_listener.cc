#include "transport/http_listener.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <atomic>
#include <cctype>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <unordered_set>

#include "events/base/clock.h"
#include "events/base/thread_annotations.h"
#include "transport/http_io_impl.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cerrno>

#include <future>

namespace kvrouter {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
// A connection lives on its loop, whose one thread runs every handler of it (no strand: a strand
// would queue each completion and each reply call once more). Its socket and stream are typed on
// the loop's executor rather than type-erased: an asynchronous operation then copies no executor
// onto the heap.
using Executor = HttpIo::Impl::Executor;
using Socket = net::basic_stream_socket<tcp, Executor>;
using Stream = beast::basic_stream<tcp, Executor>;

std::optional<std::string_view> HttpRequest::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (k == name) return std::string_view(v);
  }
  return std::nullopt;
}

std::string_view HttpRequest::Path() const {
  const std::string_view t = target;
  return t.substr(0, t.find('?'));
}

namespace {

class Session;

// Sockets are not handed to programs this one starts (Asio opens them without FD_CLOEXEC).
void CloseOnExec(int fd) {
  if (fd >= 0) (void)::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC);
}

// A parsed Beast request as the handler sees it: header names in lower case.
HttpRequest ToRequest(http::request<http::string_body>&& req) {
  HttpRequest r;
  r.method = std::string(req.method_string());
  r.target = std::string(req.target());
  r.headers.reserve(std::distance(req.begin(), req.end()));
  for (const auto& f : req) {
    std::string name(f.name_string());
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    r.headers.emplace_back(std::move(name), std::string(f.value()));
  }
  r.body = std::move(req.body());
  return r;
}

// This process's resident memory in kB (/proc/self/statm), 0 when unreadable.
std::uint64_t ResidentKb() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  unsigned long long size = 0, resident = 0;
  const bool read = std::fscanf(f, "%llu %llu", &size, &resident) == 2;
  std::fclose(f);
  return read ? resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)) / 1024 : 0;
}

void Limit(http::request_parser<http::string_body>& p, std::size_t max_header_bytes, std::size_t max_body_bytes) {
  p.header_limit(static_cast<std::uint32_t>(std::min<std::size_t>(max_header_bytes, UINT32_MAX)));
  p.body_limit(max_body_bytes);
}

}  // namespace

Result<HttpRequest> ParseHttpRequest(std::string_view bytes, std::size_t max_header_bytes, std::size_t max_body_bytes) {
  http::request_parser<http::string_body> p;
  Limit(p, max_header_bytes, max_body_bytes);
  p.eager(true);
  beast::error_code ec;
  std::size_t used = 0;
  while (!p.is_done() && used < bytes.size()) {
    const std::size_t n = p.put(net::buffer(bytes.data() + used, bytes.size() - used), ec);
    if (ec == http::error::need_more) break;
    if (ec == http::error::header_limit || ec == http::error::body_limit) {
      return Status(StatusCode::kOverloaded, ec.message());
    }
    if (ec) return InvalidArgument(ec.message());
    if (n == 0) break;
    used += n;
  }
  if (!p.is_done()) {
    p.put_eof(ec);
    if (ec || !p.is_done()) return InvalidArgument("incomplete request");
  }
  return ToRequest(p.release());
}

struct HttpListener::State : std::enable_shared_from_this<HttpListener::State> {
  State(HttpIo& http_io, HttpListenerOptions o, HttpRequestHandler h)
      : io(http_io.impl()),
        options(std::move(o)),
        handler(std::move(h)),
        acceptor(io.executor(0)),
        release_timer(io.executor(0)) {}

  void Accept();
  // Closes the acceptor on its loop; off the io threads waits for it, so that the port is
  // free (and a connect is refused) when it returns.
  void CloseAcceptor();
  void Forget(Session* s) {
    KvMutexLock g(mu);
    sessions.erase(s);
  }
  // A connection closed (it counts in `open` until then): wakes AwaitClosed.
  void ConnectionClosed() {
    open.fetch_sub(1);
    { KvMutexLock g(mu); }  // a waiter between its check and its wait sees the count or the notify
    closed_cv.notify_all();
  }
  // The sessions alive now.
  std::vector<std::shared_ptr<Session>> LiveSessions();
  // A request was handed to the handler; its response ended (or its connection closed). The
  // last of a burst to end arms the release of free memory.
  void RequestBegan();
  void RequestEnded();
  // On release_timer's loop: (re)starts the wait of release_memory_after, after which, if no
  // request came meanwhile, ReleaseMemory runs.
  void ArmRelease();
  void ReleaseMemory(std::uint64_t burst);

  HttpIo::Impl& io;
  const HttpListenerOptions options;
  const HttpRequestHandler handler;
  tcp::acceptor acceptor;
  std::uint16_t port = 0;  // bound port, read at Start
  std::atomic<bool> stopped{false};
  std::atomic<bool> draining{false};  // Drain called: accepting no more, responses close their connection
  KvMutex mu;
  std::condition_variable_any closed_cv;                    // `open` fell (ConnectionClosed)
  std::unordered_set<Session*> sessions KV_GUARDED_BY(mu);  // each erases itself when destroyed
  std::atomic<std::uint64_t> connections{0}, open{0}, refused{0}, requests{0}, bad_requests{0}, timeouts{0},
      clients_gone{0}, under_way{0}, memory_releases{0};
  std::atomic<std::uint64_t> burst_peak{0};  // the most under way at once since the last release
  net::basic_waitable_timer<std::chrono::steady_clock, net::wait_traits<std::chrono::steady_clock>, Executor>
      release_timer;  // touched only on the first loop, as the acceptor
};

namespace {

// One connection: reads a request, hands it to the handler, writes its reply, and again while
// the client keeps the connection alive. Every member is touched only on the connection's loop.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(std::shared_ptr<HttpListener::State> state, Socket socket)
      : state_(std::move(state)), stream_(std::move(socket)) {}
  ~Session() {
    if (!closed_) state_->ConnectionClosed();  // never ran Shutdown (its io_context stopped)
    if (dispatched_) --state_->under_way;       // likewise; nothing is armed any more
    state_->Forget(this);
  }

  // From the acceptor's loop: the session starts on its own.
  void Run() {
    net::post(stream_.get_executor(), [self = shared_from_this()] { self->ReadHeader(); });
  }
  // Closes the connection (from Stop, on any thread).
  void Close() {
    net::post(stream_.get_executor(), [self = shared_from_this()] { self->Shutdown(); });
  }
  // The listener drains (from Drain, on any thread): a connection waiting for a request with
  // none of it arrived closes now; one with a request under way answers it and then closes.
  void EndWhenIdle() {
    net::post(stream_.get_executor(), [self = shared_from_this()] { self->CloseIfIdle(); });
  }

  // The reply's calls, run on the connection's loop; `request` names the request they answer.
  void Send(std::uint64_t request, int status, HttpHeaders headers, std::string body);
  void Begin(std::uint64_t request, int status, HttpHeaders headers);
  void Write(std::uint64_t request, std::string chunk);
  void End(std::uint64_t request);
  void Abort(std::uint64_t request);
  void SetGone(std::uint64_t request, std::function<void()> gone);
  void SetDrained(std::uint64_t request, std::size_t low_water, std::function<void()> drained);
  // Counted by the reply as Write is called (before the call reaches the loop), so that a
  // producer reading it right after its Write sees its own bytes.
  void AddBacklog(std::size_t n) { backlog_ += n; }
  std::size_t Backlog() const { return backlog_.load(); }
  Executor executor() { return stream_.get_executor(); }
  // A reply call runs at once when made on the loop's thread with none waiting; else it waits in
  // the session's own queue, run in order on the loop. Not the loop's queue: a post made on the
  // loop's thread waits in that thread's private queue until its handler returns, behind a post
  // made meanwhile from another thread, even one that follows it.
  bool CallsWaiting() const { return calls_waiting_.load(); }
  void QueueCall(std::function<void(Session&)> call) {
    bool first = false;
    {
      KvMutexLock g(calls_mu_);
      first = calls_.empty();
      calls_.push_back(std::move(call));
      calls_waiting_ = true;
    }
    if (first) net::post(stream_.get_executor(), [self = shared_from_this()] { self->RunQueuedCalls(); });
  }

 private:
  struct Out {
    enum Kind { kWhole, kHead, kChunk, kLast } kind = kWhole;
    std::string whole_head;  // kWhole: the status line and headers; `data` is the body
    std::shared_ptr<http::response<http::empty_body>> head;
    std::shared_ptr<http::response_serializer<http::empty_body>> head_writer;
    std::string data;
  };

  void ReadHeader();
  void OnHeader(beast::error_code ec);
  void ReadBody();
  void OnBody(beast::error_code ec);
  // A read of the request that failed: answered (413, 400) or closed. False when ec is no error.
  bool ReadFailed(beast::error_code ec);
  // Answers a request the handler never saw, then closes.
  void Refuse(int status, std::string_view message);
  void Dispatch();
  void WatchClient();
  void Enqueue(Out out);
  void WriteNext();
  void OnWritten(beast::error_code ec, Out::Kind kind);
  void ResponseDone();
  // Takes `n` bytes off the backlog (written or dropped) and runs the drained callback once it
  // is low enough.
  void Drained(std::size_t n);
  // Runs `drained` next on the loop (never inside the reply call that got here), unless the
  // response has ended or the connection closed meanwhile.
  void RunDrained(std::function<void()> drained) {
    net::post(stream_.get_executor(), [self = shared_from_this(), r = request_, d = std::move(drained)] {
      if (self->Current(r) && !self->closed_) d();
    });
  }
  void ClientGone();
  void CloseIfIdle();
  // Runs the calls queued so far; calls_waiting_ stays set while any is left, so that a call
  // made by one of them waits behind the rest. Those queued meanwhile have their own turn (their
  // QueueCall found the queue empty and posted it): other handlers of the loop run in between.
  void RunQueuedCalls() {
    std::deque<std::function<void(Session&)>> batch;
    {
      KvMutexLock g(calls_mu_);
      batch.swap(calls_);
    }
    for (auto& call : batch) call(*this);
    KvMutexLock g(calls_mu_);
    if (calls_.empty()) calls_waiting_ = false;
  }
  // The response is complete and the connection ends: the write side is shut (the client reads
  // the whole response and its end), and what the client still sends is read and dropped for at
  // most linger_timeout and linger_max_bytes before the close. A close with unread bytes would
  // reset the connection, and a client still uploading (a body refused with 413) would lose the
  // answer it has not read yet.
  void Linger();
  void Discard();
  void Shutdown();
  bool Current(std::uint64_t request) const { return request == request_ && responding_; }
  // The request handed to the handler is over (answered, or its connection closed).
  void RequestOver() {
    if (std::exchange(dispatched_, false)) state_->RequestEnded();
  }

  template <typename Response>
  void Fill(Response& res, int status, HttpHeaders&& headers) {
    res.result(static_cast<unsigned>(status));
    res.version(version_);
    res.set(http::field::server, state_->options.server_name);
    for (auto& [k, v] : headers) res.insert(k, v);  // a name given twice is sent twice
    if (state_->draining.load()) keep_alive_ = false;
    res.keep_alive(keep_alive_);
  }

  static std::string_view Reason(int status) {
    const beast::string_view r = http::obsolete_reason(static_cast<http::status>(status));
    return {r.data(), r.size()};
  }
  // A whole response's head, written here as Fill and prepare_payload would have Beast write it
  // (its fields take an allocation per header). A header with a line break is left out.
  std::string WholeHead(int status, const HttpHeaders& headers, std::size_t length) {
    if (state_->draining.load()) keep_alive_ = false;
    std::string head;
    head.reserve(128 + headers.size() * 48);
    fmt::format_to(std::back_inserter(head), "HTTP/1.{} {} {}\r\nServer: {}\r\n", version_ >= 11 ? 1 : 0, status,
                   Reason(status), state_->options.server_name);
    for (const auto& [k, v] : headers) {  // a name given twice is sent twice
      if (!HasLineBreak(k) && !HasLineBreak(v)) head.append(k).append(": ").append(v).append("\r\n");
    }
    if (version_ >= 11 && !keep_alive_) head.append("Connection: close\r\n");
    if (version_ < 11 && keep_alive_) head.append("Connection: keep-alive\r\n");
    if (status >= 200 && status != 204 && status != 304)
      fmt::format_to(std::back_inserter(head), "Content-Length: {}\r\n", length);
    head.append("\r\n");
    return head;
  }

  static constexpr std::size_t kReadPiece = 4 * 1024;
  const std::shared_ptr<HttpListener::State> state_;
  Stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  unsigned version_ = 11;
  bool keep_alive_ = false;
  bool first_ = true;        // no request read yet on this connection
  bool reading_body_ = false;  // a request's headers came, its body is being read
  bool responding_ = false;  // a request was handed to the handler and its reply is not done
  bool dispatched_ = false;  // it counts in the listener's under_way (a refused one does not)
  bool closed_ = false;     // Shutdown ran: the socket is closed
  char peeked_ = 0;         // WatchClient's peek
  bool lingering_ = false;  // Linger ran: the response went, the client's bytes are dropped
  std::size_t linger_left_ = 0;  // bytes Linger still reads before it closes
  SteadyTime linger_end_;  // Linger closes then at the latest
  bool writing_ = false;
  bool head_sent_ = false;
  bool finishing_ = false;     // the last piece of the reply is queued
  std::uint64_t request_ = 0;  // number of the request being answered
  std::deque<Out> out_;
  std::atomic<std::size_t> backlog_{0};
  std::function<void()> gone_;
  std::function<void()> drained_;  // OnDrained's, run when backlog_ <= drain_at_
  std::size_t drain_at_ = 0;
  KvMutex calls_mu_;
  std::deque<std::function<void(Session&)>> calls_ KV_GUARDED_BY(calls_mu_);  // QueueCall's
  std::atomic<bool> calls_waiting_{false};  // calls_ has calls, or RunQueuedCalls runs them
};

class ReplyImpl final : public HttpReply {
 public:
  ReplyImpl(std::shared_ptr<Session> s, std::uint64_t request) : s_(std::move(s)), request_(request) {}
  ~ReplyImpl() override {
    // Dropped without a complete answer: the connection ends (Abort is a no-op after End/Send).
    if (!finished_.load()) Abort();
  }
  void Send(int status, HttpHeaders headers, std::string body) override {
    finished_ = true;
    Post([status, h = std::move(headers), b = std::move(body)](Session& s, std::uint64_t r) mutable {
      s.Send(r, status, std::move(h), std::move(b));
    });
  }
  void Begin(int status, HttpHeaders headers) override {
    Post([status, h = std::move(headers)](Session& s, std::uint64_t r) mutable { s.Begin(r, status, std::move(h)); });
  }
  void Write(std::string chunk) override {
    if (chunk.empty()) return;  // an empty chunk would end the stream
    s_->AddBacklog(chunk.size());
    Post([c = std::move(chunk)](Session& s, std::uint64_t r) mutable { s.Write(r, std::move(c)); });
  }
  void End() override {
    finished_ = true;
    Post([](Session& s, std::uint64_t r) { s.End(r); });
  }
  void Abort() override {
    finished_ = true;
    Post([](Session& s, std::uint64_t r) { s.Abort(r); });
  }
  void OnClientGone(std::function<void()> gone) override {
    Post([g = std::move(gone)](Session& s, std::uint64_t r) mutable { s.SetGone(r, std::move(g)); });
  }
  std::size_t Backlog() const override { return s_->Backlog(); }
  void OnDrained(std::size_t low_water, std::function<void()> drained) override {
    Post([low_water, d = std::move(drained)](Session& s, std::uint64_t r) mutable {
      s.SetDrained(r, low_water, std::move(d));
    });
  }
  void Defer(std::function<void()> task) override { net::post(s_->executor(), std::move(task)); }

 private:
  // At once when called on the connection's loop and no call waits (the session calls back into
  // no caller from these: its callbacks are posted), else queued behind the waiting ones. A call
  // made elsewhere meanwhile is concurrent with it; one made after it returned queues behind it.
  template <typename F>
  void Post(F&& f) {
    Session& s = *s_;
    if (!s.CallsWaiting() && s.executor().running_in_this_thread()) return f(s, request_);
    s.QueueCall([r = request_, f = std::forward<F>(f)](Session& session) mutable { f(session, r); });
  }
  const std::shared_ptr<Session> s_;
  const std::uint64_t request_;
  std::atomic<bool> finished_{false};
};

void Session::ReadHeader() {
  if (closed_) return;
  // Beast reads what the buffer has room for, and at least 512 bytes: a buffer grown one read
  // at a time reads a request 512 bytes per system call. Room for a usual request at once (an
  // idle connection keeps it).
  buffer_.reserve(kReadPiece);
  parser_.emplace();
  Limit(*parser_, state_->options.max_header_bytes, state_->options.max_body_bytes);
  stream_.expires_after(first_ ? state_->options.header_timeout : state_->options.idle_timeout);
  http::async_read_header(stream_, buffer_, *parser_,
                          [self = shared_from_this()](beast::error_code ec, std::size_t) { self->OnHeader(ec); });
}

bool Session::ReadFailed(beast::error_code ec) {
  if (!ec) return false;
  if (ec == http::error::body_limit) {  // from Content-Length in the headers, before any of the body
    Refuse(413, fmt::format("the body is over the limit of {} bytes", state_->options.max_body_bytes));
  } else if (ec == beast::error::timeout) {
    ++state_->timeouts;
    Shutdown();
  } else if (ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::connection_reset ||
             ec == net::error::operation_aborted) {
    Shutdown();
  } else {
    Refuse(400, fmt::format("malformed request: {}", ec.message()));
  }
  return true;
}

void Session::OnHeader(beast::error_code ec) {
  first_ = false;
  if (ec == http::error::header_limit) return Refuse(431, "the request's headers are too large");
  if (ReadFailed(ec)) return;
  reading_body_ = true;
  const auto& req = parser_->get();
  version_ = req.version();
  keep_alive_ = req.keep_alive();
  if (beast::iequals(req[http::field::expect], "100-continue")) {
    auto cont = std::make_shared<http::response<http::empty_body>>(http::status::continue_, version_);
    stream_.expires_after(state_->options.write_timeout);
    http::async_write(stream_, *cont, [self = shared_from_this(), cont](beast::error_code e, std::size_t) {
      if (e) return self->Shutdown();
      self->ReadBody();
    });
    return;
  }
  ReadBody();
}

void Session::ReadBody() {
  stream_.expires_after(state_->options.body_timeout);
  http::async_read(stream_, buffer_, *parser_,
                   [self = shared_from_this()](beast::error_code ec, std::size_t) { self->OnBody(ec); });
}

void Session::OnBody(beast::error_code ec) {
  if (ReadFailed(ec)) return;
  Dispatch();
}

void Session::Refuse(int status, std::string_view message) {
  ++state_->bad_requests;
  keep_alive_ = false;
  reading_body_ = false;
  std::string type = "text/plain; charset=utf-8";
  std::string body = std::string(message) + "\n";
  if (state_->options.error_body) std::tie(type, body) = state_->options.error_body(status, message);
  std::string head = WholeHead(status, {{"content-type", type}}, body.size());
  responding_ = true;
  ++request_;
  finishing_ = true;
  Enqueue({.kind = Out::kWhole, .whole_head = std::move(head), .data = std::move(body)});
}

void Session::Dispatch() {
  HttpRequest r = ToRequest(parser_->release());
  reading_body_ = false;
  responding_ = true;
  head_sent_ = false;
  finishing_ = false;
  ++request_;
  ++state_->requests;
  dispatched_ = true;
  state_->RequestBegan();
  stream_.expires_never();  // the handler may take its time; writes set their own deadline
  WatchClient();
  state_->handler(std::move(r), std::make_shared<ReplyImpl>(shared_from_this(), request_));
}

void Session::WatchClient() {
  // A byte peeked (the next request came early: it is read once this response is done), the end
  // of the stream or an error (the client left). A receive, not a wait for readiness: Asio
  // re-arms epoll for every wait (a system call per request), not for a receive.
  //
  // The end seen after the response went still closes the connection: this peek took epoll's
  // edge for it, and Asio starts the next read (ReadHeader's) without trying it first after a
  // receive that found the socket empty, so that read would wait until the idle timeout. The
  // handler does not ask which request it watched: every end of a response (ResponseDone,
  // Linger, Shutdown) cancels the peek first, so one that ends otherwise is about this request.
  stream_.socket().async_receive(net::buffer(&peeked_, 1), tcp::socket::message_peek,
                                 [self = shared_from_this()](beast::error_code ec, std::size_t n) {
                                   if (self->closed_ || ec == net::error::operation_aborted) return;
                                   if (ec || n == 0) self->ClientGone();
                                 });
}

void Session::SetGone(std::uint64_t request, std::function<void()> gone) {
  if (!Current(request)) {
    if (closed_ && request == request_) net::post(stream_.get_executor(), std::move(gone));  // it already went
    return;
  }
  gone_ = std::move(gone);
}

void Session::Send(std::uint64_t request, int status, HttpHeaders headers, std::string body) {
  if (!Current(request) || finishing_ || head_sent_) return;
  std::string head = WholeHead(status, headers, body.size());
  finishing_ = true;
  Enqueue({.kind = Out::kWhole, .whole_head = std::move(head), .data = std::move(body)});
}

void Session::Begin(std::uint64_t request, int status, HttpHeaders headers) {
  if (!Current(request) || finishing_ || head_sent_) return;
  auto res = std::make_shared<http::response<http::empty_body>>();
  // HTTP/1.0 has no chunked encoding: the body runs until the connection closes.
  if (version_ < 11) keep_alive_ = false;
  Fill(*res, status, std::move(headers));
  res->chunked(version_ >= 11);
  head_sent_ = true;
  auto writer = std::make_shared<http::response_serializer<http::empty_body>>(*res);
  Enqueue({.kind = Out::kHead, .head = std::move(res), .head_writer = std::move(writer)});
}

void Session::SetDrained(std::uint64_t request, std::size_t low_water, std::function<void()> drained) {
  if (!Current(request) || closed_) return;
  if (backlog_.load() <= low_water) return RunDrained(std::move(drained));
  drain_at_ = low_water;
  drained_ = std::move(drained);
}

void Session::Write(std::uint64_t request, std::string chunk) {
  if (!Current(request) || finishing_ || !head_sent_ || closed_) return Drained(chunk.size());
  Enqueue({.kind = Out::kChunk, .data = std::move(chunk)});
}

void Session::Drained(std::size_t n) {
  backlog_ -= n;
  if (drained_ && backlog_.load() <= drain_at_) RunDrained(std::exchange(drained_, nullptr));
}

void Session::End(std::uint64_t request) {
  if (!Current(request) || finishing_) return;
  if (!head_sent_) return Abort(request);  // End without Begin: nothing sensible to send
  finishing_ = true;
  Enqueue({.kind = Out::kLast});
}

void Session::Abort(std::uint64_t request) {
  if (request != request_ || closed_) return;
  if (!responding_) return;  // already answered
  Shutdown();
}

void Session::Enqueue(Out out) {
  out_.push_back(std::move(out));
  if (!writing_) WriteNext();
}

void Session::WriteNext() {
  if (out_.empty() || closed_) return;
  writing_ = true;
  Out& o = out_.front();
  stream_.expires_after(state_->options.write_timeout);
  auto done = [self = shared_from_this(), kind = o.kind](beast::error_code ec, std::size_t) {
    self->OnWritten(ec, kind);
  };
  switch (o.kind) {
    case Out::kWhole:
      net::async_write(stream_, std::array<net::const_buffer, 2>{net::buffer(o.whole_head), net::buffer(o.data)},
                       std::move(done));
      break;
    case Out::kHead: http::async_write_header(stream_, *o.head_writer, std::move(done)); break;
    case Out::kChunk:
      if (version_ >= 11) {
        net::async_write(stream_, http::make_chunk(net::buffer(o.data)), std::move(done));
      } else {
        net::async_write(stream_, net::buffer(o.data), std::move(done));
      }
      break;
    case Out::kLast:
      if (version_ >= 11) {
        net::async_write(stream_, http::make_chunk_last(), std::move(done));
      } else {
        net::async_write(stream_, net::const_buffer(), std::move(done));  // the close ends it
      }
      break;
  }
}

void Session::OnWritten(beast::error_code ec, Out::Kind kind) {
  writing_ = false;
  if (!out_.empty()) {
    if (kind == Out::kChunk) Drained(out_.front().data.size());
    out_.pop_front();
  }
  if (closed_) return;
  if (ec) {
    if (ec == beast::error::timeout) ++state_->timeouts;
    return ClientGone();
  }
  if (kind == Out::kWhole || kind == Out::kLast) return ResponseDone();
  WriteNext();
}

void Session::ResponseDone() {
  responding_ = false;
  RequestOver();
  gone_ = nullptr;
  drained_ = nullptr;
  if (!keep_alive_ || state_->draining.load()) return Linger();
  // The client-gone watch may still be pending: cancel it before reading again.
  beast::error_code ignored;
  stream_.socket().cancel(ignored);
  ReadHeader();
}

void Session::ClientGone() {
  if (closed_) return;
  const bool mid_response = responding_;
  auto gone = std::move(gone_);
  Shutdown();
  if (mid_response) {
    ++state_->clients_gone;
    if (gone) gone();
  }
}

void Session::CloseIfIdle() {
  // A request under way (its body being read, or its response) closes its connection when answered.
  if (closed_ || lingering_ || reading_body_ || responding_) return;
  if (buffer_.size() > 0) return;  // part of a request came: it is read and answered
  char byte;
  const ssize_t n = ::recv(stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return;  // likewise, still in the socket
  Shutdown();
}

void Session::Linger() {
  if (closed_ || lingering_) return;
  lingering_ = true;
  beast::error_code ignored;
  stream_.socket().cancel(ignored);  // the client-gone watch
  stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  linger_left_ = state_->options.linger_max_bytes;
  buffer_.consume(buffer_.size());
  linger_end_ = std::chrono::steady_clock::now() + state_->options.linger_timeout;
  Discard();
}

void Session::Discard() {
  if (closed_) return;
  constexpr std::size_t kPiece = 16 * 1024;
  stream_.expires_at(std::min(std::chrono::steady_clock::now() + state_->options.linger_idle, linger_end_));
  stream_.async_read_some(buffer_.prepare(kPiece), [self = shared_from_this()](beast::error_code ec, std::size_t n) {
    // The client closed (or reset, or the time is up): the close below sends nothing it could lose.
    if (ec || n >= self->linger_left_) return self->Shutdown();
    self->linger_left_ -= n;
    self->Discard();
  });
}

void Session::Shutdown() {
  if (closed_) return;
  closed_ = true;
  responding_ = false;
  RequestOver();
  drained_ = nullptr;
  // The piece being written stays until its write completes (aborted by the close below): the
  // write reads its buffers until then.
  while (out_.size() > (writing_ ? 1u : 0u)) {
    if (out_.back().kind == Out::kChunk) backlog_ -= out_.back().data.size();
    out_.pop_back();
  }
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
  stream_.close();
  state_->ConnectionClosed();
}

}  // namespace

void HttpListener::State::Accept() {
  // Each connection on the next loop in turn, for its life.
  acceptor.async_accept(io.executor(io.Next()), [self = shared_from_this()](beast::error_code ec, Socket socket) {
    if (self->stopped.load()) return;
    if (!ec) {
      ++self->connections;
      CloseOnExec(socket.native_handle());
      // Responses go out in pieces (head, chunks): no waiting for the client's delayed ACKs.
      beast::error_code nodelay_ec;
      socket.set_option(tcp::no_delay(true), nodelay_ec);
      if (self->open.load() >= self->options.max_connections) {
        ++self->refused;
        beast::error_code ignored;
        socket.close(ignored);
      } else {
        ++self->open;
        auto session = std::make_shared<Session>(self, std::move(socket));
        {
          KvMutexLock g(self->mu);
          self->sessions.insert(session.get());
        }
        // Stop may have taken its list of sessions before this one joined it.
        if (self->stopped.load()) return session->Close();
        session->Run();
      }
    }
    // Draining: the connection accepted as the acceptor closed is served (as draining), and no
    // other is taken.
    if (self->draining.load()) return;
    if (ec == net::error::no_descriptors || ec == net::error::no_buffer_space || ec == net::error::no_memory ||
        ec.value() == ENFILE) {
      // Out of descriptors (EMFILE) and the like: the error would repeat at once, so the next
      // try waits a little instead of spinning a thread.
      auto pause = std::make_shared<net::steady_timer>(self->acceptor.get_executor(), std::chrono::milliseconds(50));
      return pause->async_wait([self, pause](beast::error_code) {
        if (!self->stopped.load() && !self->draining.load()) self->Accept();
      });
    }
    self->Accept();
  });
}

void HttpListener::State::RequestBegan() {
  const std::uint64_t now = ++under_way;
  std::uint64_t peak = burst_peak.load();
  while (now > peak && !burst_peak.compare_exchange_weak(peak, now)) {
  }
}

void HttpListener::State::RequestEnded() {
  if (--under_way != 0 || options.release_memory_after.count() <= 0) return;
  if (burst_peak.load() < options.release_memory_burst) return;
  net::post(release_timer.get_executor(), [self = shared_from_this()] { self->ArmRelease(); });
}

void HttpListener::State::ArmRelease() {
  if (stopped.load()) return;
  release_timer.expires_after(options.release_memory_after);  // a wait pending is cancelled
  release_timer.async_wait([self = shared_from_this()](beast::error_code ec) {
    if (ec || self->stopped.load() || self->under_way.load() != 0) return;  // the next end re-arms
    const std::uint64_t burst = self->burst_peak.exchange(0);
    if (burst >= self->options.release_memory_burst) self->ReleaseMemory(burst);
  });
}

namespace {

// tcmalloc's call that gives its free pages back (gperftools' C API), when the program is linked
// with it (kvgateway is: docs/performance.md); looked up, so that no header or library of it is
// needed where it is absent.
using ReleaseFreeMemoryFn = void (*)();
ReleaseFreeMemoryFn TcmallocRelease() {
  static const auto release =
      reinterpret_cast<ReleaseFreeMemoryFn>(::dlsym(RTLD_DEFAULT, "MallocExtension_ReleaseFreeMemory"));
  return release;
}

}  // namespace

void HttpListener::State::ReleaseMemory(std::uint64_t burst) {
#if defined(__GLIBC__)
  const std::uint64_t before = ResidentKb();
  const auto start = std::chrono::steady_clock::now();
  if (const ReleaseFreeMemoryFn release = TcmallocRelease()) {
    release();  // its page heap's free spans (glibc's arenas hold nothing: tcmalloc serves malloc)
  } else {
    // Every arena's free pages, not only the top of each heap (all that free() gives back): the
    // I/O threads' arenas hold most of what a burst freed, below chunks that are still in use.
    (void)malloc_trim(0);
  }
  const auto took = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start);
  ++memory_releases;
  // At most once a burst (a burst needs release_memory_burst requests at once).
  fmt::print(stderr, "{} I http: free memory returned after a burst of {} requests at once (RSS {} -> {} kB, {} us)\n",
             options.server_name, burst, before, ResidentKb(), took.count());
#else
  (void)burst;
#endif
}

HttpListener::HttpListener(std::shared_ptr<State> state) : state_(std::move(state)) {}

Result<std::unique_ptr<HttpListener>> HttpListener::Start(HttpIo& io, HttpListenerOptions options,
                                                          HttpRequestHandler handler) {
  auto state = std::make_shared<State>(io, std::move(options), std::move(handler));
  beast::error_code ec;
  const auto address = net::ip::make_address(state->options.host, ec);
  if (ec) return InvalidArgument(fmt::format("bad listen address '{}': {}", state->options.host, ec.message()));
  const tcp::endpoint endpoint(address, state->options.port);
  state->acceptor.open(endpoint.protocol(), ec);
  if (!ec) CloseOnExec(state->acceptor.native_handle());
  if (!ec) state->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) state->acceptor.bind(endpoint, ec);
  if (!ec) state->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return Internal(fmt::format("cannot listen on {}:{}: {}", state->options.host, state->options.port, ec.message()));
  }
  state->port = state->acceptor.local_endpoint(ec).port();
  net::post(state->acceptor.get_executor(), [state] { state->Accept(); });
  return std::unique_ptr<HttpListener>(new HttpListener(std::move(state)));
}

HttpListener::~HttpListener() { Stop(); }

std::uint16_t HttpListener::port() const { return state_->port; }

void HttpListener::State::CloseAcceptor() {
  auto closed = std::make_shared<std::promise<void>>();
  auto done = closed->get_future();
  net::post(acceptor.get_executor(), [self = shared_from_this(), closed] {
    beast::error_code ignored;
    self->acceptor.close(ignored);
    closed->set_value();
  });
  if (!io.OnLoop() && !io.stopped()) {
    (void)done.wait_for(std::chrono::seconds(5));
  }
}

std::vector<std::shared_ptr<Session>> HttpListener::State::LiveSessions() {
  std::vector<std::shared_ptr<Session>> live;
  KvMutexLock g(mu);
  for (Session* s : sessions) {
    if (auto p = s->weak_from_this().lock()) live.push_back(std::move(p));
  }
  return live;
}

void HttpListener::Stop() {
  if (state_->stopped.exchange(true)) return;
  net::post(state_->release_timer.get_executor(), [state = state_] { state->release_timer.cancel(); });
  state_->CloseAcceptor();
  for (auto& s : state_->LiveSessions()) s->Close();
}

void HttpListener::Drain() {
  if (state_->stopped.load() || state_->draining.exchange(true)) return;
  state_->CloseAcceptor();
  for (auto& s : state_->LiveSessions()) s->EndWhenIdle();
}

bool HttpListener::AwaitClosed(std::chrono::milliseconds timeout) {
  KvMutexLock g(state_->mu);
  return state_->closed_cv.wait_for(state_->mu, timeout, [&] { return state_->open.load() == 0; });
}

HttpListener::Counters HttpListener::counters() const {
  return {.connections = state_->connections.load(),
          .open = state_->open.load(),
          .refused = state_->refused.load(),
          .requests = state_->requests.load(),
          .bad_requests = state_->bad_requests.load(),
          .timeouts = state_->timeouts.load(),
          .clients_gone = state_->clients_gone.load(),
          .under_way = state_->under_way.load(),
          .memory_releases = state_->memory_releases.load()};
}

}  // namespace kvrouter
