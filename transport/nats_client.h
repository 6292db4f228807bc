// NatsClient: kvrouter's one connection to NATS (publish, subscribe, request/reply, reconnect).
//
// This is the only code in the project that talks to nats.c. A NatsClient owns one
// natsConnection that reconnects forever in the background; subscriptions survive reconnects
// (nats.c re-sends them) and Callbacks::on_reconnected tells the owner when events may have
// been missed. Errors come back as Status / Result; nothing throws out of this API and no
// exception crosses a nats.c callback (a throwing handler is caught, counted and logged).
//
// Threads: every NatsClient method may be called from any thread, including from inside a
// message handler (in event-loop mode, see NatsOptions::event_loop, for what not to call on the
// loop). Each Subscription has its own nats.c delivery thread (so keep subscriptions
// few: use wildcards): one handler call at a time per subscription, in arrival order; different
// subscriptions run in parallel. Connection callbacks run on nats.c's single, process-wide
// callback thread: never block in them and never destroy the NatsClient from them.
// Ownership: NatsClient and Subscription are non-copyable, non-movable RAII owners of their
// nats.c handles (held by unique_ptr with deleters). A Subscription may outlive its NatsClient
// (it then receives nothing); handlers and callbacks are kept until their owner is destroyed.
//
//   auto nc = NatsClient::Connect({.url = "nats://127.0.0.1:4222"}, {});
//   auto sub = (*nc)->Subscribe("a.b", "", [](const IncomingMessage& m) { /* use m.data */ });
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "events/base/status.h"
#include "transport/nats_security.h"

// Opaque nats.c handle types, spelled as nats.h spells them so this header need not include it.
typedef struct __natsMsg natsMsg;
typedef struct __natsConnection natsConnection;
typedef struct __natsSubscription natsSubscription;
typedef struct __natsOptions natsOptions;

namespace boost::asio {
class io_context;
}  // namespace boost::asio

namespace kvrouter {

// How a client proves who it is, and TLS (every program's --nats-* flags). Empty = unused.
// A user and password in the URL (nats://user:pass@host) work too.
struct NatsOptions {
  std::string url = "nats://127.0.0.1:4222";  // server URL (comma-separated list allowed)
  std::string name = "kvrouter";              // connection name shown by the server
  int reconnect_wait_ms = 250;                // pause between reconnect attempts to one server
  // true: Connect succeeds even when no server is up and keeps trying in the background
  // (publishes are buffered, subscriptions are sent once connected, on_reconnected fires when
  // the first connection is made). false: Connect fails if no server answers.
  bool retry_on_failed_connect = true;
  int connect_timeout_ms = 2000;  // timeout of one TCP connect + handshake attempt
  // true: every publish is written to the socket at once. false: nats.c's flusher thread
  // coalesces writes, which batches well but adds about 1 ms to each reply (it sleeps 1 ms
  // per flush). Request/reply servers want true; bulk event publishers may want false.
  bool send_asap = false;
  // Each subscription's queue of delivered-but-unhandled messages. Past either limit nats.c
  // drops messages for that subscription and reports a slow consumer (on_slow_consumer).
  int pending_msgs_limit = 1'000'000;
  int pending_bytes_limit = 1 << 30;  // 1 GiB
  NatsSecurity security;
  // Event-loop mode: the connection's socket is read and written on this Asio event loop's
  // thread (nats.c's external event loop), instead of by nats.c's read and flusher threads, and
  // every subscription's handler runs on that thread right after the read that brought its
  // messages (no delivery thread, no hand-off). Publishes from any thread are buffered and
  // written together on the loop, once per turn of it (send_asap is ignored). The loop must run
  // for anything to be sent or received, and outlive the client. On the loop's thread, do not
  // call Flush, Request or Drain (they wait for the loop) and do not destroy a Subscription of
  // the client from its own handler. A "no responders" status comes with an empty subject
  // (nats.c does not say to which request): see IncomingMessage::no_responders. Not with TLS
  // (Connect refuses it): nats.c waits inside its TLS reads and writes.
  boost::asio::io_context* event_loop = nullptr;
};

// Counters since Connect. Plain snapshot, not updated after Stats() returns.
struct NatsStats {
  uint64_t reconnects = 0;       // connection (re)established in the background (includes a
                                 // delayed first connect, see NatsOptions::retry_on_failed_connect)
  uint64_t disconnects = 0;      // connection lost (not counting our own Close/Drain)
  uint64_t slow_consumer = 0;    // slow-consumer errors: a subscription's pending queue was full
                                 // and nats.c dropped messages for it
  uint64_t callback_errors = 0;  // handlers/callbacks that threw (caught here)
  uint64_t async_errors = 0;     // other asynchronous errors reported by nats.c
  // Unsubscribed subscriptions not freed yet: nats.c 3.4's read loop may still lock one it
  // looked up before the unsubscribe. Freed in batches by Subscribe (after a flush) or on close.
  uint64_t retired_subscriptions = 0;
};

// One received message, borrowed from nats.c: every view is valid only during the handler call.
// Copy what must outlive it.
struct IncomingMessage {
  std::string_view subject;
  std::span<const std::byte> data;
  std::string_view reply;  // empty when the sender expects no reply
  // The subscription had more messages queued behind this one when it was delivered (a hint:
  // a handler may gather work and hand it on when this is false).
  bool more_pending = false;

