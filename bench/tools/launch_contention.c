/* launch_contention: what a staging copy's launch costs when N threads of one process each run a lane's
 * copy loop at once. Inside `tether bench` a 1 MiB cuMemcpyAsync launch (TETHER_X_API_NS) took several
 * times what one thread alone takes (bench/gpu/launch_cost.py); this tells whether threads of one process slow each other's launches, and whether polling a flag the GPU
 * writes instead of a CUDA event changes that.
 *
 * Each thread: its own non-blocking stream, BYTES of device memory and of pinned host memory (portable,
 * mapped: a staging slot's kind). It launches a copy (device to host and back, alternating), marks its
 * end, and polls for it with naps of 8 us, as a tcp progress thread does (staging_nap_us). Two marks:
 *   event: cuEventRecord, then cuEventQuery until done          (tether's StagingRing today)
 *   flag:  cuStreamWriteValue32 of a sequence number into pinned host memory, then plain loads
 * Prints, per mark and thread count: the median and p90 us of the launch call and of the mark call, the
 * polls per copy and copies per second (all threads).
 *
 *   cc -O2 -pthread -o launch_contention bench/tools/launch_contention.c -ldl
 *   launch_contention [-t SECONDS] [-b BYTES] [-n THREADS,...]      (defaults: 1, 1 MiB, 1,2,4,8,16)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
enum { kNotReady = 600, kMaxThreads = 64, kMaxSamples = 1 << 16 };

static struct {
  CUresult (*init)(unsigned);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*primary_retain)(CUcontext*, CUdevice);
  CUresult (*set_current)(CUcontext);
  CUresult (*mem_alloc)(CUdeviceptr*, size_t);
  CUresult (*host_alloc)(void**, size_t, unsigned);
  CUresult (*host_device_ptr)(CUdeviceptr*, void*, unsigned);
  CUresult (*stream_create)(CUstream*, unsigned);
  CUresult (*event_create)(CUevent*, unsigned);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_query)(CUevent);
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*write_value32)(CUstream, CUdeviceptr, uint32_t, unsigned);
  CUresult (*stream_sync)(CUstream);
} cu;

static void check(CUresult r, const char* what) {
  if (r != 0) {
    fprintf(stderr, "%s: CUDA error %d\n", what, r);
    exit(1);
  }
}

static void* sym(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (!p) {
    fprintf(stderr, "libcuda has no %s\n", name);
    exit(1);
  }
  return p;
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

struct lane {
  CUstream stream;
  CUevent event;
  CUdeviceptr dev, flag_dev;
  uint8_t* host;
  volatile uint32_t* flag;
  float launch[kMaxSamples], mark[kMaxSamples];
  long copies, polls;
};

static CUcontext ctx;
static size_t bytes = 1 << 20;
static double seconds = 1;
static int use_flag;
static atomic_int ready, go;

static void* run(void* arg) {
  struct lane* l = arg;
  check(cu.set_current(ctx), "cuCtxSetCurrent");
  atomic_fetch_add(&ready, 1);
  while (!atomic_load(&go)) {
  }
  const struct timespec nap = {0, 8000};
  uint32_t seq = 0;
  l->copies = l->polls = 0;
  const double end = now_us() + seconds * 1e6;
  while (now_us() < end) {
    const CUdeviceptr h = (CUdeviceptr)(uintptr_t)l->host;
    const double t0 = now_us();
    check(l->copies & 1 ? cu.memcpy_async(l->dev, h, bytes, l->stream) : cu.memcpy_async(h, l->dev, bytes, l->stream),
          "cuMemcpyAsync");
    const double t1 = now_us();
    if (use_flag) {
      check(cu.write_value32(l->stream, l->flag_dev, ++seq, 0), "cuStreamWriteValue32");
    } else {
      check(cu.event_record(l->event, l->stream), "cuEventRecord");
    }
    const double t2 = now_us();
    for (;;) {
      ++l->polls;
      if (use_flag) {
        if (*l->flag == seq) break;
      } else {
        const CUresult r = cu.event_query(l->event);
        if (r == 0) break;
        if (r != kNotReady) check(r, "cuEventQuery");
      }
      nanosleep(&nap, NULL);
    }
    if (l->copies < kMaxSamples) {
      l->launch[l->copies] = (float)(t1 - t0);
      l->mark[l->copies] = (float)(t2 - t1);
    }
    ++l->copies;
  }
  return NULL;
}

static int by_value(const void* a, const void* b) {
  const float x = *(const float*)a, y = *(const float*)b;
  return (x > y) - (x < y);
}

static float pct(float* v, long n, double q) {
  qsort(v, (size_t)n, sizeof *v, by_value);
  return v[(long)(q * (double)(n - 1))];
}

int main(int argc, char** argv) {
  char counts[256] = "1,2,4,8,16";
  for (int c; (c = getopt(argc, argv, "t:b:n:")) != -1;) {
    if (c == 't') seconds = atof(optarg);
    else if (c == 'b') bytes = strtoull(optarg, NULL, 0);
    else if (c == 'n') snprintf(counts, sizeof counts, "%s", optarg);
    else return 2;
  }
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us, as tether's progress threads
  void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "no libcuda.so.1: %s\n", dlerror());
    return 1;
  }
  cu.init = sym(lib, "cuInit");
  cu.device_get = sym(lib, "cuDeviceGet");
  cu.primary_retain = sym(lib, "cuDevicePrimaryCtxRetain");
  cu.set_current = sym(lib, "cuCtxSetCurrent");
  cu.mem_alloc = sym(lib, "cuMemAlloc_v2");
  cu.host_alloc = sym(lib, "cuMemHostAlloc");
  cu.host_device_ptr = sym(lib, "cuMemHostGetDevicePointer_v2");
  cu.stream_create = sym(lib, "cuStreamCreate");
  cu.event_create = sym(lib, "cuEventCreate");
  cu.event_record = sym(lib, "cuEventRecord");
  cu.event_query = sym(lib, "cuEventQuery");
  cu.memcpy_async = sym(lib, "cuMemcpyAsync");
  cu.write_value32 = sym(lib, "cuStreamWriteValue32_v2");
  cu.stream_sync = sym(lib, "cuStreamSynchronize");
  CUdevice dev;
  check(cu.init(0), "cuInit");
  check(cu.device_get(&dev, 0), "cuDeviceGet");
  check(cu.primary_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(cu.set_current(ctx), "cuCtxSetCurrent");
  int most = 0;
  for (char* s = counts; s; s = strchr(s, ',') ? strchr(s, ',') + 1 : NULL)
    if (atoi(s) > most) most = atoi(s);
  if (most < 1 || most > kMaxThreads) return 2;
  static struct lane lanes[kMaxThreads];
  for (int i = 0; i < most; ++i) {
    struct lane* l = &lanes[i];
    void* p;
    check(cu.stream_create(&l->stream, 1), "cuStreamCreate");  // non-blocking
    check(cu.event_create(&l->event, 2), "cuEventCreate");     // disable timing
    check(cu.mem_alloc(&l->dev, bytes), "cuMemAlloc");
    check(cu.host_alloc(&p, bytes + 4096, 1 | 2), "cuMemHostAlloc");  // portable | device map
    l->host = p;
    l->flag = (volatile uint32_t*)(l->host + bytes);
    *l->flag = 0;
    check(cu.host_device_ptr(&l->flag_dev, (void*)l->flag, 0), "cuMemHostGetDevicePointer");
  }
  printf("%-6s %7s %12s %12s %10s %10s %11s %8s\n", "mark", "threads", "launch p50", "launch p90", "mark p50",
         "mark p90", "polls/copy", "copies/s");
  for (use_flag = 0; use_flag < 2; ++use_flag) {
    for (char* s = counts; *s;) {
      const int n = atoi(s);
      if (n < 1) return 2;
      pthread_t th[kMaxThreads];
      atomic_store(&ready, 0);
      atomic_store(&go, 0);
      for (int i = 0; i < n; ++i) pthread_create(&th[i], NULL, run, &lanes[i]);
      while (atomic_load(&ready) < n) {
      }
      atomic_store(&go, 1);
      for (int i = 0; i < n; ++i) pthread_join(th[i], NULL);
      static float launch[kMaxThreads * kMaxSamples / 16], mark[kMaxThreads * kMaxSamples / 16];
      long k = 0, copies = 0, polls = 0;
      for (int i = 0; i < n; ++i) {
        copies += lanes[i].copies;
        polls += lanes[i].polls;
        for (long j = 0; j < lanes[i].copies && j < kMaxSamples / 16; ++j, ++k) {
          launch[k] = lanes[i].launch[j];
          mark[k] = lanes[i].mark[j];
        }
      }
      printf("%-6s %7d %12.1f %12.1f %10.1f %10.1f %11.1f %8.0f\n", use_flag ? "flag" : "event", n,
             pct(launch, k, 0.5), pct(launch, k, 0.9), pct(mark, k, 0.5), pct(mark, k, 0.9),
             copies ? (double)polls / (double)copies : 0.0, (double)copies / seconds);
      s = strchr(s, ',');
      if (!s) break;
      ++s;
    }
  }
  return 0;
}
