// The ipc transport's insides, shared by its files (ipc_transport.h says what the transport does):
// the messages on a lane, what each side keeps per peer (IpcPeer) and per lane (Lane), and the steps
// one file calls in another.
//   setup.cc          connecting: offers, the rendezvous socket, lane introductions (Hello), attach
//   lane.cc           a lane's thread (next message, what it is, who takes it) and message I/O
//   initiator.cc      our chunks: described and sent, or moved one-sided; pumped over the lanes
//   answers.cc        the target's answers to our chunks: reads copied out, grants kept
//   target.cc         the peer's requests: validated, pinned, moved, counted, answered
//   ipc_transport.cc  the transport object: caps, regions (export, revoke), wake, stop, counters
#pragma once
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/region.h"
#include "core/wire.h"
#include "transport/host.h"
#include "transport/ipc/cuda_mover.h"
#include "transport/ipc/host_mover.h"
#include "transport/ipc/ipc_transport.h"
#include "transport/ipc/one_sided.h"
#include "transport/ipc/ring.h"
#include "transport/link.h"

namespace tether::transport::ipc {

using core::RegionState;
using wire::FrameHeader;
using wire::FrameType;

constexpr uint32_t kHelloMagic = 0x43504954;  // "TIPC"
constexpr uint16_t kIpcVersion = 8;  // raised whenever a message below changes (both sides must match)

#pragma pack(push, 1)
// Every message on a lane after its setup: the tcp frame header, and for requests where the
// initiator's bytes are. The target trusts addr only as a place in the INITIATOR's memory.
struct Frame {
  FrameHeader hdr;
  uint8_t where;    // Where (requests); kNone in answers, but those granting one-sided access
  uint8_t grant;    // kWantGrant (requests), kGranted | kGrantReadOnly (answers): one_sided.h
  uint8_t pad[6];
  uint64_t addr;    // kCma: address in the initiator; kShm: offset in its bounce area; kCuda: offset in `cuda`
                    // (a kWriteBatch of GPU pieces: the number of CudaRefs at the end of the message)
  CudaRef cuda;     // kCuda: the allocation; in a kReadResp, the TARGET's (the initiator copies, then kReadDone)
};
// A kWriteBatch message: the Frame, `hdr.fragments` entries, then (kCuda) `addr` CudaRefs.
struct BatchEntry {
  wire::Fragment frag;  // checked like a kWrite header
  uint64_t addr;        // where the piece is (as Frame::addr for the frame's `where`)
  uint32_t ref;         // kCuda: index of its allocation among the CudaRefs
  uint32_t pad;
};
// Lane setup. Stage 1: connector -> listener on every lane, sent before the connector answers the
// TCP handshake (bounce area fd on lane 0). Stage 2: listener -> connector on lane 0 (its bounce area fd, its
// verdict). Stage 3: connector -> listener on lane 0 (its verdict).
struct Hello {
  uint32_t magic;
  uint16_t version;
  uint8_t stage;
  uint8_t verdict;       // stages 2, 3: the receiver may describe its chunks by address (kCma)
  uint64_t session;
  uint32_t lane, lanes;
  uint64_t cookie_addr;  // 8 bytes at this address in the sender hold `cookie`: the CMA probe
  uint64_t cookie;
  uint64_t challenge;    // stage 1: the challenge from the listener's offer for this session
};
#pragma pack(pop)
static_assert(sizeof(Frame) == 160);
static_assert(sizeof(BatchEntry) == 64);
static_assert(sizeof(Hello) == 48);
constexpr size_t kMaxMsg = sizeof(Frame) + kMaxBatch * (sizeof(BatchEntry) + sizeof(CudaRef));  // ~152 KiB
// ipc's own frame type: initiator -> target, "the read of (slot, gen) is copied out, let go of the region".
constexpr uint8_t kReadDone = 0x40;
// ... and either way: "the GPU memory in `cuda` was deregistered here, close your mapping of it".
constexpr uint8_t kRelease = 0x41;
// target -> initiator: the answer to a kReadBatch. Frame (status; fragments = n, addr = CudaRefs), then
// on success n BatchEntry (the fragment as asked, `addr` and `ref` where it lies, `pad` its Where:
// kCuda, kCma = an address in the target, kShm = an offset in the initiator's bounce area), then the CudaRefs.
constexpr uint8_t kReadBatchAnswer = 0x42;

struct IpcPeer {
  uint64_t session = 0;
  pid_t pid = 0;                     // the other process, as the kernel names it (SO_PEERCRED)
  std::vector<int> fds;              // lane sockets (owned by Link::lane_fds)
  std::vector<std::weak_ptr<Lane>> lanes;
  uint64_t cookie = 0;               // the other side probes this
  BounceArea own;                    // our chunks' bounce slots (used when !out_cma)
  BounceArea theirs;                 // the other side's, mapped (their kShm chunks)
  std::unique_ptr<CmaMover> cma;     // set when our probe of the other side worked
  std::unique_ptr<ShmMover> shm;
  // Our chunks are described by address. Set by the listener's lane 0 from the connector's verdict
  // while its other lanes already serve (grant_for reads it): atomic; senders read it after `sending`.
  std::atomic<bool> out_cma{false};
  uint64_t slot_bytes = 0;           // one chunk per core slot in `own`
  std::atomic<bool> ready{false};    // lanes may serve the other side's requests
  std::atomic<bool> sending{false};  // setup done: lanes may take and send ours
  int64_t setup_deadline_ms = 0;     // listener: the connector's stage 3 must come by then
  std::unique_ptr<CudaImports> imports;  // the other side's GPU allocations we opened (kept until the peer goes)
  std::vector<std::unique_ptr<RingWriter>> out;  // per lane: our messages, in `own`
  std::vector<std::unique_ptr<RingReader>> in;   // per lane: theirs, in `theirs`
  Host* host = nullptr;
  Counters* counters = nullptr;                  // the transport's
  uint64_t one_sided_max = 0;                    // Config::ipc_one_sided_bytes (0: off)
  OneSidedPage* os_own = nullptr;                // our liveness table and hazards, in `own`
  OneSidedPage* os_theirs = nullptr;             // theirs, in `theirs`
  std::unique_ptr<OneSidedInitiator> os;         // the grants we hold for their regions (one_sided_max > 0)
  GpuCompleter* completer = nullptr;             // the transport's (null: busy polling off)
};

struct Lane {
  std::mutex mu;                     // guards letting go of peer/ip against stop()
  std::shared_ptr<Link> peer;        // held while the thread runs
  std::shared_ptr<IpcPeer> ip;
  uint32_t index = 0;
  int fd = -1;
  RingReader* ring = nullptr;        // the other side's messages on this lane (IpcPeer::in)
  InlineMover inline_bytes;          // lane thread: the request being served, when its bytes came in it
  bool setup_first = false;          // listener's lane 0: finish the setup before serving
  int host_mode = 0;                 // Config::ipc_host, as IpcTransport keeps it
  std::thread thread;
  std::atomic<bool> finished{false};
  // Lane thread only:
  std::unique_ptr<uint8_t[]> rx;     // one message (kMaxMsg)
  std::unique_ptr<CudaLane> cuda;    // streams, bounce buffer
  struct Held { uint32_t slot, gen; RegionState* pin; };
  std::mutex held_mu;                // held: the lane thread changes it; deregister looks for a region in it
  std::vector<Held> held;            // regions pinned for reads the initiator is copying out (until kReadDone)
  uint32_t held_reads = 0;           // reads in `held` (a batch holds several pins): at most 2 x slot_count
  RegionState* pins[kMaxBatch];      // a batch's pinned regions (one per run of one descriptor)
  RegionState* dests[kMaxBatch];     // each fragment's region
  std::shared_ptr<Mapping> maps[kMaxBatch];
  uint64_t triples[3 * kMaxBatch];
  iovec local_iov[kMaxBatch], remote_iov[kMaxBatch];  // a read batch's host pieces read by attach
};

// ---- lane.cc: messages
// One message, with an fd attached when pass_fd >= 0.
bool send_msg(int fd, const void* buf, size_t len, int pass_fd);
// One message (blocking, or bounded by deadline_ms when >= 0); *got_fd receives a passed fd.
ssize_t recv_msg(int fd, void* buf, size_t len, int* got_fd, int64_t deadline_ms, int flags = 0);
// One message on lane `lane`; false (the peer failed with why): the lane is gone.
bool send_or_fail(IpcPeer& ip, Link& p, uint32_t lane, const void* msg, size_t len);
// The calling thread's buffer for one message of up to kMaxMsg bytes (batches, inline writes).
uint8_t* message_buffer();
void fail_peer(Link& p, Code c, const std::string& why);
bool protocol_error(Link& p, const std::string& why);  // fails the peer; false
// Whether a batch message of `n` entries and `nrefs` CudaRefs is `bytes` long, within the limits.
bool batch_fits(uint32_t n, uint64_t nrefs, size_t bytes);
// Whether two fragments name one descriptor (a run of a batch: one registry lookup, one grant).
inline bool same_descriptor(const wire::Fragment& a, const wire::Fragment& b) {
  return a.region_id == b.region_id && a.key == b.key && a.desc_offset == b.desc_offset && a.desc_length == b.desc_length;
}
BatchEntry batch_entry(const uint8_t* msg, uint32_t i);         // entry i, after the Frame
CudaRef batch_ref(const uint8_t* msg, uint32_t n, uint64_t k);  // CudaRef k, after n entries
// Where `r` is among a batch message's `*nrefs` CudaRefs, added if new (VMM spans may share a base).
uint32_t ref_slot(CudaRef* refs, uint32_t* nrefs, const CudaRef& r);
// Where GPU bytes [ptr, ptr+len) of `region` lie for the other process: false if it cannot open them
// (the export failed at registration) or they leave the allocation. within(): the same, in `ref`.
bool gpu_place(const RegionState* region, const uint8_t* ptr, uint64_t len, CudaRef* ref, uint64_t* offset);
bool within(const CudaRef& ref, const uint8_t* ptr, uint64_t len, uint64_t* offset);
// A chunk whose bytes moved, counted in the endpoint's traffic.
void count_moved(Host& host, bool received, uint64_t length);
// `n` (src, dst, len) triples on `device` by one copy-kernel launch (`one_kernel`) or a copy each;
// counted as one CUDA chunk. kInternal when CUDA fails.
Code copy_triples(Lane& l, int device, uint32_t n, bool one_kernel);
// The lane's thread (setup.cc starts it).
void lane_main(Lane* l);

// ---- initiator.cc
void pump_lane(IpcPeer& ip, Link& p, uint32_t lane);
void pump_all(IpcPeer& ip, Link& p, bool one_round = false);

// ---- answers.cc: false when the lane must end
bool take_answer(Lane& l, const Frame& f);
bool take_read_batch(Lane& l, const uint8_t* msg, size_t bytes);

// ---- target.cc: false when the lane must end
bool serve(Lane& l, const Frame& f);
bool serve_batch(Lane& l, const uint8_t* msg, size_t bytes);
bool serve_read_batch(Lane& l, const uint8_t* msg, size_t bytes);
bool read_done(Lane& l, const FrameHeader& h);
// Moving a request's bytes failed with `err`: EPROTO (it names memory this side cannot reach) or the
// other process is gone. Fails the peer; false.
bool lane_error(Link& p, int err);

// ---- setup.cc
// Listener's lane 0, before it serves: the connector's verdict (stage 3); false: the lane must end.
bool finish_listener_setup(Lane& l);

}  // namespace tether::transport::ipc
