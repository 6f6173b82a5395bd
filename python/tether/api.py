"""The Python surface of tether: Endpoint, Region, Peer, Transfer (same words as the C++ API)."""
from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from tether import _tether

Remote = Union[bytes, str, _tether.RemoteRegion]  # str: a descriptor's .hex() text

# Constructor keywords and their kinds, from the option table (src/core/config.cc; each also has a
# TETHER_* environment override). Keywords of kind "seconds" are given in seconds, stored in the
# Config field keyword + "_ms"; every other keyword names its field.
_KINDS = {o["keyword"]: o["kind"] for o in _tether.options() if o["keyword"]}


def _set_option(cfg: "_tether.Config", key: str, value: Any) -> None:
    """Sets one Config field; a value of the wrong type or range is InvalidArgument naming the option
    (nanobind's own conversion error names neither). Text is parsed as the option's TETHER_* variable is
    ("4M", "yes", "2.5s"), by the same C++ parser."""
    if isinstance(value, str):
        cfg.set(key, value)
        return
    try:
        setattr(cfg, key, value)
    except (TypeError, ValueError, OverflowError):
        current = getattr(cfg, key)
        want = ("True or False" if isinstance(current, bool) else "a string" if isinstance(current, str)
                else "a non-negative integer in range")
        raise _tether.InvalidArgument(f"option {key}: expected {want}, got {value!r}") from None


def _set_seconds(cfg: "_tether.Config", key: str, value: Any) -> None:
    if not isinstance(value, str):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise _tether.InvalidArgument(f"{key} is in seconds: expected a number >= 0, got {value!r}")
        value = format(value, "f") if isinstance(value, float) else str(value)
    cfg.set(key, value)  # rounded to milliseconds as the variable's text is; inf is refused there


def _config(options: dict) -> "_tether.Config":
    """The Config an Endpoint with these keywords gets: defaults, then TETHER_* variables (a bad one is
    InvalidArgument naming it), then the keywords (None keeps the lower layers)."""
    cfg = _tether.Config.from_env()
    for key, value in options.items():
        if value is None:
            continue
        if key not in _KINDS:
            raise TypeError(f"Endpoint() got an unknown option {key!r}")
        (_set_seconds if _KINDS[key] == "seconds" else _set_option)(cfg, key, value)
    return cfg


def effective_options(**options: Any) -> list[dict]:
    """Every row of the option table as `Endpoint(**options)` would use it: keyword (None for a
    process-wide knob), env, kind, value (as the keyword takes it: seconds for timeouts; a secret shows
    as "(set)"), source ("keyword", "environment" or "default") and help. A bad TETHER_* variable or
    keyword raises InvalidArgument naming it, as Endpoint() would."""
    cfg = _config(options)
    _tether.Config.check_process_env()
    rows = []
    for o in _tether.options():
        kw, raw = o["keyword"], o["env_value"]
        source = ("keyword" if kw and options.get(kw) is not None else
                  "environment" if raw is not None else "default")
        value = cfg.get(kw) if kw else raw if raw is not None else o["default"]
        if "TOKEN" in o["env"] and value:
            value = "(set)"
        rows.append({"keyword": kw, "env": o["env"], "kind": o["kind"], "value": value, "source": source,
                     "help": o["help"]})
    return rows


def _keyword_doc() -> str:
    """The Endpoint docstring's list of keywords, one per row of the option table."""
    lines = []
    for o in _tether.options():
        if o["keyword"]:
            unit = " (seconds)" if o["kind"] == "seconds" else ""
            lines.append(f"    {o['keyword']}{unit} [{o['env']}; default {o['default'] or chr(34) * 2}]: {o['help']}")
    return "\n".join(lines)


_U64 = 1 << 64