  // Value of header `key` (the first one if repeated), or nullopt. nats.c 3.x header keys are
  // case-sensitive; this falls back to a case-insensitive match so "kv-seq" finds "Kv-Seq".
  std::optional<std::string> Header(std::string_view key) const;

  // NATS' "no responders" status (503): nobody subscribed to the subject of the request this
  // answers. Event-loop mode only; `subject` is then empty, since nats.c does not tell which
  // request it answers. (Otherwise such an answer comes as a message with empty data and a
  // "Status: 503" header, on the request's reply subject.)
  bool no_responders = false;

  // Set by the transport: the nats.c message, owned by the delivery trampoline (never destroy
  // it). Left null by fakes, which may instead point `headers` at their own list.
  natsMsg* native = nullptr;
  const std::vector<std::pair<std::string, std::string>>* headers = nullptr;
};

using MessageHandler = std::function<void(const IncomingMessage&)>;

namespace transport_detail {
struct ClientShared;
struct SubscriptionState;
struct ConnectionDeleter {
  void operator()(natsConnection* nc) const;
};
struct SubscriptionDeleter {
  void operator()(natsSubscription* sub) const;
};
}  // namespace transport_detail

// Interest in a subject. Destroying it unsubscribes with this guarantee: when the destructor
// returns, the handler is not running and will never run again (it waits for a handler call in
// progress to finish; messages still queued locally are discarded). Destroying a Subscription
// from inside its own handler is allowed: the handler's current call then finishes normally and
// nothing runs after it. Not thread-safe: one thread owns and destroys it.
class Subscription {
 public:
  ~Subscription();
  Subscription(const Subscription&) = delete;
  Subscription& operator=(const Subscription&) = delete;

  const std::string& subject() const;
  // Messages nats.c dropped for this subscription because its pending queue was full.
  int64_t dropped() const;

 private:
  friend class NatsClient;
  Subscription(std::unique_ptr<transport_detail::SubscriptionState> state,
               std::unique_ptr<natsSubscription, transport_detail::SubscriptionDeleter> sub);

