#include "transport/fabric/stage.h"

#include <cstdlib>
#include <cstring>

#include "sys/crypto.h"

namespace tether::transport::fabric {

Status Copier::start(uint32_t id, void* dst, const void* src, uint64_t n, int device) {
  if (device < 0) {
    std::memcpy(dst, src, n);
    device_[id] = -1;
    return Status::ok();
  }
  std::string why;
  const gpu::CudaApi* a = gpu::cuda(&why);
  if (!a) return Status(Code::kUnavailable, why);
  // Set every time: the application may have switched this thread's context.
  if (Status s = gpu::use_device(device); !s.is_ok()) return s;
  if (streams_.empty()) {  // first GPU copy of this owner
    const int n_dev = gpu::device_count();
    streams_.assign(size_t(n_dev), nullptr);
    events_.assign(size_t(n_dev) * ids_, nullptr);
  }
  if (size_t(device) >= streams_.size())
    return Status(Code::kInvalidArgument, "GPU " + std::to_string(device) + " does not exist");
  gpu::CUstream& stream = streams_[size_t(device)];
  if (!stream)
    TETHER_CUDA_TRY("cuStreamCreate", a->cuStreamCreate(&stream, gpu::kStreamNonBlocking));
  gpu::CUevent& ev = events_[size_t(device) * ids_ + id];
  if (!ev)
    TETHER_CUDA_TRY("cuEventCreate", a->cuEventCreate(&ev, gpu::kEventDisableTiming));
  device_[id] = device;  // from here done() asks the event (an event never recorded counts as done)
  if (Status s = gpu::cuda_check("cuMemcpyAsync", a->cuMemcpyAsync(reinterpret_cast<gpu::CUdeviceptr>(dst),
                                                         reinterpret_cast<gpu::CUdeviceptr>(src), n, stream));
      !s.is_ok())
    return s;
  return gpu::cuda_check("cuEventRecord", a->cuEventRecord(ev, stream));
}

Result<bool> Copier::done(uint32_t id) {
  const int d = device_[id];
  if (d < 0) return true;
  const gpu::CUresult r = gpu::cuda()->cuEventQuery(events_[size_t(d) * ids_ + id]);
  if (r == gpu::kCudaNotReady) return false;
  device_[id] = -1;
  if (r != gpu::kCudaSuccess) return Status(Code::kInternal, gpu::cuda_error("cuEventQuery", r));
  return true;
}

void Copier::wait_all() {
  if (streams_.empty()) return;
  const gpu::CudaApi* a = gpu::cuda();
  for (auto& s : streams_)
    if (s) a->cuStreamSynchronize(s);
  for (auto& e : events_)
    if (e) a->cuEventDestroy(e);
  for (auto& s : streams_)
    if (s) a->cuStreamDestroy(s);
  events_.clear();
  streams_.clear();
  device_.assign(ids_, -1);
}

Status StageMem::allocate(Rail& rail, uint32_t slots, uint64_t bytes, int device) {
  bytes = (bytes + 4095) & ~uint64_t(4095);
  const uint64_t total = bytes * slots;
  void* p = nullptr;
  if (device >= 0) {
    std::string why;
    const gpu::CudaApi* a = gpu::cuda(&why);
    if (!a) return Status(Code::kUnavailable, why);
    if (Status s = gpu::use_device(device); !s.is_ok()) return s;
    if (Status s = gpu::cuda_check("cuMemHostAlloc", a->cuMemHostAlloc(&p, total, gpu::kHostAllocPortable | gpu::kHostAllocDeviceMap));
        !s.is_ok())
      return s;
    pinned_ = true;
  } else {
    p = std::aligned_alloc(4096, total);
    if (!p) return Status(Code::kUnavailable, "staging: out of memory");
    pinned_ = false;
  }
  std::string why;
  if (!rail.register_memory(p, total, -1, tether::crypto::random_u64(), false, &mr_, &why)) {
    if (pinned_) gpu::cuda()->cuMemFreeHost(p);
    else std::free(p);
    return Status(Code::kUnavailable, "staging: " + why);
  }
  rail_ = &rail;
  base_ = static_cast<uint8_t*>(p);
  slots_ = slots;
  bytes_ = bytes;
  busy_.assign(slots, 0);
  return Status::ok();
}

void StageMem::release() {
  if (!base_) return;
  rail_->deregister(&mr_);
  if (pinned_) gpu::cuda()->cuMemFreeHost(base_);
  else std::free(base_);
  base_ = nullptr;
  slots_ = 0;
  busy_.clear();
}

}  // namespace tether::transport::fabric
