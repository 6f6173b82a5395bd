// Movers: how a chunk's bytes cross between the two processes of an ipc peer. The initiator says
// where its local bytes are (Where + addr in every request frame); the target validates the
// request against its own registry first, then moves the bytes with the mover for that place.
// Host memory has two: cross-memory attach (process_vm_readv: the target reads the initiator's
// writes and sends, the initiator reads what it asked to read out of the target's region) and a
// shared-memory bounce area (the initiator stages through it). Where attach is refused in one
// direction, that direction's bytes go through the bounce area. GPU memory is moved by CUDA
// (cuda_mover.h, Where::kCuda).
#pragma once
#include <sys/types.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstdint>

namespace tether::transport::ipc {

enum class Where : uint8_t {
  kNone = 0,  // answers
  kCma = 1,   // addr: a virtual address in the initiator (a read's answer: in the target; its request: 0)
  kShm = 2,   // addr: a byte offset in the initiator's bounce area
  kCuda = 3,  // addr: a byte offset in the GPU allocation the frame's CudaRef names (cuda_mover.h)
  kInline = 4,  // a small write's bytes follow the frame in its message; addr: 0
};

constexpr uint64_t kInlineMax = 8 << 10;  // up to here two memcpys beat one process_vm_readv

class Mover {
 public:
  virtual ~Mover() = default;
  // `remote` is the other process's addr for this mover. 0 on success, else an errno.
  virtual int pull(uint64_t remote, uint8_t* dst, uint64_t len) = 0;        // the other process -> dst
  // src -> initiator. Only into the initiator's bounce area for now: a push into its own memory
  // could land after it gave up on the chunk and reused that memory (see ARCHITECTURE.md).
  virtual int push(const uint8_t* src, uint64_t remote, uint64_t len) = 0;
};

// Cross-memory attach into process `pid` (as the kernel named it, SO_PEERCRED).
class CmaMover final : public Mover {
 public:
  explicit CmaMover(pid_t pid) : pid_(pid) {}
  int pull(uint64_t remote, uint8_t* dst, uint64_t len) override;
  int push(const uint8_t* src, uint64_t remote, uint64_t len) override;
  // `n` (at most IOV_MAX) pieces of `total` bytes in one system call where the kernel copies them all.
  int pull_many(const iovec* local, const iovec* remote, uint32_t n, uint64_t total);
  // Reads 8 bytes at `addr` in the other process, checks them against `expect` and writes them
  // back: 0 when both work, else the errno (EPERM: ptrace rules, a non-dumpable peer, seccomp...).
  int probe(uint64_t addr, uint64_t expect);

 private:
  pid_t pid_;
};

// The bytes carried in the request message itself (Where::kInline): the lane's receive buffer.
class InlineMover final : public Mover {
 public:
  void set(const uint8_t* bytes, uint64_t len) { bytes_ = bytes; len_ = len; }
  int pull(uint64_t remote, uint8_t* dst, uint64_t len) override;
  int push(const uint8_t*, uint64_t, uint64_t) override { return EPROTO; }  // reads never come inline

 private:
  const uint8_t* bytes_ = nullptr;
  uint64_t len_ = 0;
};

// A sealed memfd mapped shared: this side's bounce slots, or the other side's mapped here.
class BounceArea {
 public:
  BounceArea() = default;
  BounceArea(const BounceArea&) = delete;
  BounceArea& operator=(const BounceArea&) = delete;
  ~BounceArea();
  // Creates one of `bytes` (pages are allocated only when touched), sealed against resizing.
  int create(uint64_t bytes);
  // Maps one received from the other side; refuses one that could shrink under us (SIGBUS).
  int map(int fd);
  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
};

// The other side's bounce area, mapped here: offsets are bounds-checked against its size.
class ShmMover final : public Mover {
 public:
  explicit ShmMover(const BounceArea& theirs) : area_(theirs) {}
  int pull(uint64_t remote, uint8_t* dst, uint64_t len) override;
  int push(const uint8_t* src, uint64_t remote, uint64_t len) override;

 private:
  const BounceArea& area_;
};

}  // namespace tether::transport::ipc