def _check_u64(**values: Any) -> None:
    """Raises InvalidArgument naming the first argument that is not an integer in [0, 2**64)."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < _U64:
            raise _tether.InvalidArgument(f"{name} must be an integer in [0, 2**64), got {v!r}")


def _u64_args(call, **values: Any):
    """Runs `call()`; if the binding refuses an argument's type, says which one (InvalidArgument).
    Checked only on failure, so the common path costs nothing."""
    try:
        return call()
    except TypeError:
        _check_u64(**values)
        raise


class Notification(NamedTuple):
    peer_id: int
    peer_name: str
    data: bytes


class Transfer:
    """One asynchronous operation. `wait()` raises the transfer's typed error, if any."""

    __slots__ = ("_t",)

    def __init__(self, t: _tether.Transfer):
        self._t = t

    def done(self) -> bool:
        return self._t.done()

    def cancel(self) -> None:
        """Stops the transfer without blocking: no further chunk leaves; it ends with Cancelled once
        the chunks already in flight are answered. No effect once it is done."""
        self._t.cancel()

    def wait(self, timeout: Optional[float] = None) -> "Transfer":
        """Blocks until done (or `timeout` seconds: raises TransferTimeout, the transfer goes on)."""
        self._t._wait(-1.0 if timeout is None else float(timeout))
        return self

    @property
    def status(self) -> str:
        """"running", "ok" or "error" (see `error`)."""
        if not self._t.done():
            return "running"
        return "ok" if self._t._code == 0 else "error"

    @property
    def error(self) -> Optional[str]:
        return self._t._message if self._t.done() and self._t._code != 0 else None

    @property
    def bytes(self) -> int:
        """Payload bytes of the operation (for recv: the length of the message received)."""
        return self._t.bytes

    def __repr__(self) -> str:
        return f"Transfer(status={self.status!r}, bytes={self.bytes})"


