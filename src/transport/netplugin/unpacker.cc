#include "transport/netplugin/unpacker.h"

#include <cstring>
#include <vector>

#include "gpu/cuda_api.h"
#include "gpu/staging.h"
#include "gpu/copy_kernel.h"

namespace tether::transport {

namespace {

using gpu::CUdeviceptr;

Status cuda_check(const char* call, gpu::CUresult r) {
  return r == gpu::kCudaSuccess ? Status::ok() : Status(Code::kInternal, "netplugin unpack: " + gpu::cuda_error(call, r));
}

class CopyUnpacker final : public Unpacker {
 public:
  CopyUnpacker(gpu::Unpack mode, bool bounce_on_gpu, int bounce_device)
      : mode_(mode), bounce_on_gpu_(bounce_on_gpu), bounce_device_(bounce_device) {}

  ~CopyUnpacker() override {
    wait();
    const gpu::CudaApi* a = gpu::cuda();
    if (!a) return;
    for (size_t d = 0; d < per_device_.size(); ++d) {
      PerDevice& p = per_device_[d];
      if (!p.stream) continue;
      (void)gpu::use_device(int(d));
      a->cuEventDestroy(p.event);
      a->cuStreamDestroy(p.stream);
    }
  }

  const char* name() const override { return bounce_on_gpu_ ? gpu::unpack_name(mode_) : "host"; }

  Status start(const netabi::UnpackEntry* frags, uint64_t n, const uint8_t* bounce, uint8_t* dest,
               int dest_device) override {
    wait();  // one copy in flight: its stream order and descriptors are reused below
    if (!bounce_on_gpu_ && dest_device < 0) {  // host to host: done when the loop is
      for (uint64_t i = 0; i < n; ++i) std::memcpy(dest + frags[i].dst_off, bounce + frags[i].src_off, frags[i].len);
      return Status::ok();
    }
    const int device = bounce_on_gpu_ ? bounce_device_ : dest_device;  // where the copy runs
    PerDevice* p = nullptr;
    if (Status s = ready(device, &p); !s.is_ok()) return s;
    const gpu::CudaApi* a = gpu::cuda();
    if (mode_ == gpu::Unpack::kKernel && bounce_on_gpu_ && dest_device == bounce_device_) {
      if (Status s = launch(*p, device, frags, n, bounce, dest); !s.is_ok()) return s;
    } else {
      for (uint64_t i = 0; i < n; ++i) {
        const auto dst = reinterpret_cast<CUdeviceptr>(dest + frags[i].dst_off);
        const auto src = reinterpret_cast<CUdeviceptr>(bounce + frags[i].src_off);
        if (Status s = cuda_check("cuMemcpyAsync", a->cuMemcpyAsync(dst, src, frags[i].len, p->stream)); !s.is_ok())
          return s;
      }
    }
    if (Status s = cuda_check("cuEventRecord", a->cuEventRecord(p->event, p->stream)); !s.is_ok()) return s;
    pending_ = device;
    if (mode_ == gpu::Unpack::kHost) wait();
    return Status::ok();
  }

  Result<bool> done() override {
    if (pending_ < 0) return true;
    if (Status s = gpu::use_device(pending_); !s.is_ok()) return s;
    const gpu::CUresult r = gpu::cuda()->cuEventQuery(per_device_[size_t(pending_)].event);
    if (r == gpu::kCudaNotReady) return false;
    pending_ = -1;
    if (r != gpu::kCudaSuccess) return cuda_check("cuEventQuery (the unpack failed)", r);
    return true;
  }

  Status read(const netabi::UnpackEntry* frags, uint64_t n, const uint8_t* bounce, void* out) override {
    auto* o = static_cast<uint8_t*>(out);
    if (!bounce_on_gpu_) {
      for (uint64_t i = 0; i < n; ++i) std::memcpy(o + frags[i].dst_off, bounce + frags[i].src_off, frags[i].len);
      return Status::ok();
    }
    // On our own non-blocking stream (not the legacy default stream, which waits for the app's work).
    PerDevice* p = nullptr;
    if (Status s = ready(bounce_device_, &p); !s.is_ok()) return s;
    const gpu::CudaApi* a = gpu::cuda();
    for (uint64_t i = 0; i < n; ++i) {
      const auto dst = reinterpret_cast<CUdeviceptr>(o + frags[i].dst_off);
      const auto src = reinterpret_cast<CUdeviceptr>(bounce + frags[i].src_off);
      if (Status s = cuda_check("cuMemcpyAsync(header)", a->cuMemcpyAsync(dst, src, frags[i].len, p->stream)); !s.is_ok())
        return s;
    }
    return cuda_check("cuStreamSynchronize(header)", a->cuStreamSynchronize(p->stream));
  }

