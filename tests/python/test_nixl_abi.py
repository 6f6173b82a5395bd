"""The NIXL plugin's ABI: tether's own declarations (src/nixl/abi) are what a plain clone builds
against, they agree with a NIXL source tree where one is beside the clone, and the NIXL wheels found
here still call a backend through the virtual slots those declarations have.

Sizes and offsets are static_asserts (src/nixl/abi/checks.h) and the virtual slots a GoogleTest
(tests/cpp/nixl_abi_test.cc); both are compiled here in a build of their own, once per set of
declarations. test_nixl.py then moves real bytes through the plugin under each wheel.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NIXL_TREE = ROOT.parent / "shared" / "third_party" / "nixl"  # a NIXL checkout beside the clone, if any


# nixlBackendEngine's virtual functions by slot, as libnixl calls them (0 and 1: the destructors).
ENGINE_SLOTS = ["~", "~", "supportsRemote", "supportsLocal", "supportsNotif", "getSupportedMems", "registerMem",
                "deregisterMem", "connect", "disconnect", "unloadMD", "prepXfer", "postXfer", "checkXfer",
                "releaseReqH", "prepMemView", "prepMemView", "releaseMemView", "getPublicData", "getConnInfo",
                "loadRemoteConnInfo", "loadRemoteMD", "loadLocalMD", "getNotifs", "genNotif", "queryMem",
                "estimateXferCost"]


needs_build_tools = pytest.mark.skipif(
    shutil.which("cmake") is None or not any(Path(p).exists() for p in ("/usr/include/gtest/gtest.h",
                                                                        "/usr/local/include/gtest/gtest.h")),
    reason="cmake or GoogleTest (libgtest-dev) not installed")


PLUGIN_OBJECTS = [f"CMakeFiles/plugin_TETHER.dir/src/nixl/{f}.cc.o" for f in ("engine", "plugin")]


def _build_abi_test(build: Path, nixl_src: str, objects: bool = False) -> str:
    """Configures a build with TETHER_NIXL_SRC=nixl_src, builds and runs tether_nixl_abi_test (and, with
    `objects`, compiles the plugin's two sources); returns CMake's configure output."""
    build.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    env = dict(os.environ, TETHER_NIXL_SRC=nixl_src)
    r = subprocess.run(["cmake", str(ROOT), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DTETHER_BUILD_PYTHON=OFF",
                        "-DTETHER_BUILD_TESTS=ON", "-DTETHER_CUDA=OFF"], cwd=build, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    targets = ["tether_nixl_abi_test"] + (PLUGIN_OBJECTS if objects else [])
    b = subprocess.run(["cmake", "--build", ".", "--target", *targets], cwd=build,
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, "the ABI checks do not compile:\n" + b.stdout[-5000:] + b.stderr[-3000:]
    t = subprocess.run([str(build / "tether_nixl_abi_test")], capture_output=True, text=True, timeout=60)
    assert t.returncode == 0, t.stdout[-5000:]
    return r.stdout


@pytest.mark.budget(600)
@needs_build_tools
def test_a_plain_build_uses_tethers_declarations(tmp_path):
    """No NIXL tree named: the plugin builds from src/nixl/abi, even with a NIXL tree beside the clone
    (CI has one; a user's clone has none, and must build the same plugin)."""
    out = _build_abi_test(tmp_path, "")
    assert "NIXL plugin built from tether's declarations of NIXL's backend ABI" in out, out[-3000:]
    assert "NIXL headers" not in out


@pytest.mark.budget(600)
@needs_build_tools
def test_the_declarations_agree_with_a_nixl_tree(tmp_path):
    """The same checks compiled against NIXL's own headers: the numbers in checks.h and the slots in
    nixl_abi_test.cc hold for them too; and the plugin's sources compile to the same functions, with the
    same machine code, against NIXL's headers as against tether's declarations: one ABI."""
    if shutil.which("ninja") is None or shutil.which("objdump") is None:
        pytest.skip("needs ninja (object-file targets) and objdump")
    if not (NIXL_TREE / "src" / "api" / "cpp" / "backend" / "backend_plugin.h").exists():
        pytest.skip(f"no NIXL source tree at {NIXL_TREE}")
    out = _build_abi_test(tmp_path / "tree", str(NIXL_TREE), objects=True)
    assert f"NIXL plugin built against the NIXL headers in {NIXL_TREE}" in out, out[-3000:]
    _build_abi_test(tmp_path / "ours", "", objects=True)
    for obj in PLUGIN_OBJECTS:
        tree, ours = _functions(tmp_path / "tree" / obj), _functions(tmp_path / "ours" / obj)
        assert sorted(ours) == sorted(tree), f"{obj}: other functions or signatures"
        differ = [name for name in tree if tree[name] != ours[name]]
        assert not differ, f"{obj}: other machine code in {differ[:5]}"


def _functions(obj: Path) -> dict[str, list[str]]:
    """An object file's functions (mangled names) and their instructions, with addresses, offsets into
    sections and the numbers of local constants left out (they move with function order and with what
    the headers define, which is no part of the ABI)."""
    out = subprocess.run(["objdump", "-d", "-r", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                         check=True).stdout
    funcs: dict[str, list[str]] = {}
    cur = None
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
        elif cur is not None and line.strip() and not line.startswith("Disassembly of section"):
            line = re.sub(r"^\s*[0-9a-f]+:\s*", "", line)
            line = re.sub(r"[0-9a-f]+ <([^>+]*)(\+0x[0-9a-f]+)?>", r"<\1>", line)
            line = re.sub(r"\.LC\d+", ".LC", line)  # local constants are numbered in the order the headers made them
            line = re.sub(r"<[^<>]*\.cold>", "<.cold>", line)  # a cold part is named after whichever function it sits in
            cur.append(re.sub(r"(\.text[.\w]*)\+0x[0-9a-f]+", r"\1", line))
    return funcs


def test_a_nixl_src_that_is_no_nixl_tree_is_refused(tmp_path):
    """A wrong TETHER_NIXL_SRC stops the configure with one line naming it (it built no plugin, silently)."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake not installed")
    wrong = tmp_path / "not-nixl"
    wrong.mkdir()
    r = subprocess.run(["cmake", str(ROOT), "-DTETHER_BUILD_PYTHON=OFF", "-DTETHER_BUILD_TESTS=OFF", "-DTETHER_CUDA=OFF"],
                       cwd=tmp_path, env=dict(os.environ, TETHER_NIXL_SRC=str(wrong)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert f"TETHER_NIXL_SRC={wrong} is not a NIXL source tree" in " ".join(r.stderr.split())  # CMake wraps lines


def _wheel_plugin_dirs() -> list[tuple[str, Path]]:
    """(version, plugin folder) of the installed NIXL wheel and of each folder in TETHER_NIXL_ALT."""
    out = []
    for dists, base in [(metadata.distributions(), None)] + [
            (metadata.distributions(path=[s]), Path(s)) for s in os.environ.get("TETHER_NIXL_ALT", "").split(os.pathsep) if s]:
        for d in dists:
            if d.metadata["Name"] in ("nixl-cu13", "nixl-cu12"):
                site = base or Path(str(d.locate_file("")))
                out += [(d.version, p) for p in sorted(site.glob(".nixl*.mesonpy.libs/plugins"))[:1]]
                break
    return out


def _vtable_methods(lib: Path, cls: str) -> list[str]:
    """The method name in each slot of `cls`'s virtual table in `lib` (x86-64 relocations)."""
    syms = subprocess.run(["nm", "-C", "-S", str(lib)], capture_output=True, text=True, check=True).stdout
    names, table = {}, None
    for line in syms.splitlines():
        p = line.split(None, 3)
        if len(p) == 4 and re.fullmatch(r"[0-9a-f]+", p[1]):
            names.setdefault(int(p[0], 16), p[3])
            if p[3] == f"vtable for {cls}":
                table = (int(p[0], 16), int(p[1], 16))
    assert table, f"{lib} has no virtual table for {cls}"
    relocs = {}
    for line in subprocess.run(["readelf", "-rW", str(lib)], capture_output=True, text=True, check=True).stdout.splitlines():
        p = line.split()
        if len(p) >= 4 and p[2] in ("R_X86_64_RELATIVE", "R_X86_64_64"):  # the address: addend, or symbol value
            relocs[int(p[0], 16)] = int(p[3], 16)
    start, size = table
    slots = [names.get(relocs.get(a, -1), "?") for a in range(start + 16, start + size, 8)]  # past offset and RTTI
    return [re.sub(r"\(.*", "", s).split("::")[-1].replace(cls, "") for s in slots]


WHEELS = _wheel_plugin_dirs()


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("readelf") is None,
                    reason="reads x86-64 relocations with binutils")
@pytest.mark.skipif(not WHEELS, reason="no NIXL wheel installed")
@pytest.mark.parametrize("version,plugins", WHEELS, ids=[v for v, _ in WHEELS])
def test_each_wheel_calls_backends_through_the_declared_slots(version, plugins):
    """NIXL's own UCX engine, as each wheel ships it, has nixlBackendEngine's virtual functions in the
    slots tether declares, and nothing more before its own: a NIXL release that reorders or adds one
    fails here, by name, instead of calling the wrong function of our plugin."""
    slots = _vtable_methods(plugins / "libplugin_UCX.so", "nixlUcxEngine")
    assert slots[:len(ENGINE_SLOTS)] == ENGINE_SLOTS, f"NIXL {version}: {slots}"
    base = subprocess.run(["nm", "-S", str(plugins / "libplugin_UCX.so")], capture_output=True, text=True).stdout
    (size,) = [int(line.split()[1], 16) for line in base.splitlines() if line.endswith(" _ZTV17nixlBackendEngine")]
    assert size == 16 + 8 * len(ENGINE_SLOTS), f"NIXL {version}: nixlBackendEngine has {(size - 16) // 8} slots"


def test_nixl_src_set_later_wins_over_the_cached_value(tmp_path):
    """pip reuses its build folder, so TETHER_NIXL_SRC given to a later `pip install .` must win over
    what an earlier configure cached (it did not: the reinstall silently built no NIXL plugin), and
    setting it empty again goes back to tether's own declarations of NIXL's ABI."""
    import shutil
    if shutil.which("cmake") is None:
        pytest.skip("cmake not installed")
    headers = os.path.join(ROOT, "..", "shared", "third_party", "nixl")
    if not os.path.exists(os.path.join(headers, "src", "api", "cpp", "backend", "backend_plugin.h")):
        pytest.skip("NIXL's backend headers (../shared/third_party/nixl) are not beside this tree")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", ROOT, *gen, "-DTETHER_BUILD_PYTHON=OFF", "-DTETHER_BUILD_TESTS=OFF"]

    def run(nixl_src: str) -> str:
        r = subprocess.run(configure, cwd=tmp_path, env=dict(os.environ, TETHER_NIXL_SRC=nixl_src),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return r.stdout

    ours = "NIXL plugin built from tether's declarations of NIXL's backend ABI"
    assert ours in run("")
    assert "NIXL plugin built against the NIXL headers in " + os.path.abspath(headers) in run(os.path.abspath(headers))
    assert ours in run("")
