"""`Child`: a real second process (multiprocessing "spawn" context) running `agent_main`, a small
command loop that owns its own tether.Endpoint (agent.py). The parent drives it over a Pipe; every
call is bounded by a timeout, and the process is SIGCONT'ed + SIGKILL'ed at cleanup."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import traceback
from typing import Any, Optional

import numpy as np

from .agent import Agent
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
