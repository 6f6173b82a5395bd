"""A NIXL agent in a child process, driven by the tests through a pipe (tests/python/test_nixl*.py).

Everything here is NIXL's own Python API (nixl._api), called the way vLLM's NixlConnector calls it;
the backend under test (TETHER, or UCX beside it) is a parameter. The child's PYTHONPATH picks the
NIXL version. Buffers are numpy arrays (DRAM) or torch tensors (VRAM), filled with seeded random
bytes or poison, so every byte can be checked where it lands.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any, Optional

import numpy as np

POISON = 0xA5


def rand_bytes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class _Side:
    """Runs in the child: each cmd_* is a command."""

    def __init__(self):
        from nixl._api import nixl_agent, nixl_agent_config
        self.nixl_agent, self.nixl_agent_config = nixl_agent, nixl_agent_config
        self.agent = None
        self.bufs: dict[str, Any] = {}      # name -> numpy array or torch tensor
        self.regs: dict[str, Any] = {}      # name -> registered descriptor list
        self.dlists: dict[str, Any] = {}    # key -> prepped dlist handle
        self.xfers: dict[str, Any] = {}     # key -> xfer handle
        self.notes: dict[str, list] = {}

    # -- agent
    def cmd_create(self, name: str, backend: str, params: Optional[dict] = None, capture_telemetry: bool = False):
        import nixl
        self.agent = self.nixl_agent(name, self.nixl_agent_config(backends=[], capture_telemetry=capture_telemetry))
        self.agent.create_backend(backend, params or {})
        self.backend = backend
        return {"pid": os.getpid(), "version": getattr(nixl, "__version__", ""),
                "plugins": self.agent.get_plugin_list()}

    def cmd_metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def cmd_add_remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def cmd_remove_remote(self, agent: str):
        self.agent.remove_remote_agent(agent)

    def cmd_check_remote(self, agent: str) -> bool:
        return self.agent.check_remote_metadata(agent)

    def cmd_make_connection(self, agent: str):
        self.agent.make_connection(agent)

    # -- memory
    def cmd_alloc(self, name: str, size: int, seed: Optional[int] = None, device: Optional[str] = None) -> int:
        host = rand_bytes(seed, size) if seed is not None else np.full(size, POISON, dtype=np.uint8)
        if device:
            import torch
            t = torch.from_numpy(host).to(device)
            torch.cuda.synchronize()
            self.bufs[name] = t
            return t.data_ptr()
        self.bufs[name] = host
        return host.ctypes.data

    def _mem(self, name):
        b = self.bufs[name]
        return ("DRAM", b.ctypes.data, b.nbytes, 0) if isinstance(b, np.ndarray) else \
               ("VRAM", b.data_ptr(), b.numel(), b.device.index)

    def cmd_register(self, names: list):
        for name in names:
            mem, addr, n, dev = self._mem(name)
            self.regs[name] = self.agent.register_memory([(addr, n, dev, "")], mem)

    def cmd_deregister(self, name: str):
        self.agent.deregister_memory(self.regs.pop(name))

    def cmd_addr(self, name: str) -> tuple:
        return self._mem(name)

    def cmd_get(self, name: str) -> bytes:
        b = self.bufs[name]
        return b.tobytes() if isinstance(b, np.ndarray) else b.cpu().numpy().tobytes()

    def cmd_fill(self, name: str, seed: Optional[int] = None):
        b = self.bufs[name]
        n = b.nbytes if isinstance(b, np.ndarray) else b.numel()
        data = rand_bytes(seed, n) if seed is not None else np.full(n, POISON, dtype=np.uint8)
        if isinstance(b, np.ndarray):
            b[:] = data
        else:
            import torch
            b.copy_(torch.from_numpy(data))
            torch.cuda.synchronize()

    # -- transfers
    def cmd_prep(self, key: str, agent: str, rows: np.ndarray, mem: str = "DRAM"):
        """rows: Nx3 (addr, len, dev) or Nx5 (addr, len, dev, stride, count), uint64."""
        self.dlists[key] = self.agent.prep_xfer_dlist(agent, rows, mem)

    def cmd_xfer(self, key: str, op: str, local: str, lidx, remote: str, ridx, notif: bytes = b"") -> None:
        self.xfers[key] = self.agent.make_prepped_xfer(op, self.dlists[local], list(map(int, lidx)),
                                                       self.dlists[remote], list(map(int, ridx)), notif_msg=notif)

    def cmd_post(self, key: str, notif: Optional[bytes] = None) -> str:
        h = self.xfers[key]
        return self.agent.transfer(h) if notif is None else self.agent.transfer(h, notif)

    def cmd_state(self, key: str) -> str:
        return self.agent.check_xfer_state(self.xfers[key])

    def cmd_wait(self, key: str, timeout: float = 30.0) -> tuple:
        """Polls check_xfer_state (the progress NIXL needs) until it leaves PROC: (state, seconds)."""
        t0 = time.monotonic()
        while True:
            try:
                s = self.agent.check_xfer_state(self.xfers[key])
            except Exception as e:  # noqa: BLE001  (NIXL raises on some errors)
                return ("ERR:" + type(e).__name__, time.monotonic() - t0)
            if s != "PROC" or time.monotonic() - t0 > timeout:
                return (s, time.monotonic() - t0)

    def cmd_run(self, key: str, notif: Optional[bytes] = None, timeout: float = 30.0) -> tuple:
        s = self.cmd_post(key, notif)
        return self.cmd_wait(key, timeout) if s == "PROC" else (s, 0.0)

    def cmd_telemetry(self, key: str) -> dict:
        t = self.agent.get_xfer_telemetry(self.xfers[key])
        return {"bytes": t.totalBytes, "descs": t.descCount}

    def cmd_release(self, key: str) -> float:
        t0 = time.monotonic()
        self.agent.release_xfer_handle(self.xfers.pop(key))
        return time.monotonic() - t0

    def cmd_release_dlist(self, key: str):
        self.agent.release_dlist_handle(self.dlists.pop(key))

    def cmd_churn(self, metadata: bytes, remote: tuple, src: str, first: int, count: int, block: int) -> dict:
        """`count` rounds of add_remote_agent / one WRITE of block i of `src` to block i of `remote`
        (addr, len, dev) / remove_remote_agent, i from `first`, as an engine adding and dropping peers
        does: this process's (fds, threads, RSS) before them, and the seconds they took."""
        mem, addr, size, dev = self._mem(src)
        raddr, _, rdev = remote
        n = size // block
        rows = np.zeros((n, 3), dtype=np.uint64)
        rows[:, 0] = addr + np.arange(n, dtype=np.uint64) * block
        rows[:, 1] = block
        rows[:, 2] = dev
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem)
        before, t0 = _usage(), time.monotonic()
        for i in range(first, first + count):
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            far = self.agent.prep_xfer_dlist(name, np.array([[raddr + i * block, block, rdev]], dtype=np.uint64), "DRAM")
            h = self.agent.make_prepped_xfer("WRITE", local, [i], far, [0])
            state = self.agent.transfer(h)
            while state == "PROC":
                state = self.agent.check_xfer_state(h)
            if state != "DONE":
                raise AssertionError(f"round {i}: {state}")
            self.agent.release_xfer_handle(h)
            self.agent.release_dlist_handle(far)
            self.agent.remove_remote_agent(name)
        took = time.monotonic() - t0
        self.agent.release_dlist_handle(local)
        return {"before": before, "seconds": took}

    # -- notifications
    def cmd_send_notif(self, agent: str, msg: bytes):
        self.agent.send_notif(agent, notif_msg=msg)

    def cmd_notifs(self, count: int = 1, timeout: float = 10.0) -> dict:
        """Polls get_new_notifs until `count` messages came (or timeout): {agent: [msg, ...]}."""
        out: dict[str, list] = {}
        deadline = time.monotonic() + timeout
        while sum(map(len, out.values())) < count and time.monotonic() < deadline:
            for k, v in self.agent.get_new_notifs().items():
                out.setdefault(k, []).extend(v)
            time.sleep(0.0005)
        return out

    def cmd_on_notif_check(self, name: str, seed: int, timeout: float = 20.0) -> tuple:
        """The moment a notification arrives, compares buffer `name` with the bytes it must hold."""
        want = rand_bytes(seed, self.bufs[name].nbytes if isinstance(self.bufs[name], np.ndarray)
                          else self.bufs[name].numel()).tobytes()
        got = self.cmd_notifs(1, timeout)
        return got, self.cmd_get(name) == want

    def cmd_on_notif_poison(self, name: str, timeout: float = 20.0) -> dict:
        """The moment a notification arrives, overwrites buffer `name` with poison (a READ's source may
        be reused once its notification came)."""
        got = self.cmd_notifs(1, timeout)
        self.cmd_fill(name)
        return got

    def cmd_usage(self) -> tuple:
        return _usage()

    def cmd_stop_self(self):
        os.kill(os.getpid(), signal.SIGSTOP)

    def cmd_exit_now(self, code: int = 0):
        """Ends the process the way a program ends (interpreter exit) with its agent, registrations
        and transfers still alive: the exit path under test."""
        import sys
        sys.exit(code)


