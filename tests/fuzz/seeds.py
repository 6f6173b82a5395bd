"""Seed inputs for fuzz_endpoint (tests/fuzz/fuzz_endpoint.cc): one well-formed example of every
message each mode parses, so the fuzzer starts past the magic numbers and mutates from there.
`python3 seeds.py DIR` writes them. The first byte of each is the mode; markers ("tthr-KEY", "RID!",
"tthr-HST...", "tthr-SES") are filled in by the harness."""
from __future__ import annotations

import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from tether_testutil.wire import client_hello, client_proof, descriptor, server_hello  # noqa: E402

HANDSHAKE, CONTROL, FRAMES, DECODERS, LISTENER, IPC_LANE, IPC_RING = range(7)
HOST = b"tthr-HST" + b"\0" * 24
KEY, RID, ADR = b"tthr-KEY", b"RID!", b"tthr-ADR"
REGION = 64 << 10
TCP, IPC, FABRIC = 1, 2, 4


def control(kind: int, body: bytes) -> bytes:
    return struct.pack("<IB3x", len(body), kind) + body


def frame(kind: int, length: int, region=RID, key=KEY, offset=0, desc=(0, REGION), slot=0, flags=0, gen=1) -> bytes:
    return (struct.pack("<BBHII", kind, 0, flags, slot, gen) + region + key +
            struct.pack("<QQQQ", desc[0], desc[1], offset, length))


def fragment(offset: int, length: int) -> bytes:
    return RID + b"\0" * 4 + KEY + struct.pack("<QQQQ", 0, REGION, offset, length)


def ipc_frame(kind: int, length: int, where: int, addr: bytes, region=RID, offset=0, slot=0) -> bytes:
    """An ipc lane message (src/transport/ipc/lane.h, Frame): the frame header, where the
    initiator's bytes are (1 cma: an address in it; 2 shm: an offset in its bounce area) and a CudaRef."""
    body = frame(kind, length, region=region, offset=offset, slot=slot) + bytes([where]) + b"\0" * 7 + addr + bytes(88)
    assert len(body) == 160
    return body


def messages(*ms: bytes) -> bytes:
    return b"".join(struct.pack("<H", len(m)) + m for m in ms)


