"""Shared helpers for the tether Python tests.

* random / poison buffers and byte-exact comparison with a useful failure message;
* `Child`: a real second process (multiprocessing "spawn" context) running `agent_main`, a small
  command loop that owns its own tether.Endpoint. The parent drives it over a Pipe; every call is
  bounded by a timeout, and the process is SIGCONT'ed + SIGKILL'ed at cleanup.
* raw-socket helpers to craft handshake messages (wire.h layouts).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any, Optional

import numpy as np

POISON = 0xA5
KiB = 1 << 10
MiB = 1 << 20

# Layouts from src/core/wire.h.
WIRE_MAGIC = 0x52485454            # "TTHR", little-endian u32
WIRE_VERSION = 8                   # wire::kVersion
CLIENT_HELLO_SIZE = 169
SERVER_HELLO_SIZE = 188  # then offers_length bytes of transport offers (control sockets)
CLIENT_PROOF_SIZE = 56
SERVER_DONE_SIZE = 8
HELLO_VERSION_MISMATCH = 1
HELLO_AUTH_FAILED = 2
HELLO_BAD_REQUEST = 3
HELLO_NOT_SAME_HOST = 5  # the connector chose a same-host transport and did not prove it shares the host
SOCKET_CONTROL = 1
SOCKET_DATA = 2

# Descriptor layout (64 bytes): magic u32, version u8, kind u8, reserved u16, endpoint id 16 B,
# region_id u32 @24, device i32 @28, offset u64 @32, length u64 @40, key u64 @48, reserved u64 @56.
DESC_SIZE = 64
DESC_KIND = 5  # 0 host memory, 1 GPU
DESC_REGION_ID = 24
DESC_OFFSET = 32
DESC_LENGTH = 40
DESC_KEY = 48
DESCRIPTOR = struct.Struct("<4sBBH16sIiQQQQ")  # src/core/region.cc, EncodedDescriptor


def descriptor(endpoint: bytes, region_id: int, length: int, key: int, kind: int = 0, device: int = -1,
               offset: int = 0) -> bytes:
    """A descriptor (no transport extensions) as a peer that owns the region would send it."""
    return DESCRIPTOR.pack(b"TTRD", 1, kind, 0, endpoint, region_id, device, offset, length, key, 0)


# --------------------------------------------------------------------------- transports

def transport_unusable(name: str, **options) -> str:
    """'' when an endpoint made with `options` offers transport `name`, else why it does not."""
    import tether
    try:
        ep = tether.Endpoint(**options)
    except tether.Unavailable as e:  # asked for by name (transport=) and unusable: creation says why
        return str(e)
    with ep:
        return ep.transports().get(name, f"this build has no {name} transport")


def descriptor_extension(desc: bytes, name: bytes) -> tuple[int, bytes]:
    """(offset in desc, bytes) of a transport's extension after the descriptor's 64 fixed bytes:
    each is u8 name length, name, u32 body length, body."""
    at = DESC_SIZE
    while at < len(desc):
        n = desc[at]
        (length,) = struct.unpack_from("<I", desc, at + 1 + n)
        body = at + 5 + n
        if desc[at + 1:at + 1 + n] == name:
            return body, bytes(desc[body:body + length])
        at = body + length
    raise AssertionError(f"descriptor has no {name.decode()} extension")


# --------------------------------------------------------------------------- GPU test modules

class GpuEnv:
    """What a GPU test module needs: torch, tether's GPU count and kernel status, and `device(kind)`
    mapping "host" / "gpu0" / "gpu1" to None or a GPU index (skipping where that GPU is missing).

    Tests written for two GPUs run on one too: `pairs()` maps "gpu1" to GPU 0 there (two processes
    sharing one GPU: CUDA IPC on one device, staging both ways through one PCIe link) and `other` is
    the second GPU's index (0 when there is one). Only what needs two devices asks `device("gpu1")`."""

    def __init__(self, torch, ngpu: int, kernels: bool, kernels_why: str):
        self.torch, self.ngpu, self.kernels, self.kernels_why = torch, ngpu, kernels, kernels_why
        self.other = 1 if ngpu > 1 else 0

    def kind(self, kind: str) -> str:
        """ "gpu1" is GPU 0 on a one-GPU machine."""
        return "gpu0" if kind == "gpu1" and self.ngpu < 2 else kind

    def pairs(self, pairs: list) -> list:
        """(local kind, remote kind) pairings written for two GPUs, on the GPUs here; pairings that
        become one (gpu0-gpu1 and gpu0-gpu0 on one GPU) run once. Test ids: "-".join(pair)."""
        out: list = []
        for p in pairs:
            q = tuple(self.kind(k) for k in p)
            if q not in out:
                out.append(q)
        return out

    def device(self, kind: str) -> Optional[int]:
        import pytest
        d = None if kind == "host" else int(kind[-1])
        if d is not None and d >= self.ngpu:
            pytest.skip(f"needs GPU {d}; {self.ngpu} visible")
        return d


