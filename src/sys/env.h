// Option values from text, one parser per kind, shared by keywords and TETHER_* variables so both take
// the same spellings. Each takes the whole text or nothing and leaves *out untouched when it refuses.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tether::sys {

// A whole number: decimal, or hexadecimal with 0x.
bool parse_uint(std::string_view text, uint64_t max, uint64_t* out);
// Bytes: a whole number, or a number with a binary unit K, M, G or T (1K = 1024; KiB, KB and k are the
// same), e.g. 4194304, 4M, 4MiB, 1.5G; the result must be whole.
bool parse_size(std::string_view text, uint64_t max, uint64_t* out);
// true/false, 1/0, yes/no, on/off, in any case.
bool parse_bool(std::string_view text, bool* out);
// A duration into whole units of `field_us` microseconds (rounded): a plain number counts units of
// `plain_us`; a number with us, ms or s counts those.
bool parse_duration(std::string_view text, double plain_us, double field_us, uint64_t max, uint64_t* out);

// Process-wide knobs (diagnostics, test faults): rows of the option table (src/core/config.cc), checked
// when an endpoint is created; a value the table refuses reads as the row's default.
bool env_flag(const char* name);
std::string env_text(const char* name);

}  // namespace tether::sys
