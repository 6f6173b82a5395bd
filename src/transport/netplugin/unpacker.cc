#include "transport/netplugin/unpacker.h"

#include <cstring>

namespace tether::transport {

namespace {

class HostUnpacker final : public Unpacker {
 public:
  const char* name() const override { return "host"; }
  Status start(const netabi::UnpackEntry* frags, uint64_t n, const uint8_t* bounce, uint8_t* dest,
               uint64_t* ticket) override {
    for (uint64_t i = 0; i < n; ++i) std::memcpy(dest + frags[i].dst_off, bounce + frags[i].src_off, frags[i].len);
    *ticket = 0;
    return Status::ok();
  }
  bool done(uint64_t) override { return true; }  // the copies above have completed
};

}  // namespace

Code check_fragments(const netabi::UnpackEntry* frags, uint64_t n, uint64_t length) {
  if (n > netabi::kUnpackMaxEntries) return Code::kProtocolError;
  uint64_t total = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const auto& f = frags[i];
    if (f.len > netabi::kUnpackPage || f.dst_off > length || f.len > length - f.dst_off) return Code::kProtocolError;
    total += f.len;
  }
  return total == length ? Code::kOk : Code::kProtocolError;
}

Result<std::unique_ptr<Unpacker>> make_unpacker(const std::string& mode, bool bounce_on_gpu) {
  // Host bounce pages (the testnet plugin on CPU): a memcpy per fragment whatever the mode asks for
  // GPU copies. GPU bounce pages (TCPX devmem): the GPU unpack.
  if (!bounce_on_gpu) {
    if (!mode.empty() && mode != "host" && mode != "kernel" && mode != "d2d")
      return Status(Code::kInvalidArgument, "TETHER_UNPACK must be kernel, d2d or host, not '" + mode + "'");
    return std::unique_ptr<Unpacker>(new HostUnpacker());
  }
  if (mode == "host")
    return Status(Code::kUnavailable, "the plugin's bounce buffer is GPU memory: TETHER_UNPACK=host cannot read it");
  if (mode.empty() || mode == "kernel" || mode == "d2d")
    return Status(Code::kUnavailable, "TETHER_UNPACK=" + mode + " needs the GPU unpack of src/gpu (not in this build)");
  return Status(Code::kInvalidArgument, "TETHER_UNPACK must be kernel, d2d or host, not '" + mode + "'");
}

}  // namespace tether::transport
