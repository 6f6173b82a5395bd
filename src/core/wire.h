// Wire format. Every integer is little-endian (x86-64 and aarch64 hosts); structs are packed
// and their sizes pinned by static_asserts so both sides agree byte for byte.
//
// Per peer there is one control socket (handshake, heartbeats, notifications, send/recv
// rendezvous) and several data sockets carrying frames: a 56-byte FrameHeader, then
// `length` payload bytes for kWrite, kReadResp and kSendData.
#pragma once
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tether::wire {

constexpr uint32_t kMagic = 0x52485454;  // "TTHR"
constexpr uint16_t kVersion = 9;  // raised with every change peers must agree on (the history is in git)

// ---- handshake (every socket, control or data) ----
// A transport's bit in ClientHello::transports (0 for a name not listed).
inline uint8_t transport_bit(std::string_view name) {
  constexpr std::string_view kNames[] = {"tcp", "ipc", "fabric", "netplugin"};
  for (size_t i = 0; i < std::size(kNames); ++i)
    if (kNames[i] == name) return uint8_t(1u << i);
  return 0;
}
enum class SocketKind : uint8_t { kControl = 1, kData = 2 };
// kNotSameHost: the connector chose a same-host transport and could not prove it shares our host.
enum class HelloStatus : uint8_t { kOk = 0, kVersionMismatch = 1, kAuthFailed = 2, kBadRequest = 3, kClosing = 4,
                                   kNotSameHost = 5 };

#pragma pack(push, 1)
struct ClientHello {           // connector -> listener
  uint32_t magic;
  uint16_t version;
  uint8_t kind;                // SocketKind
  uint8_t has_token;
  uint8_t endpoint_id[16];
  uint8_t nonce[16];
  uint64_t session;            // random; names the peer link all its sockets join
  uint32_t lane;               // data socket index (0 for control)
  uint32_t lanes;              // number of data sockets that will follow the control socket
  uint32_t peer_timeout_ms;    // the connector declares us dead after this much silence
  uint8_t host_id[32];         // boot id + network namespace: equal means same host, same netns
  char name[64];
  uint64_t chunk_bytes;        // the peer uses min(ours, theirs): no frame is longer (0 = no preference)
  uint8_t transports;          // bit transport_bit(name): transports the connector may choose (0: any)
  uint32_t max_notify;         // the largest notification the connector accepts (its notify_max_bytes)
};
struct ServerHello {           // listener -> connector
  uint32_t magic;
  uint16_t version;
  uint8_t status;              // HelloStatus
  uint8_t has_token;
  uint8_t endpoint_id[16];
  uint8_t nonce[16];
  uint8_t proof[32];           // HMAC(token, "tether-server" | client nonce | server nonce)
  uint32_t peer_timeout_ms;    // the listener declares us dead after this much silence
  uint8_t host_id[32];
  char name[64];
  uint32_t offers_length;      // control sockets: this many bytes of transport offers follow
  uint64_t chunk_bytes;
  uint32_t max_notify;         // the largest notification the listener accepts
};
struct ClientProof {           // connector -> listener
  uint8_t proof[32];           // HMAC(token, "tether-client" | client nonce | server nonce | session | lane)
  char transport[16];          // control sockets: the transport the connector picked ("" for data sockets)
  uint32_t lanes;              // lanes the peer gets on it
  uint32_t offer_length;       // then the connector's offer for that transport
};
struct ServerDone {            // listener -> connector
  uint8_t status;              // HelloStatus
  uint8_t pad;
  uint16_t nic_list;           // control socket: bytes of the listener's NIC list that follow (sys::encode_nic_list)
  uint8_t pad2[4];
};

// ---- data sockets ----
enum class FrameType : uint8_t {
  kWrite = 1,      // initiator -> target, payload follows; target answers kAck
  kAck = 2,        // target -> initiator: chunk `slot` is in place (or failed: status)
  kReadReq = 3,    // initiator -> target; target answers kReadResp
  kReadResp = 4,   // target -> initiator, payload follows when status == 0
  kSendData = 5,   // sender -> receiver, into a matched recv (recv_token); answered by kAck
  kWriteBatch = 6, // many small writes in one chunk: `fragments`, length = payload bytes;
                   // `count` Fragments follow the header, then the payloads in that order; one kAck
  kReadBatch = 7,  // many small reads in one chunk (Caps::batch_reads): as kWriteBatch without payloads,
                   // length = bytes asked; one kReadResp carries the fragments' bytes in table order
  kPull = 8,       // a read the target pushes (Caps::pull_reads): [offset, +length) of the region as kSendData
                   // for `pull_token`; gen 0, no payload, no answer; refused by ControlType::kPullFail
};

// One small write inside a kWriteBatch frame; checked like a kWrite header.
struct Fragment {
  uint32_t region_id;
  uint32_t reserved;
  uint64_t key, desc_offset, desc_length;
  uint64_t offset;     // absolute offset in the target region
  uint64_t length;
};
constexpr uint32_t kMaxFragments = 128;  // per kWriteBatch (tcp: and kReadBatch) frame
// A chunk sent again after its first lane died: a target that already placed it (kSendData) or already
// pushes it (kPull) ignores it.
constexpr uint16_t kFlagResent = 1;
constexpr uint16_t kKnownFlags = kFlagResent;

struct FrameHeader {
  uint8_t type;        // FrameType
  uint8_t status;      // tether::Code of the result (answers only)
  uint16_t flags;      // kFlag* bits; unknown bits are a protocol error
  // A field some frame types use for something else has one name per use (same bytes).
  union {
    uint32_t slot;           // initiator's chunk slot; echoed in the answer
    uint32_t pull_token;     // kPull: the recv token the pushed kSendData frames go to
  };
  uint32_t gen;              // slot generation; echoed, guards against stale answers
  union {
    uint32_t region_id;      // kWrite, kReadReq, kPull: the target region
    uint32_t recv_token;     // kSendData: the matched recv
    uint32_t fragments;      // kWriteBatch, kReadBatch: Fragments after the header
  };
  union {
    uint64_t key;            // descriptor key for (region_id, desc_offset, desc_length)
    uint64_t sender_chunk;   // kSendData: the sender's chunk size (where a resent chunk lands)
  };
  uint64_t desc_offset;
  uint64_t desc_length;
  uint64_t offset;     // absolute byte offset in the target region (or in the message)
  uint64_t length;     // payload bytes
};

// ---- control socket: 8-byte header then body ----
enum class ControlType : uint8_t {
  kHeartbeat = 1,
  kNotify = 2,      // u64 id, then bytes
  kNotifyAck = 3,   // NotifyAckBody: delivered (status 0), or refused with a tether::Code
  kRts = 4,         // ready to send: u64 msg id, u64 tag, u64 length
  kCts = 5,         // clear to send: u64 msg id, u32 token, u8 status
  kCancel = 6,      // u32 token: the sender withdrew the message this CTS was for
  // 7 is unused (was kPull, now a FrameType).
  kPullFail = 8,    // PullFailBody: the range a kPull named is refused (a tether::Code)
  kPullCancel = 9,  // u32 token: the reader cancelled the pulled read; stop sending it
};
struct ControlHeader {
  uint32_t length;     // body bytes
  uint8_t type;        // ControlType
  uint8_t pad[3];
};
struct RtsBody { uint64_t msg_id, tag, length; };
struct NotifyAckBody { uint64_t id; uint8_t status; uint8_t pad[7]; };
struct CtsBody { uint64_t msg_id; uint32_t token; uint8_t status; uint8_t pad[3]; };
struct PullFailBody { uint32_t token; uint8_t status; uint8_t pad[3]; };
#pragma pack(pop)

static_assert(sizeof(ClientHello) == 4 + 2 + 1 + 1 + 16 + 16 + 8 + 4 + 4 + 4 + 32 + 64 + 8 + 1 + 4);
static_assert(sizeof(ServerHello) == 4 + 2 + 1 + 1 + 16 + 16 + 32 + 4 + 32 + 64 + 4 + 8 + 4);
static_assert(sizeof(NotifyAckBody) == 16);
static_assert(sizeof(ClientProof) == 32 + 16 + 4 + 4);
static_assert(sizeof(FrameHeader) == 56);
static_assert(sizeof(Fragment) == 48);
static_assert(sizeof(ControlHeader) == 8);
static_assert(sizeof(ServerDone) == 8);

// Transport offers in the handshake: repeated {u8 name length, name, u32 length, bytes}.
constexpr uint32_t kMaxOffers = 16 << 10;
using Offers = std::vector<std::pair<std::string, std::string>>;
inline std::string encode_offers(const Offers& offers) {
  std::string out;
  for (auto& [name, bytes] : offers) {
    const uint8_t n = uint8_t(name.size());
    const uint32_t len = uint32_t(bytes.size());
    out.append(reinterpret_cast<const char*>(&n), 1).append(name, 0, n);
    out.append(reinterpret_cast<const char*>(&len), 4).append(bytes);
  }
  return out;
}
inline bool decode_offers(std::string_view in, Offers* out) {
  while (!in.empty()) {
    const uint8_t n = uint8_t(in[0]);
    if (in.size() < 1u + n + 4u) return false;
    std::string name(in.substr(1, n));
    uint32_t len;
    std::memcpy(&len, in.data() + 1 + n, 4);
    in.remove_prefix(1 + n + 4);
    if (in.size() < len) return false;
    out->emplace_back(std::move(name), std::string(in.substr(0, len)));
    in.remove_prefix(len);
  }
  return true;
}

constexpr uint32_t kMaxNotify = 1 << 20;                // Config::notify_max_bytes is at most this
constexpr uint32_t kMaxControlBody = kMaxNotify + 8;    // a kNotify body: id + bytes; bigger is garbage

}  // namespace tether::wire
