// The socket engine of a tcp lane: the tx state machine (answers and pulled chunks into one sendmsg,
// paced by what the socket holds) and the rx state machine (headers through the lane's buffer, payload
// straight to its destination, every frame answered).
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "core/trace.h"
#include "transport/frame_target.h"
#include "transport/tcp/tcp_lane.h"

namespace tether::transport::tcp {

namespace trace = core::trace;

void kill_lane(Lane& l, Status why) {
  if (l.dead.exchange(true)) return;
  l.peer->lane_failed(l.index, std::move(why));
}

bool protocol_error(Lane& l, const char* what) {
  kill_lane(l, Status(Code::kProtocolError, "peer '" + l.peer->info().name + "' " + what));
  return false;
}

void count_landed(Lane& l, Host* host, uint64_t length) {
  auto& traffic = host->traffic();
  traffic.bytes_received.fetch_add(length, std::memory_order_relaxed);
  traffic.chunks_received.fetch_add(1, std::memory_order_relaxed);
  core::count_received(l.ctr, l.nic_ctr, length);
}

void push_ack(Lane& l, const FrameHeader& h, uint8_t status) {
  TxItem ack{};
  ack.hdr.type = static_cast<uint8_t>(FrameType::kAck);
  ack.hdr.status = status;
  ack.hdr.slot = h.slot;
  ack.hdr.gen = h.gen;
  l.answers.push(ack);
}

// ---------------------------------------------------------------- send

namespace {

// Bytes in the socket's send queue (unsent or unacknowledged).
inline uint64_t kernel_queued(int fd) {
  int q = 0;
  return ::ioctl(fd, SIOCOUTQ, &q) == 0 && q > 0 ? uint64_t(q) : 0;
}

// Moves the answers rx produced into the tx ring, those from GPU memory staged first. False: a copy failed.
bool queue_answers(Lane& l, Host* host, Status* error) {
  const auto& ring = l.stage.tx_ring;  // made by the first stage_tx
  TxItem a;
  while (l.tx.count < kTxRing && l.answers.peek(&a)) {
    if (a.device >= 0 && ring && !ring->has_free(ring->span_for(a.length))) break;  // the answer waits
    if (a.device >= 0 && l.tx.unstaged > 0) break;  // one copy out of the GPU at a time, as for chunks
    trace::mark(trace::Event::kTaken, l.index, a.hdr.type, a.hdr.slot, a.hdr.gen);  // before staging
    if (a.device >= 0 && !stage_tx(l, host, a, error)) {
      if (!error->is_ok()) return false;
      break;  // no free slot: the answer waits in the ring
    }
    TxItem taken;
    l.answers.pop(&taken);  // `a` is the (possibly staged) copy we queue
    l.queue(a);
  }
  return true;
}

// Takes chunks from the peer only when what this socket holds has (almost) drained: faster sockets take
// more. What the kernel still queues counts too, or a slow link would swallow a socket buffer's worth of
// chunks and set the pace at the end of every transfer. False: a copy failed.
bool take_chunks(Lane& l, Host* host, Status* error) {
  ChunkOp op;
  // The kernel holds at most the lane's unanswered chunks, so ask it only when those are many.
  const uint64_t limit = kLaneQueueChunks * l.peer->info().chunk_bytes;
  const uint64_t queued = l.peer->has_work() && l.peer->lane_bytes(l.index) >= limit ? kernel_queued(l.fd) : 0;
  // A lane stages one chunk at a time: all lanes' copies share the GPU's copy engines, so each lane's
  // first chunk is on the wire sooner when second chunks wait; later ones are copied while the one
  // before is sent.
  const bool yield_copies = l.yield_copies();  // first copies first
  while (!yield_copies && l.tx.unsent + queued < limit && l.tx.count < kTxRing / 2 && l.tx.unstaged == 0 &&
         (!l.stage.tx_ring || l.stage.tx_ring->has_free(kGpuBatchChunks)) && l.peer->next_chunk(l.index, &op)) {
    TxItem it{op.hdr, op.payload, op.length, op.pin};  // a pushed send's chunk: unpinned once sent
    it.device = op.payload || op.fragments ? op.device : -1;
    if (static_cast<FrameType>(op.hdr.type) == FrameType::kReadBatch) {  // a request: header and table
      it.payload = reinterpret_cast<const uint8_t*>(op.frags);
      it.length = uint64_t(op.fragments) * sizeof(wire::Fragment);
      it.device = -1;
    } else if (op.fragments) {
      it.fragments = op.fragments;
      it.frags = op.frags;
      it.pieces = op.pieces;
      it.length = uint64_t(op.fragments) * sizeof(wire::Fragment) + op.length;
    }
    trace::mark(trace::Event::kTaken, l.index, it.hdr.type, it.hdr.slot, it.hdr.gen);  // before staging
    if (it.device >= 0 && !stage_tx(l, host, it, error)) {
      if (error->is_ok()) *error = Status(Code::kInternal, "staging: no free slot after checking for one");
      return false;
    }
    l.queue(it);
  }
  return true;
}

// Points iov at every unsent part of the queued items (header, then the payload or a batch's table and
// pieces), up to the first whose copy out of the GPU is still running. *staged_now: a copy was seen
// finished. False: a copy failed.
bool gather_unsent(Lane& l, iovec* iov, size_t* niov, bool* staged_now, Status* error) {
  uint64_t skip = l.tx.head_sent;
  auto add = [&](const void* p, uint64_t n) {
    if (skip >= n) {
      skip -= n;
      return;
    }
    iov[(*niov)++] = {static_cast<uint8_t*>(const_cast<void*>(p)) + skip, n - skip};
    skip = 0;
  };
  for (size_t i = 0; i < l.tx.count; ++i) {
    TxItem& it = l.tx.ring[(l.tx.head + i) % kTxRing];
    if (*niov + 2 + it.fragments + 1 > kMaxIov) break;
    if (it.stage && !it.staged) {  // its copy out of the GPU must finish before its bytes go
      auto done = l.stage.tx_ring->done(it.stage);
      if (!done.is_ok()) { *error = done.status(); return false; }
      if (!done.value()) break;
      it.staged = true;
      --l.tx.unstaged;
      *staged_now = true;
      trace::mark(trace::Event::kStaged, l.index, it.hdr.type, it.hdr.slot, it.hdr.gen);
      core::count_time(&core::LinkCounters::staging_ns, l.ctr, l.nic_ctr, core::mono_ns() - it.stage_ns);
    }
    add(&it.hdr, sizeof(FrameHeader));
    if (it.fragments) {
      if (it.frags) add(it.frags, uint64_t(it.fragments) * sizeof(wire::Fragment));
      for (uint32_t k = 0; k < it.fragments; ++k) add(it.pieces[k].data, it.pieces[k].length);
    } else if (it.length > 0) {
      add(it.payload, it.length);
    }
  }
  return true;
}

// `sent` more bytes left the socket: the items they complete are counted and let go of.
void complete_sent(Lane& l, Host* host, uint64_t sent) {
  auto& traffic = host->traffic();
  while (sent > 0) {
    TxItem& it = l.tx.ring[l.tx.head];
    const uint64_t total = sizeof(FrameHeader) + it.length;
    const uint64_t take = std::min(sent, total - l.tx.head_sent);
    l.tx.head_sent += take;
    sent -= take;
    if (l.tx.head_sent < total) continue;
    trace::mark(trace::Event::kSent, l.index, it.hdr.type, it.hdr.slot, it.hdr.gen);
    if (it.length > 0 && static_cast<FrameType>(it.hdr.type) != FrameType::kReadBatch) {  // data, not a request's table
      traffic.bytes_sent.fetch_add(it.hdr.length, std::memory_order_relaxed);
      traffic.chunks_sent.fetch_add(1, std::memory_order_relaxed);
      core::count_sent(l.ctr, l.nic_ctr, it.length);
    }
    if (it.pin) it.pin->unpin();
    if (it.batch) it.batch->release();
    if (it.stage) {
      l.stage.tx_ring->release(it.stage);
      l.copy_finished();
    }
    l.tx.head = (l.tx.head + 1) % kTxRing;
    --l.tx.count;
    l.tx.head_sent = 0;
  }
}

// Cuts the iovecs after `cap` bytes; returns how many are left.
size_t cap_iov(iovec* iov, size_t n, uint64_t cap) {
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    if (total >= cap) return i;
    if (total + iov[i].iov_len > cap) {
      iov[i].iov_len = cap - total;
      return i + 1;
    }
    total += iov[i].iov_len;
  }
  return n;
}

}  // namespace

