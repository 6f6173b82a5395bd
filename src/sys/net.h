// Socket plumbing shared by the handshake and the TCP transport.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "tether/status.h"

namespace tether::sys {

// buffer_bytes (0 = kernel default) sizes SO_SNDBUF/SO_RCVBUF before listen()/connect(): shrinking
// them on an established connection makes Linux drop in-window segments and stall.
Result<int> listen_tcp(const std::string& host, uint16_t port, uint32_t buffer_bytes = 0);
uint16_t local_port(int fd);
// Non-blocking connect bounded by deadline_ms (absolute, steady clock ms). bind_addr (numeric, optional)
// is the local address to leave from: the NIC a lane uses.
Result<int> connect_tcp(const std::string& host, uint16_t port, int64_t deadline_ms, uint32_t buffer_bytes = 0,
                        const std::string& bind_addr = {});
// A data socket whose sent data stays unacknowledged for timeout_ms, or whose idle link stops answering
// keepalive probes, fails with ETIMEDOUT (TCP_USER_TIMEOUT + keepalive): a dead link is noticed in
// bounded time even when no RST can arrive.
void set_link_timeout(int fd, uint32_t timeout_ms);
// Numeric local / remote address of a connected socket.
std::string local_addr(int fd);
std::string remote_addr(int fd);
bool is_loopback_host(const std::string& host);
// Exact reads/writes on a non-blocking socket, bounded by an absolute deadline.
Status write_all(int fd, const void* buf, size_t len, int64_t deadline_ms);
Status read_all(int fd, void* buf, size_t len, int64_t deadline_ms);
void tune_data_socket(int fd);  // non-blocking and TCP_NODELAY
void set_nodelay(int fd);
void close_fd(int& fd);

// "host:port" <-> parts. IPv6 literals as "[::1]:port".
Status split_host_port(std::string_view s, std::string* host, uint16_t* port);
std::string join_host_port(const std::string& host, uint16_t port);
// Same boot and same network namespace <=> equal ids: loopback reaches the other side.
std::array<uint8_t, 32> host_id();
std::string hostname();
int64_t now_ms();

}  // namespace tether::sys
