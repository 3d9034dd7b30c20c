#!/usr/bin/env python3
"""4 KiB READ latency of every progress mode against its baselines, in one run.

Each round runs, in a rotating order so that a noisy phase of the host hits every worker alike:
  multirail --progress adaptive | poll | block    (`multirail bench local`, transfer_sync loop)
  mr-pingpong (blocking) and mr-pingpong --poll    (raw TCP, the like-for-like floors)
  NIXL 1.5 over UCX tcp                            (transfer + check_xfer_state loop; skipped
                                                    when nixl-cu12 is not installed)
and prints, per worker, the median over rounds of p50 and p99 and the waiting thread's CPU, then
the ratios the issue asks for: multirail (each mode) over NIXL and over the ping-pong that waits
the same way.

    .venv/bin/python benchmarks/latency_modes.py [--rounds 3] [--iters 5000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from multirail.bench.baseline import run_pingpong  # noqa: E402
from multirail.bench.nixl_latency import nixl_available, run_nixl_latency  # noqa: E402

MODES = ("adaptive", "poll", "block")
SIZE = 4096


def multirail_row(mode: str, iters: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "multirail", "bench", "local", "--op", "READ", "--start-block-size", "4KiB",
           "--max-block-size", "4KiB", "--num-iter", str(iters), "--warmup-iter", "200", "--progress", mode,
           "--json", "-"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if cp.returncode != 0:
        raise SystemExit(f"bench failed ({mode}): {cp.stderr.strip()[-800:]}")
    row = json.loads(cp.stdout)["rows"][0]
    return {"p50": row["lat_p50_us"], "p99": row["lat_p99_us"], "cpu": row.get("cpu_pct")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    have_nixl = nixl_available()
    workers = [f"multirail-{m}" for m in MODES] + ["mr-pingpong", "mr-pingpong-poll"] + (["nixl"] if have_nixl else [])
    res: dict[str, list[dict[str, Any]]] = {w: [] for w in workers}
    for r in range(a.rounds):
        order = workers[r % len(workers):] + workers[:r % len(workers)]
        for w in order:
            if w.startswith("multirail-"):
                res[w].append(multirail_row(w.split("-", 1)[1], a.iters))
            elif w == "nixl":
                b = run_nixl_latency(SIZE, a.iters, 200)
                res[w].append({"p50": b.lat_p50_us, "p99": b.lat_p99_us, "cpu": b.cpu_pct})
            else:
                b = run_pingpong(SIZE, a.iters, 200, poll=w.endswith("-poll"))
                res[w].append({"p50": b.lat_p50_us, "p99": b.lat_p99_us, "cpu": b.cpu_pct})
            print(f"round {r + 1}/{a.rounds} {w:<20} p50 {res[w][-1]['p50']:7.1f} us  p99 {res[w][-1]['p99']:7.1f} us",
                  file=sys.stderr, flush=True)
    med = {w: {k: statistics.median(x[k] for x in v if x[k] is not None) if any(x[k] is not None for x in v)
               else None for k in ("p50", "p99", "cpu")} for w, v in res.items()}
    print(f"\n4 KiB READ latency, median of {a.rounds} interleaved rounds x {a.iters} iterations")
    print(f"{'worker':<20} {'p50 us':>8} {'p99 us':>8} {'CPU %':>6}")
    for w, m in med.items():
        cpu = f"{m['cpu']:6.0f}" if m["cpu"] is not None else "     -"
        print(f"{w:<20} {m['p50']:8.1f} {m['p99']:8.1f} {cpu}")
    ratios: dict[str, Any] = {}
    for mode in MODES:
        mr = med[f"multirail-{mode}"]
        ping = med["mr-pingpong" if mode == "block" else "mr-pingpong-poll"]
        ratios[mode] = {"p50_x_pingpong": mr["p50"] / ping["p50"], "p99_x_pingpong": mr["p99"] / ping["p99"]}
        line = (f"{mode:<9} p50 {ratios[mode]['p50_x_pingpong']:.2f}x / p99 {ratios[mode]['p99_x_pingpong']:.2f}x "
                f"{'blocking' if mode == 'block' else 'polling'} ping-pong")
        if have_nixl:
            n = med["nixl"]
            ratios[mode] |= {"p50_x_nixl": mr["p50"] / n["p50"], "p99_x_nixl": mr["p99"] / n["p99"]}
            line += f"; p50 {ratios[mode]['p50_x_nixl']:.2f}x / p99 {ratios[mode]['p99_x_nixl']:.2f}x NIXL"
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps({"rounds": res, "median": med, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
