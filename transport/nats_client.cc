#include "transport/nats_client.h"

#include "transport/thread_annotations.h"

#include <nats/nats.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>

#include <fmt/format.h>

#include "transport/log.h"

// How the nats.c 3.4.1 threading model is used here (facts from nats.h and nats.c's sources):
// - Every asynchronous subscription gets its own delivery thread (we force this with
//   natsOptions_UseGlobalMessageDelivery(false), whatever NATS_DEFAULT_TO_LIB_MSG_DELIVERY says).
//   When the subscription is closed (unsubscribe, drain end, or connection close) that thread
//   stops dispatching, and after the last handler call has returned it invokes the
//   subscription's on-complete callback. That callback is what Subscription's destructor waits
//   for.
// - Connection callbacks (disconnected, reconnected, connected, closed, async errors) run on the
//   library's single async-callback thread, in the order they were posted; "closed" is the last
//   one for a connection. NatsClient's destructor waits for it before freeing the state the
//   callbacks point at.

namespace kvrouter {
namespace transport_detail {

struct ClientShared {
  NatsClient::Callbacks callbacks;
  std::string url;
  RateLimitedLog log{std::chrono::seconds(5)};

  std::atomic<uint64_t> reconnects{0};
  std::atomic<uint64_t> disconnects{0};
  std::atomic<uint64_t> slow_consumer{0};
  std::atomic<uint64_t> callback_errors{0};
  std::atomic<uint64_t> async_errors{0};
  std::atomic<bool> closing{false};  // our own Close/Drain is under way: not a "disconnect"

  KvMutex mu;
  std::condition_variable_any cv;
  bool closed KV_GUARDED_BY(mu) = false;  // set by the closed callback

  void CountCallbackError(std::string_view where, std::string_view what) {
    callback_errors.fetch_add(1, std::memory_order_relaxed);
    log.Log(LogLevel::kError, "nats.callback_error", "{} threw: {} ({} callback errors so far)",
            where, what, callback_errors.load(std::memory_order_relaxed));
  }
};

struct SubscriptionState {
  std::shared_ptr<ClientShared> client;
  std::string subject;
  MessageHandler handler;

  KvMutex mu;
  std::condition_variable_any cv;
  bool complete KV_GUARDED_BY(mu) = false;  // the delivery thread has finished for good
  // Set when the Subscription is destroyed from inside its own handler: the on-complete
  // callback then deletes this state. Written and read only on the delivery thread.
  bool orphaned = false;
};

void ConnectionDeleter::operator()(natsConnection* nc) const { natsConnection_Destroy(nc); }
void SubscriptionDeleter::operator()(natsSubscription* sub) const { natsSubscription_Destroy(sub); }

}  // namespace transport_detail

namespace {

using transport_detail::ClientShared;
using transport_detail::SubscriptionState;

struct OptionsDeleter {
  void operator()(natsOptions* o) const { natsOptions_Destroy(o); }
};
struct MsgDeleter {
  void operator()(natsMsg* m) const { natsMsg_Destroy(m); }
};
using OptionsPtr = std::unique_ptr<natsOptions, OptionsDeleter>;
using MsgPtr = std::unique_ptr<natsMsg, MsgDeleter>;

constexpr int kPendingMsgsLimit = 1'000'000;
constexpr int kPendingBytesLimit = 1 << 30;  // 1 GiB
constexpr auto kCloseGrace = std::chrono::seconds(5);

// The subscription whose handler is running on this thread (a delivery thread runs exactly one
// subscription's handler), so that a Subscription destroyed from inside its own handler does
// not wait for itself.
thread_local SubscriptionState* tls_dispatching = nullptr;

StatusCode CodeFor(natsStatus s) {
  switch (s) {
    case NATS_TIMEOUT: return StatusCode::kTimeout;
    case NATS_NO_RESPONDERS: return StatusCode::kNotFound;
    case NATS_INSUFFICIENT_BUFFER:  // reconnect buffer full while disconnected: retry later
    case NATS_SLOW_CONSUMER: return StatusCode::kOverloaded;
    case NATS_INVALID_ARG:
    case NATS_INVALID_SUBJECT:
    case NATS_INVALID_QUEUE_NAME:
    case NATS_INVALID_TIMEOUT:
    case NATS_MAX_PAYLOAD: return StatusCode::kInvalidArgument;
    default: return StatusCode::kInternal;
  }
}

// `what` says what failed ("publish to x.y"); the text includes nats.c's own detail when the
// calling thread's last error has one.
Status FromNats(natsStatus s, std::string_view what) {
  std::string message = fmt::format("{}: {}", what, natsStatus_GetText(s));
  natsStatus last = NATS_OK;
  const char* detail = nats_GetLastError(&last);
  if (last == s && detail != nullptr && *detail != '\0' &&
      std::strcmp(detail, natsStatus_GetText(s)) != 0) {
    message += fmt::format(" ({})", detail);
  }
  return Status(CodeFor(s), std::move(message));
}

// A NUL-terminated copy of a string_view, on the stack when short (subjects usually are).
class CString {
 public:
  explicit CString(std::string_view s) {
    if (s.size() < sizeof(small_)) {
      std::memcpy(small_, s.data(), s.size());
      small_[s.size()] = '\0';
      ptr_ = small_;
    } else {
      large_.assign(s);
      ptr_ = large_.c_str();
    }
  }
  CString(const CString&) = delete;
  CString& operator=(const CString&) = delete;
  const char* c_str() const { return ptr_; }