  std::unique_ptr<transport_detail::SubscriptionState> state_;
  std::unique_ptr<natsSubscription, transport_detail::SubscriptionDeleter> sub_;
};

class NatsClient {
 public:
  struct Callbacks {
    // Run on nats.c's callback thread; keep them short and do not block (hand work to your own
    // thread). A throw is caught and counted. Neither runs for our own Drain/destruction.
    // on_reconnected: connected again (subscriptions are re-sent): events may have been
    // missed. Also fires for a first connection made in the background.
    std::function<void()> on_reconnected;
    std::function<void()> on_disconnected;  // lost the server; nats.c is reconnecting
    // A subscription's pending queue overflowed and messages to `subject` were dropped.
    std::function<void(std::string_view subject)> on_slow_consumer;
  };

  // Connects (or, with retry_on_failed_connect, starts connecting in the background).
  static Result<std::unique_ptr<NatsClient>> Connect(const NatsOptions& options, Callbacks callbacks);

  // Starts nats.c's library threads (timers, callbacks, and the collector that frees every
  // delivered message) if the first Connect has not yet: a caller that treats them specially
  // (the router marks the collector as ingestion) finds them started by this call.
  static Status OpenLibrary();

  // Unsubscribed subscriptions are freed in batches of this many (see NatsStats).
  static constexpr std::size_t kRetiredBatch = 32;

  // Closes the connection (without draining) and waits for nats.c's last callback.
  ~NatsClient();
  NatsClient(const NatsClient&) = delete;
  NatsClient& operator=(const NatsClient&) = delete;

  // queue_group empty = plain subscription; otherwise each message goes to one member of the
  // group. Pending limits are raised to 1M messages / 1 GiB per subscription.
  Result<std::unique_ptr<Subscription>> Subscribe(std::string subject, std::string queue_group, MessageHandler handler);

  Status Publish(std::string_view subject, std::span<const std::byte> data);
  // Publishes with a reply subject: the receiver answers there (streams of replies, relays).
  Status PublishRequest(std::string_view subject, std::string_view reply, std::span<const std::byte> data);
  // Headers are added in order; a repeated key gets several values.
  Status PublishWithHeaders(std::string_view subject, std::span<const std::byte> data,
                            const std::vector<std::pair<std::string, std::string>>& headers);
  // Publishes `data` to the message's reply subject; kInvalidArgument when it has none.
  Status Respond(const IncomingMessage& request, std::span<const std::byte> data);
  // Sends a request and waits for the first reply. kNotFound: nobody is subscribed to `subject`
  // (NATS "no responders", returned at once); kTimeout: no reply within `timeout`.
  Result<std::vector<std::byte>> Request(std::string_view subject, std::span<const std::byte> data,
                                         std::chrono::milliseconds timeout);

  // Round trip to the server: everything published before has reached it. kTimeout if not
  // within `timeout` (for instance while disconnected).
  Status Flush(std::chrono::milliseconds timeout);
  // Closes the connection now (what is buffered is flushed first, for up to half a second) and
  // waits for nats.c's last callback; every call fails with kInternal afterwards.
  void Close();
  // Clean shutdown: stop taking new messages, let handlers finish the queued ones, flush
  // publishes, then close. Blocks up to `timeout` (plus a short grace) for that to finish.
  // Afterwards every call fails with kInternal ("connection closed").
  void Drain(std::chrono::milliseconds timeout);

  bool IsConnected() const;
  // The server's max_payload (what it announced on connect); 1 MiB before the first connect.
  std::size_t MaxPayload() const;
  NatsStats Stats() const;

 private:
  NatsClient(std::shared_ptr<transport_detail::ClientShared> shared,
             std::unique_ptr<natsConnection, transport_detail::ConnectionDeleter> conn);
  // Waits for the closed callback (the last one nats.c posts); see the .cc for the fallback.
  void AwaitClosed(std::chrono::milliseconds timeout);
  // Once kRetiredBatch unsubscribed subscriptions wait, flushes and frees them (see
  // ClientShared::retired).
  void FreeRetiredSubscriptions();

  std::shared_ptr<transport_detail::ClientShared> shared_;
  std::unique_ptr<natsConnection, transport_detail::ConnectionDeleter> conn_;
};

}  // namespace kvrouter