class Region:
    """A registered memory range. Keeps the registered object alive until deregistered."""

    __slots__ = ("_r", "_obj", "__weakref__")

    def __init__(self, r: _tether.Region, obj: Any):
        self._r = r
        self._obj = obj

    id = property(lambda self: self._r.id)
    size = property(lambda self: self._r.size)
    ptr = property(lambda self: self._r.ptr)
    readonly = property(lambda self: self._r.readonly)
    kind = property(lambda self: self._r.kind)
    device = property(lambda self: self._r.device, doc="GPU index, or -1 for host memory")

    def descriptor(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        """Bytes (binary; a RemoteRegion) granting access to [offset, offset+length) and nothing else
        (default: the whole region). Send them to the peer that will access it; over a text channel
        use `.hex()` / `bytes.fromhex()` (or base64)."""
        return _u64_args(lambda: self._r.descriptor(offset, length), offset=offset,
                         **({} if length is None else {"length": length}))

    def __repr__(self) -> str:
        return f"Region(id={self.id}, size={self.size}, kind={self.kind!r})"


def _notify_arg(notify: Optional[bytes]) -> bytes:
    if notify is not None and len(notify) == 0:
        raise _tether.InvalidArgument("notify= must not be empty (None means no notification)")
    return bytes(notify) if notify is not None else b""


def _remote(r: Remote) -> _tether.RemoteRegion:
    if isinstance(r, _tether.RemoteRegion):
        return r
    if isinstance(r, str):  # a descriptor that crossed a text channel as .hex()
        try:
            r = bytes.fromhex(r)
        except ValueError:
            raise _tether.InvalidArgument("a descriptor is bytes (or their .hex() text); got other text "
                                          "(base64 must be decoded first)") from None
    return _tether.RemoteRegion(bytes(r))


def _rest(local: "Region", offset: Any) -> int:
    """The default length of write/read: the local region from `offset` to its end (0 past its end, which
    the core then refuses as out of range, naming both ranges)."""
    try:
        return max(0, local._r.size - offset)
    except TypeError:
        _check_u64(local_offset=offset)
        raise


Offsets = Union[Sequence[int], np.ndarray]


def _column(values: Offsets, name: str) -> np.ndarray:
    """One column of blocks as the core reads it: a 1-D C-contiguous uint64 array of non-negative
    integers (no copy if it already is one)."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise _tether.InvalidArgument(f"{name} must be one-dimensional, got shape {a.shape}")
    if a.dtype == np.uint64 and a.flags.c_contiguous:
        return a
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.size and a.dtype.kind == "i" and a.min() < 0:
        raise _tether.InvalidArgument(f"{name} must not be negative (block {int(np.argmax(a < 0))})")
    return np.ascontiguousarray(a, dtype=np.uint64)


def _columns(local_offsets: Offsets, remote_offsets: Offsets, lengths: Union[int, Offsets]):
    """(local offsets, remote offsets, lengths) as the core reads them in place: two uint64 columns, and
    one int for every block or a third column."""
    lo = _column(local_offsets, "local_offsets")
    ro = _column(remote_offsets, "remote_offsets")
    if lo.size != ro.size:
        raise _tether.InvalidArgument(f"local_offsets has {lo.size} blocks but remote_offsets has {ro.size}")
    if isinstance(lengths, (int, np.integer)) and not isinstance(lengths, (bool, np.bool_)):
        if lengths < 0 or lengths >= 1 << 64:
            raise _tether.InvalidArgument(f"lengths must be in [0, 2**64), got {lengths}")
        return lo, ro, int(lengths)
    n = _column(lengths, "lengths")
    if n.size != lo.size:
        raise _tether.InvalidArgument(f"lengths has {n.size} entries for {lo.size} blocks")
    return lo, ro, n


class Peer:
    """The link to another endpoint. Every operation is asynchronous and returns a Transfer."""

    __slots__ = ("_p",)

    def __init__(self, p: _tether.Peer):
        self._p = p

    id = property(lambda self: self._p.id)
    name = property(lambda self: self._p.name)
    transport = property(lambda self: self._p.transport, doc="the transport carrying this peer's data")
    connected = property(lambda self: self._p.connected)
    error = property(lambda self: self._p.error)

    def _rma(self, call, local: Region, remote: Remote, local_offset, remote_offset, length, notify) -> Transfer:
        # _u64_args inlined: a lone small op costs little more than this call, so no closure and no
        # keyword dict on the way in.
        if isinstance(remote, str):
            remote = _remote(remote)
        if length is None:
            length = _rest(local, local_offset)
        try:
            return Transfer(call(local._r, local_offset, remote, remote_offset, length,
                                 b"" if notify is None else _notify_arg(notify)))
        except TypeError:
            _check_u64(local_offset=local_offset, remote_offset=remote_offset, length=length)
            raise

    def write(self, local: Region, remote: Remote, *, local_offset: int = 0, remote_offset: int = 0,
              length: Optional[int] = None, notify: Optional[bytes] = None) -> Transfer:
        """Local [local_offset, +length) -> remote [remote_offset, +length): exactly `length` bytes, or
        OutOfRange naming both ranges where either side is too short (nothing moves). Default length:
        the rest of the local region (`local.size - local_offset`), which the remote range must hold
        from `remote_offset` on. `remote`: a descriptor (bytes, its .hex() text, or a RemoteRegion).
        `notify` reaches the target only after the data is in place."""
        return self._rma(self._p.write, local, remote, local_offset, remote_offset, length, notify)

    def read(self, local: Region, remote: Remote, *, local_offset: int = 0, remote_offset: int = 0,
             length: Optional[int] = None, notify: Optional[bytes] = None) -> Transfer:
        """Remote [remote_offset, +length) -> local [local_offset, +length); length and errors as for `write`.
        `notify` reaches the target once every byte has arrived here (it may then reuse its memory)."""
        return self._rma(self._p.read, local, remote, local_offset, remote_offset, length, notify)

    def writev(self, entries: Sequence[Tuple[Region, int, Remote, int, int]],
               notify: Optional[bytes] = None) -> Transfer:
        """Many (local region, local offset, remote, remote offset, length) as one transfer; a remote is
        a descriptor as for `write` (bytes, .hex() text or RemoteRegion). Exactly the lengths given move,
        or nothing does: OutOfRange names the entry and both of its ranges."""
        return Transfer(self._p.writev(entries, _notify_arg(notify)))

    def readv(self, entries: Sequence[Tuple[Region, int, Remote, int, int]],
              notify: Optional[bytes] = None) -> Transfer:
        """Many (local region, local offset, remote, remote offset, length) read as one transfer."""
        return Transfer(self._p.readv(entries, _notify_arg(notify)))

    def writev_blocks(self, local: Region, remote: Remote, local_offsets: Offsets, remote_offsets: Offsets,
                      lengths: Union[int, Offsets], notify: Optional[bytes] = None) -> Transfer:
        """Block i: local [local_offsets[i], +lengths[i]) -> remote [remote_offsets[i], +lengths[i]),
        all blocks as one transfer between one local region and one remote range (the KV-cache
        pattern). Offsets: sequences or numpy integer arrays of equal length (uint64 arrays are used
        as they are); `lengths`: one int for every block, or one per block; zero-length blocks are
        allowed. Checked like `writev` before any byte moves; errors name the block ("(block 17)").
        Much cheaper to post than `writev` with a tuple per block."""
        return Transfer(self._p.writev_blocks(local._r, _remote(remote) if isinstance(remote, str) else remote,
                                              *_columns(local_offsets, remote_offsets, lengths), _notify_arg(notify)))

    def readv_blocks(self, local: Region, remote: Remote, local_offsets: Offsets, remote_offsets: Offsets,
                     lengths: Union[int, Offsets], notify: Optional[bytes] = None) -> Transfer:
        """Block i: remote [remote_offsets[i], +lengths[i]) -> local [local_offsets[i], +lengths[i]);
        arguments as for `writev_blocks`."""
        return Transfer(self._p.readv_blocks(local._r, _remote(remote) if isinstance(remote, str) else remote,
                                             *_columns(local_offsets, remote_offsets, lengths), _notify_arg(notify)))

    def send(self, local: Region, *, offset: int = 0, length: Optional[int] = None, tag: int = 0) -> Transfer:
        """Two-sided: matched by the peer's recv with the same tag, in posting order."""
        return self._two_sided(self._p.send, local, offset, length, tag)

    def recv(self, local: Region, *, offset: int = 0, length: Optional[int] = None, tag: int = 0) -> Transfer:
        """Posts room for one message; `Transfer.bytes` is its length once done."""
        return self._two_sided(self._p.recv, local, offset, length, tag)

    def _two_sided(self, call, local: Region, offset, length, tag) -> Transfer:
        if length is None:
            length = local.size - offset
        return Transfer(_u64_args(lambda: call(local._r, offset, length, tag), offset=offset, length=length, tag=tag))

    def notify(self, data: bytes) -> Transfer:
        return Transfer(self._p.notify(bytes(data)))

    # Blocking conveniences.
    def write_sync(self, *args, timeout: Optional[float] = None, **kw) -> Transfer:
        return self.write(*args, **kw).wait(timeout)

    def read_sync(self, *args, timeout: Optional[float] = None, **kw) -> Transfer:
        return self.read(*args, **kw).wait(timeout)

    def close(self) -> None:
        """Drops the link; transfers still running on it fail with Cancelled. Its sockets, shared
        memory and threads are let go before this returns, though this object lives on; anything
        posted on it afterwards fails with Cancelled."""
        self._p.close()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Peer) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"Peer(id={self.id}, name={self.name!r}, connected={self.connected})"


