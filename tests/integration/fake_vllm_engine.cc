#include "tests/integration/fake_vllm_engine.h"

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <iterator>

namespace kvrouter::testing {
namespace {

std::string Seq(std::int64_t seq) {
  std::string s(8, '\0');
  const auto u = static_cast<std::uint64_t>(seq);
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(u >> (56 - 8 * i));
  return s;
}

std::int64_t ReadSeq(const zmq::message_t& m) {
  std::uint64_t v = 0;
  const auto* p = static_cast<const unsigned char*>(m.data());
  for (std::size_t i = 0; i < 8 && i < m.size(); ++i) v = (v << 8) | p[i];
  return static_cast<std::int64_t>(v);
}

// Binds to a port the system picks and returns it.
int BindAnyPort(zmq::socket_t& s) {
  s.bind("tcp://127.0.0.1:*");
  const std::string ep = s.get(zmq::sockopt::last_endpoint);  // tcp://127.0.0.1:NNNN
  return std::stoi(ep.substr(ep.rfind(':') + 1));
}

}  // namespace

struct FakeVllmEngine::Sockets {
  zmq::context_t ctx{1};
  zmq::socket_t pub{ctx, zmq::socket_type::pub};
  std::unique_ptr<zmq::socket_t> router;
};

FakeVllmEngine::FakeVllmEngine(bool with_replay) : s_(std::make_unique<Sockets>()) {
  s_->pub.set(zmq::sockopt::linger, 0);
  pub_port_ = BindAnyPort(s_->pub);
  if (with_replay) {
    s_->router = std::make_unique<zmq::socket_t>(s_->ctx, zmq::socket_type::router);
    s_->router->set(zmq::sockopt::linger, 0);
    s_->router->set(zmq::sockopt::rcvtimeo, 50);
    replay_port_ = BindAnyPort(*s_->router);
    replay_thread_ = std::thread([this] { ServeReplays(); });
  }
}

FakeVllmEngine::~FakeVllmEngine() {
  stopping_ = true;
  if (replay_thread_.joinable()) replay_thread_.join();
  s_->router.reset();
  s_->pub.close();
}

std::int64_t FakeVllmEngine::Publish(const std::vector<VllmEvent>& events, bool deliver) {
  const msgpack::sbuffer body = EncodeVllmBatch(1.0, events, 0);
  std::string payload(body.data(), body.size());
  std::int64_t seq;
  {
    std::lock_guard g(mu_);
    seq = next_seq_++;
    buffer_[seq] = payload;
  }
  if (deliver) {
    s_->pub.send(zmq::message_t(), zmq::send_flags::sndmore);  // topic "" (vLLM's default)
    s_->pub.send(zmq::buffer(Seq(seq)), zmq::send_flags::sndmore);
    s_->pub.send(zmq::buffer(payload), zmq::send_flags::none);
  }
  return seq;
}

void FakeVllmEngine::Restart() {
  std::lock_guard g(mu_);
  next_seq_ = 0;
  buffer_.clear();
}

void FakeVllmEngine::Forget(std::int64_t seq) {
  std::lock_guard g(mu_);
  buffer_.erase(buffer_.begin(), buffer_.upper_bound(seq));
}

void FakeVllmEngine::ServeReplays() {
  while (!stopping_) {
    std::vector<zmq::message_t> req;
    if (!zmq::recv_multipart(*s_->router, std::back_inserter(req))) continue;  // 50 ms timeout
    if (req.size() != 3) continue;                                             // [identity, "", start_seq]
    ++replay_requests_;
    if (replays_muted_) continue;
    const std::string identity = req[0].to_string();
    const std::int64_t start = ReadSeq(req[2]);
    std::vector<std::pair<std::int64_t, std::string>> batches;
    {
      std::lock_guard g(mu_);
      for (auto it = buffer_.lower_bound(start); it != buffer_.end(); ++it) batches.emplace_back(*it);
    }
    auto send = [&](std::int64_t seq, const std::string& payload) {
      s_->router->send(zmq::buffer(identity), zmq::send_flags::sndmore);
      s_->router->send(zmq::message_t(), zmq::send_flags::sndmore);
      s_->router->send(zmq::buffer(Seq(seq)), zmq::send_flags::sndmore);
      s_->router->send(zmq::buffer(payload), zmq::send_flags::none);
    };
    for (const auto& [seq, payload] : batches) send(seq, payload);
    send(-1, "");
  }
}

}  // namespace kvrouter::testing
