#include "router/kvgateway/headers.h"

#include <algorithm>
#include <cctype>

namespace kvrouter {

namespace {

bool EqualsNoCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](unsigned char x, unsigned char y) {
           return std::tolower(x) == std::tolower(y);
         });
}

// A Connection header's value names headers, comma-separated, with optional white space.
bool NamedBy(std::string_view list, std::string_view name) {
  while (!list.empty()) {
    const std::size_t comma = list.find(',');
    std::string_view token = list.substr(0, comma);
    while (!token.empty() && (token.front() == ' ' || token.front() == '\t')) token.remove_prefix(1);
    while (!token.empty() && (token.back() == ' ' || token.back() == '\t')) token.remove_suffix(1);
    if (EqualsNoCase(token, name)) return true;
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return false;
}

bool OneOf(std::string_view name, std::initializer_list<std::string_view> names) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

bool IsHopByHop(std::string_view name, const HttpHeaders& headers) {
  if (OneOf(name, {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}) ||
      name.starts_with("proxy-")) {
    return true;
  }
  for (const auto& [k, v] : headers) {
    if (k == "connection" && NamedBy(v, name)) return true;
  }
  return false;
}

void ForwardRequestHeaders(const HttpHeaders& from, HttpHeaders& to) {
  for (const auto& [k, v] : from) {
    if (OneOf(k, {"host", "content-length", "expect", "accept-encoding", "content-type", "x-request-id"}) ||
        IsHopByHop(k, from)) {
      continue;
    }
    to.emplace_back(k, v);
  }
}

void ForwardResponseHeaders(const HttpHeaders& from, HttpHeaders& to) {
  for (const auto& [k, v] : from) {
    if (OneOf(k, {"content-length", "server", "x-request-id"}) || k.starts_with("x-kvrouter-") || IsHopByHop(k, from)) {
      continue;
    }
    to.emplace_back(k, v);
  }
}

}  // namespace kvrouter
