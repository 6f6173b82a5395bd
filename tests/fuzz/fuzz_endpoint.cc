// libFuzzer target: a listening endpoint fed what a hostile peer can send it (docs/RELIABILITY.md). The first
// byte picks where the rest goes:
//   0 handshake  the first bytes of a fresh TCP connection (ClientHello, ClientProof, offers, and
//                control messages after a handshake that completes)
//   1 control    the control socket of a peer this harness connected properly (tcp, one lane)
//   2 frames     that peer's data socket (tcp frame headers, batches, payloads)
//   3 decoders   the pure parsers: transport offers, NIC lists, descriptors
//   4 listener   the reply of a hostile listener to the target's own connect() (ServerHello, offers,
//                ServerDone, NIC list): the connector's side of the handshake
//   5 ipc        messages ({u16 length, bytes} each) on the lane of an ipc peer this harness set up
//                as a same-host process does (lane to the target's socket, challenge, bounce area)
//   6 ring       that peer's message ring (in our bounce area, src/transport/ipc/ring.h), then a doorbell:
//                after a 0 byte, {u16 length, bytes} messages as well-formed records; after any other,
//                a head index (8 bytes) and raw bytes over the ring, what a hostile process can write
// Markers in the input stand for what the fuzzer cannot know: "tthr-KEY" (8 bytes) becomes the
// target region's descriptor key, "RID!" its id, "tthr-HST" followed by 24 bytes the host id, and
// (mode 4) "tthr-SES" the session of the connect being answered, (mode 5) "tthr-ADR" the address of a
// 64 KiB buffer of the harness (what an ipc initiator names for the target to copy from).
//
// Besides the sanitizers, every input must leave the target as it found it: a peer whose sockets
// closed is gone within kGoneMs, and every kCheckEvery inputs the target's descriptors are back to
// where they started and a legitimate peer's write still lands (else abort: a finding).
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/wire.h"
#include "transport/ipc/lane.h"
#include "transport/ipc/one_sided.h"
#include "transport/ipc/ring.h"
#include "sys/topology.h"
#include "tether/endpoint.h"

using namespace tether;

namespace {

constexpr uint64_t kRegionBytes = 64 << 10;
constexpr int64_t kGoneMs = 10000;      // a closed peer must be reaped by then
constexpr uint64_t kCheckEvery = 1024;  // inputs between full checks (descriptors, a legitimate write)

struct Harness {
  std::unique_ptr<Endpoint> target, legit;
  uint16_t port = 0;
  std::string host_id;                  // 32 bytes, from the target's metadata
  std::vector<uint8_t> memory, legit_src;
  Region region, legit_region;
  RemoteRegion whole;                   // a descriptor of the whole target region
  Peer legit_peer;
  int fake_listener = -1;               // mode 4: where the target connects
  uint16_t fake_port = 0;
  std::vector<uint8_t> ipc_src;         // mode 5: bytes the target may copy from (marker tthr-ADR)
  int bounce_area = -1;                     // modes 5, 6: our bounce area (a sealed memfd), our ring at its end
  uint8_t* ring = nullptr;              // mode 6: that ring, mapped here
  uint64_t cookie = 0x5eed5eed5eed5eedull;  // mode 5: what the target's cross-memory attach probe reads
  int base_fds = 0;
  uint64_t runs = 0;
  uint64_t retries = 0;                 // well-formed connects refused while the target was busy
};
Harness* h = nullptr;

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "FUZZ FINDING: %s\n", what.c_str());
  std::abort();
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n - 1;  // the directory itself
}

// A well-formed connect may meet a target still busy with what earlier inputs left (handshakes
// waiting for their data sockets hold pending slots until handshake_timeout): once the target is
// quiet it must succeed, else that is a finding.
std::pair<int, int> connect_with(bool (*attempt)(int[2], std::string*), const char* what) {
  std::string why;
  for (int tries = 0; tries < 3; ++tries) {
    int fds[2] = {-1, -1};
    if (attempt(fds, &why)) return {fds[0], fds[1]};
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
    ++h->retries;
    std::this_thread::sleep_for(std::chrono::milliseconds(h->target->config().handshake_timeout_ms + 500));
  }
  finding(std::string("the target refused a well-formed ") + what + " connect 3 times, the last one quiet: " + why);
}

