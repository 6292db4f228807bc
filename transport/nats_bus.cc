#include "transport/nats_bus.h"

namespace kvrouter {
namespace {

class NatsBusSubscription : public BusSubscription {
 public:
  explicit NatsBusSubscription(std::unique_ptr<Subscription> sub) : sub_(std::move(sub)) {}

 private:
  std::unique_ptr<Subscription> sub_;  // its destructor gives the no-callback-after guarantee
};

std::optional<std::string> HeaderOf(const void* ctx, std::string_view key) {
  return static_cast<const IncomingMessage*>(ctx)->Header(key);
}

}  // namespace

Result<std::unique_ptr<BusSubscription>> NatsBus::Subscribe(std::string subject, std::string queue_group,
                                                            Handler handler) {
  auto sub =
      client_.Subscribe(std::move(subject), std::move(queue_group), [h = std::move(handler)](const IncomingMessage& m) {
        BusMessage bm{m.subject, m.data, m.reply, &HeaderOf, &m};
        bm.more_pending = m.more_pending;
        h(bm);
      });
  if (!sub.ok()) return sub.status();
  return std::unique_ptr<BusSubscription>(new NatsBusSubscription(std::move(sub).value()));
}

Status NatsBus::Publish(std::string_view subject, std::span<const std::byte> data) {
  return client_.Publish(subject, data);
}

Status NatsBus::PublishRequest(std::string_view subject, std::string_view reply, std::span<const std::byte> data) {
  return client_.PublishRequest(subject, reply, data);
}

}  // namespace kvrouter
