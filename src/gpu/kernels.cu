// GPU copy kernels, compiled to a fatbin at build time and loaded with cuModuleLoadData at run time.
// One kernel serves gather (many GPU blocks -> one staging chunk), unpack (one received chunk -> many
// destinations) and the net-plugin's scattered 4 KiB fragments: a descriptor block of (source,
// destination, length), one launch per chunk.
#include <cstdint>

struct Frag {
  unsigned long long src, dst, len;
};

// gridDim.y walks fragments, gridDim.x splits a fragment; 16-byte loads when both ends are aligned.
extern "C" __global__ void __launch_bounds__(256) tether_copy_frags(const Frag* __restrict__ frags, unsigned n) {
  for (unsigned f = blockIdx.y; f < n; f += gridDim.y) {
    const Frag fr = frags[f];
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
      for (; i + 3 * stride < nv; i += 4 * stride) {  // four loads in flight per thread
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
}