def gpu_env(what: str) -> GpuEnv:
    """Call at import of a GPU test module: skips the whole module, saying why, where CUDA or torch
    with a GPU is missing (CPU machines, CI)."""
    import pytest
    import tether
    try:
        import torch
        have_torch = torch.cuda.is_available()
    except ImportError:  # CPU CI
        torch, have_torch = None, False
    cuda, why, ngpu, kernels, kwhy = tether._tether.gpu_status()
    if not (cuda and have_torch):
        pytest.skip(f"{what} need CUDA and torch with a GPU (tether: {why or 'ok'}; torch cuda: {have_torch})",
                    allow_module_level=True)
    return GpuEnv(torch, ngpu, kernels, kwhy)


# --------------------------------------------------------------------------- data



class LocalMemory:
    """This process's side of a two-process GPU test: endpoint `ep` and named regions in host memory
    or on a GPU; `device(kind)` maps "host" / "gpu0" / "gpu1" to a GPU index, or None for host."""

    def __init__(self, ep, device):
        self.ep, self.device, self.mem = ep, device, {}

    def region(self, name, kind, size, seed=None):
        buf = rand_bytes(seed, size) if seed is not None else poisoned(size)
        d = self.device(kind)
        if d is None:
            obj = buf
        else:
            import torch
            obj = torch.from_numpy(buf).to(f"cuda:{d}")
            torch.cuda.synchronize(d)
        self.mem[name] = obj
        return self.ep.register(obj)

    def get(self, name):
        obj = self.mem[name]
        return obj if isinstance(obj, np.ndarray) else obj.cpu().numpy()


def build_testnet_plugin() -> str:
    """Path of the testnet NCCL net plugin (tests/netplugin, TCPX-like over loopback), built on first
    use; TETHER_TEST_NET_PLUGIN=path names another build."""
    import shutil
    import subprocess
    from pathlib import Path

    import pytest
    if os.environ.get("TETHER_TEST_NET_PLUGIN"):
        return os.environ["TETHER_TEST_NET_PLUGIN"]
    if shutil.which("cmake") is None:
        pytest.skip("cmake not installed: the testnet plugin cannot be built")
    root = Path(__file__).resolve().parents[2]
    build = root / "build" / "testnet"
    build.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", str(root), *gen, "-DTETHER_BUILD_PYTHON=OFF", "-DTETHER_BUILD_TEST_PLUGIN=ON",
                    "-DCMAKE_BUILD_TYPE=Release"], cwd=build, check=True, capture_output=True)
    subprocess.run(["cmake", "--build", ".", "--target", "tether_testnet"], cwd=build, check=True, capture_output=True)
    return str(build / "libtether_testnet.so")


