// The C++ API end to end: two endpoints in one process over loopback TCP.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "tether/endpoint.h"

using namespace tether;

namespace {

std::unique_ptr<Endpoint> make(Config c = {}) {
  auto r = Endpoint::create(c);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.take();
}

std::vector<uint8_t> random_bytes(size_t n) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = uint8_t(rng());
  return v;
}

// n random bytes on `a` (src), and two poisoned buffers: `dst` on `b`, `back` on `a` for reads.
struct Buffers {
  std::vector<uint8_t> src, dst, back;
  Region rs, rb, rd;
  RemoteRegion d;
  Buffers(Endpoint& a, Endpoint& b, size_t n) : src(random_bytes(n)), dst(n, 0xA5), back(n, 0x5A) {
    rs = a.register_memory(src.data(), n).take();
    rb = a.register_memory(back.data(), n).take();
    rd = b.register_memory(dst.data(), n).take();
    d = RemoteRegion::parse(rd.descriptor().value()).take();
  }
};

}  // namespace

TEST(Loopback, WriteReadVectoredAndNotify) {
  Config c;
  c.chunk_bytes = 64 << 10;  // many chunks across both lanes
  auto a = make(c), b = make(c);
  auto peer = a->connect(b->metadata());
  ASSERT_TRUE(peer.is_ok()) << peer.status().to_string();
  const size_t n = (4 << 20) + 3;
  Buffers x(*a, *b, n);
  auto &src = x.src, &dst = x.dst, &back = x.back;
  const Region &rs = x.rs, &rb = x.rb;
  const RemoteRegion& d = x.d;

  ASSERT_TRUE(peer.value().write(rs, 0, d, 0, n, "done").wait(10000).is_ok());
  EXPECT_EQ(dst, src);
  auto notes = b->wait_notifications(5000);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].data, "done");

  ASSERT_TRUE(peer.value().read(rb, 0, d, 0, n).wait(10000).is_ok());
  EXPECT_EQ(back, src);

  std::fill(dst.begin(), dst.end(), 0xA5);
  std::vector<IoEntry> entries;
  for (size_t i = 0; i < 100; ++i) entries.push_back(IoEntry{rs, i * 1000, d, (99 - i) * 1000, 1000});
  ASSERT_TRUE(peer.value().writev(entries).wait(10000).is_ok());
  for (size_t i = 0; i < 100; ++i)
    ASSERT_TRUE(std::equal(src.begin() + i * 1000, src.begin() + (i + 1) * 1000, dst.begin() + (99 - i) * 1000));
  EXPECT_EQ(dst[100 * 1000], 0xA5);  // nothing beyond what was written
}

// poll() is done() that also reads the answer itself: a caller polling in a loop (NIXL's checkXfer)
// sees small writes and reads finish with every byte in place, and a finished transfer stays done.
TEST(Loopback, PollingSmallTransfersToTheEnd) {
  Config c;
  c.transport = "tcp";  // the transport whose lanes poll() reads
  auto a = make(c), b = make(c);
  Peer peer = a->connect(b->metadata()).take();
  const size_t n = 4096 + 5;
  Buffers x(*a, *b, n);
  for (int i = 0; i < 200; ++i) {
    Transfer t = i % 2 ? peer.read(x.rb, 0, x.d, 0, n) : peer.write(x.rs, 0, x.d, 0, n);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!t.poll()) ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "poll() never saw the end";
    ASSERT_TRUE(t.status().is_ok()) << t.status().to_string();
    EXPECT_TRUE(t.poll() && t.done());
  }
  EXPECT_EQ(x.dst, x.src);
  EXPECT_EQ(x.back, x.src);
}

