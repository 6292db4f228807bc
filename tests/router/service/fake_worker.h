// FakeWorker: one worker rank for the service's tests: its events numbered by a
// KvEventPublisher and published on an in-memory bus (or lost), its recovery endpoint
// (docs/protocol.md section 6) answered from the publisher in parts. Thread contract: the test thread
// publishes; the endpoint runs on whatever thread publishes the query (a shard thread), so a
// mutex guards the publisher.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "events/event_codec.h"
#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"
#include "tests/router/service/service_fixture.h"
#include "transport/memory_bus.h"

namespace kvrouter::testing {

// The tokens of prompt `p` (4 blocks of kBs tokens, distinct per prompt).
inline std::vector<std::uint32_t> PromptTokens(std::uint32_t p, std::size_t blocks = 4) {
  std::vector<std::uint32_t> t(blocks * kBs);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = p * 1000 + static_cast<std::uint32_t>(i);
  return t;
}

// A worker rank whose events are numbered by a KvEventPublisher, published through `via` (or
// lost), and whose recovery endpoint answers from the publisher (unless `serve` is off). The
// endpoint runs on the router's shard thread (the bus is synchronous): a mutex guards the
// publisher, as kvmocker's engine mutex does.
class FakeWorker {
 public:
  FakeWorker(InMemoryBus& bus, std::uint64_t id, bool serve = true, std::size_t buffer = 1024)
      : bus_(bus),
        id_(id),
        buffer_(buffer),
        pub_(std::make_unique<KvEventPublisher>(PublisherConfig{.worker_id = id, .event_buffer = buffer})) {
    if (serve) {
      sub_ = std::move(bus.Subscribe(RecoverySubject("dynamo", "backend", id, 0), "", [this](const BusMessage& m) {
               if (!answer_) return;  // a worker that hangs
               RecoveryReply reply;
               {
                 std::lock_guard g(mu_);
                 reply = pub_->Answer(RecoveryQuery::Decode(m.data));
               }
               auto parts = EncodeRecoveryReplyParts(reply, bus_.MaxPayload());
               ASSERT_TRUE(parts.ok()) << parts.status().ToString();
               for (const auto& part : *parts) (void)bus_.Publish(m.reply, AsBytes(part));
             })).value();
    }
  }
  // Stores a prompt; returns the message (published unless `publish` is false: a lost event).
  msgpack::sbuffer Store(const std::vector<std::uint32_t>& tokens, MessageBus* via) {
    const KvEventBatch b = StoredPromptBatch(id_, 0, tokens, kBs);  // for its chain only
    msgpack::sbuffer body;
    {
      std::lock_guard g(mu_);
      body = EncodeDynamoEnvelope(pub_->Publish(b.ops.at(0).data), {});
    }
    if (via) (void)via->Publish(KvEventsSubject("dynamo", "backend"), AsBytes(body));
    return body;
  }
  msgpack::sbuffer Remove(std::vector<BlockHash> hashes, MessageBus* via) {
    return Emit(KvRemoved{std::move(hashes)}, via);
  }
  msgpack::sbuffer Clear(MessageBus* via) { return Emit(KvCleared{}, via); }
  // The engine restarts: an empty cache, event ids from 1 again.
  void Restart() {
    std::lock_guard g(mu_);
    pub_ = std::make_unique<KvEventPublisher>(PublisherConfig{.worker_id = id_, .event_buffer = buffer_});
  }
  // Read it only while no event is being recovered (after the index is flushed).
  const KvEventPublisher& publisher() const { return *pub_; }
  msgpack::sbuffer Emit(KvEventData data, MessageBus* via) {
    msgpack::sbuffer body;
    {
      std::lock_guard g(mu_);
      body = EncodeDynamoEnvelope(pub_->Publish(std::move(data)), {});
    }
    if (via) (void)via->Publish(KvEventsSubject("dynamo", "backend"), AsBytes(body));
    return body;
  }
  void set_answer(bool a) { answer_ = a; }
  std::uint64_t id() const { return id_; }

 private:
  InMemoryBus& bus_;
  std::uint64_t id_;
  std::size_t buffer_;
  std::mutex mu_;
  std::unique_ptr<KvEventPublisher> pub_;
  std::atomic<bool> answer_{true};
  std::unique_ptr<BusSubscription> sub_;
};

}  // namespace kvrouter::testing