def rand_bytes(seed: int, n: int) -> np.ndarray:
    """Deterministic random bytes (both processes can regenerate the same data from a seed)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def poisoned(n: int, value: int = POISON) -> np.ndarray:
    return np.full(n, value, dtype=np.uint8)


def first_mismatch(a: np.ndarray, b: np.ndarray) -> Optional[int]:
    a = np.asarray(a, dtype=np.uint8).reshape(-1)
    b = np.asarray(b, dtype=np.uint8).reshape(-1)
    if a.size != b.size:
        return min(a.size, b.size)
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else None


def assert_bytes_equal(actual, expected, what: str = "buffer") -> None:
    """Compares every byte; reports the first differing offset and how many differ."""
    actual = np.asarray(actual, dtype=np.uint8).reshape(-1)
    expected = np.asarray(expected, dtype=np.uint8).reshape(-1)
    assert actual.size == expected.size, f"{what}: size {actual.size} != expected {expected.size}"
    diff = np.flatnonzero(actual != expected)
    if diff.size:
        i = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.size} of {actual.size} bytes differ; first at offset {i}: "
            f"got {actual[i:i + 8].tolist()} expected {expected[i:i + 8].tolist()}")


def assert_poison(buf, what: str = "buffer", value: int = POISON) -> None:
    buf = np.asarray(buf, dtype=np.uint8).reshape(-1)
    bad = np.flatnonzero(buf != value)
    if bad.size:
        raise AssertionError(f"{what}: {bad.size} bytes were modified; first at offset {int(bad[0])}")


def set_u64(desc: bytes, at: int, value: int) -> bytes:
    b = bytearray(desc)
    struct.pack_into("<Q", b, at, value)
    return bytes(b)


def set_u32(desc: bytes, at: int, value: int) -> bytes:
    b = bytearray(desc)
    struct.pack_into("<I", b, at, value)
    return bytes(b)


def get_u64(desc: bytes, at: int) -> int:
    return struct.unpack_from("<Q", desc, at)[0]


def wait_error(transfer, timeout: float = 10.0) -> BaseException:
    """Waits for a transfer that must fail; returns its exception (fails the test if it succeeds)."""
    try:
        transfer.wait(timeout)
    except Exception as e:  # noqa: BLE001
        import tether
        if isinstance(e, tether.TransferTimeout):
            raise AssertionError(f"transfer still running after {timeout} s") from e
        return e
    raise AssertionError(f"transfer unexpectedly succeeded: {transfer!r}")


def outcome(transfer, timeout: float = 10.0) -> str:
    """'ok' or the exception class name; 'TIMEOUT' if still running after `timeout`."""
    import tether
    try:
        transfer.wait(timeout)
        return "ok"
    except tether.TransferTimeout:
        return "TIMEOUT"
    except tether.TetherError as e:
        return type(e).__name__


def wait_until(pred, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def fd_count(pid: str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


# --------------------------------------------------------------------------- raw sockets


def client_hello(version: int = WIRE_VERSION, kind: int = SOCKET_CONTROL, lanes: int = 1, lane: int = 0,
                 has_token: int = 0, magic: int = WIRE_MAGIC, name: bytes = b"raw", host_id: bytes = bytes(32),
                 transports: int = 0, max_notify: int = 1 << 20) -> bytes:
    """A ClientHello (169 bytes): magic u32, version u16, kind u8, has_token u8, endpoint id 16,
    nonce 16, session u64, lane u32, lanes u32, peer timeout ms u32, host id 32, name 64, chunk bytes u64,
    transports u8 (bits: tcp 1, ipc 2, fabric 4, netplugin 8; 0 = any), max notification u32.
    `host_id`: the listener's (host_id_of(its metadata)) to pose as a same-host peer."""
    msg = struct.pack("<IHBB16s16sQIII32s64sQBI", magic, version, kind, has_token, os.urandom(16),
                      os.urandom(16), int.from_bytes(os.urandom(8), "little"), lane, lanes, 10000, host_id,
                      name.ljust(64, b"\0")[:64], 0, transports, max_notify)
    assert len(msg) == CLIENT_HELLO_SIZE
    return msg


def host_id_of(metadata: bytes) -> bytes:
    """The host id inside an endpoint's metadata (src/core/endpoint.cc, MetadataHeader)."""
    return metadata[24:56]


def parse_server_hello(b: bytes) -> dict:
    magic, version, status, has_token = struct.unpack_from("<IHBB", b, 0)
    return {"magic": magic, "version": version, "status": status, "has_token": has_token,
            "name": b[108:172].split(b"\0")[0].decode(errors="replace"),
            "offers_length": struct.unpack_from("<I", b, 172)[0]}


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


def server_hello(host_id: bytes, offers: dict, version: int = WIRE_VERSION, name: bytes = b"fake",
                 endpoint_id: Optional[bytes] = None) -> bytes:
    """A ServerHello (188 bytes) and its transport offers, as a (possibly hostile) listener sends them:
    magic u32, version u16, status u8, has_token u8, endpoint id 16, nonce 16, proof 32, peer timeout
    ms u32, host id 32, name 64, offers length u32, chunk bytes u64, max notification u32; then per
    offer: name length u8, name, length u32, bytes."""
    raw = b"".join(bytes([len(k)]) + k.encode() + struct.pack("<I", len(v)) + v for k, v in offers.items())
    msg = struct.pack("<IHBB16s16s32sI32s64sIQI", WIRE_MAGIC, version, 0, 0, endpoint_id or os.urandom(16), os.urandom(16),
                      bytes(32), 10000, host_id, name.ljust(64, b"\0")[:64], len(raw), 0, 1 << 20)
    assert len(msg) == SERVER_HELLO_SIZE
    return msg + raw


def parse_client_hello(b: bytes) -> dict:
    """The fields of a ClientHello a test listener needs: session and host id."""
    session, = struct.unpack_from("<Q", b, 40)
    return {"magic": struct.unpack_from("<I", b, 0)[0], "session": session, "host_id": b[60:92]}


