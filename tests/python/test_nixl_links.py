"""NIXL links over time, through NIXL's own Python API with backends=["TETHER"]: agents added, used and
removed a thousand times leave nothing behind, and a link whose agent stopped answering for longer
than peer_timeout heals by itself once it answers again (vLLM's NixlConnector never removes and
re-adds an agent after an error). Two agents in two processes; random data, poisoned destinations.
"""
from __future__ import annotations

import signal
import time

import pytest

from nixl_agent import AgentError
from test_nixl import NO_NIXL, SITES, _bytes, _register, _whole, agents, linked, nixl_site, spawn  # noqa: F401  (fixtures)
from tether_testutil.data import MiB, rand_bytes, wait_until

pytestmark = pytest.mark.skipif(not SITES, reason=NO_NIXL)


@pytest.mark.budget(150)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_add_write_remove_churn_leaves_nothing_behind(spawn, transport):
    """1,000 rounds of add_remote_agent / WRITE / remove_remote_agent after 50 of warm-up: the initiator's
    descriptors, threads and RSS stay flat, so do the target's descriptors, and every round's bytes landed."""
    warm, rounds, block = 50, 1000, 256
    a, b = agents(spawn, "TETHER", {"transport": transport})
    size = (warm + rounds) * block
    _register(a, size, ["src"], seed=21)
    _register(b, size, ["dst"])
    md, dst = b.call("metadata"), b.call("addr", "dst")[1:]
    a.call("churn", md, dst, "src", 0, warm, block, timeout=60)
    b_before = b.call("usage")
    r = a.call("churn", md, dst, "src", warm, rounds, block, timeout=120)
    fds0, threads0, rss0 = r["before"]
    # a removed link's threads end as its sockets close, a moment after remove_remote_agent returns
    wait_until(lambda: a.call("usage")[1] <= threads0, 5)
    fds1, threads1, rss1 = a.call("usage")
    time.sleep(0.5)  # the target lets go of each link as it sees it closed
    b_after = b.call("usage")
    print(f"\n{transport}: {rounds} rounds in {r['seconds']:.1f} s ({rounds / r['seconds']:.0f}/s); initiator fds "
          f"{fds0} -> {fds1}, threads {threads0} -> {threads1}, RSS {rss0 / MiB:.1f} -> {rss1 / MiB:.1f} MiB; "
          f"target fds {b_before[0]} -> {b_after[0]}, threads {b_before[1]} -> {b_after[1]}, "
          f"RSS {b_before[2] / MiB:.1f} -> {b_after[2] / MiB:.1f} MiB")
    assert abs(fds1 - fds0) <= 2, f"initiator fds {fds0} -> {fds1} over {rounds} rounds"
    assert threads1 <= threads0, f"initiator threads {threads0} -> {threads1} over {rounds} rounds"
    assert rss1 <= rss0 + 8 * MiB, f"initiator RSS {rss0 / MiB:.1f} -> {rss1 / MiB:.1f} MiB over {rounds} rounds"
    assert b_after[0] <= b_before[0] + 2, f"target fds {b_before[0]} -> {b_after[0]} over {rounds} rounds"
    assert b_after[1] <= b_before[1] + 1, f"target threads {b_before[1]} -> {b_after[1]} over {rounds} rounds"
    assert r["seconds"] < 60
    assert _bytes(b, "dst").tobytes() == rand_bytes(21, size).tobytes()


def _attempt(a, key: str, timeout: float) -> str:
    """A fresh request on the prepared lists, posted and waited for: its final state (ERR:... where
    NIXL raised, making or posting it)."""
    try:
        a.call("xfer", key, "WRITE", "l", [0], "r", [0])
    except AgentError as e:
        return "ERR:" + str(e).strip().splitlines()[-1][:120]
    try:
        state = a.call("post", key)
        if state == "PROC":
            state = a.call("wait", key, timeout)[0]
    except AgentError as e:
        state = "ERR:" + str(e).strip().splitlines()[-1][:120]
    a.call("release", key)
    return state


@pytest.mark.budget(90)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_link_heals_after_the_agent_was_stopped_past_peer_timeout(spawn, transport):
    """B stopped with peer_timeout 3 s: A's transfer fails by peer_timeout, never hangs. A transfer posted
    while B is still stopped waits for the link (at most connect_timeout) and completes once B continues,
    without remove/re-add; the link stays up after."""
    params = {"transport": transport, "peer_timeout": "3", "heartbeat": "0.3", "connect_timeout": "5"}
    a, b = agents(spawn, "TETHER", params)
    size = MiB + 5
    linked(a, b, size, 31)
    assert _attempt(a, "w0", 10) == "DONE"
    assert _bytes(b, "dst").tobytes() == rand_bytes(31, size).tobytes()
    b.kill(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        a.call("fill", "src", seed=32)
        state = _attempt(a, "w1", 20)
        took = time.monotonic() - stopped
        assert state.startswith("ERR") and took < 8, (state, took)
        seed = 40
        a.call("fill", "src", seed=seed)
        a.call("xfer", "w2", "WRITE", "l", [0], "r", [0])
        posted = time.monotonic()
        assert a.call("post", "w2") in ("PROC", "DONE")
        time.sleep(1.0)
    finally:
        b.kill(signal.SIGCONT)
    resumed = time.monotonic()
    state = a.call("wait", "w2", 10)[0]
    a.call("release", "w2")
    assert state == "DONE", f"the transfer posted while B was stopped did not complete once it continued: {state}"
    print(f"\n{transport}: the transfer posted while B was stopped completed "
          f"{time.monotonic() - resumed:.2f} s after B continued ({resumed - posted:.2f} s after its post)")
    assert _bytes(b, "dst").tobytes() == rand_bytes(seed, size).tobytes()
    b.call("fill", "dst")
    a.call("fill", "src", seed=99)
    assert _attempt(a, "w4", 10) == "DONE"
    assert _bytes(b, "dst").tobytes() == rand_bytes(99, size).tobytes()


@pytest.mark.budget(90)
def test_agent_restarted_under_the_same_name(spawn):
    """B's process ends and a new one takes its name: A removes B (NIXL refuses other connection info for
    a loaded agent) and adds the new one; the dead links' descriptors go, transfers reach each new process."""
    a = spawn()
    a.call("create", "A", "TETHER", {"transport": "tcp"})
    _register(a, 4096, ["src"], seed=51)
    a.call("prep", "l", "NIXL_INIT_AGENT", _whole(a, "src"))
    fds = []
    for life in range(4):
        b = spawn()
        b.call("create", "B", "TETHER", {"transport": "tcp"})
        _register(b, 4096, ["dst"])
        assert a.call("add_remote", b.call("metadata")) == "B"
        a.call("prep", f"r{life}", "B", _whole(b, "dst"))
        a.call("xfer", "w", "WRITE", "l", [0], f"r{life}", [0])
        assert a.call("run", "w")[0] == "DONE"
        a.call("release", "w")
        assert _bytes(b, "dst").tobytes() == rand_bytes(51, 4096).tobytes()
        b.close()  # SIGKILL: its sockets close under A's link
        time.sleep(0.3)
        a.call("release_dlist", f"r{life}")
        a.call("remove_remote", "B")
        fds.append(a.call("usage")[0])
    assert fds[-1] <= fds[0] + 2, f"A's descriptors over four lives of B: {fds}"
