// "testnet": an NCCL net plugin (ABI v8, plus a v7 table) over loopback TCP that behaves like
// GPUDirect-TCPX where it matters to a caller:
//  - a hard ring of 16 requests per comm; posting a 17th FAILS (kInternalError), it does not wait;
//  - a receive lands scattered over 4 KiB pages of a bounce buffer (pages handed out from a shuffled
//    free list), described by unpack metadata (netDeviceType = unpack); the posted buffer is untouched;
//  - irecvConsumed gives the pages back and they are reused first (LIFO) by the next receive, so a
//    caller that consumes before copying out reads the next message's bytes;
//  - each receive is matched to the next message in posting order and its tag must equal the
//    sender's (a mismatch is an error: it means the two sides disagree on order).
// Progress happens inside test(); each comm must be driven by one thread at a time (like NCCL's proxy).
//
// Knobs: TETHER_TESTNET_DEVICES (2), TETHER_TESTNET_ADDR (127.0.0.1), TETHER_TESTNET_POOL_BYTES
// (32 MiB of bounce pages per recv comm), TETHER_TESTNET_BOUNCE=host|cuda (cuda: bounce pages in GPU
// memory of TETHER_TESTNET_CUDA_DEVICE, ptrSupport includes CUDA and sends from GPU memory are
// accepted), TETHER_TESTNET_UNPACK=1 (0: an ordinary host plugin that receives into the posted buffer).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bounce_memory.h"
#include "transport/netplugin/net_abi.h"

using namespace tether::netabi;

namespace {

constexpr int kMaxRequests = 16;
constexpr uint32_t kHandleMagic = 0x54584e54;  // "TNXT"
constexpr uint32_t kMsgMagic = 0x4753534d;
constexpr int kMaxIov = 64;

Logger g_log = nullptr;
int g_ndev = 2;
std::string g_addr = "127.0.0.1";
size_t g_pool_bytes = 32u << 20;
std::string g_bounce = "host";
bool g_unpack = true;
char g_names[8][16];

#define WARN(...) \
  do { if (g_log) g_log(2, 16, __FILE__, __LINE__, __VA_ARGS__); } while (0)

struct Handle {  // what listen() publishes; connect() keeps its progress in the tail
  uint32_t magic;
  int32_t dev;
  uint16_t port;
  uint8_t addr[4];
  int32_t stage;   // connect(): 0 fresh, 1 connecting
  int32_t fd;
};
static_assert(sizeof(Handle) <= kHandleMaxSize);

struct MsgHeader {
  uint32_t magic;
  int32_t tag;
  uint64_t size;
};

struct MemHandle {
  uint8_t* data;
  size_t size;
  int type;
};

struct Comm;
struct Request {
  Comm* comm = nullptr;
  bool used = false;
  bool done = false;
  bool recv = false;
  uint8_t* data = nullptr;
  size_t size = 0;     // posted size (recv) or message size (send)
  size_t got = 0;      // bytes moved so far (after the header)
  int tag = 0;
  int slot = 0;        // unpack metadata slot
  MsgHeader hdr{};
  size_t hdr_got = 0;  // header bytes moved
  std::vector<uint32_t> pages;  // bounce pages this receive holds
  std::vector<uint8_t> host_copy;  // a send from CUDA memory, copied out at isend (TCPX sends from GPU memory)
};

struct Comm {
  int fd = -1;
  bool recv = false;
  bool failed = false;
  Request reqs[kMaxRequests];
  std::vector<Request*> queue;  // posting order; head is in progress
  size_t head = 0;
  uint64_t posted = 0;
  // receive side (unpack)
  std::unique_ptr<testnet::BounceMemory> bounce;
  std::unique_ptr<UnpackMeta> meta;
  UnpackDeviceHandle unpack{};
  DeviceHandle dev_handle{};
  std::vector<uint32_t> free_pages;  // LIFO: a page given back is the next one handed out
  uint32_t cur_page = UINT32_MAX;    // page being filled, and how far
  uint32_t cur_fill = 0;
  uint64_t pages_taken = 0;
  std::vector<uint8_t> staging;      // socket -> staging -> GPU pages when !bounce->direct()
};

struct ListenComm {
  int fd = -1;
  int dev = 0;
};

uint64_t env_u64(const char* name, uint64_t dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 0) : dflt;
}