bool drive_tx(Lane& l, Host* host, Status* error) {
  uint64_t budget = kTxBudget;
  bool copy_wait = false;
  for (;;) {
    if (!queue_answers(l, host, error) || !take_chunks(l, host, error)) return false;
    if (l.tx.count == 0 || budget == 0) break;

    iovec iov[kMaxIov];
    size_t niov = 0;
    bool staged_now = false;  // an item's copy out of the GPU was seen finished on this pass
    if (!gather_unsent(l, iov, &niov, &staged_now, error)) return false;
    l.note_starving();  // now, not after a send of 100s of µs: lanes yielding to this one stop sooner
    if (niov == 0) {  // the head waits for its GPU copy; the progress thread polls it
      copy_wait = true;
      break;
    }
    // A copy just finished: start the next one before this sendmsg, so that copy and send overlap.
    if (staged_now) continue;
    // While this lane may not start its next copy (first copies first), a whole chunk in one sendmsg
    // would hold it there long after the other lanes' first copies are done: a piece at a time, it
    // comes back to take_chunks and starts that copy while the rest of this chunk goes.
    if (l.yield_copies()) niov = cap_iov(iov, niov, kYieldingSendBytes);
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = niov;
    const uint64_t t0 = core::mono_ns();
    ssize_t n = ::sendmsg(l.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    core::count_time(&core::LinkCounters::send_ns, l.ctr, l.nic_ctr, core::mono_ns() - t0);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) break;
      *error = Status(Code::kConnectionLost, "data connection to peer '" + l.peer->info().name + "': " + std::strerror(errno));
      return false;
    }
    const uint64_t sent = uint64_t(n);
    l.io_bytes.fetch_add(sent, std::memory_order_relaxed);
    budget -= std::min(budget, sent);
    l.tx.unsent -= sent;
    complete_sent(l, host, sent);
  }
  l.note_starving();
  // A head waiting for its copy out of the GPU needs no EPOLLOUT when the thread naps between polls of
  // that copy: a writable socket would end every nap at once (level-triggered).
  l.tx.backlog.store(l.tx.count > 0 && !copy_wait, std::memory_order_relaxed);
  return true;
}