def _usage() -> tuple:
    """(open fds, threads, RSS bytes) of this process."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), rss


def _main(conn, env: dict) -> None:
    os.environ.update(env)
    side = _Side()
    while True:
        try:
            cmd, args, kw = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, getattr(side, "cmd_" + cmd)(*args, **kw)))
        except SystemExit:
            raise
        except BaseException:  # noqa: BLE001
            conn.send((False, traceback.format_exc()))


class AgentProcess:
    """A NIXL agent in its own process. `call(cmd, ...)` runs cmd_<cmd> there."""

    _ctx = mp.get_context("spawn")

    def __init__(self, nixl_path: Optional[str] = None, env: Optional[dict] = None):
        self.parent, child = self._ctx.Pipe()
        env = dict(env or {})
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        old = os.environ.get("PYTHONPATH")
        if nixl_path:  # the child imports this NIXL before any other
            os.environ["PYTHONPATH"] = nixl_path + (os.pathsep + old if old else "")
        try:
            self.proc = self._ctx.Process(target=_main, args=(child, env), daemon=True)
            self.proc.start()
        finally:
            if nixl_path:
                if old is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = old
        child.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, cmd: str, *args, **kw) -> None:
        self.parent.send((cmd, args, kw))

    def result(self, timeout: float = 60.0):
        if not self.parent.poll(timeout):
            raise AssertionError(f"agent process {self.pid} did not answer within {timeout} s")
        try:
            ok, value = self.parent.recv()
        except EOFError as e:
            raise AssertionError(f"agent process {self.pid} died (exit code {self.proc.exitcode})") from e
        if not ok:
            raise AgentError(value)
        return value

    def call(self, cmd: str, *args, timeout: float = 60.0, **kw):
        self.start(cmd, *args, **kw)
        return self.result(timeout)

    def kill(self, sig=signal.SIGKILL) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.proc.is_alive():
            self.kill(signal.SIGCONT)
            self.kill(signal.SIGKILL)
        self.proc.join(10)
        self.parent.close()


class AgentError(AssertionError):
    """A command raised inside the agent process (the text is its traceback)."""
