// Known-answer tests for the hashes that guard the handshake and descriptor keys.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "sys/crypto.h"

using namespace tether;

static std::string hex(const uint8_t* p, size_t n) {
  std::string s;
  char b[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", p[i]);
    s += b;
  }
  return s;
}

TEST(Crypto, Sha256KnownAnswers) {
  auto d = crypto::sha256("abc", 3);
  EXPECT_EQ(hex(d.data(), 32), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  auto e = crypto::sha256("", 0);
  EXPECT_EQ(hex(e.data(), 32), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  std::string m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // two blocks
  auto f = crypto::sha256(m.data(), m.size());
  EXPECT_EQ(hex(f.data(), 32), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Crypto, HmacSha256Rfc4231Case2) {
  const std::string msg = "what do ya want for nothing?";
  auto d = crypto::hmac_sha256("Jefe", msg.data(), msg.size());
  EXPECT_EQ(hex(d.data(), 32), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(Crypto, HmacLongKeyIsHashedFirst) {
  std::string key(131, '\xaa');
  const std::string msg = "Test Using Larger Than Block-Size Key - Hash Key First";
  auto d = crypto::hmac_sha256(key, msg.data(), msg.size());
  EXPECT_EQ(hex(d.data(), 32), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(Crypto, SipHashReferenceVector) {
  // Reference implementation's vector: key 00..0f, message 00..0e (15 bytes).
  uint8_t key[16], msg[15];
  for (int i = 0; i < 16; ++i) key[i] = uint8_t(i);
  for (int i = 0; i < 15; ++i) msg[i] = uint8_t(i);
  EXPECT_EQ(crypto::siphash24(key, msg, 15), 0xa129ca6149be45e5ULL);
  EXPECT_EQ(crypto::siphash24(key, msg, 0), 0x726fdb47dd0e0e31ULL);
}

TEST(Crypto, RandomIsNotConstant) {
  EXPECT_NE(crypto::random_u64(), crypto::random_u64());
}
