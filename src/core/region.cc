#include "core/region.h"

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/wire.h"
#include "sys/crypto.h"

namespace tether::core {

constexpr uint32_t kDescriptorMagic = 0x44525454;  // "TTRD"
constexpr uint8_t kDescriptorVersion = 1;

#pragma pack(push, 1)
struct EncodedDescriptor {
  uint32_t magic;
  uint8_t version;
  uint8_t kind;
  uint16_t reserved;
  uint8_t endpoint[16];
  uint32_t region_id;
  int32_t device;
  uint64_t offset;
  uint64_t length;
  uint64_t key;
  uint64_t reserved2;
};
#pragma pack(pop)
static_assert(sizeof(EncodedDescriptor) == RemoteRegion::kEncodedSize);

uint64_t RegionState::key_for(uint64_t offset, uint64_t length) const {
  uint8_t msg[20];
  std::memcpy(msg, &id, 4);
  std::memcpy(msg + 4, &offset, 8);
  std::memcpy(msg + 12, &length, 8);
  return crypto::siphash24(secret, msg, sizeof msg);
}

Result<Region> RegionRegistry::add(void* ptr, uint64_t size, MemoryKind kind, int device, bool readonly) {
  if (ptr == nullptr && size > 0) return Status(Code::kInvalidArgument, "register: null pointer");
  if (size == 0) return Status(Code::kInvalidArgument, "register: zero-length region");
  auto s = std::make_shared<RegionState>();
  s->base = static_cast<uint8_t*>(ptr);
  s->size = size;
  s->kind = kind;
  s->device = device;
  s->readonly = readonly;
  s->endpoint = endpoint_;
  crypto::random_bytes(s->secret, sizeof s->secret);
  std::unique_lock lock(mu_);
  s->id = next_id_++;
  regions_.emplace(s->id, s);
  return Region(s);
}

Status RegionRegistry::unpublish(const Region& region) {
  const auto& s = region.state();
  if (!s) return Status(Code::kInvalidArgument, "deregister: empty region handle");
  {
    std::unique_lock lock(mu_);
    auto it = regions_.find(s->id);
    if (it == regions_.end() || it->second != s)
      return Status(Code::kNotFound, "deregister: region " + std::to_string(s->id) + " is not registered");
    regions_.erase(it);
    s->live.store(false, std::memory_order_release);
  }
  return Status::ok();
}

void RegionRegistry::wait_unpinned(const Region& region, const std::function<void(int64_t)>& stalled) {
  // Ends: a stalled peer is cut off (peer_timeout_ms, or `stalled`). Yields first (a chunk takes
  // microseconds), then sleeps: a long wait must not take a core.
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto next = start + std::chrono::milliseconds(10);
  for (int spins = 0; region.state()->pins.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < 1000) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    const auto now = Clock::now();
    if (stalled && now >= next) {
      stalled(std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count());
      next = now + std::chrono::milliseconds(10);
    }
  }
}

// (mu_ held) The region an access names, pinned, if key, rights and bounds allow it; else null and *code.
const std::shared_ptr<RegionState>* RegionRegistry::pin_checked(uint32_t id, uint64_t key, uint64_t desc_offset,
                                                                uint64_t desc_length, uint64_t offset,
                                                                uint64_t length, bool write, Code* code) const {
  auto it = regions_.find(id);
  *code = Code::kOk;
  if (it == regions_.end()) *code = Code::kNotFound;
  else if (it->second->key_for(desc_offset, desc_length) != key) *code = Code::kAccessDenied;
  else if (write && it->second->readonly) *code = Code::kAccessDenied;
  else if (!in_bounds(desc_offset, desc_length, it->second->size)) *code = Code::kOutOfRange;
  else if (offset < desc_offset || !in_bounds(offset - desc_offset, length, desc_length)) *code = Code::kOutOfRange;
  if (*code != Code::kOk) return nullptr;
  it->second->pins.fetch_add(1, std::memory_order_acquire);
  return &it->second;
}

Code RegionRegistry::resolve(uint32_t id, uint64_t key, uint64_t desc_offset, uint64_t desc_length,
                             uint64_t offset, uint64_t length, bool write, RegionState** out) const {
  std::shared_lock lock(mu_);
  Code code;
  if (const auto* r = pin_checked(id, key, desc_offset, desc_length, offset, length, write, &code)) *out = r->get();
  return code;
}

Code RegionRegistry::resolve(uint32_t id, uint64_t key, uint64_t desc_offset, uint64_t desc_length, uint64_t offset,
                             uint64_t length, bool write, std::shared_ptr<RegionState>* out) const {
  std::shared_lock lock(mu_);
  Code code;
  if (const auto* r = pin_checked(id, key, desc_offset, desc_length, offset, length, write, &code)) *out = *r;
  return code;
}