int set_nonblock_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int fl = ::fcntl(fd, F_GETFL);
  return ::fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

Request* alloc_request(Comm* c) {
  for (auto& r : c->reqs)
    if (!r.used) {
      r.used = true;
      r.done = false;
      r.got = r.hdr_got = 0;
      r.pages.clear();
      r.comm = c;
      return &r;
    }
  return nullptr;
}

// ---------------------------------------------------------------- progress

bool fail(Comm* c, const char* what) {
  if (!c->failed) WARN("testnet: %s: %s", what, errno ? std::strerror(errno) : "");
  c->failed = true;
  return false;
}

// Sends what the head requests hold. False on a socket error.
bool progress_send(Comm* c) {
  while (c->head < c->queue.size()) {
    Request* r = c->queue[c->head];
    iovec iov[2];
    int n = 0;
    if (r->hdr_got < sizeof(MsgHeader))
      iov[n++] = {reinterpret_cast<uint8_t*>(&r->hdr) + r->hdr_got, sizeof(MsgHeader) - r->hdr_got};
    if (r->got < r->size) iov[n++] = {r->data + r->got, r->size - r->got};
    if (n > 0) {
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = n;
      ssize_t s = ::sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (s < 0) return errno == EAGAIN || errno == EINTR ? true : fail(c, "send");
      size_t k = size_t(s);
      const size_t h = std::min(k, sizeof(MsgHeader) - r->hdr_got);
      r->hdr_got += h;
      r->got += k - h;
    }
    if (r->hdr_got < sizeof(MsgHeader) || r->got < r->size) return true;
    r->done = true;
    ++c->head;
  }
  c->queue.erase(c->queue.begin(), c->queue.begin() + c->head);
  c->head = 0;
  return true;
}

// What one read of a staged (unpack) receive did.
enum PageRead { kRead, kWait, kFailed };

// One readv of the next pages (the partly filled one first) for `r`, with a fragment recorded for
// each piece that arrived; pages not reached go back on the free list.
PageRead recv_pages(Comm* c, Request* r, size_t want) {
  iovec iov[kMaxIov];
  uint32_t iov_page[kMaxIov], iov_off[kMaxIov];
  int n = 0;
  size_t left = want - r->got;
  uint32_t page = c->cur_page, fill = c->cur_fill;
  std::vector<uint32_t> taken;  // pages popped for this read (returned if unused)
  while (left > 0 && n < kMaxIov) {
    if (page == UINT32_MAX || fill == kUnpackPage) {
      if (c->free_pages.empty()) break;
      page = c->free_pages.back();
      c->free_pages.pop_back();
      taken.push_back(page);
      // Every fourth page starts mid-page: fragments are not all page-aligned, as with real NICs.
      fill = (c->pages_taken++ % 4 == 3) ? 100 : 0;
    }
    const size_t len = std::min<size_t>(left, kUnpackPage - fill);
    uint8_t* dst = c->bounce->direct() ? c->bounce->base() + size_t(page) * kUnpackPage + fill : nullptr;
    iov[n] = {dst, len};
    iov_page[n] = page, iov_off[n] = fill;
    ++n;
    left -= len;
    fill += uint32_t(len);
  }
  if (n == 0) return kWait;  // no free page: wait until the consumer gives some back
  ssize_t s;
  if (c->bounce->direct()) {
    s = ::readv(c->fd, iov, n);
  } else {
    size_t total = 0;
    for (int i = 0; i < n; ++i) total += iov[i].iov_len;
    total = std::min(total, c->staging.size());
    s = ::recv(c->fd, c->staging.data(), total, MSG_DONTWAIT);
  }
  if (s <= 0) {
    for (auto it = taken.rbegin(); it != taken.rend(); ++it) c->free_pages.push_back(*it), --c->pages_taken;
    if (s == 0) { c->failed = true; return kFailed; }  // the peer closed: normal at teardown, no warning
    if (errno == EAGAIN || errno == EINTR) return kWait;
    fail(c, "recv");
    return kFailed;
  }
  // Record fragments for what arrived; pages not reached go back on the free list.
  size_t k = size_t(s), staged = 0;
  size_t used_taken = 0;
  for (int i = 0; i < n && k > 0; ++i) {
    const size_t len = std::min(k, iov[i].iov_len);
    if (!c->bounce->direct() &&
        !c->bounce->copy_in(size_t(iov_page[i]) * kUnpackPage + iov_off[i], c->staging.data() + staged, len)) {
      errno = 0;
      fail(c, "copy into the GPU bounce buffer failed");
      return kFailed;
    }
    staged += len;
    const bool same_page = iov_page[i] == c->cur_page;
    if (!same_page) {
      ++used_taken;
      r->pages.push_back(iov_page[i]);
    }
    uint64_t& cnt = c->meta->cnt[r->slot];
    UnpackEntry* e = c->meta->mem[r->slot];
    const uint32_t src = uint32_t(size_t(iov_page[i]) * kUnpackPage + iov_off[i]);
    if (same_page && cnt > 0 && e[cnt - 1].src_off + e[cnt - 1].len == src &&
        e[cnt - 1].dst_off + e[cnt - 1].len == r->got) {
      e[cnt - 1].len += uint32_t(len);  // the same page, continued by this read
    } else {
      if (cnt == kUnpackMaxEntries) {
        errno = 0;
        fail(c, "too many fragments");
        return kFailed;
      }
      e[cnt] = UnpackEntry{src, uint32_t(len), r->got};
      ++cnt;
    }
    r->got += len;
    k -= len;
    c->cur_page = iov_page[i];
    c->cur_fill = iov_off[i] + uint32_t(len);
  }
  for (size_t i = taken.size(); i > used_taken; --i) c->free_pages.push_back(taken[i - 1]), --c->pages_taken;
  return kRead;
}

