"""tether as a NIXL backend: where the plugin is, making an installed NIXL find it, and what NIXL sees.

`libplugin_TETHER.so` ships inside this package (tether/plugins/). NIXL's Python wheels load plugins
from their own folder (site-packages/.nixl_cu13.mesonpy.libs/plugins); pointing NIXL_PLUGIN_DIR
elsewhere would hide NIXL's built-in backends (UCX, ...), so `install()` copies the plugin there.
After that, `nixl_agent_config(backends=["TETHER"])` runs every transfer on tether (docs/NIXL.md).
"""
from __future__ import annotations

import filecmp
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

PLUGIN_NAME = "libplugin_TETHER.so"
NIXL_DISTRIBUTIONS = ("nixl-cu13", "nixl-cu12", "nixl")  # the wheels that carry libnixl and its plugins


class NixlError(RuntimeError):
    """NIXL is missing, or the plugin cannot be put where NIXL looks."""


def plugin_path() -> Optional[Path]:
    """This package's libplugin_TETHER.so, or None where the build left it out (TETHER_NIXL=OFF)."""
    p = Path(__file__).resolve().parent / "plugins" / PLUGIN_NAME
    return p if p.is_file() else None


def nixl_installed() -> Optional[dict[str, str]]:
    """{"distribution", "version", "plugin_dir"} of the installed NIXL wheel, or None."""
    for name in NIXL_DISTRIBUTIONS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        site = Path(str(dist.locate_file("")))
        dirs = sorted(glob.glob(str(site / ".nixl*.mesonpy.libs" / "plugins")))
        if dirs:
            return {"distribution": name, "version": dist.version, "plugin_dir": dirs[0]}
    return None


def install(plugin_dir: Optional[str] = None) -> Path:
    """Copies libplugin_TETHER.so into NIXL's plugin folder (or `plugin_dir`); returns where it went.
    The copy is atomic (a process loading plugins sees the old file or the new one, never half)."""
    src = plugin_path()
    if src is None:
        raise NixlError("this tether was built without its NIXL plugin (CMake option TETHER_NIXL=OFF): "
                        "rebuild with `pip install .`, which builds it by default")
    if plugin_dir is None:
        info = nixl_installed()
        if info is None:
            raise NixlError("NIXL is not installed here (pip install nixl), or its wheel has no plugin folder; "
                            "name one with --plugin-dir")
        plugin_dir = info["plugin_dir"]
    dest_dir = Path(plugin_dir)
    if not dest_dir.is_dir():
        raise NixlError(f"{dest_dir} is not a folder")
    dest = dest_dir / PLUGIN_NAME
    fd, tmp = tempfile.mkstemp(prefix=".tether-", dir=dest_dir)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise NixlError(f"cannot write {dest}: {e}") from e
    return dest


_PROBE = """
import json, sys
from nixl._api import nixl_agent, nixl_agent_config
a = nixl_agent("tether-probe", nixl_agent_config(backends=[]))
ok, why = "TETHER" in a.get_plugin_list(), ""
if ok:
    try:
        a.create_backend("TETHER", {})
    except Exception as e:  # noqa: BLE001
        ok, why = False, str(e)
print(json.dumps({"listed": "TETHER" in a.get_plugin_list(), "creates": ok, "why": why}))
"""


def probe(timeout: float = 60.0) -> dict[str, Any]:
    """Asks NIXL itself, in a separate process: is TETHER listed, and does a backend create?"""
    env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "ERROR"))
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"listed": False, "creates": False, "why": f"NIXL did not answer within {timeout:.0f} s"}
    import json
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return {"listed": False, "creates": False, "why": f"the NIXL probe failed: {tail}"}


def status(ask_nixl: bool = True) -> dict[str, Any]:
    """What `tether doctor` and `tether nixl status` show: NIXL's version, where its plugins live,
    whether our plugin is there and current, and whether NIXL lists it and creates a TETHER backend."""
    ours = plugin_path()
    info = nixl_installed()
    out: dict[str, Any] = {
        "plugin": str(ours) if ours else None,
        "nixl_installed": info is not None,
        "nixl_version": info["version"] if info else None,
        "nixl_distribution": info["distribution"] if info else None,
        "plugin_dir": info["plugin_dir"] if info else None,
        "installed_copy": None,
        "installed_copy_current": False,
        "nixl_sees_tether": None,
        "detail": "",
    }
    if info:
        copy = Path(info["plugin_dir"]) / PLUGIN_NAME
        if copy.is_file():
            out["installed_copy"] = str(copy)
            out["installed_copy_current"] = bool(ours) and filecmp.cmp(copy, ours, shallow=False)
    if not ours:
        out["detail"] = "built without the NIXL plugin (TETHER_NIXL=OFF): rebuild with `pip install .`"
    elif not info:
        out["detail"] = "NIXL is not installed (pip install nixl)"
    elif not out["installed_copy"]:
        out["detail"] = "run `tether nixl install` so NIXL finds the plugin"
    elif not out["installed_copy_current"]:
        out["detail"] = "the copy in NIXL's plugin folder is from another tether build: run `tether nixl install`"
    if info and ask_nixl:
        p = probe()
        out["nixl_sees_tether"] = bool(p["listed"] and p["creates"])
        if not out["nixl_sees_tether"] and not out["detail"]:
            out["detail"] = p["why"] or "NIXL does not list TETHER"
    return out


def cli(args) -> int:
    """`tether nixl install|status`."""
    if args.action == "install":
        try:
            dest = install(args.plugin_dir)
        except NixlError as e:
            print(f"tether nixl install: {e}", file=sys.stderr)
            return 1
        print(f"installed {dest}")
        if args.plugin_dir is None:
            p = probe()
            if not (p["listed"] and p["creates"]):
                print(f"but NIXL does not load it: {p['why'] or 'not listed'}", file=sys.stderr)
                return 1
            print('NIXL lists TETHER: nixl_agent_config(backends=["TETHER"]) uses it')
        return 0
    st = status()
    if args.json:
        import json
        print(json.dumps(st, indent=2))
    else:
        print(f"plugin:       {st['plugin'] or 'not built'}")
        print(f"NIXL:         {st['nixl_distribution'] + ' ' + st['nixl_version'] if st['nixl_installed'] else 'not installed'}")
        if st["plugin_dir"]:
            print(f"plugin dir:   {st['plugin_dir']}")
            print(f"installed:    {'yes, current' if st['installed_copy_current'] else 'yes, from another build' if st['installed_copy'] else 'no'}")
            print(f"NIXL sees it: {'yes' if st['nixl_sees_tether'] else 'no'}")
        if st["detail"]:
            print(st["detail"])
    return 0 if st["nixl_sees_tether"] else 1
