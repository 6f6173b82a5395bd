"""`tether doctor`: what this machine offers and what tether will use."""
from __future__ import annotations

import ctypes.util
import glob
import os
from typing import Any, Optional


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _nics(topology: dict[str, Any]) -> list[dict[str, Any]]:
    """NICs as the C++ side (src/sys/topology.cc) discovered them, plus what it decided about each."""
    data = topology["data_nics"]
    out = []
    for n in topology["nics"]:
        out.append({
            "name": n["name"],
            "state": "up" if n["up"] else "down",
            "addrs": n["addrs"],
            "speed_mbps": n["speed_mbps"] if n["speed_mbps"] > 0 else None,
            "numa_node": n["numa_node"] if n["pci_path"] and n["numa_node"] >= 0 else None,  # -1: unknown
            "pci_path": n["pci_path"] or None,
            "local_cpus": n["local_cpus"],
            "mtu": int(_read(f"/sys/class/net/{n['name']}/mtu", "0") or 0),
            "use": ("data #%d" % data.index(n["name"]) if n["name"] in data else "") +
                   (" control" if n["name"] == topology["control_nic"] else ""),
        })
    return out


def _run(*cmd: str, check: bool = False) -> Optional[str]:
    """`cmd`'s stdout; None where the tool is missing or cannot be run (or, with `check`, fails)."""
    import shutil
    import subprocess

    if not shutil.which(cmd[0]):
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=check).stdout
    except (subprocess.SubprocessError, OSError):
        return None


def _gpus() -> list[dict[str, Any]]:
    """GPUs from nvidia-smi (index, name, PCI bus id, memory), with their sysfs PCI path and NUMA node."""
    out = _run("nvidia-smi", "--query-gpu=index,name,pci.bus_id,memory.total", "--format=csv,noheader", check=True)
    gpus = []
    for line in (out or "").strip().splitlines():
        idx, name, bus, mem = [x.strip() for x in line.split(",")]
        bus = bus.lower()
        if bus.count(":") == 2 and len(bus.split(":")[0]) == 8:  # 00000000:18:00.0 -> 0000:18:00.0
            bus = bus[4:]
        sysfs = f"/sys/bus/pci/devices/{bus}"
        gpus.append({
            "index": int(idx), "name": name, "pci_bus_id": bus, "memory": mem,
            "pci_path": os.path.realpath(sysfs) if os.path.exists(sysfs) else None,
            "numa_node": int(_read(f"{sysfs}/numa_node", "-1") or -1),
        })
    return gpus


def _nvlink_matrix() -> str:
    return (_run("nvidia-smi", "topo", "-m") or "").strip()


def topology(gpus: list[dict]) -> dict[str, Any]:
    """What an endpoint created with this environment would use: data NICs in order, the control NIC,
    each progress thread's NIC and CPUs, and per GPU its data NICs nearest first (the C++ ranking)."""
    import tether
    from tether import _tether

    try:
        t = _tether.topology(_tether.Config.from_env(), [(g["pci_path"] or "", g["numa_node"]) for g in gpus])
    except tether.TetherError as e:
        return {"error": str(e), "nics": [], "data_nics": [], "control_nic": None, "threads": [], "gpu_nics": {}}
    t["gpu_nics"] = {str(g["index"]): r for g, r in zip(gpus, t.pop("device_ranks"))}
    return t


def fabric_rails(gpus: list[dict]) -> dict[str, Any] | None:
    """The fabric transport's rails with their NIC's PCI location, and the rail order (domains, nearest
    first) for host memory and per GPU (the C++ ranking the data path uses). None if fabric is unusable."""
    from tether import _tether

    try:
        r = _tether.fabric_rails(_tether.Config.from_env(), [(g["pci_path"] or "", g["numa_node"]) for g in gpus])
    except Exception:  # a bad TETHER_* setting: the topology section reports it
        return None
    if r["why"]:
        return None
    r["gpu_orders"] = {str(g["index"]): o for g, o in zip(gpus, r.pop("device_orders"))}
    return r


