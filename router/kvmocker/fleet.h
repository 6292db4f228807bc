// MockWorkerFleet: kvmocker's simulated vLLM-like workers in one process, on NATS: registration
// heartbeats (docs/protocol.md section 4), KV events in the Dynamo (2) or vLLM (3) format, the
// recovery (6) and generate (7) endpoints; one MockEngine and one KvEventPublisher per rank; with
// --http-port, each worker's OpenAI HTTP face (section 11, openai_face.h) on the same engines.
// Threads: see the class. Start and Stop are called from one controlling thread; the fleet
// borrows the NatsClient, which must outlive it.
//
//   MockWorkerFleet fleet(config, **nc);  if (Status s = fleet.Start(); !s.ok()) ...;  fleet.Stop();
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>

#include "events/base/clock.h"
#include "events/base/status.h"
#include "events/registration_codec.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"
#include "router/kvmocker/config.h"
#include "router/kvmocker/kv_transfer.h"
#include "router/kvmocker/openai_face.h"
#include "router/engine/mock_engine.h"
#include "events/base/log.h"
#include "transport/nats_client.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

// The HTTP face's types are only named here (fleet_http.cc has them): Asio and Beast stay out
// of every file that includes the fleet.
class HttpClient;
class HttpIo;
class HttpListener;
class HttpReply;
struct HttpRequest;

// num_workers workers of dp_size ranks each. NATS delivery threads (one per subscription) and the
// HTTP threads (one HttpIo of two threads for every worker's listener) only decode requests and
// push them, and the aborts of HTTP clients that went away, into a bounded inbox; the HTTP
// threads answer what needs no engine (models, render, errors) themselves. One engine thread
// owns the engines: it sleeps until the earliest step end or engine timer (a KV transfer's or a
// pin lease's end), a heartbeat or a new request, steps every engine whose previous step has
// ended or whose timer is due on real time (virtual ms = steady-clock ms since Start; engine
// durations are already divided by their worker's speedup ratio), and publishes events (as they
// happen), responses (at the step's end: NATS messages, or HTTP responses and streamed tokens
// through HttpReply, which never blocks) and heartbeats. A recovery request reads its rank's
// publisher under engine_mu_ from its delivery thread.
//
// Disaggregated legs (docs/protocol.md section 13, "kvmocker's roles"): a body's
// kv_transfer_params picks the leg on any worker (vLLM's kv_both engines take both); SGLang's
// bootstrap fields pick it by the process's role. A prefill leg pins its blocks; a decode leg's
// pull end (EngineOutput::kPulled) releases them: directly when the prefill worker is in this
// fleet, else by POST /kvmocker/kv_pulled to the prefill process (HttpClient, fire and forget;
// the lease frees the blocks when that fails). SGLang's legs meet by room at the prefill
// process's bootstrap listener (rooms_, on HTTP threads and the engine thread).
class MockWorkerFleet {
 public:
  // Counters since construction (a snapshot).
  struct Counters {
    std::uint64_t requests = 0;          // NATS generate requests accepted into the inbox
    std::uint64_t bad_requests = 0;      // undecodable / out-of-range requests and queries
    std::uint64_t inbox_full = 0;        // requests refused because the inbox was full
    std::uint64_t events = 0;            // KV event messages published
    std::uint64_t publish_failures = 0;  // any publish that failed
    std::uint64_t http_requests = 0;     // HTTP generations accepted into the inbox
    std::uint64_t http_errors = 0;       // HTTP requests answered with an error status
    std::uint64_t aborted = 0;           // HTTP generations whose client went away before the end
    std::uint64_t invalid_transfers = 0;     // decode legs with bad kv_transfer_params: local prefills
    std::uint64_t pull_notice_failures = 0;  // POST kv_pulled to a prefill process that failed
    std::uint64_t bootstrap_failures = 0;    // SGLang decode legs failed: their room never came
  };
  // Generate requests (NATS and HTTP) not yet finished (inbox, engine queues, running) before
  // refusing more (NATS: an "overloaded" error; HTTP: 503 with Retry-After).
  static constexpr std::size_t kMaxOutstanding = 65536;
  std::atomic<std::size_t> outstanding_{0};

  MockWorkerFleet(MockerConfig config, NatsClient& nats);
  ~MockWorkerFleet();  // Stop()
  MockWorkerFleet(const MockWorkerFleet&) = delete;
  MockWorkerFleet& operator=(const MockWorkerFleet&) = delete;

  // Opens the HTTP ports (with --http-port; Internal when one is taken), subscribes the generate
  // and recovery endpoints, publishes the first registration of every worker and starts the
  // engine thread.
  Status Start();
  // Stops the engine thread, publishes status "leaving" for every worker, unsubscribes, answers
  // every unfinished request (NATS: finish_reason "error"; HTTP: 503, or an error event when the
  // stream had begun), closes the HTTP ports and flushes. Idempotent.
  void Stop();

  const std::vector<std::uint64_t>& worker_ids() const { return worker_ids_; }
  Counters counters() const;
  // /metrics: the counters above and every rank's engine (kvmocker_*), as Prometheus text.
  std::string MetricsText();