// ---------------------------------------------------------------- receive

namespace {

// recv() of up to `want` bytes into `dst`: how many came (counted in io_bytes), or 0 when nothing more
// comes now (EAGAIN) or the lane was killed (peer closed, socket error).
size_t read_socket(Lane& l, void* dst, size_t want) {
  const uint64_t t0 = core::mono_ns();
  ssize_t r = ::recv(l.fd, dst, want, MSG_DONTWAIT);
  core::count_time(&core::LinkCounters::recv_ns, l.ctr, l.nic_ctr, core::mono_ns() - t0);
  if (r == 0) {
    kill_lane(l, Status(Code::kConnectionLost, "peer '" + l.peer->info().name + "' closed a data connection"));
    return 0;
  }
  if (r < 0) {
    if (errno != EAGAIN && errno != EINTR)
      kill_lane(l, Status(Code::kConnectionLost, "data connection to peer '" + l.peer->info().name + "': " + std::strerror(errno)));
    return 0;
  }
  l.io_bytes.fetch_add(uint64_t(r), std::memory_order_relaxed);
  return size_t(r);
}

// kWrite, kSendData: checked (region, key, bounds; or the matched recv), then the payload lands in place
// or in a bounce slot; a refused one is discarded, then answered with the error.
bool on_write(Lane& l, Host* host) {
  LaneRx& rx = l.rx;
  const FrameHeader& h = rx.hdr;
  const TargetPlan p = plan_target(*host, *l.peer, h);
  rx.status = static_cast<uint8_t>(p.code);
  rx.pin = p.pin;
  rx.recv = p.recv;
  rx.dest = p.dest;  // null: discard the payload, then answer with the error
  rx.left = h.length;
  rx.state = p.code == Code::kOk ? RxState::kPayload : RxState::kDiscard;
  if (p.code == Code::kOk && p.device >= 0 && h.length > 0 && !land_in_bounce(l, host, p.device, p.dest)) return false;
  if (rx.left == 0) payload_done(l, host);
  return true;
}

// kReadReq: answered by a kReadResp the tx owner sends (staging it first from GPU memory).
bool on_read_request(Lane& l, Host* host) {
  const FrameHeader& h = l.rx.hdr;
  const TargetPlan p = plan_target(*host, *l.peer, h);
  TxItem it{};
  it.hdr = read_response(h, p);
  if (p.code == Code::kOk) {
    RegionState* pin = p.pin;
    if (pin->kind == MemoryKind::kCuda && h.length > host->config().chunk_bytes) {
      pin->unpin();
      return protocol_error(l, "sent a read request longer than the agreed chunk size");
    }
    it.payload = pin->base + h.offset;
    it.length = h.length;
    it.pin = pin;
    it.device = pin->kind == MemoryKind::kCuda ? pin->device : -1;  // the tx owner stages it
  }
  l.answers.push(it);
  return true;
}

// kReadResp: an answer to one of our reads; its payload lands where the read asked (a kReadBatch's in
// its pieces, in order).
bool on_read_response(Lane& l, Host* host) {
  LaneRx& rx = l.rx;
  const FrameHeader& h = rx.hdr;
  if (h.status != 0) {
    if (l.peer->answer(l.index, h.slot, h.gen, h.status) != Code::kOk) return protocol_error(l, "sent an answer to no request");
    return true;
  }
  uint8_t* dest = nullptr;
  int device = -1;
  const Piece* pieces = nullptr;
  uint32_t npieces = 0;
  if (l.peer->read_destination(l.index, h.slot, h.gen, h.length, &dest, &device, &pieces, &npieces) != Code::kOk)
    return protocol_error(l, "sent read data for no read");
  rx.dest = dest;
  rx.left = h.length;
  rx.status = 0;
  rx.state = RxState::kPayload;
  if (npieces > 0) {  // a kReadBatch's answer: its pieces in order (they are never empty: see Link)
    for (uint32_t i = 0; i < npieces; ++i) {
      rx.frag_dest[i] = pieces[i].data;
      rx.frag_len[i] = pieces[i].length;
      rx.frag_pin[i] = nullptr;  // the transfer holds its own regions
    }
    rx.nfrags = npieces;
    rx.frag = 0;
    rx.mixed = false;  // a read batch's pieces share one device (Link::pack_batch)
    if (device >= 0) return land_in_bounce(l, host, device, nullptr);  // all of it, then one unpack
    rx.dest = rx.frag_dest[0];
    rx.left = rx.frag_len[0];
    return true;
  }
  if (device >= 0 && h.length > 0 && !land_in_bounce(l, host, device, dest)) return false;
  if (rx.left == 0) payload_done(l, host);
  return true;
}

// The header (and a batch's table) is in the rx buffer. Returns false if it was not consumed (paused
// for backpressure, or lane killed).
bool on_header(Lane& l, Host* host) {
  const FrameHeader& h = l.rx.hdr;
  if (h.flags & ~wire::kKnownFlags) return protocol_error(l, "sent a malformed frame");
  trace::mark(trace::Event::kHeader, l.index, h.type, h.slot, h.gen);
  const auto type = static_cast<FrameType>(h.type);
  const bool needs_answer = type == FrameType::kWrite || type == FrameType::kSendData || type == FrameType::kReadReq ||
                            type == FrameType::kReadBatch;
  if (needs_answer && l.answers.full()) {
    l.rx.paused.store(true, std::memory_order_relaxed);  // resumes once answers have drained
    return false;
  }
  const bool has_payload = type == FrameType::kWrite || type == FrameType::kSendData || type == FrameType::kWriteBatch ||
                           (type == FrameType::kReadResp && h.status == 0);
  if (has_payload && !gpu_rx_room(l, h.length)) {
    l.rx.paused.store(true, std::memory_order_relaxed);  // resumes once a GPU copy has finished
    return false;
  }
  if ((type == FrameType::kWrite || type == FrameType::kReadReq) && h.length <= kTinyRequest)
    l.small_requests.fetch_add(1, std::memory_order_relaxed);
  switch (type) {
    case FrameType::kWrite:
    case FrameType::kSendData: return on_write(l, host);
    case FrameType::kWriteBatch: return on_batch(l, host);
    case FrameType::kReadReq: return on_read_request(l, host);
    case FrameType::kAck:
      trace::mark(trace::Event::kAnswered, l.index, h.type, h.slot, h.gen);
      if (l.peer->answer(l.index, h.slot, h.gen, h.status) != Code::kOk) return protocol_error(l, "sent an answer to no request");
      return true;
    case FrameType::kReadResp: return on_read_response(l, host);
    case FrameType::kReadBatch: return on_read_batch(l, host);
    case FrameType::kPull:
      if (!l.peer->on_pull(h)) return protocol_error(l, "sent a malformed kPull");
      return true;
  }
  return protocol_error(l, "sent a frame of unknown type");
}

}  // namespace

