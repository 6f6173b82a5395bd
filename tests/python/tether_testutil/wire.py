"""Byte layouts of src/core/wire.h and of region descriptors, to craft or read handshake messages,
frames and descriptors by hand."""
from __future__ import annotations

import os
import struct
from typing import Optional


# Layouts from src/core/wire.h.
WIRE_MAGIC = 0x52485454            # "TTHR", little-endian u32
WIRE_VERSION = 9                   # wire::kVersion
CLIENT_HELLO_SIZE = 169
SERVER_HELLO_SIZE = 188  # then offers_length bytes of transport offers (control sockets)
CLIENT_PROOF_SIZE = 56
SERVER_DONE_SIZE = 8
HELLO_VERSION_MISMATCH = 1
HELLO_AUTH_FAILED = 2
HELLO_BAD_REQUEST = 3
HELLO_NOT_SAME_HOST = 5  # the connector chose a same-host transport and did not prove it shares the host
SOCKET_CONTROL = 1
SOCKET_DATA = 2


# Descriptor layout (64 bytes): magic u32, version u8, kind u8, reserved u16, endpoint id 16 B,
# region_id u32 @24, device i32 @28, offset u64 @32, length u64 @40, key u64 @48, reserved u64 @56.
DESC_SIZE = 64
DESC_KIND = 5  # 0 host memory, 1 GPU
DESC_REGION_ID = 24
DESC_OFFSET = 32
DESC_LENGTH = 40
DESC_KEY = 48
DESCRIPTOR = struct.Struct("<4sBBH16sIiQQQQ")  # src/core/region.cc, EncodedDescriptor


def descriptor(endpoint: bytes, region_id: int, length: int, key: int, kind: int = 0, device: int = -1,
               offset: int = 0) -> bytes:
    """A descriptor (no transport extensions) as a peer that owns the region would send it."""
    return DESCRIPTOR.pack(b"TTRD", 1, kind, 0, endpoint, region_id, device, offset, length, key, 0)


def descriptor_extension(desc: bytes, name: bytes) -> tuple[int, bytes]:
    """(offset in desc, bytes) of a transport's extension after the descriptor's 64 fixed bytes:
    each is u8 name length, name, u32 body length, body."""
    at = DESC_SIZE
    while at < len(desc):
        n = desc[at]
        (length,) = struct.unpack_from("<I", desc, at + 1 + n)
        body = at + 5 + n
        if desc[at + 1:at + 1 + n] == name:
            return body, bytes(desc[body:body + length])
        at = body + length
    raise AssertionError(f"descriptor has no {name.decode()} extension")


def set_u64(desc: bytes, at: int, value: int) -> bytes:
    b = bytearray(desc)
    struct.pack_into("<Q", b, at, value)
    return bytes(b)


def set_u32(desc: bytes, at: int, value: int) -> bytes:
    b = bytearray(desc)
    struct.pack_into("<I", b, at, value)
    return bytes(b)


def get_u64(desc: bytes, at: int) -> int:
    return struct.unpack_from("<Q", desc, at)[0]


def client_hello(version: int = WIRE_VERSION, kind: int = SOCKET_CONTROL, lanes: int = 1, lane: int = 0,
                 has_token: int = 0, magic: int = WIRE_MAGIC, name: bytes = b"raw", host_id: bytes = bytes(32),
                 transports: int = 0, max_notify: int = 1 << 20) -> bytes:
    """A ClientHello (169 bytes): magic u32, version u16, kind u8, has_token u8, endpoint id 16,
    nonce 16, session u64, lane u32, lanes u32, peer timeout ms u32, host id 32, name 64, chunk bytes u64,
    transports u8 (bits: tcp 1, ipc 2, fabric 4, netplugin 8; 0 = any), max notification u32.
    `host_id`: the listener's (host_id_of(its metadata)) to pose as a same-host peer."""
    msg = struct.pack("<IHBB16s16sQIII32s64sQBI", magic, version, kind, has_token, os.urandom(16),
                      os.urandom(16), int.from_bytes(os.urandom(8), "little"), lane, lanes, 10000, host_id,
                      name.ljust(64, b"\0")[:64], 0, transports, max_notify)
    assert len(msg) == CLIENT_HELLO_SIZE
    return msg


def host_id_of(metadata: bytes) -> bytes:
    """The host id inside an endpoint's metadata (src/core/handshake.h, MetadataHeader)."""
    return metadata[24:56]