TEST(Loopback, BlocksScatterGatherEveryByte) {
  Config c;
  c.chunk_bytes = 64 << 10;
  auto a = make(c), b = make(c);
  Peer peer = a->connect(b->metadata()).take();
  const size_t n = 512, slot = 1000;
  auto src = random_bytes(n * slot);
  std::vector<uint8_t> dst(n * slot + 7, 0xA5), back(n * slot, 0x5A);
  Region rs = a->register_memory(src.data(), src.size()).take();
  Region rb = a->register_memory(back.data(), back.size()).take();
  Region rd = b->register_memory(dst.data(), dst.size()).take();
  RemoteRegion d = RemoteRegion::parse(rd.descriptor(7).value()).take();  // offsets relative to byte 7
  std::vector<uint64_t> perm(n);
  for (size_t i = 0; i < n; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(n));
  std::vector<Block> blocks(n);
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {  // lengths 0..slot-1: some blocks are empty, every slot has a gap
    blocks[i] = Block{i * slot, perm[i] * slot, (i * 37) % slot};
    total += blocks[i].length;
  }
  Transfer w = peer.writev(rs, d, blocks.data(), n, "blocks");
  ASSERT_TRUE(w.wait(10000).is_ok()) << w.status().to_string();
  EXPECT_EQ(w.bytes(), total);
  std::vector<uint8_t> expect(dst.size(), 0xA5);
  for (const Block& bl : blocks)
    std::copy_n(src.begin() + bl.local_offset, bl.length, expect.begin() + 7 + bl.remote_offset);
  EXPECT_EQ(dst, expect);
  ASSERT_EQ(b->wait_notifications(5000).size(), 1u);

  ASSERT_TRUE(peer.readv(rb, d, blocks.data(), n).wait(10000).is_ok());
  std::vector<uint8_t> expect_back(back.size(), 0x5A);
  for (const Block& bl : blocks)
    std::copy_n(src.begin() + bl.local_offset, bl.length, expect_back.begin() + bl.local_offset);
  EXPECT_EQ(back, expect_back);
}

TEST(Loopback, BadBlockIsNamedAndNothingMoves) {
  auto a = make(), b = make();
  Peer peer = a->connect(b->metadata()).take();
  std::vector<uint8_t> src(10000, 1), dst(10000, 0xA5);
  Region rs = a->register_memory(src.data(), src.size()).take();
  Region rd = b->register_memory(dst.data(), dst.size()).take();
  RemoteRegion d = RemoteRegion::parse(rd.descriptor().value()).take();
  std::vector<Block> blocks;
  for (uint64_t i = 0; i < 100; ++i) blocks.push_back(Block{i * 100, i * 100, 100});
  blocks[37].remote_offset = 9950;  // 50 bytes past the descriptor
  Status s = peer.writev(rs, d, blocks.data(), blocks.size()).wait(1000);
  EXPECT_EQ(s.code(), Code::kOutOfRange);
  EXPECT_NE(s.message().find("(block 37)"), std::string::npos) << s.message();
  blocks[37].remote_offset = 3700;
  blocks[3].local_offset = 9901;
  s = peer.readv(rs, d, blocks.data(), blocks.size()).wait(1000);
  EXPECT_EQ(s.code(), Code::kOutOfRange);
  EXPECT_NE(s.message().find("local range [9901, +100) exceeds local region of 10000 bytes (remote range [300, +100)"),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("(block 3)"), std::string::npos) << s.message();
  // The IoEntry form names entries; equal descriptors in a row are one run, a change starts another.
  RemoteRegion d2 = RemoteRegion::parse(rd.descriptor(5000).value()).take();
  std::vector<IoEntry> entries{{rs, 0, d, 0, 10}, {rs, 10, d, 10, 10}, {rs, 20, d2, 0, 10}, {rs, 30, d2, 4999, 2}};
  s = peer.writev(entries).wait(1000);
  EXPECT_EQ(s.code(), Code::kOutOfRange);
  EXPECT_NE(s.message().find("(entry 3)"), std::string::npos) << s.message();
  EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](uint8_t x) { return x == 0xA5; }));
  entries.pop_back();
  ASSERT_TRUE(peer.writev(entries).wait(10000).is_ok());
  EXPECT_EQ(dst[0], 1);
  EXPECT_EQ(dst[5000], 1);
  EXPECT_EQ(dst[5010], 0xA5);
}

