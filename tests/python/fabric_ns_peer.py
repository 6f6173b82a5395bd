"""One side of test_fabric.py's two-namespace test, run inside a network namespace.

    fabric_ns_peer.py target IP          prints "ready METADATA_HEX", then "target ok" once the
                                         initiator's write (with its notification) is in place
    fabric_ns_peer.py initiator IP BLOB  reads the target's random region, writes its own into the
                                         target's poisoned one, sends a message; prints "initiator ok"
"""
import sys

import numpy as np

import tether

N = 9 * (1 << 20) + 777
FAB = dict(transport="fabric", fabric_provider="tcp")


def data(seed, n=N):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def target(ip):
    with tether.Endpoint(host=ip, **FAB) as ep:
        src = data(1)
        dst = np.full(N, 0xA5, np.uint8)
        inbox = np.full(N, 0xA5, np.uint8)
        d_src, d_dst = ep.register(src).descriptor(), ep.register(dst).descriptor()
        r_inbox = ep.register(inbox)
        print("ready", ":".join(x.hex() for x in (ep.metadata(), d_src, d_dst)), flush=True)
        notes = []
        while not notes:
            notes = ep.notifications(timeout=60)
        assert notes[0][2] == b"written", notes
        assert (dst == data(2)).all(), "written data incomplete at the notification"
        peer = ep.peers()[0]
        assert peer.transport == "fabric", peer.transport
        t = peer.recv(r_inbox, tag=3)
        t.wait(30)
        assert t.bytes == N and (inbox == data(3)).all(), "received message differs"
        print("target ok", flush=True)
        sys.stdin.read()  # until the test is done with us


def initiator(ip, blob_hex):
    meta, d_src, d_dst = (bytes.fromhex(x) for x in blob_hex.split(":"))
    with tether.Endpoint(host=ip, **FAB) as ep:
        peer = ep.connect(meta, timeout=10)
        assert peer.transport == "fabric", peer.transport
        back = np.full(N, 0xA5, np.uint8)
        peer.read(ep.register(back), d_src).wait(30)
        assert (back == data(1)).all(), "read data differs"
        peer.write(ep.register(data(2)), d_dst, notify=b"written").wait(30)
        peer.send(ep.register(data(3)), tag=3).wait(30)
        print("initiator ok", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "target":
        target(sys.argv[2])
    else:
        initiator(sys.argv[2], sys.argv[3])
