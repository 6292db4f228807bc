// Status and Result<T>: cheap error values used everywhere inside kvrouter.
//
// A Status is a code plus a message. Codes are chosen by what the caller should do next and map
// one to one onto the wire error codes of docs/protocol.md section 5. Result<T> holds a T or a non-OK
// Status. Both are plain values: copy them, return them, never throw them. Thread-compatible.
//
//   Result<RouteRequest> r = DecodeRouteRequest(bytes);
//   if (!r.ok()) return ErrorReply(r.status());
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvrouter {

enum class StatusCode {
  kOk,
  kInvalidArgument,  // fix the request
  kNoWorkers,        // wait for capacity
  kOverloaded,       // retry later
  kTimeout,          // gave up waiting
  kNotFound,         // named thing does not exist
  kInternal,         // bug or environment failure
};

// Wire spelling of a code ("invalid_argument", ...); "ok" for kOk.
std::string_view StatusCodeName(StatusCode code);
// Inverse of StatusCodeName; unknown names map to kInternal.
StatusCode StatusCodeFromName(std::string_view name);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) { assert(!std::get<Status>(v_).ok()); }  // NOLINT

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kvrouter
