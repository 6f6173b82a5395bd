"""The attacks a hostile or broken peer can make, measured (docs/RELIABILITY.md, "The attacks, before and after"): each runs against a target endpoint in a
child process while a legitimate peer keeps writing 1 MiB to it, and reports what the target held
(connections, descriptors, resident memory) before, during and after, and how long the legitimate
write took alone and under attack. It asserts nothing: it runs the same on a build without the fixes.

    PYTHONPATH=python python3 bench/attacks.py [--only fd,notify,ipc,garbage,stop]
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import tether  # noqa: E402
from tether_testutil.child import Child  # noqa: E402
from tether_testutil.data import rand_bytes  # noqa: E402
from tether_testutil.proc import cpu_seconds, fd_count, rss_bytes  # noqa: E402
from tether_testutil.sockets import raw_connect, read_server_hello, recv_exact  # noqa: E402
from tether_testutil.wire import SERVER_DONE_SIZE, client_hello, client_proof, host_id_of  # noqa: E402

MiB = 1 << 20
ROWS: list[dict] = []


def timed_write(peer, src, desc) -> float:
    t0 = time.monotonic()
    try:
        peer.write(src, desc).wait(30)
    except tether.TetherError as e:
        print(f"  legit write failed: {type(e).__name__}: {e}")
        return float("nan")
    return time.monotonic() - t0


def snapshot(pid: int) -> tuple[int, float]:
    return fd_count(pid), rss_bytes(pid) / MiB


def row(attack, held, before, during, after, alone, under, outcome):
    ROWS.append(dict(attack=attack, held=held, before=before, during=during, after=after, alone=alone, under=under,
                     outcome=outcome))
    print(f"  {attack}: fds {before[0]} -> {during[0]} -> {after[0]}, RSS {before[1]:.0f} -> {during[1]:.0f} -> "
          f"{after[1]:.0f} MiB, legit write {alone * 1e3:.2f} ms alone / {under * 1e3:.2f} ms under attack; {outcome}")


class Scene:
    """One attack's scene: a target endpoint in a child process with a 1 MiB region `desc`, and a legitimate
    peer writing 1 MiB to it, timed alone (the best of three) before the attack, beside what the target held."""

    def __init__(self, c: Child, info: dict, desc: bytes, me):
        self.c, self.info, self.desc = c, info, desc
        self.peer = me.connect(info["metadata"], timeout=5)
        self.src = me.register(rand_bytes(1, 1 * MiB))
        self.alone = min(self.write() for _ in range(3))
        self.before = snapshot(c.pid)

    def write(self) -> float:
        return timed_write(self.peer, self.src, self.desc)

    def holding(self) -> None:
        """While the attack holds: the legitimate write's time and what the target holds."""
        self.under, self.during = self.write(), snapshot(self.c.pid)

    def row(self, attack: str, held: int, outcome: str) -> None:
        """After the attack let go."""
        row(attack, held, self.before, self.during, snapshot(self.c.pid), self.alone, self.under, outcome)


@contextmanager
def scene(name: str, transport: str = "auto", legit_transport: str = "auto", nofile: int = 0, **kw):
    """A Scene whose target runs with endpoint options `kw` (and at most `nofile` descriptors); closed after."""
    c = Child(name)
    try:
        if nofile:
            c.call("setrlimit_nofile", nofile)
        info = c.call("endpoint", name=name, transport=transport, **kw)
        desc = c.call("register", "dst", 1 * MiB)
        with tether.Endpoint(name="legit", transport=legit_transport, channels=2) as me:
            yield Scene(c, info, desc, me)
    finally:
        c.cleanup()


def idle(address: str, n: int) -> list:
    host, port = address.rsplit(":", 1)
    out = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(5)
        s.connect((host, int(port)))
        out.append(s)
    return out


def attack_fd():
    """Item 1: a target limited to 128 descriptors; 300 idle TCP connections held against it."""
    with scene("fd-target", "tcp", "tcp", nofile=128, handshake_timeout=5.0) as sc:
        socks = idle(sc.info["address"], 300)
        time.sleep(0.5)
        c0 = cpu_seconds(sc.c.pid)
        time.sleep(2.0)
        cpu = cpu_seconds(sc.c.pid) - c0
        sc.holding()
        for s in socks:
            s.close()
        time.sleep(1.0)
        t0 = time.monotonic()
        try:
            other = tether.Endpoint(name="newcomer", transport="tcp")
            other.connect(sc.info["metadata"], timeout=10)
            outcome = f"target CPU {cpu:.2f} s per 2 s; a new peer connected {time.monotonic() - t0:.2f} s after"
            other.close()
        except tether.TetherError as e:
            outcome = f"target CPU {cpu:.2f} s per 2 s; a new peer could not connect: {e}"
        sc.row("300 idle TCP connections, target limited to 128 fds", 300, outcome)


