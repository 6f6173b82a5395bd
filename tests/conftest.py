"""What every test under tests/ shares: its wall-clock budget (the watchdog) and the default selection.

Budget: a test (setup, call and teardown) that runs longer than its budget — 45 s, or
`@pytest.mark.budget(seconds)` — fails, named, with the stack it was stuck in and the budget to raise;
the session goes on to the next test and prints its summary. How the watchdog stops it, mildest first:
1. it signals the main thread (SIGALRM), whose handler raises the failure in the test's own code
   (a sleep, a socket or pipe wait, a subprocess wait: anything that returns to Python);
2. a test still stuck after a few seconds waits inside a C++ call that released the GIL (a transfer's
   wait() without a timeout, say): the watchdog closes this process's tether endpoints, which ends
   every such wait with Cancelled, and the failure is raised where the test resumes;
3. a test that no signal and no endpoint reaches ends the run: one line naming it, every thread's stack.

Lab harnesses (`@pytest.mark.lab`: the tools under bench/ that run real benchmark rounds for minutes)
are left out unless asked for: `pytest -m lab`, or their file named (tests/python/test_lab_tools.py).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import pytest

DEFAULT_BUDGET_S = 45.0
GRACE_S = 5.0   # after the first signal, before closing the process's endpoints
LAST_S = 30.0   # after closing them, before giving up on the test (and the run)


def pytest_configure(config):
    config.addinivalue_line("markers", "budget(seconds): wall-clock budget of one test (the watchdog; default 45)")
    config.addinivalue_line("markers", "lab: a lab harness (bench/ tools, minutes of benchmark rounds); "
                                       "left out unless selected with -m lab")
    config.addinivalue_line("markers", "gpu_alone: takes a whole GPU's memory; bench/gpu/par_tests.sh runs it after "
                                       "the other modules, not beside them")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, _on_signal)


def pytest_collection_modifyitems(config, items):
    """Lab harnesses run when asked: -m naming them, or their file or test named on the command line."""
    if "lab" in (config.option.markexpr or ""):
        return
    named = {os.path.abspath(a.split("::")[0]) for a in config.args}
    lab = [it for it in items if it.get_closest_marker("lab") and str(it.path) not in named]
    if lab:
        config.hook.pytest_deselected(items=lab)
        items[:] = [it for it in items if it not in lab]


class _Watch:
    """One test's watchdog: a thread that waits out the budget, then stops the test (module docstring)."""

    def __init__(self, item, budget: float, real_stderr):
        self.item, self.budget, self.err = item, budget, real_stderr
        self.done = threading.Event()
        self.fired = self.reported = False
        self.raised = None  # the failure the handler raised in the test's code
        self.closed = 0     # endpoints closed to free the test
        self.stacks = ""
        self.main = threading.main_thread().ident
        self.root = str(item.config.rootpath) + os.sep
        self.thread = threading.Thread(target=self._run, name="test-budget-watchdog", daemon=True)

    def message(self) -> str:
        more = max(2 * self.budget, self.budget + 30)
        freed = (f"; it was blocked in tether, so the watchdog closed this process's {self.closed} endpoint(s)"
                 if self.closed else "")
        return (f"{self.item.nodeid} ran past its budget of {self.budget:g} s and was stopped{freed}. "
                f"If it needs longer, raise its budget: @pytest.mark.budget({more:g})")

    def _poke(self) -> None:
        try:
            signal.pthread_kill(self.main, signal.SIGALRM)
        except (OSError, ValueError):
            pass

    def _poke_until(self, seconds: float) -> bool:
        """Signals the main thread every 0.2 s (its handler raises once, in test code) until the test
        ends (True) or `seconds` pass (False)."""
        end = time.monotonic() + seconds
        while not self.raised:
            self._poke()
            if self.done.wait(0.2) or time.monotonic() >= end:
                break
        return self.done.wait(max(0.0, end - time.monotonic()))

    def _run(self) -> None:
        if self.done.wait(self.budget):
            return
        self.stacks = _stacks(self.main, self.root)
        self.fired = True
        if self._poke_until(GRACE_S):
            return
        try:
            import tether.api as api
            for ep in list(api._live):
                ep.close()
                self.closed += 1
        except Exception:  # noqa: BLE001 (no tether here, or it is broken: the last step still comes)
            pass
        if self._poke_until(LAST_S):
            return
        self.err.write(f"\n{self.message()}\nNothing reached it in {GRACE_S + LAST_S:g} s more: ending the run. "
                       f"Where every thread was:\n{_stacks(self.main, self.root, every=True)}\n")
        self.err.flush()
        os._exit(70)


_current: list = [None]  # the running test's _Watch (tests run one at a time, on the main thread)


def _in_test_code(frame, root: str) -> bool:
    """Whether the handler interrupted the test's own code (its function, a fixture, what they call)
    rather than pytest's machinery, which a raise there would break: walking out from the interrupted
    frame, a frame under the rootdir comes before any of pytest's."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name == __file__ or f"{os.sep}_pytest{os.sep}" in name or f"{os.sep}pluggy{os.sep}" in name:
            return False
        if name.startswith(root):
            return True
        frame = frame.f_back
    return False


def _on_signal(signum, frame):
    w = _current[0]
    if w is None or not w.fired or w.raised or not _in_test_code(frame, w.root):
        return  # not ours, or inside pytest: the next signal (0.2 s) lands in the test's code
    w.raised = pytest.fail.Exception(w.message(), pytrace=False)
    raise w.raised


def _stacks(main: int, root: str, every: bool = False) -> str:
    """The main thread's stack (every thread's with `every`), from the test's own first frame on."""
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        if t.ident in frames and (every or t.ident == main):
            entries = traceback.extract_stack(frames[t.ident])
            first = next((i for i, e in enumerate(entries) if e.filename.startswith(root)), max(0, len(entries) - 12))
            out.append(f"--- thread {t.name}:\n" + "".join(traceback.format_list(entries[first:])))
    return "\n".join(out)


_REAL_STDERR: list = []


def _real_stderr(config):
    """The terminal's stderr even while pytest captures fd 2 (for the last step's words)."""
    if not _REAL_STDERR:
        f = sys.__stderr__
        try:
            capman = config.pluginmanager.getplugin("capturemanager")
            fd = capman._global_capturing.err.targetfd_save  # pytest internals; fallback above
            f = os.fdopen(os.dup(fd), "w")
        except Exception:  # noqa: BLE001
            pass
        _REAL_STDERR.append(f)
    return _REAL_STDERR[0]


_KEY = pytest.StashKey()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    m = item.get_closest_marker("budget")
    w = _Watch(item, float(m.args[0]) if m else DEFAULT_BUDGET_S, _real_stderr(item.config))
    item.stash[_KEY] = w
    _current[0] = w
    w.thread.start()
    yield


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item):
    yield
    w = item.stash.get(_KEY, None)
    if w is not None:
        w.done.set()
        _current[0] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The phase the watchdog stopped fails with its message and the stack it found, whatever the test
    raised when freed (Cancelled, say) or whether it passed after all."""
    outcome = yield
    w = item.stash.get(_KEY, None)
    if w is None or not w.fired or w.reported:
        return
    w.reported = True
    rep = outcome.get_result()
    ours = call.excinfo is not None and call.excinfo.value is w.raised
    before = "" if rep.passed or ours else f"\n\nThen it raised:\n{rep.longreprtext}"
    rep.outcome = "failed"
    rep.longrepr = f"{w.message()}\n\nWhere it was when its budget ran out:\n{w.stacks}{before}"
