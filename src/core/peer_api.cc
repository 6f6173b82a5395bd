// The public Peer and Transfer handles: thin calls into PeerState and TransferState.
#include "core/endpoint_impl.h"
#include "core/peer.h"

namespace tether {

Transfer Peer::write(const Region& local, uint64_t local_offset, const RemoteRegion& remote, uint64_t remote_offset,
                     uint64_t length, std::string notify) {
  const Block b{local_offset, remote_offset, length};
  return writev(local, remote, &b, 1, std::move(notify));
}
Transfer Peer::read(const Region& local, uint64_t local_offset, const RemoteRegion& remote, uint64_t remote_offset,
                    uint64_t length) {
  const Block b{local_offset, remote_offset, length};
  return readv(local, remote, &b, 1);
}

namespace {
// An IoEntry list as runs of blocks: consecutive entries with the same local region and an equal
// descriptor form one run, so the core keeps one copy of each descriptor rather than one per entry.
struct EntryRuns {
  std::vector<Block> blocks;
  std::vector<BlockRun> runs;
  explicit EntryRuns(const std::vector<IoEntry>& entries) {
    blocks.reserve(entries.size());  // runs point into it
    for (size_t i = 0; i < entries.size(); ++i) {
      const IoEntry& e = entries[i];
      blocks.push_back(Block{e.local_offset, e.remote_offset, e.length});
      if (i == 0 || e.local.state() != entries[i - 1].local.state() || !(e.remote == entries[i - 1].remote))
        runs.push_back(BlockRun{&e.local, &e.remote, &blocks.back(), 0});
      ++runs.back().n;
    }
  }
};
}  // namespace

Transfer Peer::writev(std::vector<IoEntry> entries, std::string notify) {
  const EntryRuns r(entries);
  return state_->post_rma(core::OpKind::kWrite, r.runs.data(), r.runs.size(), "entry", std::move(notify));
}
Transfer Peer::readv(std::vector<IoEntry> entries) {
  const EntryRuns r(entries);
  return state_->post_rma(core::OpKind::kRead, r.runs.data(), r.runs.size(), "entry", {});
}
Transfer Peer::writev(const Region& local, const RemoteRegion& remote, const Block* blocks, size_t n, std::string notify) {
  const BlockRun run{&local, &remote, blocks, n};
  return state_->post_rma(core::OpKind::kWrite, &run, 1, "block", std::move(notify));
}
Transfer Peer::readv(const Region& local, const RemoteRegion& remote, const Block* blocks, size_t n, std::string notify) {
  const BlockRun run{&local, &remote, blocks, n};
  return state_->post_rma(core::OpKind::kRead, &run, 1, "block", std::move(notify));
}
Transfer Peer::writev(const BlockRun* runs, size_t nruns, std::string notify) {
  return state_->post_rma(core::OpKind::kWrite, runs, nruns, "block", std::move(notify));
}
Transfer Peer::readv(const BlockRun* runs, size_t nruns, std::string notify) {
  return state_->post_rma(core::OpKind::kRead, runs, nruns, "block", std::move(notify));
}
Transfer Peer::send(const Region& local, uint64_t offset, uint64_t length, uint64_t tag) {
  return state_->post_send(local, offset, length, tag);
}
Transfer Peer::recv(const Region& local, uint64_t offset, uint64_t length, uint64_t tag) {
  return state_->post_recv(local, offset, length, tag);
}
Transfer Peer::notify(std::string data) { return state_->post_notify(std::move(data)); }
uint64_t Peer::id() const { return state_->info().id; }
std::string Peer::name() const { return state_->info().name; }
std::string Peer::transport() const { return state_->info().transport; }
EndpointId Peer::endpoint_id() const { return state_->info().endpoint; }
bool Peer::connected() const { return !state_->failed(); }
Status Peer::error() const { return state_->error(); }
void Peer::close() {
  gpu::KeepContext keep;  // the last hold let go here tears the transport's state down (CUDA streams)
  state_->fail(Status(Code::kCancelled, "peer '" + state_->info().name + "' was closed locally"));
  // Bounded: the control thread lets go within a wake-up, lanes once they answered what they held.
  (void)state_->wait_released(2000);
}

// Transfer
bool Transfer::done() const { return state_->is_finished(); }
Status Transfer::wait(int64_t timeout_ms) const {
  return state_->wait(timeout_ms);
}
bool Transfer::poll() const {
  if (state_->is_finished()) return true;
  core::PeerState* p = state_->peer.get();
  if (!p) return false;
  p->finish_here();  // one-sided GPU copies: the caller finishes them itself (Transport::finish_here)
  const uint32_t lane = state_->lane_hint.load(std::memory_order_relaxed);
  // A small transfer's answer is read here; where progress threads spin, only for a lone transfer (a
  // caller polling beside busy threads slows them). Large transfers: their lanes' threads are awake.
  const uint64_t bytes = state_->bytes.load(std::memory_order_relaxed);
  if (lane != UINT32_MAX && bytes <= (256u << 10) &&
      (p->busy_poll_us() == 0 || (!p->has_work() && p->unanswered_bytes() <= bytes)))
    p->progress_lane(lane);
  return state_->is_finished();
}
Status Transfer::status() const { return state_->is_finished() ? state_->final_status() : Status::ok(); }
void Transfer::cancel() const {
  if (state_->peer) state_->peer->cancel(state_.get());
}
uint64_t Transfer::bytes() const { return state_->bytes.load(std::memory_order_acquire); }

}  // namespace tether
