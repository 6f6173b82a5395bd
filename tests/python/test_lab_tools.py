"""Lab harnesses under bench/ (they run real benchmark rounds, minutes each on a small machine): the
goals tool, the A/B table and the environment sweep. Left out of the default run;
`pytest -m lab` runs them (tests/conftest.py)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import tether

pytestmark = pytest.mark.lab

TETHER_PATH = os.path.dirname(os.path.dirname(os.path.abspath(tether.__file__)))
ENV = dict(os.environ, PYTHONPATH=TETHER_PATH + os.pathsep + os.environ.get("PYTHONPATH", ""))
ENV.pop("COLUMNS", None)  # piped with no COLUMNS: the table at full width (the tests read its cells)


@pytest.mark.budget(420)
def test_tcp_goals_judges_each_goal_by_the_median_of_its_rounds(tmp_path):
    """bench/gpu/tcp_goals.py --host-only runs the host-memory goals for real (tether beside the C ceiling
    at the same stream count) and judges each by the median of its rounds' ratios, with the median
    transfer's rate (size / p50) against the same ceiling beside it; the GPU goals are "n/a" here."""
    here = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu")
    r = subprocess.run([sys.executable, os.path.join(here, "tcp_goals.py"), "--rounds", "2", "--host-only", "--out",
                        str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    at = lines.index("by the median of the rounds (the p50 transfer's rate against the same ceiling in brackets):")
    per_round = {line.split(" goal ")[0].strip(): line for line in lines[1:at]}
    verdicts = {line[:30].strip(): line[30:].strip() for line in lines[at + 1:] if not line.startswith("  CPU ")}
    for what in ("host 256 MiB write", "host 256 MiB read"):
        ratios = sorted(float(cell.split(" = ")[1].split()[0]) for cell in per_round[what].split(" | "))
        assert len(ratios) == 2, per_round[what]
        median, rest = verdicts[what].split(" (p50 ")
        assert float(median) == pytest.approx(sum(ratios) / 2, abs=0.011), verdicts[what]  # two rounds: their mean
        assert rest.split(")")[0].replace(".", "").isdigit() and " over 2 round(s): " in rest
        assert rest.endswith("(goal >= 0.9)") and ("NOT met" in rest) == (float(median) < 0.9)
    assert verdicts["GPU 16 MiB read"] == "n/a"
    sys.path.insert(0, here)
    try:
        import tcp_goals
    finally:
        sys.path.remove(here)
    # Three rounds: the median decides, not the best round nor the mean (0.2 + 0.61 + 0.95 averages 0.59).
    assert tcp_goals.verdict([(0.95, 1.0), (0.2, 0.9), (0.61, 0.7)], 0.6).startswith("0.61 (p50 0.90) over 3 round(s): met")
    assert tcp_goals.verdict([(0.95, 1.0), (0.2, 0.9), (0.59, 0.7)], 0.6).endswith("NOT met (goal >= 0.6)")


@pytest.mark.budget(420)
def test_tcp_goals_compares_variants_round_by_round(tmp_path):
    """tcp_goals.py --variant runs each variant in every round (their own ceilings: two lanes against two
    streams) and ends with them side by side: per goal, each variant's median ratio and median GB/s."""
    here = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu")
    r = subprocess.run([sys.executable, os.path.join(here, "tcp_goals.py"), "--rounds", "1", "--host-only", "--out",
                        str(tmp_path), "--variant", "base=", "--variant", "two=TETHER_CHANNELS=2"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "== base: the environment as is" in out and "== two: TETHER_CHANNELS=2" in out
    side = out.split("variants side by side")[1].splitlines()
    row = next(line for line in side if "host 256 MiB write" in line)
    cells = row.split("host 256 MiB write")[1].split(" | ")
    assert [c.split()[0] for c in cells] == ["base", "two"], row
    for c in cells:  # ratio (a * where met), then GB/s
        ratio, gbps = c.split()[1].rstrip("*"), c.split()[-1]
        assert float(ratio) > 0 and float(gbps) > 0, row
    streams = {}
    for name in ("base", "two"):
        d = json.load(open(tmp_path / f"{name}-r0-host.json"))
        streams[name] = {c["streams"] for c in d["ceilings"]}
    assert streams["two"] == {2} and streams["base"] != {2}, streams  # each ceiling at its own lane count
    sys.path.insert(0, here)
    try:
        import tcp_goals
    finally:
        sys.path.remove(here)
    assert tcp_goals.parse_variant("l7=TETHER_CHANNELS=7,TETHER_X=a=b") == ("l7", {"TETHER_CHANNELS": "7", "TETHER_X": "a=b"})
    assert tcp_goals.parse_variant("base=") == ("base", {})
    for bad in ("=X=1", "l7=TETHER_CHANNELS"):
        with pytest.raises(Exception, match="NAME"):
            tcp_goals.parse_variant(bad)


@pytest.mark.budget(420)
def test_tcp_goals_stops_at_its_deadline_or_on_sigterm_with_whole_rounds(tmp_path):
    """tcp_goals.py --deadline starts no round that would end past it (the first always runs), and SIGTERM
    (a device call's `timeout`) stops at once: either way the report covers the whole rounds run."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu", "tcp_goals.py")
    args = [sys.executable, tool, "--rounds", "3", "--host-only", "--out"]
    r = subprocess.run([*args, str(tmp_path / "d"), "--deadline", "1"], env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deadline: 1 round(s) run" in r.stdout and "tcp goals, 1 rounds" in r.stdout, r.stdout
    p = subprocess.Popen([*args, str(tmp_path / "s")], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines = []
    while not lines or not lines[-1].startswith("round 1 done"):  # printed as each round ends
        lines.append(p.stdout.readline())
        assert lines[-1], "".join(lines)
    p.send_signal(signal.SIGTERM)  # during round 2, whose bench takes seconds
    out = "".join(lines) + p.communicate(timeout=120)[0]
    assert p.returncode == 0, out
    assert "stopped (SIGTERM) during round 2: the report covers the 1 whole round(s)" in out, out
    assert "tcp goals, 1 rounds" in out and "host 256 MiB write" in out, out


@pytest.mark.budget(240)
def test_ab_table_pairs_each_row_over_the_rounds(tmp_path):
    """bench/gpu/ab_table.py (an A/B's verdict) reads real `tether bench` tables. Two runs' logs are
    crossed (round 1: run A new, run B old; round 2: B new, A old), so every row's medians are equal
    (ratio 1.00) and the new build won exactly one round of two; a row printed twice in one log is kept
    as its own row."""
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "tether", "bench", "--quiet", "--transport", "tcp", "--sizes", "64K,1M",
                            "--mode", "write,read", "--iters", "20"], env=ENV, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        outs.append(r.stdout)
    for name, text in (("ab_new_1", outs[0] * 2), ("ab_old_1", outs[1] * 2), ("ab_new_2", outs[1] * 2),
                       ("ab_old_2", outs[0] * 2)):
        (tmp_path / f"{name}.log").write_text(text)
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu", "ab_table.py")
    t = subprocess.run([sys.executable, tool, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert t.returncode == 0, t.stderr
    rows = [line for line in t.stdout.splitlines() if " won " in line and " = " in line]
    assert len(rows) == 8, t.stdout  # write/read x 64 KiB/1 MiB, each twice
    assert sum("(#2)" in row for row in rows) == 4, t.stdout
    for row in rows:
        assert " = 1.00 " in row, row
        won = row.split(" won ")[1]
        assert won in ("1 of 2", "0 of 2"), row  # 0 only where both runs printed the same GB/s


@pytest.mark.budget(420)
def test_sweep_env_runs_each_environment_per_round_beside_a_ceiling(tmp_path):
    """bench/gpu/sweep_env.py: one command under two environments, rounds interleaved, a loopback ceiling
    opening each round; its table has every row once, with the ratio to the first environment, and the
    p50 of a latency row (64 B moves far under 2 GB/s)."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu", "sweep_env.py")
    cmd = f"{sys.executable} -m tether bench --quiet --transport tcp --sizes 64,1M --iters 20"
    t = subprocess.run([sys.executable, tool, "--rounds", "2", "--ceiling", "2", "--out", str(tmp_path),
                        "--env", "base=", "--env", "small=TETHER_CHUNK_BYTES=262144", cmd],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert t.returncode == 0, t.stdout + t.stderr
    ceilings = [line for line in t.stdout.splitlines() if line.startswith("== round ") and "ceiling" in line]
    assert len(ceilings) == 2 and all(float(c.split()[-2]) > 0 for c in ceilings), t.stdout
    assert sorted(os.listdir(tmp_path)) == ["base_1.log", "base_2.log", "small_1.log", "small_2.log"]
    table = t.stdout.split("median GB/s over 2 rounds")[1].splitlines()[1:]
    # A 64 B row whose GB/s prints as 0.00 is keyed by its p50 (ab_table.py): its name says so, or not on a
    # machine fast enough for 0.01.
    rows = {line.split("  base ")[0].strip().removesuffix(" p50 µs"): line for line in table if "  base " in line}
    assert set(rows) == {"write tcp cpu 64 B", "write tcp cpu 1 MiB"}, t.stdout
    assert " p50 " in rows["write tcp cpu 64 B"] and "small " in rows["write tcp cpu 64 B"], t.stdout
    assert "x, " in rows["write tcp cpu 1 MiB"], t.stdout  # the ratio to base and the rounds won
    # Each run's line carries the hypervisor's share of the CPU time while it ran (0 where there is none).
    runs = [line for line in t.stdout.splitlines() if line.startswith(("== base round", "== small round"))]
    assert len(runs) == 4 and all(0.0 <= float(line.split(" steal ")[1].split(" %")[0]) <= 100.0 for line in runs)
    sys.path.insert(0, os.path.dirname(tool))
    try:
        import sweep_env
    finally:
        sys.path.remove(os.path.dirname(tool))
    # --skip-steal PCT: rounds in which some run lost more than PCT % are left out; without it, none is.
    assert sweep_env.rounds_to_keep([0.0, 3.5, 0.4, 1.0], 1.0) == [0, 2, 3]
    assert sweep_env.rounds_to_keep([0.0, 3.5], None) == [0, 1]
    # --deadline: a round starts only where it would end in time at the slowest round's pace so far.
    assert sweep_env.should_start(0.0, [], 10.0) and sweep_env.should_start(500.0, [400.0], 0)
    assert sweep_env.should_start(6.0, [3.0, 4.0], 10.0) and not sweep_env.should_start(6.5, [3.0, 4.0], 10.0)
    # A run past --timeout is killed with its process group and counts as exit status 124; the sweep goes on.
    t0 = time.monotonic()
    assert sweep_env.run_group("sleep 30", dict(os.environ), subprocess.DEVNULL, 1) == 124
    assert time.monotonic() - t0 < 10


@pytest.mark.budget(240)
def test_sweep_env_stopped_by_sigterm_prints_the_table_of_its_whole_rounds(tmp_path):
    """`timeout` ending a device call's sweep mid-round (SIGTERM) still gets the table, over the rounds
    that finished: a call that ran out of time used to lose every figure it had measured."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu", "sweep_env.py")
    nap = tmp_path / "nap"  # once it exists, every run sleeps a minute after its bench
    cmd = f"{sys.executable} -m tether bench --quiet --transport tcp --sizes 1M --iters 10; [ -e {nap} ] && sleep 60; true"
    p = subprocess.Popen([sys.executable, tool, "--rounds", "4", "--out", str(tmp_path / "logs"),
                          "--env", "base=", "--env", "slow=TETHER_CHUNK_BYTES=262144", cmd],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in p.stdout:  # round 1: base, then slow
            seen.append(line)
            if line.startswith("== slow round 1"):
                break
        nap.touch()
        time.sleep(8)  # round 2's first run has run its bench and sleeps
        p.terminate()
        out = "".join(seen) + p.communicate(timeout=60)[0]
    finally:
        p.kill()
    assert p.returncode == 0, out
    assert "stopped (SIGTERM) during round 2: the table covers the 1 whole round(s)" in out, out
    table = out.split("median GB/s over 1 rounds")[1].splitlines()[1:]
    assert any(line.strip().startswith("write tcp cpu 1 MiB") and "slow " in line for line in table), out
