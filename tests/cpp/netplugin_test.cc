// The testnet NCCL net plugin (tests/netplugin) driven through tether's loader: the ABI tables,
// non-blocking connect/accept, the 16-request ring that fails when exceeded, payload scattered over
// bounce pages described by unpack metadata, and the consume-too-early hazard being real.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "transport/netplugin/plugin.h"

using namespace tether;
using namespace tether::transport;
namespace nabi = tether::netabi;

namespace {

std::shared_ptr<NetPlugin> load_testnet() {
  auto r = NetPlugin::load(TETHER_TESTNET_PATH);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? r.take() : nullptr;
}

struct Pair {
  std::shared_ptr<NetPlugin> net;
  void* listen = nullptr;
  void* send = nullptr;
  void* recv = nullptr;
  nabi::DeviceHandle* dev = nullptr;
  uint8_t handle[nabi::kHandleMaxSize];

  explicit Pair(std::shared_ptr<NetPlugin> n, int device = 0) : net(std::move(n)) {
    EXPECT_EQ(net->listen(device, handle, &listen), nabi::kSuccess);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while ((!send || !recv) && std::chrono::steady_clock::now() < deadline) {
      nabi::DeviceHandle* sdev = nullptr;
      if (!send) EXPECT_EQ(net->connect(device, handle, &send, &sdev), nabi::kSuccess);
      if (!recv) EXPECT_EQ(net->accept(listen, &recv, &dev), nabi::kSuccess);
    }
    EXPECT_TRUE(send && recv);
  }
  ~Pair() {
    if (send) net->close_send(send);
    if (recv) net->close_recv(recv);
    if (listen) net->close_listen(listen);
  }
  nabi::UnpackDeviceHandle* unpack() const { return static_cast<nabi::UnpackDeviceHandle*>(dev->handle); }
};

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = uint8_t(rng());
  return v;
}

// Drives both requests to completion (test() progresses the comms). Returns the received size.
size_t wait_both(NetPlugin& net, void* sreq, void* rreq) {
  int sdone = sreq ? 0 : 1, rdone = 0;
  size_t got = 0, sent = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((!sdone || !rdone) && std::chrono::steady_clock::now() < deadline) {
    if (!sdone) EXPECT_EQ(net.test(sreq, &sdone, &sent), nabi::kSuccess);
    if (!rdone) EXPECT_EQ(net.test(rreq, &rdone, &got), nabi::kSuccess);
  }
  EXPECT_TRUE(sdone && rdone);
  return got;
}

// The host unpack: what tether's Unpacker does on CPU.
void unpack(const nabi::UnpackDeviceHandle* h, uint64_t k, uint8_t* dest) {
  const int slot = int(k % nabi::kUnpackQueueDepth);
  const auto* bounce = static_cast<const uint8_t*>(h->bounce_buf);
  for (uint64_t i = 0; i < h->meta->cnt[slot]; ++i) {
    const nabi::UnpackEntry& e = h->meta->mem[slot][i];
    std::memcpy(dest + e.dst_off, bounce + e.src_off, e.len);
  }
}

struct Registered {
  NetPlugin& net;
  void* comm;
  void* mh = nullptr;
  Registered(NetPlugin& n, void* c, void* data, size_t size) : net(n), comm(c) {
    EXPECT_EQ(net.reg_mr(comm, data, size, nabi::kPtrHost, &mh), nabi::kSuccess);
  }
  ~Registered() { net.dereg_mr(comm, mh); }
};

}  // namespace

TEST(NetPluginLoader, PicksTheHighestAbiTable) {
  auto v8 = load_testnet();
  ASSERT_TRUE(v8);
  EXPECT_EQ(v8->abi_version(), 8);
  EXPECT_EQ(v8->name(), "testnet");
  EXPECT_EQ(v8->devices(), 2);
  auto v7 = NetPlugin::load(TETHER_TESTNET_V7_PATH);
  ASSERT_TRUE(v7.is_ok()) << v7.status().to_string();
  EXPECT_EQ(v7.value()->abi_version(), 7);
}

