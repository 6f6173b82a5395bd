/* tcp_ceiling: what the kernel's TCP alone moves over loopback with N streams, the ceiling that
 * tether's tcp transport is measured against. Two processes (a sender and a receiver), one
 * thread per stream on each side, the socket options tether's tcp lanes use (src/sys/net.cc:
 * SO_SNDBUF/SO_RCVBUF set before connect/listen, TCP_NODELAY, O_NONBLOCK with poll() when the socket
 * is full or empty, TCP_USER_TIMEOUT and keepalive), and tether's framing: each chunk is one
 * sendmsg of a 56-byte header and the payload; the receiver reads the header, then the payload
 * straight into its place. Both sides send from and receive into page-locked host memory: mlock'd
 * pages, or cudaHostAlloc (libcudart loaded with dlopen) with --cuda where a GPU is present.
 *
 * Prints GB/s (10^9 bytes per second, payload only) and CPU-seconds per GB on each side (getrusage of
 * each process over the measured window: user + system, every thread).
 *
 *   cc -O2 -pthread -o tcp_ceiling bench/tools/tcp_ceiling.c -ldl     (or the CMake target tcp_ceiling)
 *   tcp_ceiling [-n STREAMS] [-t SECONDS] [-c CHUNK] [-b BUFFER] [-s SOCKBUF] [--cuda] [--blocking] [--json]
 *
 * -n streams (default 4), -t measured seconds (default 3; 0.5 s of warm-up before), -c chunk bytes per
 * sendmsg (default 1 MiB, tether's chunk_bytes), -b page-locked buffer per side (default 256 MiB;
 * chunks cycle through it), -s SO_SNDBUF/SO_RCVBUF bytes (default 4 MiB, tether's socket_buffer; 0:
 * the kernel's), --blocking: blocking sockets instead of O_NONBLOCK + poll. Sizes take K, M, G (binary).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { kHeader = 56, kMaxStreams = 256 };  /* sizeof(tether::wire::FrameHeader) */

static int streams = 4, blocking = 0, want_cuda = 0, json = 0;
static double seconds = 3.0, warmup = 0.5;
static uint64_t chunk = 1 << 20, buffer_bytes = 256ull << 20, sockbuf = 4 << 20;
static const uint32_t lane_timeout_ms = 5000; /* tether's lane_timeout default */

