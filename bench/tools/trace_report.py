#!/usr/bin/env python3
"""Where a transfer's time goes, from TETHER_TRACE files (src/core/trace.h).

    TETHER_TRACE=/tmp/tr tether bench --transport tcp --device gpu --sizes 4M --mode write
    python3 bench/tools/trace_report.py /tmp/tr
    python3 bench/tools/trace_report.py /tmp/tr --gaps 50     # where a stalled transfer stopped
    python3 bench/tools/trace_report.py /tmp/tr --phases      # a transfer's milestones, µs after its post
    python3 bench/tools/trace_report.py /tmp/tr --sender-time # a staged sender's time: sendmsg, copy wait, idle
    python3 bench/tools/trace_report.py /tmp/tr --reader-time # a receiving lane's time: in recv, between chunks
    python3 bench/tools/trace_report.py /tmp/tr --outliers 4  # transfer times; the slowest, lane by lane
    python3 bench/tools/trace_report.py /tmp/tr --timeline 0.5 # the median transfer, every event lane by lane

Every chunk is one (slot, gen) pair on both sides: the initiator pulls and sends it, the target reads
its header and lands it, and the answer (ack or read response) goes back. The events of one chunk,
from both processes, are put in time order; each step between two consecutive events is one row
(percentiles over all chunks). The process that posted transfers is the initiator ("I"), the other
the target ("T"). Steps that include a GPU copy are taken→staged (out of the GPU) and
landed→unpacked (into it); header→… and …→answered include wake-ups of a sleeping thread.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import glob
import signal
import sys

TYPES = {1: "write", 2: "ack", 3: "readreq", 4: "readresp", 5: "senddata", 6: "batch", 7: "readbatch", 8: "pull"}


def load(prefix: str):
    procs = {}
    for path in sorted(glob.glob(prefix + ".*.tsv")):
        rows = []
        with open(path) as f:
            for line in f:
                if line.startswith("#") or line.startswith("ns\t"):
                    continue
                fields = line.rstrip("\n").split("\t")
                if len(fields) not in (6, 7):  # a process that exited mid-flush (os._exit) leaves its last line cut
                    continue
                ns, event, lane, typ, slot, gen = fields[:6]
                cpu = int(fields[6]) if len(fields) == 7 else -1  # older traces have no cpu column
                rows.append((int(ns), event, int(lane), int(typ), int(slot), int(gen), cpu))
        procs[path] = rows
    return procs


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def print_gaps(procs, side, ms: float) -> int:
    evs = sorted((r, side[p]) for p, rows in procs.items() for r in rows)
    posts = [r[0] for r, _ in evs if r[1] == "post"]
    waits = [r[0] for r, _ in evs if r[1] == "waited"]
    found = 0
    for i in range(len(evs) - 1):
        t, nxt = evs[i][0][0], evs[i + 1][0][0]
        if nxt - t <= ms * 1e6:
            continue
        k = bisect.bisect_right(posts, t) - 1  # the transfer posted last before this silence
        w = bisect.bisect_right(waits, posts[k]) if k >= 0 else len(waits)
        if w == len(waits) or waits[w] <= t:  # not inside a transfer that was waited for
            continue
        found += 1
        print(f"--- {(nxt - t) / 1e6:.1f} ms without an event, {(t - posts[k]) / 1e3:.0f} µs after a post")
        for (ns, event, lane, typ, slot, gen, cpu), who in evs[max(0, i - 30):i + 9]:
            print(f"{(ns - t) / 1e3:12.1f} µs  {who}:{event:9} lane {lane} {TYPES.get(typ, typ)} slot {slot} gen {gen} cpu {cpu}")
    print(f"{found} silences over {ms} ms inside transfers ({len(posts)} posts)")
    return 0


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", help="the TETHER_TRACE prefix the run used")
    ap.add_argument("--skip", type=float, default=0.0, help="ignore chunks in the first SKIP seconds (warm-up)")
    ap.add_argument("--last", type=int, default=0, help="only the chunks of the last N transfers posted")
    ap.add_argument("--slowest", type=int, default=3, help="print the event sequence of the N slowest chunks")
    ap.add_argument("--lanes", type=int, default=0,
                    help="for each of the last N transfers (post to wait() returning): per lane, when it first sent, "
                         "how many chunks it took, and when the target last sent on it (the lanes' balance)")
    ap.add_argument("--phases", action="store_true",
                    help="instead: when each milestone of a transfer came (µs after its post, percentiles over the "
                         "transfers): its first request or chunk out, the target's first copy and send, each lane's "
                         "last send (the earliest and the latest lane), the last landing, copy in, answer, wait()")
    ap.add_argument("--sender-time", action="store_true",
                    help="instead: per sending lane and transfer (percentiles), how many chunks it sent, time inside "
                         "sendmsg, waiting for a copy out of the GPU with nothing else to send, idle with nothing "
                         "asked of it, and when its last send ended (a staged read's target, a staged write's initiator)")
    ap.add_argument("--reader-time", action="store_true",
                    help="instead: per receiving lane and transfer (percentiles), how many chunks it landed, time "
                         "from each header to its payload landed (inside recv), between one chunk landed and the "
                         "next header (its own work on the last one, and waiting for bytes), and when its first "
                         "header, last landing and last copy into the GPU happened (a read's initiator, a write's "
                         "target)")
    ap.add_argument("--gaps", type=float, default=0.0,
                    help="instead: every silence longer than GAPS ms inside a transfer (post to wait() returning, "
                         "both processes' events), with the 30 events before it and 8 after (a stalled transfer)")
    ap.add_argument("--outliers", type=int, default=0,
                    help="instead: the transfers' times (percentiles, a histogram), then the median one and the N "
                         "slowest lane by lane: events, first and last (µs after the post), the CPUs its thread ran "
                         "on, and its longest silence (which lane stopped, and after what)")
    ap.add_argument("--timeline", type=float, default=None, metavar="Q",
                    help="instead: the transfer at quantile Q of the transfers' times (0.5: the median), every "
                         "event of both sides lane by lane, µs after its post (it shows, e.g., a read's "
                         "first copies out of the GPU finishing in two waves)")
    return ap


def print_chunk_steps(procs, side, a) -> int:
    """The default report: each step between two consecutive events of a chunk (percentiles over the
    chunks), what lies outside them for ops posted one at a time, wake-ups, and the slowest chunks."""
    t0 = min(r[0] for rows in procs.values() for r in rows)
    posts = sorted(r[0] for rows in procs.values() for r in rows if r[1] == "post")
    since = posts[-a.last] if a.last and len(posts) >= a.last else 0
    chunks = collections.defaultdict(list)
    for p, rows in procs.items():
        for ns, event, lane, typ, slot, gen, _cpu in rows:
            if event in ("called", "post", "wake", "waited"):
                continue
            if ns - t0 < a.skip * 1e9 or ns < since:
                continue
            chunks[(slot, gen)].append((ns, f"{side[p]}:{event}/{TYPES.get(typ, typ)}", lane))
    steps = collections.defaultdict(list)
    totals = []
    for key, evs in chunks.items():
        evs.sort()
        if len(evs) < 2:
            continue
        totals.append((evs[-1][0] - evs[0][0], key))
        for (t1, e1, _), (t2, e2, _) in zip(evs, evs[1:]):
            steps[f"{e1} → {e2}"].append((t2 - t1) / 1e3)
    print(f"{len(chunks)} chunks from {len(procs)} processes ({', '.join(f'{side[p]}={p}' for p in procs)})")
    print(f"{'step':58} {'n':>6} {'p50 µs':>9} {'p90 µs':>9} {'max µs':>9} {'mean µs':>9}")
    for name, v in sorted(steps.items(), key=lambda kv: -sum(kv[1])):
        if len(v) < max(3, len(chunks) // 50):
            continue
        print(f"{name:58} {len(v):6d} {pct(v, .5):9.1f} {pct(v, .9):9.1f} {max(v):9.1f} {sum(v) / len(v):9.1f}")
    if totals:
        t = [x / 1e3 for x, _ in totals]
        print(f"{'chunk, first event to last':58} {len(t):6d} {pct(t, .5):9.1f} {pct(t, .9):9.1f} {max(t):9.1f} {sum(t) / len(t):9.1f}")
    # Ops posted one at a time: what lies outside the chunk steps, before (post → its first step: the
    # post's own work) and after (the last step → wait() returning → the next post: the application).
    waits = sorted(r[0] for rows in procs.values() for r in rows if r[1] == "waited")
    before, to_wait, after = [], [], []
    for evs in chunks.values():
        i = bisect.bisect_right(posts, evs[0][0])
        if i > 0 and posts[i - 1] >= since:
            before.append((evs[0][0] - posts[i - 1]) / 1e3)
        j = bisect.bisect_right(posts, evs[-1][0])
        nxt = posts[j] if j < len(posts) else None
        k = bisect.bisect_right(waits, evs[-1][0])
        if k < len(waits) and (nxt is None or waits[k] < nxt):
            to_wait.append((waits[k] - evs[-1][0]) / 1e3)
            if nxt is not None:
                after.append((nxt - waits[k]) / 1e3)
        elif nxt is not None:
            after.append((nxt - evs[-1][0]) / 1e3)
    for name, v in (("post → its chunk's first step", before), ("chunk's last step → wait() returns", to_wait),
                    ("wait() returns (else the last step) → next post", after)):
        if v:
            print(f"{name:58} {len(v):6d} {pct(v, .5):9.1f} {pct(v, .9):9.1f} {max(v):9.1f} {sum(v) / len(v):9.1f}")
    for p, rows in procs.items():
        wakes = collections.Counter(r[2] for r in rows if r[1] == "wake")
        posts = sum(1 for r in rows if r[1] == "post")
        print(f"{side[p]}: {posts} posts, sleeping wake-ups per progress thread {dict(sorted(wakes.items()))}")
    if a.lanes:
        lane_balance(procs, side, a.lanes)
    for total, key in sorted(totals, reverse=True)[: a.slowest]:
        evs = chunks[key]
        print(f"slowest chunk slot {key[0]} gen {key[1]}: {total / 1e3:.1f} µs")
        for ns, e, lane in evs:
            print(f"   {(ns - evs[0][0]) / 1e3:10.1f} µs  {e:24} lane {lane}")
    return 0


def main() -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: stop quietly
    ap = make_parser()
    a = ap.parse_args()
    procs = load(a.prefix)
    if not procs:
        print(f"no {a.prefix}.*.tsv files", file=sys.stderr)
        return 1
    # The initiator waits for its transfers; a pushed read's target also posts (the push it answers with).
    mark = "waited" if any(r[1] == "waited" for rows in procs.values() for r in rows) else "post"
    side = {p: ("I" if any(r[1] == mark for r in rows) else "T") for p, rows in procs.items()}
    if a.gaps:
        return print_gaps(procs, side, a.gaps)
    if a.phases:
        return print_phases(procs, side, a.skip)
    if a.sender_time:
        return print_sender_time(procs, side, a.skip)
    if a.reader_time:
        return print_reader_time(procs, side, a.skip)
    if a.outliers:
        return print_outliers(procs, side, a.skip, a.outliers)
    if a.timeline is not None:
        return print_timeline(procs, side, a.skip, a.timeline)
    return print_chunk_steps(procs, side, a)


def transfers(procs, side, skip: float):
    """(post, wait() returning, both processes' events between them as ((ns, event, lane, type, slot,
    gen, cpu), side)) for every transfer posted after the first SKIP seconds and waited for."""
    evs = sorted((r, side[p]) for p, rows in procs.items() for r in rows)
    t_first = evs[0][0][0] if evs else 0
    posts = [(r[0], w) for r, w in evs if r[1] == "post" and r[0] - t_first >= skip * 1e9]
    # A pushed read's target posts too (the push); traces from before the initiator marked its pull have
    # only the target's post.
    posts = [t for t, w in posts if w == "I"] or [t for t, _ in posts]
    waits = [r[0] for r, w in evs if r[1] == "waited" and w == "I"]
    times = [r[0] for r, _ in evs]
    for t0 in posts:
        k = bisect.bisect_left(waits, t0)
        if k < len(waits):
            yield t0, waits[k], evs[bisect.bisect_left(times, t0):bisect.bisect_right(times, waits[k])]


def print_outliers(procs, side, skip: float, n: int) -> int:
    """Transfer times, then the median transfer and the n slowest lane by lane. A slow transfer whose
    lanes all ended early but one, silent for milliseconds, had a thread that did not run (or a copy
    that did not finish); one whose lanes all paused together waited on something they share."""
    xs = list(transfers(procs, side, skip))
    if not xs:
        print("no transfer was posted and waited for")
        return 1
    order = sorted(range(len(xs)), key=lambda i: xs[i][1] - xs[i][0])
    v = [(xs[i][1] - xs[i][0]) / 1e3 for i in order]
    print(f"{len(v)} transfers, µs: p10 {pct(v, .1):.0f} p50 {pct(v, .5):.0f} p90 {pct(v, .9):.0f} "
          f"p99 {pct(v, .99):.0f} max {v[-1]:.0f}")
    step = max(50, int(pct(v, .5) / 4) // 50 * 50)  # about four buckets to the median
    hist = collections.Counter(int(x // step) * step for x in v)
    print(f"histogram ({step} µs buckets): " + ", ".join(f"{k}: {c}" for k, c in sorted(hist.items())))
    for tag, i in [("median", order[len(order) // 2])] + [("slow", i) for i in order[::-1][:n]]:
        t0, t1, window = xs[i]
        lanes = collections.defaultdict(list)
        for (ns, event, lane, _typ, _slot, _gen, cpu), who in window:
            if event not in ("called", "post", "waited"):  # a wake-up names its progress thread, not a lane
                lanes[(who, "thread" if event == "wake" else "lane", lane)].append((ns, event, cpu))
        print(f"-- {tag} transfer: {(t1 - t0) / 1e3:.0f} µs")
        for (who, what, lane), evs in sorted(lanes.items()):
            gaps = [(evs[k + 1][0] - evs[k][0], k) for k in range(len(evs) - 1)]
            g, k = max(gaps) if gaps else (0, 0)
            after = f" after {evs[k][1]} at {(evs[k][0] - t0) / 1e3:.0f} µs, then {evs[k + 1][1]}" if gaps else ""
            cpus = ",".join(str(c) for c in sorted({c for _, _, c in evs}))
            print(f"   {who} {what} {lane}: {len(evs):3d} events, {(evs[0][0] - t0) / 1e3:7.0f} to "
                  f"{(evs[-1][0] - t0) / 1e3:7.0f} µs, cpus {cpus}, longest silence {g / 1e3:.0f} µs{after}")
    return 0


def print_phases(procs, side, skip: float) -> int:
    """Where a transfer's wall time goes: start (before the target's first send), body, tail (after
    the target's last send). Milestones are µs after the post; a lane's last send is per lane, so
    "earliest lane done" against "latest lane done" is the lanes' imbalance."""
    names = ["I called (posting cost)", "T post (a pushed read)", "I first sent", "T first header", "T first staged",
             "T first sent", "earliest lane's T last sent",
             "latest lane's T last sent", "I last landed", "I last unpacked", "I last answered", "waited"]
    got = collections.defaultdict(list)
    # A write or read entering the core comes before its post (negative µs: what checking and queueing cost).
    called = sorted(r[0] for p, rows in procs.items() if side[p] == "I" for r in rows if r[1] == "called")
    for t0, t1, window in transfers(procs, side, skip):
        first, last, lane_last = {}, {}, {}
        k = bisect.bisect_right(called, t0)
        first["I called"] = called[k - 1] if k else None
        for (ns, event, lane, *_), who in window:
            key = f"{who} {event}"
            first.setdefault(key, ns)
            last[key] = ns
            if key == "T sent":
                lane_last[lane] = ns
        mark = {"I called (posting cost)": first.get("I called"), "T post (a pushed read)": first.get("T post"),
                "I first sent": first.get("I sent"), "T first header": first.get("T header"),
                "T first staged": first.get("T staged"), "T first sent": first.get("T sent"),
                "earliest lane's T last sent": min(lane_last.values()) if lane_last else None,
                "latest lane's T last sent": max(lane_last.values()) if lane_last else None,
                "I last landed": last.get("I landed"), "I last unpacked": last.get("I unpacked"),
                "I last answered": last.get("I answered"), "waited": t1}
        for name in names:
            if mark[name] is not None:
                got[name].append((mark[name] - t0) / 1e3)
    n = len(got["waited"])
    print(f"{n} transfers: milestones in µs after the post (I initiator, T target; a write's target sends acks)")
    print(f"{'milestone':32} {'n':>5} {'p10':>8} {'p50':>8} {'p90':>8}")
    for name in names:
        v = got[name]
        if v:
            print(f"{name:32} {len(v):5d} {pct(v, .1):8.1f} {pct(v, .5):8.1f} {pct(v, .9):8.1f}")
    return 0 if n else 1


def print_timeline(procs, side, skip: float, q: float) -> int:
    """One transfer (at quantile q of their times), each side's lanes and threads on a line apiece: every
    event as "event type slot.gen @µs" (µs after the post), a thread's wake-ups as "wake @µs"."""
    xs = sorted(transfers(procs, side, skip), key=lambda x: x[1] - x[0])
    if not xs:
        print("no transfers")
        return 1
    t0, t1, window = xs[min(len(xs) - 1, max(0, int(q * len(xs))))]
    print(f"the transfer at quantile {q} of {len(xs)}: {(t1 - t0) / 1e3:.0f} µs (µs after its post; slot.gen)")
    rows = collections.defaultdict(list)
    for (ns, event, lane, typ, slot, gen, _cpu), who in window:
        at = f"@{(ns - t0) / 1e3:.0f}"
        if event in ("called", "post", "waited"):
            rows[(who, "op", 0)].append(f"{event} {at}")
        elif event == "wake":
            rows[(who, "thread", lane)].append(f"wake {at}")
        else:
            rows[(who, "lane", lane)].append(f"{event} {TYPES.get(typ, typ)} {slot}.{gen} {at}")
    for (who, kind, n), evs in sorted(rows.items()):
        print(f"{who} {kind} {n}: " + ", ".join(evs))
    return 0


def lane_chunks(window, events, types):
    """A transfer's events `events` of frame types `types`, per lane of each side: (side, lane) -> (slot,
    gen) -> event -> ns (its first)."""
    per = collections.defaultdict(lambda: collections.defaultdict(dict))
    for (ns, event, lane, typ, slot, gen, _cpu), who in window:
        if event in events and TYPES.get(typ) in types:
            per[(who, lane)][(slot, gen)].setdefault(event, ns)
    return per


def print_lane_table(title: str, got) -> None:
    """A per-lane-and-transfer table: each row's p10 / p50 / p90."""
    print(title)
    print(f"{'':22} {'p10':>8} {'p50':>8} {'p90':>8}")
    for name, v in got.items():
        print(f"{name:22} {pct(v, .1):8.1f} {pct(v, .5):8.1f} {pct(v, .9):8.1f}")


def print_sender_time(procs, side, skip: float) -> int:
    """Where a sending lane's time goes in each transfer: its staged chunks in send order; a chunk's send
    starts when both its copy is seen done and the chunk before is sent. Time between the previous send
    and this chunk's copy being done is a copy wait, except where the request (or pull) came after that
    send: then the lane was idle until it came. Reads: the target sends; writes: the initiator."""
    got = collections.defaultdict(list)
    n = 0
    for t0, _, window in transfers(procs, side, skip):
        n += 1
        per = lane_chunks(window, ("header", "taken", "staged", "sent"), ("readresp", "write", "batch", "senddata"))
        for chunks in per.values():
            done = sorted((c for c in chunks.values() if "sent" in c and "staged" in c), key=lambda c: c["sent"])
            if not done:
                continue
            send = copy = idle = 0.0
            prev = None
            for c in done:
                send += c["sent"] - max(c["staged"], prev if prev is not None else c["staged"])
                if prev is not None and c["staged"] > prev:
                    asked = c.get("header", c.get("taken", prev))
                    if asked > prev:
                        idle += asked - prev
                        copy += c["staged"] - asked
                    else:
                        copy += c["staged"] - prev
                prev = c["sent"]
            got["chunks"].append(len(done))
            got["inside sendmsg µs"].append(send / 1e3)
            got["copy wait µs"].append(copy / 1e3)
            got["idle µs"].append(idle / 1e3)
            got["last send ended µs"].append((prev - t0) / 1e3)
    if not got:
        print("no staged sends in these transfers (host memory has no copy steps)")
        return 1
    print_lane_table(f"{n} transfers, {len(got['chunks'])} sending lanes: per lane and transfer", got)
    return 0


def print_reader_time(procs, side, skip: float) -> int:
    """Where a receiving lane's time goes in each transfer: its chunks in header order. Header -> landed is
    the payload's recv (the thread's copy out of the socket, and bytes not yet there); landed -> the next
    header is the thread's work on the chunk it landed (answer, copy launch, polls) plus waiting for the
    next one's bytes. A lane busy in recv end to end sets the pace; one with long gaps waits on its sender."""
    got = collections.defaultdict(list)
    n = 0
    for t0, _, window in transfers(procs, side, skip):
        n += 1
        per = lane_chunks(window, ("header", "landed", "unpacked"), ("readresp", "senddata", "write", "batch"))
        for chunks in per.values():
            done = sorted((c for c in chunks.values() if "header" in c and "landed" in c), key=lambda c: c["header"])
            if not done:
                continue
            got["chunks"].append(len(done))
            got["inside recv µs"].append(sum(c["landed"] - c["header"] for c in done) / 1e3)
            got["between chunks µs"].append(sum(b["header"] - a["landed"] for a, b in zip(done, done[1:])) / 1e3)
            got["first header µs"].append((done[0]["header"] - t0) / 1e3)
            got["last landed µs"].append((max(c["landed"] for c in done) - t0) / 1e3)
            unpacked = [c["unpacked"] for c in done if "unpacked" in c]
            if unpacked:
                got["last copy in µs"].append((max(unpacked) - t0) / 1e3)
    if not got:
        print("no landed chunks in these transfers")
        return 1
    print_lane_table(f"{n} transfers, {len(got['chunks'])} receiving lanes: per lane and transfer, µs from the post "
                     "where it says so", got)
    return 0


def lane_balance(procs, side, n: int) -> None:
    """One line per transfer, µs from its post: a transfer ends with its slowest lane, so a lane that
    starts late or pulls few chunks while others pull many shows here (as a 16 MiB GPU read once did)."""
    init = [rows for p, rows in procs.items() if side[p] == "I"]
    target = [r for p, rows in procs.items() if side[p] == "T" for r in rows]
    if not init:
        return
    rows = init[0]
    posts = [r[0] for r in rows if r[1] == "post"]
    waits = [r[0] for r in rows if r[1] == "waited"]
    lanes = sorted({r[2] for r in rows if r[1] == "taken"})
    print(f"lanes of the last {n} transfers (µs from the post): first sent | chunks taken | target's last sent "
          f"| each lane's CPUs, initiator/target | CPUs more than one thread used (side, lane), "
          f"lanes {lanes[0] if lanes else 0}..{lanes[-1] if lanes else 0}")
    for t0 in posts[-n:]:
        k = bisect.bisect_left(waits, t0)
        if k == len(waits):
            continue
        t1 = waits[k]
        first, count, last = {}, collections.Counter(), {}
        for ns, event, lane, *_ in rows:
            if t0 <= ns <= t1 and event == "sent":
                first.setdefault(lane, (ns - t0) / 1e3)
            if t0 <= ns <= t1 and event == "taken":
                count[lane] += 1
        for ns, event, lane, *_ in target:
            if t0 <= ns <= t1 and event == "sent":
                last[lane] = (ns - t0) / 1e3
        # Where each lane's threads ran (initiator/target CPU of its events), and the CPUs that more
        # than one thread used within the transfer: a lane thread that lost its core to another spinner.
        cpus, users = {}, collections.defaultdict(set)
        for who, evs in (("I", rows), ("T", target)):
            for ns, event, lane, *_, cpu in evs:
                if not (t0 <= ns <= t1) or cpu < 0 or event in ("called", "post"):
                    continue
                if event == "waited":
                    users[cpu].add((who, "waiter"))
                    continue
                cpus.setdefault(lane, {}).setdefault(who, set()).add(cpu)
                users[cpu].add((who, lane))
        cells = lambda d, f: " ".join(f(d[x]) if x in d else "-" for x in lanes)  # noqa: E731
        line = (f"{(t1 - t0) / 1e3:8.0f} µs | {cells(first, lambda v: f'{v:.0f}')} | "
                f"{' '.join(str(count[x]) for x in lanes)} | {cells(last, lambda v: f'{v:.0f}')}")
        if cpus:
            where = lambda x: "/".join(",".join(map(str, sorted(cpus[x].get(w, ())))) or "-" for w in "IT")  # noqa: E731
            shared = {c: sorted(f"{w}{x}" for w, x in u) for c, u in users.items() if len(u) > 1}
            line += f" | cpus I/T {' '.join(where(x) if x in cpus else '-' for x in lanes)}"
            line += " | shared " + (" ".join(f"{c}:{'+'.join(shared[c])}" for c in sorted(shared)) or "none")
        print(line)


if __name__ == "__main__":
    sys.exit(main())