void receive(Lane& l, Host* host, uint64_t budget) {
  LaneRx& rx = l.rx;
  if (l.stage.gpu_rx_count > 0) complete_gpu_rx(l, host);
  while (!l.dead.load(std::memory_order_relaxed) && !rx.paused.load(std::memory_order_relaxed) && budget > 0) {
    const size_t buffered = rx.end - rx.begin;
    if (rx.state != RxState::kHeader) {
      size_t n;
      if (buffered > 0) {
        n = size_t(std::min<uint64_t>(buffered, rx.left));
        if (rx.dest) std::memcpy(rx.dest, rx.buf.get() + rx.begin, n);
        rx.begin += n;
      } else {
        // Payload goes straight to its destination; discarded bytes through the buffer.
        void* dst = rx.dest ? static_cast<void*>(rx.dest) : static_cast<void*>(rx.buf.get());
        size_t want = size_t(std::min<uint64_t>(rx.left, rx.dest ? rx.left : kRxBuffer));
        n = read_socket(l, dst, want);
        if (n == 0) return;
        rx.begin = rx.end = 0;
      }
      if (rx.dest) rx.dest += n;
      rx.left -= n;
      budget -= std::min<uint64_t>(budget, n);
      if (rx.left == 0) {
        if (rx.nfrags > 0 && !rx.slot && rx.state == RxState::kPayload && ++rx.frag < rx.nfrags) {
          rx.dest = rx.frag_dest[rx.frag];  // next piece of a batch, straight to its place
          rx.left = rx.frag_len[rx.frag];
        } else {
          payload_done(l, host);
        }
      }
      continue;
    }
    if (buffered >= sizeof(FrameHeader)) {
      std::memcpy(&rx.hdr, rx.buf.get() + rx.begin, sizeof(FrameHeader));
      size_t need = sizeof(FrameHeader);
      const auto type = static_cast<FrameType>(rx.hdr.type);
      if (type == FrameType::kWriteBatch || type == FrameType::kReadBatch) {
        if (rx.hdr.fragments < 2 || rx.hdr.fragments > wire::kMaxFragments) {
          protocol_error(l, "sent a malformed batch");
          return;
        }
        need += size_t(rx.hdr.fragments) * sizeof(wire::Fragment);  // the table is read with the header
      }
      if (buffered >= need) {
        if (!on_header(l, host)) return;  // paused (no room to answer) or dead
        rx.begin += need;
        budget -= std::min<uint64_t>(budget, need);
        continue;
      }
    }
    if (rx.begin > 0) {
      std::memmove(rx.buf.get(), rx.buf.get() + rx.begin, buffered);
      rx.begin = 0;
      rx.end = buffered;
    }
    const size_t n = read_socket(l, rx.buf.get() + rx.end, kRxBuffer - rx.end);
    if (n == 0) return;
    rx.end += n;
  }
}