TEST(NetPluginLoader, RefusesWhatIsNoPlugin) {
  auto missing = NetPlugin::load("/nonexistent/libnccl-net.so");
  EXPECT_EQ(missing.status().code(), Code::kUnavailable);
  auto none = NetPlugin::load("");
  EXPECT_EQ(none.status().code(), Code::kUnavailable);
  auto not_plugin = NetPlugin::load("libm.so.6");  // a real library with no ncclNetPlugin table
  EXPECT_EQ(not_plugin.status().code(), Code::kUnavailable);
  EXPECT_NE(not_plugin.status().message().find("ncclNetPlugin"), std::string::npos);
}

TEST(NetPlugin, PropertiesDescribeAnUnpackDevice) {
  auto net = load_testnet();
  ASSERT_TRUE(net);
  auto p = net->properties(1);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p.value().name, "testnet1");
  EXPECT_EQ(p.value().device_type, nabi::kDeviceUnpack);
  EXPECT_EQ(p.value().device_version, nabi::kUnpackVersion);
  EXPECT_TRUE(p.value().ptr_support & nabi::kPtrHost);
  EXPECT_EQ(net->properties(2).status().code(), Code::kInvalidArgument);
}

TEST(NetPlugin, ScatteredPagesUnpackToEveryByte) {
  auto net = load_testnet();
  ASSERT_TRUE(net);
  Pair pr(net, 1);
  ASSERT_TRUE(pr.dev && pr.dev->type == nabi::kDeviceUnpack);
  std::vector<uint8_t> posted(nabi::kUnpackMaxRecv, 0xEE), dest(nabi::kUnpackMaxRecv);
  Registered rmr(*net, pr.recv, posted.data(), posted.size());
  uint64_t k = 0;
  for (size_t size : {size_t(0), size_t(1), size_t(4095), size_t(4096), size_t(4097), size_t(100003),
                      size_t(1) << 20, nabi::kUnpackMaxRecv}) {
    auto src = random_bytes(size, uint32_t(size));
    Registered smr(*net, pr.send, src.data(), src.size());
    void *sreq = nullptr, *rreq = nullptr;
    const int tag = int(1000 + k);
    ASSERT_EQ(net->irecv(pr.recv, posted.data(), posted.size(), tag, rmr.mh, &rreq), nabi::kSuccess);
    ASSERT_EQ(net->isend(pr.send, src.data(), size, tag, smr.mh, &sreq), nabi::kSuccess);
    ASSERT_EQ(wait_both(*net, sreq, rreq), size);
    // The fragments: at most a page each, inside one page, covering [0, size) exactly once.
    const int slot = int(k % nabi::kUnpackQueueDepth);
    uint64_t covered = 0;
    std::set<uint32_t> pages;
    for (uint64_t i = 0; i < pr.unpack()->meta->cnt[slot]; ++i) {
      const auto& e = pr.unpack()->meta->mem[slot][i];
      EXPECT_LE(e.len, nabi::kUnpackPage);
      EXPECT_EQ(e.src_off / nabi::kUnpackPage, (e.src_off + e.len - 1) / nabi::kUnpackPage);
      EXPECT_EQ(e.dst_off, covered);
      covered += e.len;
      pages.insert(e.src_off / uint32_t(nabi::kUnpackPage));
    }
    EXPECT_EQ(covered, size);
    if (size >= (1u << 20)) {  // scattered: the pages are not one ascending run
      uint32_t runs = 0, prev = UINT32_MAX - 1;
      for (uint64_t i = 0; i < pr.unpack()->meta->cnt[slot]; ++i) {
        const uint32_t pg = pr.unpack()->meta->mem[slot][i].src_off / uint32_t(nabi::kUnpackPage);
        runs += pg != prev + 1 && pg != prev;
        prev = pg;
      }
      EXPECT_GT(runs, pages.size() / 4);
    }
    std::memset(dest.data(), 0x5A, dest.size());
    unpack(pr.unpack(), k, dest.data());
    EXPECT_EQ(std::memcmp(dest.data(), src.data(), size), 0) << "size " << size;
    for (size_t i = size; i < dest.size(); i += 4093) ASSERT_EQ(dest[i], 0x5A);
    EXPECT_EQ(net->irecv_consumed(pr.recv, rreq), nabi::kSuccess);
    ++k;
  }
  // The posted buffer itself is never written by an unpack device.
  for (uint8_t b : posted) ASSERT_EQ(b, 0xEE);
}

