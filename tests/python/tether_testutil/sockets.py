"""Raw sockets against a listening endpoint: reading exactly, a handshake completed by hand, and a
hand-made peer that must be dropped alone."""
from __future__ import annotations

import os
import socket
import struct

from .data import assert_bytes_equal, poisoned, rand_bytes, wait_until
from .wire import (
    client_hello, client_proof, parse_server_hello, SERVER_DONE_SIZE, SERVER_HELLO_SIZE, SOCKET_DATA,
)


def recv_exact(s: socket.socket, n: int, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def recv_until_closed(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Reads until EOF (or reset). Raises socket.timeout if the peer keeps the connection open."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def raw_connect(address: str, timeout: float = 5.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def read_server_hello(s: socket.socket) -> dict:
    """A ServerHello and the transport offers that follow it: {..., "offers": {name: bytes}}."""
    h = parse_server_hello(recv_exact(s, SERVER_HELLO_SIZE))
    raw, offers = recv_exact(s, h["offers_length"]), {}
    while raw:
        n = raw[0]
        name, (length,) = raw[1:1 + n].decode(), struct.unpack_from("<I", raw, 1 + n)
        offers[name] = raw[5 + n:5 + n + length]
        raw = raw[5 + n + length:]
    h["offers"] = offers
    return h


def raw_peer(address: str, lanes: int = 1) -> list:
    """Completes a real (token-less) tcp handshake by hand: [control socket, `lanes` data sockets]."""
    session_hello = bytearray(client_hello(lanes=lanes))
    socks = []
    for lane in range(lanes + 1):
        h = bytearray(session_hello)
        h[6] = 1 if lane == 0 else SOCKET_DATA
        struct.pack_into("<I", h, 48, 0 if lane == 0 else lane - 1)
        h[24:40] = os.urandom(16)  # fresh nonce
        s = raw_connect(address)
        s.sendall(bytes(h))
        assert read_server_hello(s)["status"] == 0
        s.sendall(client_proof(b"tcp" if lane == 0 else b"", lanes))
        assert recv_exact(s, SERVER_DONE_SIZE)[0] == 0
        socks.append(s)
    return socks


def assert_dropped(server, socks, what: str, left=()) -> None:
    """The server closes both sockets of the hand-made peer that sent `what`; its peers are then `left` (names)."""
    for s in socks:
        try:
            recv_until_closed(s, timeout=5)
        except socket.timeout:
            raise AssertionError(f"server kept the peer that sent {what}") from None
    assert wait_until(lambda: [p.name for p in server.peers()] == list(left), 5), server.peers()


def assert_drops_only_that_peer(endpoints, send, what: str, seed: int, timeout: float = 20.0) -> None:
    """A hand-made peer (tcp, one lane) beside a legitimate one does `send([control, data])`: the server
    must close both of that peer's sockets, keep serving the other, and still land its write byte for byte."""
    server = endpoints(name="server")
    good_client = endpoints(name="good")
    good = good_client.connect(server.metadata(), timeout=5)
    socks = raw_peer(server.address, lanes=1)
    try:
        assert wait_until(lambda: len(server.peers()) == 2, 5)
        send(socks)
        assert_dropped(server, socks, what, left=["good"])
    finally:
        for s in socks:
            s.close()
    dst = poisoned(1000)
    src = rand_bytes(seed, 1000)
    good.write(good_client.register(src), server.register(dst).descriptor()).wait(timeout)
    assert_bytes_equal(dst, src)
