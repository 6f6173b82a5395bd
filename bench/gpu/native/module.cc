// Python module tether._gpubench: GPU copy benchmarks that call the core's CUDA layer directly
// (bench/gpu/ipc_probe.py, bench/gpu/unpack_bench.py). A module of its own so that the core library
// and tether._tether carry no benchmark code.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>

#include "copy_bench.h"
#include "unpack_bench.h"

namespace nb = nanobind;

namespace {

template <typename T>
T take(tether::Result<T> r) {
  if (!r.is_ok()) throw std::runtime_error(r.status().to_string());
  return r.take();
}

}  // namespace

NB_MODULE(_gpubench, m) {
  // bench/gpu/ipc_probe.py: copy engines or the copy kernel between raw device pointers (peer or IPC-opened).
  m.def("copy_bench", [](int device, uint64_t src, uint64_t dst, uint64_t bytes, uint64_t frag_bytes, uint32_t streams,
                         uint32_t batch, uint32_t iters, bool kernel, uint64_t seed) {
    auto result = [&] {
      nb::gil_scoped_release unlocked;
      return tether::gpu::bench_copy(device, src, dst, bytes, frag_bytes, streams, batch, iters, kernel, seed);
    }();
    auto r = take(std::move(result));
    nb::dict d;
    d["gbps"] = r.gbps;
    d["us_per_op"] = r.us_per_op;
    d["submit_us"] = r.submit_us;
    d["mismatches"] = r.mismatches;
    return d;
  });
  // bench/gpu/unpack_bench.py: the shared copy kernel vs per-fragment and contiguous cuMemcpyAsync.
  m.def("unpack_bench", [](int device, uint64_t chunk_bytes, uint64_t frag_bytes, uint32_t iters, uint64_t seed) {
        auto result = [&] {
          nb::gil_scoped_release unlocked;
          return tether::gpu::bench_unpack(device, chunk_bytes, frag_bytes, iters, seed);
        }();
        auto rows = take(std::move(result));
        nb::list out;
        for (auto& r : rows) {
          nb::dict d;
          d["method"] = r.method;
          d["stream_gbps"] = r.stream_gbps;
          d["host_us"] = r.host_us;
          d["alone_gbps"] = r.alone_gbps;
          d["mismatches"] = r.mismatches;
          out.append(d);
        }
        return out;
      },
      nb::arg("device") = 0, nb::arg("chunk_bytes") = 4u << 20, nb::arg("frag_bytes") = 4096, nb::arg("iters") = 1000,
      nb::arg("seed") = 1);
}
