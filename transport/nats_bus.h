// NatsBus: MessageBus over a NatsClient, the production bus of the kvrouter service.
// Thread-safe like NatsClient; borrows the client, which must outlive the bus and every
// subscription made through it.
//
//   auto nc = NatsClient::Connect({.url = url}, {});  NatsBus bus(**nc);
#pragma once

#include "transport/message_bus.h"
#include "transport/nats_client.h"

namespace kvrouter {

class NatsBus : public MessageBus {
 public:
  explicit NatsBus(NatsClient& client) : client_(client) {}

  Result<std::unique_ptr<BusSubscription>> Subscribe(std::string subject, std::string queue_group,
                                                     Handler handler) override;
  Status Publish(std::string_view subject, std::span<const std::byte> data) override;
  Status PublishRequest(std::string_view subject, std::string_view reply, std::span<const std::byte> data) override;
  std::size_t MaxPayload() const override { return client_.MaxPayload(); }
  Status Flush(std::chrono::milliseconds timeout) override { return client_.Flush(timeout); }

 private:
  NatsClient& client_;
};

}  // namespace kvrouter
