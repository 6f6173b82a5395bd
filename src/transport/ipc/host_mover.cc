#include "transport/ipc/host_mover.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace tether::transport::ipc {

namespace {

// process_vm_readv/writev may copy less than asked (a fault part way): loop, and treat no
// progress as the error it is.
template <bool kWrite>
int cma_copy(pid_t pid, uint8_t* local, uint64_t remote, uint64_t len) {
  while (len > 0) {
    iovec l{local, len};
    iovec r{reinterpret_cast<void*>(remote), len};
    ssize_t n = kWrite ? ::process_vm_writev(pid, &l, 1, &r, 1, 0) : ::process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    local += n;
    remote += uint64_t(n);
    len -= uint64_t(n);
  }
  return 0;
}

}  // namespace

int CmaMover::pull(uint64_t remote, uint8_t* dst, uint64_t len) { return cma_copy<false>(pid_, dst, remote, len); }

int CmaMover::push(const uint8_t* src, uint64_t remote, uint64_t len) {
  return cma_copy<true>(pid_, const_cast<uint8_t*>(src), remote, len);
}

int CmaMover::pull_many(const iovec* local, const iovec* remote, uint32_t n, uint64_t total) {
  const ssize_t got = ::process_vm_readv(pid_, local, n, remote, n, 0);
  if (got >= 0 && uint64_t(got) == total) return 0;
  if (got < 0 && errno != EINTR && errno != EFAULT) return errno;
  for (uint32_t i = 0; i < n; ++i)  // cut short: piece by piece, which says where it fails
    if (int e = pull(reinterpret_cast<uint64_t>(remote[i].iov_base), static_cast<uint8_t*>(local[i].iov_base), local[i].iov_len))
      return e;
  return 0;
}

int CmaMover::probe(uint64_t addr, uint64_t expect) {
  if (pid_ <= 0) return ESRCH;  // not visible from our pid namespace
  uint64_t got = 0;
  if (int e = pull(addr, reinterpret_cast<uint8_t*>(&got), sizeof got)) return e;
  if (got != expect) return EFAULT;
  return push(reinterpret_cast<const uint8_t*>(&got), addr, sizeof got);
}

BounceArea::~BounceArea() {
  if (base_) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
}

int BounceArea::create(uint64_t bytes) {
  fd_ = ::memfd_create("tether-ipc", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd_ < 0) return errno;
  if (::ftruncate(fd_, off_t(bytes)) != 0) return errno;
  if (::fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) return errno;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) return errno;
  base_ = static_cast<uint8_t*>(p);
  size_ = bytes;
  return 0;
}

int BounceArea::map(int fd) {
  fd_ = fd;
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return errno;
  if (!(seals & F_SEAL_SHRINK)) return EPERM;  // could be truncated under us: a SIGBUS later
  struct stat st{};
  if (::fstat(fd, &st) != 0) return errno;
  if (st.st_size <= 0) return EINVAL;
  void* p = ::mmap(nullptr, uint64_t(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return errno;
  base_ = static_cast<uint8_t*>(p);
  size_ = uint64_t(st.st_size);
  return 0;
}

int InlineMover::pull(uint64_t remote, uint8_t* dst, uint64_t len) {
  if (remote > len_ || len > len_ - remote) return EPROTO;
  std::memcpy(dst, bytes_ + remote, len);
  return 0;
}

int ShmMover::pull(uint64_t remote, uint8_t* dst, uint64_t len) {
  if (remote > area_.size() || len > area_.size() - remote) return ERANGE;
  std::memcpy(dst, area_.base() + remote, len);
  return 0;
}

int ShmMover::push(const uint8_t* src, uint64_t remote, uint64_t len) {
  if (remote > area_.size() || len > area_.size() - remote) return ERANGE;
  std::memcpy(area_.base() + remote, src, len);
  return 0;
}

}  // namespace tether::transport::ipc
