// Wire format. Every integer is little-endian (x86-64 and aarch64 hosts); structs are packed
// and their sizes pinned by static_asserts so both sides agree byte for byte.
//
// Per peer there is one control socket (handshake, heartbeats, notifications, send/recv
// rendezvous) and several data sockets carrying frames: a 64-byte FrameHeader, then
// `length` payload bytes for kWrite, kReadResp and kSendData.
#pragma once
#include <cstdint>

namespace tether::wire {

constexpr uint32_t kMagic = 0x52485454;  // "TTHR"
constexpr uint16_t kVersion = 1;

// ---- handshake (every socket, control or data) ----
enum class SocketKind : uint8_t { kControl = 1, kData = 2 };
enum class HelloStatus : uint8_t { kOk = 0, kVersionMismatch = 1, kAuthFailed = 2, kBadRequest = 3, kClosing = 4 };

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
};
struct ClientProof {           // connector -> listener
  uint8_t proof[32];           // HMAC(token, "tether-client" | client nonce | server nonce | session | lane)
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
  kSendData = 5,   // sender -> receiver, into a matched recv (region_id = recv token); answered by kAck
};

// A chunk sent again on another lane after its first lane died. The target treats a resent kSendData
// for a message it already completed as done (its first copy was placed; only the answer was lost).
constexpr uint16_t kFlagResent = 1;
constexpr uint16_t kKnownFlags = kFlagResent;

struct FrameHeader {
  uint8_t type;        // FrameType
  uint8_t status;      // tether::Code of the result (answers only)
  uint16_t flags;      // kFlag* bits; unknown bits are a protocol error
  uint32_t slot;       // initiator's chunk slot; echoed in the answer
  uint32_t gen;        // slot generation; echoed, guards against stale answers
  uint32_t region_id;  // target region id, or recv token for kSendData
  uint64_t key;        // descriptor key for (region_id, desc_offset, desc_length); kSendData: the sender's chunk size
  uint64_t desc_offset;
  uint64_t desc_length;
  uint64_t offset;     // absolute byte offset in the target region (or in the message)
  uint64_t length;     // payload bytes
};

// ---- control socket: 8-byte header then body ----
enum class ControlType : uint8_t {
  kHeartbeat = 1,
  kNotify = 2,      // u64 id, then bytes
  kNotifyAck = 3,   // u64 id
  kRts = 4,         // ready to send: u64 msg id, u64 tag, u64 length
  kCts = 5,         // clear to send: u64 msg id, u32 token, u8 status
  kCancel = 6,      // u32 token: the sender withdrew the message this CTS was for
};
struct ControlHeader {
  uint32_t length;     // body bytes
  uint8_t type;        // ControlType
  uint8_t pad[3];
};
struct RtsBody { uint64_t msg_id, tag, length; };
struct CtsBody { uint64_t msg_id; uint32_t token; uint8_t status; uint8_t pad[3]; };
#pragma pack(pop)

static_assert(sizeof(ClientHello) == 4 + 2 + 1 + 1 + 16 + 16 + 8 + 4 + 4 + 4 + 32 + 64);
static_assert(sizeof(ServerHello) == 4 + 2 + 1 + 1 + 16 + 16 + 32 + 4 + 32 + 64);
static_assert(sizeof(FrameHeader) == 56);
static_assert(sizeof(ControlHeader) == 8);
static_assert(sizeof(ServerDone) == 8);

constexpr uint32_t kMaxControlBody = 1 << 20;   // notifications are bounded; bigger is garbage
constexpr uint32_t kMaxNotify = kMaxControlBody - 8;

}  // namespace tether::wire
