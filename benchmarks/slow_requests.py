"""What a slow request is (issue 22, session 15): one large WRITE at a time between two agents
in this process, timed one by one, with what each transfer cost.

    .venv/bin/python benchmarks/slow_requests.py [--mib 1280] [--transfers 60] [--progress adaptive]

Per transfer: wall time, the process's CPU time, each engine thread's CPU time (by thread name,
from /proc/self/task) and the host's TCP retransmissions (/proc/net/snmp). The transfers are
then split into typical (< 1.1x the median wall time) and slow (> 1.25x), and the mean of each
is printed side by side, with the order in which slow ones came (X slow, x > 1.1x, . typical):
on a shared host they come in stretches of seconds, in which the same bytes cost the kernel's
copies more CPU (docs/benchmarks.md, "What makes a slow loopback kv run"). Loopback only.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np
from loopback_pair import join

import multirail


def thread_ticks() -> collections.Counter[str]:
    """CPU clock ticks (user + system) of this process's threads, summed by thread name."""
    out: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue  # the thread exited meanwhile
        fields = s[s.rindex(")") + 2:].split()
        out[s[s.index("(") + 1:s.rindex(")")]] += int(fields[11]) + int(fields[12])
    return out


def retrans_segs() -> int:
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1280, help="size of each WRITE (default 1280, a bench kv request)")
    ap.add_argument("--transfers", type=int, default=60)
    ap.add_argument("--progress", default="adaptive", choices=("adaptive", "block", "poll"))
    a = ap.parse_args()
    size = a.mib << 20
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    t = multirail.Agent("slow-t", {"progress": a.progress})
    i = multirail.Agent("slow-i", {"timeout": 60.0, "progress": a.progress})
    try:
        src, dst = np.full(size, 7, np.uint8), np.zeros(size, np.uint8)
        t.register_memory(dst)
        i.register_memory(src)
        join(i, t, "slow-t")
        h = i.initialize_xfer("WRITE", [(src.ctypes.data, size, 0)], [(dst.ctypes.data, size, 0)], "slow-t")
        for _ in range(2):  # warm-up
            i.transfer(h)
            i.wait(h, 60)
        rows = []
        for _ in range(a.transfers):
            th0, cpu0, re0, w0 = thread_ticks(), time.process_time(), retrans_segs(), time.perf_counter()
            i.transfer(h)
            i.wait(h, 60)
            wall = time.perf_counter() - w0
            th1 = thread_ticks()
            rows.append({"wall ms": 1e3 * wall, "process CPU ms": 1e3 * (time.process_time() - cpu0),
                         "retransmits": retrans_segs() - re0,
                         **{f"{n} CPU ms": (th1[n] - th0.get(n, 0)) * tick_ms for n in th1}})
    finally:
        i.close()
        t.close()
    med = statistics.median(r["wall ms"] for r in rows)
    print("order:", "".join("X" if r["wall ms"] > 1.25 * med else "x" if r["wall ms"] > 1.1 * med else "."
                            for r in rows))
    groups = {"typical": [r for r in rows if r["wall ms"] < 1.1 * med],
              "slow": [r for r in rows if r["wall ms"] > 1.25 * med]}
    print(f"{a.transfers} WRITEs of {a.mib} MiB, progress {a.progress}; median {med:.1f} ms; "
          f"typical {len(groups['typical'])}, slow {len(groups['slow'])}")
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "wall ms", k))
    print(f"{'mean per transfer':32s} {'typical':>10s} {'slow':>10s}")
    for k in keys:
        means = [statistics.mean(r.get(k, 0) for r in g) if g else None for g in groups.values()]
        if all(m is None or m < 0.05 for m in means):
            continue  # threads that did nothing here (accept, watchdog, notifier)
        print(f"{k:32s} " + " ".join(f"{m:10.1f}" if m is not None else f"{'-':>10s}" for m in means))
    return 0


if __name__ == "__main__":
    sys.exit(main())
