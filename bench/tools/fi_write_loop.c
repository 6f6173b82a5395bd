/* The provider's own ceiling: a bare fi_write loop between two processes, nothing of tether.
 *
 *   fi_write_loop -s [-p tcp] [-a 127.0.0.1] [-P 5399] [-S bytes] [-R bytes]      # target
 *   fi_write_loop -c HOST [-p tcp] [-a 127.0.0.1] [-P 5399] [-S bytes] [-R bytes] [-w window] [-t seconds] [-d] [-B]
 *
 * The target registers a buffer and hands its endpoint address, key and base over a TCP socket,
 * then only progresses its completion queue (the tcp provider places incoming data from there).
 * The initiator keeps `window` writes of -S bytes in flight for -t seconds, walking through a -R byte
 * buffer on both sides (default -S: one cache-warm buffer; give tether's transfer size for a fair
 * ceiling against cache-cold memory), and prints one line:
 * "bytes GB/s writes". -d asks FI_DELIVERY_COMPLETE (what tether asks for). Both sides wait for
 * completions in fi_cq_sread (the provider progresses meanwhile); -B busy-polls fi_cq_read instead
 * (faster with cores to spare, slower where the two processes share few cores). Build:
 *   cc -O2 -o fi_write_loop fi_write_loop.c -lfabric
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHECK(call)                                                                     \
  do {                                                                                  \
    int rc_ = (int)(call);                                                              \
    if (rc_) { fprintf(stderr, "%s: %s (%d)\n", #call, fi_strerror(-rc_), rc_); exit(1); } \
  } while (0)

struct wire { uint64_t key, base, size; uint32_t addrlen; char addr[256]; };

static struct fi_info *info;
static struct fid_fabric *fabric;
static struct fid_domain *domain;
static struct fid_av *av;
static struct fid_cq *cq;
static struct fid_ep *ep;
static struct fid_mr *mr;
static int busy_poll = 0;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void open_fabric(const char *prov, const char *bind, int dc) {
  struct fi_info *hints = fi_allocinfo();
  hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->domain_attr->threading = FI_THREAD_SAFE;
  if (dc) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  hints->fabric_attr->prov_name = strdup(prov);
  CHECK(fi_getinfo(FI_VERSION(1, 9), bind, NULL, bind ? FI_SOURCE : 0, hints, &info));
  fi_freeinfo(hints);
  CHECK(fi_fabric(info->fabric_attr, &fabric, NULL));
  CHECK(fi_domain(fabric, info, &domain, NULL));
  struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
  CHECK(fi_av_open(domain, &av_attr, &av, NULL));
  struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_CONTEXT, .size = 1024,
                               .wait_obj = busy_poll ? FI_WAIT_NONE : FI_WAIT_UNSPEC};
  CHECK(fi_cq_open(domain, &cq_attr, &cq, NULL));
  CHECK(fi_endpoint(domain, info, &ep, NULL));
  CHECK(fi_ep_bind(ep, &av->fid, 0));
  CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
  CHECK(fi_enable(ep));
}

static void register_buffer(void *buf, size_t size, uint64_t access) {
  CHECK(fi_mr_reg(domain, buf, size, access, 0, 0x5eed, 0, &mr, NULL));
  if (info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
    CHECK(fi_mr_bind(mr, &ep->fid, 0));
    CHECK(fi_mr_enable(mr));
  }
}

static int tcp_socket(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

static void full(int fd, void *p, size_t n, int writing) {
  for (size_t done = 0; done < n;) {
    ssize_t r = writing ? write(fd, (char *)p + done, n - done) : read(fd, (char *)p + done, n - done);
    if (r <= 0) { perror("oob socket"); exit(1); }
    done += (size_t)r;
  }
}

/* Completions so far; `block`: wait (up to 100 ms) for at least one unless busy-polling. */
static int reap(int want_all, int outstanding, int block) {
  struct fi_cq_entry e[64];
  int done = 0;
  do {
    ssize_t n = (block || want_all) && !busy_poll ? fi_cq_sread(cq, e, 64, NULL, 100) : fi_cq_read(cq, e, 64);
    if (n > 0) done += (int)n;
    else if (n == -FI_EAVAIL) {
      struct fi_cq_err_entry err = {0};
      fi_cq_readerr(cq, &err, 0);
      fprintf(stderr, "completion error: %s\n", fi_strerror(err.err));
      exit(1);
    } else if (n != -FI_EAGAIN && n != -FI_ETIMEDOUT) { fprintf(stderr, "fi_cq_read: %s\n", fi_strerror((int)-n)); exit(1); }
  } while (want_all && done < outstanding);
  return done;
}

/* The target: publishes the buffer's key and address, then progresses until the initiator hangs up
   (the tcp provider moves target data only while the target reads its completion queue). */
