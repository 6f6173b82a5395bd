"""A bench that fails fast and plainly and never hangs on a dead helper (docs/RELIABILITY.md, "The attacks,
before and after", item 4): a bounded --check, bad sizes, counts, outputs and a missing matplotlib refused
before the run, one-line failures, a case too big for memory refused up front, and a server that dies (of a
memory error, or killed) ending the run at once, leaving one line and no orphans."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time

import pytest

from tether import bench as B, cli
from tether_testutil.cli import ENV, run_cli

# ---------------------------------------------------------------- refused before the run

@pytest.mark.budget(120)
def test_check_is_bounded(monkeypatch):
    """--check verifies --check-iters operations per case (5 by default), not every timed one."""
    counted = []
    real = B._checked_iteration

    def counting(pair, case, *a):
        counted.append(case.size)
        return real(pair, case, *a)

    monkeypatch.setattr(B, "_checked_iteration", counting)
    assert cli.main(["bench", "--quiet", "--sizes", "4K,64K", "--iters", "200", "--check"]) == 0
    assert counted == [4096] * 5 + [65536] * 5
    counted.clear()
    assert cli.main(["bench", "--quiet", "--sizes", "4K", "--iters", "20", "--check", "--check-iters", "12"]) == 0
    assert counted == [4096] * 12


def test_bad_size_lists_suffixes():
    r = run_cli("bench", "--sizes", "12Q")
    assert r.returncode == 2 and "K, M or G" in r.stderr and "12Q" in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "tether bench --help" in r.stderr, r.stderr


@pytest.mark.parametrize("args,says", [
    (["--num-iovs", "0"], "--num-iovs: 0 is below 1"), (["--iters", "0"], "--iters: 0 is below 1"),
    (["--channels", "2,x"], "'x' is not a whole number"), (["--window", "-1"], "-1 is below 1"),
    (["--role", "client", "--peer", "127.0.0.1"], "--peer: expected HOST:PORT"),
    (["--role", "server", "--listen", "nonsense"], "--listen: expected HOST:PORT"),
    (["--mode", "send", "--num-iovs", "4"], "nothing to measure: send moves one block per op")])
def test_bad_counts_fail_before_the_run(args, says):
    """Found by argparse, not by a ZeroDivisionError (or a server's refusal) inside a run."""
    r = run_cli("bench", "--sizes", "4K", *args)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_unwritable_output_fails_before_the_run(tmp_path):
    t0 = time.monotonic()
    r = run_cli("bench", "--sizes", "4K", "--iters", "2", "--json", str(tmp_path / "no" / "such" / "r.json"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--json" in lines[0] and r.stdout == "", r.stderr
    assert time.monotonic() - t0 < 30


def test_plot_without_matplotlib_fails_up_front():
    code = ("import sys; sys.modules['matplotlib'] = None; from tether.cli import main; "
            "sys.exit(main(['bench', '--quiet', '--sizes', '4K', '--iters', '2', '--plot', 'x.png']))")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install matplotlib" in lines[0] and ".[plot]" in lines[0], r.stderr
    assert r.stdout == ""  # nothing ran


# ---------------------------------------------------------------- failures are one line

def test_refused_connection_is_one_line():
    r = run_cli("bench", "--role", "client", "--peer", "127.0.0.1:1", "--quiet", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "Connection refused" in lines[0] and "127.0.0.1:1" in lines[0]
    r = run_cli("bench", "--role", "client", "--peer", "127.0.0.1:1", "--quiet", "--debug", timeout=60)
    assert r.returncode == 1 and "Traceback" in r.stderr and "Connection refused" in r.stderr.splitlines()[-1]
    r = run_cli("bench", "--role", "client", "--peer", "127.0.0.1:1", "--quiet", env={"TETHER_DEBUG": "1"})
    assert r.returncode == 1 and "Traceback" in r.stderr


# ---------------------------------------------------------------- dead helpers, memory

def _address_space(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


OVERSIZED_CASE = ["bench", "--transport", "tcp", "--device", "cpu", "--mode", "write",
                 "--sizes", "268435456,1179648", "--num-iovs", "1,128", "--check"]


@pytest.mark.budget(60)
def test_case_too_big_is_refused_up_front():
    """The command as found (256 MiB x 128 iovs = 32 GiB per buffer), in 4 GiB of address space: it
    ends at once, saying what it needs, instead of waiting on a server that died allocating."""
    t0 = time.monotonic()
    r = run_cli(*OVERSIZED_CASE, "--quiet", timeout=60, preexec_fn=_address_space(4 << 30))
    took = time.monotonic() - t0
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "32 GiB" in lines[0] and "256 MiB x 128 iovs" in lines[0] and "--num-iovs" in lines[0]
    assert took < 30, took


@pytest.mark.budget(90)
def test_server_dying_of_memory_error_ends_run():
    """Past the up-front check (patched away), the server dies allocating: the client says why at once."""
    code = ("import sys; from tether import bench as B, cli; B.memory_shortfall = lambda *a, **k: None; "
            f"sys.exit(cli.main({OVERSIZED_CASE + ['--quiet']!r}))")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=80,
                       preexec_fn=_address_space(4 << 30))
    took = time.monotonic() - t0
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "MemoryError" in lines[0] and "32.0 GiB" in lines[0], lines
    assert took < 60, took


@pytest.mark.budget(60)
def test_local_pair_reports_server_memory_error():
    t0 = time.monotonic()
    with pytest.raises(B.BenchError, match="MemoryError"):
        B.LocalPair({}, 1 << 62)
    assert time.monotonic() - t0 < 30


class KilledPair(B.LocalPair):
    """The server is SIGKILLed `after` seconds into the run."""
    after = 0.0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        threading.Timer(self.after, os.kill, (self.proc.pid, signal.SIGKILL)).start()


@pytest.mark.budget(90)
@pytest.mark.parametrize("after", [0.0, 1.5], ids=["before-first-case", "mid-run"])
def test_killed_server_ends_run_at_once(monkeypatch, capsys, after):
    """Killed before its first answer, or while ops fly (a long timed pass): one line, exit 1, at once."""
    monkeypatch.setattr(KilledPair, "after", after)
    monkeypatch.setattr(B, "LocalPair", KilledPair)
    t0 = time.monotonic()
    rc = cli.main(["bench", "--quiet", "--sizes", "4K", "--iters", "1000000", "--mode", "write,read"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert "died" in err[0] and "SIGKILL" in err[0], err
    assert took < after + 20, took


@pytest.mark.budget(90)
def test_killed_server_ends_remote_run():
    """Two hosts' roles: the server process killed mid-run; the client ends with one line, promptly."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "tether", "bench", "--role", "server", "--listen",
                               f"127.0.0.1:{port}"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # listening?
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        client = subprocess.Popen([sys.executable, "-m", "tether", "bench", "--quiet", "--role", "client", "--peer",
                                   f"127.0.0.1:{port}", "--sizes", "4K", "--iters", "1000000", "--mode", "read"],
                                  env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        server.kill()
        t0 = time.monotonic()
        _, err = client.communicate(timeout=40)
        assert time.monotonic() - t0 < 30
        lines = err.strip().splitlines()
        assert client.returncode == 1 and len(lines) == 1, err
    finally:
        server.kill()
        server.wait(10)


def _children(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _sockets(pid: int) -> int:
    try:
        return sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


@pytest.mark.budget(120)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_killing_the_bench_leaves_one_line_from_its_server(sig):
    """`kill -INT/-TERM/-9` of the bench's main process (not Ctrl-C, which reaches both) made its server
    process print a 14-20 line traceback (BenchError: the bench server closed its pipe, BrokenPipeError)."""
    p = subprocess.Popen([sys.executable, "-m", "tether", "bench", "--quiet", "--transport", "tcp", "--sizes", "64M",
                          "--iters", "100000"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(_sockets(c) >= 3 for c in _children(p.pid)):  # the server listens and serves a peer
            assert time.monotonic() < deadline and p.poll() is None, "the bench's server never came up"
            time.sleep(0.1)
        time.sleep(1)  # transfers under way
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=60)  # both ends of stderr closed: the server has ended too
    finally:
        p.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 1, err
    assert "Traceback" not in err, err
