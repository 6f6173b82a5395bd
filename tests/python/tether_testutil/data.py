"""Test data: seeded random and poisoned buffers, byte-exact comparison that names the first
difference, and bounded waits for transfers and conditions."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np


POISON = 0xA5
KiB = 1 << 10
MiB = 1 << 20


def rand_bytes(seed: int, n: int) -> np.ndarray:
    """Deterministic random bytes (both processes can regenerate the same data from a seed)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def poisoned(n: int, value: int = POISON) -> np.ndarray:
    return np.full(n, value, dtype=np.uint8)


def first_mismatch(a: np.ndarray, b: np.ndarray) -> Optional[int]:
    a = np.asarray(a, dtype=np.uint8).reshape(-1)
    b = np.asarray(b, dtype=np.uint8).reshape(-1)
    if a.size != b.size:
        return min(a.size, b.size)
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else None


def assert_bytes_equal(actual, expected, what: str = "buffer") -> None:
    """Compares every byte; reports the first differing offset and how many differ."""
    actual = np.asarray(actual, dtype=np.uint8).reshape(-1)
    expected = np.asarray(expected, dtype=np.uint8).reshape(-1)
    assert actual.size == expected.size, f"{what}: size {actual.size} != expected {expected.size}"
    diff = np.flatnonzero(actual != expected)
    if diff.size:
        i = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.size} of {actual.size} bytes differ; first at offset {i}: "
            f"got {actual[i:i + 8].tolist()} expected {expected[i:i + 8].tolist()}")


def assert_poison(buf, what: str = "buffer", value: int = POISON) -> None:
    buf = np.asarray(buf, dtype=np.uint8).reshape(-1)
    bad = np.flatnonzero(buf != value)
    if bad.size:
        raise AssertionError(f"{what}: {bad.size} bytes were modified; first at offset {int(bad[0])}")


def wait_error(transfer, timeout: float = 10.0) -> BaseException:
    """Waits for a transfer that must fail; returns its exception (fails the test if it succeeds)."""
    try:
        transfer.wait(timeout)
    except Exception as e:  # noqa: BLE001
        import tether
        if isinstance(e, tether.TransferTimeout):
            raise AssertionError(f"transfer still running after {timeout} s") from e
        return e
    raise AssertionError(f"transfer unexpectedly succeeded: {transfer!r}")


def immediate_error(transfer, exc) -> BaseException:
    """A local check's refusal: the transfer is already finished when the call returns, failed with `exc`."""
    assert transfer.done(), "a locally detectable error must finish the transfer immediately"
    e = wait_error(transfer, timeout=0.5)
    assert isinstance(e, exc), f"expected {exc.__name__}, got {type(e).__name__}: {e}"
    return e


def cancel_and_wait(transfer, timeout: float = 10.0) -> None:
    """Cancels a transfer that may already have finished: it ends either done or failed as cancelled."""
    transfer.cancel()
    try:
        transfer.wait(timeout)
    except Exception as e:  # noqa: BLE001
        assert "cancelled" in str(e), e


def poisoned_target(initiator, target, size: int, seed: int) -> tuple:
    """(a poisoned buffer of `size` bytes registered at `target`, its descriptor, `size` random bytes
    from `seed` registered at `initiator`)."""
    dst = poisoned(size)
    return dst, target.register(dst).descriptor(), initiator.register(rand_bytes(seed, size))


def outcome(transfer, timeout: float = 10.0) -> str:
    """'ok' or the exception class name; 'TIMEOUT' if still running after `timeout`."""
    import tether
    try:
        transfer.wait(timeout)
        return "ok"
    except tether.TransferTimeout:
        return "TIMEOUT"
    except tether.TetherError as e:
        return type(e).__name__


def wait_until(pred, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def disjoint_blocks(rng, n, lo, hi, gap_max=37):
    """n (offset, size) pairs, disjoint, sizes odd in [lo, hi), separated by random gaps; and the
    length of a buffer that holds them all."""
    sizes = rng.integers(lo, hi, n) | 1
    gaps = rng.integers(1, gap_max, n)
    offsets = np.cumsum(gaps + np.concatenate([[0], sizes[:-1]]))
    return [(int(o), int(s)) for o, s in zip(offsets, sizes)], int(offsets[-1] + sizes[-1] + 13)
