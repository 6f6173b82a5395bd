// One rail: a libfabric domain (one NIC) with its address vector, completion queue and one
// reliable-datagram endpoint. Every peer reached over this rail shares the endpoint; peers are
// entries in the address vector. Rails know nothing about tether's chunks: they post RMA
// operations with an opaque context and hand completions back.
#pragma once
#include <rdma/fabric.h>
#include <rdma/fi_eq.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>

#include "transport/fabric/discovery.h"
#include "transport/fabric/libfabric.h"

namespace tether::transport::fabric {

// One region's registration on one rail.
struct RailMr {
  fid_mr* mr = nullptr;
  void* desc = nullptr;    // for the local side of operations (FI_MR_LOCAL)
  uint64_t key = 0;        // what the remote side names it by
  uint64_t base = 0;       // remote address of the region's first byte: its virtual address
                           // under FI_MR_VIRT_ADDR, else 0 (addresses are offsets)
};

class Rail {
 public:
  // Opens fabric, domain, address vector, completion queue and endpoint of d.rails[index].
  static std::unique_ptr<Rail> open(const Discovery& d, uint32_t index, std::string* why);
  ~Rail();
  Rail(const Rail&) = delete;
  Rail& operator=(const Rail&) = delete;

  const std::string& domain() const { return domain_; }
  const std::string& address() const { return address_; }   // fi_getname: what peers insert
  const Lib& lib() const { return lib_; }
  bool delivery_complete() const { return delivery_complete_; }

  // Address vector. FI_ADDR_NOTAVAIL (with *why) when the provider rejects the address.
  fi_addr_t insert(const std::string& address, std::string* why);
  void remove(fi_addr_t addr);

  // Registers [base, base+size). cuda_device >= 0: device memory (FI_HMEM, where offered).
  // requested_key is used when the provider does not pick keys itself.
  // remote_write false: peers may only read it (read-only regions).
  bool register_memory(void* base, uint64_t size, int cuda_device, uint64_t requested_key, bool remote_write,
                       RailMr* out, std::string* why);
  void deregister(RailMr* mr);

  // Data path: 0 posted, -FI_EAGAIN (progress, then retry), or another negative error.
  // `context` must start with a struct fi_context2 and live until its completion.
  ssize_t write(const void* buf, size_t len, void* desc, fi_addr_t dest, uint64_t raddr, uint64_t key,
                void* context);
  ssize_t read(void* buf, size_t len, void* desc, fi_addr_t src, uint64_t raddr, uint64_t key, void* context);
  // One byte back from raddr after the writes before it (fenced where the provider can): what
  // makes a write visible at the target when writes cannot ask for delivery completion.
  ssize_t flush_read(void* buf, void* desc, fi_addr_t src, uint64_t raddr, uint64_t key, void* context);

  // Two-sided messages (send/recv chunks land in bounce buffers the receiver posts).
  ssize_t send(const iovec* iov, void** desc, size_t count, fi_addr_t dest, void* context);
  ssize_t post_recv(void* buf, size_t len, void* desc, void* context);

  // Up to `max` completions into done[] (context, flags, length); 0 if none. A failed operation
  // comes back as *failed (its context) with *err = the provider's positive errno, returning
  // -FI_EAVAIL once per failure. Other negative values: the completion queue itself failed.
  // timeout_ms > 0 blocks that long for a completion (progressing the provider) unless woken.
  ssize_t poll(fi_cq_msg_entry* done, size_t max, void** failed, int* err, int timeout_ms = 0);
  void wake();

 private:
  Rail(const Lib& lib) : lib_(lib) {}
  const Lib& lib_;
  MrMode mode_;
  bool delivery_complete_ = false;
  bool fence_ = false;
  bool can_wait_ = false;
  std::string domain_, address_;
  fi_info* info_ = nullptr;   // our copy
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_fid_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_ep* ep_ = nullptr;
};

}  // namespace tether::transport::fabric