// Fills the head receive's pages from the socket. False on a socket or protocol error.
bool progress_recv(Comm* c) {
  while (c->head < c->queue.size()) {
    Request* r = c->queue[c->head];
    if (r->hdr_got < sizeof(MsgHeader)) {
      ssize_t s = ::recv(c->fd, reinterpret_cast<uint8_t*>(&r->hdr) + r->hdr_got, sizeof(MsgHeader) - r->hdr_got, MSG_DONTWAIT);
      if (s == 0) { c->failed = true; return false; }  // the peer closed: normal at teardown, no warning
      if (s < 0) return errno == EAGAIN || errno == EINTR ? true : fail(c, "recv");
      r->hdr_got += size_t(s);
      if (r->hdr_got < sizeof(MsgHeader)) return true;
      errno = 0;
      if (r->hdr.magic != kMsgMagic) return fail(c, "garbage on the data socket");
      if (r->hdr.tag != r->tag) return fail(c, "tag mismatch: the sender's message is not the one this receive was posted for");
      if (r->hdr.size > r->size) return fail(c, "message larger than the posted receive");
      if (g_unpack) c->meta->cnt[r->slot] = 0;
    }
    const size_t want = r->hdr.size;
    while (r->got < want) {
      if (!g_unpack) {  // ordinary plugin: straight into the posted buffer
        ssize_t s = ::recv(c->fd, r->data + r->got, want - r->got, MSG_DONTWAIT);
        if (s == 0) { c->failed = true; return false; }  // the peer closed: normal at teardown, no warning
        if (s < 0) return errno == EAGAIN || errno == EINTR ? true : fail(c, "recv");
        r->got += size_t(s);
        continue;
      }
      switch (recv_pages(c, r, want)) {
        case kRead: break;
        case kWait: return true;
        case kFailed: return false;
      }
    }
    r->done = true;
    // The next message starts on a fresh page: pages belong to one receive only.
    c->cur_page = UINT32_MAX;
    ++c->head;
  }
  c->queue.erase(c->queue.begin(), c->queue.begin() + c->head);
  c->head = 0;
  return true;
}

// ---------------------------------------------------------------- ABI entries

