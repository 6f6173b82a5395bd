// Small keyed hashes, written here so tether needs no crypto library (no dependency on the rest of tether).
//  - HMAC-SHA-256 proves possession of the shared auth token in the handshake.
//  - SipHash-2-4 (a keyed 64-bit MAC made for short inputs) binds a descriptor's key to
//    exactly (region, offset, length): holding the bytes for one range grants nothing else.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tether::crypto {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t len);
Digest hmac_sha256(std::string_view key, const void* msg, size_t len);

// SipHash-2-4 with a 128-bit key.
uint64_t siphash24(const uint8_t key[16], const void* data, size_t len);

// Cryptographically random bytes (getrandom); aborts only if the kernel refuses entropy.
void random_bytes(void* out, size_t len);
uint64_t random_u64();

// Constant-time comparison for proofs and keys.
bool equal(const void* a, const void* b, size_t len);

}  // namespace tether::crypto
