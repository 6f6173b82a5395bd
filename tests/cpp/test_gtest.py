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



SANITIZER_REPORTS = {"thread": "WARNING: ThreadSanitizer", "address": "ERROR: AddressSanitizer"}


@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed: C++ unit tests not built")
@pytest.mark.skipif(not _have_gtest(), reason="GoogleTest headers not installed (apt-get install libgtest-dev)")
@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_cpp_unit_tests_under_a_sanitizer(sanitizer):
    """The same tests built with -fsanitize=thread (data races between lane threads, waiters and the
    control thread) and -fsanitize=address (out-of-bounds, use after free, leaks), so CI fails on them
    rather than waiting for a session to run the sanitizers by hand. Session 22's TSAN run found two
    races: a tcp progress thread reading a waiter's rx state unowned (a stale low mark could hold a
    staged payload's last bytes for epoll's 1 s), and the ipc verdict written while other lanes read it.
    tests/cpp/tsan.supp names the orderings TSAN cannot see (a socket's, a cross-memory attach's)."""
    build = ROOT / "build" / f"cpp-{sanitizer}"
    build.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", str(ROOT), *gen, "-DTETHER_BUILD_TESTS=ON", "-DTETHER_BUILD_PYTHON=OFF",
                    f"-DTETHER_SANITIZE={sanitizer}", "-DTETHER_CUDA=OFF", "-DCMAKE_BUILD_TYPE=RelWithDebInfo"],
                   cwd=build, check=True, capture_output=True)
    subprocess.run(["cmake", "--build", ".", "-j", str(os.cpu_count() or 2)], cwd=build, check=True,
                   capture_output=True)
    env = dict(os.environ, TSAN_OPTIONS=f"suppressions={ROOT / 'tests' / 'cpp' / 'tsan.supp'} halt_on_error=0")
    run = subprocess.run([str(build / "tether_unit_tests")], cwd=build, env=env, capture_output=True, text=True,
                         timeout=600)
    out = run.stdout + run.stderr
    reports = out.count(SANITIZER_REPORTS[sanitizer]) + out.count("ERROR: LeakSanitizer")
    assert run.returncode == 0 and reports == 0, f"{reports} {sanitizer} sanitizer report(s), rc {run.returncode}:\n" + out[-8000:]
