"""`Child`: a real second process (multiprocessing "spawn" context) running `agent_main`, a small
command loop that owns its own tether.Endpoint (agent.py). The parent drives it over a Pipe; every
call is bounded by a timeout, and the process is SIGCONT'ed + SIGKILL'ed at cleanup."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import Any, Optional

import numpy as np

from .agent import Agent
from .data import assert_bytes_equal, assert_poison, poisoned, rand_bytes
from .proc import wait_stopped


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


@contextmanager
def child_endpoint(process: str, env: Optional[dict] = None, /, **endpoint: Any):
    """A Child process with an endpoint made from `endpoint` (its info kept as `.info`); closed and killed at exit."""
    c = Child(process, env)
    try:
        c.info = c.call("endpoint", **endpoint)
        yield c
    finally:
        try:
            c.call("close", timeout=10)
        except Exception:  # noqa: BLE001
            pass
        c.cleanup()


def agent_main(conn, env: dict) -> None:
    env = dict(env)
    ns = env.pop("TETHER_TEST_NETNS", None)
    if ns:  # run inside a test bed's namespace (tests/python/netns.py), before any socket exists
        import netns
        netns.enter(ns)
    os.environ.update(env)
    agent = Agent(conn)
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


def child_bytes(child: Child, name: str, *span) -> np.ndarray:
    """The bytes of the child's buffer `name` (host or GPU; `span`: offset, length), as a uint8 array."""
    return np.frombuffer(child.call("get", name, *span), np.uint8)


def write_then_read_child(ep, peer, child: Child, size: int, lo: int, ro: int, pad: int, seeds, timeout: float):
    """`size` random bytes (seeds[0]) written from local offset `lo` to offset `ro` of a poisoned child
    buffer `pad` bytes longer, then that buffer refilled (seeds[1]) and read back: every byte checked,
    the poison around the range on both sides too."""
    desc = child.call("register", "dst", size + ro + pad)
    try:
        src = rand_bytes(seeds[0], size + lo)
        peer.write(ep.register(src), desc, local_offset=lo, remote_offset=ro, length=size).wait(timeout)
        got = child_bytes(child, "dst")
        assert_bytes_equal(got[ro:ro + size], src[lo:], "child buffer, written range")
        assert_poison(got[:ro], "child buffer before the range")
        assert_poison(got[ro + size:], "child buffer after the range")

        child.call("fill", "dst", ("seed", seeds[1]))
        expected = rand_bytes(seeds[1], size + ro + pad)
        back = poisoned(size + 2 * lo)
        peer.read(ep.register(back), desc, local_offset=lo, remote_offset=ro, length=size).wait(timeout)
        assert_bytes_equal(back[lo:lo + size], expected[ro:ro + size], "read from the child")
        assert_poison(back[:lo])
        assert_poison(back[lo + size:])
    finally:
        child.call("deregister", "dst")