TEST(Loopback, SendRecvMatchesByTag) {
  auto a = make(), b = make();
  auto peer = a->connect(b->address()).take();
  auto src = random_bytes(100000);
  std::vector<uint8_t> dst(200000, 0);
  Region rs = a->register_memory(src.data(), src.size()).take();
  Region rd = b->register_memory(dst.data(), dst.size()).take();
  Transfer s2 = peer.send(rs, 0, 50000, 2);
  Transfer s1 = peer.send(rs, 50000, 50000, 1);
  auto accepted = b->peers();
  ASSERT_EQ(accepted.size(), 1u);
  Transfer r1 = accepted[0].recv(rd, 0, 100000, 1);
  Transfer r2 = accepted[0].recv(rd, 100000, 100000, 2);
  ASSERT_TRUE(r1.wait(10000).is_ok());
  ASSERT_TRUE(r2.wait(10000).is_ok());
  ASSERT_TRUE(s1.wait(10000).is_ok() && s2.wait(10000).is_ok());
  EXPECT_EQ(r1.bytes(), 50000u);
  EXPECT_TRUE(std::equal(src.begin() + 50000, src.end(), dst.begin()));
  EXPECT_TRUE(std::equal(src.begin(), src.begin() + 50000, dst.begin() + 100000));
}

TEST(Loopback, ErrorsAreStatusesNotCrashes) {
  auto a = make(), b = make();
  auto peer = a->connect(b->address()).take();
  std::vector<uint8_t> buf(1024);
  Region r = a->register_memory(buf.data(), buf.size()).take();
  Region t = b->register_memory(buf.data(), buf.size()).take();
  RemoteRegion d = RemoteRegion::parse(t.descriptor(0, 512).value()).take();
  EXPECT_EQ(peer.write(r, 0, d, 0, 513).wait(1000).code(), Code::kOutOfRange);
  EXPECT_EQ(peer.write(r, 1000, d, 0, 100).wait(1000).code(), Code::kOutOfRange);
  RemoteRegion bad = d;
  bad.key ^= 42;
  EXPECT_EQ(peer.write(r, 0, bad, 0, 10).wait(5000).code(), Code::kAccessDenied);
  ASSERT_TRUE(b->deregister(t).is_ok());
  EXPECT_EQ(peer.write(r, 0, d, 0, 10).wait(5000).code(), Code::kNotFound);
  EXPECT_EQ(a->connect("127.0.0.1:1").status().code(), Code::kConnectionLost);
  EXPECT_EQ(a->connect("nonsense").status().code(), Code::kInvalidArgument);
  b->close();
  Status s = peer.write(r, 0, d, 0, 10).wait(5000);
  EXPECT_FALSE(s.is_ok());
}

TEST(Loopback, AuthTokenMustMatch) {
  Config good, bad;
  good.auth_token = "secret";
  bad.auth_token = "guess";
  auto server = make(good), ok = make(good), wrong = make(bad), none = make();
  EXPECT_TRUE(ok->connect(server->address()).is_ok());
  EXPECT_EQ(wrong->connect(server->address()).status().code(), Code::kAuthFailed);
  EXPECT_EQ(none->connect(server->address()).status().code(), Code::kAuthFailed);
}

// A transport named in the Config must exist and work here; create() says so, not connect(), so a
// misconfiguration shows when the endpoint is made, not at the first peer.
TEST(Loopback, CreateRefusesUnknownOrUnusableTransport) {
  Config c;
  c.transport = "fabirc";
  auto r = Endpoint::create(c);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("fabirc"), std::string::npos) << r.status().message();
  c.transport = "fabric";
  c.fabric_library = "/nonexistent/libfabric.so.1";
  r = Endpoint::create(c);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kUnavailable);
  EXPECT_NE(r.status().message().find("transport fabric cannot be used here"), std::string::npos) << r.status().message();
}