def parse_server_hello(b: bytes) -> dict:
    magic, version, status, has_token = struct.unpack_from("<IHBB", b, 0)
    return {"magic": magic, "version": version, "status": status, "has_token": has_token,
            "name": b[108:172].split(b"\0")[0].decode(errors="replace"),
            "offers_length": struct.unpack_from("<I", b, 172)[0]}


def server_hello(host_id: bytes, offers: dict, version: int = WIRE_VERSION, name: bytes = b"fake",
                 endpoint_id: Optional[bytes] = None) -> bytes:
    """A ServerHello (188 bytes) and its transport offers, as a (possibly hostile) listener sends them:
    magic u32, version u16, status u8, has_token u8, endpoint id 16, nonce 16, proof 32, peer timeout
    ms u32, host id 32, name 64, offers length u32, chunk bytes u64, max notification u32; then per
    offer: name length u8, name, length u32, bytes."""
    raw = b"".join(bytes([len(k)]) + k.encode() + struct.pack("<I", len(v)) + v for k, v in offers.items())
    msg = struct.pack("<IHBB16s16s32sI32s64sIQI", WIRE_MAGIC, version, 0, 0, endpoint_id or os.urandom(16), os.urandom(16),
                      bytes(32), 10000, host_id, name.ljust(64, b"\0")[:64], len(raw), 0, 1 << 20)
    assert len(msg) == SERVER_HELLO_SIZE
    return msg + raw


def parse_client_hello(b: bytes) -> dict:
    """The fields of a ClientHello a test listener needs: session and host id."""
    session, = struct.unpack_from("<Q", b, 40)
    return {"magic": struct.unpack_from("<I", b, 0)[0], "session": session, "host_id": b[60:92]}


def client_proof(transport: bytes = b"tcp", lanes: int = 1, proof: bytes = bytes(32), offer: bytes = b"") -> bytes:
    """A ClientProof (56 bytes): HMAC 32, chosen transport 16 (control sockets; empty for data
    sockets), lanes u32, offer length u32, then the connector's offer for that transport."""
    return struct.pack("<32s16sII", proof, transport.ljust(16, b"\0"), lanes, len(offer)) + offer


FRAME = struct.Struct("<BBHIIIQQQQQ")  # wire::FrameHeader: type, status, flags, slot, gen, region_id, key,


                                       # desc_offset, desc_length, offset, length
FRAGMENT = struct.Struct("<IIQQQQQ")   # wire::Fragment: region_id, reserved, key, desc_offset, desc_length, offset, length
KWRITE, KACK, KREAD_RESP, KWRITE_BATCH, KREAD_BATCH = 1, 2, 4, 6, 7  # wire::FrameType


def fragment(desc: bytes, offset: int, length: int, key_xor: int = 0) -> bytes:
    """A wire::Fragment for `length` bytes at absolute `offset` of the region `desc` describes."""
    region = struct.unpack_from("<I", desc, DESC_REGION_ID)[0]
    return FRAGMENT.pack(region, 0, get_u64(desc, DESC_KEY) ^ key_xor, get_u64(desc, DESC_OFFSET),
                         get_u64(desc, DESC_LENGTH), offset, length)


def frame(kind: int, slot: int, desc: bytes = b"", offset: int = 0, length: int = 0, region_id: Optional[int] = None) -> bytes:
    """A wire::FrameHeader from an initiator (gen 1): a kWrite's fields from `desc`, or `region_id` as given
    (a batch's fragment count)."""
    if desc:
        rid = struct.unpack_from("<I", desc, DESC_REGION_ID)[0] if region_id is None else region_id
        return FRAME.pack(kind, 0, 0, slot, 1, rid, get_u64(desc, DESC_KEY), get_u64(desc, DESC_OFFSET),
                          get_u64(desc, DESC_LENGTH), offset, length)
    return FRAME.pack(kind, 0, 0, slot, 1, region_id or 0, 0, 0, 0, offset, length)


KPULL = 8  # wire::FrameType::kPull


def pull(token: int, desc: bytes, offset: int, length: int, key_xor: int = 0, region_id: Optional[int] = None,
         flags: int = 0, gen: int = 0) -> bytes:
    """A kPull frame (for a data socket): the recv token in `slot`, the range as a kReadReq names it."""
    rid = struct.unpack_from("<I", desc, DESC_REGION_ID)[0] if region_id is None else region_id
    return FRAME.pack(KPULL, 0, flags, token, gen, rid, get_u64(desc, DESC_KEY) ^ key_xor, get_u64(desc, DESC_OFFSET),
                      get_u64(desc, DESC_LENGTH), offset, length)
