"""Builds the libFuzzer target tests/fuzz/fuzz_endpoint.cc with clang (AddressSanitizer, UBSan) and
runs it from the seeds for a bounded time: TETHER_FUZZ_SECONDS (default 60). A crash, a sanitizer
report or a harness finding (a peer not reaped, descriptors not returned, a legitimate write that
fails) fails the test with the fuzzer's output. docs/RELIABILITY.md has a longer run's figures.
Skipped where clang with libFuzzer is missing (Debian: apt-get install clang libclang-rt-dev)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "fuzz"
HERE = Path(__file__).resolve().parent


def _clang() -> str:
    """A clang++ that links -fsanitize=fuzzer, or ''."""
    names = ["clang++"] + [f"clang++-{v}" for v in range(20, 13, -1)]
    for name in names:
        path = shutil.which(name)
        if not path:
            continue
        probe = BUILD / "probe"
        probe.mkdir(parents=True, exist_ok=True)
        src = probe / "p.cc"
        src.write_text('#include <cstdint>\n#include <cstddef>\nextern "C" int LLVMFuzzerTestOneInput'
                       '(const uint8_t*, size_t) { return 0; }\n')
        r = subprocess.run([path, "-fsanitize=fuzzer,address", str(src), "-o", str(probe / "p")], capture_output=True)
        if r.returncode == 0:
            return path
    return ""


def _drop_stale_cache(cxx: str) -> None:
    """Removes a CMake cache configured with another compiler or without TETHER_BUILD_FUZZ: CMake deletes
    such a cache itself on a compiler change and re-runs with defaults, dropping our -D options (the
    fuzz target then does not exist)."""
    cache = BUILD / "CMakeCache.txt"
    if not cache.exists():
        return
    text = cache.read_text(errors="replace")
    compiler = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.*)$", text, re.M)
    same = compiler is not None and Path(compiler.group(1)).resolve() == Path(cxx).resolve()
    if not same or "TETHER_BUILD_FUZZ:BOOL=ON" not in text:
        cache.unlink()
        shutil.rmtree(BUILD / "CMakeFiles", ignore_errors=True)


def build() -> Path:
    """Configures and builds build/fuzz/fuzz_endpoint; returns its path."""
    cxx = _clang()
    if not cxx:
        pytest.skip("no clang++ with libFuzzer (apt-get install clang libclang-rt-dev)")
    _drop_stale_cache(cxx)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(BUILD), *gen, f"-DCMAKE_CXX_COMPILER={cxx}",
                    "-DCMAKE_BUILD_TYPE=Release", "-DTETHER_BUILD_FUZZ=ON", "-DTETHER_BUILD_PYTHON=OFF",
                    "-DTETHER_CUDA=OFF"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(BUILD), "--target", "fuzz_endpoint", "-j", str(os.cpu_count() or 2)],
                   check=True)
    return BUILD / "fuzz_endpoint"


def run(seconds: int, corpus: Path, extra=()) -> tuple[int, str, dict]:
    """Runs the fuzzer for `seconds` over `corpus` (kept: new inputs are added) and fresh seeds."""
    binary = build()
    seeds = BUILD / "seeds"
    subprocess.run([sys.executable, str(HERE / "seeds.py"), str(seeds)], check=True, capture_output=True)
    corpus.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    r = subprocess.run([str(binary), f"-max_total_time={seconds}", "-max_len=16384", "-timeout=60",
                        "-rss_limit_mb=4096", "-print_final_stats=1", f"-artifact_prefix={BUILD}/", *extra,
                        str(corpus), str(seeds)], capture_output=True, text=True, env=env, cwd=BUILD,
                       timeout=seconds + 600)
    out = r.stdout + r.stderr
    stats = {k: int(v) for k, v in re.findall(r"stat::(\w+):\s+(\d+)", out)}
    last = re.findall(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)", out)
    if last:
        stats.update(zip(("inputs", "cov", "ft", "corpus"), map(int, last[-1])))
    retried = re.findall(r"harness: \d+ inputs, (\d+) well-formed connects retried", out)
    if retried:
        stats["connects_retried"] = int(retried[-1])
    return r.returncode, out, stats


FUZZ_SECONDS = int(os.environ.get("TETHER_FUZZ_SECONDS", "60"))


@pytest.mark.budget(FUZZ_SECONDS + 900)  # the build (≈ 3 min on 2 cores) and the fuzzer's own run
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_fuzz_endpoint_bounded():
    seconds = FUZZ_SECONDS
    rc, out, stats = run(seconds, BUILD / "corpus")
    print(f"fuzz_endpoint {seconds} s: {stats}")
    assert rc == 0, out[-8000:]
    assert stats.get("number_of_executed_units", 0) > 0, out[-3000:]
