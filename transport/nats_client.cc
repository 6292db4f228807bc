#include "transport/nats_client.h"

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

#include <cstring>
#include <fstream>

#include "events/base/log.h"
#include "transport/nats_detail.h"

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

void ConnectionDeleter::operator()(natsConnection* nc) const { natsConnection_Destroy(nc); }

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
  if (last == s && detail != nullptr && *detail != '\0' && std::strcmp(detail, natsStatus_GetText(s)) != 0) {
    message += fmt::format(" ({})", detail);
  }
  return Status(CodeFor(s), std::move(message));
}

}  // namespace transport_detail

namespace {

using transport_detail::ClientShared;
using transport_detail::CString;
using transport_detail::FromNats;
using transport_detail::MsgPtr;

struct OptionsDeleter {
  void operator()(natsOptions* o) const { natsOptions_Destroy(o); }
};
using OptionsPtr = std::unique_ptr<natsOptions, OptionsDeleter>;

constexpr auto kCloseGrace = std::chrono::seconds(5);

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
    shared->log.Log(LogLevel::kInfo, "nats.reconnected", "reconnected to {} ({} so far)", ConnectedUrl(nc), n);
  } catch (...) {}
  RunUserCallback(shared, shared->callbacks.on_reconnected, "on_reconnected");
}

// First connection made in the background (retry_on_failed_connect). For the owner this is the
// same event as a reconnect: subscriptions are now live and nothing was seen before.
void OnConnectedLate(natsConnection* nc, void* closure) {
  auto* shared = static_cast<ClientShared*>(closure);
  try {
    shared->reconnects.fetch_add(1);
    shared->log.Log(LogLevel::kInfo, "nats.connected", "connected to {}", ConnectedUrl(nc));
  } catch (...) {}
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
      if (shared->callbacks.on_slow_consumer) {
        const std::string_view dropped_on(subject);
        RunUserCallback(
            shared, [&] { shared->callbacks.on_slow_consumer(dropped_on); }, "on_slow_consumer");
      }
    } else {
      shared->async_errors.fetch_add(1);
      shared->log.Log(LogLevel::kWarning, "nats.async_error", "asynchronous error on '{}': {}", subject,
                      natsStatus_GetText(err));
    }
  } catch (...) {}
}

// "a, b,c" -> {"a", "b", "c"} (blanks trimmed, empty entries dropped).
std::vector<std::string> SplitUrls(const std::string& list) {
  std::vector<std::string> urls;
  for (size_t start = 0; start <= list.size();) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string one = list.substr(start, end - start);
    one.erase(0, one.find_first_not_of(" \t"));
    one.erase(one.find_last_not_of(" \t") + 1);
    if (!one.empty()) urls.push_back(std::move(one));
    start = end + 1;
  }
  return urls;
}

// Every option of the connection; `closure` (the ClientShared) is what the callbacks receive.
// The public key (U...) in an nkey seed file, which nats.c needs beside the seed.
Result<std::string> NkeyPublicKey(const std::string& file) {
  std::ifstream in(file);
  if (!in) return InvalidArgument(fmt::format("--nats-nkey-seed {}: cannot read the file", file));
  for (std::string line; std::getline(in, line);) {
    const auto first = line.find_first_not_of(" \t");
    if (first != std::string::npos && line[first] == 'U')
      return line.substr(first, line.find_first_of(" \t\r", first) - first);
  }
  return InvalidArgument(
      fmt::format("--nats-nkey-seed {}: no public key (U...) in the file; write it beside the seed "
                  "(nk -gen user -pubout)",
                  file));
}

// Applies the credentials and TLS; a file that cannot be used is an error naming its flag.
Status ApplySecurity(natsOptions* opts, const NatsSecurity& sec) {
  auto check = [](natsStatus s, std::string_view flag, const std::string& value) -> Status {
    if (s == NATS_OK) return Status::Ok();
    const char* last = nats_GetLastError(nullptr);
    return InvalidArgument(fmt::format("{} {}: {}", flag, value, last && *last ? last : natsStatus_GetText(s)));
  };
  if (!sec.user.empty()) {
    if (Status s =
            check(natsOptions_SetUserInfo(opts, sec.user.c_str(), sec.password.c_str()), "--nats-user", sec.user);
        !s.ok())
      return s;
  }
  if (!sec.token.empty()) {
    if (Status s = check(natsOptions_SetToken(opts, sec.token.c_str()), "--nats-token", "(hidden)"); !s.ok()) return s;
  }
  if (!sec.creds_file.empty()) {
    if (!std::ifstream(sec.creds_file))
      return InvalidArgument(fmt::format("--nats-creds {}: cannot read the file", sec.creds_file));
    if (Status s = check(natsOptions_SetUserCredentialsFromFiles(opts, sec.creds_file.c_str(), nullptr), "--nats-creds",
                         sec.creds_file);
        !s.ok()) {
      return s;
    }
  }
  if (!sec.nkey_seed_file.empty()) {
    auto pub = NkeyPublicKey(sec.nkey_seed_file);
    if (!pub.ok()) return pub.status();
    if (Status s = check(natsOptions_SetNKeyFromSeed(opts, pub->c_str(), sec.nkey_seed_file.c_str()),
                         "--nats-nkey-seed", sec.nkey_seed_file);
        !s.ok()) {
      return s;
    }
  }
  if (sec.tls()) {
    if (Status s = check(natsOptions_SetSecure(opts, true), "--nats-tls-ca", sec.tls_ca); !s.ok()) return s;
  }
  if (!sec.tls_ca.empty()) {
    if (Status s = check(natsOptions_LoadCATrustedCertificates(opts, sec.tls_ca.c_str()), "--nats-tls-ca", sec.tls_ca);
        !s.ok()) {
      return s;
    }
  }
  if (!sec.tls_cert.empty() || !sec.tls_key.empty()) {
    if (sec.tls_cert.empty() || sec.tls_key.empty()) {
      return InvalidArgument("--nats-tls-cert and --nats-tls-key go together");
    }
    if (Status s = check(natsOptions_LoadCertificatesChain(opts, sec.tls_cert.c_str(), sec.tls_key.c_str()),
                         "--nats-tls-cert", sec.tls_cert);
        !s.ok()) {
      return s;
    }
  }
  return Status::Ok();
}

