#include "transport/ipc/vmm.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace tether::transport::ipc {

using gpu::CudaApi;
using gpu::CUdeviceptr;
using gpu::CUmemGenericAllocationHandle;

namespace {

Result<uint64_t> attribute(const CudaApi* a, int attr, uint64_t ptr) {
  uint64_t v = 0;  // every attribute read here is 64 bits, or 32 (handle types): zero-extended
  TETHER_CUDA_TRY("cuPointerGetAttribute", a->cuPointerGetAttribute(&v, attr, ptr));
  return v;
}

Status errno_status(const std::string& what) { return Status(Code::kUnavailable, what + ": " + std::strerror(errno)); }

// Closes an fd on every way out.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Every piece of an exported region keeps an fd open here (a 60 GiB pool of torch's 20 MiB pieces is
// 3,072): the soft limit on open files goes up to the hard one, once.
void raise_fd_limit() {
  static std::once_flag once;
  std::call_once(once, [] {
    rlimit r{};
    if (::getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
      r.rlim_cur = r.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &r);
    }
  });
}

}  // namespace

VmmExport::~VmmExport() {
  for (const VmmPiece& p : pieces)
    if (p.fd >= 0) ::close(p.fd);
}

Result<std::shared_ptr<VmmExport>> export_vmm(uint64_t base, uint64_t size) {
  std::string why;
  const CudaApi* a = gpu::cuda(&why);
  if (!a) return Status(Code::kUnavailable, why);
  if (!a->has_vmm()) return Status(Code::kUnavailable, "this CUDA driver lacks the VMM API");
  auto e = std::make_shared<VmmExport>();
  auto first = attribute(a, gpu::kPointerAttrMappingBase, base);
  if (!first.is_ok()) return Status(Code::kUnavailable, "not VMM memory: " + first.status().message());
  raise_fd_limit();
  e->base = first.value();
  for (uint64_t at = e->base; at < base + size;) {
    auto mbase = attribute(a, gpu::kPointerAttrMappingBase, at);
    auto msize = attribute(a, gpu::kPointerAttrMappingSize, at);
    auto types = attribute(a, gpu::kPointerAttrAllowedHandleTypes, at);
    auto block = attribute(a, gpu::kPointerAttrMemoryBlockId, at);
    if (!mbase.is_ok() || !msize.is_ok() || !types.is_ok() || !block.is_ok() || mbase.value() != at || msize.value() == 0)
      return Status(Code::kUnavailable, "VMM region with a hole or an unmapped piece");
    if (!(types.value() & gpu::kMemHandlePosixFd))
      return Status(Code::kUnavailable, "VMM memory not created shareable as a POSIX fd (requestedHandleTypes)");
    if (e->pieces.size() >= kMaxVmmPieces) return Status(Code::kUnavailable, "VMM region of too many pieces");
    CUmemGenericAllocationHandle h = 0;
    TETHER_CUDA_TRY("cuMemRetainAllocationHandle", a->cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(at)));
    int fd = -1;
    const gpu::CUresult r = a->cuMemExportToShareableHandle(&fd, h, gpu::kMemHandlePosixFd, 0);
    a->cuMemRelease(h);  // the retain's reference; the mapping keeps the allocation
    TETHER_CUDA_TRY("cuMemExportToShareableHandle", r);
    e->pieces.push_back(VmmPiece{at - e->base, msize.value(), fd, 0, block.value()});
    e->identity = e->identity * 0x100000001b3ull ^ block.value();
    at += msize.value();
  }
  e->size = e->pieces.back().offset + e->pieces.back().size;
  return e;
}

VmmImport::~VmmImport() {
  const CudaApi* a = gpu::cuda();
  if (!a || !ptr) return;
  for (size_t i = 0; i < mapped; ++i) a->cuMemUnmap(ptr + pieces[i].offset, pieces[i].size);
  a->cuMemAddressFree(ptr, size);
}

Result<std::unique_ptr<VmmImport>> import_vmm(pid_t pid, uint64_t table, uint32_t count, uint64_t size, int device) {
  std::string why;
  const CudaApi* a = gpu::cuda(&why);
  if (!a) return Status(Code::kUnavailable, why);
  if (!a->has_vmm()) return Status(Code::kUnavailable, "this CUDA driver lacks the VMM API");
  if (count == 0 || count > kMaxVmmPieces) return Status(Code::kProtocolError, "a VMM region of no or too many pieces");
  auto m = std::make_unique<VmmImport>();
  std::vector<VmmPiece>& pieces = m->pieces;
  pieces.resize(count);
  iovec mine{pieces.data(), count * sizeof(VmmPiece)}, theirs{reinterpret_cast<void*>(table), mine.iov_len};
  if (::process_vm_readv(pid, &mine, 1, &theirs, 1, 0) != ssize_t(mine.iov_len))
    return errno_status("reading the peer's VMM pieces (process_vm_readv)");
  uint64_t end = 0;
  for (const VmmPiece& p : pieces) {  // contiguous from 0 and exactly `size`: anything else is a lie
    if (p.offset != end || p.size == 0 || p.size > size - end) return Status(Code::kProtocolError, "a malformed VMM piece table");
    end += p.size;
  }
  if (end != size) return Status(Code::kProtocolError, "a malformed VMM piece table");
  Fd pidfd{int(::syscall(SYS_pidfd_open, pid, 0))};
  if (pidfd.fd < 0) return errno_status("pidfd_open");
  TETHER_CUDA_TRY("cuMemAddressReserve", a->cuMemAddressReserve(&m->ptr, size, 0, 0, 0));
  m->size = size;
  gpu::CUmemAccessDesc access{{gpu::kMemLocationDevice, device}, gpu::kMemAccessReadWrite};
  for (const VmmPiece& p : pieces) {  // on any failure `m` unmaps what was mapped and frees the range
    Fd fd{int(::syscall(SYS_pidfd_getfd, pidfd.fd, p.fd, 0))};
    if (fd.fd < 0) return errno_status("pidfd_getfd (the peer's VMM allocation)");
    CUmemGenericAllocationHandle h = 0;
    TETHER_CUDA_TRY("cuMemImportFromShareableHandle",
                    a->cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(intptr_t(fd.fd)), gpu::kMemHandlePosixFd));
    const gpu::CUresult r = a->cuMemMap(m->ptr + p.offset, p.size, 0, h, 0);
    a->cuMemRelease(h);  // the mapping holds the allocation from here on
    TETHER_CUDA_TRY("cuMemMap", r);
    ++m->mapped;
    TETHER_CUDA_TRY("cuMemSetAccess", a->cuMemSetAccess(m->ptr + p.offset, p.size, &access, 1));
  }
  return m;
}

}  // namespace tether::transport::ipc