def attack_notify():
    """Item 2: a token-less peer sends 150 x 1 MiB notifications the application does not read."""
    with scene("note-target", legit_transport="tcp") as sc:
        flood = tether.Endpoint(name="flooder")
        fp = flood.connect(sc.info["metadata"], timeout=5)
        sc.before = snapshot(sc.c.pid)
        ts = [fp.notify(b"n" * (MiB - 64)) for _ in range(150)]
        refused = 0
        for t in ts:
            try:
                t.wait(30)
            except tether.TetherError:
                refused += 1
        sc.holding()
        flood.close()
        time.sleep(1.0)
        left = snapshot(sc.c.pid)
        got = len(sc.c.call("drain_notifications"))
        time.sleep(0.5)
        sc.row("150 x 1 MiB unread notifications", 1, f"{150 - refused} queued, {refused} refused; RSS {left[1]:.0f} "
               f"MiB after the flooder left, {got} read by the application")


def forge_ipc(address, host, strip):
    s = raw_connect(address)
    s.sendall(client_hello(host_id=host, transports=2))
    h = read_server_hello(s)
    if h["status"] != 0 or "ipc" not in h["offers"]:
        return s, f"hello {h['status']}"
    offer = h["offers"]["ipc"][:18] if strip else h["offers"]["ipc"]
    s.sendall(client_proof(b"ipc", lanes=4, offer=offer))
    done = recv_exact(s, SERVER_DONE_SIZE)
    return s, (done[0] if done else "closed")


def attack_ipc():
    """Item 3: 200 TCP connectors claim the target's host and pick ipc with an offer naming the
    target's own ipc socket; the connections are held."""
    with scene("ipc-target") as sc:
        held, answers = [], {}
        for i in range(200):
            s, a = forge_ipc(sc.info["address"], host_id_of(sc.info["metadata"]), strip=bool(i % 2))
            held.append(s)
            answers[a] = answers.get(a, 0) + 1
        time.sleep(0.5)
        sc.holding()
        for s in held:
            s.close()
        time.sleep(1.0)
        sc.row(f"200 forged same-host ipc handshakes ({sc.peer.transport} legit peer)", 200,
               f"answers (status: count) {answers}")


def attack_garbage():
    """The fuzzer's attack in bulk: 1000 connections each sending 4 KiB of random bytes."""
    with scene("garbage-target", legit_transport="tcp") as sc:
        rng = np.random.default_rng(7)
        held = []
        for i in range(1000):
            s = raw_connect(sc.info["address"])
            try:
                s.sendall((client_hello()[:8] if i % 2 else b"") + rng.bytes(4096))
            except OSError:
                pass
            held.append(s)
        time.sleep(0.5)
        sc.holding()
        for s in held:
            s.close()
        time.sleep(1.0)
        sc.row("1000 connections sending 4 KiB of random bytes", 1000, f"legit peer connected: {sc.peer.connected}")


def attack_stop():
    """Item 6: a peer reading our region over ipc is SIGSTOPped; we deregister the region."""
    for transport in ("tcp", "ipc"):
        me = tether.Endpoint(name="target", peer_timeout=3.0, heartbeat=0.2)
        mine = rand_bytes(6, 64 * MiB)
        rm = me.register(mine)
        c = Child("stopped-reader")
        try:
            c.call("endpoint", name="stopped-reader", transport=transport, peer_timeout=3.0, heartbeat=0.2)
            c.call("connect", me.metadata())
            c.call("register", "dst", 64 * MiB)
            c.call("start_stream", "read", "dst", rm.descriptor(), 64 * MiB)
            time.sleep(0.3)
            os.kill(c.pid, signal.SIGSTOP)
            time.sleep(0.05)
            t0 = time.monotonic()
            done = threading.Event()
            threading.Thread(target=lambda: (me.deregister(rm), done.set()), daemon=True).start()
            done.wait(15)
            took = time.monotonic() - t0
            os.kill(c.pid, signal.SIGCONT)
            print(f"  stopped reader over {transport}: deregister took {took * 1e3:.0f} ms")
            ROWS.append(dict(attack=f"reader SIGSTOPped mid-read over {transport}", deregister_ms=took * 1e3))
        finally:
            c.cleanup()
            me.close()


ATTACKS = {"fd": attack_fd, "notify": attack_notify, "ipc": attack_ipc, "garbage": attack_garbage, "stop": attack_stop}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(ATTACKS), help="comma-separated: " + ",".join(ATTACKS))
    args = ap.parse_args()
    print(f"tether {getattr(tether, '__file__', '?')}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs")
    for name in args.only.split(","):
        print(f"{name}:")
        try:
            ATTACKS[name]()
        except Exception as e:  # a build without the fixes may not survive it: say so and go on
            print(f"  {name}: the attack run failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