def client_proof(transport: bytes = b"tcp", lanes: int = 1, proof: bytes = bytes(32), offer: bytes = b"") -> bytes:
    """A ClientProof (56 bytes): HMAC 32, chosen transport 16 (control sockets; empty for data
    sockets), lanes u32, offer length u32, then the connector's offer for that transport."""
    return struct.pack("<32s16sII", proof, transport.ljust(16, b"\0"), lanes, len(offer)) + offer


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
        for s in socks:
            try:
                recv_until_closed(s, timeout=5)
            except socket.timeout:
                raise AssertionError(f"server kept the peer that sent {what}") from None
        assert wait_until(lambda: [p.name for p in server.peers()] == ["good"], 5), server.peers()
    finally:
        for s in socks:
            s.close()
    dst = poisoned(1000)
    src = rand_bytes(seed, 1000)
    good.write(good_client.register(src), server.register(dst).descriptor()).wait(timeout)
    assert_bytes_equal(dst, src)


FRAME = struct.Struct("<BBHIIIQQQQQ")  # wire::FrameHeader: type, status, flags, slot, gen, region_id, key,
                                       # desc_offset, desc_length, offset, length
FRAGMENT = struct.Struct("<IIQQQQQ")   # wire::Fragment: region_id, reserved, key, desc_offset, desc_length, offset, length
KWRITE, KACK, KREAD_RESP, KWRITE_BATCH, KREAD_BATCH = 1, 2, 4, 6, 7  # wire::FrameType


def fragment(desc: bytes, offset: int, length: int, key_xor: int = 0) -> bytes:
    """A wire::Fragment for `length` bytes at absolute `offset` of the region `desc` describes."""
    region = struct.unpack_from("<I", desc, DESC_REGION_ID)[0]
    return FRAGMENT.pack(region, 0, get_u64(desc, DESC_KEY) ^ key_xor, get_u64(desc, DESC_OFFSET),
                         get_u64(desc, DESC_LENGTH), offset, length)


def frame(kind: int, slot: int, desc: bytes = b"", offset: int = 0, length: int = 0, region_id: Optional[int] = None) -> bytes:
    """A wire::FrameHeader from an initiator (gen 1): a kWrite's fields from `desc`, or `region_id` as given
    (a batch's fragment count)."""
    if desc:
        rid = struct.unpack_from("<I", desc, DESC_REGION_ID)[0] if region_id is None else region_id
        return FRAME.pack(kind, 0, 0, slot, 1, rid, get_u64(desc, DESC_KEY), get_u64(desc, DESC_OFFSET),
                          get_u64(desc, DESC_LENGTH), offset, length)
    return FRAME.pack(kind, 0, 0, slot, 1, region_id or 0, 0, 0, 0, offset, length)


KPULL = 8  # wire::FrameType::kPull


def pull(token: int, desc: bytes, offset: int, length: int, key_xor: int = 0, region_id: Optional[int] = None,
         flags: int = 0, gen: int = 0) -> bytes:
    """A kPull frame (for a data socket): the recv token in `slot`, the range as a kReadReq names it."""
    rid = struct.unpack_from("<I", desc, DESC_REGION_ID)[0] if region_id is None else region_id
    return FRAME.pack(KPULL, 0, flags, token, gen, rid, get_u64(desc, DESC_KEY) ^ key_xor, get_u64(desc, DESC_OFFSET),
                      get_u64(desc, DESC_LENGTH), offset, length)


# --------------------------------------------------------------------------- child process


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until every thread of `pid` is stopped (SIGSTOP is delivered to each thread as it next leaves the
    kernel: one busy in a system call can still answer a chunk or two right after kill() returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = [open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                      for t in os.listdir(f"/proc/{pid}/task")]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return  # gone, or a thread exited while we looked: nothing left to wait for
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} not stopped {timeout} s after SIGSTOP")


class ChildError(AssertionError):
    pass


