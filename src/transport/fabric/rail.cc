#include "transport/fabric/rail.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

namespace tether::transport::fabric {

namespace {
constexpr size_t kCqSize = 4096;
}

std::unique_ptr<Rail> Rail::open(const Discovery& d, uint32_t index, std::string* why) {
  const Lib& lib = *d.lib;
  std::unique_ptr<Rail> r(new Rail(lib));
  r->mode_ = d.mr;
  r->delivery_complete_ = d.delivery_complete;
  r->fence_ = d.fence;
  r->info_ = lib.dupinfo(d.rails[index].get());
  const fi_info* info = r->info_;
  r->domain_ = info->domain_attr->name ? info->domain_attr->name : "?";
  auto fail = [&](const char* what, int rc) {
    *why = "rail " + r->domain_ + ": " + what + ": " + lib.error(rc);
    return nullptr;
  };
  if (int rc = lib.fabric(info->fabric_attr, &r->fabric_, nullptr)) return fail("fi_fabric", rc);
  if (int rc = fi_domain(r->fabric_, r->info_, &r->domain_fid_, nullptr)) return fail("fi_domain", rc);
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  if (int rc = fi_av_open(r->domain_fid_, &av_attr, &r->av_, nullptr)) return fail("fi_av_open", rc);
  // A queue that can block (progress thread sleeps in fi_cq_sread); fall back to polling.
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_MSG;
  cq_attr.size = kCqSize;
  cq_attr.wait_obj = FI_WAIT_UNSPEC;
  if (!d.busy_poll && fi_cq_open(r->domain_fid_, &cq_attr, &r->cq_, nullptr) == 0) {
    r->can_wait_ = true;
  } else {
    cq_attr.wait_obj = FI_WAIT_NONE;
    if (int rc = fi_cq_open(r->domain_fid_, &cq_attr, &r->cq_, nullptr)) return fail("fi_cq_open", rc);
  }
  if (int rc = fi_endpoint(r->domain_fid_, r->info_, &r->ep_, nullptr)) return fail("fi_endpoint", rc);
  if (int rc = fi_ep_bind(r->ep_, &r->av_->fid, 0)) return fail("fi_ep_bind(av)", rc);
  if (int rc = fi_ep_bind(r->ep_, &r->cq_->fid, FI_TRANSMIT | FI_RECV)) return fail("fi_ep_bind(cq)", rc);
  if (int rc = fi_enable(r->ep_)) return fail("fi_enable", rc);
  char name[256];
  size_t len = sizeof(name);
  if (int rc = fi_getname(&r->ep_->fid, name, &len)) return fail("fi_getname", rc);
  r->address_.assign(name, len);
  return r;
}

Rail::~Rail() {
  if (ep_) fi_close(&ep_->fid);
  if (cq_) fi_close(&cq_->fid);
  if (av_) fi_close(&av_->fid);
  if (domain_fid_) fi_close(&domain_fid_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) lib_.freeinfo(info_);
}

fi_addr_t Rail::insert(const std::string& address, std::string* why) {
  fi_addr_t out = FI_ADDR_NOTAVAIL;
  const int n = fi_av_insert(av_, address.data(), 1, &out, 0, nullptr);
  if (n != 1) {
    *why = "rail " + domain_ + ": fi_av_insert rejected the peer's address" + (n < 0 ? ": " + lib_.error(n) : "");
    return FI_ADDR_NOTAVAIL;
  }
  return out;
}

void Rail::remove(fi_addr_t addr) {
  if (addr != FI_ADDR_NOTAVAIL) fi_av_remove(av_, &addr, 1, 0);
}

bool Rail::register_memory(void* base, uint64_t size, int cuda_device, uint64_t requested_key, bool remote_write,
                           RailMr* out, std::string* why) {
  if (cuda_device >= 0 && !mode_.hmem) {
    *why = "rail " + domain_ + ": the provider does not register device memory (no FI_HMEM)";
    return false;
  }
  iovec iov{base, size};
  fi_mr_attr attr{};
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = FI_READ | FI_WRITE | FI_SEND | FI_RECV | FI_REMOTE_READ | (remote_write ? FI_REMOTE_WRITE : 0);
  // Keys are unique per domain; small-key providers get the low bits.
  attr.requested_key = mode_.key_size >= 8 ? requested_key : requested_key & ((1ull << (8 * mode_.key_size)) - 1);
  attr.iface = cuda_device >= 0 ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
  if (cuda_device >= 0) attr.device.cuda = cuda_device;
  fid_mr* mr = nullptr;
  if (int rc = fi_mr_regattr(domain_fid_, &attr, 0, &mr)) {
    *why = "rail " + domain_ + ": fi_mr_regattr: " + lib_.error(rc);
    return false;
  }
  if (mode_.endpoint) {
    int rc = fi_mr_bind(mr, &ep_->fid, 0);
    if (rc == 0) rc = fi_mr_enable(mr);
    if (rc) {
      fi_close(&mr->fid);
      *why = "rail " + domain_ + ": binding the registration to the endpoint: " + lib_.error(rc);
      return false;
    }
  }
  out->mr = mr;
  out->desc = fi_mr_desc(mr);
  out->key = fi_mr_key(mr);
  out->base = mode_.virt_addr ? reinterpret_cast<uint64_t>(base) : 0;
  return true;
}

void Rail::deregister(RailMr* mr) {
  if (mr->mr) fi_close(&mr->mr->fid);
  *mr = RailMr{};
}

namespace {

// One local buffer against one remote range, as fi_writemsg / fi_readmsg take it.
struct RmaMsg {
  iovec iov;
  void* desc;
  fi_rma_iov rma;
  fi_msg_rma msg{};
  RmaMsg(void* buf, size_t len, void* d, fi_addr_t peer, uint64_t raddr, uint64_t key, void* context)
      : iov{buf, len}, desc(d), rma{raddr, len, key} {
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = peer;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = context;
  }
  RmaMsg(const RmaMsg&) = delete;
};

}  // namespace

ssize_t Rail::write(const void* buf, size_t len, void* desc, fi_addr_t dest, uint64_t raddr, uint64_t key,
                    void* context) {
  RmaMsg m(const_cast<void*>(buf), len, desc, dest, raddr, key, context);
  // Delivery complete: the completion means the bytes are in the target's memory, so the
  // notification the core sends after the last completion cannot overtake them.
  return fi_writemsg(ep_, &m.msg, FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0));
}