static void die(const char* what) {
  fprintf(stderr, "tcp_ceiling: %s: %s\n", what, strerror(errno));
  exit(1);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

static double cpu_s(void) {
  struct rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

static uint64_t parse_size(const char* s) {
  char* end;
  double v = strtod(s, &end);
  uint64_t m = 1;
  if (*end == 'K' || *end == 'k') m = 1ull << 10;
  else if (*end == 'M' || *end == 'm') m = 1ull << 20;
  else if (*end == 'G' || *end == 'g') m = 1ull << 30;
  else if (*end) { fprintf(stderr, "tcp_ceiling: bad size '%s' (bytes, or with K, M, G)\n", s); exit(2); }
  return (uint64_t)(v * m);
}

static const char* human(uint64_t n, char* out, size_t cap) {
  if (n >= (1ull << 30) && n % (1ull << 30) == 0) snprintf(out, cap, "%llu GiB", (unsigned long long)(n >> 30));
  else if (n >= (1ull << 20) && n % (1ull << 20) == 0) snprintf(out, cap, "%llu MiB", (unsigned long long)(n >> 20));
  else if (n >= (1ull << 10) && n % (1ull << 10) == 0) snprintf(out, cap, "%llu KiB", (unsigned long long)(n >> 10));
  else snprintf(out, cap, "%llu B", (unsigned long long)n);
  return out;
}

/* ---------------------------------------------------------------- page-locked memory */

typedef int (*host_alloc_fn)(void**, size_t, unsigned);
static char pinned_how[160];

static void* alloc_pinned(uint64_t n) {
  if (want_cuda) {
    const char* names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"};
    for (size_t i = 0; i < sizeof names / sizeof *names; ++i) {
      void* lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
      if (!lib) continue;
      host_alloc_fn host_alloc = (host_alloc_fn)dlsym(lib, "cudaHostAlloc");
      void* p = NULL;
      int rc = host_alloc ? host_alloc(&p, n, 0 /* cudaHostAllocDefault */) : -1;
      if (rc == 0 && p) {
        memset(p, 0x5a, n);
        snprintf(pinned_how, sizeof pinned_how, "cudaHostAlloc (%s)", names[i]);
        return p;
      }
      snprintf(pinned_how, sizeof pinned_how, "cudaHostAlloc failed (%s: error %d), ", names[i], rc);
      break;
    }
    if (!pinned_how[0]) snprintf(pinned_how, sizeof pinned_how, "no libcudart, ");
  }
  void* p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) die("mmap");
  memset(p, 0x5a, n);
  size_t used = strlen(pinned_how);
  if (mlock(p, n) == 0)
    snprintf(pinned_how + used, sizeof pinned_how - used, "mlock");
  else
    snprintf(pinned_how + used, sizeof pinned_how - used, "NOT page-locked (mlock: %s; ulimit -l)", strerror(errno));
  return p;
}

/* ---------------------------------------------------------------- sockets, as tether sets them */

static void size_buffers(int fd) {
  if (sockbuf == 0) return;
  int b = (int)sockbuf;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
}

static void tune_lane(int fd) {  /* sys::tune_data_socket + sys::set_link_timeout */
  int one = 1;
  if (!blocking) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  unsigned int t = lane_timeout_ms;
  int idle = lane_timeout_ms / 2000 > 1 ? (int)(lane_timeout_ms / 2000) : 1, intvl = 1;
  int cnt = lane_timeout_ms / 1000 > 2 ? (int)(lane_timeout_ms / 1000) : 2;
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &t, sizeof t);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

static void wait_fd(int fd, short ev) {
  struct pollfd p = {.fd = fd, .events = ev};
  poll(&p, 1, 100);
}

/* ---------------------------------------------------------------- the streams */

struct stream {
  int fd, index;
  char* buf;
  _Atomic uint64_t bytes; /* payload bytes moved */
  char pad[64];
};

static struct stream st[kMaxStreams];
static atomic_int stop;

static uint64_t chunk_offset(uint64_t seq, int index) {
  uint64_t chunks = buffer_bytes / chunk;
  return ((seq * (uint64_t)streams + (uint64_t)index) % chunks) * chunk;
}

static uint64_t past_header(uint64_t sent) { return sent > kHeader ? sent - kHeader : 0; }

static void* send_stream(void* arg) {
  struct stream* s = arg;
  uint8_t hdr[kHeader];
  memset(hdr, 0, sizeof hdr);
  const uint64_t frame = kHeader + chunk;
  for (uint64_t seq = 0; !atomic_load_explicit(&stop, memory_order_relaxed); ++seq) {
    memcpy(hdr + 40, &seq, 8);   /* FrameHeader::offset */
    memcpy(hdr + 48, &chunk, 8); /* FrameHeader::length */
    char* payload = s->buf + chunk_offset(seq, s->index);
    uint64_t sent = 0;
    while (sent < frame) {
      struct iovec iov[2];
      int n = 0;
      if (sent < kHeader) iov[n++] = (struct iovec){hdr + sent, kHeader - sent};
      iov[n++] = (struct iovec){payload + past_header(sent), chunk - past_header(sent)};
      struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
      ssize_t k = sendmsg(s->fd, &m, MSG_NOSIGNAL | (blocking ? 0 : MSG_DONTWAIT));
      if (k < 0) {
        if (errno != EAGAIN && errno != EINTR) goto out;
        if (sent == 0 && atomic_load_explicit(&stop, memory_order_relaxed)) goto out;
        wait_fd(s->fd, POLLOUT);
        continue;
      }
      atomic_fetch_add_explicit(&s->bytes, past_header(sent + (uint64_t)k) - past_header(sent), memory_order_relaxed);
      sent += (uint64_t)k;
    }
  }
out:
  shutdown(s->fd, SHUT_WR);
  return NULL;
}

/* Reads exactly n bytes into p; 0 on success, -1 at the end of the stream. */
static int recv_full(struct stream* s, char* p, uint64_t n, int payload) {
  while (n > 0) {
    ssize_t k = recv(s->fd, p, n, blocking ? 0 : MSG_DONTWAIT);
    if (k == 0) return -1;
    if (k < 0) {
      if (errno == EAGAIN || errno == EINTR) { wait_fd(s->fd, POLLIN); continue; }
      return -1;
    }
    p += k;
    n -= (uint64_t)k;
    if (payload) atomic_fetch_add_explicit(&s->bytes, (uint64_t)k, memory_order_relaxed);
  }
  return 0;
}

static void* recv_stream(void* arg) {
  struct stream* s = arg;
  char hdr[kHeader];
  for (;;) {
    if (recv_full(s, hdr, kHeader, 0)) break;
    uint64_t seq, len;
    memcpy(&seq, hdr + 40, 8);
    memcpy(&len, hdr + 48, 8);
    if (len != chunk) { fprintf(stderr, "tcp_ceiling: stream %d: bad frame\n", s->index); exit(1); }
    if (recv_full(s, s->buf + chunk_offset(seq, s->index), len, 1)) break;
  }
  return NULL;
}

/* ---------------------------------------------------------------- the two processes */

static void full_write(int fd, const void* p, size_t n) {
  if (write(fd, p, n) != (ssize_t)n) die("pipe write");
}
static void full_read(int fd, void* p, size_t n) {
  char* c = p;
  while (n > 0) {
    ssize_t k = read(fd, c, n);
    if (k <= 0) { fprintf(stderr, "tcp_ceiling: the sender process died\n"); exit(1); }
    c += k;
    n -= (size_t)k;
  }
}

static void sender(struct sockaddr_in addr, int ctl, int res) {
  char* buf = alloc_pinned(buffer_bytes);
  pthread_t th[kMaxStreams];
  for (int i = 0; i < streams; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) die("socket");
    size_buffers(fd);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr*)&addr, sizeof addr)) die("connect");
    tune_lane(fd);
    st[i] = (struct stream){.fd = fd, .index = i, .buf = buf};
  }
  for (int i = 0; i < streams; ++i) pthread_create(&th[i], NULL, send_stream, &st[i]);
  char c;
  double cpu[2];
  full_read(ctl, &c, 1); /* 'B': the measured window starts */
  cpu[0] = cpu_s();
  full_read(ctl, &c, 1); /* 'E': it ends */
  cpu[1] = cpu_s();
  atomic_store(&stop, 1);
  double out[2] = {cpu[1] - cpu[0], 0};
  full_write(res, out, sizeof out);
  full_write(res, pinned_how, sizeof pinned_how);
  for (int i = 0; i < streams; ++i) pthread_join(th[i], NULL);
  _exit(0);
}

