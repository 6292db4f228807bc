// InMemoryBus: a MessageBus inside one process, for unit tests and kvbench's offline mode.
// Publish delivers synchronously, on the caller's thread, to every matching subscription (NATS
// wildcards `*` and `>`; one member per queue group, round-robin), so the caller sees every
// effect of a message when Publish returns. Request() publishes with a private reply subject
// and returns the reply. One mutex guards the subscription list; handlers run unlocked, so a
// handler may publish again (nested delivery).
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "transport/message_bus.h"

namespace kvrouter {

class InMemoryBus : public MessageBus {
 public:
  Result<std::unique_ptr<BusSubscription>> Subscribe(std::string subject, std::string group,
                                                      Handler handler) override {
    std::lock_guard g(mu_);
    auto entry = std::make_shared<Entry>(Entry{std::move(subject), std::move(group), std::move(handler), true});
    subs_.push_back(entry);
    return std::unique_ptr<BusSubscription>(new Sub(entry));
  }

  Status Publish(std::string_view subject, std::span<const std::byte> data) override {
    return Deliver(subject, data, "", {});
  }

  Status PublishRequest(std::string_view subject, std::string_view reply, std::span<const std::byte> data) override {
    return Deliver(subject, data, reply, {});
  }

  // Like NATS's max_payload: larger publishes fail (default 1 MiB).
  std::size_t MaxPayload() const override { return max_payload_.load(); }
  void set_max_payload(std::size_t bytes) { max_payload_.store(bytes); }

  // Publishes with headers.
  Status PublishWithHeaders(std::string_view subject, std::span<const std::byte> data,
                            std::map<std::string, std::string> headers) {
    return Deliver(subject, data, "", std::move(headers));
  }

  // Publishes with a reply subject and returns what was published to it (nullopt: no reply).
  std::optional<std::vector<std::byte>> Request(std::string_view subject, std::span<const std::byte> data) {
    const std::string inbox = "_INBOX." + std::to_string(++inbox_seq_);
    std::optional<std::vector<std::byte>> reply;
    auto sub = Subscribe(inbox, "", [&](const BusMessage& m) { reply.emplace(m.data.begin(), m.data.end()); });
    (void)Deliver(subject, data, inbox, {});
    return reply;
  }

  // A request whose reply may come later (a queued route): the reply lands in `reply` whenever
  // it is published, as long as the returned object lives.
  struct PendingRequest {
    std::unique_ptr<BusSubscription> sub;
    std::shared_ptr<std::optional<std::vector<std::byte>>> reply;
  };
  PendingRequest RequestAsync(std::string_view subject, std::span<const std::byte> data) {
    const std::string inbox = "_INBOX." + std::to_string(++inbox_seq_);
    PendingRequest p{nullptr, std::make_shared<std::optional<std::vector<std::byte>>>()};
    auto slot = p.reply;
    p.sub = std::move(Subscribe(inbox, "", [slot](const BusMessage& m) { slot->emplace(m.data.begin(), m.data.end()); }))
                .value();
    (void)Deliver(subject, data, inbox, {});
    return p;
  }

  std::size_t published(std::string_view subject) const {
    std::lock_guard g(mu_);
    auto it = counts_.find(std::string(subject));
    return it == counts_.end() ? 0 : it->second;
  }

  static bool Matches(std::string_view pattern, std::string_view subject) {
    while (true) {
      const auto pd = pattern.find('.');
      const auto sd = subject.find('.');
      const std::string_view pt = pattern.substr(0, pd);
      const std::string_view st = subject.substr(0, sd);
      if (pt == ">") return !subject.empty();
      if (pt != "*" && pt != st) return false;
      if (pd == std::string_view::npos || sd == std::string_view::npos) {
        return pd == std::string_view::npos && sd == std::string_view::npos;
      }
      pattern.remove_prefix(pd + 1);
      subject.remove_prefix(sd + 1);
    }
  }

 private:
  struct Entry {
    std::string subject, group;
    Handler handler;
    bool live;
  };
  class Sub : public BusSubscription {
   public:
    explicit Sub(std::shared_ptr<Entry> e) : e_(std::move(e)) {}
    ~Sub() override { e_->live = false; }
   private:
    std::shared_ptr<Entry> e_;
  };

  static std::optional<std::string> HeaderOf(const void* ctx, std::string_view key) {
    const auto* h = static_cast<const std::map<std::string, std::string>*>(ctx);
    auto it = h->find(std::string(key));
    return it == h->end() ? std::nullopt : std::optional<std::string>(it->second);
  }

  Status Deliver(std::string_view subject, std::span<const std::byte> data, std::string_view reply,
                 std::map<std::string, std::string> headers) {
    if (data.size() > max_payload_.load()) {
      return Internal(fmt::format("payload {} greater than maximum allowed: {}", data.size(), max_payload_.load()));
    }
    std::vector<std::shared_ptr<Entry>> targets;
    {
      std::lock_guard g(mu_);
      ++counts_[std::string(subject)];
      std::map<std::string, std::vector<std::shared_ptr<Entry>>> groups;
      for (auto it = subs_.begin(); it != subs_.end();) {
        if (!(*it)->live) { it = subs_.erase(it); continue; }
        if (Matches((*it)->subject, subject)) {
          if ((*it)->group.empty()) targets.push_back(*it);
          else groups[(*it)->group].push_back(*it);
        }
        ++it;
      }
      for (auto& [name, members] : groups) targets.push_back(members[rr_++ % members.size()]);
    }
    BusMessage m{subject, data, reply, &InMemoryBus::HeaderOf, &headers};
    for (auto& t : targets) {
      if (t->live) t->handler(m);
    }
    return Status::Ok();
  }

  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Entry>> subs_;
  std::map<std::string, std::size_t> counts_;
  std::size_t rr_ = 0;
  std::size_t inbox_seq_ = 0;
  std::atomic<std::size_t> max_payload_{std::size_t{1} << 20};
};

}  // namespace kvrouter
