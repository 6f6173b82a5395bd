"""A prefill and a decode engine (engine.py) as two processes of the example's venv, and the calls to them."""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class EngineError(RuntimeError):
    """An engine process died, did not start, answered an error or did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One engine.py process: JSON commands on stdin, JSON answers on stdout, its log in a file."""

    def __init__(self, role, python, model, backend, env, log_dir: Path, n=1):
        self.role = role
        self.log_path = log_dir / (f"{role}.log" if n == 1 else f"{role}-{n}.log")
        self.log = open(self.log_path, "w")
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        cmd = [str(python), str(HERE / "engine.py"), "--model", str(model), "--backend", backend,
               "--engine-id", f"{role}-{os.getpid()}-{n}", "--kv-role", kv_role]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                  env=env, text=True, start_new_session=True)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.q.put(json.loads(line))
        self.q.put(None)

    def tail(self, n=25):
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def recv(self, timeout):
        try:
            r = self.q.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"{self.role} engine did not answer in {timeout:.0f} s; log {self.log_path}:\n"
                              f"{self.tail()}") from None
        if r is None:
            raise EngineError(f"{self.role} engine exited (code {self.p.wait()}); log {self.log_path}:\n"
                              f"{self.tail()}")
        if not r.get("ok"):
            raise EngineError(f"{self.role} engine: {r.get('error')}")
        return r

    def call(self, cmd, timeout=180.0):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.recv(timeout)["results"]

    def signal(self, sig):
        os.kill(self.p.pid, sig)

    def close(self):
        if self.p.poll() is None:
            try:
                os.kill(self.p.pid, signal.SIGCONT)
                self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.p.stdin.flush()
                self.p.wait(timeout=20)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()
        self.log.close()


def engine_env(python, pythonpath, transport, peer_timeout_s, threads):
    """The environment both engines run under: the engine core in the process, few threads, a small KV
    cache, each its own NIXL side-channel port, and tether's transport and peer timeout."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(pythonpath),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # engine core in this process: steps are ours to drive
        "VLLM_CPU_KVCACHE_SPACE": "1",           # GiB of KV cache per engine
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
        "TETHER_HOST": "127.0.0.1",
        "TETHER_PEER_TIMEOUT_MS": str(int(peer_timeout_s * 1000)),
        "TQDM_DISABLE": "1",
    })
    if transport:
        env["TETHER_TRANSPORT"] = transport
    env.pop("TETHER_NIXL_ALT", None)
    return env


class Pair:
    """Prefill and decode engines, both started at once; `close()` ends both."""

    def __init__(self, python, pythonpath, model, backend, transport, log_dir: Path, peer_timeout_s=10.0,
                 threads=1, start_timeout=300.0):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.base = engine_env(python, pythonpath, transport, peer_timeout_s, threads)
        self.args = (python, model, backend, log_dir)
        self.start_timeout = start_timeout
        self.procs = [self._proc("prefill"), self._proc("decode")]
        self.prefill, self.decode = self.procs
        self.startup_s = self._wait(self.procs)

    def _proc(self, role, n=1):
        env = dict(self.base, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        python, model, backend, log_dir = self.args
        return Proc(role, python, model, backend, env, log_dir, n)

    def _wait(self, procs):
        t0 = time.monotonic()
        try:
            for p in procs:
                p.recv(max(1.0, self.start_timeout - (time.monotonic() - t0)))
        except Exception:
            self.close()
            raise
        return time.monotonic() - t0

    def close(self):
        for p in self.procs:
            p.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
