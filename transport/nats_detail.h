// Internals shared by transport/nats_client.cc (connection, publish, request),
// transport/nats_subscription.cc (subscriptions and message delivery) and transport/nats_loop.cc
// (a connection served by an event loop): the state nats.c's callbacks point at, nats.c status
// translation and small helpers. Not part of the API: only those files include it. The threading
// model is described at the top of nats_client.cc.
#pragma once

#include <nats/nats.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "events/base/log.h"
#include "transport/nats_client.h"
#include "events/base/thread_annotations.h"

namespace kvrouter::transport_detail {

struct LoopAttachment;  // nats_loop.cc

struct ClientShared {
  NatsClient::Callbacks callbacks;
  std::string url;
  int pending_msgs_limit = 0;  // per subscription (NatsOptions)
  int pending_bytes_limit = 0;
  RateLimitedLog log{std::chrono::seconds(5)};
  // Event-loop mode (NatsOptions::event_loop): the socket's state on that loop; else null.
  std::shared_ptr<LoopAttachment> loop;

  std::atomic<uint64_t> reconnects{0};
  std::atomic<uint64_t> disconnects{0};
  std::atomic<uint64_t> slow_consumer{0};
  std::atomic<uint64_t> callback_errors{0};
  std::atomic<uint64_t> async_errors{0};
  std::atomic<bool> closing{false};  // our own Close/Drain is under way: not a "disconnect"

  KvMutex mu;
  std::condition_variable_any cv;
  bool closed KV_GUARDED_BY(mu) = false;  // set by the closed callback
  // Subscriptions unsubscribed but not yet freed. nats.c 3.4's read loop looks a subscription
  // up, lets go of the connection's subscription lock and then locks the subscription, so an
  // unsubscribe and free in that gap makes it lock freed memory (nats-io/nats.c#637, fixed in
  // 3.6). One is freed only once the connection is closed, or after a flush whose PONG the read
  // loop handled after the unsubscribe (it handles the stream in order, so it is past them).
  std::vector<natsSubscription*> retired KV_GUARDED_BY(mu);

  // Frees `sub` now if the connection is closed, else keeps it in `retired`.
  void Retire(natsSubscription* sub) {
    {
      KvMutexLock lock(mu);
      if (!closed) {
        retired.push_back(sub);
        return;
      }
    }
    natsSubscription_Destroy(sub);
  }

  void CountCallbackError(std::string_view where, std::string_view what) {
    callback_errors.fetch_add(1, std::memory_order_relaxed);
    log.Log(LogLevel::kError, "nats.callback_error", "{} threw: {} ({} callback errors so far)", where, what,
            callback_errors.load(std::memory_order_relaxed));
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

// Runs `state`'s handler for `raw` (which stays the caller's), catching and counting what it
// throws. `sub` tells whether more messages wait behind it.
void Deliver(SubscriptionState* state, natsSubscription* sub, natsMsg* raw);

// Event-loop mode (nats_loop.cc). MakeLoopAttachment: the state nats.c's event-loop callbacks
// get, for a connection served by `loop`. SetEventLoop: hands them
// to nats.c. AddPolled / RemovePolled: a synchronous subscription whose messages the loop
// delivers to its state's handler after each read; RemovePolled returns once no handler of it
// runs (call it off the handler).
std::shared_ptr<LoopAttachment> MakeLoopAttachment(boost::asio::io_context& loop);
natsStatus SetEventLoop(natsOptions* opts, LoopAttachment& attachment);
void AddPolled(LoopAttachment& attachment, SubscriptionState* state, natsSubscription* sub);
void RemovePolled(LoopAttachment& attachment, SubscriptionState* state);

struct MsgDeleter {
  void operator()(natsMsg* m) const { natsMsg_Destroy(m); }
};
using MsgPtr = std::unique_ptr<natsMsg, MsgDeleter>;

// The subscription whose handler is running on this thread (a delivery thread runs exactly one
// subscription's handler), so that a Subscription destroyed from inside its own handler does
// not wait for itself.
inline thread_local SubscriptionState* tls_dispatching = nullptr;

// The error code a caller should act on for a nats.c status.
StatusCode CodeFor(natsStatus s);
// `what` says what failed ("publish to x.y"); the text includes nats.c's own detail when the
// calling thread's last error has one.
Status FromNats(natsStatus s, std::string_view what);

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

inline bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

}  // namespace kvrouter::transport_detail