class Child:
    """A second process running `agent_main`; `call(cmd, ...)` runs a command there and returns
    its result (exceptions inside the child come back as ChildError with the child's traceback)."""

    _ctx = mp.get_context("spawn")

    def __init__(self, name: str = "child", env: Optional[dict] = None):
        self.parent_conn, child_conn = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=agent_main, args=(child_conn, env or {}), name=name, daemon=True)
        self.proc.start()
        child_conn.close()
        self._busy = False
        self.call("ping", timeout=30)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, cmd: str, *args: Any, **kw: Any) -> None:
        """Starts a command without waiting; collect it with result()."""
        assert not self._busy, "a command is already running in the child"
        self.parent_conn.send((cmd, args, kw))
        self._busy = True

    def result(self, timeout: float = 30.0) -> Any:
        if not self.parent_conn.poll(timeout):
            raise ChildError(f"child {self.proc.name} (pid {self.pid}) did not answer within {timeout} s")
        try:
            ok, value = self.parent_conn.recv()
        except EOFError as e:
            raise ChildError(f"child {self.proc.name} died (exit code {self.proc.exitcode})") from e
        self._busy = False
        if not ok:
            raise ChildError(f"child command failed:\n{value}")
        return value

    def call(self, cmd: str, *args: Any, timeout: float = 30.0, **kw: Any) -> Any:
        self.start(cmd, *args, **kw)
        return self.result(timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                return
            if sig == signal.SIGSTOP:
                wait_stopped(self.pid)

    def cleanup(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.kill(signal.SIGKILL)
        self.proc.join(10)
        self.parent_conn.close()


def refuse_cma(dumpable: bool) -> None:
    """Drops CAP_SYS_PTRACE from this process and optionally makes it non-dumpable (prctl)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    hdr, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(hdr), data) == 0, os.strerror(ctypes.get_errno())
    cap_sys_ptrace = 19
    data[0].effective &= ~(1 << cap_sys_ptrace)
    data[0].permitted &= ~(1 << cap_sys_ptrace)
    assert libc.capset(ctypes.byref(hdr), data) == 0, os.strerror(ctypes.get_errno())
    if not dumpable:
        assert libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE


def _status_of(transfer, timeout: float) -> tuple:
    import tether
    try:
        transfer.wait(timeout)
        return ("ok", transfer.bytes)
    except tether.TetherError as e:
        return (type(e).__name__, str(e))


class _Agent:
    """Runs inside the child process. Every cmd_* method is a command."""

    def __init__(self, conn):
        import tether
        self.tether = tether
        self.conn = conn
        self.ep = None
        self.peer = None
        self.buffers: dict[str, np.ndarray] = {}
        self.gpu: dict[str, Any] = {}  # name -> torch tensor (GPU regions)
        self.regions: dict[str, Any] = {}
        self.background: list[threading.Thread] = []
        self.bg_state: dict[str, Any] = {}

    # -- setup
    def cmd_ping(self):
        return os.getpid()

    def cmd_endpoint(self, **kw):
        self.ep = self.tether.Endpoint(**kw)
        return {"metadata": self.ep.metadata(), "address": self.ep.address, "name": self.ep.name}

    def cmd_register(self, name, size, fill=("poison", POISON), readonly=None, as_bytes=False, device=None):
        kind, arg = fill
        buf = rand_bytes(arg, size) if kind == "seed" else poisoned(size, arg)
        self.gpu.pop(name, None)  # a name reused for another kind of memory: get/fill must see the new one
        self.buffers.pop(name, None)
        if device is not None:  # a torch tensor on GPU `device`
            import torch
            self.gpu[name] = torch.from_numpy(buf).to(f"cuda:{device}")
            torch.cuda.synchronize(device)
            self.regions[name] = self.ep.register(self.gpu[name], readonly=readonly)
            return self.regions[name].descriptor()
        obj = bytes(buf.tobytes()) if as_bytes else buf
        self.buffers[name] = buf if not as_bytes else np.frombuffer(obj, dtype=np.uint8)
        self.regions[name] = self.ep.register(obj, readonly=readonly)
        return self.regions[name].descriptor()

    def cmd_register_slow(self, name, size):
        """Host memory whose pages fault to a userfaultfd (tests/python/userfault.py) that the test
        process serves (no page is present until then). Returns (descriptor, uffd number, address)."""
        from userfault import SlowMemory
        m = SlowMemory(size)
        self.buffers[name] = m.array
        self.regions[name] = self.ep.register(m.array)
        self.bg_state.setdefault("slow", []).append(m)  # kept until exit
        return self.regions[name].descriptor(), m.fd, m.addr

    def cmd_register_vmm(self, name, size, device, pieces=3, fill=("poison", POISON)):
        """GPU memory from CUDA's VMM API as KV-cache pools make it: `pieces` physical allocations
        (cuMemCreate, shareable as POSIX fds) mapped back to back into one reserved range, seen by torch
        through __cuda_array_interface__ (get/fill work as for other GPU buffers). Kept until exit."""
        import ctypes as C
        import torch
        kind, arg = fill
        buf = rand_bytes(arg, size) if kind == "seed" else poisoned(size, arg)
        torch.cuda.set_device(device)
        torch.zeros(1, device=f"cuda:{device}")  # the primary context, current on this thread
        cu = C.CDLL("libcuda.so.1")

        def ok(r, what):
            assert r == 0, f"{what}: CUresult {r}"

        class Prop(C.Structure):  # CUmemAllocationProp
            _fields_ = [("type", C.c_int), ("handle_types", C.c_int), ("loc_type", C.c_int), ("loc_id", C.c_int),
                        ("win32", C.c_void_p), ("compression", C.c_ubyte), ("rdma", C.c_ubyte), ("usage", C.c_ushort),
                        ("reserved", C.c_ubyte * 4)]

        class Access(C.Structure):  # CUmemAccessDesc
            _fields_ = [("loc_type", C.c_int), ("loc_id", C.c_int), ("flags", C.c_int)]

        prop = Prop(1, 1, 1, device)  # pinned, POSIX fd shareable, on GPU `device`
        gran = C.c_size_t()
        ok(cu.cuMemGetAllocationGranularity(C.byref(gran), C.byref(prop), 0), "cuMemGetAllocationGranularity")
        piece = -(-(-(-size // pieces)) // gran.value) * gran.value
        va = C.c_uint64()
        ok(cu.cuMemAddressReserve(C.byref(va), C.c_size_t(piece * pieces), C.c_size_t(0), C.c_uint64(0),
                                  C.c_ulonglong(0)), "cuMemAddressReserve")
        for i in range(pieces):
            h = C.c_ulonglong()
            ok(cu.cuMemCreate(C.byref(h), C.c_size_t(piece), C.byref(prop), C.c_ulonglong(0)), "cuMemCreate")
            ok(cu.cuMemMap(C.c_uint64(va.value + i * piece), C.c_size_t(piece), C.c_size_t(0), h, C.c_ulonglong(0)),
               "cuMemMap")
            ok(cu.cuMemRelease(h), "cuMemRelease")  # the mapping keeps it
        ok(cu.cuMemSetAccess(C.c_uint64(va.value), C.c_size_t(piece * pieces), C.byref(Access(1, device, 3)),
                             C.c_size_t(1)), "cuMemSetAccess")

        class Raw:
            __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (va.value, False), "version": 3}

        t = torch.as_tensor(Raw(), device=f"cuda:{device}")
        t.copy_(torch.from_numpy(buf))
        torch.cuda.synchronize(device)
        self.gpu.pop(name, None)
        self.buffers.pop(name, None)
        self.gpu[name] = t
        self.regions[name] = self.ep.register(t)
        return self.regions[name].descriptor()

    def cmd_fill_gpu(self, device):
        """Takes GPU `device`'s memory with cuMemAlloc until none is left (held until free_gpu): what a
        serving engine that reserved the GPU leaves. Returns (bytes taken, bytes still free)."""
        import ctypes as C
        import torch
        torch.cuda.set_device(device)
        torch.zeros(1, device=f"cuda:{device}")  # the primary context, current on this thread
        cu = C.CDLL("libcuda.so.1")
        self.bg_state.setdefault("filler", [])
        taken, step = 0, 1 << 30
        while step >= 64 * 1024:
            p = C.c_uint64()
            if cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(step)) == 0:
                self.bg_state["filler"].append(p.value)
                taken += step
            else:
                step //= 2
        free, total = C.c_size_t(), C.c_size_t()
        assert cu.cuMemGetInfo_v2(C.byref(free), C.byref(total)) == 0
        return taken, free.value

    def cmd_free_gpu(self):
        import ctypes as C
        cu = C.CDLL("libcuda.so.1")
        for p in self.bg_state.pop("filler", []):
            assert cu.cuMemFree_v2(C.c_uint64(p)) == 0

    def cmd_register_head(self, name, of, size):
        """Registers the first `size` bytes of GPU buffer `of` as a second region `name`: the same base,
        another size (for VMM memory, another span)."""
        self.gpu[name] = self.gpu[of][:size]
        self.regions[name] = self.ep.register(self.gpu[name])
        return self.regions[name].descriptor()

    def cmd_legacy_ipc_capable(self, name):
        """Whether GPU buffer `name` can be named by a legacy CUDA IPC handle (False: VMM memory)."""
        import ctypes
        v = ctypes.c_uint32(0)
        r = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute(ctypes.byref(v), 10, ctypes.c_uint64(self.gpu[name].data_ptr()))
        assert r == 0, f"cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE): CUresult {r}"
        return bool(v.value)

    def cmd_descriptor(self, name, offset=0, length=None):
        return self.regions[name].descriptor(offset, length)

    def cmd_deregister(self, name):
        self.ep.deregister(self.regions.pop(name))

    def cmd_get(self, name, offset=0, length=None):
        if name in self.gpu:
            g = self.gpu[name]
            end = g.numel() if length is None else offset + length
            return g[offset:end].cpu().numpy().tobytes()
        b = self.buffers[name]
        end = b.size if length is None else offset + length
        return b[offset:end].tobytes()

    def cmd_fill(self, name, fill):
        kind, arg = fill
        if name in self.gpu:
            import torch
            g = self.gpu[name]
            buf = rand_bytes(arg, g.numel()) if kind == "seed" else poisoned(g.numel(), arg)
            g.copy_(torch.from_numpy(buf))
            torch.cuda.synchronize(g.device)
            return
        b = self.buffers[name]
        b[:] = rand_bytes(arg, b.size) if kind == "seed" else arg

    def cmd_connect(self, target, timeout=10.0):
        self.peer = self.ep.connect(target, timeout=timeout)
        return self.peer.name

    def _peer(self, accepted):
        """Our own connected peer, or (accepted=True) the newest connected peer in ep.peers()."""
        if not accepted:
            return self.peer
        live = lambda: [p for p in self.ep.peers() if p.connected and p != self.peer]  # noqa: E731
        assert wait_until(lambda: len(live()) > 0, 5.0), "no accepted peer"
        return max(live(), key=lambda p: p.id)

    # -- operations (bounded waits; status tuples instead of exceptions)
    def cmd_write(self, local, remote, local_offset=0, remote_offset=0, length=None, notify=None,
                  accepted=False, timeout=20.0):
        t = self._peer(accepted).write(self.regions[local], remote, local_offset=local_offset,
                                       remote_offset=remote_offset, length=length, notify=notify)
        return _status_of(t, timeout)

    def cmd_writev(self, entries, remote, accepted=False, timeout=20.0):
        """One vectored write of (local name, local offset, remote offset, length) entries into `remote`."""
        t = self._peer(accepted).writev([(self.regions[n], lo, remote, ro, ln) for n, lo, ro, ln in entries])
        return _status_of(t, timeout)

    def cmd_read(self, local, remote, local_offset=0, remote_offset=0, length=None, accepted=False,
                 timeout=20.0):
        t = self._peer(accepted).read(self.regions[local], remote, local_offset=local_offset,
                                      remote_offset=remote_offset, length=length)
        return _status_of(t, timeout)

    def cmd_send(self, local, offset=0, length=None, tag=0, accepted=False, timeout=20.0):
        t = self._peer(accepted).send(self.regions[local], offset=offset, length=length, tag=tag)
        return _status_of(t, timeout)

    def cmd_recv(self, local, offset=0, length=None, tag=0, accepted=False, timeout=20.0):
        t = self._peer(accepted).recv(self.regions[local], offset=offset, length=length, tag=tag)
        st = _status_of(t, timeout)
        n = t.bytes if st[0] == "ok" else 0
        return st + (self.cmd_get(local, offset, n),)

    def cmd_notify(self, data, accepted=False, timeout=10.0):
        return _status_of(self._peer(accepted).notify(data), timeout)

    def cmd_notifications(self, count=1, timeout=10.0):
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            out += self.ep.notifications(timeout=max(0.001, deadline - time.monotonic()))
        return [tuple(n) for n in out]

    def cmd_check_on_notify(self, name, seed, offset, nbytes, timeout=20.0):
        """Waits for one notification; the moment it arrives, checks that the data it announces
        ([offset, +nbytes) == rand_bytes(seed, nbytes)) is already complete in `name`."""
        expected = rand_bytes(seed, nbytes)
        deadline = time.monotonic() + timeout
        notes = []
        while not notes and time.monotonic() < deadline:
            notes = self.ep.notifications(timeout=max(0.001, deadline - time.monotonic()))
        if not notes:
            return {"notes": [], "mismatch": None, "timed_out": True}
        if name in self.gpu:  # what was there when the note arrived
            snapshot = self.gpu[name][offset:offset + nbytes].cpu().numpy()
        else:
            snapshot = self.buffers[name][offset:offset + nbytes].copy()
        return {"notes": [tuple(n) for n in notes], "mismatch": first_mismatch(snapshot, expected),
                "timed_out": False}

    def cmd_drain_notifications(self):
        """Takes every notification waiting; returns (length, first 8 bytes) of each, not the data."""
        return [(len(n.data), n.data[:8]) for n in self.ep.notifications()]

    def cmd_stream_errors(self):
        """Errors the background stream (cmd_start_stream) met, and how many of its ops completed."""
        return list(self.bg_state.get("errors", [])), self.bg_state.get("completed", 0)

    def cmd_peers(self):
        return [(p.id, p.name, p.connected, p.error) for p in self.ep.peers()]

    def cmd_start_stream(self, op, local, remote, length, accepted=False):
        """Background thread: keeps `op` ("write"/"read") of `length` bytes in flight (8 at a time)
        until the process dies. Returns once the first one has completed."""
        peer = self._peer(accepted)
        region = self.regions[local]
        first = threading.Event()
        self.bg_state["errors"] = []

        def loop():
            inflight = []
            while True:
                while len(inflight) < 8:
                    f = peer.write if op == "write" else peer.read
                    inflight.append(f(region, remote, length=length))
                t = inflight.pop(0)
                try:
                    t.wait(30)
                except self.tether.TetherError as e:  # noqa: BLE001
                    self.bg_state["errors"].append(repr(e))
                    first.set()
                    return
                self.bg_state["completed"] = self.bg_state.get("completed", 0) + 1
                first.set()

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        self.background.append(th)
        return first.wait(20)

    def cmd_post(self, op, local, remote, count, length=None, accepted=False):
        """Posts `count` operations and returns at once (they stay in flight, nobody waits)."""
        peer = self._peer(accepted)
        f = peer.write if op == "write" else peer.read
        self.bg_state.setdefault("posted", []).extend(
            f(self.regions[local], remote, length=length) for _ in range(count))
        return len(self.bg_state["posted"])

    def cmd_wait_posted(self, timeout=30.0):
        """Waits for every operation cmd_post started; their (status, detail) tuples, and elapsed s."""
        t0 = time.monotonic()
        out = [_status_of(t, max(0.001, timeout - (time.monotonic() - t0))) for t in self.bg_state.pop("posted", [])]
        return out, time.monotonic() - t0

    def cmd_post_sends(self, local, count, length=None, tag=0):
        """Posts `count` sends of `local` (they stay in flight; collect with cmd_wait_posted)."""
        self.bg_state.setdefault("posted", []).extend(
            self.peer.send(self.regions[local], length=length, tag=tag) for _ in range(count))

    def cmd_post_recvs(self, local, count, length, accepted=True, tag=0):
        """Posts `count` recvs into consecutive `length`-byte slices of `local`."""
        peer = self._peer(accepted)
        self.bg_state.setdefault("posted", []).extend(
            peer.recv(self.regions[local], offset=i * length, length=length, tag=tag) for i in range(count))

    def cmd_stats(self):
        return self.ep.stats()

    def cmd_thread_cpus(self):
        """Cpus_allowed_list of every thread of this process."""
        out = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status") as f:
                out += [line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list")]
        return out

    def cmd_transport(self, accepted=False):
        return self._peer(accepted).transport

    def cmd_refuse_cma(self, dumpable: bool):
        """Makes cross-memory attach between this process and its peers fail the way containers
        do: drop CAP_SYS_PTRACE (root may attach to anything with it) and, unless `dumpable`,
        become non-dumpable (then no process without CAP_SYS_PTRACE may attach to us)."""
        refuse_cma(dumpable)
        return True

    def cmd_setrlimit_nofile(self, soft):
        """Lowers this process's open-files limit (the soft one; the hard one stays)."""
        import resource
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return soft

    def cmd_hold_fds(self, leave=0):
        """Opens /dev/null until the open-files limit is reached (then closes `leave` of them again):
        the application itself has used up the descriptors. Returns how many it holds."""
        held = self.bg_state.setdefault("fds", [])
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        for _ in range(min(leave, len(held))):
            os.close(held.pop())
        return len(held)

    def cmd_release_fds(self):
        for fd in self.bg_state.pop("fds", []):
            os.close(fd)

    def cmd_stderr_to(self, path):
        """Sends this process's stderr (fd 2: where tether logs) to a file."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)
        os.close(fd)

    def cmd_close(self):
        if self.ep is not None:
            self.ep.close()

    def cmd_exit(self):
        self.cmd_close()
        return True


def agent_main(conn, env: dict) -> None:
    env = dict(env)
    ns = env.pop("TETHER_TEST_NETNS", None)
    if ns:  # run inside a test bed's namespace (tests/python/netns.py), before any socket exists
        import netns
        netns.enter(ns)
    os.environ.update(env)
    agent = _Agent(conn)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        cmd, args, kw = msg
        try:
            value = getattr(agent, "cmd_" + cmd)(*args, **kw)
            conn.send((True, value))
        except BaseException:  # noqa: BLE001
            conn.send((False, traceback.format_exc()))
            continue
        if cmd == "exit":
            break
    conn.close()
    sys.stdout.flush()
