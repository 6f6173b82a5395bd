#include "sys/env.h"

#include <cmath>
#include <cstdlib>

namespace tether::sys {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

char lower(char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; }

bool equals_lower(std::string_view text, std::string_view word) {
  if (text.size() != word.size()) return false;
  for (size_t i = 0; i < text.size(); ++i)
    if (lower(text[i]) != word[i]) return false;
  return true;
}

// The leading "123" or "1.25" of `text`: at least one digit, at most one dot; its length, or 0.
size_t number_length(std::string_view text) {
  size_t i = 0, digits = 0;
  bool dot = false;
  for (; i < text.size(); ++i) {
    if (is_digit(text[i])) {
      ++digits;
    } else if (text[i] == '.' && !dot) {
      dot = true;
    } else {
      break;
    }
  }
  return digits ? i : 0;
}

// 2^10 per step of K, M, G, T; 1 for "" and "b"; 0 for anything else.
uint64_t size_unit(std::string_view unit) {
  if (unit.empty() || equals_lower(unit, "b")) return 1;
  const char* const prefixes = "kmgt";
  for (int i = 0; i < 4; ++i) {
    const char p[2] = {prefixes[i], '\0'};
    const std::string one(p), kb = one + "b", kib = one + "ib";
    if (equals_lower(unit, one) || equals_lower(unit, kb) || equals_lower(unit, kib)) return uint64_t(1) << (10 * (i + 1));
  }
  return 0;
}

}  // namespace

bool parse_uint(std::string_view text, uint64_t max, uint64_t* out) {
  int base = 10;
  if (text.size() > 2 && text[0] == '0' && lower(text[1]) == 'x') {
    base = 16;
    text.remove_prefix(2);
  }
  if (text.empty()) return false;
  unsigned __int128 v = 0;
  for (char c : text) {
    int d = is_digit(c) ? c - '0' : (base == 16 && lower(c) >= 'a' && lower(c) <= 'f') ? lower(c) - 'a' + 10 : -1;
    if (d < 0) return false;
    v = v * base + unsigned(d);
    if (v > max) return false;
  }
  *out = uint64_t(v);
  return true;
}

bool parse_size(std::string_view text, uint64_t max, uint64_t* out) {
  if (text.size() > 2 && text[0] == '0' && lower(text[1]) == 'x') return parse_uint(text, max, out);
  const size_t n = number_length(text);
  const uint64_t unit = n ? size_unit(text.substr(n)) : 0;
  if (unit == 0) return false;
  const std::string_view number = text.substr(0, n);
  const size_t dot = number.find('.');
  const std::string_view whole = number.substr(0, dot), frac = dot == number.npos ? "" : number.substr(dot + 1);
  if (whole.size() > 20 || frac.size() > 18) return false;
  unsigned __int128 w = 0, f = 0, scale = 1;
  for (char c : whole) w = w * 10 + unsigned(c - '0');
  for (char c : frac) f = f * 10 + unsigned(c - '0'), scale *= 10;
  if ((f * unit) % scale != 0) return false;  // not a whole number of bytes
  const unsigned __int128 v = w * unit + f * unit / scale;
  if (v > max) return false;
  *out = uint64_t(v);
  return true;
}

bool parse_bool(std::string_view text, bool* out) {
  for (const char* t : {"1", "true", "yes", "on"})
    if (equals_lower(text, t)) return *out = true, true;
  for (const char* f : {"0", "false", "no", "off"})
    if (equals_lower(text, f)) return *out = false, true;
  return false;
}

bool parse_duration(std::string_view text, double plain_us, double field_us, uint64_t max, uint64_t* out) {
  const size_t n = number_length(text);
  if (n == 0 || n > 24) return false;
  const std::string_view unit = text.substr(n);
  double unit_us = 0;
  if (unit.empty()) unit_us = plain_us;
  else if (equals_lower(unit, "us")) unit_us = 1;
  else if (equals_lower(unit, "ms")) unit_us = 1e3;
  else if (equals_lower(unit, "s")) unit_us = 1e6;
  else return false;
  const double v = std::strtod(std::string(text.substr(0, n)).c_str(), nullptr) * unit_us / field_us;
  if (!std::isfinite(v) || v > double(max)) return false;
  *out = uint64_t(std::llround(v));
  return true;
}

}  // namespace tether::sys
