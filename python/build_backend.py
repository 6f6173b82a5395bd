"""pip's build backend for tether: scikit-build-core, keeping the CMake build between installs.

pip builds every `pip install .` in a new isolated environment. scikit-build-core records where it
was imported from in build/<wheel tag>/.skbuild-info.json and, seeing a new path, clears the build
directory (CMakeCache.txt and CMakeFiles/, which hold every object file): each install compiled all
targets again. Nothing tether builds depends on that path (CMakeLists.txt keeps nanobind at a stable
path in the build tree), so before delegating, the recorded path is set to this run's. What else marks
a build stale (another source directory, CMake, settings) still does; were scikit-build-core to change
that file, the cost is the old one, a full rebuild.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import scikit_build_core
from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks, unchanged but these two)
from scikit_build_core.build import build_editable as _build_editable
from scikit_build_core.build import build_wheel as _build_wheel


def _adopt_build_dirs() -> None:
    here = str(Path(scikit_build_core.__file__).parent.resolve())
    source = str(Path.cwd().resolve())  # pip runs the backend in the source tree
    for info_path in Path("build").glob("*/.skbuild-info.json"):
        try:
            info = json.loads(info_path.read_text())
            if info.get("source_dir") != source or info.get("skbuild_path") == here:
                continue
            info["skbuild_path"] = here
            tmp = info_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(info, indent=2))
            os.replace(tmp, info_path)
        except (OSError, ValueError, AttributeError):  # unreadable: scikit-build-core clears it itself
            continue


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _adopt_build_dirs()
    return _build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _adopt_build_dirs()
    return _build_editable(wheel_directory, config_settings, metadata_directory)
