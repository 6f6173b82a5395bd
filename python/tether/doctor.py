"""`tether doctor`: what this machine offers and what tether will use."""
from __future__ import annotations

import ctypes.util
import glob
import os
from typing import Any


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _nics() -> list[dict[str, Any]]:
    out = []
    for dev in sorted(glob.glob("/sys/class/net/*")):
        name = os.path.basename(dev)
        speed = _read(f"{dev}/speed", "")
        pci = os.path.realpath(f"{dev}/device") if os.path.exists(f"{dev}/device") else None
        out.append({
            "name": name,
            "state": _read(f"{dev}/operstate", "unknown"),
            "speed_mbps": int(speed) if speed.lstrip("-").isdigit() and int(speed) > 0 else None,
            "numa_node": int(_read(f"{dev}/device/numa_node", "-1") or -1) if pci else None,
            "pci_path": pci,
            "mtu": int(_read(f"{dev}/mtu", "0") or 0),
        })
    return out


SYSCTLS = {
    "net.core.rmem_max": (8 << 20, "raise to >= 8 MiB so large socket buffers take effect"),
    "net.core.wmem_max": (8 << 20, "raise to >= 8 MiB so large socket buffers take effect"),
    "net.ipv4.tcp_rmem": (None, "max (third value) >= 8 MiB recommended"),
    "net.ipv4.tcp_wmem": (None, "max (third value) >= 8 MiB recommended"),
}


def collect() -> dict[str, Any]:
    import tether

    sysctls = {}
    for key, (minimum, advice) in SYSCTLS.items():
        value = _read("/proc/sys/" + key.replace(".", "/"))
        numbers = [int(x) for x in value.split()] if value else []
        ok = True
        if numbers:
            top = numbers[-1]
            ok = top >= (minimum or (8 << 20))
        sysctls[key] = {"value": value, "ok": ok, "advice": None if ok else advice}
    cuda = ctypes.util.find_library("cuda") or (os.path.exists("/dev/nvidiactl") and "libcuda (driver present)")
    fabric = ctypes.util.find_library("fabric")
    transports = {
        "tcp": {"available": True, "why": "kernel sockets"},
        "ipc": {"available": False, "why": "not in this build yet"},
        "fabric": {"available": False, "why": "not in this build yet" + ("" if fabric else "; libfabric.so not found")},
        "netplugin": {"available": False, "why": "not in this build yet"},
    }
    return {
        "tether": tether.__version__,
        "wire_version": tether.WIRE_VERSION,
        "cpus": os.cpu_count(),
        "numa_nodes": len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1,
        "nics": _nics(),
        "gpus": sorted(os.path.basename(p) for p in glob.glob("/dev/nvidia[0-9]*")),
        "cuda": bool(cuda),
        "libfabric": fabric,
        "sysctls": sysctls,
        "transports": transports,
        "env": {k: v for k, v in os.environ.items() if k.startswith("TETHER_") and "TOKEN" not in k},
    }


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    c.print(f"[bold]tether {report['tether']}[/bold] (wire version {report['wire_version']})")
    c.print(f"CPUs: {report['cpus']}, NUMA nodes: {report['numa_nodes']}; GPUs: {', '.join(report['gpus']) or 'none'};"
            f" CUDA: {'yes' if report['cuda'] else 'no'}; libfabric: {report['libfabric'] or 'not found'}")
    t = Table(title="NICs")
    for col in ("name", "state", "speed", "NUMA", "PCI path"):
        t.add_column(col)
    for n in report["nics"]:
        t.add_row(n["name"], n["state"], f"{n['speed_mbps']} Mb/s" if n["speed_mbps"] else "-",
                  str(n["numa_node"]) if n["numa_node"] is not None else "-", n["pci_path"] or "virtual")
    c.print(t)
    t = Table(title="Transports")
    t.add_column("transport")
    t.add_column("available")
    t.add_column("why")
    for name, v in report["transports"].items():
        t.add_row(name, "[green]yes[/green]" if v["available"] else "[red]no[/red]", v["why"])
    c.print(t)
    t = Table(title="sysctls")
    t.add_column("key")
    t.add_column("value")
    t.add_column("advice")
    for k, v in report["sysctls"].items():
        t.add_row(k, v["value"] or "?", "[green]ok[/green]" if v["ok"] else f"[yellow]{v['advice']}[/yellow]")
    c.print(t)
    if report["env"]:
        c.print("TETHER_* set: " + ", ".join(f"{k}={v}" for k, v in report["env"].items()))
