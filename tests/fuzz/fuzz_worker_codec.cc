// libFuzzer target for the worker endpoint codecs and kv_metrics: RecoveryQuery, recovery reply,
// GenerateRequest, GenerateResponse and DecodeKvMetrics on the same bytes. Whatever decodes must
// survive encode + decode unchanged; a decoded reply's events belong to the queried worker and
// have one op each; replaying them into a KvEventPublisher must leave it answering a dump whose
// replay reproduces its held blocks.
#include <cstddef>
#include <cstdint>

#include "events/message_codec.h"
#include "events/msgpack_reader.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvrouter;
  const std::span<const std::byte> body(reinterpret_cast<const std::byte*>(data), size);

  auto query = RecoveryQuery::Decode(body);
  if (query.ok()) {
    auto again = RecoveryQuery::Decode(AsBytes(query->Encode()));
    Check(again.ok() && *again == *query);
  }

  auto reply = DecodeRecoveryReply(body, 7);
  if (reply.ok()) {
    KvEventPublisher publisher({.worker_id = 7, .event_buffer = 4});
    for (const KvEventBatch& b : reply->events) {
      Check(b.worker_id == 7 && b.ops.size() == 1 && b.sequence.kind == SequenceKind::kEventId);
      publisher.Publish(b.ops[0].data, b.ops[0].tier);
    }
    auto again = DecodeRecoveryReply(AsBytes(EncodeRecoveryReply(*reply)), 7);
    Check(again.ok() && *again == *reply);
    const RecoveryReply dump = publisher.Recover(std::nullopt, std::nullopt);
    KvEventPublisher rebuilt({.worker_id = 7});
    for (const KvEventBatch& b : dump.events) rebuilt.Publish(b.ops[0].data);
    Check(rebuilt.HeldBlocks() == publisher.HeldBlocks());
    (void)publisher.Answer(query);
  }

  auto request = GenerateRequest::Decode(body);
  if (request.ok()) {
    Check(request->max_tokens >= 1 && request->max_tokens <= kMaxGenerateTokens);
    auto again = GenerateRequest::Decode(AsBytes(request->Encode()));
    Check(again.ok() && *again == *request);
  }

  auto response = GenerateResponse::Decode(body);
  if (response.ok()) {
    auto again = GenerateResponse::Decode(AsBytes(response->Encode()));
    Check(again.ok());
    if (response->is_final()) {
      Check(*again == *response);
    } else {  // a first-token response carries only these
      Check(again->request_id == response->request_id && again->token_ids == response->token_ids &&
            again->index == response->index && !again->is_final());
    }
  }

  auto metrics = DecodeKvMetrics(body);
  if (metrics.ok()) {
    auto again = DecodeKvMetrics(AsBytes(EncodeKvMetrics(*metrics)));
    Check(again.ok() && *again == *metrics);
  }
  return 0;
}
