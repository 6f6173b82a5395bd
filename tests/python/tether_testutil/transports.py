"""Which transports an endpoint can use here, and the testnet NCCL net plugin built on first use."""
from __future__ import annotations

import os


def transport_unusable(name: str, **options) -> str:
    """'' when an endpoint made with `options` offers transport `name`, else why it does not."""
    import tether
    try:
        ep = tether.Endpoint(**options)
    except tether.Unavailable as e:  # asked for by name (transport=) and unusable: creation says why
        return str(e)
    with ep:
        return ep.transports().get(name, f"this build has no {name} transport")


def build_testnet_plugin() -> str:
    """Path of the testnet NCCL net plugin (tests/netplugin, TCPX-like over loopback), built on first
    use; TETHER_TEST_NET_PLUGIN=path names another build."""
    import shutil
    import subprocess
    from pathlib import Path

    import pytest
    if os.environ.get("TETHER_TEST_NET_PLUGIN"):
        return os.environ["TETHER_TEST_NET_PLUGIN"]
    if shutil.which("cmake") is None:
        pytest.skip("cmake not installed: the testnet plugin cannot be built")
    root = Path(__file__).resolve().parents[3]  # the source tree
    build = root / "build" / "testnet"
    build.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", str(root), *gen, "-DTETHER_BUILD_PYTHON=OFF", "-DTETHER_BUILD_TEST_PLUGIN=ON",
                    "-DCMAKE_BUILD_TYPE=Release"], cwd=build, check=True, capture_output=True)
    subprocess.run(["cmake", "--build", ".", "--target", "tether_testnet"], cwd=build, check=True, capture_output=True)
    return str(build / "libtether_testnet.so")
