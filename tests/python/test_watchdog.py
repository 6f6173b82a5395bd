"""The per-test watchdog (tests/conftest.py) and the default selection, run on a small suite of their own
in a child pytest: a test past its budget fails by name with the way to raise it, and the session goes
on to the next test and its summary, whether the test sleeps in Python or waits in tether's C++."""
import os
import shutil
import subprocess
import sys
import time

import pytest

import tether

HERE = os.path.dirname(os.path.abspath(__file__))
TETHER_PATH = os.path.dirname(os.path.dirname(os.path.abspath(tether.__file__)))

SUITE = '''
import time, numpy as np, pytest, tether

@pytest.mark.budget(1)
def test_sleeps_past_its_budget():
    time.sleep(60)

@pytest.mark.budget(1)
def test_blocked_in_a_tether_wait():
    a = tether.Endpoint(transport="tcp"); b = tether.Endpoint(transport="tcp")
    region = a.register(np.zeros(4096, np.uint8))
    peer = a.connect(b.metadata(), timeout=5)
    peer.recv(region).wait()  # no timeout, and no send ever comes: only closing the endpoint ends it

def test_after_them_runs():
    assert True

@pytest.mark.lab
def test_lab_harness():
    assert True
'''


def _pytest(tmp_path, *args):
    shutil.copy(os.path.join(HERE, "..", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = dict(os.environ, PYTHONPATH=TETHER_PATH)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:timeout", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)


@pytest.mark.budget(120)
def test_an_overrun_fails_that_test_alone_and_the_session_goes_on(tmp_path):
    t0 = time.monotonic()
    r = _pytest(tmp_path)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "2 failed, 1 passed, 1 deselected" in out, out  # the summary: the run went on to the end
    assert ("test_suite.py::test_sleeps_past_its_budget ran past its budget of 1 s and was stopped. If it needs "
            "longer, raise its budget: @pytest.mark.budget(31)") in out, out
    assert "test_suite.py::test_blocked_in_a_tether_wait ran past its budget of 1 s and was stopped; it was " \
           "blocked in tether, so the watchdog closed this process's 2 endpoint(s)" in out, out
    assert "peer.recv(region).wait()" in out and "time.sleep(60)" in out, out  # where each was stuck
    assert "Then it raised:" in out, out  # what the freed wait raised (Cancelled, ConnectionLost)
    assert took < 60, took


@pytest.mark.budget(60)
def test_lab_harnesses_run_only_when_asked(tmp_path):
    """Left out of a plain run (above), they run with -m lab or when named."""
    r = _pytest(tmp_path, "-m", "lab")
    assert r.returncode == 0 and "1 passed, 3 deselected" in r.stdout, r.stdout + r.stderr
    r = _pytest(tmp_path, "test_suite.py::test_lab_harness")
    assert r.returncode == 0 and "1 passed in" in r.stdout, r.stdout + r.stderr