Result<OptionsPtr> BuildOptions(const NatsOptions& options, ClientShared* shared) {
  void* const closure = shared;
  natsOptions* raw_opts = nullptr;
  natsStatus s = natsOptions_Create(&raw_opts);
  if (s != NATS_OK) return FromNats(s, "nats options");
  OptionsPtr opts(raw_opts);

  // natsOptions_SetURL takes one URL; a comma-separated list becomes a server pool.
  const std::vector<std::string> urls = SplitUrls(options.url);
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
  // In event-loop mode publishes are written by the loop (no flusher thread).
  if (s == NATS_OK) s = natsOptions_SetSendAsap(opts.get(), options.send_asap || shared->loop != nullptr);
  if (s == NATS_OK && shared->loop != nullptr) s = transport_detail::SetEventLoop(opts.get(), *shared->loop);
  if (s == NATS_OK) s = natsOptions_SetDisconnectedCB(opts.get(), OnDisconnected, closure);
  if (s == NATS_OK) s = natsOptions_SetReconnectedCB(opts.get(), OnReconnected, closure);
  if (s == NATS_OK) s = natsOptions_SetClosedCB(opts.get(), OnClosed, closure);
  if (s == NATS_OK) s = natsOptions_SetErrorHandler(opts.get(), OnAsyncError, closure);
  if (s == NATS_OK) {
    // With a connected callback, a failed first connect returns NATS_NOT_YET_CONNECTED and
    // retries in the background; without one nats.c would block here (forever, since the
    // number of attempts is unlimited).
    s = natsOptions_SetRetryOnFailedConnect(opts.get(), options.retry_on_failed_connect,
                                            options.retry_on_failed_connect ? OnConnectedLate : nullptr, closure);
  }
  if (s != NATS_OK) return FromNats(s, "nats options");
  if (Status sec = ApplySecurity(opts.get(), options.security); !sec.ok()) return sec;
  return opts;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// NatsClient

NatsClient::NatsClient(std::shared_ptr<transport_detail::ClientShared> shared,
                       std::unique_ptr<natsConnection, transport_detail::ConnectionDeleter> conn)
    : shared_(std::move(shared)), conn_(std::move(conn)) {}

Status NatsClient::OpenLibrary() {
  const natsStatus s = nats_Open(-1);  // -1: nats.c's default lock spin count
  return s == NATS_OK ? Status::Ok() : transport_detail::FromNats(s, "nats_Open");
}

Result<std::unique_ptr<NatsClient>> NatsClient::Connect(const NatsOptions& options, Callbacks callbacks) {
  if (options.reconnect_wait_ms < 0 || options.connect_timeout_ms <= 0) {
    return InvalidArgument("reconnect_wait_ms must be >= 0 and connect_timeout_ms > 0");
  }
  auto shared = std::make_shared<ClientShared>();
  shared->callbacks = std::move(callbacks);
  shared->url = options.url;
  if (options.pending_msgs_limit <= 0 || options.pending_bytes_limit <= 0) {
    return InvalidArgument("pending limits must be > 0");
  }
  shared->pending_msgs_limit = options.pending_msgs_limit;
  shared->pending_bytes_limit = options.pending_bytes_limit;
  if (options.event_loop != nullptr && options.security.tls()) {
    // nats.c waits inside its TLS reads and writes, which would block the loop (nats_loop.cc).
    return InvalidArgument("a NATS connection served by an event loop cannot use TLS");
  }
  if (options.event_loop != nullptr) shared->loop = transport_detail::MakeLoopAttachment(*options.event_loop);
  auto opts = BuildOptions(options, shared.get());
  if (!opts.ok()) return opts.status();

  natsConnection* raw_conn = nullptr;
  natsStatus s = natsConnection_Connect(&raw_conn, opts->get());
  if (s == NATS_NOT_YET_CONNECTED && raw_conn != nullptr) {
    // A server that answered and refused us will refuse again: say so now, naming the flags.
    const char* last = nullptr;
    natsConnection_GetLastError(raw_conn, &last);
    if (last && (std::strstr(last, "uthorization") || std::strstr(last, "uthentication"))) {
      const std::string why = last;
      {
        // Closed the way every client is (callbacks may still be pending on `shared`).
        std::unique_ptr<natsConnection, transport_detail::ConnectionDeleter> doomed(raw_conn);
        NatsClient discard(shared, std::move(doomed));
      }
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{} refused the login ({}): check --nats-user/--nats-password, --nats-token, "
                                "--nats-creds, --nats-nkey-seed or the user in the URL",
                                options.url, why));
    }
  }
  if (s == NATS_CONNECTION_AUTH_FAILED || s == NATS_NOT_PERMITTED) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} refused the login ({}): check --nats-user/--nats-password, --nats-token, "
                              "--nats-creds, --nats-nkey-seed or the user in the URL",
                              options.url, natsStatus_GetText(s)));
  }
  if (s == NATS_NOT_YET_CONNECTED) {
    shared->log.Log(LogLevel::kWarning, "nats.connecting", "no NATS server at {} yet; connecting in the background",
                    options.url);
  } else if (s != NATS_OK) {
    return FromNats(s, fmt::format("connect to {}", options.url));
  }
  std::unique_ptr<natsConnection, transport_detail::ConnectionDeleter> conn(raw_conn);
  return std::unique_ptr<NatsClient>(new NatsClient(std::move(shared), std::move(conn)));
}

