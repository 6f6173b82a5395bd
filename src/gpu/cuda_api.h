// The CUDA driver API, loaded at run time (dlopen libcuda.so.1): one build runs with or without a
// GPU, and nothing links against CUDA. Only the calls tether uses, declared from the documented ABI.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "tether/status.h"

namespace tether::gpu {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = uint64_t;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
struct CUipcMemHandle { char reserved[64]; };
using CUmemGenericAllocationHandle = unsigned long long;
struct CUmemLocation { int type, id; };
struct CUmemAccessDesc { CUmemLocation location; int flags; };

constexpr CUresult kCudaSuccess = 0;
constexpr CUresult kCudaNotReady = 600;
constexpr int kPointerAttrContext = 1, kPointerAttrMemoryType = 2, kPointerAttrDeviceOrdinal = 9;
// Memory from the VMM API (cuMemCreate + cuMemMap): what a pointer's mapping is and how it may be shared.
constexpr int kPointerAttrAllowedHandleTypes = 14, kPointerAttrMappingSize = 18, kPointerAttrMappingBase = 19,
              kPointerAttrMemoryBlockId = 20;
constexpr int kMemHandlePosixFd = 1, kMemLocationDevice = 1, kMemAccessReadWrite = 3;
constexpr unsigned kMemoryTypeHost = 1, kMemoryTypeDevice = 2, kMemoryTypeUnified = 4;
constexpr unsigned kHostAllocPortable = 1, kHostAllocDeviceMap = 2;
constexpr unsigned kStreamNonBlocking = 1, kEventDisableTiming = 2;
constexpr unsigned kIpcLazyEnablePeerAccess = 1;

struct CudaApi {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetPCIBusId)(char*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuPointerGetAttribute)(void*, int, CUdeviceptr);
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent);  // ms (optional: may be null)
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);  // any direction (UVA)
  CUresult (*cuMemcpy)(CUdeviceptr, CUdeviceptr, size_t);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  // The VMM API (CUDA 10.2+), optional: null where the driver lacks it (then VMM memory is not shared).
  CUresult (*cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle*, void*);
  CUresult (*cuMemExportToShareableHandle)(void*, CUmemGenericAllocationHandle, int, unsigned long long);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*, int);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  bool has_vmm() const { return cuMemRetainAllocationHandle && cuMemExportToShareableHandle && cuMemImportFromShareableHandle &&
                                cuMemRelease && cuMemAddressReserve && cuMemAddressFree && cuMemMap && cuMemUnmap && cuMemSetAccess; }
};

// The loaded API, or null with `why` saying what is missing (no driver, no GPU, a missing symbol).
// Loads once, on first use; thread-safe. TETHER_LIBCUDA_SO overrides the library path.
const CudaApi* cuda(std::string* why = nullptr);
int device_count();  // 0 without CUDA

// "cuMemcpyAsync: invalid argument (1)"-style message for a failed call.
std::string cuda_error(const char* call, CUresult r);
// Ok, or kInternal with cuda_error's message.
inline Status cuda_check(const char* call, CUresult r) {
  return r == kCudaSuccess ? Status::ok() : Status(Code::kInternal, cuda_error(call, r));
}
// Returns the failed call's Status from the enclosing function.
#define TETHER_CUDA_TRY(call, expr)                                                              \
  do {                                                                                           \
    if (::tether::Status s_ = ::tether::gpu::cuda_check(call, (expr)); !s_.is_ok()) return s_;   \
  } while (0)
// Makes device `device`'s primary context current on the calling thread.
Status use_device(int device);

// Hands the calling thread back the CUDA context it had when the scope began, if tether made another
// current meanwhile (use_device). The CUDA runtime (torch, cupy) runs on whatever context is current:
// without this, an application working on GPU 1 that writes from GPU 0 memory would find GPU 0 current
// afterwards, and its next allocation there. Every entry point an application thread calls opens
// one; costs nothing unless tether switched contexts. Scopes nest; the outermost restores.
class KeepContext {
 public:
  KeepContext();
  ~KeepContext();
  KeepContext(const KeepContext&) = delete;
  KeepContext& operator=(const KeepContext&) = delete;
};
// GPU `device`'s PCI address as sysfs names it ("0000:18:00.0"), or "" when CUDA cannot say.
std::string pci_bus_id(int device);

// What a pointer is: host memory (incl. pinned), or GPU memory of `device`.
struct PointerInfo {
  bool is_device = false;
  int device = -1;
  uint64_t alloc_base = 0, alloc_size = 0;  // the allocation it lies in (VMM memory: its mapping)
};
Result<PointerInfo> pointer_info(const void* ptr);
// True when [at, at + size) is GPU memory mapped without holes by the VMM API (cuMemMap), possibly
// across several allocations (torch's expandable segments): such a range may be registered whole.
bool mapped_through(uint64_t at, uint64_t size);

}  // namespace tether::gpu
