// Status: the one error type of the C++ API. Python maps each code to a typed exception.
#pragma once
#include <string>
#include <utility>

namespace tether {

enum class Code : int {
  kOk = 0,
  kInvalidArgument,   // malformed call: bad length, bad descriptor bytes, wrong peer
  kNotFound,          // region unknown or deregistered at the target
  kAccessDenied,      // key does not match, or region is read-only
  kOutOfRange,        // offset/length outside the region or the descriptor's range
  kTimeout,           // wait() or connect deadline passed
  kConnectionLost,    // peer died, socket error, peer timed out
  kProtocolError,     // garbage on a socket, version mismatch
  kAuthFailed,        // shared secret missing or wrong
  kCancelled,         // endpoint closed while the transfer was in flight
  kTruncated,         // two-sided message larger than the posted receive
  kUnavailable,       // transport or feature not available on this machine
  kInternal,
  kResourceExhausted, // the peer's bounded queue is full (unread notifications); retry after it drains
};

const char* code_name(Code c);

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }
  bool is_ok() const { return code_ == Code::kOk; }
  explicit operator bool() const { return is_ok(); }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// Holds a value or an error.
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT
  bool is_ok() const { return status_.is_ok(); }
  const Status& status() const { return status_; }
  T& value() { return value_; }
  T&& take() { return std::move(value_); }

 private:
  Status status_;
  T value_{};
};

}  // namespace tether
