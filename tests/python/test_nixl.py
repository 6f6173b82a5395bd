"""tether as a NIXL backend, through NIXL's own Python API, two agents in two processes.

Every test runs against backends=["TETHER"] and, beside it, NIXL's UCX backend: both must pass, so
the tests check NIXL's semantics, not our reading of them (the few that UCX cannot pass say why and
run on TETHER only). They run on every NIXL found: the installed one, and each --target folder named
in TETHER_NIXL_ALT (colon-separated; .ci/run installs 1.4.1 there). DRAM here; VRAM in
test_nixl_gpu.py. Random data, poisoned destinations, every byte checked.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from nixl_agent import POISON, AgentError, AgentProcess, rand_bytes

MiB = 1 << 20
T = 30.0


def _nixl_sites() -> list[tuple[str, str | None, str]]:
    """(version, PYTHONPATH for the child or None for the installed one, plugin folder)."""
    out = []
    try:
        import tether.nixl as tn
        info = tn.nixl_installed()
        if info:
            out.append((info["version"], None, info["plugin_dir"]))
    except ImportError:
        pass
    for site in filter(None, os.environ.get("TETHER_NIXL_ALT", "").split(os.pathsep)):
        dists = list(metadata.distributions(path=[site]))
        versions = [d.version for d in dists if d.metadata["Name"] in ("nixl-cu13", "nixl-cu12")]
        plugins = sorted(Path(site).glob(".nixl*.mesonpy.libs/plugins"))
        if versions and plugins:
            out.append((versions[0], site, str(plugins[0])))
    return out


SITES = _nixl_sites()
NO_NIXL = "NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1)"
pytestmark = pytest.mark.skipif(not SITES, reason=NO_NIXL)


@pytest.fixture(scope="session", params=[s[0] for s in SITES] or ["none"])
def nixl_site(request):
    """One NIXL, with our plugin installed into its plugin folder (what `tether nixl install` does)."""
    import tether.nixl as tn
    version, path, plugin_dir = next(s for s in SITES if s[0] == request.param)
    if tn.plugin_path() is None:  # every build makes it (src/nixl/abi) unless configured with TETHER_NIXL=OFF
        pytest.fail("this tether has no NIXL plugin (python/tether/plugins/libplugin_TETHER.so): build it")
    tn.install(plugin_dir)
    return {"version": version, "path": path}


@pytest.fixture(params=["TETHER", "UCX"])
def backend(request):
    return request.param


@pytest.fixture
def spawn(nixl_site):
    made = []

    def make(env=None):
        a = AgentProcess(nixl_site["path"], env)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def _version_tuple(v: str) -> tuple:
    return tuple(int(x) for x in v.split(".")[:3])


def agents(spawn, backend, params=None, env=None):
    """(initiator A, target B), fresh agents on `backend`; `link` them once their memory is registered."""
    a, b = spawn(env), spawn(env)
    a.call("create", "A", backend, params)
    b.call("create", "B", backend, params)
    return a, b


@pytest.fixture
def pair(spawn, backend):
    return agents(spawn, backend)


def link(a, b, both=False):
    """A loads B's metadata (as NIXL wants, after B registered its memory); B loads A's if `both`."""
    assert a.call("add_remote", b.call("metadata")) == "B"
    if both:
        assert b.call("add_remote", a.call("metadata")) == "A"


def _rows(addr: int, block: int, count: int) -> np.ndarray:
    """Nx3 rows (addr, len, dev): `count` blocks of `block` bytes from `addr`."""
    r = np.zeros((count, 3), dtype=np.uint64)
    r[:, 0] = addr + np.arange(count, dtype=np.uint64) * block
    r[:, 1] = block
    return r


def _whole(agent, name: str) -> np.ndarray:
    mem, addr, n, dev = agent.call("addr", name)
    return np.array([[addr, n, dev]], dtype=np.uint64)


def _bytes(agent, name) -> np.ndarray:
    return np.frombuffer(agent.call("get", name), dtype=np.uint8)


def _register(agent, size: int, names, seed=None):
    """Buffers `names` of `size` bytes (the first random from `seed`, the rest poisoned), registered."""
    for i, name in enumerate(names):
        agent.call("alloc", name, size, seed=seed if i == 0 else None)
    agent.call("register", list(names))


def linked(a, b, size: int, a_seed=None, b_seed=None, a_names=("src",), b_names=("dst",), both=False):
    """A's buffers `a_names` and B's `b_names` (each side's first random from its seed), registered and
    linked; A's dlists "l" (its own, whole) and "r" (B's) prepped."""
    _register(a, size, a_names, a_seed)
    _register(b, size, b_names, b_seed)
    link(a, b, both)
    a.call("prep", "l", "NIXL_INIT_AGENT", np.vstack([_whole(a, n) for n in a_names]))
    a.call("prep", "r", "B", np.vstack([_whole(b, n) for n in b_names]))


# --------------------------------------------------------------------------- data


@pytest.mark.parametrize("size", [1, 4096 + 3, 9 * MiB + 7])
def test_write_then_read_every_byte(pair, size):
    a, b = pair
    linked(a, b, size, 1, a_names=("src", "back"))
    a.call("xfer", "w", "WRITE", "l", [0], "r", [0])
    assert a.call("run", "w")[0] == "DONE"
    assert _bytes(b, "dst").tobytes() == rand_bytes(1, size).tobytes()
    b.call("fill", "dst", seed=2)
    a.call("xfer", "rd", "READ", "l", [1], "r", [0])
    assert a.call("run", "rd")[0] == "DONE"
    assert _bytes(a, "back").tobytes() == rand_bytes(2, size).tobytes()


def _kv_layout(agent, regions: int, blocks: int, block: int, seed=None):
    """`regions` buffers (layers x K/V) of `blocks` blocks each, registered; returns their addrs."""
    names = [f"kv{r}" for r in range(regions)]
    addrs = [agent.call("alloc", n, blocks * block, seed=None if seed is None else seed + i)
             for i, n in enumerate(names)]
    agent.call("register", names)
    return names, addrs


@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("form", ["Nx5", "Nx3"])
def test_kv_blocks_permuted_ids(pair, nixl_site, op, form):
    """vLLM's pattern: per-layer K and V regions of fixed-size blocks, one dlist over all of them,
    block ids permuted on both sides; Nx5 is the strided form (addr, len, dev, stride, count)."""
    if form == "Nx5" and _version_tuple(nixl_site["version"]) < (1, 5):
        pytest.skip(f"NIXL {nixl_site['version']} has no strided (Nx5) lists")
    a, b = pair
    regions, blocks, block = 4, 48, 3000
    src, dst = (b, a) if op == "READ" else (a, b)
    src_names, src_addrs = _kv_layout(src, regions, blocks, block, seed=100)
    dst_names, dst_addrs = _kv_layout(dst, regions, blocks, block)
    link(a, b)
    rng = np.random.default_rng(7)
    n = 30
    src_ids, dst_ids = rng.choice(blocks, n, replace=False), rng.choice(blocks, n, replace=False)

    def rows(addrs):
        if form == "Nx5":
            return np.array([[x, block, 0, block, blocks] for x in addrs], dtype=np.uint64)
        return np.vstack([_rows(x, block, blocks) for x in addrs])

    a_addrs, b_addrs = (dst_addrs, src_addrs) if op == "READ" else (src_addrs, dst_addrs)
    a.call("prep", "l", "NIXL_INIT_AGENT", rows(a_addrs), "DRAM")
    a.call("prep", "r", "B", rows(b_addrs), "DRAM")
    a_ids, b_ids = (dst_ids, src_ids) if op == "READ" else (src_ids, dst_ids)
    flat = lambda ids: [r * blocks + int(i) for r in range(regions) for i in ids]  # noqa: E731
    a.call("xfer", "x", op, "l", flat(a_ids), "r", flat(b_ids), notif=b"kv-done")
    assert a.call("run", "x")[0] == "DONE"
    for r in range(regions):
        want = rand_bytes(100 + r, blocks * block).reshape(blocks, block)
        got = _bytes(dst, dst_names[r]).reshape(blocks, block)
        for s, d in zip(src_ids, dst_ids):
            assert got[d].tobytes() == want[s].tobytes(), f"region {r}: block {s} -> {d}"
        untouched = np.setdiff1d(np.arange(blocks), dst_ids)
        assert (got[untouched] == POISON).all(), "blocks no id named were written"
    assert b.call("notifs", 1, T) == {"A": [b"kv-done"]}


def test_write_notification_only_after_data(pair):
    """The target compares its buffer the moment the notification shows: every byte must be there."""
    a, b = pair
    size = 24 * MiB
    _register(a, size, ["src"], seed=5)
    _register(b, size, ["dst"])
    link(a, b)
    a.call("prep", "l", "NIXL_INIT_AGENT", _rows(a.call("addr", "src")[1], size // 8, 8))
    a.call("prep", "r", "B", _rows(b.call("addr", "dst")[1], size // 8, 8))
    b.start("on_notif_check", "dst", 5)
    a.call("xfer", "w", "WRITE", "l", list(range(8)), "r", list(range(8)), notif=b"layer-7")
    assert a.call("run", "w")[0] == "DONE"
    got, complete = b.result(T)
    assert got == {"A": [b"layer-7"]}
    assert complete, "the notification arrived before all of the data"


def test_read_notification_only_after_data(pair):
    """A READ's notification tells the source its memory may be reused: it poisons the buffer the
    moment the notification shows, and the reader must still have every original byte."""
    a, b = pair
    size = 32 * MiB
    linked(a, b, size, b_seed=6, a_names=("dst",), b_names=("src",))
    b.start("on_notif_poison", "src")
    a.call("xfer", "rd", "READ", "l", [0], "r", [0], notif=b"read-done")
    assert a.call("run", "rd")[0] == "DONE"
    assert b.result(T) == {"A": [b"read-done"]}
    assert _bytes(a, "dst").tobytes() == rand_bytes(6, size).tobytes()
    assert (_bytes(b, "src") == POISON).all()


def test_standalone_notifications_both_ways(pair):
    a, b = pair
    link(a, b, both=True)
    msgs = [b"HB:%d" % i for i in range(100)] + [b"req-17:2", b"\x00\xff" * 300, bytes(rand_bytes(3, 60000))]
    for m in msgs:
        a.call("send_notif", "B", m)
    got = b.call("notifs", len(msgs), T)
    assert list(got) == ["A"] and sorted(got["A"]) == sorted(msgs)
    b.call("send_notif", "A", b"back")
    assert a.call("notifs", 1, T) == {"B": [b"back"]}


def test_repost_handle(pair):
    """One prepared handle posted again and again once done, with new data each time."""
    a, b = pair
    size = 3 * MiB + 1
    linked(a, b, size, 10)
    a.call("xfer", "w", "WRITE", "l", [0], "r", [0], notif=b"n")
    for seed in range(10, 15):
        a.call("fill", "src", seed=seed)
        assert a.call("run", "w")[0] == "DONE"
        assert _bytes(b, "dst").tobytes() == rand_bytes(seed, size).tobytes()
    assert b.call("notifs", 5, T) == {"A": [b"n"] * 5}
    a.call("release", "w")


def test_release_in_flight_does_not_block(pair, backend):
    """Releasing a handle whose transfer cannot progress (the target is stopped) returns at once;
    the agents go on working."""
    a, b = pair
    size = 64 * MiB
    linked(a, b, size, 20)
    a.call("xfer", "warm", "WRITE", "l", [0], "r", [0])
    assert a.call("run", "warm")[0] == "DONE"  # connected, every lane up
    a.call("xfer", "w", "WRITE", "l", [0], "r", [0], notif=b"never")
    b.kill(signal.SIGSTOP)
    try:
        state = a.call("post", "w")
        if state == "DONE" and backend == "UCX":
            pytest.skip("UCX finished 64 MiB into a stopped process (shared memory): nothing in flight to release")
        assert state == "PROC"
        took = a.call("release", "w")
        assert took < 0.5, f"release_xfer_handle of a transfer in flight took {took:.2f} s"
    finally:
        b.kill(signal.SIGCONT)
    b.call("fill", "dst")
    a.call("xfer", "w2", "WRITE", "l", [0], "r", [0], notif=b"after")
    assert a.call("run", "w2")[0] == "DONE"
    got = b.call("notifs", 2, 3)
    assert b"after" in got.get("A", []) and b"never" not in got.get("A", [])
    assert _bytes(b, "dst").tobytes() == rand_bytes(20, size).tobytes()


def test_remove_remote_agent_then_add_again(pair):
    a, b = pair
    _register(a, 4096, ["src"], seed=30)
    _register(b, 4096, ["dst"])
    link(a, b)
    md = b.call("metadata")
    a.call("remove_remote", "B")
    with pytest.raises(AgentError):
        a.call("prep", "r", "B", _whole(b, "dst"))
    assert a.call("add_remote", md) == "B"
    a.call("prep", "l", "NIXL_INIT_AGENT", _whole(a, "src"))
    a.call("prep", "r", "B", _whole(b, "dst"))
    a.call("xfer", "w", "WRITE", "l", [0], "r", [0])
    assert a.call("run", "w")[0] == "DONE"
    assert _bytes(b, "dst").tobytes() == rand_bytes(30, 4096).tobytes()


def _big_write(a, b, size=128 * MiB, both=False):
    linked(a, b, size, 40, both=both)
    a.call("xfer", "warm", "WRITE", "l", [0], "r", [0])
    assert a.call("run", "warm")[0] == "DONE"
    a.call("xfer", "w", "WRITE", "l", [0], "r", [0])


def test_peer_killed_mid_transfer_is_an_error_not_a_hang(spawn, backend):
    """The target is stopped before the write is posted, so the write cannot finish before the target is
    killed. UCX is held to tcp: over shared memory it writes a stopped process's memory itself (cross-memory
    attach) and the write is DONE at once, which tests nothing about a dead peer."""
    a, b = agents(spawn, backend, env={"UCX_TLS": "tcp"} if backend == "UCX" else None)
    _big_write(a, b)
    b.kill(signal.SIGSTOP)
    assert a.call("post", "w") == "PROC"  # a stopped target cannot take 128 MiB
    b.kill(signal.SIGKILL)
    state, took = a.call("wait", "w", 20.0)
    assert state != "PROC", f"still in progress {took:.1f} s after the target died"
    assert state.startswith("ERR"), state
    assert took < 15


def test_silent_peer_ends_in_an_error_within_the_peer_timeout(spawn, backend):
    """A target that stops answering (SIGSTOP, its sockets open): the transfer fails by tether's
    peer_timeout. NIXL's UCX backend has no timeout (it stays PROC forever: a known complaint)."""
    if backend == "UCX":
        pytest.skip("UCX has no transfer timeout: a stopped peer leaves the transfer in PROC forever")
    a, b = agents(spawn, backend, {"peer_timeout": "2", "heartbeat": "0.2"})
    _big_write(a, b)
    b.kill(signal.SIGSTOP)
    assert a.call("post", "w") == "PROC"
    state, took = a.call("wait", "w", 20.0)
    assert state.startswith("ERR") and 1.0 < took < 6.0, (state, took)


