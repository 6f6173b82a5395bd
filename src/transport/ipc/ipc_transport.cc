// The ipc transport object: what it can do, the regions it exports (and revokes on deregister), the
// wake-ups of its peers, stopping, and its counters. Connecting is setup.cc; the lanes are lane.cc.
#include "transport/ipc/ipc_transport.h"

#include <algorithm>

#include "sys/proc.h"
#include "transport/ipc/lane.h"

namespace tether::transport {

using namespace ipc;

Caps IpcTransport::caps() const {
  Caps c;
  c.same_host_only = true;
  c.attach_before_answer = true;  // the connector's lanes are here before it answers: attach needs nothing more
  c.batch_fragments = kMaxBatch;
  c.batch_reads = true;
  c.gpu_chunk_bytes = host_->config().ipc_gpu_chunk_bytes;
  c.lanes_hold = true;  // attach() takes a hold per lane; retiring the lane lets go
  return c;
}

uint32_t IpcTransport::lanes_for(std::string_view) const { return std::max<uint32_t>(1, host_->config().channels); }

// GPU regions are exported once, here: every chunk from or to them names this handle.
Status IpcTransport::register_region(RegionState& region, std::string*) { return export_region(region); }

// No grant for the region holds any more, and one-sided copies into it end first (one_sided.h); then
// peers that opened the region's allocation close their mapping (else it would hold the memory until
// they disconnect: the driver keeps an allocation alive while another process has it open).
void IpcTransport::deregister_region(RegionState& region) {
  std::vector<std::pair<std::shared_ptr<IpcPeer>, std::shared_ptr<Link>>> peers;
  {
    std::lock_guard lock(mu_);
    for (auto& l : lanes_) {
      if (l->index != 0) continue;
      std::lock_guard ll(l->mu);
      // Past setup, and held: its lane sockets stay open while we send on them below.
      if (l->ip && l->ip->ready.load(std::memory_order_acquire) && l->peer->hold()) peers.emplace_back(l->ip, l->peer);
    }
  }
  struct LetGo {
    decltype(peers)& all;
    ~LetGo() { for (auto& [ip, peer] : all) peer->let_go(); }
  } let_go{peers};
  for (auto& [ip, peer] : peers) {
    if (!ip->os_own) continue;
    // A copy that may still land is waited for as long as its process lives (one_sided.h); past
    // deregister_timeout_ms the peer is dropped meanwhile, so its transfers end.
    struct Slow {
      Link* peer;
      uint32_t region;
    } slow{peer.get(), region.id};
    (void)revoke(*ip->os_own, *ip->os_theirs, region.id, ip->pid, host_->config().deregister_timeout_ms,
                 [](void* arg) {
                   auto* s = static_cast<Slow*>(arg);
                   s->peer->fail(Status(Code::kConnectionLost,
                                        "peer '" + s->peer->info().name + "' held a one-sided copy into region " +
                                            std::to_string(s->region) + " while it was deregistered (stopped?)"));
                 },
                 &slow);
  }
  Frame f{};
  if (!region_ref(region, &f.cuda)) return;
  f.hdr.type = kRelease;
  // Never blocks: a peer that stopped reading keeps its mapping until it is dropped (peer timeout).
  for (auto& [ip, peer] : peers) (void)::send(ip->fds[0], &f, sizeof f, MSG_NOSIGNAL | MSG_DONTWAIT);
}

namespace {
// The process is stopped (SIGSTOP, a debugger): it cannot answer until someone continues it. False
// where we cannot tell (another pid namespace).
bool process_stopped(pid_t pid) {
  const char state = sys::process_state(pid);
  return state == 'T' || state == 't';
}
}  // namespace

// deregister() is waiting for `region`: readers over ipc copy it themselves and hold it until their
// kReadDone. One that cannot answer is disconnected, which shuts its lanes: our lane threads unpin
// what it held, and its own copy, should its process run again, ends in a failed send of kReadDone,
// so that read fails rather than completing with bytes the application wrote after deregister().
void IpcTransport::region_stalled(RegionState& region, bool force) {
  std::vector<std::shared_ptr<Link>> cut;
  {
    std::lock_guard lock(mu_);
    for (auto& l : lanes_) {
      std::shared_ptr<Link> peer;
      pid_t pid = 0;
      {
        std::lock_guard ll(l->mu);
        if (!l->peer || !l->ip) continue;
        peer = l->peer;
        pid = l->ip->pid;
      }
      bool holds = false;
      {
        std::lock_guard hl(l->held_mu);
        for (auto& h : l->held) holds = holds || h.pin == &region;
      }
      if (holds && !peer->failed() && std::find(cut.begin(), cut.end(), peer) == cut.end() &&
          (force || process_stopped(pid)))
        cut.push_back(peer);
    }
  }
  for (auto& p : cut)
    p->fail(Status(Code::kConnectionLost, "peer '" + p->info().name + "' held region " + std::to_string(region.id) +
                                              " while it was deregistered and did not let go (" +
                                              (force ? "deregister_timeout_ms" : "its process is stopped") + ")"));
}

void IpcTransport::reap_finished() {
  for (size_t i = 0; i < lanes_.size();) {
    if (lanes_[i]->finished.load(std::memory_order_acquire)) {
      lanes_[i]->thread.join();
      lanes_[i] = std::move(lanes_.back());
      lanes_.pop_back();
    } else {
      ++i;
    }
  }
}

void IpcTransport::finish_here(Link*) {
  if (completer_) completer_->finish_here();
}

void IpcTransport::wake(Link* peer, uint64_t, int) {
  auto* ip = static_cast<IpcPeer*>(peer->transport_state.get());
  if (!ip || !ip->sending.load(std::memory_order_seq_cst)) return;  // setup pumps when it finishes
  pump_all(*ip, *peer, /*one_round=*/true);
}

void IpcTransport::detach(Link& peer) { peer.transport_state.reset(); }

void IpcTransport::stop() {
  std::vector<std::shared_ptr<Lane>> all;
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    all.swap(lanes_);
  }
  for (auto& l : all) {
    std::shared_ptr<Link> p;
    {
      std::lock_guard lock(l->mu);
      p = l->peer;
    }
    if (p) p->fail(Status(Code::kCancelled, "endpoint closed"));  // shuts the lanes down: recv() returns
  }
  for (auto& l : all)
    if (l->thread.joinable()) l->thread.join();
  if (completer_) completer_->stop();  // one-sided copies still running finish and are answered
}

void IpcTransport::counters(std::vector<std::pair<std::string, uint64_t>>& out) const {
  const Counters& k = counters_;
  for (auto [name, value] : {std::pair{"ipc_cma_chunks", &k.cma_chunks}, {"ipc_shm_chunks", &k.shm_chunks},
                             {"ipc_inline_chunks", &k.inline_chunks}, {"ipc_one_sided_chunks", &k.one_sided_chunks},
                             {"ipc_cuda_chunks", &k.cuda_chunks}, {"ipc_cuda_opens", &k.cuda_opens}})
    out.emplace_back(name, value->load(std::memory_order_relaxed));
}

}  // namespace tether::transport