/* The options into the globals: -1 to go on, else the exit code. */
static int parse_args(int argc, char** argv) {
  static struct option opts[] = {{"cuda", no_argument, 0, 'C'}, {"blocking", no_argument, 0, 'K'},
                                 {"json", no_argument, 0, 'J'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  int o;
  while ((o = getopt_long(argc, argv, "n:t:c:b:s:h", opts, NULL)) != -1) {
    switch (o) {
      case 'n': streams = atoi(optarg); break;
      case 't': seconds = atof(optarg); break;
      case 'c': chunk = parse_size(optarg); break;
      case 'b': buffer_bytes = parse_size(optarg); break;
      case 's': sockbuf = parse_size(optarg); break;
      case 'C': want_cuda = 1; break;
      case 'K': blocking = 1; break;
      case 'J': json = 1; break;
      default:
        fprintf(stderr, "usage: tcp_ceiling [-n STREAMS] [-t SECONDS] [-c CHUNK] [-b BUFFER] [-s SOCKBUF] "
                        "[--cuda] [--blocking] [--json]\n");
        return o == 'h' ? 0 : 2;
    }
  }
  if (streams < 1 || streams > kMaxStreams || seconds <= 0 || chunk < 1 || buffer_bytes < chunk) {
    fprintf(stderr, "tcp_ceiling: need 1 <= STREAMS <= %d, SECONDS > 0, 1 <= CHUNK <= BUFFER\n", kMaxStreams);
    return 2;
  }
  return -1;
}

/* A listening socket on a free loopback port, its address in *addr. */
static int listen_loopback(struct sockaddr_in* addr) {
  int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  size_buffers(ls); /* accepted sockets inherit them */
  *addr = (struct sockaddr_in){.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof *addr;
  if (bind(ls, (struct sockaddr*)addr, sizeof *addr) || listen(ls, streams) ||
      getsockname(ls, (struct sockaddr*)addr, &len))
    die("listen");
  return ls;
}

/* The measured window's rate and CPU, as one line or one JSON object. */
static void report(double el, const uint64_t* b0, const uint64_t* b1, double rx_cpu, double tx_cpu,
                   const char* sender_pinned) {
  double total = 0, lo = 1e300, hi = 0, per[kMaxStreams];
  for (int i = 0; i < streams; ++i) {
    per[i] = (double)(b1[i] - b0[i]) / el / 1e9;
    total += (double)(b1[i] - b0[i]);
    lo = per[i] < lo ? per[i] : lo;
    hi = per[i] > hi ? per[i] : hi;
  }
  double gb = total / 1e9, gbps = gb / el;
  if (json) {
    printf("{\"tool\": \"tcp_ceiling\", \"streams\": %d, \"seconds\": %.3f, \"chunk_bytes\": %llu, "
           "\"buffer_bytes\": %llu, \"socket_buffer\": %llu, \"blocking\": %s, \"gbps\": %.4f, "
           "\"per_stream_gbps\": [",
           streams, el, (unsigned long long)chunk, (unsigned long long)buffer_bytes,
           (unsigned long long)sockbuf, blocking ? "true" : "false", gbps);
    for (int i = 0; i < streams; ++i) printf("%s%.4f", i ? ", " : "", per[i]);
    printf("], \"cpu_s\": {\"sender\": %.4f, \"receiver\": %.4f}, "
           "\"cpu_s_per_gb\": {\"sender\": %.5f, \"receiver\": %.5f, \"both\": %.5f}, "
           "\"pinned\": {\"sender\": \"%s\", \"receiver\": \"%s\"}}\n",
           tx_cpu, rx_cpu, tx_cpu / gb, rx_cpu / gb, (tx_cpu + rx_cpu) / gb, sender_pinned, pinned_how);
  } else {
    char c[32], b[32], k[32];
    printf("tcp_ceiling: %d stream%s over loopback, %s sends, %s sockets (buffers %s), %.1f s; %s each side, %s\n",
           streams, streams == 1 ? "" : "s", human(chunk, c, sizeof c), blocking ? "blocking" : "non-blocking",
           sockbuf ? human(sockbuf, k, sizeof k) : "kernel default", el, human(buffer_bytes, b, sizeof b),
           pinned_how);
    printf("  %.2f GB/s (per stream %.2f-%.2f)   CPU-s per GB: sender %.3f, receiver %.3f, both %.3f\n", gbps, lo,
           hi, tx_cpu / gb, rx_cpu / gb, (tx_cpu + rx_cpu) / gb);
  }
}

int main(int argc, char** argv) {
  int rc = parse_args(argc, argv);
  if (rc >= 0) return rc;
  signal(SIGPIPE, SIG_IGN);
  struct sockaddr_in addr;
  int ls = listen_loopback(&addr);
  int ctl[2], res[2];
  if (pipe(ctl) || pipe(res)) die("pipe");
  pid_t pid = fork();
  if (pid < 0) die("fork");
  if (pid == 0) {
    close(ctl[1]);
    close(res[0]);
    close(ls);
    sender(addr, ctl[0], res[1]);
  }
  close(ctl[0]);
  close(res[1]);

  char* buf = alloc_pinned(buffer_bytes);
  pthread_t th[kMaxStreams];
  for (int i = 0; i < streams; ++i) {
    int fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) die("accept");
    tune_lane(fd);
    st[i] = (struct stream){.fd = fd, .index = i, .buf = buf};
  }
  close(ls);
  for (int i = 0; i < streams; ++i) pthread_create(&th[i], NULL, recv_stream, &st[i]);

  struct timespec w = {(time_t)warmup, (long)((warmup - (time_t)warmup) * 1e9)};
  nanosleep(&w, NULL);
  uint64_t b0[kMaxStreams], b1[kMaxStreams];
  for (int i = 0; i < streams; ++i) b0[i] = atomic_load(&st[i].bytes);
  double t0 = now_s(), c0 = cpu_s();
  full_write(ctl[1], "B", 1);
  struct timespec d = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
  nanosleep(&d, NULL);
  for (int i = 0; i < streams; ++i) b1[i] = atomic_load(&st[i].bytes);
  double t1 = now_s(), c1 = cpu_s();
  full_write(ctl[1], "E", 1);
  double sender_cpu[2];
  char sender_pinned[sizeof pinned_how];
  full_read(res[0], sender_cpu, sizeof sender_cpu);
  full_read(res[0], sender_pinned, sizeof sender_pinned);
  for (int i = 0; i < streams; ++i) pthread_join(th[i], NULL);
  int status = 0;
  waitpid(pid, &status, 0);

  report(t1 - t0, b0, b1, c1 - c0, sender_cpu[0], sender_pinned);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
