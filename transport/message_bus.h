// MessageBus: the narrow publish/subscribe interface the router service is written against, so
// the service runs on NATS in production (NatsBus, transport/nats_bus.h) and on an in-memory
// bus in unit tests (no sockets, no sleeping). Implementations must be thread-safe; handlers
// may run on any thread, concurrently for different subscriptions, and must not throw.
//
//   auto sub = bus.Subscribe("namespace.dynamo.router.route", "kvrouter", [&](const BusMessage& m) {
//     bus.Publish(m.reply, EncodeRouteReply(...)); });
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "events/base/status.h"

namespace kvrouter {

// One delivered message; its views are valid only during the handler call.
struct BusMessage {
  std::string_view subject;
  std::span<const std::byte> data;
  std::string_view reply;  // empty when the sender expects no reply
  // Header lookup (nullopt when absent or the transport has no headers).
  std::optional<std::string> (*header_fn)(const void* ctx, std::string_view key) = nullptr;
  const void* header_ctx = nullptr;
  // More messages of this subscription are queued behind this one (NATS only; a hint, so the
  // last of them arrives with false).
  bool more_pending = false;

  std::optional<std::string> Header(std::string_view key) const {
    return header_fn == nullptr ? std::nullopt : header_fn(header_ctx, key);
  }
};

// Unsubscribes when destroyed; after the destructor returns the handler is not running and
// will not run again.
class BusSubscription {
 public:
  virtual ~BusSubscription() = default;
};

class MessageBus {
 public:
  using Handler = std::function<void(const BusMessage&)>;
  virtual ~MessageBus() = default;

  // queue_group empty = every subscriber gets every message; otherwise one member of the group.
  virtual Result<std::unique_ptr<BusSubscription>> Subscribe(std::string subject, std::string queue_group,
                                                             Handler handler) = 0;
  virtual Status Publish(std::string_view subject, std::span<const std::byte> data) = 0;
  // Publishes with a reply subject for the receiver to answer on (possibly many times).
  virtual Status PublishRequest(std::string_view subject, std::string_view reply, std::span<const std::byte> data) = 0;
  // The largest message body the bus carries now (NATS: the server's max_payload, 1 MiB by
  // default); a larger publish fails.
  virtual std::size_t MaxPayload() const = 0;
  // Returns once the server has seen everything sent before (subscriptions included), or fails
  // after `timeout`. Buses without a server return at once.
  virtual Status Flush(std::chrono::milliseconds timeout) = 0;
};

}  // namespace kvrouter