int tn_init(Logger log) {
  g_log = log;
  g_ndev = int(env_u64("TETHER_TESTNET_DEVICES", 2));
  if (g_ndev < 1) g_ndev = 1;
  if (g_ndev > 8) g_ndev = 8;
  if (const char* a = std::getenv("TETHER_TESTNET_ADDR"); a && *a) g_addr = a;
  g_pool_bytes = env_u64("TETHER_TESTNET_POOL_BYTES", 32u << 20) / kUnpackPage * kUnpackPage;
  if (g_pool_bytes < 2 * kUnpackMaxRecv + kUnpackMaxRecv / 2) g_pool_bytes = 2 * kUnpackMaxRecv + kUnpackMaxRecv / 2;
  if (const char* b = std::getenv("TETHER_TESTNET_BOUNCE"); b && *b) g_bounce = b;
  g_unpack = env_u64("TETHER_TESTNET_UNPACK", 1) != 0;
  for (int i = 0; i < 8; ++i) std::snprintf(g_names[i], sizeof g_names[i], "testnet%d", i);
  return kSuccess;
}

int tn_devices(int* n) {
  *n = g_ndev;
  return kSuccess;
}

int tn_properties_v8(int dev, PropertiesV8* p) {
  if (dev < 0 || dev >= g_ndev) return kInvalidArgument;
  std::memset(p, 0, sizeof *p);
  p->name = g_names[dev];
  p->pci_path = const_cast<char*>("/sys/devices/virtual/net/lo");
  p->guid = uint64_t(dev);
  p->ptr_support = kPtrHost | (g_bounce == "cuda" ? kPtrCuda : 0);
  p->reg_is_global = 0;
  p->speed = 100000;
  p->port = 0;
  p->latency = 0;
  p->max_comms = 65536;
  p->max_recvs = 1;
  p->net_device_type = g_unpack ? kDeviceUnpack : kDeviceHost;
  p->net_device_version = g_unpack ? kUnpackVersion : 0;
  return kSuccess;
}

int tn_listen(int dev, void* opaque, void** listen_comm) {
  *listen_comm = nullptr;
  if (dev < 0 || dev >= g_ndev) return kInvalidArgument;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (::inet_pton(AF_INET, g_addr.c_str(), &sa.sin_addr) != 1) return kInvalidArgument;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return kSystemError;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(fd, 128) != 0) {
    ::close(fd);
    return kSystemError;
  }
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  set_nonblock_nodelay(fd);
  Handle h{};
  h.magic = kHandleMagic;
  h.dev = dev;
  h.port = ntohs(sa.sin_port);
  std::memcpy(h.addr, &sa.sin_addr, 4);
  h.fd = -1;
  std::memset(opaque, 0, kHandleMaxSize);
  std::memcpy(opaque, &h, sizeof h);
  auto* l = new ListenComm;
  l->fd = fd;
  l->dev = dev;
  *listen_comm = l;
  return kSuccess;
}

int tn_connect(int, void* opaque, void** send_comm, DeviceHandle** send_dev_comm) {
  *send_comm = nullptr;
  if (send_dev_comm) *send_dev_comm = nullptr;
  Handle* h = static_cast<Handle*>(opaque);
  if (h->magic != kHandleMagic) return kInvalidArgument;
  if (h->stage == 0) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return kSystemError;
    set_nonblock_nodelay(fd);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(h->port);
    std::memcpy(&sa.sin_addr, h->addr, 4);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 && errno != EINPROGRESS) {
      ::close(fd);
      return kSystemError;
    }
    h->fd = fd;
    h->stage = 1;
    return kSuccess;  // not connected yet: call again
  }
  pollfd p{h->fd, POLLOUT, 0};
  if (::poll(&p, 1, 0) == 0) return kSuccess;
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(h->fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    ::close(h->fd);
    h->fd = -1, h->stage = 0;
    return kSystemError;
  }
  auto* c = new Comm;
  c->fd = h->fd;
  h->fd = -1, h->stage = 0;
  *send_comm = c;
  return kSuccess;
}