NatsClient::~NatsClient() {
  Close();  // nats.c's close is a no-op when already closed (e.g. after Drain)
  std::vector<natsSubscription*> retired;
  {
    KvMutexLock lock(shared_->mu);
    if (shared_->closed) retired.swap(shared_->retired);  // the read loop has ended
  }
  for (natsSubscription* sub : retired) natsSubscription_Destroy(sub);
  conn_.reset();
}

void NatsClient::Close() {
  shared_->closing.store(true);
  natsConnection_Close(conn_.get());
  AwaitClosed(kCloseGrace);
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
  shared_->log.Log(LogLevel::kError, "nats.close", "connection to {} did not report closed within {} ms", shared_->url,
                   timeout.count());
  // nats.c may still call back into `shared_` later. Keep it alive for good: a small leak
  // instead of a use-after-free.
  new std::shared_ptr<ClientShared>(shared_);  // NOLINT: intentional leak
}

Status NatsClient::Publish(std::string_view subject, std::span<const std::byte> data) {
  if (data.size() > static_cast<size_t>(INT_MAX)) return InvalidArgument("payload too large");
  CString subj(subject);
  const natsStatus s = natsConnection_Publish(conn_.get(), subj.c_str(), data.data(), static_cast<int>(data.size()));
  if (s != NATS_OK) return FromNats(s, fmt::format("publish to '{}'", subject));
  return Status::Ok();
}

Status NatsClient::PublishRequest(std::string_view subject, std::string_view reply, std::span<const std::byte> data) {
  if (data.size() > static_cast<size_t>(INT_MAX)) return InvalidArgument("payload too large");
  CString subj(subject);
  CString rep(reply);
  const natsStatus s =
      natsConnection_PublishRequest(conn_.get(), subj.c_str(), rep.c_str(), data.data(), static_cast<int>(data.size()));
  if (s != NATS_OK) return FromNats(s, fmt::format("publish to '{}'", subject));
  return Status::Ok();
}

Status NatsClient::PublishWithHeaders(std::string_view subject, std::span<const std::byte> data,
                                      const std::vector<std::pair<std::string, std::string>>& headers) {
  if (data.size() > static_cast<size_t>(INT_MAX)) return InvalidArgument("payload too large");
  CString subj(subject);
  natsMsg* raw = nullptr;
  natsStatus s = natsMsg_Create(&raw, subj.c_str(), nullptr, reinterpret_cast<const char*>(data.data()),
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

Result<std::vector<std::byte>> NatsClient::Request(std::string_view subject, std::span<const std::byte> data,
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
      shared_->log.Log(LogLevel::kWarning, "nats.drain", "drain failed ({}); closing", natsStatus_GetText(s));
    }
    natsConnection_Close(conn_.get());
  }
  AwaitClosed(timeout + kCloseGrace);
}

bool NatsClient::IsConnected() const { return natsConnection_Status(conn_.get()) == NATS_CONN_STATUS_CONNECTED; }

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
  KvMutexLock lock(shared_->mu);
  st.retired_subscriptions = shared_->retired.size();
  return st;
}

}  // namespace kvrouter
