// GPU staging of a tcp lane: payloads from or to GPU memory go through pinned bounce slots (a
// gpu::StagingRing per direction). The tx owner copies (gathers) a chunk out of the GPU into a slot and
// sends it once the copy is done; the rx owner lands a payload in a slot and copies (unpacks) it to the
// GPU, answering the frame once that copy is done.
#include <algorithm>
#include <cstring>

#include "core/trace.h"
#include "transport/tcp/tcp_lane.h"

namespace tether::transport::tcp {

namespace trace = core::trace;

// First copies first: a lane that has a chunk to send starts no copy of its next one out of a GPU while
// another lane waits for its copy out of that GPU with nothing to send, or the early lanes' second
// copies take the copy engines from the late lanes' first. Lane::note_starving and yield_copies keep it.
std::atomic<int> g_starving[kMaxGpus];

namespace {

// A lane's staging rings, made on first need. A tx slot holds a batch's fragment table too.
gpu::StagingRing& tx_ring(Lane& l, Host* host) {
  if (!l.stage.tx_ring)
    l.stage.tx_ring = std::make_unique<gpu::StagingRing>(kStageSlots, host->config().chunk_bytes + kTableBytes, wire::kMaxFragments);
  return *l.stage.tx_ring;
}
gpu::StagingRing& rx_ring(Lane& l, Host* host) {
  if (!l.stage.rx_ring) l.stage.rx_ring = std::make_unique<gpu::StagingRing>(kStageSlots, host->config().chunk_bytes, wire::kMaxFragments);
  return *l.stage.rx_ring;
}

// Publishes a staging ring's peak to the lane's counters when it grew past `*published` (the ring owner's
// copy: a compare per acquire, the atomics only when it grew).
void note_staging_peak(Lane& l, const gpu::StagingRing& ring, uint32_t* published) {
  if (ring.peak() <= *published) return;
  *published = ring.peak();
  core::count_peak(&core::LinkCounters::staging_slots_peak, l.ctr, l.nic_ctr, *published);
}

}  // namespace

// Pinning is slow: done here, the first transfers do not carry it. A side another thread holds is
// skipped and prepares lazily; a failure is met again, and reported, by the first transfer.
void prepare_staging(Lane& l, Host* host, uint64_t gpus) {
  auto each = [&](gpu::StagingRing& ring) {
    for (int d = 0; d < 64; ++d)
      if (gpus >> d & 1) (void)ring.prepare(d);
  };
  if (l.try_own_tx()) {
    each(tx_ring(l, host));
    l.disown_tx();
  }
  if (l.try_own_rx()) {
    each(rx_ring(l, host));
    l.disown_rx();
  }
}

bool stage_tx(Lane& l, Host* host, TxItem& it, Status* error) {
  gpu::StagingRing& ring = tx_ring(l, host);
  auto slot = ring.acquire(it.device, ring.span_for(it.length));  // a batch may take more than one
  if (!slot.is_ok()) { *error = slot.status(); return false; }
  if (!slot.value()) return false;
  note_staging_peak(l, ring, &l.stage.tx_peak);
  gpu::StagingSlot* st = slot.value();
  gpu::Fragment one{0, const_cast<uint8_t*>(it.payload), it.length};
  const gpu::Fragment* frags = &one;
  uint32_t n = 1;
  if (it.fragments) {  // a batch: the slot holds the fragment table (writes), then every piece gathered
    const uint64_t table = it.frags ? uint64_t(it.fragments) * sizeof(wire::Fragment) : 0;
    if (table) std::memcpy(st->host, it.frags, table);
    uint64_t at = table;
    for (uint32_t i = 0; i < it.fragments; ++i) {
      l.stage.tx_gather[i] = gpu::Fragment{at, const_cast<uint8_t*>(it.pieces[i].data), it.pieces[i].length};
      at += it.pieces[i].length;
    }
    frags = l.stage.tx_gather;
    n = it.fragments;
    it.fragments = 0;  // from here on it is one contiguous payload
  }
  if (Status s = ring.pack(st, it.device, frags, n, it.mixed ? gpu::Unpack::kD2D : host->unpack_mode()); !s.is_ok()) {
    ring.release(st);
    *error = s;
    return false;
  }
  it.stage = st;
  it.stage_ns = core::mono_ns();
  it.payload = st->host;
  it.device = -1;
  it.staged = false;
  ++l.tx.unstaged;
  if (st->device >= 0 && st->device < kMaxGpus) l.stage.device = st->device;
  l.copy_started(it.length);
  return true;
}

void complete_gpu_rx(Lane& l, Host* host) {
  LaneStaging& s = l.stage;
  while (s.gpu_rx_count > 0) {
    GpuRx& g = s.gpu_rx[s.gpu_rx_head];
    auto done = s.rx_ring->done(g.slot);
    uint8_t status = g.status;
    if (!done.is_ok()) {
      status = uint8_t(Code::kInternal);
    } else if (!done.value()) {
      return;
    }
    if (g.start_ns) {
      core::count_time(&core::LinkCounters::staging_ns, l.ctr, l.nic_ctr, core::mono_ns() - g.start_ns);
      trace::mark(trace::Event::kUnpacked, l.index, g.hdr.type, g.hdr.slot, g.hdr.gen);
    }
    g.start_ns = 0;
    const bool read = static_cast<FrameType>(g.hdr.type) == FrameType::kReadResp;
    if (!read && l.answers.full()) return;  // the ack waits for room
    s.rx_ring->release(g.slot);
    l.copy_finished();
    if (g.pin) g.pin->unpin();
    for (uint32_t i = 0; i < g.npins; ++i) s.gpu_rx_pins[s.gpu_rx_head][i]->unpin();
    if (g.recv) l.peer->send_data_placed(g.recv, g.hdr.offset, g.hdr.length);
    if (status == 0) count_landed(l, host, g.hdr.length);  // the lane's and NIC's too
    s.gpu_rx_head = (s.gpu_rx_head + 1) % kStageSlots;
    --s.gpu_rx_count;
    if (read) {
      trace::mark(trace::Event::kAnswered, l.index, g.hdr.type, g.hdr.slot, g.hdr.gen);
      if (l.peer->answer(l.index, g.hdr.slot, g.hdr.gen, status) != Code::kOk) protocol_error(l, "answered no request");
    } else {
      push_ack(l, g.hdr, status);
    }
  }
}

// Checked before a frame is resolved, so nothing is undone. A frame longer than kGpuBatchChunks chunks
// is never GPU-bound (land_in_bounce refuses it): it must not wait for a run of slots the ring never has.
bool gpu_rx_room(const Lane& l, uint64_t length) {
  const LaneStaging& s = l.stage;
  if (!s.rx_ring) return true;
  const uint32_t span = std::min(s.rx_ring->span_for(length), kGpuBatchChunks);
  return s.gpu_rx_count < kStageSlots && s.rx_ring->has_free(span);
}

bool land_in_bounce(Lane& l, Host* host, int device, uint8_t* final) {
  // A batch (or a read batch's answer, its pieces listed) may carry kGpuBatchChunks chunks.
  const auto type = static_cast<FrameType>(l.rx.hdr.type);
  const bool batch = type == FrameType::kWriteBatch || (type == FrameType::kReadResp && l.rx.nfrags > 0);
  if (l.rx.hdr.length > host->config().chunk_bytes * (batch ? kGpuBatchChunks : 1))
    return protocol_error(l, "sent a frame longer than the agreed chunk size");
  gpu::StagingRing& ring = rx_ring(l, host);
  auto slot = ring.acquire(device, ring.span_for(l.rx.hdr.length));
  if (!slot.is_ok() || !slot.value()) {
    kill_lane(l, slot.is_ok() ? Status(Code::kInternal, "staging: no free slot after checking for one") : slot.status());
    return false;
  }
  note_staging_peak(l, ring, &l.stage.rx_peak);
  l.rx.slot = slot.value();
  l.rx.device = device;
  l.rx.final = final;
  l.rx.dest = l.rx.slot->host;
  return true;
}

void unpack_to_gpu(Lane& l, Host* host) {
  LaneRx& rx = l.rx;
  LaneStaging& s = l.stage;
  const FrameHeader& h = rx.hdr;
  const uint32_t at = (s.gpu_rx_head + s.gpu_rx_count) % kStageSlots;
  GpuRx& g = s.gpu_rx[at];
  g.slot = rx.slot;
  g.hdr = h;
  g.status = rx.status;
  g.pin = rx.pin;
  g.recv = rx.recv;
  const bool answer = static_cast<FrameType>(h.type) == FrameType::kReadResp;
  g.npins = answer ? 0 : rx.nfrags;  // a read's pieces are the transfer's, not pinned here
  g.start_ns = core::mono_ns();
  rx.slot = nullptr;
  rx.pin = nullptr;
  rx.recv = nullptr;
  gpu::Unpack mode = host->unpack_mode();
  uint32_t n = 1;
  s.rx_unpack[0] = gpu::Fragment{0, rx.final, h.length};
  if (rx.nfrags > 0) {  // a batch: one descriptor per piece (one kernel launch in kernel mode)
    uint64_t off = 0;
    for (uint32_t i = 0; i < rx.nfrags; ++i) {
      s.gpu_rx_pins[at][i] = rx.frag_pin[i];
      s.rx_unpack[i] = gpu::Fragment{off, rx.frag_dest[i], rx.frag_len[i]};
      off += rx.frag_len[i];
    }
    n = rx.nfrags;
    if (rx.mixed) mode = gpu::Unpack::kD2D;  // pieces on several devices: one copy each
    rx.nfrags = 0;
  }
  if (!s.rx_ring->unpack(g.slot, rx.device, s.rx_unpack, n, mode).is_ok()) g.status = uint8_t(Code::kInternal);
  rx.device = -1;
  ++s.gpu_rx_count;
  l.copy_started(h.length);
  complete_gpu_rx(l, host);  // small copies may be done already
}

}  // namespace tether::transport::tcp