 private:
  struct Rank {
    std::size_t worker_index = 0;
    std::uint32_t dp_rank = 0;
    std::unique_ptr<KvEventPublisher> publisher;  // numbers the engine's events, serves recovery
    std::unique_ptr<MockEngine> engine;
    bool stepping = false;  // a step is in progress until step_end_ms
    double step_end_ms = 0;
    std::vector<EngineOutput> outputs;  // of the step in progress, delivered at step_end_ms
    std::uint64_t vllm_seq = 0;         // next Kv-Seq (vLLM format)
    std::string vllm_events_subject;    // VllmEventsSubject of the rank (vLLM format)
  };
  // Where a request's answers go: a NATS reply subject (protocol.md section 7) or an HTTP
  // client (section 11).
  struct NatsTarget {
    std::string reply;       // the subject
    std::string request_id;  // the client's
  };
  struct HttpTarget {
    std::shared_ptr<HttpReply> reply;
    OpenAiAnswer answer;
    bool begun = false;  // a stream's head was sent: errors now go as an event
  };
  using ReplyTarget = std::variant<NatsTarget, HttpTarget>;

  // A request's part in a disaggregated pair (section 13).
  struct LegState {
    EngineLeg leg = EngineLeg::kWhole;
    std::optional<KvTransferParams> source;  // kDecode: whom to tell of the pull (its blocks moved out)
    std::optional<std::uint64_t> room;       // an SGLang kPrefill leg: its bootstrap room
  };
  struct GenerateJob {
    std::uint64_t id = 0;  // the fleet's, unique: the engine's request id
    std::size_t worker_index = 0;
    std::optional<std::uint32_t> dp_rank;  // nullopt: the worker's least busy rank
    std::vector<std::uint32_t> tokens;
    std::vector<MmItem> mm_items;
    std::uint32_t max_tokens = 1;
    ReplyTarget target;
    double arrival_ms = 0;
    LegState legs;
    std::optional<KvPull> transfer;  // kDecode with valid kv_transfer_params
  };
  struct InFlight {
    std::size_t rank_index = 0;
    ReplyTarget target;
    double arrival_ms = 0;
    double first_token_ms = 0;
    std::uint32_t max_tokens = 1;
    LegState legs;
    bool pulled = false;  // kDecode: its pull ended (EngineOutput::kPulled)
  };
  // An SGLang bootstrap room on the prefill process: the decode legs waiting for it, until its
  // prefill leg is done (`ready`) or failed; a ready room lives until a decode leg takes it or
  // its pin's lease ends, a waited-for one until expires_ms.
  struct Room {
    std::optional<KvTransferParams> ready;
    std::optional<std::string> failed;  // why its prefill leg failed
    std::vector<std::shared_ptr<HttpReply>> waiters;
    double expires_ms = 0;
  };
  static constexpr std::size_t kMaxRooms = 65536;
  static constexpr std::size_t kMaxRoomWaiters = 8;
  // How long an SGLang decode leg waits for its room, and a room for its decode legs: the
  // worker's --kv-lease-ms over its speedup ratio (the prefill engine holds the blocks no longer),
  // at least kMinLegWaitMs.
  static constexpr double kMinLegWaitMs = 1000;
  double LegWaitMs(std::size_t worker_index) const;
  enum class Admission { kQueued, kFull, kStopping };

  double NowMs() const;
  void EngineLoop();
  // Adds the jobs to their engines, aborts the aborted ones and runs every engine whose step has
  // ended or whose timer is due; returns the earliest end of a step in progress, or timer
  // (MockEngine::NextTimerMs) of an engine not stepping (infinity when all are idle).
  double AdvanceEngines(std::vector<GenerateJob>& jobs, const std::vector<std::uint64_t>& aborts, double now_ms)
      KV_REQUIRES(engine_mu_);
  std::size_t LeastBusyRank(std::size_t worker_index) KV_REQUIRES(engine_mu_);
  void DeliverOutputs(Rank& rank) KV_REQUIRES(engine_mu_);
  void AnswerNats(const NatsTarget& target, const InFlight& f, const EngineOutput& o);
  // Into the inbox unless it is full or the fleet stops; `job` is moved from only when queued.
  Admission Enqueue(GenerateJob& job);
  // Tells a request that the inbox is full, or that the fleet stops (true for an HTTP client).
  void AnswerOverloaded(ReplyTarget& target);
  bool AnswerShutdown(ReplyTarget& target);
  // From the engine sink, which runs inside AdvanceEngines.
  void PublishEvent(Rank& rank, KvEventBatch&& batch) KV_REQUIRES(engine_mu_);
  void PublishRegistrations(WorkerStatus status);
  void OnGenerate(std::size_t worker_index, const IncomingMessage& m);
  void OnRecovery(std::size_t rank_index, const IncomingMessage& m);
  void Respond(std::string_view reply, const GenerateResponse& response);
  void RespondError(std::string_view reply, std::string request_id, std::string message);
  void CountPublish(const Status& s, std::string_view what);

