// What both sides of a connection's handshake share (docs/ARCHITECTURE.md, "Wire format and handshake"): the
// endpoint metadata a connector is given, the proofs of the auth token, and the listener's state for
// one socket whose handshake is under way. The connector's side is connect.cc, the listener's listener.cc.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/endpoint_impl.h"
#include "core/wire.h"
#include "sys/crypto.h"
#include "tether/endpoint.h"

namespace tether::core {

constexpr uint32_t kMaxLanes = 256;  // channels, and a hello's lanes

// Endpoint::metadata(): this header, then the listen host, the hostname and the control address.
constexpr uint32_t kMetadataMagic = 0x4d525454;  // "TTRM"
#pragma pack(push, 1)
struct MetadataHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t port;
  uint8_t endpoint[16];
  uint8_t host_id[32];
  uint16_t host_len;      // listen host, then hostname, then control address, follow
  uint16_t hostname_len;
  uint16_t control_len;   // a wildcard listener's control NIC address ("" if none): where to connect
};
#pragma pack(pop)

struct ParsedMetadata {
  MetadataInfo info;
  uint8_t host_id[32];
  std::string control;  // a wildcard listener's control address
};
bool looks_like_metadata(std::string_view b);
Status parse_metadata_bytes(std::string_view b, ParsedMetadata* out);

bool wildcard(const std::string& host);  // a listen address that serves every interface
void copy_name(char (&dst)[64], const std::string& src);
std::string read_name(const char (&src)[64]);

// HMAC of the auth token over who speaks ("tether-client" / "tether-server"), both nonces and, from the
// connector, the session and lane its socket belongs to.
crypto::Digest proof(const std::string& token, const char* who, const uint8_t* cn, const uint8_t* sn,
                     uint64_t session = 0, uint32_t lane = 0);

// What the other side's hello says of it, under a new peer id; the caller fills in the transport.
template <class Hello>
PeerInfo EndpointImpl::describe_peer(const Hello& h) {
  PeerInfo info;
  info.id = next_peer_id_.fetch_add(1);
  std::memcpy(info.endpoint.data(), h.endpoint_id, 16);
  info.name = read_name(h.name);
  info.same_host = std::memcmp(h.host_id, host_id_.data(), 32) == 0;
  info.heartbeat_ms = heartbeat_for(h.peer_timeout_ms);
  info.chunk_bytes = chunk_for(h.chunk_bytes);
  info.max_notify = std::min(uint32_t(h.max_notify), wire::kMaxNotify);  // a copy: no reference to a packed field
  return info;
}

// A socket whose handshake is under way (listener side).
struct EndpointImpl::Pending {
  int fd = -1;
  int stage = 0;  // 0: reading ClientHello, 1: reading ClientProof, 2: reading the connector's offer
  size_t have = 0;
  uint8_t buf[sizeof(wire::ClientHello)];
  wire::ClientHello hello{};
  wire::ClientProof proof{};
  std::string offer;
  uint8_t server_nonce[16];
  int64_t deadline_ms = 0;
  int64_t since_ms = 0;  // accepted then
  uint64_t seq = 0;      // accept order (the oldest is shed first)
};

}  // namespace tether::core