TEST(NetPlugin, SeventeenthRequestFails) {
  auto net = load_testnet();
  ASSERT_TRUE(net);
  Pair pr(net);
  std::vector<uint8_t> buf(64 << 10);
  Registered rmr(*net, pr.recv, buf.data(), buf.size());
  Registered smr(*net, pr.send, buf.data(), buf.size());
  std::vector<void*> rreqs, sreqs;
  for (int i = 0; i < 16; ++i) {
    void* r = nullptr;
    ASSERT_EQ(net->irecv(pr.recv, buf.data(), 4096, i, rmr.mh, &r), nabi::kSuccess);
    ASSERT_TRUE(r);
    rreqs.push_back(r);
  }
  void* extra = nullptr;
  EXPECT_EQ(net->irecv(pr.recv, buf.data(), 4096, 16, rmr.mh, &extra), nabi::kInternalError);
  EXPECT_EQ(extra, nullptr);
  for (int i = 0; i < 16; ++i) {
    void* s = nullptr;
    ASSERT_EQ(net->isend(pr.send, buf.data(), 4096, i, smr.mh, &s), nabi::kSuccess);
    sreqs.push_back(s);
  }
  EXPECT_EQ(net->isend(pr.send, buf.data(), 4096, 16, smr.mh, &extra), nabi::kInternalError);
  // A completed receive still holds its slot until irecvConsumed; consuming before done is misuse.
  for (int i = 0; i < 16; ++i) wait_both(*net, sreqs[i], rreqs[i]);
  EXPECT_EQ(net->irecv(pr.recv, buf.data(), 4096, 16, rmr.mh, &extra), nabi::kInternalError);
  ASSERT_EQ(net->irecv_consumed(pr.recv, rreqs[0]), nabi::kSuccess);
  EXPECT_EQ(net->irecv(pr.recv, buf.data(), 4096, 16, rmr.mh, &extra), nabi::kSuccess);
  EXPECT_EQ(net->irecv_consumed(pr.recv, extra), nabi::kInvalidUsage);  // not completed yet
}

TEST(NetPlugin, ConsumingBeforeUnpackCorruptsData) {
  auto net = load_testnet();
  ASSERT_TRUE(net);
  Pair pr(net);
  const size_t size = 256 << 10;
  std::vector<uint8_t> posted(size), dest(size);
  auto a = random_bytes(size, 1), b = random_bytes(size, 2);
  Registered rmr(*net, pr.recv, posted.data(), size);
  Registered amr(*net, pr.send, a.data(), size), bmr(*net, pr.send, b.data(), size);
  void *s = nullptr, *ra = nullptr, *rb = nullptr;
  ASSERT_EQ(net->irecv(pr.recv, posted.data(), size, 1, rmr.mh, &ra), nabi::kSuccess);
  ASSERT_EQ(net->isend(pr.send, a.data(), size, 1, amr.mh, &s), nabi::kSuccess);
  wait_both(*net, s, ra);
  auto pages_of = [&](int slot) {
    std::set<uint32_t> pages;
    for (uint64_t i = 0; i < pr.unpack()->meta->cnt[slot]; ++i)
      pages.insert(pr.unpack()->meta->mem[slot][i].src_off / uint32_t(nabi::kUnpackPage));
    return pages;
  };
  const std::set<uint32_t> a_pages = pages_of(0);
  // Wrong order: give A's pages back, let B arrive, then unpack A.
  ASSERT_EQ(net->irecv_consumed(pr.recv, ra), nabi::kSuccess);
  ASSERT_EQ(net->irecv(pr.recv, posted.data(), size, 2, rmr.mh, &rb), nabi::kSuccess);
  ASSERT_EQ(net->isend(pr.send, b.data(), size, 2, bmr.mh, &s), nabi::kSuccess);
  wait_both(*net, s, rb);
  size_t reused = 0;
  for (uint32_t p : pages_of(1)) reused += a_pages.count(p);
  EXPECT_GE(reused, a_pages.size() - 1) << "B should land in the pages A gave back";
  unpack(pr.unpack(), 0, dest.data());
  size_t differ = 0;
  for (size_t i = 0; i < size; ++i) differ += dest[i] != a[i];
  EXPECT_GT(differ, size / 2) << "consuming before the unpack went unnoticed";
  // Right order for B: unpack, then consume.
  unpack(pr.unpack(), 1, dest.data());
  EXPECT_EQ(std::memcmp(dest.data(), b.data(), size), 0);
  EXPECT_EQ(net->irecv_consumed(pr.recv, rb), nabi::kSuccess);
}