def test_garbage_metadata_is_an_error(pair, backend):
    a, b = pair
    _register(a, 1000, ["src"], seed=50)
    _register(b, 1000, ["dst"])
    for junk in (b"", b"garbage", bytes(rand_bytes(1, 4000))):
        with pytest.raises(AgentError):
            a.call("add_remote", junk)
    if backend == "TETHER":
        # Well-formed NIXL metadata whose TETHER connection info is damaged (its wire version byte),
        # then B's metadata cut short: errors both, and B can still be added afterwards. (UCX keeps
        # the connection info of a half-loaded agent and refuses it from then on, seen with 1.5.1.)
        md = bytearray(b.call("metadata"))
        at = md.find(b"TTRM")
        assert at > 0
        md[at + 4] ^= 0xFF
        with pytest.raises(AgentError):
            a.call("add_remote", bytes(md))
        with pytest.raises(AgentError):
            a.call("add_remote", b.call("metadata")[:-7])
    link(a, b)  # still healthy
    a.call("prep", "l", "NIXL_INIT_AGENT", _whole(a, "src"))
    a.call("prep", "r", "B", _whole(b, "dst"))
    a.call("xfer", "w", "WRITE", "l", [0], "r", [0])
    assert a.call("run", "w")[0] == "DONE"
    assert _bytes(b, "dst").tobytes() == rand_bytes(50, 1000).tobytes()