def seeds() -> dict[str, bytes]:
    s: dict[str, bytes] = {}
    # 0: a stranger's first bytes
    s["hs_tcp"] = bytes([HANDSHAKE]) + client_hello(transports=TCP) + client_proof(b"tcp", lanes=1)
    s["hs_tcp_two_lanes"] = bytes([HANDSHAKE]) + client_hello(transports=TCP, lanes=2) + client_proof(b"tcp", lanes=2)
    ipc_offer = struct.pack("<HQQ", 6, 0, 0)
    s["hs_ipc_claim"] = (bytes([HANDSHAKE]) + client_hello(host_id=HOST, transports=IPC) +
                         client_proof(b"ipc", lanes=1, offer=ipc_offer))
    s["hs_fabric"] = (bytes([HANDSHAKE]) + client_hello(transports=FABRIC) +
                      client_proof(b"fabric", lanes=1, offer=b"\0" * 64))
    s["hs_data"] = bytes([HANDSHAKE]) + client_hello(kind=2, lanes=1) + client_proof(b"", lanes=1)
    s["hs_old_version"] = bytes([HANDSHAKE]) + client_hello(version=3)
    # 1: control messages of a connected peer
    msgs = [control(1, b""), control(2, struct.pack("<Q", 1) + b"hello"),
            control(3, struct.pack("<QB7x", 1, 0)), control(4, struct.pack("<QQQ", 1, 0, 4096)),
            control(5, struct.pack("<QIB3x", 1, 0, 0)), control(6, struct.pack("<I", 0)),
            # a pulled read's refusal (not ours to send: a protocol error) and its cancel; 7 (kPull before
            # wire v8, now a frame) is no control message any more
            control(8, struct.pack("<IB3x", 5, 2)), control(9, struct.pack("<I", 5)),
            control(7, struct.pack("<I", 5) + RID + KEY + struct.pack("<QQQQ", 0, REGION, 100, 4096))]
    for i, m in enumerate(msgs):
        s[f"ctl_{i}"] = bytes([CONTROL]) + m
    s["ctl_all"] = bytes([CONTROL]) + b"".join(msgs)
    # 2: frames on its data socket
    s["fr_write"] = bytes([FRAMES]) + frame(1, 16, offset=100) + bytes(range(16))
    s["fr_write_sub"] = bytes([FRAMES]) + frame(1, 8, offset=4096 + 8, desc=(4096, 4096)) + b"x" * 8
    s["fr_read"] = bytes([FRAMES]) + frame(3, 4096)
    s["fr_send"] = bytes([FRAMES]) + frame(5, 8, region=b"\0" * 4, key=struct.pack("<Q", 1 << 20)) + b"y" * 8
    s["fr_batch"] = (bytes([FRAMES]) + frame(6, 24, region=struct.pack("<I", 2)) + fragment(0, 16) +
                     fragment(1000, 8) + b"z" * 24)
    s["fr_read_batch"] = (bytes([FRAMES]) + frame(7, 24, region=struct.pack("<I", 2)) + fragment(0, 16) +
                          fragment(1000, 8))
    s["fr_read_batch_bad"] = (bytes([FRAMES]) + frame(7, 99, region=struct.pack("<I", 3)) + fragment(0, 16) +
                              fragment(1000, 0) + fragment(70000, 8))
    s["fr_pull"] = bytes([FRAMES]) + frame(8, 4096, offset=100, slot=5, gen=0)  # wire v8: token in slot
    s["fr_pull_resent"] = bytes([FRAMES]) + frame(8, 4096, slot=5, gen=0) + frame(8, 4096, slot=5, flags=1, gen=0)
    s["fr_ack"] = bytes([FRAMES]) + frame(2, 0)
    s["fr_resent"] = bytes([FRAMES]) + frame(1, 4, flags=1) + b"abcd"
    s["fr_two"] = bytes([FRAMES]) + frame(1, 4) + b"abcd" + frame(3, 4, offset=4)
    # 3: pure parsers
    offers = b"".join(bytes([len(n)]) + n + struct.pack("<I", len(v)) + v
                      for n, v in ((b"tcp", b""), (b"ipc", ipc_offer + b"tether-ipc-0123456789abcdef")))
    s["dec_offers"] = bytes([DECODERS]) + offers
    s["dec_nics"] = bytes([DECODERS]) + b"eth0 10.0.0.2/24\nib0 fe80::1/64\n"
    desc = descriptor(b"\0" * 16, 1, REGION, 0)
    s["dec_descriptor"] = bytes([DECODERS]) + desc + b"ext"
    # 4: a listener's answers to the target's connect
    sh_tcp = server_hello(bytes(32), {"tcp": b""})
    done = struct.pack("<BBH4x", 0, 0, 17) + b"lo 127.0.0.1/8\n"[:17].ljust(17, b"\n")
    s["ls_tcp"] = bytes([LISTENER]) + sh_tcp + done
    s["ls_ipc"] = (bytes([LISTENER]) + server_hello(HOST, {"ipc": b"\6\0" + b"tthr-SES" + b"\0" * 8 + b"tether-ipc-x"}) +
                   struct.pack("<BBH4x", 0, 0, 0))
    s["ls_refused"] = bytes([LISTENER]) + server_hello(bytes(32), {"tcp": b""}) + struct.pack("<BBH4x", 3, 0, 0)
    s["ls_fabric"] = bytes([LISTENER]) + server_hello(bytes(32), {"fabric": b"\0" * 64, "tcp": b""})
    # 5: an ipc peer's lane
    zero = struct.pack("<Q", 0)
    s["ipc_write_cma"] = bytes([IPC_LANE]) + messages(ipc_frame(1, 64, 1, ADR, offset=128))
    s["ipc_write_shm"] = bytes([IPC_LANE]) + messages(ipc_frame(1, 64, 2, zero))
    s["ipc_read"] = bytes([IPC_LANE]) + messages(ipc_frame(3, 4096, 1, zero), ipc_frame(0x40, 0, 0, zero))
    s["ipc_read_shm"] = bytes([IPC_LANE]) + messages(ipc_frame(3, 4096, 2, zero))
    entry = lambda off, n, addr: fragment(off, n) + addr + struct.pack("<II", 0, 0)  # noqa: E731
    s["ipc_batch"] = bytes([IPC_LANE]) + messages(ipc_frame(6, 48, 1, zero, region=struct.pack("<I", 2)) +
                                                   entry(0, 16, ADR) + entry(512, 32, ADR))
    s["ipc_release"] = bytes([IPC_LANE]) + messages(ipc_frame(0x41, 0, 0, zero))
    s["ipc_send"] = bytes([IPC_LANE]) + messages(ipc_frame(5, 8, 1, ADR, region=b"\0" * 4))
    s["ipc_ack"] = bytes([IPC_LANE]) + messages(ipc_frame(2, 0, 0, zero))
    s["ipc_write_inline"] = bytes([IPC_LANE]) + messages(ipc_frame(1, 16, 4, zero, offset=64) + b"i" * 16)
    # 6: the same peer's message ring: well-formed records, then raw bytes with a head index
    s["ring_records"] = bytes([IPC_RING, 0]) + messages(ipc_frame(1, 16, 4, zero) + b"r" * 16,
                                                         ipc_frame(1, 64, 1, ADR, offset=128), ipc_frame(3, 64, 1, zero))
    record = struct.pack("<II", 176, 0) + ipc_frame(1, 16, 4, zero) + b"q" * 16
    s["ring_raw"] = bytes([IPC_RING, 1]) + struct.pack("<Q", len(record)) + record
    return s


def write(directory: str) -> int:
    os.makedirs(directory, exist_ok=True)
    made = seeds()
    for name, data in made.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    return len(made)


if __name__ == "__main__":
    print(write(sys.argv[1]), "seeds in", sys.argv[1])
