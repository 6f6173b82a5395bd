"""Many NICs on a real test bed: two network namespaces joined by four veth pairs (tests/python/netns.py),
shaped with tc, one endpoint process inside each. Lanes spread over NIC pairs, a slow link carries less,
a link that dies mid-transfer loses no byte, all links dead -> a clear error in bounded time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import netns
from tether_testutil.data import MiB, assert_bytes_equal, rand_bytes

OK, WHY = netns.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")

LINKS = 4


@pytest.fixture
def bed():
    netns.cleanup_stale()
    b = netns.TestBed(links=LINKS)
    try:
        b.up()
        yield b
    finally:
        b.cleanup()


def _pair(bed, children, a_opts=None, b_opts=None, a_env=None):
    """Child A in namespace a connected to child B (listening on every interface) in namespace b."""
    b = children("b", env={"TETHER_TEST_NETNS": bed.ns["b"]})
    a = children("a", env={"TETHER_TEST_NETNS": bed.ns["a"], **(a_env or {})})
    info = b.call("endpoint", host="0.0.0.0", channels=4, nics=bed.nics("b"), **(b_opts or {}))
    a.call("endpoint", channels=4, **({"nics": bed.nics("a")} | (a_opts or {})))
    a.call("connect", info["metadata"])
    return a, b


def _lanes(child):
    return child.call("stats")["lanes"]


def _nic_bytes(child, key="bytes_sent"):
    return {n["name"]: n[key] for n in child.call("stats")["nics"]}


@pytest.mark.budget(90)
def test_lanes_spread_over_every_nic_pair(bed, children):
    a, b = _pair(bed, children)
    n = 48 * MiB
    desc = b.call("register", "dst", n)
    a.call("register", "src", n, fill=("seed", 5))
    assert a.call("write", "src", desc, timeout=60) == ("ok", n)
    assert_bytes_equal(np.frombuffer(b.call("get", "dst", timeout=60), np.uint8), rand_bytes(5, n), "written")
    lanes = _lanes(a)
    assert sorted(l["local_nic"] for l in lanes) == ["a0", "a1", "a2", "a3"], lanes
    for l in lanes:  # each lane leaves from aI and goes to bI: the pair that shares a subnet
        i = int(l["local_nic"][1:])
        assert l["local_addr"] == bed.addr("a", i) and l["remote_addr"] == bed.addr("b", i), l
        assert l["remote_nic"] == f"b{i}" and l["alive"] and l["bytes_sent"] > 0, l
    sent = _nic_bytes(a)
    assert sum(sent[f"a{i}"] for i in range(LINKS)) == n, sent
    got = _nic_bytes(b, "bytes_received")
    assert all(got[f"b{i}"] > 0 for i in range(LINKS)), got
    # and back: a read lands every byte too
    b.call("fill", "dst", ("seed", 6))
    a.call("register", "back", n)
    assert a.call("read", "back", desc, timeout=60) == ("ok", n)
    assert_bytes_equal(np.frombuffer(a.call("get", "back", timeout=60), np.uint8), rand_bytes(6, n), "read")


def test_tether_nics_restricts_and_orders(bed, children):
    a, b = _pair(bed, children, a_opts={"nics": "a2,a1"})
    desc = b.call("register", "dst", 4 * MiB)
    a.call("register", "src", 4 * MiB, fill=("seed", 1))
    assert a.call("write", "src", desc)[0] == "ok"
    lanes = sorted(_lanes(a), key=lambda l: l["lane"])
    # two local NICs: channels alternate a2, a1 in the order given
    assert [l["local_nic"] for l in lanes] == ["a2", "a1", "a2", "a1"], lanes
    assert {x["name"] for x in a.call("stats")["nics"]} >= {"a1", "a2"}


def test_unknown_nic_names_are_refused(bed, children):
    a = children("a", env={"TETHER_TEST_NETNS": bed.ns["a"]})
    for opts, word in (({"nics": "a0,eth9"}, "eth9"), ({"control_nic": "zz"}, "zz"),
                       ({"tx_cpus": "a0:0-1;nope:0"}, "nope"), ({"tx_cpus": "a0:x"}, "CPU list"),
                       ({"rx_cpus": "a0:100000"}, "CPU")):
        with pytest.raises(Exception) as e:
            a.call("endpoint", **opts)
        assert "InvalidArgument" in str(e.value) and word in str(e.value), str(e.value)[-300:]


def test_progress_threads_pinned_per_nic(bed, children):
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    c0, c1 = sorted(cpus)[:2]
    a = children("a", env={"TETHER_TEST_NETNS": bed.ns["a"]})
    before = a.call("thread_cpus")
    a.call("endpoint", channels=4, nics=bed.nics("a"), tx_cpus=f"a0:{c0};a1:{c1}", rx_cpus=f"a1:{c0}")
    after = a.call("thread_cpus")
    new = list(after)
    for x in before:
        new.remove(x)
    # threads 0 and 1 serve a0 and a1: pinned as bound (a1: TX and RX CPUs together); 2 and 3 (veths,
    # no local CPU list) stay unpinned, like the control thread
    assert sorted(new).count(str(c0)) == 1, new
    assert f"{c0}-{c1}" in new or f"{c0},{c1}" in new, new


def test_doctor_shows_the_cpp_plan(bed):
    env = dict(os.environ, TETHER_NICS="a1,a0", TETHER_TX_CPUS="a1:0", TETHER_CHANNELS="2")
    r = subprocess.run(bed.cmd("a", sys.executable, "-m", "tether", "doctor", "--json"), capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["topology"]["data_nics"] == ["a1", "a0"]
    threads = rep["topology"]["threads"]
    assert [t["nic"] for t in threads] == ["a1", "a0"] and threads[0]["cpus"] == "0", threads
    assert "TETHER_TX_CPUS" in threads[0]["why"] and threads[1]["cpus"] == "", threads
    names = {n["name"]: n for n in rep["nics"]}
    assert names["a0"]["addrs"] == [f"{bed.addr('a', 0)}/24"], names["a0"]


@pytest.mark.budget(120)
def test_slow_link_carries_proportionally_less(bed, children):
    for i in range(LINKS):
        bed.shape(i, "100mbit" if i == 3 else "400mbit")
    a, b = _pair(bed, children)
    n = 64 * MiB
    desc = b.call("register", "dst", n)
    a.call("register", "src", n, fill=("seed", 9))
    t0 = time.monotonic()
    assert a.call("write", "src", desc, timeout=90) == ("ok", n)
    elapsed = time.monotonic() - t0
    assert_bytes_equal(np.frombuffer(b.call("get", "dst", timeout=60), np.uint8), rand_bytes(9, n), "written")
    sent = _nic_bytes(a)
    fast = min(sent[f"a{i}"] for i in range(3))
    # by rate the slow link should carry 1/4 of a fast one; a static split would give it as much
    assert sent["a3"] < 0.6 * fast, sent
    # A slow link must not set the pace: a static split would finish at its pace, 4 x 100 Mbit/s =
    # 0.4 Gbit/s. The bound sits between that and the links' 1.3 Gbit/s, well below what a loaded CI
    # box reaches (0.72 the slowest seen); the rate itself is a benchmark's business.
    gbit = n * 8 / elapsed / 1e9
    assert gbit > 0.55, f"{gbit:.2f} Gbit/s over 1.3 Gbit/s of links: paced by the slow link?"


@pytest.mark.budget(120)
@pytest.mark.parametrize("op", ["write", "read", "send"])
def test_a_link_dies_mid_transfer(bed, children, op):
    for i in range(LINKS):
        bed.shape(i, "200mbit")
    opts = {"lane_timeout": 1.0}
    a, b = _pair(bed, children, a_opts=opts, b_opts=opts)
    n, count = 16 * MiB, 4
    if op == "write":
        desc = b.call("register", "dst", n)
        a.call("register", "src", n, fill=("seed", 21))
        a.call("post", "write", "src", desc, count)
    elif op == "read":
        desc = b.call("register", "src", n, fill=("seed", 21))
        a.call("register", "dst", n)
        a.call("post", "read", "dst", desc, count)
    else:
        b.call("register", "dst", n * count)
        a.call("register", "src", n, fill=("seed", 21))
        b.call("post_recvs", "dst", count, n)
        a.call("post_sends", "src", count)
    time.sleep(0.6)  # 64 MiB over 4 x 200 Mbit/s takes ~0.7 s a link... mid-transfer
    bed.down(2)
    statuses, _ = a.call("wait_posted", 60, timeout=70)
    assert all(s[0] == "ok" for s in statuses), statuses
    if op == "write":
        got = b.call("get", "dst", timeout=60)
    elif op == "read":
        got = a.call("get", "dst", timeout=60)
    else:
        rstat, _ = b.call("wait_posted", 30, timeout=40)
        assert all(s == ("ok", n) for s in rstat), rstat
        got = b.call("get", "dst", timeout=60)
        for k in range(count):
            assert_bytes_equal(np.frombuffer(got[k * n:(k + 1) * n], np.uint8), rand_bytes(21, n), f"message {k}")
        got = got[:n]
    assert_bytes_equal(np.frombuffer(got, np.uint8), rand_bytes(21, n), op)
    lanes = {l["local_nic"]: l for l in _lanes(a)}
    assert not lanes["a2"]["alive"] and lanes["a2"]["errors"] == 1, lanes["a2"]
    assert all(lanes[f"a{i}"]["alive"] for i in (0, 1, 3)), lanes
    nics = {x["name"]: x for x in a.call("stats")["nics"]}
    assert nics["a2"]["errors"] == 1 and nics["a2"]["resends"] == lanes["a2"]["resends"]
    # the survivors go on working
    if op == "write":
        a.call("fill", "src", ("seed", 22))
        assert a.call("write", "src", desc, timeout=60) == ("ok", n)
        assert_bytes_equal(np.frombuffer(b.call("get", "dst", timeout=60), np.uint8), rand_bytes(22, n), "after")


@pytest.mark.budget(60)
def test_every_link_dead_fails_in_bounded_time(bed, children):
    for i in range(LINKS):
        bed.shape(i, "100mbit")
    opts = {"lane_timeout": 1.0, "peer_timeout": 3.0}
    a, b = _pair(bed, children, a_opts=opts, b_opts=opts)
    n = 32 * MiB
    desc = b.call("register", "dst", n)
    a.call("register", "src", n, fill=("seed", 3))
    a.call("post", "write", "src", desc, 2)
    time.sleep(0.4)
    t0 = time.monotonic()
    for i in range(LINKS):
        bed.blackhole(i)
    statuses, _ = a.call("wait_posted", 20, timeout=30)
    elapsed = time.monotonic() - t0
    assert all(s[0] == "ConnectionLost" for s in statuses), statuses
    assert any("every data connection" in s[1] or "silent" in s[1] for s in statuses), statuses
    assert elapsed < 3.0 + 2.0, f"failed after {elapsed:.1f} s (peer_timeout 3 s, lane_timeout 1 s)"
    # nothing hangs afterwards: a new write fails at once
    st = a.call("write", "src", desc, timeout=5)
    assert st[0] in ("ConnectionLost", "Cancelled"), st