def test_deregister_while_transfers_run(pair):
    """The target deregisters the memory being written: every transfer ends (DONE or ERR), none hangs,
    nothing crashes, and the agents work afterwards."""
    a, b = pair
    size = 8 * MiB
    linked(a, b, size, 60, b_names=("dst", "dst2"))
    keys = []
    for i in range(6):
        a.call("xfer", f"w{i}", "WRITE", "l", [0], "r", [0])
        try:
            a.call("post", f"w{i}")
            keys.append(f"w{i}")
        except AgentError as e:  # after the deregistration, post itself may already report the refusal
            assert i > 2 and "NIXL_ERR_NOT_FOUND" in str(e), e
        if i == 2:
            b.call("deregister", "dst")
    for k in keys:
        state, _ = a.call("wait", k, 20.0)
        assert state != "PROC"
    a.call("xfer", "ok", "WRITE", "l", [0], "r", [1])
    assert a.call("run", "ok")[0] == "DONE"
    assert _bytes(b, "dst2").tobytes() == rand_bytes(60, size).tobytes()


@pytest.mark.parametrize("who", ["initiator", "target"])
def test_process_exit_with_live_agents_is_clean(spawn, backend, who):
    """A process leaves with its agent alive and a transfer in flight: no crash at exit, and the
    other side sees an error, not a hang."""
    if backend == "UCX":
        pytest.skip("NIXL's UCX backend dies with SIGSEGV at such an exit (seen here with 1.5.1): a known complaint")
    a, b = agents(spawn, backend)
    _big_write(a, b, 64 * MiB, both=True)
    a.call("post", "w")
    leaving = a if who == "initiator" else b
    leaving.start("exit_now", 0)
    leaving.proc.join(30)
    assert leaving.proc.exitcode == 0, f"exit code {leaving.proc.exitcode} (negative: killed by that signal)"
    if who == "target":
        state, took = a.call("wait", "w", 20.0)
        assert state != "PROC", "the initiator kept waiting for a target that exited"


