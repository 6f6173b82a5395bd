#include "core/handshake.h"

#include <algorithm>
#include <cstring>

namespace tether::core {

bool wildcard(const std::string& h) { return h.empty() || h == "0.0.0.0" || h == "::" || h == "[::]"; }

void copy_name(char (&dst)[64], const std::string& src) {
  std::memset(dst, 0, sizeof dst);
  std::memcpy(dst, src.data(), std::min(src.size(), sizeof dst - 1));
}

std::string read_name(const char (&src)[64]) { return std::string(src, strnlen(src, sizeof src)); }

crypto::Digest proof(const std::string& token, const char* who, const uint8_t* cn, const uint8_t* sn, uint64_t session,
                     uint32_t lane) {
  uint8_t msg[16 + 16 + 16 + 8 + 4] = {};
  std::memcpy(msg, who, std::min<size_t>(16, std::strlen(who)));
  std::memcpy(msg + 16, cn, 16);
  std::memcpy(msg + 32, sn, 16);
  std::memcpy(msg + 48, &session, 8);
  std::memcpy(msg + 56, &lane, 4);
  return crypto::hmac_sha256(token, msg, sizeof msg);
}

bool looks_like_metadata(std::string_view b) {
  return b.size() >= sizeof(MetadataHeader) && std::memcmp(b.data(), &kMetadataMagic, 4) == 0;
}

Status parse_metadata_bytes(std::string_view b, ParsedMetadata* out) {
  if (!looks_like_metadata(b)) return Status(Code::kInvalidArgument, "not tether endpoint metadata");
  MetadataHeader m;
  std::memcpy(&m, b.data(), sizeof m);
  if (m.version != wire::kVersion)
    return Status(Code::kProtocolError, "metadata from wire version " + std::to_string(m.version) +
                                            ", this build speaks " + std::to_string(wire::kVersion));
  if (b.size() != sizeof m + m.host_len + m.hostname_len + m.control_len)
    return Status(Code::kInvalidArgument, "metadata is truncated or malformed");
  if (m.port == 0) return Status(Code::kInvalidArgument, "metadata names port 0");
  out->info.host.assign(b.substr(sizeof m, m.host_len));
  out->info.hostname.assign(b.substr(sizeof m + m.host_len, m.hostname_len));
  out->control.assign(b.substr(sizeof m + m.host_len + m.hostname_len, m.control_len));
  out->info.port = m.port;
  std::memcpy(out->info.endpoint.data(), m.endpoint, 16);
  std::memcpy(out->host_id, m.host_id, 32);
  return Status::ok();
}

}  // namespace tether::core