def _nccl_net_plugins() -> list[str]:
    """NCCL network plugins (libnccl-net*.so) where NCCL would look, plus NCCL_NET_PLUGIN's choice."""
    import site
    import sysconfig

    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/lib", "/usr/local/nvidia/lib64",
             "/usr/local/tcpx/lib64", "/var/lib/tcpx/lib64"]
    for sp in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]:
        dirs.append(os.path.join(sp, "nvidia", "nccl", "lib"))
    found = set()
    for d in dirs:
        found.update(glob.glob(os.path.join(d, "libnccl-net*.so*")))
    chosen = os.environ.get("NCCL_NET_PLUGIN")
    if chosen and os.path.exists(chosen):
        found.add(os.path.abspath(chosen))
    return sorted(found)


def _fabric_providers() -> list[str] | None:
    """Provider names from `fi_info -l` (libfabric-bin), or None where it cannot tell."""
    out = _run("fi_info", "-l")
    if out is None:
        return None
    return sorted({line.strip().rstrip(":") for line in out.splitlines() if line.strip().endswith(":")})


# tether asks for socket_buffer per data socket; the kernel caps it at these.
SYSCTLS = {
    "net.core.rmem_max": "raise to >= socket_buffer ({}), or the kernel caps tether's buffers",
    "net.core.wmem_max": "raise to >= socket_buffer ({}), or the kernel caps tether's buffers",
    "net.ipv4.tcp_rmem": "max (third value) >= {} recommended for fast or long links",
    "net.ipv4.tcp_wmem": "max (third value) >= {} recommended for fast or long links",
}


def options() -> tuple[Optional[list[dict]], Optional[str]]:
    """(every option as an Endpoint created here would use it, with where its value came from; None),
    or (None, why an Endpoint cannot start with this environment: the bad variable, in one line)."""
    import tether
    from tether.api import effective_options

    try:
        return effective_options(), None
    except tether.TetherError as e:
        return None, str(e)


def _value(opts: Optional[list[dict]], keyword: str) -> str:
    """The option's effective value; its default where the environment is refused."""
    from tether import _tether

    rows = opts or [dict(o, value=o["default"]) for o in _tether.options()]
    return next(o["value"] for o in rows if o["keyword"] == keyword)


def collect() -> dict[str, Any]:
    import tether

    opts, config_error = options()
    socket_buffer = int(_value(opts, "socket_buffer"))
    sysctls = {}
    for key, advice in SYSCTLS.items():
        value = _read("/proc/sys/" + key.replace(".", "/"))
        numbers = [int(x) for x in value.split()] if value else []
        ok = not numbers or numbers[-1] >= socket_buffer
        sysctls[key] = {"value": value, "ok": ok, "advice": None if ok else advice.format(_bytes(socket_buffer))}
    cuda = ctypes.util.find_library("cuda") or (os.path.exists("/dev/nvidiactl") and "libcuda (driver present)")
    fabric = ctypes.util.find_library("fabric")
    transports = {"tcp": {"available": True, "why": "kernel sockets"}}
    usable = {"tcp": "kernel sockets", "ipc": "same-host peers: process_vm_readv / memfd segments, CUDA IPC (VMM: fds) for GPU memory",
              "netplugin": "NCCL net plugin " + _value(opts, "net_plugin")}
    try:
        with tether.Endpoint() as probe:  # what this build reports (fabric: libfabric found, a provider usable)
            for name, why in probe.transports().items():
                transports[name] = {"available": why == "", "why": why or usable.get(name, "usable")}
    except tether.TetherError:
        pass  # a bad TETHER_* setting; the sections below report it
    if transports.get("fabric", {}).get("available"):
        transports["fabric"]["why"] = "libfabric provider " + (_value(opts, "fabric_provider") or "auto")
    gpus = _gpus()
    topo = topology(gpus)
    nics = _nics(topo) if topo["nics"] else []
    return {
        "tether": tether.__version__,
        "wire_version": tether.WIRE_VERSION,
        "cpus": os.cpu_count(),
        "busy_poll_us": int(_value(opts, "busy_poll_us")) if opts else None,
        "numa_nodes": len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1,
        "nics": nics,
        "gpus": gpus,
        "nvlink_topology": _nvlink_matrix(),
        "gpu_nic_affinity": topo["gpu_nics"],
        "fabric_rails": fabric_rails(gpus) if transports.get("fabric", {}).get("available") else None,
        "topology": topo,
        "cuda": bool(cuda),
        "libfabric": fabric,
        "libfabric_providers": _fabric_providers() if fabric else None,
        "nccl_net_plugins": _nccl_net_plugins(),
        "sysctls": sysctls,
        "transports": transports,
        "nixl": _nixl(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("TETHER_") and "TOKEN" not in k},
        "options": opts,
        "config_error": config_error,
    }


