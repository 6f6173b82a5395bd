// The NCCL network plugin ABI, versions 7 to 9, written from the documented interface (NCCL's
// ext-net example and plugin docs) under our own names. Only the layout and the calling
// convention must match: a plugin exports a table named ncclNetPlugin_vN; every entry returns an
// ncclResult_t (an int). Field order is pinned by the static_asserts at the end.
//
// The device-unpack extension (netDeviceType == kUnpack, used by GPUDirect-TCPX): received payload
// is not in the posted buffer but scattered over 4 KiB pages of a bounce buffer; for the k-th
// receive posted on a comm the plugin publishes meta->cnt[k % 16] entries in meta->mem[k % 16],
// each {src_off in the bounce buffer, len, dst_off from the start of the posted buffer}. The
// receiver copies them out itself and only then calls irecvConsumed, which gives the pages back.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tether::netabi {

// ncclResult_t values.
enum Result : int {
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
  kInProgress = 7,
};

constexpr size_t kHandleMaxSize = 128;  // NCCL_NET_HANDLE_MAXSIZE: listen handles travel out of band
constexpr int kPtrHost = 0x1;
constexpr int kPtrCuda = 0x2;
constexpr int kPtrDmabuf = 0x4;

enum DeviceType : int { kDeviceHost = 0, kDeviceUnpack = 1 };
constexpr int kUnpackVersion = 0x7;  // the unpack device version NCCL 2.19+ expects

// ncclDebugLogger_t; level: 0 none, 1 version, 2 warn, 3 info, 4 abort, 5 trace.
using Logger = void (*)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);

// ncclNetDeviceHandle_v7_t (unchanged up to v11).
struct DeviceHandle {
  int type;                 // DeviceType
  int version;
  void* handle;             // for kDeviceUnpack: an UnpackDeviceHandle
  size_t size;
  int needs_proxy_progress;
};

// ---- unpack metadata (per recv comm) ----
constexpr int kUnpackQueueDepth = 16;               // one slot per request of the comm's ring
constexpr size_t kUnpackPage = 4096;
constexpr size_t kUnpackMaxRecv = 4u << 20;         // at most 4 MiB per irecv
constexpr size_t kUnpackMaxEntries = kUnpackMaxRecv / kUnpackPage * 2;  // 2,048 (slack for split pages)

struct alignas(16) UnpackEntry {
  uint32_t src_off;  // offset in the bounce buffer
  uint32_t len;      // bytes (at most one page)
  uint64_t dst_off;  // offset from the start of the posted receive buffer
};
struct UnpackMeta {
  UnpackEntry mem[kUnpackQueueDepth][kUnpackMaxEntries];
  uint64_t cnt[kUnpackQueueDepth];
};
struct UnpackDeviceHandle {
  UnpackMeta* meta;   // device-mapped on GPU plugins
  void* bounce_buf;   // base of the page pool src_off counts from
  uint64_t head;      // receives consumed so far (slot = head % 16)
};

// ---- v7 ----
struct PropertiesV7 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;       // kPtrHost | kPtrCuda | kPtrDmabuf
  int speed;             // Mbps
  int port;
  float latency;         // us
  int max_comms;
  int max_recvs;         // grouped receives per irecv
  int net_device_type;   // DeviceType
  int net_device_version;
};