# --------------------------------------------------------------------------- vLLM's calls


def vllm_teardown(a, b, remote: str, me: str, requests: int, a_names):
    """The end of vLLM's pattern: B got each request's "req-i:1" notification from `me` (A), a heartbeat
    A sends reaches it, then A releases its dlists "local" and "remote", removes B and deregisters."""
    got = b.call("notifs", requests, T)
    assert sorted(got[me]) == [b"req-%d:1" % i for i in range(requests)]
    a.call("send_notif", remote, b"HB:" + me.encode())
    assert b.call("notifs", 1, T) == {me: [b"HB:" + me.encode()]}
    a.call("release_dlist", "local")
    a.call("release_dlist", "remote")
    a.call("remove_remote", remote)
    for name in a_names:
        a.call("deregister", name)


def test_vllm_nixl_connector_call_pattern(spawn, backend, nixl_site):
    """The calls vLLM's NixlConnector makes, in its order: prefill (B) registers its KV caches and
    publishes metadata; decode (A) adds it, preps both sides, pulls blocks by id with a notification
    "req_id:consumers", checks state, reads telemetry, releases, sends heartbeats; then teardown."""
    strided = _version_tuple(nixl_site["version"]) >= (1, 5)
    a, b = spawn(), spawn()
    a.call("create", "decode-uuid", backend, capture_telemetry=True)
    b.call("create", "prefill-uuid", backend, capture_telemetry=True)
    layers, blocks, block = 3, 32, 4096
    b_names, b_addrs = _kv_layout(b, 2 * layers, blocks, block, seed=200)
    a_names, a_addrs = _kv_layout(a, 2 * layers, blocks, block)
    remote = a.call("add_remote", b.call("metadata"))
    assert remote == "prefill-uuid" and a.call("check_remote", remote)

    def rows(addrs):
        if strided:
            return np.array([[x, block, 0, block, blocks] for x in addrs], dtype=np.uint64)
        return np.vstack([_rows(x, block, blocks) for x in addrs])

    a.call("prep", "local", "NIXL_INIT_AGENT", rows(a_addrs), "DRAM")
    a.call("prep", "remote", remote, rows(b_addrs), "DRAM")
    rng = np.random.default_rng(3)
    for req in range(4):
        n = int(rng.integers(1, 12))
        rid, lid = rng.choice(blocks, n, replace=False), rng.choice(blocks, n, replace=False)
        flat = lambda ids: [r * blocks + int(i) for r in range(2 * layers) for i in ids]  # noqa: E731
        a.call("xfer", f"req{req}", "READ", "local", flat(lid), "remote", flat(rid), notif=b"req-%d:1" % req)
        a.call("post", f"req{req}")
        state, _ = a.call("wait", f"req{req}", T)
        assert state == "DONE"
        tel = a.call("telemetry", f"req{req}")
        assert tel["bytes"] == n * block * 2 * layers
        a.call("release", f"req{req}")
        for r in range(2 * layers):
            got = _bytes(a, a_names[r]).reshape(blocks, block)
            want = rand_bytes(200 + r, blocks * block).reshape(blocks, block)
            for s, d in zip(rid, lid):
                assert got[d].tobytes() == want[s].tobytes()
    vllm_teardown(a, b, remote, "decode-uuid", 4, a_names)


