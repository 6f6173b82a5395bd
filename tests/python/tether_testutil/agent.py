"""The commands a child process (child.py) runs: an endpoint, regions, operations with bounded
waits, background streams, and ways to starve or slow the process. GPU memory commands: agent_gpu.py."""
from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from .agent_gpu import GpuCommands
from .data import POISON, first_mismatch, poisoned, rand_bytes, wait_until
from .proc import refuse_cma


def _status_of(transfer, timeout: float) -> tuple:
    import tether
    try:
        transfer.wait(timeout)
        return ("ok", transfer.bytes)
    except tether.TetherError as e:
        return (type(e).__name__, str(e))


class Agent(GpuCommands):
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

    def cmd_start_stream(self, op, local, remote, length, accepted=False, blocks=1):
        """Background thread: keeps `op` ("write"/"read") of `length` bytes in flight (8 at a time)
        until the process dies; with `blocks` > 1, each op is a writev/readv of that many `length`-byte
        blocks in reversed order. Returns once the first one has completed."""
        peer = self._peer(accepted)
        region = self.regions[local]
        first = threading.Event()
        self.bg_state["errors"] = []
        spans = [(region, i * length, remote, (blocks - 1 - i) * length, length) for i in range(blocks)]

        def post():
            if blocks > 1:
                return (peer.writev if op == "write" else peer.readv)(spans)
            return (peer.write if op == "write" else peer.read)(region, remote, length=length)

        def loop():
            inflight = []
            while True:
                while len(inflight) < 8:
                    inflight.append(post())
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
