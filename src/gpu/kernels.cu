// GPU copy kernels, compiled to a fatbin at build time and loaded with cuModuleLoadData at run time.
// One kernel body serves gather (many GPU blocks -> one staging chunk), unpack (one received chunk ->
// many destinations), the net-plugin's scattered 4 KiB fragments and ipc batches over peer pointers:
// a list of (source, destination, length) triples, one launch per chunk.
//
// The triples travel inside the launch, as a __grid_constant__ kernel parameter (up to 32 KiB since
// CUDA 12.1 on Volta and later): no descriptor upload precedes the copy and no thread copies the list.
// The launch ships the whole parameter block whatever the count, so there are several sizes, and a
// compact form (32-bit offsets from two bases, 12 bytes a fragment instead of 24) for the common case
// of fragments within 4 GiB windows (a bounce buffer and a destination region). Where the host's cost
// per launch matters more (ipc's one-sided batches, several launched back to back by one thread),
// tether_copy_table reads the triples from mapped memory instead.
#include <cstdint>

struct Frag {
  unsigned long long src, dst, len;
};

template <unsigned K>
struct Frags {
  unsigned long long n;
  Frag f[K];
};

// gridDim.x splits a fragment, gridDim.y walks fragments; 16-byte loads when both ends are aligned,
// four in flight per thread where the fragment is long enough.
__device__ __forceinline__ void copy_frag(const Frag& fr) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const char* __restrict__ s = reinterpret_cast<const char*>(fr.src);
  char* __restrict__ d = reinterpret_cast<char*>(fr.dst);
  unsigned long long done = 0;
  if (((fr.src | fr.dst) & 15) == 0) {
    const unsigned long long nv = fr.len / 16;
    const uint4* __restrict__ sv = reinterpret_cast<const uint4*>(s);
    uint4* __restrict__ dv = reinterpret_cast<uint4*>(d);
    unsigned long long i = first;
    for (; i + 3 * stride < nv; i += 4 * stride) {
      const uint4 a = sv[i], b = sv[i + stride], c = sv[i + 2 * stride], e = sv[i + 3 * stride];
      dv[i] = a;
      dv[i + stride] = b;
      dv[i + 2 * stride] = c;
      dv[i + 3 * stride] = e;
    }
    for (; i < nv; i += stride) dv[i] = sv[i];
    done = nv * 16;
  }
  for (unsigned long long i = done + first; i < fr.len; i += stride) d[i] = s[i];
}

template <unsigned K>
__device__ __forceinline__ void copy_all(const Frags<K>& p) {
  for (unsigned long long f = blockIdx.y; f < p.n; f += gridDim.y) copy_frag(p.f[f]);
}

struct Piece {
  unsigned src, dst, len;  // offsets from the bases, length
};

template <unsigned K>
struct Pieces {
  unsigned long long src_base, dst_base, n;
  Piece p[K];
};

template <unsigned K>
__device__ __forceinline__ void copy_all(const Pieces<K>& p) {
  for (unsigned long long f = blockIdx.y; f < p.n; f += gridDim.y) {
    const Piece q = p.p[f];
    copy_frag(Frag{p.src_base + q.src, p.dst_base + q.dst, q.len});
  }
}

// Triples read where the GPU can reach them (mapped pinned host memory the launcher wrote): the launch
// carries a pointer and a count, not the triples, so it costs the host what a small launch costs and
// nothing is converted first; each block fetches its triple once (over PCIe from host memory).
extern "C" __global__ void __launch_bounds__(256) tether_copy_table(const Frag* __restrict__ table, unsigned long long n) {
  __shared__ Frag e;
  for (unsigned long long f = blockIdx.y; f < n; f += gridDim.y) {
    if (threadIdx.x == 0) e = table[f];
    __syncthreads();
    const Frag fr = e;
    __syncthreads();  // every thread has read `e` before thread 0 overwrites it
    copy_frag(fr);
  }
}

// Names and sizes must match copy_kernel.cc.
#define TETHER_WIDE(K) \
  extern "C" __global__ void __launch_bounds__(256) tether_copy_frags_##K(const __grid_constant__ Frags<K> p) { copy_all(p); }
#define TETHER_COMPACT(K) \
  extern "C" __global__ void __launch_bounds__(256) tether_copy_pieces_##K(const __grid_constant__ Pieces<K> p) { copy_all(p); }
TETHER_WIDE(96)
TETHER_WIDE(1344)
TETHER_COMPACT(128)
TETHER_COMPACT(1024)
TETHER_COMPACT(1344)