int tn_accept(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm) {
  *recv_comm = nullptr;
  auto* l = static_cast<ListenComm*>(listen_comm);
  int fd = ::accept4(l->fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? kSuccess : kSystemError;
  set_nonblock_nodelay(fd);
  auto c = std::make_unique<Comm>();
  c->fd = fd;
  c->recv = true;
  if (g_unpack) {
    std::string err;
    c->bounce = testnet::make_bounce_memory(g_bounce, g_pool_bytes, &err);
    if (!c->bounce) {
      WARN("testnet: %s", err.c_str());
      ::close(fd);
      return kSystemError;
    }
    if (!c->bounce->direct()) c->staging.resize(kMaxIov * kUnpackPage);
    c->meta = std::make_unique<UnpackMeta>();
    const uint32_t pages = uint32_t(g_pool_bytes / kUnpackPage);
    c->free_pages.resize(pages);
    for (uint32_t i = 0; i < pages; ++i) c->free_pages[i] = i;
    // Shuffle: a receive's pages are scattered over the pool, not one contiguous run.
    uint64_t x = 0x9e3779b97f4a7c15ull ^ uint64_t(fd);
    for (uint32_t i = pages - 1; i > 0; --i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::swap(c->free_pages[i], c->free_pages[x % (i + 1)]);
    }
    c->unpack = UnpackDeviceHandle{c->meta.get(), c->bounce->base(), 0};
    c->dev_handle = DeviceHandle{kDeviceUnpack, kUnpackVersion, &c->unpack, sizeof(UnpackDeviceHandle), 0};
    if (recv_dev_comm) *recv_dev_comm = &c->dev_handle;
  } else if (recv_dev_comm) {
    *recv_dev_comm = nullptr;
  }
  *recv_comm = c.release();
  return kSuccess;
}

int tn_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  *mhandle = nullptr;
  if (!comm || (type != kPtrHost && type != kPtrCuda)) return kInvalidArgument;
  if (type == kPtrCuda && g_bounce != "cuda") return kInvalidArgument;  // ptrSupport says host only
  *mhandle = new MemHandle{static_cast<uint8_t*>(data), size, type};
  return kSuccess;
}
int tn_reg_mr_v7(void* comm, void* data, int size, int type, void** mhandle) {
  if (size < 0) return kInvalidArgument;
  return tn_reg_mr(comm, data, size_t(size), type, mhandle);
}
int tn_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t, int, void** mhandle) {
  return tn_reg_mr(comm, data, size, type, mhandle);
}
int tn_dereg_mr(void*, void* mhandle) {
  delete static_cast<MemHandle*>(mhandle);
  return kSuccess;
}

// A request on `c` for [data, data + size) in *out, or why not (kSuccess is 0): the memory is outside
// `mhandle`'s registration, the comm failed, or all of its requests are in flight.
int new_request(Comm* c, void* mhandle, const void* data, size_t size, const char* op, Request** out) {
  auto* m = static_cast<MemHandle*>(mhandle);
  const auto* p = static_cast<const uint8_t*>(data);
  if (!m || p < m->data || size > m->size || size_t(p - m->data) > m->size - size) {
    WARN("testnet: %s memory outside its registration", op);
    return kInvalidArgument;
  }
  if (c->failed) return kSystemError;
  if (!(*out = alloc_request(c))) {
    WARN("testnet: unable to allocate requests (%d in flight on this comm)", kMaxRequests);
    return kInternalError;
  }
  return kSuccess;
}

int tn_isend(void* send_comm, void* data, int size, int tag, void* mhandle, void** request) {
  *request = nullptr;
  auto* c = static_cast<Comm*>(send_comm);
  if (!c || c->recv || size < 0) return kInvalidArgument;
  Request* r = nullptr;
  if (int rc = new_request(c, mhandle, data, size_t(size), "isend from", &r)) return rc;
  r->recv = false;
  r->data = static_cast<uint8_t*>(data);
  if (static_cast<MemHandle*>(mhandle)->type == kPtrCuda && size > 0) {
    std::string err;
    r->host_copy.resize(size_t(size));
    if (!testnet::copy_from_gpu(r->host_copy.data(), data, size_t(size), &err)) {
      WARN("testnet: %s", err.c_str());
      r->used = false;
      return kSystemError;
    }
    r->data = r->host_copy.data();
  }
  r->size = size_t(size);
  r->tag = tag;
  r->hdr = MsgHeader{kMsgMagic, tag, uint64_t(size)};
  c->queue.push_back(r);
  ++c->posted;
  *request = r;
  return progress_send(c) ? kSuccess : kSystemError;
}