def _as_gpu_bytes(obj: Any) -> Tuple[int, int, bool]:
    """(pointer, nbytes, readonly) of a contiguous (C or Fortran order) GPU array
    (__cuda_array_interface__: torch, cupy, numba)."""
    cai = obj.__cuda_array_interface__
    ptr, ro = cai["data"]
    shape = tuple(int(n) for n in cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is not None and int(np.prod(shape)) > 1:
        # C or Fortran order: either way one block of memory (dimensions of length 1 have any stride)
        def dense(dims):
            step = itemsize
            for n, st in dims:
                if n > 1 and st != step:
                    return False
                step *= n
            return True
        dims = list(zip(shape, strides))
        if not (dense(reversed(dims)) or dense(dims)):
            raise _tether.InvalidArgument(
                f"cannot register a non-contiguous GPU array (shape {shape}, strides {tuple(strides)}): "
                "register a contiguous copy, e.g. t.contiguous() (torch) or cupy.ascontiguousarray(a)")
    return int(ptr or 0), int(np.prod(shape, dtype=np.int64)) * itemsize, bool(ro)


def _as_host_bytes(obj: Any) -> Tuple[int, int, bool]:
    """(pointer, nbytes, readonly) of a contiguous (C or Fortran order) host buffer (buffer protocol or DLPack)."""
    try:
        arr = np.asarray(memoryview(obj))
    except TypeError:
        if not hasattr(obj, "__dlpack__"):
            raise _tether.InvalidArgument(
                f"cannot register {type(obj).__name__}: expected the buffer protocol, DLPack, or (pointer, nbytes)")
        if hasattr(obj, "__dlpack_device__") and obj.__dlpack_device__()[0] not in (1, 3):  # CPU, CUDA-pinned
            raise _tether.InvalidArgument(
                f"cannot register {type(obj).__name__} on DLPack device {obj.__dlpack_device__()}: GPU objects "
                "need __cuda_array_interface__ (torch, cupy), or pass (pointer, nbytes) with device=")
        arr = np.from_dlpack(obj)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):  # Fortran order is one block too
        raise _tether.InvalidArgument(
            f"cannot register a non-contiguous buffer (shape {arr.shape}, strides {arr.strides}): "
            "register a contiguous copy, e.g. np.ascontiguousarray(a)")
    return arr.ctypes.data, arr.nbytes, not arr.flags.writeable


