#include "transport/zmq_stream.h"

#include <fmt/format.h>

#include <cstring>
#include <iterator>
#include <zmq.hpp>
#include <zmq_addon.hpp>

namespace kvrouter {
namespace {

std::int64_t ReadSeq(const zmq::message_t& m) {
  std::uint64_t v = 0;
  const auto* p = static_cast<const unsigned char*>(m.data());
  for (std::size_t i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return static_cast<std::int64_t>(v);
}

std::vector<std::byte> Bytes(const zmq::message_t& m) {
  const auto* p = static_cast<const std::byte*>(m.data());
  return {p, p + m.size()};
}

}  // namespace

struct ZmqEngineStream::Sockets {
  ZmqStreamOptions options;
  zmq::context_t ctx{1};
  zmq::socket_t sub{ctx, zmq::socket_type::sub};
  std::unique_ptr<zmq::socket_t> dealer;

  void OpenDealer() {
    dealer = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
    dealer->set(zmq::sockopt::linger, 0);
    dealer->connect(*options.replay_endpoint);
  }
};

ZmqEngineStream::ZmqEngineStream(std::unique_ptr<Sockets> s) : s_(std::move(s)) {}

ZmqEngineStream::~ZmqEngineStream() {
  if (!s_) return;
  s_->sub.set(zmq::sockopt::linger, 0);
  s_->sub.close();
  s_->dealer.reset();
}

Result<std::unique_ptr<ZmqEngineStream>> ZmqEngineStream::Connect(const ZmqStreamOptions& options) {
  auto s = std::make_unique<Sockets>();
  s->options = options;
  try {
    s->sub.set(zmq::sockopt::linger, 0);
    s->sub.set(zmq::sockopt::subscribe, options.topic);
    s->sub.connect(options.endpoint);
    if (options.replay_endpoint) s->OpenDealer();
  } catch (const zmq::error_t& e) {
    return InvalidArgument(fmt::format("cannot connect to {}{}: {}", options.endpoint,
                                       options.replay_endpoint ? " / " + *options.replay_endpoint : "", e.what()));
  }
  return std::unique_ptr<ZmqEngineStream>(new ZmqEngineStream(std::move(s)));
}

bool ZmqEngineStream::has_replay() const { return s_->dealer != nullptr; }

Result<std::optional<ZmqBatch>> ZmqEngineStream::Receive(std::chrono::milliseconds timeout) {
  std::vector<zmq::message_t> parts;
  try {
    s_->sub.set(zmq::sockopt::rcvtimeo, static_cast<int>(timeout.count()));
    if (!zmq::recv_multipart(s_->sub, std::back_inserter(parts))) return std::optional<ZmqBatch>();
  } catch (const zmq::error_t& e) {
    return Status(StatusCode::kInternal, fmt::format("zmq receive: {}", e.what()));
  }
  if (parts.size() != 3 || parts[1].size() != 8) {
    return InvalidArgument(fmt::format("a message of {} frames, not [topic, seq (8 bytes), payload]", parts.size()));
  }
  return std::optional<ZmqBatch>(ZmqBatch{parts[0].to_string(), ReadSeq(parts[1]), Bytes(parts[2])});
}

Result<std::vector<ZmqBatch>> ZmqEngineStream::Replay(std::int64_t start_seq, std::chrono::milliseconds timeout,
                                                      std::stop_token stop) {
  if (!s_->dealer) return NotFound("the engine has no replay endpoint (--zmq-replay-endpoint)");
  std::vector<ZmqBatch> out;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  try {
    unsigned char seq[8];
    const auto u = static_cast<std::uint64_t>(start_seq);
    for (int i = 0; i < 8; ++i) seq[i] = static_cast<unsigned char>(u >> (56 - 8 * i));
    s_->dealer->send(zmq::message_t(), zmq::send_flags::sndmore);
    s_->dealer->send(zmq::buffer(seq, 8), zmq::send_flags::none);
    while (true) {
      // Wait in slices, so that a stop request ends the wait within kReplayStopCheck.
      std::vector<zmq::message_t> parts;
      while (true) {
        if (stop.stop_requested()) {
          s_->OpenDealer();  // a late answer must not be read as the next one's
          return Status(StatusCode::kTimeout, "replay abandoned: stopping");
        }
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
          s_->OpenDealer();
          return Status(StatusCode::kTimeout, fmt::format("no end of replay within {} ms", timeout.count()));
        }
        const auto slice = std::min<std::int64_t>(left.count(), kReplayStopCheck.count());
        s_->dealer->set(zmq::sockopt::rcvtimeo, static_cast<int>(std::max<std::int64_t>(1, slice)));
        if (zmq::recv_multipart(*s_->dealer, std::back_inserter(parts))) break;
      }
      // ["", seq, payload] or ["", topic, seq, payload]; an empty payload ends the replay.
      if (parts.size() < 3 || parts.size() > 4 || parts[parts.size() - 2].size() != 8) {
        s_->OpenDealer();
        return InvalidArgument(fmt::format("a replay message of {} frames", parts.size()));
      }
      const zmq::message_t& payload = parts.back();
      if (payload.size() == 0) return out;
      out.push_back({parts.size() == 4 ? parts[1].to_string() : "", ReadSeq(parts[parts.size() - 2]), Bytes(payload)});
    }
  } catch (const zmq::error_t& e) {
    s_->OpenDealer();
    return Status(StatusCode::kInternal, fmt::format("zmq replay: {}", e.what()));
  }
}

}  // namespace kvrouter