// One plain connect to the listener, waited for with poll rather than blocking: libFuzzer's SIGALRM
// (its -timeout watch) cut a blocking connect short with EINTR, and a connect the kernel must retry (a
// listener whose backlog is full of the handshakes earlier inputs left) waits about 1 s.
bool try_dial(int fds[2], std::string* why) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(h->port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int err = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    pollfd p{fd, POLLOUT, 0};
    int r = 0;
    while ((r = ::poll(&p, 1, 100)) == 0 || (r < 0 && errno == EINTR))
      if (std::chrono::steady_clock::now() >= end) break;
    socklen_t len = sizeof err;
    if (r > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    else err = ETIMEDOUT;
  }
  if (err != 0) {
    *why = std::strerror(err);
    ::close(fd);
    return false;
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // callers use blocking reads with timeouts
  fds[0] = fd;
  return true;
}

int dial() { return connect_with(try_dial, "plain").first; }

// Sends what fits without blocking: the target may stop reading or close at any point.
void send_some(int fd, const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n <= 0) return;
    off += size_t(n);
  }
}

bool read_exact(int fd, void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
  }
  return true;
}

// Waits (up to ms) for the target to close its end; reads and drops what it sends meanwhile.
void drain_until_closed(int fd, int ms) {
  const int64_t until = now_ms() + ms;
  char buf[4096];
  for (int64_t left; (left = until - now_ms()) > 0;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, int(left)) <= 0) return;
    if (::recv(fd, buf, sizeof buf, MSG_DONTWAIT) <= 0) return;
  }
}

void replace(std::string& s, std::string_view marker, const void* with, size_t n) {
  for (size_t at = s.find(marker); at != std::string::npos && at + n <= s.size(); at = s.find(marker, at + n))
    std::memcpy(s.data() + at, with, n);
}

std::string substitute(const uint8_t* data, size_t size) {
  std::string s(reinterpret_cast<const char*>(data), size);
  replace(s, "tthr-KEY", &h->whole.key, 8);
  replace(s, "RID!", &h->whole.region_id, 4);
  replace(s, "tthr-HST", h->host_id.data(), 32);
  const uint64_t adr = reinterpret_cast<uint64_t>(h->ipc_src.data());
  replace(s, "tthr-ADR", &adr, 8);
  return s;
}

// Mode 4: the target connects to our fake listener, which answers its ClientHello with `reply` and
// closes every other connection (the data lanes a complete reply sends it to open) at once.
void hostile_listener(std::string reply) {
  std::atomic<bool> done{false};
  std::thread answer([&] {
    int fd = -1;
    while (!done.load()) {
      pollfd p[2] = {{h->fake_listener, POLLIN, 0}, {fd, POLLIN, 0}};
      if (::poll(p, fd >= 0 ? 2 : 1, 5) <= 0) continue;
      if (p[0].revents & POLLIN) {
        const int c = ::accept4(h->fake_listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0 && fd < 0) {
          fd = c;
          timeval tv{5, 0};
          ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
          wire::ClientHello ch{};
          if (read_exact(fd, &ch, sizeof ch)) {
            const uint64_t session = ch.session;
            replace(reply, "tthr-SES", &session, 8);
            send_some(fd, reply);
          }
          ::shutdown(fd, SHUT_WR);
        } else if (c >= 0) {
          ::close(c);
        }
      }
      char buf[4096];
      if (fd >= 0 && (p[1].revents & (POLLIN | POLLHUP)) && ::recv(fd, buf, sizeof buf, MSG_DONTWAIT) == 0) {
        ::close(fd);  // the target gave up on us
        fd = -2;
      }
    }
    if (fd >= 0) ::close(fd);
  });
  auto peer = h->target->connect("127.0.0.1:" + std::to_string(h->fake_port), 200);
  done.store(true);
  answer.join();
  if (peer.is_ok()) peer.value().close();
}

wire::ClientHello base_hello(uint8_t transports) {
  wire::ClientHello ch{};
  ch.magic = wire::kMagic;
  ch.version = wire::kVersion;
  ch.kind = uint8_t(wire::SocketKind::kControl);
  for (auto& b : ch.endpoint_id) b = uint8_t(std::rand());
  ch.session = (uint64_t(std::rand()) << 32) ^ uint64_t(std::rand());
  ch.lanes = 1;
  ch.peer_timeout_ms = 10000;
  ch.transports = transports;
  ch.max_notify = wire::kMaxNotify;
  std::memcpy(ch.name, "fuzz", 4);
  return ch;
}

std::string errno_text(const char* step) { return std::string(step) + ": " + std::strerror(errno); }

