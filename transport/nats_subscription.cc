#include <nats/nats.h>

#include <exception>

#include <fmt/format.h>

#include "transport/nats_client.h"
#include "transport/nats_detail.h"

// Subscriptions: each has its own nats.c delivery thread (see nats_client.cc). A Subscription's
// destructor waits for that thread's on-complete callback, so no handler runs after it.

namespace kvrouter {

namespace transport_detail {
void SubscriptionDeleter::operator()(natsSubscription* sub) const { natsSubscription_Destroy(sub); }

void Deliver(SubscriptionState* state, natsSubscription* sub, natsMsg* raw) {
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
    int pending_msgs = 0, pending_bytes = 0;
    m.more_pending = natsSubscription_GetPending(sub, &pending_msgs, &pending_bytes) == NATS_OK && pending_msgs > 0;
    state->handler(m);
  } catch (const std::exception& e) {
    state->client->CountCallbackError(fmt::format("handler for '{}'", state->subject), e.what());
  } catch (...) {
    state->client->CountCallbackError(fmt::format("handler for '{}'", state->subject), "unknown exception");
  }
}
}  // namespace transport_detail

namespace {

using transport_detail::CString;
using transport_detail::EqualsIgnoreCase;
using transport_detail::FromNats;
using transport_detail::MsgPtr;
using transport_detail::SubscriptionState;
using transport_detail::tls_dispatching;

void OnMessage(natsConnection* /*nc*/, natsSubscription* sub, natsMsg* raw, void* closure) {
  MsgPtr msg(raw);  // the callback owns the message
  if (msg == nullptr) return;
  auto* state = static_cast<SubscriptionState*>(closure);
  SubscriptionState* const previous = tls_dispatching;
  tls_dispatching = state;
  transport_detail::Deliver(state, sub, raw);
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
    if (keys[i] != nullptr && EqualsIgnoreCase(keys[i], key) && natsMsgHeader_Get(native, keys[i], &value) == NATS_OK) {
      found = std::string(value != nullptr ? value : "");
    }
  }
  std::free(static_cast<void*>(keys));  // the array is ours, the strings are the message's
  return found;
}

// ---------------------------------------------------------------------------------------------
// Subscription

Subscription::Subscription(std::unique_ptr<transport_detail::SubscriptionState> state,
                           std::unique_ptr<natsSubscription, transport_detail::SubscriptionDeleter> sub)
    : state_(std::move(state)), sub_(std::move(sub)) {}

Subscription::~Subscription() {
  const std::shared_ptr<transport_detail::ClientShared> client = state_->client;
  if (client->loop != nullptr) {
    // Event-loop mode: once it is off the loop's list no handler of it runs or will run.
    transport_detail::RemovePolled(*client->loop, state_.get());
    const natsStatus s = natsSubscription_Unsubscribe(sub_.get());
    if (s != NATS_OK && s != NATS_CONNECTION_CLOSED && s != NATS_INVALID_SUBSCRIPTION) {
      client->log.Log(LogLevel::kWarning, "nats.unsubscribe", "unsubscribe '{}': {}", state_->subject,
                      natsStatus_GetText(s));
    }
    client->Retire(sub_.release());
    return;
  }
  // Closes the subscription: its delivery thread stops dispatching. If the connection is
  // already closed the subscription was closed with it, and this reports an error we ignore.
  const natsStatus s = natsSubscription_Unsubscribe(sub_.get());
  if (s != NATS_OK && s != NATS_CONNECTION_CLOSED && s != NATS_INVALID_SUBSCRIPTION) {
    state_->client->log.Log(LogLevel::kWarning, "nats.unsubscribe", "unsubscribe '{}': {}", state_->subject,
                            natsStatus_GetText(s));
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
  // Our reference is dropped later, when the read loop cannot be holding it (see Retire).
  client->Retire(sub_.release());
}

void NatsClient::FreeRetiredSubscriptions() {
  std::vector<natsSubscription*> batch;
  {
    KvMutexLock lock(shared_->mu);
    if (shared_->retired.size() < kRetiredBatch) return;
    batch.swap(shared_->retired);
  }
  // Every subscription in `batch` was removed before this PING is sent; once the read loop has
  // handled its PONG it holds none of them.
  if (natsConnection_FlushTimeout(conn_.get(), 1000) == NATS_OK) {
    for (natsSubscription* sub : batch) natsSubscription_Destroy(sub);
    return;
  }
  KvMutexLock lock(shared_->mu);  // disconnected: keep them for the next try or for the close
  shared_->retired.insert(shared_->retired.end(), batch.begin(), batch.end());
}

const std::string& Subscription::subject() const { return state_->subject; }

int64_t Subscription::dropped() const {
  int64_t n = 0;
  if (natsSubscription_GetDropped(sub_.get(), &n) != NATS_OK) return 0;
  return n;
}

Result<std::unique_ptr<Subscription>> NatsClient::Subscribe(std::string subject, std::string queue_group,
                                                            MessageHandler handler) {
  if (!handler) return InvalidArgument("subscribe " + subject + ": empty handler");
  if (shared_->loop == nullptr) FreeRetiredSubscriptions();  // its flush needs the loop, which may be this thread
  auto state = std::make_unique<SubscriptionState>();
  state->client = shared_;
  state->subject = subject;
  state->handler = std::move(handler);

  natsSubscription* raw = nullptr;
  if (shared_->loop != nullptr) {
    // Event-loop mode: a synchronous subscription, whose messages the loop hands to the handler
    // after each read (no delivery thread).
    natsStatus s = queue_group.empty()
                       ? natsConnection_SubscribeSync(&raw, conn_.get(), subject.c_str())
                       : natsConnection_QueueSubscribeSync(&raw, conn_.get(), subject.c_str(), queue_group.c_str());
    if (s != NATS_OK) return FromNats(s, fmt::format("subscribe '{}'", subject));
    std::unique_ptr<natsSubscription, transport_detail::SubscriptionDeleter> sub(raw);
    s = natsSubscription_SetPendingLimits(raw, shared_->pending_msgs_limit, shared_->pending_bytes_limit);
    if (s != NATS_OK) {
      shared_->log.Log(LogLevel::kWarning, "nats.pending_limits", "could not set pending limits of '{}': {}", subject,
                       natsStatus_GetText(s));
    }
    transport_detail::AddPolled(*shared_->loop, state.get(), raw);
    return std::unique_ptr<Subscription>(new Subscription(std::move(state), std::move(sub)));
  }
  natsStatus s = queue_group.empty()
                     ? natsConnection_Subscribe(&raw, conn_.get(), subject.c_str(), OnMessage, state.get())
                     : natsConnection_QueueSubscribe(&raw, conn_.get(), subject.c_str(), queue_group.c_str(), OnMessage,
                                                     state.get());
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
  s = natsSubscription_SetPendingLimits(raw, shared_->pending_msgs_limit, shared_->pending_bytes_limit);
  if (s != NATS_OK) {
    shared_->log.Log(LogLevel::kWarning, "nats.pending_limits", "could not set pending limits of '{}': {}", subject,
                     natsStatus_GetText(s));
  }
  return std::unique_ptr<Subscription>(new Subscription(std::move(state), std::move(sub)));
}

}  // namespace kvrouter