# --------------------------------------------------------------------------- TETHER's own


@pytest.mark.parametrize("transport", ["tcp", "ipc", "fabric", "netplugin"])
def test_every_tether_transport_through_nixl(spawn, nixl_site, transport):
    """The transport parameter forces one tether transport on both agents (nothing else is offered),
    so a transfer that completes went over it."""
    params = {"transport": transport}
    if transport == "fabric":
        from tether_testutil.transports import transport_unusable
        why = transport_unusable("fabric", transport="fabric", fabric_provider="tcp")
        if why:
            pytest.skip(f"fabric transport unavailable: {why}")
        params["fabric_provider"] = "tcp"
    if transport == "netplugin":
        from tether_testutil.transports import build_testnet_plugin
        params["net_plugin"] = build_testnet_plugin()
    a, b = agents(spawn, "TETHER", params)
    size = 5 * MiB + 3
    linked(a, b, size, 70, a_names=("src", "back"))
    a.call("xfer", "w", "WRITE", "l", [0], "r", [0], notif=b"over " + transport.encode())
    assert a.call("run", "w")[0] == "DONE"
    assert b.call("notifs", 1, T) == {"A": [b"over " + transport.encode()]}
    assert _bytes(b, "dst").tobytes() == rand_bytes(70, size).tobytes()
    a.call("xfer", "r", "READ", "l", [1], "r", [0])
    assert a.call("run", "r")[0] == "DONE"
    assert _bytes(a, "back").tobytes() == rand_bytes(70, size).tobytes()