// One handshake on `fd` as Endpoint::connect does it; the listener's offers go to *offers.
bool handshake(int fd, const wire::ClientHello& ch, const std::string& proof, std::string* offers, std::string* why) {
  wire::ServerHello sh{};
  wire::ServerDone done{};
  std::string nics;
  if (::send(fd, &ch, sizeof ch, MSG_NOSIGNAL) != ssize_t(sizeof ch)) return *why = errno_text("send hello"), false;
  if (!read_exact(fd, &sh, sizeof sh)) return *why = errno_text("read server hello"), false;
  if (sh.status != 0) return *why = "server hello status " + std::to_string(sh.status), false;
  offers->resize(sh.offers_length);
  if (!read_exact(fd, offers->data(), offers->size())) return *why = errno_text("read offers"), false;
  if (proof.empty()) return true;  // the caller answers: its proof depends on the offers
  if (::send(fd, proof.data(), proof.size(), MSG_NOSIGNAL) != ssize_t(proof.size())) return *why = errno_text("send proof"), false;
  if (!read_exact(fd, &done, sizeof done)) return *why = errno_text("read server done"), false;
  if (done.status != 0) return *why = "server done status " + std::to_string(done.status), false;
  nics.resize(done.nic_list);
  if (!read_exact(fd, nics.data(), nics.size())) return *why = errno_text("read NIC list"), false;
  return true;
}

std::string proof_for(const char* transport, const std::string& offer = {}) {
  wire::ClientProof cp{};
  std::memcpy(cp.transport, transport, std::strlen(transport));
  cp.lanes = 1;
  cp.offer_length = uint32_t(offer.size());
  return std::string(reinterpret_cast<const char*>(&cp), sizeof cp) + offer;
}

// A tcp peer with one lane, the way Endpoint::connect makes one: {control fd, data fd}.
bool try_tcp_peer(int fds[2], std::string* why) {
  wire::ClientHello ch = base_hello(wire::transport_bit("tcp"));
  std::string offers;
  fds[0] = dial();
  if (!handshake(fds[0], ch, proof_for("tcp"), &offers, why)) return *why = "control: " + *why, false;
  ch.kind = uint8_t(wire::SocketKind::kData);
  fds[1] = dial();
  if (!handshake(fds[1], ch, proof_for(""), &offers, why)) return *why = "data: " + *why, false;
  return true;
}

// The ipc lane setup message (src/transport/ipc/lane.h, Hello; ipc version 8).
#pragma pack(push, 1)
struct IpcHello {
  uint32_t magic = 0x43504954;
  uint16_t version = 8;
  uint8_t stage = 1, verdict = 0;
  uint64_t session = 0;
  uint32_t lane = 0, lanes = 1;
  uint64_t cookie_addr = 0, cookie = 0, challenge = 0;
};
#pragma pack(pop)
static_assert(sizeof(IpcHello) == 48);

// An ipc peer with one lane, set up the way a same-host connector does: {control fd, lane fd}.
bool try_ipc_peer(int fds[2], std::string* why) {
  wire::ClientHello ch = base_hello(wire::transport_bit("ipc"));
  std::memcpy(ch.host_id, h->host_id.data(), 32);
  std::string offers;
  fds[0] = dial();
  if (!handshake(fds[0], ch, {}, &offers, why)) return false;
  wire::Offers parsed;
  if (!wire::decode_offers(offers, &parsed) || parsed.size() != 1 || parsed[0].first != "ipc" ||
      parsed[0].second.size() <= 18)
    return *why = "no ipc offer for a same-host connector", false;
  const std::string& offer = parsed[0].second;
  IpcHello m;
  std::memcpy(&m.challenge, offer.data() + 10, 8);
  m.session = ch.session;
  m.cookie_addr = reinterpret_cast<uint64_t>(&h->cookie);
  m.cookie = h->cookie;
  fds[1] = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string name = offer.substr(18);
  std::memcpy(a.sun_path + 1, name.data(), std::min(name.size(), sizeof a.sun_path - 2));
  const socklen_t alen = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + std::min(name.size(), sizeof a.sun_path - 2));
  if (::connect(fds[1], reinterpret_cast<sockaddr*>(&a), alen) != 0 || !transport::ipc::send_msg(fds[1], &m, sizeof m, h->bounce_area))
    return *why = errno_text("lane to the ipc socket"), false;
  // The proof, our offer (session and challenge) and the rest of the handshake.
  const std::string p = proof_for("ipc", offer.substr(0, 18));
  wire::ServerDone done{};
  std::string nics;
  if (::send(fds[0], p.data(), p.size(), MSG_NOSIGNAL) != ssize_t(p.size()) || !read_exact(fds[0], &done, sizeof done))
    return *why = errno_text("ipc proof"), false;
  if (done.status != 0) return *why = "ipc: server done status " + std::to_string(done.status), false;
  nics.resize(done.nic_list);
  if (!read_exact(fds[0], nics.data(), nics.size())) return *why = errno_text("NIC list"), false;
  IpcHello two;
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))];
  iovec iov{&two, sizeof two};
  msghdr r{};
  r.msg_iov = &iov;
  r.msg_iovlen = 1;
  r.msg_control = ctl;
  r.msg_controllen = sizeof ctl;
  const ssize_t n = ::recvmsg(fds[1], &r, MSG_CMSG_CLOEXEC);
  for (cmsghdr* c = CMSG_FIRSTHDR(&r); n > 0 && c; c = CMSG_NXTHDR(&r, c)) {
    int got;
    std::memcpy(&got, CMSG_DATA(c), sizeof got);
    ::close(got);  // its bounce area: we never describe chunks by it
  }
  if (n != ssize_t(sizeof two) || two.stage != 2) return *why = errno_text("ipc stage 2"), false;
  IpcHello three = m;
  three.stage = 3;
  three.verdict = 1;  // it may name its chunks by address
  if (!transport::ipc::send_msg(fds[1], &three, sizeof three, -1)) return *why = errno_text("ipc stage 3"), false;
  return true;
}

