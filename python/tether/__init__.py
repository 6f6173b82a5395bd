"""tether: point-to-point transfers of GPU and host memory between processes and machines.

    import numpy as np, tether
    ep = tether.Endpoint()                      # listens on an ephemeral port
    peer = ep.connect(other_metadata)           # bytes from the other side's ep.metadata()
    src = ep.register(np.arange(1 << 20, dtype=np.uint8))
    peer.write(src, remote_descriptor).wait()   # bytes are in the target's memory
"""
from tether._tether import (  # noqa: F401  (typed exceptions)
    AccessDenied,
    AuthError,
    Cancelled,
    ConnectionLost,
    InternalError,
    InvalidArgument,
    OutOfRange,
    ProtocolError,
    RegionNotFound,
    RemoteRegion,
    ResourceExhausted,
    TetherError,
    TransferTimeout,
    Truncated,
    Unavailable,
    WIRE_VERSION,
)
from tether.api import Endpoint, Notification, Peer, Region, Transfer  # noqa: F401

__version__ = "0.1.0"
__all__ = [
    "Endpoint", "Peer", "Region", "RemoteRegion", "Transfer", "Notification",
    "TetherError", "InvalidArgument", "RegionNotFound", "AccessDenied", "OutOfRange",
    "TransferTimeout", "ConnectionLost", "ProtocolError", "AuthError", "Cancelled",
    "Truncated", "Unavailable", "InternalError", "ResourceExhausted",
]
