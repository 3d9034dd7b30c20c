#!/usr/bin/env python3
"""GPU memory throughput against host memory, in one run (issue 10).

Run as root: ``.venv/bin/python benchmarks/gpu_staging.py [--gpu standin|cuda] [--rails 2x2g|none]
[--rounds 3] [--size 64MiB] [--iters 5] [--ipc] [--json FILE]``.

Every case is one ``multirail bench local`` run (target process + initiator; with a testbed, in
its two namespaces over its rate-limited veth rails), each checked byte for byte
(``--check-consistency``); ``--rounds`` rounds, the order of the cases rotated by one per round,
medians reported. Cases, READ and WRITE each:

* ``DRAM->DRAM``, all rails: the baseline;
* ``VRAM->VRAM``, all rails, staged (``--gpu-ipc off``: through the pinned pools on both sides);
* ``VRAM->VRAM``, rail 0 only (with a testbed): for "2 rails >= 1.9x one";
* ``--ipc`` (same host, no testbed needed): ``VRAM->VRAM`` by CUDA IPC (``--gpu-ipc on``), and
  the device's own device-to-device copy rate (``multirail.gpu``, same size) as its baseline.

Ratios: VRAM / DRAM (target >= 90%), 2 rails / 1 rail (>= 1.9x), IPC / D2D copy (>= 80%).

``--gpu standin`` runs everywhere: the stand-in's "device memory" is host memory and its copies
are memcpys on threads (``--standin-rate`` bytes/s paces them like a copy engine), so it measures
the staging pipeline (pool, overlap, per-chunk cost), not a GPU. Over loopback (``--rails none``)
its copies compete with the TCP copies for the CPU, which a GPU's copy engines do not. ``--gpu
cuda`` on a GPU machine gives the issue's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

RAIL_PRESETS = {"2x2g": ["2gbit", "2gbit"], "none": []}


def bench_once(case: dict[str, Any], a: argparse.Namespace, tb_name: str | None) -> dict[str, Any]:
    """One `multirail bench local` run; {"gbps", "staging", "ipc"} or {"error"}."""
    args = [sys.executable, "-m", "multirail", "bench", "local", "--op", case["op"],
            "--initiator-seg-type", case["iseg"], "--target-seg-type", case["tseg"], "--gpu", a.gpu,
            "--gpu-ipc", "on" if case.get("ipc") else "off",
            "--start-block-size", a.size, "--max-block-size", a.size, "--num-iter", str(a.iters),
            "--warmup-iter", "1", "--check-consistency", "--timeout", "60", "--json", "-"]
    if tb_name:
        args += ["--testbed", tb_name]
        if case.get("rails"):
            args += ["--rails", case["rails"]]
    env = {**os.environ}
    if a.standin_rate:
        env["MULTIRAIL_STANDIN_RATE"] = str(a.standin_rate)
    env.pop("MULTIRAIL_TRANSPORT", None)
    try:
        cp = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "bench did not finish within 600 s"}
    if cp.returncode != 0 or "{" not in cp.stdout:
        return {"error": f"bench exited {cp.returncode}: {cp.stderr.strip()[-600:]}"}
    doc = json.loads(cp.stdout[cp.stdout.index("{"):])
    row = doc["rows"][0]
    if row.get("consistency") not in ("ok", None):
        return {"error": f"consistency: {row.get('consistency')}"}
    st = row.get("staging") or {}
    return {"gbps": row["gbps"], "bottleneck": st.get("bottleneck"), "ipc": (st.get("ipc") or {}).get("transfers"),
            "rails": [r.get("bytes") for r in row.get("rails") or []]}


def d2d_gbps(a: argparse.Namespace) -> float | None:
    """The device's own device-to-device copy rate for `--size` (median of `--iters`)."""
    if a.standin_rate:
        os.environ["MULTIRAIL_STANDIN_RATE"] = str(a.standin_rate)
    from multirail import _core
    from multirail.bench.core import parse_size
    from multirail.gpu import DeviceBuffer

    n = parse_size(a.size)
    src, dst = DeviceBuffer(n, kind=a.gpu), DeviceBuffer(n, kind=a.gpu)
    try:
        times = []
        for _ in range(a.iters + 1):
            t0 = time.perf_counter()
            _core.gpu_copy(dst.addr, src.addr, n, "d2d", 0, a.gpu)
            times.append(time.perf_counter() - t0)
        return n * 8 / statistics.median(times[1:]) / 1e9
    finally:
        src.free()
        dst.free()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="standin", choices=["standin", "cuda"])
    p.add_argument("--rails", default="2x2g", choices=sorted(RAIL_PRESETS),
                   help="testbed rails (2x2g, default) or none (loopback, no testbed)")
    p.add_argument("--name", default=None, help="testbed name (default: a fresh one, removed afterwards)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", default="64MiB", help="transfer size (default 64MiB)")
    p.add_argument("--iters", type=int, default=5, help="timed transfers per case and round (default 5)")
    p.add_argument("--standin-rate", type=float, default=None, metavar="BYTES_PER_S",
                   help="pace the stand-in's copies (MULTIRAIL_STANDIN_RATE)")
    p.add_argument("--ipc", action="store_true", help="also CUDA IPC (same host) against the D2D copy rate")
    p.add_argument("--json", metavar="FILE", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cases: list[dict[str, Any]] = []
    for op in ("READ", "WRITE"):
        cases.append({"name": f"{op} DRAM->DRAM", "op": op, "iseg": "DRAM", "tseg": "DRAM"})
        cases.append({"name": f"{op} VRAM->VRAM staged", "op": op, "iseg": "VRAM", "tseg": "VRAM"})
        if RAIL_PRESETS[a.rails]:
            cases.append({"name": f"{op} VRAM->VRAM staged 1 rail", "op": op, "iseg": "VRAM", "tseg": "VRAM",
                          "rails": "0"})
        if a.ipc:
            cases.append({"name": f"{op} VRAM->VRAM ipc", "op": op, "iseg": "VRAM", "tseg": "VRAM", "ipc": True})
    tb = None
    if RAIL_PRESETS[a.rails]:
        from multirail.testbed import Testbed

        tb = Testbed(a.name or f"gs{uuid.uuid4().hex[:6]}", rates=RAIL_PRESETS[a.rails])
        tb.up()
    results: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in cases}
    d2d: list[float] = []
    try:
        for rnd in range(a.rounds):
            k = rnd % len(cases)
            for c in cases[k:] + cases[:k]:
                r = bench_once(c, a, tb.name if tb else None)
                results[c["name"]].append(r)
                print(f"round {rnd + 1} {c['name']}: {r.get('gbps', r.get('error'))}", file=sys.stderr, flush=True)
            if a.ipc:
                g = d2d_gbps(a)
                if g:
                    d2d.append(g)
    finally:
        if tb is not None and not a.name:
            tb.down()
    med = {n: (statistics.median([r["gbps"] for r in rs if "gbps" in r]) if any("gbps" in r for r in rs) else None)
           for n, rs in results.items()}
    errors = {n: [r["error"] for r in rs if "error" in r] for n, rs in results.items() if any("error" in r for r in rs)}
    ratios: dict[str, float | None] = {}
    for op in ("READ", "WRITE"):
        base, v = med.get(f"{op} DRAM->DRAM"), med.get(f"{op} VRAM->VRAM staged")
        ratios[f"{op} VRAM/DRAM"] = v / base if v and base else None
        one = med.get(f"{op} VRAM->VRAM staged 1 rail")
        if one:
            ratios[f"{op} 2 rails/1 rail (VRAM)"] = v / one if v else None
        if a.ipc and d2d:
            ipc = med.get(f"{op} VRAM->VRAM ipc")
            ratios[f"{op} IPC/D2D copy"] = ipc / statistics.median(d2d) if ipc else None
    from multirail.gpu import info

    dev = info(0, a.gpu)
    print(f"device: {dev['kind']} {dev['name']}; rails: {a.rails}; size {a.size} x {a.iters} iters, {a.rounds} rounds"
          + (f"; stand-in copies paced at {a.standin_rate:.3g} B/s" if a.standin_rate else ""))
    for n, g in med.items():
        bn = next((r.get("bottleneck") for r in results[n] if r.get("bottleneck")), None)
        print(f"  {n:32s} {('%.3f Gbps' % g) if g else 'n/a':>14}" + (f"   bottleneck {bn}" if bn else ""))
    if d2d:
        print(f"  {'D2D copy (device)':32s} {statistics.median(d2d):10.3f} Gbps")
    targets = {"VRAM/DRAM": 0.90, "2 rails/1 rail": 1.9, "IPC/D2D": 0.80}
    for n, r in ratios.items():
        t = next(v for k, v in targets.items() if k in n)
        verdict = "n/a" if r is None else ("met" if r >= t else "NOT met")
        print(f"  {n:32s} {('%.3f' % r) if r is not None else 'n/a':>10}  (target >= {t}: {verdict})")
    for n, es in errors.items():
        print(f"  ERROR {n}: {es[0]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": dev, "args": vars(a), "results": results, "medians": med,
                                            "d2d_gbps": d2d, "ratios": ratios}, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
