// Batch frames on a tcp lane: a kWriteBatch or kReadBatch carries a table of up to kMaxFragments small
// writes or reads after its header. Every fragment is checked and pinned before any byte lands or is
// sent; one refused fragment refuses the whole batch.
#include <cstring>

#include "core/region.h"
#include "transport/tcp/tcp_lane.h"

namespace tether::transport::tcp {

namespace {

// A batch's fragments, checked and pinned (pin_batch).
struct BatchPlaces {
  Code code = Code::kOk;
  int32_t gpu = -1;    // the first GPU among the places (-1: all in host memory)
  bool mixed = false;  // they span host memory and GPUs, or several GPUs
  bool adds_up = true; // false: the fragments' bytes are not the header's length (a protocol error)
};

// Checks every fragment of a batch's table (region, key, bounds, for `write` access; a fragment is never
// empty) and pins its region: place i is at[i], len[i] bytes, in pins[i]. On a refusal, or a table whose
// bytes are not `length`, nothing stays pinned.
BatchPlaces pin_batch(Host* host, const uint8_t* table, uint32_t n, uint64_t length, bool write,
                      RegionState** pins, uint8_t** at, uint64_t* len) {
  BatchPlaces b;
  uint64_t sum = 0;
  int32_t first = -2;  // device of the first place (-1 host)
  for (uint32_t i = 0; i < n; ++i) {
    wire::Fragment f;
    std::memcpy(&f, table + size_t(i) * sizeof f, sizeof f);
    RegionState* pin = nullptr;
    b.code = f.reserved != 0 || f.length == 0
                 ? Code::kInvalidArgument
                 : host->registry().resolve(f.region_id, f.key, f.desc_offset, f.desc_length, f.offset, f.length, write, &pin);
    if (b.code != Code::kOk) {
      for (uint32_t k = 0; k < i; ++k) pins[k]->unpin();
      host->traffic().rejected_requests.fetch_add(1, std::memory_order_relaxed);
      return b;
    }
    pins[i] = pin;
    at[i] = pin->base + f.offset;
    len[i] = f.length;
    sum += f.length;
    const int32_t d = pin->kind == MemoryKind::kCuda ? pin->device : -1;
    b.mixed |= first != -2 && d != first;
    if (first == -2) first = d;
    if (b.gpu < 0) b.gpu = d;
  }
  if (sum != length) {
    for (uint32_t i = 0; i < n; ++i) pins[i]->unpin();
    b.adds_up = false;
  }
  return b;
}

// A free ReadAnswer of the lane's, or null when kReadAnswers are all waiting to be sent. Caller owns rx.
ReadAnswer* take_read_answer(Lane& l) {
  auto& all = l.rx.read_answers;
  for (auto& a : all)
    if (!a->busy.load(std::memory_order_acquire)) {
      a->busy.store(true, std::memory_order_relaxed);
      return a.get();
    }
  if (all.size() >= kReadAnswers) return nullptr;
  all.push_back(std::make_unique<ReadAnswer>());
  all.back()->busy.store(true, std::memory_order_relaxed);
  return all.back().get();
}

}  // namespace

// A refused batch's payload is discarded, then answered with the refusal.
bool on_batch(Lane& l, Host* host) {
  LaneRx& rx = l.rx;
  const FrameHeader& h = rx.hdr;
  const uint32_t n = h.fragments;
  const uint8_t* table = rx.buf.get() + rx.begin + sizeof(FrameHeader);
  const BatchPlaces b = pin_batch(host, table, n, h.length, true, rx.frag_pin, rx.frag_dest, rx.frag_len);
  if (!b.adds_up) return protocol_error(l, "sent a batch whose table does not add up");
  rx.pin = nullptr;
  rx.recv = nullptr;
  rx.left = h.length;
  if (b.code != Code::kOk) {
    rx.status = static_cast<uint8_t>(b.code);
    rx.dest = nullptr;
    rx.nfrags = 0;
    rx.state = RxState::kDiscard;
    return true;
  }
  rx.status = 0;
  rx.nfrags = n;
  rx.frag = 0;
  rx.mixed = b.mixed;
  rx.state = RxState::kPayload;
  if (b.gpu >= 0)  // some piece goes to a GPU: the whole payload lands in a bounce slot first
    return land_in_bounce(l, host, b.gpu, nullptr);
  rx.dest = rx.frag_dest[0];
  rx.left = rx.frag_len[0];
  return true;
}

// One kReadResp carries the fragments' bytes back in table order (gathered from GPU memory into a
// staging slot by the tx owner). A refused batch's answer carries only its status.
bool on_read_batch(Lane& l, Host* host) {
  const FrameHeader& h = l.rx.hdr;
  if (h.length > host->config().chunk_bytes * kGpuBatchChunks)
    return protocol_error(l, "sent a read batch longer than the agreed chunk size");
  ReadAnswer* a = take_read_answer(l);
  if (!a) {
    l.rx.paused.store(true, std::memory_order_relaxed);  // resumes once answers have gone out
    return false;
  }
  const uint32_t n = h.fragments;
  const uint8_t* table = l.rx.buf.get() + l.rx.begin + sizeof(FrameHeader);
  uint8_t* at[wire::kMaxFragments];
  uint64_t len[wire::kMaxFragments];
  const BatchPlaces b = pin_batch(host, table, n, h.length, false, a->pins, at, len);
  if (!b.adds_up) {
    a->release();  // pin_batch let its pins go
    return protocol_error(l, "sent a read batch whose table does not add up");
  }
  TxItem it{};
  it.hdr.type = static_cast<uint8_t>(FrameType::kReadResp);
  it.hdr.status = static_cast<uint8_t>(b.code);
  it.hdr.slot = h.slot;
  it.hdr.gen = h.gen;
  if (b.code != Code::kOk) {
    a->release();
  } else {
    a->n = n;
    for (uint32_t i = 0; i < n; ++i) a->pieces[i] = Piece{at[i], len[i], a->pins[i]};
    it.hdr.length = h.length;
    it.length = h.length;
    it.fragments = n;
    it.pieces = a->pieces;
    it.batch = a;
    it.device = b.gpu;  // GPU memory among them: the tx owner gathers them into a staging slot
    it.mixed = b.mixed;
  }
  l.answers.push(it);
  return true;
}

}  // namespace tether::transport::tcp