void payload_done(Lane& l, Host* host) {
  LaneRx& rx = l.rx;
  const FrameHeader& h = rx.hdr;
  trace::mark(trace::Event::kLanded, l.index, h.type, h.slot, h.gen);
  rx.state = RxState::kHeader;
  rx.dest = nullptr;
  if (rx.slot) return unpack_to_gpu(l, host);  // in a bounce slot: answered once copied to the GPU
  if (static_cast<FrameType>(h.type) == FrameType::kReadResp) {
    rx.nfrags = 0;
    trace::mark(trace::Event::kAnswered, l.index, h.type, h.slot, h.gen);
    count_landed(l, host, h.length);
    if (l.peer->answer(l.index, h.slot, h.gen, 0) != Code::kOk) protocol_error(l, "answered no request");
    return;
  }
  if (rx.pin) { rx.pin->unpin(); rx.pin = nullptr; }
  for (uint32_t i = 0; i < rx.nfrags; ++i) rx.frag_pin[i]->unpin();
  rx.nfrags = 0;
  if (rx.recv) {
    l.peer->send_data_placed(rx.recv, h.offset, h.length);
    rx.recv = nullptr;
  }
  if (rx.status == 0) count_landed(l, host, h.length);
  push_ack(l, h, rx.status);
}

}  // namespace tether::transport::tcp
