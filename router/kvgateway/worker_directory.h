// WorkerDirectory: the engines the gateway can send requests to, learned from the workers'
// registrations on NATS (docs/protocol.md section 4, with section 11's http_url and models and
// section 13's role): which workers serve a model, at what base URL, in which role, and which
// models exist at all. A worker goes with its `leaving`, or when its lease ends unheard. As the
// router does, an outage of NATS forgets nothing: leases do not end while the connection is down
// (Pause), and each worker has a whole lease after it is back (Resume). Bounded: at most
// kMaxWorkers workers.
// Thread contract: every method may be called from any thread (one mutex; registrations come on
// a NATS thread, lookups on the HTTP threads).
//
//   dir.Apply(reg, now);  auto ids = dir.Serving("llama");  auto url = dir.HttpUrl(ids[0]);
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "events/base/clock.h"
#include "events/base/thread_annotations.h"
#include "events/registration_codec.h"
#include "transport/http_client.h"

namespace kvrouter {

class WorkerDirectory {
 public:
  static constexpr std::size_t kMaxWorkers = 1 << 16;

  // A registration (up: added or renewed; leaving: removed). Workers without an http_url are
  // not kept: the gateway cannot reach them. Returns the http_urls no worker has any more (the
  // engine connections to them may be closed).
  std::vector<std::string> Apply(const WorkerRegistration& reg, SteadyTime now);
  // Forgets the workers whose lease ended before `now` (none while paused); returns as Apply.
  std::vector<std::string> Expire(SteadyTime now);
  // The connection that brings registrations went down: silence says nothing of the workers.
  void Pause();
  // It is back: every lease ends one lease from `now` at the earliest.
  void Resume(SteadyTime now);

  // Workers with an http_url that list `model`, ascending.
  std::vector<std::uint64_t> Serving(std::string_view model) const;
  std::optional<std::string> HttpUrl(std::uint64_t worker_id) const;
  // Its http_url parsed (at its registration, not per request); nullopt when it is not known or
  // its URL does not parse.
  std::optional<HttpEndpoint> Endpoint(std::uint64_t worker_id) const;
  // Its registered role (section 13); kBoth for a worker not known.
  WorkerRole Role(std::uint64_t worker_id) const;
  // Whether a whole request sent to it alone is served: an aggregated worker (kBoth) or a vLLM
  // (nixl) prefill or decode engine, which runs one whole; an SGLang engine of a disaggregated
  // pair waits for its other half. True for a worker not known.
  bool ServesAlone(std::uint64_t worker_id) const;
  // Every worker known, ascending.
  std::vector<std::uint64_t> Ids() const;
  // Every model some worker serves, sorted, each once.
  std::vector<std::string> Models() const;
  std::size_t size() const;

 private:
  struct Worker {
    std::string http_url;
    std::optional<HttpEndpoint> endpoint;  // http_url parsed
    std::vector<std::string> models;
    WorkerRole role = WorkerRole::kBoth;
    KvConnector connector = KvConnector::kNixl;
    SteadyTime lease_end;
    std::chrono::milliseconds lease{0};
  };
  // Those of `urls` no worker has.
  std::vector<std::string> Unused(std::vector<std::string> urls) const KV_REQUIRES(mu_);

  mutable KvMutex mu_;
  std::map<std::uint64_t, Worker> workers_ KV_GUARDED_BY(mu_);
  bool paused_ KV_GUARDED_BY(mu_) = false;
};

}  // namespace kvrouter
