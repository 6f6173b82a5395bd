// The transport interface. A transport moves chunks over its lanes (channels) and nothing else:
// it takes chunks from Link::next_chunk() when a lane has room, validates incoming requests
// through the endpoint's RegionRegistry (or lets the hardware do it, for one-sided RMA), places
// payload, and reports answers back to Link. Chunking, windows, scheduling across lanes,
// notifications and completion accounting live once in the core (src/core/peer.*).
//
// Connecting: the TCP control socket always exists. During its handshake the listener sends the
// offer() of each usable transport, the connector picks one (Config::transport, else the highest
// priority() both sides offer) and sends back its own offer for it; then both sides attach().
// Adding a transport is one folder and one line in src/transport/registry.cc.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tether/status.h"

namespace tether::core {
struct RegionState;
}  // namespace tether::core

namespace tether::transport {

class Link;

struct Caps {
  bool same_host_only = false;  // only offered to peers on this host (ipc)
  bool uses_tcp_lanes = false;  // its lanes are the TCP data sockets opened during connect
  // The listener attaches and publishes the peer before answering (attach() needs nothing from the
  // connector), so when connect() returns, the listener's peers() shows it.
  bool attach_before_answer = false;
  uint32_t batch_fragments = 0; // most small writes in one kWriteBatch chunk (one answer); 0: no batches
  bool batch_reads = false;     // small reads are batched too, as kReadBatch chunks
  uint32_t gpu_batch_chunks = 1;  // chunks' bytes a kWriteBatch or kReadBatch from or to GPU memory may carry
  uint64_t gpu_chunk_bytes = 0; // chunk size when both ends of a write/read are GPU memory (0: the peer's chunk_bytes)
  uint32_t read_depth = 0;      // reads one lane keeps requested at once, in chunk_bytes (0: its whole window)
  bool staged_gpu = false;      // GPU memory is staged through pinned host buffers on each side: a GPU
                                // read is cut into smaller chunks that pipeline the copies
  bool pull_reads = false;      // large contiguous reads are pushed by the target (wire::kPull), moved as sends
  bool wait_naps = false;       // wait() on a large read naps, on another large transfer sleeps, instead of
                                // spinning: the transport's own threads land its chunks
  bool lanes_hold = false;      // each lane's thread holds its peer (Link::hold) until it retires the lane,
                                // so the peer's chunk slots outlive every lane reading them
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual Caps caps() const = 0;
  // Auto selection picks the highest priority both sides offer (tcp = 0).
  virtual int priority() const { return 0; }
  // Empty when usable; otherwise why not (shown by `tether doctor`; never offered to peers).
  virtual std::string unavailable_reason() const { return {}; }

  // Bytes telling the peer connecting in `session` how to reach us (fabric addresses, plugin
  // listen handles...). Called on the control thread during each handshake.
  virtual std::string offer(uint64_t session) { (void)session; return {}; }
  // The connector's offer, answering the listener's `remote_offer` before the connector answers the
  // handshake: it may prepare what the listener's attach() must find (ipc opens its lanes here).
  virtual Result<std::string> connector_offer(uint64_t session, std::string_view remote_offer) {
    (void)remote_offer;
    return offer(session);
  }
  // The connect that called connector_offer(session) failed before attach(): let go of what it prepared.
  virtual void abandon(uint64_t session) { (void)session; }
  // Called by the control thread every tick (at most 200 ms apart): reclaim what handshakes left behind.
  virtual void tick(int64_t now_ms) { (void)now_ms; }
  // Lanes a peer gets on this transport, given the other side's offer.
  virtual uint32_t lanes_for(std::string_view remote_offer) const = 0;

  // Per-region registration (memory registration, IPC export). `desc_ext` bytes travel inside
  // every descriptor of the region; the initiator finds them with RemoteRegion::ext(name()).
  virtual Status register_region(core::RegionState& region, std::string* desc_ext) {
    (void)region; (void)desc_ext; return Status::ok();
  }
  // After every access in flight has let go of the region.
  virtual void deregister_region(core::RegionState& region) { (void)region; }
  // Called every few milliseconds while deregister() waits for `region`'s pins: disconnect the peers
  // that hold it and cannot answer (a stopped process), or with `force` (Config::deregister_timeout_ms
  // passed) every peer still holding it. Only transports that let a peer hold a region do anything.
  virtual void region_stalled(core::RegionState& region, bool force) { (void)region; (void)force; }

  // Takes the peer over: `tcp_fds` are its connected data sockets (uses_tcp_lanes only),
  // `remote_offer` the other side's offer(); `initiator` is true on the connecting side; setup
  // waiting on the other side gives up at `deadline_ms` (sys::now_ms(): the connect's own timeout on
  // the connecting side) with kTimeout. Called before anyone can post on the peer. An error fails the connect.
  virtual Status attach(const std::shared_ptr<Link>& peer, const std::vector<int>& tcp_fds,
                        std::string_view remote_offer, bool initiator, int64_t deadline_ms) = 0;
  // `chunks` new chunks are queued on `peer`; up to that many lanes with room should take them.
  // `device`: the GPU their local bytes are on (-1: host memory, or not known), so a transport with
  // several NICs can wake the lanes on the NICs nearest that memory first (fabric: rail ranking).
  virtual void wake(Link* peer, uint64_t chunks, int device) = 0;
  // Called by a thread spinning on a small transfer: progress lane `lane` of `peer` from the calling
  // thread if no other thread is doing so (saves waking a progress thread for the answer).
  virtual void progress_lane(Link* peer, uint32_t lane) { (void)peer; (void)lane; }
  // Called by a thread waiting for a transfer of `peer`: finish here what would otherwise finish on
  // another thread and be handed back, so a lone op stays on one core. Never blocks; cheap when idle.
  virtual void finish_here(Link* peer) { (void)peer; }
  // The peer's last hold went (Link::hold: its lanes retired, the control side and every caller
  // let go): drop what the transport keeps for it (peer.transport_state), which no thread uses now.
  virtual void detach(Link& peer) { (void)peer; }
  // Stops every progress thread; lanes answer what they had in flight with kCancelled.
  virtual void stop() = 0;
  // Appends what the transport counts, as (name, value): names start with the transport's name
  // ("ipc_cma_chunks"); the core only forwards them (EndpointStats::transport_counters).
  virtual void counters(std::vector<std::pair<std::string, uint64_t>>& out) const { (void)out; }
};

}  // namespace tether::transport