  // The HTTP face (fleet_http.cc).
  Status StartHttp();
  // Ends the HTTP threads `grace` after the last answers were handed over, then the listeners.
  void StopHttp(std::chrono::milliseconds grace);
  // How long Stop lets the HTTP threads write the answers it gave to unfinished requests.
  static constexpr std::chrono::milliseconds kHttpAnswerGrace{200};
  // On an HttpIo thread: answers at once, or queues a generation for the worker's engine.
  void OnHttp(std::size_t worker_index, HttpRequest&& request, std::shared_ptr<HttpReply> reply);
  // Queues an HTTP generation (its client's going away then aborts it), or answers 503.
  void QueueHttpJob(GenerateJob& job);
  // On an HttpIo thread: the client of job `id` went away.
  void AbortJob(std::uint64_t id);
  // On an HttpIo thread: POST /kvmocker/kv_pulled (the face and the bootstrap listener).
  FaceResponse OnKvPulled(std::string_view body);
  // On an HttpIo thread: the bootstrap listener (GET rooms, POST kv_pulled).
  void OnBootstrapHttp(HttpRequest&& request, std::shared_ptr<HttpReply> reply);
  // On an HttpIo thread: an SGLang decode leg asks the prefill process for its room, then
  // queues `job` with its pull, or fails its client (502 kv_bootstrap_failed).
  void AwaitRoom(GenerateJob job, SglangBootstrap bootstrap);
  // On the engine thread: a decode leg's pull ended; tells its prefill engine.
  void TellPulled(const KvTransferParams& source) KV_REQUIRES(engine_mu_);
  // A room's prefill leg is done (`params`) or failed (nullopt, `why`): answers its waiters.
  void PublishRoom(std::uint64_t room, std::optional<KvTransferParams> params, double lease_ms, std::string_view why);
  // Answers and drops the rooms whose time is up; under rooms_mu_.
  void ExpireRooms(double now_ms) KV_REQUIRES(rooms_mu_);
  // What a prefill leg answers with: the rank's pin of engine request `id`, reached at host:port.
  KvTransferParams PinnedParams(const InFlight& f, const std::string& id) KV_REQUIRES(engine_mu_);
  // On the engine thread: one engine output for an HTTP client.
  void AnswerHttp(HttpTarget& target, const InFlight& f, const EngineOutput& o) KV_REQUIRES(engine_mu_);
  // An error for an HTTP client: the whole response, or an error event and the stream's end.
  static void FailHttp(HttpTarget& target, int status, std::string_view code, std::string_view message);

  const MockerConfig config_;
  NatsClient& nats_;
  const std::string kv_events_subject_;  // KvEventsSubject (events/subjects.h)
  const std::string instances_subject_;  // InstancesSubject
  std::vector<std::uint64_t> worker_ids_;
  const SteadyTime start_;
  RateLimitedLog log_;

  // Engine state: written by the engine thread; OnRecovery reads a publisher. Ranks are created by
  // the constructor and never move (the engine sinks point at them).
  KvMutex engine_mu_;
  // Worker i's rank r at i * dp_size + r.
  std::vector<std::unique_ptr<Rank>> ranks_ KV_GUARDED_BY(engine_mu_);
  std::vector<std::uint64_t> envelope_seq_ KV_GUARDED_BY(engine_mu_);              // per worker
  std::unordered_map<std::string, InFlight> in_flight_ KV_GUARDED_BY(engine_mu_);  // engine id ->

  KvMutex inbox_mu_;
  std::condition_variable_any inbox_cv_;
  std::vector<GenerateJob> inbox_ KV_GUARDED_BY(inbox_mu_);
  // Jobs whose HTTP client went away: at most one per job, so bounded with the jobs.
  std::vector<std::uint64_t> aborts_ KV_GUARDED_BY(inbox_mu_);
  bool stopping_ KV_GUARDED_BY(inbox_mu_) = false;
  std::atomic<std::uint64_t> next_job_id_{0};

  KvMutex rooms_mu_;
  std::unordered_map<std::uint64_t, Room> rooms_ KV_GUARDED_BY(rooms_mu_);
  std::deque<std::pair<double, std::uint64_t>> room_expiry_ KV_GUARDED_BY(rooms_mu_);  // (expires_ms, room)

  // Thread-safe (OpenAiFace::Handle); built from the config.
  OpenAiFace face_;

  // Owned by the controlling thread (Start / Stop). The listeners go before the HttpIo they use.
  std::vector<std::unique_ptr<Subscription>> subscriptions_;
  std::unique_ptr<HttpIo> http_io_;
  std::vector<std::unique_ptr<HttpListener>> listeners_;  // the workers' faces, then the bootstrap listener
  std::unique_ptr<HttpClient> peer_client_;               // kv_pulled notices and bootstrap waits
  std::thread engine_thread_;
  bool started_ = false;
  bool stopped_ = false;

  std::atomic<std::uint64_t> requests_{0}, bad_requests_{0}, inbox_full_{0}, events_{0}, publish_failures_{0},
      http_requests_{0}, http_errors_{0}, aborted_{0}, invalid_transfers_{0}, pull_notice_failures_{0},
      bootstrap_failures_{0};
};

}  // namespace kvrouter