def _nixl() -> dict[str, Any]:
    """NIXL: installed? which version? does it list and create our TETHER backend (tether.nixl)?"""
    from . import nixl
    try:
        return nixl.status()
    except Exception as e:  # a broken NIXL install is a finding, not a crash of doctor
        return {"nixl_installed": None, "detail": f"{type(e).__name__}: {e}"}


def _bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n and n % (1 << 20) == 0 else f"{n} B"


def _table(title: str, *columns: str):
    """Cells wrap at spaces and fold where a word is too long: a narrow terminal never cuts one."""
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, overflow="fold")
    return t


def _numa(node: Optional[int]) -> str:
    return "-" if node is None or node < 0 else str(node)  # unknown (no PCI device, or one node)


def render(report: dict[str, Any]) -> None:
    from rich.console import Console

    from tether import _tether

    c = Console()
    c.print(f"[bold]tether {report['tether']}[/bold] (wire version {report['wire_version']})")
    c.print(f"CPUs: {report['cpus']}, NUMA nodes: {report['numa_nodes']}; GPUs: {len(report['gpus']) or 'none'};"
            f" CUDA: {'yes' if report['cuda'] else 'no'}; libfabric: {report['libfabric'] or 'not found'}")
    busy = report.get("busy_poll_us")
    if busy is not None:
        c.print(f"Busy polling: {busy} µs after each message, then sleep" if busy else
                "Busy polling: off (threads sleep at once; default below 8 CPUs; TETHER_BUSY_POLL_US)")
    if report["libfabric"]:
        prov = report["libfabric_providers"]
        c.print("libfabric providers: " + (", ".join(prov) if prov else "unknown (install libfabric-bin for fi_info)"))
    c.print("NCCL net plugins: " + (", ".join(report["nccl_net_plugins"]) or "none found"))
    if report["gpus"]:
        t = _table("GPUs", "index", "name", "memory", "PCI", "NUMA", "nearest NICs")
        for g in report["gpus"]:
            near = report["gpu_nic_affinity"].get(str(g["index"]), [])
            t.add_row(str(g["index"]), g["name"], g["memory"], g["pci_bus_id"], _numa(g["numa_node"]),
                      ", ".join(near[:4]) or "-")
        c.print(t)
    if report["nvlink_topology"]:
        c.print("[bold]GPU topology (nvidia-smi topo -m)[/bold]")
        c.print(report["nvlink_topology"], markup=False, soft_wrap=True)  # a matrix: never re-wrapped
    topo = report["topology"]
    error = report["config_error"] or topo.get("error")
    if error:  # one line naming the bad variable (the topology fails on the same one)
        c.print(f"tether cannot start with this environment: {error}", style="red", markup=False, highlight=False,
                soft_wrap=True)
    t = _table("NICs", "name", "state", "addresses", "speed", "NUMA", "local CPUs", "tether uses")
    for n in report["nics"]:
        t.add_row(n["name"], n["state"], "\n".join(n["addrs"]) or "-",
                  f"{n['speed_mbps']} Mb/s" if n["speed_mbps"] else "-",
                  _numa(n["numa_node"]), n["local_cpus"] or "-", n["use"] or "-")
    c.print(t)
    # Paths are long and must stay whole (copied into commands): one line each, below the table.
    c.print("NIC PCI paths:")
    for n in report["nics"]:
        c.print(f"  {n['name']}: {n['pci_path'] or 'virtual (no PCI device)'}", soft_wrap=True,
                highlight=False, markup=False)
    if topo["threads"]:
        t = _table("Progress threads (TETHER_CHANNELS, TETHER_TX_CPUS / TETHER_RX_CPUS)", "thread", "NIC", "CPUs", "why")
        for th in topo["threads"]:
            t.add_row(str(th["thread"]), th["nic"] or "-", th["cpus"] or "any", th["why"])
        c.print(t)
    rails = report.get("fabric_rails")
    if rails:
        t = _table(f"Fabric rails ({rails['provider']})", "rail", "domain", "NUMA")
        for i, r in enumerate(rails["rails"]):
            t.add_row(str(i), r["domain"], _numa(r["numa_node"]))
        c.print(t)
        c.print("Rail PCI paths:")
        for i, r in enumerate(rails["rails"]):
            c.print(f"  rail {i}: {r['pci_path'] or 'PCI path unknown'}", soft_wrap=True, highlight=False, markup=False)
        node = rails["host_numa"]
        c.print(f"Rail order, host memory (NUMA {node if node >= 0 else 'any'}): " + ", ".join(rails["host_order"]))
        for gpu, order in rails["gpu_orders"].items():
            c.print(f"Rail order, GPU {gpu}: " + ", ".join(order))
    t = _table("Transports", "transport", "available", "why")
    for name, v in report["transports"].items():
        t.add_row(name, "[green]yes[/green]" if v["available"] else "[red]no[/red]", v["why"])
    c.print(t)
    n = report["nixl"]
    t = _table("NIXL (serving stacks: vLLM, SGLang, Dynamo)", "NIXL", "version", "sees TETHER", "detail")
    sees = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}[n.get("nixl_sees_tether")]
    t.add_row({True: "installed", False: "not installed", None: "?"}[n.get("nixl_installed")],
              n.get("nixl_version") or "-", sees, n.get("detail") or "backends=[\"TETHER\"] uses tether")
    c.print(t)
    t = _table("sysctls", "key", "value", "advice")
    for k, v in report["sysctls"].items():
        t.add_row(k, " ".join(v["value"].split()) or "?",
                  "[green]ok[/green]" if v["ok"] else f"[yellow]{v['advice']}[/yellow]")
    c.print(t)
    if report["options"]:
        _render_options(c, report["options"])
    known = {o["env"] for o in _tether.options()}
    other = {k: v for k, v in report["env"].items() if k not in known}
    if other:  # a misspelt name lands here
        c.print("TETHER_* set that are not options: " + ", ".join(f"{k}={v}" for k, v in other.items()),
                markup=False, highlight=False)


_UNITS = {"seconds": "s", "microseconds": "us"}


def _render_options(c, opts: list[dict]) -> None:
    """The effective configuration: each option's value as an Endpoint created here would use it (in a
    spelling its keyword and variable both take), where it came from, and its help line. A line each, not
    a table: names and values stay whole in a narrow terminal."""
    import textwrap

    c.print("[bold]Options[/bold] (the value an endpoint started here uses, and where it came from)")
    for o in opts:
        value = o["value"]
        if o["kind"] == "bool" and value in ("0", "1"):
            value = "on" if value == "1" else "off"
        elif value and o["kind"] in _UNITS:
            value += _UNITS[o["kind"]]
        name = f"{o['keyword']} = {value or chr(34) * 2}  ({o['env']}: {o['source']})" if o["keyword"] else \
            f"{o['env']} = {value or chr(34) * 2}  ({o['source']})"
        c.print("  " + name, style=None if o["source"] == "default" else "bold", soft_wrap=True, markup=False,
                highlight=False)
        c.print(textwrap.fill(o["help"], width=max(40, c.width - 1), initial_indent="      ",
                              subsequent_indent="      "), markup=False, highlight=False, soft_wrap=True)