TEST(NetPlugin, TagMismatchAndOversizeAreErrors) {
  auto net = load_testnet();
  ASSERT_TRUE(net);
  std::vector<uint8_t> buf(8192);
  {
    Pair pr(net);
    Registered rmr(*net, pr.recv, buf.data(), buf.size()), smr(*net, pr.send, buf.data(), buf.size());
    void *s = nullptr, *r = nullptr;
    ASSERT_EQ(net->irecv(pr.recv, buf.data(), 4096, 7, rmr.mh, &r), nabi::kSuccess);
    ASSERT_EQ(net->isend(pr.send, buf.data(), 4096, 8, smr.mh, &s), nabi::kSuccess);
    int done = 0;
    int rc = nabi::kSuccess;
    for (int i = 0; i < 100000 && rc == nabi::kSuccess && !done; ++i) rc = net->test(r, &done, nullptr);
    EXPECT_NE(rc, nabi::kSuccess);
  }
  {
    Pair pr(net);
    Registered rmr(*net, pr.recv, buf.data(), buf.size()), smr(*net, pr.send, buf.data(), buf.size());
    void *s = nullptr, *r = nullptr;
    ASSERT_EQ(net->irecv(pr.recv, buf.data(), 100, 1, rmr.mh, &r), nabi::kSuccess);
    ASSERT_EQ(net->isend(pr.send, buf.data(), 4096, 1, smr.mh, &s), nabi::kSuccess);
    int done = 0;
    int rc = nabi::kSuccess;
    for (int i = 0; i < 100000 && rc == nabi::kSuccess && !done; ++i) rc = net->test(r, &done, nullptr);
    EXPECT_NE(rc, nabi::kSuccess);
    // Sends from unregistered memory and receives above 4 MiB are refused up front.
    std::vector<uint8_t> other(16);
    void* x = nullptr;
    EXPECT_EQ(net->isend(pr.send, other.data(), 16, 2, smr.mh, &x), nabi::kInvalidArgument);
    EXPECT_EQ(net->irecv(pr.recv, buf.data(), nabi::kUnpackMaxRecv + 1, 2, rmr.mh, &x), nabi::kInvalidArgument);
  }
}

TEST(NetPlugin, V7TableMovesData) {
  auto r = NetPlugin::load(TETHER_TESTNET_V7_PATH);
  ASSERT_TRUE(r.is_ok());
  auto net = r.take();
  Pair pr(net);
  auto src = random_bytes(50000, 7);
  std::vector<uint8_t> posted(65536), dest(65536);
  Registered rmr(*net, pr.recv, posted.data(), posted.size()), smr(*net, pr.send, src.data(), src.size());
  void *s = nullptr, *q = nullptr;
  ASSERT_EQ(net->irecv(pr.recv, posted.data(), posted.size(), 3, rmr.mh, &q), nabi::kSuccess);
  ASSERT_EQ(net->isend(pr.send, src.data(), src.size(), 3, smr.mh, &s), nabi::kSuccess);
  ASSERT_EQ(wait_both(*net, s, q), src.size());
  unpack(pr.unpack(), 0, dest.data());
  EXPECT_EQ(std::memcmp(dest.data(), src.data(), src.size()), 0);
  EXPECT_EQ(net->irecv_consumed(pr.recv, q), nabi::kSuccess);
}
