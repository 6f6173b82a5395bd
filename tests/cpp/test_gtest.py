"""Builds the GoogleTest unit tests with CMake and runs them, so one `pytest` runs every test."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "cpp-tests"


def _have_gtest() -> bool:
    return any(Path(p).exists() for p in ("/usr/include/gtest/gtest.h", "/usr/local/include/gtest/gtest.h"))


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed: C++ unit tests not built")
@pytest.mark.skipif(not _have_gtest(), reason="GoogleTest headers not installed (apt-get install libgtest-dev)")
def test_cpp_unit_tests():
    BUILD.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", str(ROOT), *gen, "-DTETHER_BUILD_TESTS=ON", "-DTETHER_BUILD_PYTHON=OFF",
                    "-DCMAKE_BUILD_TYPE=Release"], cwd=BUILD, check=True, capture_output=True)
    subprocess.run(["cmake", "--build", ".", "-j", str(os.cpu_count() or 2)], cwd=BUILD, check=True)
    run = subprocess.run([str(BUILD / "tether_unit_tests")], cwd=BUILD, capture_output=True, text=True, timeout=300)
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
