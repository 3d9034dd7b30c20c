#!/usr/bin/env python3
"""What scattered KV pages cost plain sockets, against what they cost multirail (issue 22).

`bench kv` compares its page workload with the same bytes contiguous. On loopback both are
bound by the two copies the kernel makes (sender into the socket, receiver out of it), and
copying scattered pages costs the memory system more than one stream does. This benchmark
measures that floor and the engine on the same layout, in the same run:

  floor   benchmarks/page_floor.c (compiled here with `cc`): one loopback TCP connection, the
          sender writev()s and the receiver readv()s each layer's pages in 1 MiB chunks (as
          multirail's vectored requests carry them), no header, no engine.
  engine  two multirail agents (one process, their own threads), one prepared WRITE per layer,
          the 80 layers posted back to back and waited for, reposted for --seconds.

The layout is bench kv's: 80 layers of 2 MiB in pools of twice that, `shuffled` taking half a
pool's pages in random order on each side, `contig` a layer's first 2 MiB. Each run starts a
fresh process per (worker, layout, page size), in a rotating order, each with one warm-up
request. Per run and page size it reports shuffled / contig for the floor and for the engine:
the engine's page penalty beside the floor's.

    .venv/bin/python benchmarks/page_floor.py [--pages 8192,65536] [--runs 5] [--seconds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS, LAYER = 80, 2 << 20


def engine_child(page: int, layout: str, seconds: float) -> None:
    import numpy as np

    import multirail
    from loopback_pair import join

    pool = 2 * LAYERS * LAYER
    t = multirail.Agent("pf-target", {"timeout": 30.0})
    i = multirail.Agent("pf-init", {"timeout": 30.0})
    try:
        src, dst = np.full(pool, 7, np.uint8), np.full(pool, 1, np.uint8)
        t.register_memory(dst)
        i.register_memory(src)
        join(i, t, "pf-target")
        per = LAYER // page
        rl, rr = np.random.default_rng(11), np.random.default_rng(12)
        handles = []
        for layer in range(LAYERS):
            base = layer * 2 * LAYER
            if layout == "contig":
                lo, ro = [base], [base]
                n = LAYER
            else:
                lo = [base + int(p) * page for p in rl.permutation(2 * per)[:per]]
                ro = [base + int(p) * page for p in rr.permutation(2 * per)[:per]]
                n = page
            handles.append(i.initialize_xfer("WRITE", [(src.ctypes.data + o, n, 0) for o in lo],
                                             [(dst.ctypes.data + o, n, 0) for o in ro], "pf-target"))

        def request() -> None:
            for h in handles:
                i.transfer(h)
            for h in handles:
                i.wait(h, 30)

        request()  # warm-up
        t0, reqs = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            request()
            reqs += 1
        dt = time.perf_counter() - t0
        print(f"{1000 * dt / reqs:.3f} {reqs * LAYERS * LAYER * 8 / dt / 1e9:.3f}")
    finally:
        i.close()
        t.close()


def run_one(cmd: list[str]) -> float:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return float(out.stdout.split()[1])  # Gbit/s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", default="8192,65536", help="page sizes in bytes, comma-separated (each divides 2 MiB)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--engine-child", nargs=3, metavar=("PAGE", "LAYOUT", "SECONDS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine_child:
        engine_child(int(a.engine_child[0]), a.engine_child[1], float(a.engine_child[2]))
        return
    pages = [int(p) for p in a.pages.split(",")]
    with tempfile.TemporaryDirectory(prefix="page-floor-") as tmp:
        exe = os.path.join(tmp, "page_floor")
        subprocess.run(["cc", "-O2", "-o", exe, os.path.join(HERE, "page_floor.c")], check=True)
        jobs = [(w, lay) for w in ("floor", "engine") for lay in ("contig", "shuffled")]
        rows = []
        for run in range(a.runs):
            for page in pages:
                got = {}
                order = jobs[run % len(jobs):] + jobs[:run % len(jobs)]
                for w, lay in order:
                    cmd = ([exe, str(page), lay, str(a.seconds)] if w == "floor" else
                           [sys.executable, os.path.abspath(__file__), "--engine-child", str(page), lay, str(a.seconds)])
                    got[(w, lay)] = run_one(cmd)
                row = {"run": run + 1, "page": page, **{f"{w}_{lay}_gbps": g for (w, lay), g in got.items()}}
                row["floor_ratio"] = got[("floor", "shuffled")] / got[("floor", "contig")]
                row["engine_ratio"] = got[("engine", "shuffled")] / got[("engine", "contig")]
                row["engine_vs_floor_shuffled"] = got[("engine", "shuffled")] / got[("floor", "shuffled")]
                rows.append(row)
                print(f"run {run + 1} page {page:>6}: floor shuffled/contig {row['floor_ratio']:.3f} "
                      f"({got[('floor', 'shuffled')]:.1f} / {got[('floor', 'contig')]:.1f} Gbit/s), engine "
                      f"{row['engine_ratio']:.3f} ({got[('engine', 'shuffled')]:.1f} / {got[('engine', 'contig')]:.1f}), "
                      f"engine / floor shuffled {row['engine_vs_floor_shuffled']:.3f}", flush=True)
    print()
    for page in pages:
        rs = [r for r in rows if r["page"] == page]
        for key in ("floor_ratio", "engine_ratio", "engine_vs_floor_shuffled"):
            v = [r[key] for r in rs]
            print(f"page {page:>6} {key:<26} median {statistics.median(v):.3f}  worst {min(v):.3f}  ({len(v)} runs)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