int tn_irecv(void* recv_comm, int n, void** data, int* sizes, int* tags, void** mhandles, void** request) {
  *request = nullptr;
  auto* c = static_cast<Comm*>(recv_comm);
  if (!c || !c->recv || n != 1 || sizes[0] < 0) return kInvalidArgument;  // maxRecvs is 1
  if (g_unpack && size_t(sizes[0]) > kUnpackMaxRecv) {
    WARN("testnet: receive of %d bytes exceeds the 4 MiB unpack limit", sizes[0]);
    return kInvalidArgument;
  }
  Request* r = nullptr;
  if (int rc = new_request(c, mhandles[0], data[0], size_t(sizes[0]), "irecv into", &r)) return rc;
  r->recv = true;
  r->data = static_cast<uint8_t*>(data[0]);
  r->size = size_t(sizes[0]);
  r->tag = tags[0];
  r->slot = int(c->posted % kUnpackQueueDepth);
  c->queue.push_back(r);
  ++c->posted;
  *request = r;
  return kSuccess;
}

int tn_iflush(void*, int, void**, int*, void**, void** request) {
  *request = nullptr;  // host memory: nothing to flush
  return kSuccess;
}

int tn_test(void* request, int* done, int* sizes) {
  auto* r = static_cast<Request*>(request);
  *done = 0;
  if (!r || !r->used) return kInvalidUsage;
  Comm* c = r->comm;
  if (!r->done) {
    if (c->failed) return kRemoteError;
    if (!(c->recv ? progress_recv(c) : progress_send(c))) return kRemoteError;
  }
  if (!r->done) return kSuccess;
  *done = 1;
  if (sizes) *sizes = int(r->recv ? r->hdr.size : r->size);
  // Sends free their slot now; unpack receives hold slot and pages until irecvConsumed.
  if (!r->recv || !g_unpack) r->used = false;
  return kSuccess;
}

int tn_irecv_consumed(void* recv_comm, int n, void* request) {
  auto* c = static_cast<Comm*>(recv_comm);
  auto* r = static_cast<Request*>(request);
  if (!c || !r || r->comm != c || !r->used || !r->recv || n != 1) return kInvalidUsage;
  if (!g_unpack) return kSuccess;
  if (!r->done) {
    WARN("testnet: irecvConsumed on a receive that has not completed");
    return kInvalidUsage;
  }
  for (uint32_t p : r->pages) c->free_pages.push_back(p);  // reused first by the next receive
  r->pages.clear();
  r->used = false;
  return kSuccess;
}

int close_comm(void* comm) {
  auto* c = static_cast<Comm*>(comm);
  if (!c) return kSuccess;
  if (c->fd >= 0) ::close(c->fd);
  delete c;
  return kSuccess;
}

int tn_close_listen(void* listen_comm) {
  auto* l = static_cast<ListenComm*>(listen_comm);
  if (!l) return kSuccess;
  if (l->fd >= 0) ::close(l->fd);
  delete l;
  return kSuccess;
}

int tn_get_device_mr(void*, void*, void** dptr) {
  *dptr = nullptr;
  return kSuccess;
}

int tn_properties_v7(int dev, PropertiesV7* p) {
  PropertiesV8 q{};
  int rc = tn_properties_v8(dev, &q);
  if (rc != kSuccess) return rc;
  *p = PropertiesV7{q.name, q.pci_path, q.guid, q.ptr_support, q.speed, q.port, q.latency, q.max_comms,
                    q.max_recvs, q.net_device_type, q.net_device_version};
  return kSuccess;
}

}  // namespace

extern "C" {

#ifndef TESTNET_V7_ONLY
__attribute__((visibility("default"))) NetV8 ncclNetPlugin_v8 = {
    "testnet", tn_init, tn_devices, tn_properties_v8, tn_listen, tn_connect, tn_accept, tn_reg_mr,
    tn_reg_mr_dmabuf, tn_dereg_mr, tn_isend, tn_irecv, tn_iflush, tn_test, close_comm, close_comm,
    tn_close_listen, tn_get_device_mr, tn_irecv_consumed};
#endif

__attribute__((visibility("default"))) NetV7 ncclNetPlugin_v7 = {
    "testnet", tn_init, tn_devices, tn_properties_v7, tn_listen, tn_connect, tn_accept, tn_reg_mr_v7,
    tn_reg_mr_dmabuf, tn_dereg_mr, tn_isend, tn_irecv, tn_iflush, tn_test, close_comm, close_comm,
    tn_close_listen, tn_get_device_mr, tn_irecv_consumed};

}  // extern "C"
