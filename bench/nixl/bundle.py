#!/usr/bin/env python3
"""A trimmed NIXL for the device machine, which has no internet and takes 64 MiB per call.

The cp312 nixl-cu13 wheel unpacks to 229 MiB (nixl_ep's torch extensions, cloud SDKs, storage plugins).
This keeps the Python API, the core libraries, the UCX and POSIX plugins and UCX's shared-memory, TCP
and CUDA transports, with every library they need (DT_NEEDED, resolved inside the wheel), and packs
them as a .tar.xz to unpack on the device and put on PYTHONPATH.

    python3 bench/nixl/bundle.py OUT.tar.xz [--version 1.5.1] [--python 3.12]
"""
import argparse
import fnmatch
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

KEEP_PLUGINS = ("libplugin_UCX.so", "libplugin_POSIX.so")
# UCX loads its transports by name at run time: nothing links them, so they are roots too.
KEEP_UCX = ("libuct_cma.so*", "libuct_cuda.so*", "libucm_cuda.so*", "libucx_perftest_cuda.so*")
DROP_UCX = ("libucx_perftest*",)
DROP_DIRS = ("nixl_ep", "nixl_ep_cu13", "nixl_cu13.scripts", "include", "bin", "pkgconfig")


def needed(path: pathlib.Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--version", default="1.5.1")
    ap.add_argument("--python", default="3.12")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        site = pathlib.Path(tmp, "site")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                        str(site), "--python-version", a.python, "--only-binary=:all:", "--platform",
                        "manylinux_2_28_x86_64", f"nixl-cu13=={a.version}", f"nixl=={a.version}"], check=True)
        for d in DROP_DIRS:
            shutil.rmtree(site / d, ignore_errors=True)
        libs = [p for p in site.rglob("*.so*") if p.is_file()]
        by_name: dict[str, list[pathlib.Path]] = {}
        for p in libs:
            by_name.setdefault(p.name, []).append(p)

        def is_root(p: pathlib.Path) -> bool:
            rel = p.relative_to(site).as_posix()
            if "plugins/" in rel or "/nixl/libplugin_" in rel or "telemetry_exporter" in p.name:
                return p.name in KEEP_PLUGINS
            if "/ucx/" in rel:
                return any(fnmatch.fnmatch(p.name, k) for k in KEEP_UCX) and \
                    not any(fnmatch.fnmatch(p.name, k) for k in DROP_UCX)
            return rel.startswith(("nixl_cu13/", ".nixl_cu13.mesonpy.libs/lib")) and "test_utils" not in p.name

        keep, todo = set(), [p for p in libs if is_root(p)]
        while todo:
            p = todo.pop()
            if p in keep:
                continue
            keep.add(p)
            for name in needed(p):
                todo.extend(by_name.get(name, []))
        for p in libs:
            if p not in keep:
                p.unlink()
        for la in site.rglob("*.la"):
            la.unlink()
        with tarfile.open(a.out, "w:xz", preset=6) as tar:
            tar.add(site, arcname="nixl-site")
    print(f"{a.out}: {os.path.getsize(a.out) / 2**20:.1f} MiB, {len(keep)} libraries kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
