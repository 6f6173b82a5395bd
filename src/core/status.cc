#include "tether/status.h"

namespace tether {

const char* code_name(Code c) {
  switch (c) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid argument";
    case Code::kNotFound: return "not found";
    case Code::kAccessDenied: return "access denied";
    case Code::kOutOfRange: return "out of range";
    case Code::kTimeout: return "timeout";
    case Code::kConnectionLost: return "connection lost";
    case Code::kProtocolError: return "protocol error";
    case Code::kAuthFailed: return "authentication failed";
    case Code::kCancelled: return "cancelled";
    case Code::kTruncated: return "truncated";
    case Code::kUnavailable: return "unavailable";
    case Code::kInternal: return "internal error";
    case Code::kResourceExhausted: return "resource exhausted";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(code_name(code_)) + ": " + message_;
}

}  // namespace tether