def test_backend_parameters_are_checked(spawn):
    a = spawn()
    for bad in ({"channels": "x"}, {"chanels": "4"}, {"peer_timeout": "-1"}, {"transport": "carrier-pigeon"}):
        with pytest.raises(AgentError):
            a.call("create", "A", "TETHER", bad)
    info = a.call("create", "A", "TETHER", {"channels": "2", "peer_timeout": "3.5", "transport": "tcp"})
    assert "TETHER" in info["plugins"]


def test_local_transfers_inside_one_agent(spawn):
    """supportsLocal: DRAM to DRAM inside one agent (its loopback descriptors name itself)."""
    a = spawn()
    a.call("create", "A", "TETHER")
    size = 2 * MiB + 5
    _register(a, size, ["src", "dst"], seed=80)
    a.call("prep", "l", "NIXL_INIT_AGENT", _whole(a, "src"))
    a.call("prep", "self", "A", _whole(a, "dst"))
    a.call("xfer", "w", "WRITE", "l", [0], "self", [0], notif=b"me")
    assert a.call("run", "w")[0] == "DONE"
    assert _bytes(a, "dst").tobytes() == rand_bytes(80, size).tobytes()
    assert a.call("notifs", 1, T) == {"A": [b"me"]}


def test_install_status_and_cli(tmp_path, nixl_site):
    import tether.nixl as tn
    dest = tn.install(str(tmp_path))
    assert dest == tmp_path / tn.PLUGIN_NAME and dest.read_bytes() == tn.plugin_path().read_bytes()
    st = tn.status()
    if nixl_site["path"] is None:  # the installed NIXL: the session fixture put our plugin there
        assert st["nixl_installed"] and st["installed_copy_current"] and st["nixl_sees_tether"], st
        r = subprocess.run([sys.executable, "-m", "tether", "nixl", "status"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "NIXL sees it: yes" in r.stdout, r.stdout + r.stderr
        r = subprocess.run([sys.executable, "-m", "tether", "doctor", "--json"], capture_output=True, text=True,
                           timeout=120)
        import json
        n = json.loads(r.stdout)["nixl"]
        assert n["nixl_installed"] and n["nixl_version"] == nixl_site["version"] and n["nixl_sees_tether"], n
    with pytest.raises(tn.NixlError):
        tn.install(str(tmp_path / "missing"))