ssize_t Rail::read(void* buf, size_t len, void* desc, fi_addr_t src, uint64_t raddr, uint64_t key,
                   void* context) {
  return fi_read(ep_, buf, len, desc, src, raddr, key, context);
}

ssize_t Rail::flush_read(void* buf, void* desc, fi_addr_t src, uint64_t raddr, uint64_t key, void* context) {
  RmaMsg m(buf, 1, desc, src, raddr, key, context);
  return fi_readmsg(ep_, &m.msg, FI_COMPLETION | (fence_ ? FI_FENCE : 0));
}

ssize_t Rail::send(const iovec* iov, void** desc, size_t count, fi_addr_t dest, void* context) {
  fi_msg msg{};
  msg.msg_iov = iov;
  msg.desc = desc;
  msg.iov_count = count;
  msg.addr = dest;
  msg.context = context;
  return fi_sendmsg(ep_, &msg, FI_COMPLETION | (delivery_complete_ ? FI_DELIVERY_COMPLETE : 0));
}

ssize_t Rail::post_recv(void* buf, size_t len, void* desc, void* context) {
  return fi_recv(ep_, buf, len, desc, FI_ADDR_UNSPEC, context);
}

ssize_t Rail::poll(fi_cq_msg_entry* done, size_t max, void** failed, int* err, int timeout_ms) {
  const ssize_t n = timeout_ms > 0 && can_wait_ ? fi_cq_sread(cq_, done, max, nullptr, timeout_ms)
                                                : fi_cq_read(cq_, done, max);
  if (n > 0) return n;
  if (n == -FI_EAGAIN || n == -FI_ETIMEDOUT || n == -FI_EINTR || n == 0) return 0;
  if (n == -FI_EAVAIL) {
    fi_cq_err_entry ee{};
    if (fi_cq_readerr(cq_, &ee, 0) < 0) return 0;
    *failed = ee.op_context;
    *err = ee.err ? ee.err : FI_EIO;
    return -FI_EAVAIL;
  }
  return n;
}

void Rail::wake() {
  if (can_wait_) fi_cq_signal(cq_);
}

}  // namespace tether::transport::fabric