 private:
  char small_[192];
  std::string large_;
  const char* ptr_;
};

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

int64_t ToMillis(std::chrono::milliseconds d) { return std::max<int64_t>(1, d.count()); }

// ---- nats.c callbacks: none of them lets an exception escape. ----

void RunUserCallback(ClientShared* shared, const std::function<void()>& cb, const char* name) {
  if (!cb) return;
  try {
    cb();
  } catch (const std::exception& e) {
    shared->CountCallbackError(name, e.what());
  } catch (...) {
    shared->CountCallbackError(name, "unknown exception");
  }
}

std::string ConnectedUrl(natsConnection* nc) {
  char buf[256] = {0};
  if (natsConnection_GetConnectedUrl(nc, buf, sizeof(buf)) != NATS_OK) return "?";
  return buf;
}

void OnDisconnected(natsConnection* /*nc*/, void* closure) {
  auto* shared = static_cast<ClientShared*>(closure);
  if (shared->closing.load()) return;
  try {
    const uint64_t n = shared->disconnects.fetch_add(1) + 1;
    shared->log.Log(LogLevel::kWarning, "nats.disconnected",
                    "disconnected from {}; reconnecting ({} disconnects so far)", shared->url, n);
  } catch (...) {  // formatting/allocation failure: nothing sensible left to do
  }
  RunUserCallback(shared, shared->callbacks.on_disconnected, "on_disconnected");
}

void OnReconnected(natsConnection* nc, void* closure) {
  auto* shared = static_cast<ClientShared*>(closure);
  try {
    const uint64_t n = shared->reconnects.fetch_add(1) + 1;
    shared->log.Log(LogLevel::kInfo, "nats.reconnected", "reconnected to {} ({} so far)",
                    ConnectedUrl(nc), n);
  } catch (...) {
  }
  RunUserCallback(shared, shared->callbacks.on_reconnected, "on_reconnected");
}

// First connection made in the background (retry_on_failed_connect). For the owner this is the
// same event as a reconnect: subscriptions are now live and nothing was seen before.
void OnConnectedLate(natsConnection* nc, void* closure) {
  auto* shared = static_cast<ClientShared*>(closure);
  try {
    shared->reconnects.fetch_add(1);
    shared->log.Log(LogLevel::kInfo, "nats.connected", "connected to {}", ConnectedUrl(nc));
  } catch (...) {
  }
  RunUserCallback(shared, shared->callbacks.on_reconnected, "on_reconnected");
}

void OnClosed(natsConnection* /*nc*/, void* closure) {
  auto* shared = static_cast<ClientShared*>(closure);
  KvMutexLock lock(shared->mu);
  shared->closed = true;
  // Notify under the lock: the waiter may free `shared` as soon as it can see `closed`.
  shared->cv.notify_all();
}

void OnAsyncError(natsConnection* /*nc*/, natsSubscription* sub, natsStatus err, void* closure) {
  auto* shared = static_cast<ClientShared*>(closure);
  try {
    const char* subject = sub != nullptr ? natsSubscription_GetSubject(sub) : nullptr;
    if (subject == nullptr) subject = "-";
    if (err == NATS_SLOW_CONSUMER) {
      const uint64_t n = shared->slow_consumer.fetch_add(1) + 1;
      shared->log.Log(LogLevel::kWarning, "nats.slow_consumer",
                      "slow consumer on '{}': pending limit reached, messages dropped "
                      "({} slow-consumer errors so far)",
                      subject, n);
    } else {
      shared->async_errors.fetch_add(1);
      shared->log.Log(LogLevel::kWarning, "nats.async_error", "asynchronous error on '{}': {}",
                      subject, natsStatus_GetText(err));
    }
  } catch (...) {
  }
}

void OnMessage(natsConnection* /*nc*/, natsSubscription* /*sub*/, natsMsg* raw, void* closure) {
  MsgPtr msg(raw);  // the callback owns the message
  if (msg == nullptr) return;
  auto* state = static_cast<SubscriptionState*>(closure);
  SubscriptionState* const previous = tls_dispatching;
  tls_dispatching = state;
  try {
    IncomingMessage m;
    const char* subject = natsMsg_GetSubject(raw);
    m.subject = subject != nullptr ? subject : "";
    const char* data = natsMsg_GetData(raw);
    const int len = natsMsg_GetDataLength(raw);
    if (data != nullptr && len > 0) {
      m.data = {reinterpret_cast<const std::byte*>(data), static_cast<size_t>(len)};
    }
    const char* reply = natsMsg_GetReply(raw);
    m.reply = reply != nullptr ? reply : "";
    m.native = raw;
    state->handler(m);
  } catch (const std::exception& e) {
    state->client->CountCallbackError(fmt::format("handler for '{}'", state->subject), e.what());
  } catch (...) {
    state->client->CountCallbackError(fmt::format("handler for '{}'", state->subject),
                                      "unknown exception");
  }
  // `state` is still alive here even if the handler destroyed its Subscription (see
  // ~Subscription): only OnSubscriptionComplete frees an orphaned state.
  tls_dispatching = previous;
}

void OnSubscriptionComplete(void* closure) {
  auto* state = static_cast<SubscriptionState*>(closure);
  if (state->orphaned) {
    delete state;
    return;
  }
  KvMutexLock lock(state->mu);
  state->complete = true;
  state->cv.notify_all();  // under the lock: the waiter frees `state` once it sees `complete`
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// IncomingMessage

std::optional<std::string> IncomingMessage::Header(std::string_view key) const {
  if (native == nullptr) {
    if (headers == nullptr) return std::nullopt;
    for (const auto& [k, v] : *headers) {
      if (k == key) return v;
    }
    for (const auto& [k, v] : *headers) {
      if (EqualsIgnoreCase(k, key)) return v;
    }
    return std::nullopt;
  }
  CString ckey(key);
  const char* value = nullptr;
  if (natsMsgHeader_Get(native, ckey.c_str(), &value) == NATS_OK) {
    return std::string(value != nullptr ? value : "");
  }
  // Case-insensitive fallback (nats.c 3.x compares keys exactly).
  const char** keys = nullptr;
  int count = 0;
  if (natsMsgHeader_Keys(native, &keys, &count) != NATS_OK || keys == nullptr) {
    return std::nullopt;
  }
  std::optional<std::string> found;
  for (int i = 0; i < count && !found; ++i) {
    if (keys[i] != nullptr && EqualsIgnoreCase(keys[i], key) &&
        natsMsgHeader_Get(native, keys[i], &value) == NATS_OK) {
      found = std::string(value != nullptr ? value : "");
    }
  }
  std::free(static_cast<void*>(keys));  // the array is ours, the strings are the message's
  return found;
}

// ---------------------------------------------------------------------------------------------
// Subscription

Subscription::Subscription(
    std::unique_ptr<transport_detail::SubscriptionState> state,
    std::unique_ptr<natsSubscription, transport_detail::SubscriptionDeleter> sub)
    : state_(std::move(state)), sub_(std::move(sub)) {}

Subscription::~Subscription() {
  // Closes the subscription: its delivery thread stops dispatching. If the connection is
  // already closed the subscription was closed with it, and this reports an error we ignore.
  const natsStatus s = natsSubscription_Unsubscribe(sub_.get());
  if (s != NATS_OK && s != NATS_CONNECTION_CLOSED && s != NATS_INVALID_SUBSCRIPTION) {
    state_->client->log.Log(LogLevel::kWarning, "nats.unsubscribe", "unsubscribe '{}': {}",
                            state_->subject, natsStatus_GetText(s));
  }
  if (tls_dispatching == state_.get()) {
    // Called from inside this subscription's own handler: the current call is on this very
    // stack, and the delivery thread runs the on-complete callback right after it returns.
    // Waiting would deadlock; hand the state to that callback instead.
    state_->orphaned = true;
    state_.release();  // NOLINT(bugprone-unused-return-value): freed by OnSubscriptionComplete
  } else {
    KvMutexLock lock(state_->mu);
    while (!state_->cv.wait_for(state_->mu, std::chrono::seconds(5), [&] {
      state_->mu.AssertHeld();
      return state_->complete;
    })) {
      // A handler call is taking very long. Returning now would break the guarantee that
      // nothing runs after the destructor, so keep waiting, but say so.
      state_->client->log.Log(LogLevel::kWarning, "nats.unsubscribe_wait",
                              "still waiting for a handler of '{}' to return", state_->subject);
    }
  }
  sub_.reset();  // drops our reference; nats.c frees the subscription when its thread is done
}

const std::string& Subscription::subject() const { return state_->subject; }

int64_t Subscription::dropped() const {
  int64_t n = 0;
  if (natsSubscription_GetDropped(sub_.get(), &n) != NATS_OK) return 0;
  return n;
}

// ---------------------------------------------------------------------------------------------
// NatsClient

NatsClient::NatsClient(std::shared_ptr<transport_detail::ClientShared> shared,
                       std::unique_ptr<natsConnection, transport_detail::ConnectionDeleter> conn)
    : shared_(std::move(shared)), conn_(std::move(conn)) {}

Result<std::unique_ptr<NatsClient>> NatsClient::Connect(const NatsOptions& options,
                                                        Callbacks callbacks) {
  if (options.reconnect_wait_ms < 0 || options.connect_timeout_ms <= 0) {
    return InvalidArgument("reconnect_wait_ms must be >= 0 and connect_timeout_ms > 0");
  }
  auto shared = std::make_shared<ClientShared>();
  shared->callbacks = std::move(callbacks);
  shared->url = options.url;
  void* closure = shared.get();

  natsOptions* raw_opts = nullptr;
  natsStatus s = natsOptions_Create(&raw_opts);
  if (s != NATS_OK) return FromNats(s, "nats options");
  OptionsPtr opts(raw_opts);

  // natsOptions_SetURL takes one URL; a comma-separated list becomes a server pool.
  std::vector<std::string> urls;
  for (size_t start = 0; start <= options.url.size();) {
    size_t end = options.url.find(',', start);
    if (end == std::string::npos) end = options.url.size();
    std::string one = options.url.substr(start, end - start);
    one.erase(0, one.find_first_not_of(" \t"));
    one.erase(one.find_last_not_of(" \t") + 1);
    if (!one.empty()) urls.push_back(std::move(one));
    start = end + 1;
  }
  if (urls.empty()) return InvalidArgument("empty NATS url");
  if (urls.size() == 1) {
    s = natsOptions_SetURL(opts.get(), urls[0].c_str());
  } else {
    std::vector<const char*> servers;
    for (const auto& u : urls) servers.push_back(u.c_str());
    s = natsOptions_SetServers(opts.get(), servers.data(), static_cast<int>(servers.size()));
  }
  if (s == NATS_OK) s = natsOptions_SetName(opts.get(), options.name.c_str());
  if (s == NATS_OK) s = natsOptions_SetMaxReconnect(opts.get(), -1);  // forever
  if (s == NATS_OK) s = natsOptions_SetReconnectWait(opts.get(), options.reconnect_wait_ms);
  if (s == NATS_OK) s = natsOptions_SetTimeout(opts.get(), options.connect_timeout_ms);
  if (s == NATS_OK) s = natsOptions_UseGlobalMessageDelivery(opts.get(), false);
  if (s == NATS_OK) s = natsOptions_SetSendAsap(opts.get(), options.send_asap);
  if (s == NATS_OK) s = natsOptions_SetDisconnectedCB(opts.get(), OnDisconnected, closure);
  if (s == NATS_OK) s = natsOptions_SetReconnectedCB(opts.get(), OnReconnected, closure);
  if (s == NATS_OK) s = natsOptions_SetClosedCB(opts.get(), OnClosed, closure);
  if (s == NATS_OK) s = natsOptions_SetErrorHandler(opts.get(), OnAsyncError, closure);
  if (s == NATS_OK) {
    // With a connected callback, a failed first connect returns NATS_NOT_YET_CONNECTED and
    // retries in the background; without one nats.c would block here (forever, since the
    // number of attempts is unlimited).
    s = natsOptions_SetRetryOnFailedConnect(opts.get(), options.retry_on_failed_connect,
                                            options.retry_on_failed_connect ? OnConnectedLate
                                                                            : nullptr,
                                            closure);
  }
  if (s != NATS_OK) return FromNats(s, "nats options");

  natsConnection* raw_conn = nullptr;
  s = natsConnection_Connect(&raw_conn, opts.get());
  if (s == NATS_NOT_YET_CONNECTED) {
    shared->log.Log(LogLevel::kWarning, "nats.connecting",
                    "no NATS server at {} yet; connecting in the background", options.url);
  } else if (s != NATS_OK) {
    return FromNats(s, fmt::format("connect to {}", options.url));
  }
  std::unique_ptr<natsConnection, transport_detail::ConnectionDeleter> conn(raw_conn);
  return std::unique_ptr<NatsClient>(new NatsClient(std::move(shared), std::move(conn)));
}

NatsClient::~NatsClient() {
  shared_->closing.store(true);
  natsConnection_Close(conn_.get());  // no-op when already closed (e.g. after Drain)
  AwaitClosed(kCloseGrace);
  conn_.reset();
}

void NatsClient::AwaitClosed(std::chrono::milliseconds timeout) {
  KvMutexLock lock(shared_->mu);
  if (shared_->cv.wait_for(shared_->mu, timeout, [&] {
        shared_->mu.AssertHeld();
        return shared_->closed;
      })) {
    return;
  }
  lock.Unlock();
  shared_->log.Log(LogLevel::kError, "nats.close",
                   "connection to {} did not report closed within {} ms", shared_->url,
                   timeout.count());
  // nats.c may still call back into `shared_` later. Keep it alive for good: a small leak
  // instead of a use-after-free.
  new std::shared_ptr<ClientShared>(shared_);  // NOLINT: intentional leak
}

Result<std::unique_ptr<Subscription>> NatsClient::Subscribe(std::string subject,
                                                            std::string queue_group,
                                                            MessageHandler handler) {
  if (!handler) return InvalidArgument("subscribe " + subject + ": empty handler");
  auto state = std::make_unique<SubscriptionState>();
  state->client = shared_;
  state->subject = subject;
  state->handler = std::move(handler);

  natsSubscription* raw = nullptr;
  natsStatus s = queue_group.empty()
                     ? natsConnection_Subscribe(&raw, conn_.get(), subject.c_str(), OnMessage,
                                                state.get())
                     : natsConnection_QueueSubscribe(&raw, conn_.get(), subject.c_str(),
                                                     queue_group.c_str(), OnMessage, state.get());
  if (s != NATS_OK) return FromNats(s, fmt::format("subscribe '{}'", subject));
  std::unique_ptr<natsSubscription, transport_detail::SubscriptionDeleter> sub(raw);

  s = natsSubscription_SetOnCompleteCB(raw, OnSubscriptionComplete, state.get());
  if (s != NATS_OK) {
    // The subscription was closed between the two calls (the connection closed under us).
    // Its delivery thread may still be inside the handler and we have no way to wait for it,
    // so the state is leaked on purpose rather than freed under that thread.
    Status status = FromNats(s, fmt::format("subscribe '{}'", subject));
    (void)natsSubscription_Unsubscribe(raw);
    state.release();  // NOLINT(bugprone-unused-return-value): intentional leak, see above
    return status;
  }
  s = natsSubscription_SetPendingLimits(raw, kPendingMsgsLimit, kPendingBytesLimit);
  if (s != NATS_OK) {
    shared_->log.Log(LogLevel::kWarning, "nats.pending_limits",
                     "could not raise pending limits of '{}': {}", subject, natsStatus_GetText(s));
  }
  return std::unique_ptr<Subscription>(new Subscription(std::move(state), std::move(sub)));
}

Status NatsClient::Publish(std::string_view subject, std::span<const std::byte> data) {
  if (data.size() > static_cast<size_t>(INT_MAX)) return InvalidArgument("payload too large");
  CString subj(subject);
  const natsStatus s = natsConnection_Publish(conn_.get(), subj.c_str(), data.data(),
                                              static_cast<int>(data.size()));
  if (s != NATS_OK) return FromNats(s, fmt::format("publish to '{}'", subject));
  return Status::Ok();
}

Status NatsClient::PublishRequest(std::string_view subject, std::string_view reply,
                                  std::span<const std::byte> data) {
  if (data.size() > static_cast<size_t>(INT_MAX)) return InvalidArgument("payload too large");
  CString subj(subject);
  CString rep(reply);
  const natsStatus s = natsConnection_PublishRequest(conn_.get(), subj.c_str(), rep.c_str(), data.data(),
                                                     static_cast<int>(data.size()));
  if (s != NATS_OK) return FromNats(s, fmt::format("publish to '{}'", subject));
  return Status::Ok();
}

Status NatsClient::PublishWithHeaders(
    std::string_view subject, std::span<const std::byte> data,
    const std::vector<std::pair<std::string, std::string>>& headers) {
  if (data.size() > static_cast<size_t>(INT_MAX)) return InvalidArgument("payload too large");
  CString subj(subject);
  natsMsg* raw = nullptr;
  natsStatus s = natsMsg_Create(&raw, subj.c_str(), nullptr,
                                reinterpret_cast<const char*>(data.data()),
                                static_cast<int>(data.size()));
  if (s != NATS_OK) return FromNats(s, fmt::format("publish to '{}'", subject));
  MsgPtr msg(raw);
  for (const auto& [key, value] : headers) {
    s = natsMsgHeader_Add(msg.get(), key.c_str(), value.c_str());
    if (s != NATS_OK) return FromNats(s, fmt::format("header '{}'", key));
  }
  s = natsConnection_PublishMsg(conn_.get(), msg.get());
  if (s != NATS_OK) return FromNats(s, fmt::format("publish to '{}'", subject));
  return Status::Ok();
}

Status NatsClient::Respond(const IncomingMessage& request, std::span<const std::byte> data) {
  if (request.reply.empty()) {
    return InvalidArgument(fmt::format("message on '{}' has no reply subject", request.subject));
  }
  return Publish(request.reply, data);
}

Result<std::vector<std::byte>> NatsClient::Request(std::string_view subject,
                                                   std::span<const std::byte> data,
                                                   std::chrono::milliseconds timeout) {
  if (data.size() > static_cast<size_t>(INT_MAX)) return InvalidArgument("payload too large");
  CString subj(subject);
  natsMsg* raw = nullptr;
  const natsStatus s = natsConnection_Request(&raw, conn_.get(), subj.c_str(), data.data(),
                                              static_cast<int>(data.size()), ToMillis(timeout));
  MsgPtr reply(raw);
  if (s != NATS_OK) return FromNats(s, fmt::format("request to '{}'", subject));
  const auto* bytes = reinterpret_cast<const std::byte*>(natsMsg_GetData(reply.get()));
  const int len = natsMsg_GetDataLength(reply.get());
  if (bytes == nullptr || len <= 0) return std::vector<std::byte>{};
  return std::vector<std::byte>(bytes, bytes + len);
}

Status NatsClient::Flush(std::chrono::milliseconds timeout) {
  const natsStatus s = natsConnection_FlushTimeout(conn_.get(), ToMillis(timeout));
  if (s != NATS_OK) return FromNats(s, "flush");
  return Status::Ok();
}

void NatsClient::Drain(std::chrono::milliseconds timeout) {
  shared_->closing.store(true);
  const natsStatus s = natsConnection_DrainTimeout(conn_.get(), ToMillis(timeout));
  if (s != NATS_OK) {
    // Already closed, or not connected (nothing can be flushed): just close.
    if (s != NATS_CONNECTION_CLOSED) {
      shared_->log.Log(LogLevel::kWarning, "nats.drain", "drain failed ({}); closing",
                       natsStatus_GetText(s));
    }
    natsConnection_Close(conn_.get());
  }
  AwaitClosed(timeout + kCloseGrace);
}

bool NatsClient::IsConnected() const {
  return natsConnection_Status(conn_.get()) == NATS_CONN_STATUS_CONNECTED;
}

std::size_t NatsClient::MaxPayload() const {
  const std::int64_t max = natsConnection_GetMaxPayload(conn_.get());
  return max > 0 ? static_cast<std::size_t>(max) : std::size_t{1} << 20;
}

NatsStats NatsClient::Stats() const {
  NatsStats st;
  st.reconnects = shared_->reconnects.load();
  st.disconnects = shared_->disconnects.load();
  st.slow_consumer = shared_->slow_consumer.load();
  st.callback_errors = shared_->callback_errors.load();
  st.async_errors = shared_->async_errors.load();
  return st;
}

}  // namespace kvrouter