struct NetV7 {
  const char* name;
  int (*init)(Logger log);
  int (*devices)(int* ndev);
  int (*get_properties)(int dev, PropertiesV7* props);
  int (*listen)(int dev, void* handle, void** listen_comm);
  int (*connect)(int dev, void* handle, void** send_comm, DeviceHandle** send_dev_comm);
  int (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  int (*reg_mr)(void* comm, void* data, int size, int type, void** mhandle);
  int (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
  int (*dereg_mr)(void* comm, void* mhandle);
  int (*isend)(void* send_comm, void* data, int size, int tag, void* mhandle, void** request);
  int (*irecv)(void* recv_comm, int n, void** data, int* sizes, int* tags, void** mhandles, void** request);
  int (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
  int (*test)(void* request, int* done, int* sizes);
  int (*close_send)(void* send_comm);
  int (*close_recv)(void* recv_comm);
  int (*close_listen)(void* listen_comm);
  int (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  int (*irecv_consumed)(void* recv_comm, int n, void* request);
};

// ---- v8: regIsGlobal added after ptrSupport; regMr takes size_t ----
struct PropertiesV8 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;     // registrations are not tied to one comm
  int speed;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  int net_device_type;
  int net_device_version;
};

struct NetV8 {
  const char* name;
  int (*init)(Logger log);
  int (*devices)(int* ndev);
  int (*get_properties)(int dev, PropertiesV8* props);
  int (*listen)(int dev, void* handle, void** listen_comm);
  int (*connect)(int dev, void* handle, void** send_comm, DeviceHandle** send_dev_comm);
  int (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  int (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  int (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
  int (*dereg_mr)(void* comm, void* mhandle);
  int (*isend)(void* send_comm, void* data, int size, int tag, void* mhandle, void** request);
  int (*irecv)(void* recv_comm, int n, void** data, int* sizes, int* tags, void** mhandles, void** request);
  int (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
  int (*test)(void* request, int* done, int* sizes);
  int (*close_send)(void* send_comm);
  int (*close_recv)(void* recv_comm);
  int (*close_listen)(void* listen_comm);
  int (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  int (*irecv_consumed)(void* recv_comm, int n, void* request);
};

// ---- v9: forceFlush, virtual devices, size limits; isend/irecv sizes become size_t ----
constexpr int kMaxDevsPerNicV9 = 4;
struct VDevicePropsV9 {
  int ndevs;
  int devs[kMaxDevsPerNicV9];
};
struct PropertiesV9 {
  char* name;
  char* pci_path;
  uint64_t guid;
  int ptr_support;
  int reg_is_global;
  int force_flush;
  int speed;
  int port;
  float latency;
  int max_comms;
  int max_recvs;
  int net_device_type;
  int net_device_version;
  VDevicePropsV9 vprops;
  size_t max_p2p_bytes;
  size_t max_coll_bytes;
};

struct NetV9 {
  const char* name;
  int (*init)(Logger log);
  int (*devices)(int* ndev);
  int (*get_properties)(int dev, PropertiesV9* props);
  int (*listen)(int dev, void* handle, void** listen_comm);
  int (*connect)(int dev, void* handle, void** send_comm, DeviceHandle** send_dev_comm);
  int (*accept)(void* listen_comm, void** recv_comm, DeviceHandle** recv_dev_comm);
  int (*reg_mr)(void* comm, void* data, size_t size, int type, void** mhandle);
  int (*reg_mr_dmabuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
  int (*dereg_mr)(void* comm, void* mhandle);
  int (*isend)(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request);
  int (*irecv)(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void** request);
  int (*iflush)(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
  int (*test)(void* request, int* done, int* sizes);
  int (*close_send)(void* send_comm);
  int (*close_recv)(void* recv_comm);
  int (*close_listen)(void* listen_comm);
  int (*get_device_mr)(void* comm, void* mhandle, void** dptr_mhandle);
  int (*irecv_consumed)(void* recv_comm, int n, void* request);
  int (*make_vdevice)(int* d, VDevicePropsV9* props);
};

// ---- layout pins (x86-64 / aarch64 LP64) ----
static_assert(sizeof(UnpackEntry) == 16);
static_assert(offsetof(UnpackMeta, cnt) == size_t(kUnpackQueueDepth) * kUnpackMaxEntries * 16);
static_assert(sizeof(DeviceHandle) == 32 && offsetof(DeviceHandle, size) == 16);
static_assert(offsetof(PropertiesV7, ptr_support) == 24 && offsetof(PropertiesV7, speed) == 28 &&
              offsetof(PropertiesV7, latency) == 36 && offsetof(PropertiesV7, net_device_type) == 48 &&
              sizeof(PropertiesV7) == 56);
static_assert(offsetof(PropertiesV8, reg_is_global) == 28 && offsetof(PropertiesV8, speed) == 32 &&
              offsetof(PropertiesV8, max_recvs) == 48 && offsetof(PropertiesV8, net_device_version) == 56 &&
              sizeof(PropertiesV8) == 64);
static_assert(offsetof(PropertiesV9, force_flush) == 32 && offsetof(PropertiesV9, net_device_type) == 56 &&
              offsetof(PropertiesV9, vprops) == 64 && offsetof(PropertiesV9, max_p2p_bytes) == 88 &&
              sizeof(PropertiesV9) == 104);
static_assert(offsetof(NetV8, irecv_consumed) == 18 * sizeof(void*) && sizeof(NetV8) == 19 * sizeof(void*));
static_assert(sizeof(NetV7) == sizeof(NetV8) && sizeof(NetV9) == 20 * sizeof(void*));

}  // namespace tether::netabi