static int serve(char *buf, size_t ring, struct sockaddr_in sa) {
  register_buffer(buf, ring, FI_REMOTE_WRITE | FI_REMOTE_READ);
  struct wire w = {.key = fi_mr_key(mr), .size = ring, .addrlen = sizeof w.addr};
  w.base = (info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)buf : 0;
  size_t len = sizeof w.addr;
  CHECK(fi_getname(&ep->fid, w.addr, &len));
  w.addrlen = (uint32_t)len;
  int lfd = tcp_socket();
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, 1)) { perror("listen"); return 1; }
  printf("ready\n");
  fflush(stdout);
  int fd = accept(lfd, NULL, NULL);
  full(fd, &w, sizeof w, 1);
  struct pollfd p = {.fd = fd, .events = POLLIN};
  for (unsigned long spin = 0;; ++spin) {
    reap(0, 0, 1);
    if ((busy_poll ? (spin & 1023) == 0 : 1) && poll(&p, 1, 0) > 0) break;
  }
  close(fd);
  close(lfd);
  return 0;
}

/* The initiator: `window` writes of `size` in flight over the target's buffer for `seconds`, then
   prints "size GB/s writes". */
static int drive(char *buf, size_t ring, size_t size, struct sockaddr_in sa, const char *host, int window, int dc,
                 double seconds) {
  register_buffer(buf, ring, FI_WRITE | FI_READ);
  void *desc = fi_mr_desc(mr);
  int fd = tcp_socket();
  inet_pton(AF_INET, host, &sa.sin_addr);
  for (int tries = 0; connect(fd, (struct sockaddr *)&sa, sizeof sa); ++tries) {
    if (tries > 200) { perror("connect"); return 1; }
    usleep(20000);
  }
  struct wire w;
  full(fd, &w, sizeof w, 0);
  if (w.size < ring) { fprintf(stderr, "target buffer is %lu bytes\n", (unsigned long)w.size); return 1; }
  fi_addr_t peer;
  if (fi_av_insert(av, w.addr, 1, &peer, 0, NULL) != 1) { fprintf(stderr, "fi_av_insert failed\n"); return 1; }
  struct fi_context2 ctx[256];
  if (window > 256) window = 256;
  const size_t slots = ring / size;
  uint64_t flags = FI_COMPLETION | (dc ? FI_DELIVERY_COMPLETE : 0);
  unsigned long writes = 0;
  int outstanding = 0;
  double t0 = now(), t1 = t0;
  while ((t1 = now()) - t0 < seconds) {
    while (outstanding < window) {
      const size_t at = (writes % slots) * size;
      struct iovec iov = {.iov_base = buf + at, .iov_len = size};
      struct fi_rma_iov rma = {.addr = w.base + at, .len = size, .key = w.key};
      struct fi_msg_rma msg = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = peer,
                               .rma_iov = &rma, .rma_iov_count = 1, .context = &ctx[writes % 256]};
      ssize_t rc = fi_writemsg(ep, &msg, flags);
      if (rc == -FI_EAGAIN) break;   /* progress, then retry */
      if (rc) { fprintf(stderr, "fi_writemsg: %s\n", fi_strerror((int)-rc)); return 1; }
      ++outstanding;
      ++writes;
    }
    outstanding -= reap(0, outstanding, outstanding >= window);
  }
  reap(1, outstanding, 1);
  t1 = now();
  printf("%lu %.3f %lu\n", (unsigned long)size, (double)size * writes / (t1 - t0) / 1e9, writes);
  close(fd);
  return 0;
}

int main(int argc, char **argv) {
  const char *prov = "tcp", *bind_addr = "127.0.0.1", *host = NULL;
  int server = 0, port = 5399, window = 16, dc = 0;
  size_t size = 1 << 20, ring = 0;
  double seconds = 3;
  for (int c; (c = getopt(argc, argv, "sc:p:a:P:S:R:w:t:dB")) != -1;) {
    switch (c) {
      case 's': server = 1; break;
      case 'c': host = optarg; break;
      case 'p': prov = optarg; break;
      case 'a': bind_addr = strcmp(optarg, "-") ? optarg : NULL; break;
      case 'P': port = atoi(optarg); break;
      case 'S': size = strtoull(optarg, NULL, 0); break;
      case 'R': ring = strtoull(optarg, NULL, 0); break;
      case 'w': window = atoi(optarg); break;
      case 't': seconds = atof(optarg); break;
      case 'd': dc = 1; break;
      case 'B': busy_poll = 1; break;
      default: fprintf(stderr, "see the comment at the top of fi_write_loop.c\n"); return 2;
    }
  }
  if (!server && !host) { fprintf(stderr, "need -s or -c HOST\n"); return 2; }
  open_fabric(prov, bind_addr, dc);
  if (ring < size) ring = size;
  ring = ring / size * size;
  char *buf = aligned_alloc(4096, (ring + 4095) / 4096 * 4096);
  memset(buf, server ? 0 : 0xab, ring);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  const int rc = server ? serve(buf, ring, sa) : drive(buf, ring, size, sa, host, window, dc, seconds);
  if (rc) return rc;
  fi_close(&mr->fid);
  fi_close(&ep->fid);
  fi_close(&cq->fid);
  fi_close(&av->fid);
  fi_close(&domain->fid);
  fi_close(&fabric->fid);
  fi_freeinfo(info);
  free(buf);
  return 0;
}
