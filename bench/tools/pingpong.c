/* Plain TCP ping-pong over loopback: the round-trip floor tether's small-write latency is compared to.
 * Two processes, blocking sockets, TCP_NODELAY, 8-byte messages. Prints p50 and p99 in microseconds. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}
static int full(int fd, char* p, int n, int rd) {
  while (n > 0) {
    ssize_t k = rd ? recv(fd, p, n, 0) : send(fd, p, n, 0);
    if (k <= 0) return -1;
    p += k; n -= k;
  }
  return 0;
}

int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 20000, size = argc > 2 ? atoi(argv[2]) : 8, one = 1;
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (bind(ls, (struct sockaddr*)&a, sizeof a) || listen(ls, 1) || getsockname(ls, (struct sockaddr*)&a, &len)) return 1;
  char buf[65536];
  if (size > (int)sizeof buf) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    int c = accept(ls, NULL, NULL);
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    while (full(c, buf, size, 1) == 0 && full(c, buf, size, 0) == 0) {}
    _exit(0);
  }
  int s = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(s, (struct sockaddr*)&a, sizeof a)) return 1;
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  double* lat = malloc(sizeof(double) * iters);
  memset(buf, 7, size);
  for (int i = 0; i < 1000; ++i) { full(s, buf, size, 0); full(s, buf, size, 1); }
  for (int i = 0; i < iters; ++i) {
    double t0 = now_us();
    if (full(s, buf, size, 0) || full(s, buf, size, 1)) return 1;
    lat[i] = now_us() - t0;
  }
  close(s);
  waitpid(pid, NULL, 0);
  qsort(lat, iters, sizeof(double), cmp);
  printf("%.2f %.2f\n", lat[iters / 2], lat[(int)(iters * 0.99)]);
  return 0;
}