  void wait() override {
    if (pending_ < 0) return;
    if (gpu::use_device(pending_).is_ok()) gpu::cuda()->cuEventSynchronize(per_device_[size_t(pending_)].event);
    pending_ = -1;  // an error shows again on the next CUDA call of this context
  }

 private:
  struct PerDevice {
    gpu::CUstream stream = nullptr;
    gpu::CUevent event = nullptr;
  };

  Status ready(int device, PerDevice** out) {
    if (Status s = gpu::use_device(device); !s.is_ok()) return s;
    if (per_device_.empty()) per_device_.resize(size_t(gpu::device_count()));
    PerDevice& p = per_device_[size_t(device)];  // use_device checked the index
    const gpu::CudaApi* a = gpu::cuda();
    if (!p.stream) {
      if (Status s = cuda_check("cuStreamCreate", a->cuStreamCreate(&p.stream, gpu::kStreamNonBlocking)); !s.is_ok()) return s;
      if (Status s = cuda_check("cuEventCreate", a->cuEventCreate(&p.event, gpu::kEventDisableTiming)); !s.is_ok()) return s;
    }
    *out = &p;
    return Status::ok();
  }

  // One receive: its fragments as offsets from the bounce buffer and the destination, one launch of
  // the shared copy kernel (they travel in the launch). A receive is at most kUnpackMaxRecv bytes, so
  // every offset fits 32 bits.
  Status launch(PerDevice& p, int device, const netabi::UnpackEntry* frags, uint64_t n, const uint8_t* bounce,
                uint8_t* dest) {
    for (uint64_t i = 0; i < n; ++i) pieces_[i] = gpu::CopyPiece{frags[i].src_off, uint32_t(frags[i].dst_off), frags[i].len};
    return gpu::launch_copy_pieces(device, p.stream, reinterpret_cast<uint64_t>(bounce), reinterpret_cast<uint64_t>(dest),
                                   pieces_, uint32_t(n));
  }

  const gpu::Unpack mode_;
  const bool bounce_on_gpu_;
  const int bounce_device_;
  std::vector<PerDevice> per_device_;
  gpu::CopyPiece pieces_[netabi::kUnpackMaxEntries];  // the launch's descriptors, built per receive
  int pending_ = -1;                // device of the copy in flight, -1: none
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

Status check_unpack_mode(const std::string& mode, bool bounce_on_gpu) {
  if (!mode.empty() && mode != "host" && mode != "kernel" && mode != "d2d")
    return Status(Code::kInvalidArgument, "TETHER_UNPACK must be kernel, d2d or host, not '" + mode + "'");
  if (!bounce_on_gpu) return Status::ok();  // host bounce pages: memcpy, or CUDA copies for GPU destinations
  std::string why;
  if (!gpu::cuda(&why)) return Status(Code::kUnavailable, "the net plugin's bounce buffer is GPU memory and CUDA is unavailable: " + why);
  if (mode == "kernel" && !gpu::kernels_available(&why))
    return Status(Code::kUnavailable, "TETHER_UNPACK=kernel: " + why);
  return Status::ok();
}

Result<std::unique_ptr<Unpacker>> make_unpacker(const std::string& mode, const void* bounce) {
  auto info = gpu::pointer_info(bounce);  // host memory when CUDA is absent
  if (!info.is_ok()) return info.status();
  const bool on_gpu = info.value().is_device;
  if (Status s = check_unpack_mode(mode, on_gpu); !s.is_ok()) return s;
  gpu::Unpack m = gpu::Unpack::kD2D;
  if (mode == "host") m = gpu::Unpack::kHost;
  else if (mode == "kernel" || (mode.empty() && on_gpu && gpu::kernels_available())) m = gpu::Unpack::kKernel;
  return std::unique_ptr<Unpacker>(new CopyUnpacker(m, on_gpu, on_gpu ? info.value().device : -1));
}

}  // namespace tether::transport
