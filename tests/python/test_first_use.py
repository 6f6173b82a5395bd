"""What a new user meets first: a transfer moves exactly the bytes asked for or fails naming both ranges
(never a silent short transfer), descriptors as .hex() text in every call, a closed endpoint that says
so on every call, a connect to something that is not tether naming where it went, arrays in Fortran order, metadata and
descriptors as .hex() text, and the README's names and examples as written.
Real sockets, random data, poisoned destinations, every byte checked."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import tether
from tether_testutil.cli import ROOT, TETHER_PATH
from tether_testutil.data import KiB, MiB, assert_bytes_equal, assert_poison, poisoned, rand_bytes, wait_error

T = 20.0


@pytest.fixture(params=["tcp", "ipc"])
def link(request, endpoints):
    """(initiator, target endpoint, peer) over one transport, two endpoints of this process."""
    a = endpoints(name="a", transport=request.param)
    b = endpoints(name="b", transport=request.param)
    return a, b, a.connect(b.metadata(), timeout=10)


def _refused(t, *parts):
    """The transfer fails with OutOfRange whose message names every part (both ranges, both sizes)."""
    e = wait_error(t, T)
    assert isinstance(e, tether.OutOfRange), repr(e)
    for p in parts:
        assert p in str(e), (p, str(e))


def test_default_length_is_the_local_region_and_a_short_remote_fails_naming_both_ranges(link):
    """The first hour's short transfers: a 2 MiB region into a 1 MiB descriptor used to move 1 MiB and
    say ok; a 4 KiB block at 1 MiB - 100 moved 100 bytes; past the end complained of a length never
    given. Each now fails before a byte moves, naming both ranges; read the same."""
    a, b, peer = link
    dst = poisoned(MiB)
    desc = b.register(dst).descriptor()
    big = a.register(rand_bytes(1, 2 * MiB))
    block = a.register(rand_bytes(2, 4 * KiB))
    _refused(peer.write(big, desc), "remote range [0, +2097152) exceeds the descriptor's 1048576 bytes",
             "local range [0, +2097152) of a local region of 2097152 bytes")
    _refused(peer.write(block, desc, remote_offset=MiB - 100), "remote range [1048476, +4096)", "local range [0, +4096)")
    _refused(peer.write(block, desc, remote_offset=2 * MiB), "remote range [2097152, +4096)", "1048576 bytes")
    _refused(peer.write(block, desc, local_offset=5 * KiB), "local range [5120, +0) exceeds local region of 4096")
    assert_poison(dst, "the target of every refused write")
    into = poisoned(4 * KiB)
    _refused(peer.read(a.register(into), desc, remote_offset=MiB - 100), "remote range [1048476, +4096)")
    assert_poison(into, "the destination of a refused read")
    # What fits moves whole: the 4 KiB block at 1 MiB - 4 KiB, every byte, the rest still poison.
    t = peer.write(block, desc, remote_offset=MiB - 4 * KiB).wait(T)
    assert t.bytes == 4 * KiB
    assert_bytes_equal(dst[MiB - 4 * KiB:], rand_bytes(2, 4 * KiB), "the block")
    assert_poison(dst[:MiB - 4 * KiB], "the bytes before the block")
    assert peer.read(a.register(into), desc, remote_offset=MiB - 4 * KiB).wait(T).bytes == 4 * KiB
    assert_bytes_equal(into, rand_bytes(2, 4 * KiB), "the block read back")


def test_vectored_and_block_calls_refuse_the_same_range_with_the_same_words(link):
    a, b, peer = link
    dst = poisoned(MiB)
    desc = b.register(dst).descriptor()
    block = a.register(rand_bytes(3, 4 * KiB))
    words = ("remote range [1048476, +4096) exceeds the descriptor's 1048576 bytes "
             "(local range [0, +4096) of a local region of 4096 bytes)")
    _refused(peer.write(block, desc, remote_offset=MiB - 100), words)
    _refused(peer.write(block, desc, remote_offset=MiB - 100, length=4 * KiB), words)
    _refused(peer.writev([(block, 0, desc, MiB - 100, 4 * KiB)]), words)
    _refused(peer.readv([(block, 0, desc, MiB - 100, 4 * KiB)]), words)
    _refused(peer.writev_blocks(block, desc, [0], [MiB - 100], 4 * KiB), words)
    _refused(peer.readv_blocks(block, desc, [0], [MiB - 100], 4 * KiB), words)
    _refused(peer.writev([(block, 0, desc, 0, 8), (block, 0, desc, MiB - 100, 4 * KiB)]), words + " (entry 1)")
    assert_poison(dst, "the target of every refused transfer")


def test_descriptors_as_hex_text_work_in_every_call(link):
    """writev/readv took descriptor bytes only, while write/read/connect/*_blocks took their .hex() text."""
    a, b, peer = link
    dst = poisoned(64 * KiB)
    text = b.register(dst).descriptor().hex()
    src = a.register(rand_bytes(4, 64 * KiB))
    peer.writev([(src, 0, text, 0, 16 * KiB), (src, 16 * KiB, text, 16 * KiB, 16 * KiB)]).wait(T)
    peer.write(src, text, local_offset=32 * KiB, remote_offset=32 * KiB, length=16 * KiB).wait(T)
    peer.writev_blocks(src, text, [48 * KiB], [48 * KiB], 16 * KiB).wait(T)
    assert_bytes_equal(dst, rand_bytes(4, 64 * KiB), "written by hex descriptors")
    back = poisoned(64 * KiB)
    rb = a.register(back)
    peer.readv([(rb, 0, text, 0, 32 * KiB)]).wait(T)
    peer.read(rb, text, local_offset=32 * KiB, remote_offset=32 * KiB, length=16 * KiB).wait(T)
    peer.readv_blocks(rb, text, [48 * KiB], [48 * KiB], 16 * KiB).wait(T)
    assert_bytes_equal(back, rand_bytes(4, 64 * KiB), "read by hex descriptors")
    with pytest.raises(tether.InvalidArgument, match="base64 must be decoded first"):
        peer.writev([(src, 0, "not hex", 0, 8)])


def test_every_call_on_a_closed_endpoint_says_endpoint_closed(endpoints):
    """After close(), peer.write said "RegionNotFound: local region 1 is deregistered" and register() and
    metadata() still worked."""
    a, b = endpoints(transport="tcp"), endpoints(transport="tcp")
    dst = poisoned(4 * KiB)
    desc = b.register(dst).descriptor()
    src = a.register(rand_bytes(5, 4 * KiB))
    peer = a.connect(b.metadata(), timeout=10)
    a.close()
    a.close()  # idempotent
    calls = {
        "metadata": a.metadata, "register": lambda: a.register(np.zeros(8, np.uint8)),
        "deregister": lambda: a.deregister(src), "connect": lambda: a.connect(b.metadata(), timeout=2),
        "peers": a.peers, "stats": a.stats, "notifications": a.notifications, "transports": a.transports,
        "write": lambda: peer.write(src, desc).wait(T), "read": lambda: peer.read(src, desc).wait(T),
        "writev": lambda: peer.writev([(src, 0, desc, 0, 8)]).wait(T),
        "readv_blocks": lambda: peer.readv_blocks(src, desc, [0], [0], 8).wait(T),
        "send": lambda: peer.send(src).wait(T), "recv": lambda: peer.recv(src).wait(T),
        "notify": lambda: peer.notify(b"x").wait(T),
    }
    for name, call in calls.items():
        with pytest.raises(tether.Cancelled, match="^endpoint closed$"):
            call()
            pytest.fail(f"{name} on a closed endpoint did not raise")
    assert_poison(dst, "the target of a closed endpoint's writes")
    assert "Endpoint(" in repr(a)  # still printable


@pytest.mark.budget(30)
def test_a_listener_that_never_answers_the_handshake_is_named(endpoints):
    """Something that accepts TCP but never speaks tether: the error names the address and says what that
    usually means (it said "handshake: socket operation timed out", no address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        where = f"127.0.0.1:{s.getsockname()[1]}"
        ep = endpoints(transport="tcp")
        t0 = time.monotonic()
        with pytest.raises(tether.TransferTimeout) as e:
            ep.connect(where, timeout=1)
        assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert msg.startswith(f"connect to {where}: "), msg
    assert "never answered the handshake" in msg and "is a tether endpoint listening there" in msg, msg


def _readme_blocks(title: str) -> list:
    """The ```python blocks of the README section `## title`."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]


@pytest.mark.budget(90)
def test_the_readme_examples_run_as_pasted(tmp_path):
    """The README's usage example could not run (one block for two processes, helpers never defined):
    its quick start, its two-process pair and its tour now run as they are written."""
    env = dict(os.environ, PYTHONPATH=TETHER_PATH)
    for title in ("Quick start", "More of the API"):
        (code,) = _readme_blocks(title)
        assert len(code.splitlines()) <= 25, f"{title}: more than a screen"
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{title}:\n{r.stdout}{r.stderr}"
    target, initiator = _readme_blocks("Two processes")
    (tmp_path / "target.py").write_text(target)
    (tmp_path / "initiator.py").write_text(initiator)
    t = subprocess.Popen([sys.executable, "target.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = t.stdout.readline().split()
        r = subprocess.run([sys.executable, "initiator.py", *line], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        out = t.stdout.readline()  # the target reports the notification, then serves on until stopped
    finally:
        t.kill()
        t.wait(10)
    assert "sent b'layer-7'; the buffer starts [7 7 7 7]" in out, out


# ---------------------------------------------------------------- API and README

def test_fortran_ordered_array_registers_and_moves():
    with tether.Endpoint() as a, tether.Endpoint() as b:
        src = np.asfortranarray(np.random.default_rng(3).integers(0, 256, (64, 48), dtype=np.uint8))
        dst = np.zeros((64, 48), dtype=np.uint8, order="F")
        rs, rd = a.register(src), b.register(dst)
        assert rs.size == src.nbytes and rs.ptr == src.ctypes.data
        a.connect(b.metadata(), timeout=10).write(rs, rd.descriptor()).wait(10)
        assert np.array_equal(dst, src)
        with pytest.raises(tether.InvalidArgument, match=r"np\.ascontiguousarray"):
            a.register(np.zeros((64, 64), np.uint8)[:, :8])


def test_readme_names_work_as_written():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "tether.Endpoint.transports()" in readme  # as written there: on the class, and on an endpoint
    assert tether.Endpoint.transports()["tcp"] == ""
    assert tether.Endpoint.transports(transport="tcp")["tcp"] == ""
    with tether.Endpoint() as ep:
        assert ep.transports() == tether.Endpoint.transports()
    assert tether.Endpoint.__init__.__doc__ and tether.Endpoint.peers.__doc__
    assert "bytes" in tether.Endpoint.metadata.__doc__ and "hex" in tether.Region.descriptor.__doc__


def test_hex_text_of_metadata_and_descriptors_is_accepted():
    """What a text channel (JSON, a store) carries: .hex() of the bytes, passed on as it is."""
    with tether.Endpoint() as a, tether.Endpoint() as b:
        dst = np.zeros(4096, np.uint8)
        src = np.arange(4096, dtype=np.uint32).astype(np.uint8)
        rd, rs = b.register(dst), a.register(src)
        peer = a.connect(b.metadata().hex(), timeout=10)
        peer.write(rs, rd.descriptor().hex()).wait(10)
        assert np.array_equal(dst, src)
        peer.writev_blocks(rs, rd.descriptor(0, 64).hex(), [0], [0], 64).wait(10)
        with pytest.raises(tether.InvalidArgument, match="base64"):
            a.connect("VFRSTQMAhbDUYZeHCjcunoPFm6MyW", timeout=5)
        with pytest.raises(tether.InvalidArgument, match="base64"):
            peer.write(rs, "zz", length=4)