bool RegionRegistry::pin_published(RegionState& region) const {
  std::shared_lock lock(mu_);
  auto it = regions_.find(region.id);
  if (it == regions_.end() || it->second.get() != &region) return false;
  region.pins.fetch_add(1, std::memory_order_acquire);
  return true;
}

void RegionRegistry::clear() {
  std::unique_lock lock(mu_);
  for (auto& [id, s] : regions_) s->live.store(false);
  regions_.clear();
}

}  // namespace tether::core

// ---- public Region / RemoteRegion ----
namespace tether {
using core::EncodedDescriptor;
using core::in_bounds;

uint32_t Region::id() const { return state_ ? state_->id : 0; }
void* Region::data() const { return state_ ? state_->base : nullptr; }
uint64_t Region::size() const { return state_ ? state_->size : 0; }
MemoryKind Region::kind() const { return state_ ? state_->kind : MemoryKind::kHost; }
int Region::device() const { return state_ ? state_->device : -1; }
bool Region::readonly() const { return state_ && state_->readonly; }

Result<std::string> Region::descriptor(uint64_t offset, uint64_t length) const {
  if (!state_) return Status(Code::kInvalidArgument, "descriptor: empty region handle");
  if (!state_->live.load()) return Status(Code::kNotFound, "descriptor: region is deregistered");
  if (offset > state_->size)
    return Status(Code::kOutOfRange, "descriptor: offset " + std::to_string(offset) + " beyond region of " +
                                         std::to_string(state_->size) + " bytes");
  if (length == UINT64_MAX) length = state_->size - offset;
  if (!in_bounds(offset, length, state_->size))
    return Status(Code::kOutOfRange, "descriptor: [" + std::to_string(offset) + ", +" + std::to_string(length) +
                                         ") exceeds region of " + std::to_string(state_->size) + " bytes");
  RemoteRegion r;
  r.endpoint = state_->endpoint;
  r.region_id = state_->id;
  r.offset = offset;
  r.length = length;
  r.key = state_->key_for(offset, length);
  r.kind = state_->kind;
  r.device = state_->device;
  r.ext = state_->desc_ext;
  return r.encode();
}

std::string RemoteRegion::encode() const {
  EncodedDescriptor d{};
  d.magic = core::kDescriptorMagic;
  d.version = core::kDescriptorVersion;
  d.kind = static_cast<uint8_t>(kind);
  std::memcpy(d.endpoint, endpoint.data(), 16);
  d.region_id = region_id;
  d.device = device;
  d.offset = offset;
  d.length = length;
  d.key = key;
  return std::string(reinterpret_cast<const char*>(&d), sizeof d) + ext;
}

std::string_view RemoteRegion::ext_for(std::string_view transport) const {
  std::string_view in(ext);  // {u8 name length, name, u32 length, bytes}..., validated by parse()
  while (in.size() >= 5) {
    const uint8_t n = uint8_t(in[0]);
    if (in.size() < 5u + n) break;
    uint32_t len;
    std::memcpy(&len, in.data() + 1 + n, 4);
    if (in.size() < 5u + n + len) break;
    if (in.substr(1, n) == transport) return in.substr(5 + n, len);
    in.remove_prefix(5 + n + len);
  }
  return {};
}

Result<RemoteRegion> RemoteRegion::parse(std::string_view bytes) {
  if (bytes.size() < sizeof(EncodedDescriptor))
    return Status(Code::kInvalidArgument, "descriptor: expected at least " + std::to_string(sizeof(EncodedDescriptor)) +
                                              " bytes, got " + std::to_string(bytes.size()));
  wire::Offers exts;
  if (!wire::decode_offers(bytes.substr(sizeof(EncodedDescriptor)), &exts) ||
      (bytes.size() > sizeof(EncodedDescriptor) && exts.empty()))
    return Status(Code::kInvalidArgument, "descriptor: malformed transport extensions after the " +
                                              std::to_string(sizeof(EncodedDescriptor)) + " fixed bytes");
  EncodedDescriptor d;
  std::memcpy(&d, bytes.data(), sizeof d);
  if (d.magic != core::kDescriptorMagic) return Status(Code::kInvalidArgument, "descriptor: not a tether descriptor");
  if (d.version != core::kDescriptorVersion)
    return Status(Code::kInvalidArgument, "descriptor: version " + std::to_string(d.version) + " not supported");
  if (d.kind > 1 || d.reserved != 0 || d.reserved2 != 0)
    return Status(Code::kInvalidArgument, "descriptor: malformed");
  if (d.offset + d.length < d.offset) return Status(Code::kInvalidArgument, "descriptor: range overflows");
  RemoteRegion r;
  std::memcpy(r.endpoint.data(), d.endpoint, 16);
  r.region_id = d.region_id;
  r.offset = d.offset;
  r.length = d.length;
  r.key = d.key;
  r.kind = static_cast<MemoryKind>(d.kind);
  r.device = d.device;
  r.ext = std::string(bytes.substr(sizeof(EncodedDescriptor)));
  return r;
}

}  // namespace tether