_METADATA_MAGIC = b"TTRM"


def _metadata_text(text: str) -> bytes:
    """connect()'s str argument: "host:port", or metadata that crossed a text channel as hex."""
    t = text.strip()
    if ":" not in t:
        try:
            raw = bytes.fromhex(t)
        except ValueError:
            raw = b""
        if raw.startswith(_METADATA_MAGIC):
            return raw
        raise _tether.InvalidArgument(
            f"connect: {t[:40]!r} is neither \"host:port\" nor metadata; metadata is bytes "
            "(over a text channel send metadata().hex(); base64 text must be decoded first)")
    return t.encode()


class _InstanceOrClass:
    """A method callable on an endpoint or on the class itself (then on a short-lived endpoint with the
    default options and TETHER_* overrides): `tether.Endpoint.transports()` reads naturally."""

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__

    def __get__(self, obj, cls=None):
        if obj is not None:
            return self.fn.__get__(obj, cls)

        def on_class(**options: Any):
            with cls(port=0, **options) as ep:
                return self.fn(ep)
        on_class.__doc__ = self.fn.__doc__
        on_class.__name__ = self.fn.__name__
        return on_class


class Endpoint:
    """One per process. Listens, accepts peers by itself, owns regions, peers and progress threads.

    Keywords (each with a TETHER_* environment override; a keyword wins over its variable, a variable
    over the default). Text values are parsed as the variables are: sizes "4M", booleans "yes",
    durations "2.5s". `tether doctor` prints the value each would have here and where it came from.
    """

    def __init__(self, host: Optional[str] = None, port: Optional[int] = None, **options: Any):
        """Starts listening at once: on `host` (default "127.0.0.1"; "0.0.0.0" for every NIC) and
        `port` (default 0: an ephemeral port; `address` says which). `options` are the keywords listed
        in the class docstring; each defaults to its TETHER_* environment variable, else to the measured
        default. An unknown option raises TypeError."""
        cfg = _config(dict(options, **{k: v for k, v in (("host", host), ("port", port)) if v is not None}))
        self.config = cfg
        self._ep = _tether.Endpoint.create(cfg)
        self._regions: dict[int, Region] = {}
        self._lock = threading.Lock()
        self._closed = False
        _live.add(self)

    def _open(self) -> "_tether.Endpoint":
        """The C++ endpoint, or Cancelled once close() ran: every call on a closed endpoint says so."""
        if self._closed:
            raise _tether.Cancelled("endpoint closed")
        return self._ep

    @property
    def address(self) -> str:
        """"host:port" this endpoint listens on."""
        return self._ep.address

    @property
    def name(self) -> str:
        return self._ep.name

    def metadata(self) -> bytes:
        """Bytes (binary, not text) another endpoint passes to connect(). Over a text channel send
        `metadata().hex()` and pass `bytes.fromhex(text)` (or base64). "host:port" also connects."""
        return self._open().metadata()

    def connect(self, target: Union[bytes, str], timeout: Optional[float] = None) -> Peer:
        """Connects to metadata bytes (or their `.hex()` text) or "host:port". Raises ConnectionLost,
        AuthError, ..."""
        if isinstance(target, str):
            target = _metadata_text(target)
        return Peer(self._open().connect(bytes(target), -1.0 if timeout is None else float(timeout)))

    def register(self, obj: Any, *, readonly: Optional[bool] = None, device: Optional[int] = None) -> Region:
        """Registers host or GPU memory: a numpy array or any buffer-protocol / DLPack object, a GPU
        tensor or array (torch, cupy: anything with __cuda_array_interface__), or (pointer, nbytes).
        A raw pointer is GPU memory when `device` is given or CUDA says so; host memory otherwise."""
        self._open()
        if isinstance(obj, tuple):
            if len(obj) != 2:
                raise _tether.InvalidArgument("expected (pointer, nbytes)")
            ptr, nbytes = int(obj[0]), int(obj[1])
            ro = bool(readonly)
            if device is None:
                device = _tether.pointer_device(ptr) if ptr else -1
                device = None if device < 0 else device
            cuda = device is not None
        else:
            cuda = hasattr(obj, "__cuda_array_interface__")
            ptr, nbytes, ro = _as_gpu_bytes(obj) if cuda else _as_host_bytes(obj)
            if readonly is not None:
                if ro and not readonly:
                    raise _tether.InvalidArgument("the object is read-only; it cannot be registered writable")
                ro = readonly
        region = Region(self._ep.register_memory(ptr, nbytes, cuda, -1 if device is None else int(device), ro), obj)
        with self._lock:
            self._regions[region.id] = region
        return region

    def deregister(self, region: Region) -> None:
        """Withdraws the region; waits for accesses in flight, then releases the object."""
        self._open().deregister(region._r)
        with self._lock:
            self._regions.pop(region.id, None)

    def notifications(self, timeout: float = 0) -> list[Notification]:
        """What arrived since the last call, and from whom; waits up to `timeout` s for the first."""
        return [Notification(*n) for n in self._open().notifications(float(timeout))]

    def peers(self) -> list[Peer]:
        """Every connected peer: those this endpoint connected to and those that connected to it.
        A target sees a peer only once the other side's connect() has returned (empty before)."""
        return [Peer(p) for p in self._open().peers()]

    def stats(self) -> dict:
        return self._open().stats()

    @_InstanceOrClass
    def transports(self) -> dict[str, str]:
        """Every transport this build knows -> why it cannot be used here ("" when it can).
        Also on the class: `tether.Endpoint.transports(**options)` asks a short-lived endpoint."""
        return dict(self._open().transports())

    def close(self) -> None:
        """Idempotent. Transfers still running fail with Cancelled; from then on every call on this
        endpoint or its peers raises Cancelled ("endpoint closed")."""
        self._closed = True
        self._ep.close()
        with self._lock:
            self._regions.clear()

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Endpoint(address={self.address!r}, name={self.name!r})"


Endpoint.__doc__ = Endpoint.__doc__.rstrip() + "\n\n" + _keyword_doc() + "\n"

_live: "weakref.WeakSet[Endpoint]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit, before the interpreter is torn down: close what is still open so threads waiting in
    tether wake (with Cancelled), then let them take the GIL back and leave while Python still runs
    them. From here on no tether call releases the GIL (see without_gil in src/bindings/module.cc)."""
    import time

    _tether._begin_exit()
    for ep in list(_live):
        ep.close()
    deadline = time.monotonic() + 5.0
    while _tether._threads_without_gil() and time.monotonic() < deadline:
        time.sleep(0.001)
