"""Fixtures for the tether tests: endpoint pairs and child processes. Every test's budget (the
watchdog) and the default selection live in tests/conftest.py."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import tether  # noqa: E402
from tether_testutil.child import Child  # noqa: E402
from tether_testutil.data import MiB, rand_bytes  # noqa: E402

# Configurations exercised by the correctness tests, on each transport that can carry a pair in
# one process (auto picks ipc for same-host peers; tcp must keep passing the same tests).
_SHAPES = {
    "c1": dict(channels=1),
    "c4": dict(channels=4),
    "chunk64k": dict(chunk_bytes=64 << 10),
}
CONFIGS = {f"{t}-{name}": dict(shape, transport=t) for t in ("tcp", "ipc") for name, shape in _SHAPES.items()}


@pytest.fixture
def endpoints():
    """Factory: endpoints(**options) -> Endpoint; every one is closed at teardown."""
    made = []

    def make(**kw):
        ep = tether.Endpoint(**kw)
        made.append(ep)
        return ep

    yield make
    for ep in reversed(made):
        ep.close()


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def config(request):
    return CONFIGS[request.param]


@pytest.fixture
def pair(endpoints, config):
    """(a, b, peer a->b) in this process with the parametrized configuration on both sides."""
    a = endpoints(name="ep-a", **config)
    b = endpoints(name="ep-b", **config)
    return a, b, a.connect(b.metadata(), timeout=5)


@pytest.fixture(params=["tcp", "ipc"])
def duo(endpoints, request):
    """(initiator over tcp or ipc, target, peer): refusal checks run on both transports, since ipc's
    target must refuse what tcp's refuses, alike."""
    a = endpoints(name="initiator", transport=request.param)
    b = endpoints(name="target")
    p = a.connect(b.metadata(), timeout=5)
    assert p.transport == request.param
    return a, b, p


@pytest.fixture
def children():
    """Factory: children(name=...) -> Child process; all are SIGCONT'ed and SIGKILL'ed at teardown."""
    made = []

    def make(name="child", env=None):
        c = Child(name, env)
        made.append(c)
        return c

    yield make
    for c in made:
        c.cleanup()


@pytest.fixture
def target(children):
    """Factory: target(transport, env=None, **endpoint_options) -> (me, peer, child): an endpoint here
    ("I") connected over `transport` to a child process's endpoint ("T"), which the test drives as the
    target."""
    made = []

    def make(transport, env=None, **ep):
        c = children(f"{transport}-target", env=env)
        info = c.call("endpoint", name="T")
        me = tether.Endpoint(name="I", transport=transport, **ep)
        made.append(me)
        peer = me.connect(info["metadata"], timeout=10)
        assert peer.transport == transport
        return me, peer, c

    yield make
    for me in made:
        me.close()


@pytest.fixture
def ipc_target(target):
    """Factory: ipc_target(env=None, **endpoint_options) -> (me, peer, child) over ipc (see `target`)."""
    return lambda env=None, **ep: target("ipc", env, **ep)


@pytest.fixture(scope="session")
def big_random():
    """64 MiB of random bytes (seed 64), shared by the large-transfer tests (read-only use)."""
    a = rand_bytes(64, 64 * MiB)
    a.flags.writeable = False
    return a
