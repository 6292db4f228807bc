#include "events/base/status.h"

#include <fmt/format.h>

namespace kvrouter {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kNoWorkers: return "no_workers";
    case StatusCode::kOverloaded: return "overloaded";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kNotFound: return "not_found";
    case StatusCode::kInternal: return "internal";
  }
  return "internal";
}

StatusCode StatusCodeFromName(std::string_view name) {
  for (StatusCode c : {StatusCode::kOk, StatusCode::kInvalidArgument, StatusCode::kNoWorkers, StatusCode::kOverloaded,
                       StatusCode::kTimeout, StatusCode::kNotFound}) {
    if (StatusCodeName(c) == name) return c;
  }
  return StatusCode::kInternal;
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  return fmt::format("{}: {}", StatusCodeName(code_), message_);
}

}  // namespace kvrouter
