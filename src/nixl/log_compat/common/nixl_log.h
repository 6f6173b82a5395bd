// Stands in for NIXL's common/nixl_log.h, which needs Abseil 20250814 (Debian 12 ships 20220623):
// NIXL's backend headers use only its logging and assertion macros. Ours write one line to stderr,
// the way NIXL's own messages reach a user; INFO and below are dropped (the plugin logs errors only).
#pragma once
#include <iostream>
#include <sstream>
#include <string>
#include <system_error>

namespace tether::nixl_log {

class Line {
 public:
  explicit Line(const char* level) : level_(level) {}
  Line(const Line&) = delete;
  ~Line() { std::cerr << "tether-nixl " << level_ << ": " << text_.str() << std::endl; }
  template <typename T>
  Line& operator<<(const T& v) {
    text_ << v;
    return *this;
  }

 private:
  const char* level_;
  std::ostringstream text_;
};

struct Null {
  template <typename T>
  Null& operator<<(const T&) {
    return *this;
  }
};

}  // namespace tether::nixl_log

#define NIXL_FATAL ::tether::nixl_log::Line("fatal")
#define NIXL_ERROR ::tether::nixl_log::Line("error")
#define NIXL_ERROR_FUNC NIXL_ERROR << __FUNCTION__ << ": "
#define NIXL_WARN ::tether::nixl_log::Line("warning")
#define NIXL_INFO ::tether::nixl_log::Null()
#define NIXL_DEBUG ::tether::nixl_log::Null()
#define NIXL_TRACE ::tether::nixl_log::Null()
#define NIXL_ASSERT(condition) \
  while (false) ::tether::nixl_log::Null()
#define NIXL_ASSERT_ALWAYS(condition) \
  if (condition) {                    \
  } else                              \
    NIXL_FATAL << "assertion failed: " #condition

static inline std::string nixl_strerror(int err) { return std::error_code(err, std::generic_category()).message(); }
