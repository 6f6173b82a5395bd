"""Decode's own small side channel to prefill (vLLM uses a ZMQ socket for its NIXL handshake and the
request's kv_transfer_params): pickled dicts over one authenticated local socket."""
from __future__ import annotations

from multiprocessing.connection import Client, Connection, Listener


class SideChannel:
    def __init__(self, conn: Connection):
        self.conn = conn

    @classmethod
    def listen(cls, host: str, port: int, key: bytes) -> tuple[Listener, str]:
        lst = Listener((host, port), authkey=key)
        return lst, "%s:%d" % lst.address

    @classmethod
    def accept(cls, lst: Listener) -> "SideChannel":
        return cls(lst.accept())

    @classmethod
    def connect(cls, address: str, key: bytes) -> "SideChannel":
        host, port = address.rsplit(":", 1)
        return cls(Client((host, int(port)), authkey=key))

    def send(self, op: str, **fields) -> None:
        self.conn.send(dict(fields, op=op))

    def recv(self, timeout: float, want: str | None = None) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"side channel: nothing from the other side within {timeout:.0f} s")
        msg = self.conn.recv()
        if want is not None and msg.get("op") != want:
            raise RuntimeError(f"side channel: expected {want!r}, got {msg.get('op')!r}: {msg.get('error', '')}")
        return msg

    def close(self) -> None:
        self.conn.close()
