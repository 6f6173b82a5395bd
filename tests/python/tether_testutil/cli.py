"""The `tether` command line run as a user runs it: a child Python with this tree's tether on its path,
piped (no COLUMNS: tables at full width, which the tests read cell by cell) and without TETHER_DEBUG."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import tether

TETHER_PATH = os.path.dirname(os.path.dirname(os.path.abspath(tether.__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the source tree
ENV = dict(os.environ, PYTHONPATH=TETHER_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""))
ENV.pop("COLUMNS", None)
ENV.pop("TETHER_DEBUG", None)


def run_cli(*args, timeout=120, env=None, preexec_fn=None):
    return subprocess.run([sys.executable, "-m", "tether", *args], env=dict(ENV, **(env or {})), capture_output=True,
                          text=True, timeout=timeout, preexec_fn=preexec_fn)


def cells(text: str) -> set:
    """Every word of every table cell."""
    return set(re.split(r"[\s│┃|]+", text))