// Modes 5 and 6: the input as {u16 length, bytes} messages (the last one cut to what is left), each
// handed to `take` until it returns false.
template <typename Take>
void each_message(std::string_view in, Take take) {
  while (in.size() >= 2) {
    uint16_t n;
    std::memcpy(&n, in.data(), 2);
    in.remove_prefix(2);
    n = uint16_t(std::min<size_t>(n, in.size()));
    if (!take(in.substr(0, n))) return;
    in.remove_prefix(n);
  }
}

// Mode 5: each message one seqpacket message on the lane.
void send_messages(int lane, std::string_view in) {
  each_message(in, [&](std::string_view m) { return ::send(lane, m.data(), m.size(), MSG_NOSIGNAL | MSG_DONTWAIT) >= 0; });
}

// Mode 6: our ring (the target reads it from its start for every peer: it is cleared before each
// connect), filled as the input says, then a doorbell on the lane.
void fill_ring(int lane, std::string_view in) {
  if (in.empty()) return;
  const bool records = in[0] == 0;
  in.remove_prefix(1);
  if (records) {
    transport::ipc::RingWriter w(h->ring);
    bool bell;
    each_message(in, [&](std::string_view m) { return w.push(m.data(), m.size(), &bell); });
  } else if (in.size() >= 8) {
    auto* ctl = reinterpret_cast<transport::ipc::RingControl*>(h->ring);
    uint64_t head;
    std::memcpy(&head, in.data(), 8);
    in.remove_prefix(8);
    std::memcpy(h->ring + 4096, in.data(), std::min<size_t>(in.size(), transport::ipc::kRingData));
    ctl->head.store(head);
  }
  const char bell = 0;
  (void)::send(lane, &bell, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
}

// The peers this harness made are gone (the legitimate one stays).
void wait_reaped() {
  const int64_t until = now_ms() + kGoneMs;
  while (h->target->peers().size() > 1) {
    if (now_ms() > until) finding("a peer whose sockets closed was not reaped within 10 s");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  (void)h->target->notifications();  // the application reads what arrived
}

void full_check() {
  const int64_t until = now_ms() + h->target->config().handshake_timeout_ms + 2000;
  while (open_fds() > h->base_fds + 2) {  // unfinished handshakes expire after handshake_timeout
    if (now_ms() > until)
      finding("the target holds " + std::to_string(open_fds() - h->base_fds) + " more descriptors than at the start");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::fill(h->memory.begin(), h->memory.end(), 0);
  h->legit_src[0] = uint8_t(h->runs / kCheckEvery);
  Status s = h->legit_peer.write(h->legit_region, 0, h->whole, 0, kRegionBytes).wait(10000);
  if (!s.is_ok()) finding("a legitimate peer's write failed: " + s.to_string());
  if (!std::equal(h->memory.begin(), h->memory.end(), h->legit_src.begin())) finding("a legitimate write landed wrong");
}

void decoders(std::string_view in) {
  wire::Offers offers;
  (void)wire::decode_offers(in, &offers);
  (void)sys::decode_nic_list(in);
  auto r = RemoteRegion::parse(in);
  if (r.is_ok() && r.value().length > 0 && r.value().offset + r.value().length < r.value().offset)
    finding("a parsed descriptor's range wraps around");
}

void report() {
  std::fprintf(stderr, "harness: %llu inputs, %llu well-formed connects retried after the target went quiet\n",
               (unsigned long long)h->runs, (unsigned long long)h->retries);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  h = new Harness;
  Config c;
  c.name = "fuzz-target";
  c.channels = 1;
  c.handshake_timeout_ms = 300;  // forged handshakes waiting for data sockets go quickly
  c.peer_timeout_ms = 10000;
  auto t = Endpoint::create(c);
  if (!t.is_ok()) finding("target: " + t.status().to_string());
  h->target = t.take();
  const std::string address = h->target->address();
  h->port = uint16_t(std::stoi(address.substr(address.rfind(':') + 1)));
  h->host_id = h->target->metadata().substr(24, 32);
  h->memory.assign(kRegionBytes, 0);
  h->region = h->target->register_memory(h->memory.data(), kRegionBytes).take();
  h->whole = RemoteRegion::parse(h->region.descriptor().value()).take();
  Config l;
  l.name = "legit";
  l.channels = 1;
  l.transport = "tcp";
  h->legit = Endpoint::create(l).take();
  h->legit_src.resize(kRegionBytes);
  for (size_t i = 0; i < kRegionBytes; ++i) h->legit_src[i] = uint8_t(i * 7 + 1);
  h->legit_region = h->legit->register_memory(h->legit_src.data(), kRegionBytes).take();
  auto p = h->legit->connect(h->target->metadata(), 5000);
  if (!p.is_ok()) finding("legit connect: " + p.status().to_string());
  h->legit_peer = p.take();
  h->ipc_src.resize(kRegionBytes);
  for (size_t i = 0; i < kRegionBytes; ++i) h->ipc_src[i] = uint8_t(i * 13 + 5);
  h->bounce_area = ::memfd_create("fuzz-bounce-area", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  // A bounce area: slots, the one-sided pages, then one lane's ring.
  constexpr uint64_t kSlots = 256 << 10, kBytes = kSlots + transport::ipc::kOneSidedBytes + transport::ipc::kRingBytes;
  if (h->bounce_area < 0 || ::ftruncate(h->bounce_area, kBytes) != 0 ||
      ::fcntl(h->bounce_area, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
    finding("memfd");
  void* seg = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, h->bounce_area, 0);
  if (seg == MAP_FAILED) finding("mmap of the bounce area");
  h->ring = static_cast<uint8_t*>(seg) + kSlots + transport::ipc::kOneSidedBytes;
  h->fake_listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof a;
  if (::bind(h->fake_listener, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(h->fake_listener, 16) != 0 ||
      ::getsockname(h->fake_listener, reinterpret_cast<sockaddr*>(&a), &alen) != 0)
    finding("fake listener");
  h->fake_port = ntohs(a.sin_port);
  h->base_fds = open_fds();
  std::atexit(report);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0] % 7;
  const std::string in = substitute(data + 1, size - 1);
  if (mode == 3) {
    decoders(in);
  } else if (mode == 4) {
    hostile_listener(in);
    wait_reaped();
  } else if (mode == 5 || mode == 6) {
    std::memset(h->ring, 0, 4096);  // indexes from 0: a fresh peer's reader starts there
    auto [control, lane] = connect_with(try_ipc_peer, "ipc");
    if (mode == 5) send_messages(lane, in);
    else fill_ring(lane, in);
    drain_until_closed(lane, 2);
    ::close(lane);
    ::close(control);
    wait_reaped();
  } else if (mode == 0) {
    const int fd = dial();
    send_some(fd, in);
    ::shutdown(fd, SHUT_WR);
    drain_until_closed(fd, 5);  // a handshake waiting for data sockets stays open: not waited for
    ::close(fd);
  } else {
    auto [control, lane] = connect_with(try_tcp_peer, "tcp");
    send_some(mode == 1 ? control : lane, in);
    drain_until_closed(mode == 1 ? control : lane, 2);  // answers, or the target closing on garbage
    ::close(lane);
    ::close(control);
    wait_reaped();
  }
  if (++h->runs % kCheckEvery == 0) full_check();
  return 0;
}
