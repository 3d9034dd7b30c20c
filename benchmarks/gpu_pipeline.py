#!/usr/bin/env python3
"""What the staging pipeline costs at chunk boundaries (issue 19, item 6), in one run.

``.venv/bin/python benchmarks/gpu_pipeline.py [--rounds 5] [--size 64MiB] [--iters 6]
[--rate 2e9] [--latency-us 10] [--buffer-sizes 256KiB,1MiB] [--engine NAME=PYTHONPATH ...]
[--json FILE]``

Each case is a fresh process: a target and an initiator agent on loopback (one tcp rail), on
the stand-in GPU, whose copies are paced to ``--rate`` bytes/s with ``--latency-us`` of launch
latency per copy (a copy engine's shape: CUDA's launch + event costs ~5-10 us). It times
``--iters`` READs and WRITEs of ``--size`` VRAM -> VRAM (staged on both sides, byte-checked once)
and, in the same process, the same transfers DRAM -> DRAM: the baseline. Rounds rotate the case
order; the table gives, per case and op, the median and the worst of VRAM / DRAM over the
rounds.

``--engine NAME=PATH`` adds an engine build to compare (its ``python/`` directory, e.g. a
worktree of an older commit with its ``_core`` built): each runs the same cases. Over loopback
the stand-in's copies compete with TCP for the CPU, which a GPU's copy engines do not: this
measures the pipeline's per-chunk behaviour, not a GPU (``make gpu-check`` does that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import numpy as np
import multirail
from multirail.gpu import DeviceBuffer
size, iters, buf = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
extra = {"staging_buffer_size": buf} if buf else {}
out = {}
with multirail.Agent("t", {"gpu": "standin", **extra}) as t, \
        multirail.Agent("i", {"gpu": "standin", "timeout": 30.0, **extra}) as i:
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    pairs = {}
    for mem in ("DRAM", "VRAM"):
        if mem == "DRAM":
            rb, lb = data.copy(), np.zeros(size, np.uint8)
        else:
            rb, lb = DeviceBuffer(size, kind="standin"), DeviceBuffer(size, kind="standin")
            rb.copy_from_host(data)
        t.register_memory(rb)
        i.register_memory(lb)
        pairs[mem] = (lb, rb)
    i.fetch_remote_metadata("t", "127.0.0.1", t.port)
    for mem, (lb, rb) in pairs.items():
        for op in ("READ", "WRITE"):
            h = i.initialize_xfer(op, [lb], [rb], "t")
            for _ in range(2):
                i.transfer_sync(h, 60)
            t0 = time.perf_counter()
            for _ in range(iters):
                i.transfer_sync(h, 60)
            dt = time.perf_counter() - t0
            out[f"{mem}_{op}"] = size * iters * 8 / dt / 1e9
            i.release_xfer_handle(h)
        got = lb.to_host() if mem == "VRAM" else lb
        assert np.array_equal(got, data), f"{mem}: bytes differ"
print(json.dumps(out))
"""


def size_arg(s: str) -> int:
    s = s.strip()
    for suf, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * m)
    return int(s)


def run_case(engine_path: str, a: argparse.Namespace, buf: int) -> dict:
    env = {**os.environ, "MULTIRAIL_STANDIN_RATE": str(a.rate), "MULTIRAIL_STANDIN_LATENCY_US": str(a.latency_us),
           "PYTHONPATH": engine_path}
    r = subprocess.run([sys.executable, "-c", CHILD, str(size_arg(a.size)), str(a.iters), str(buf)], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout)[-500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--rate", type=float, default=2e9, help="stand-in copy rate, bytes/s")
    ap.add_argument("--latency-us", type=int, default=10, help="stand-in launch latency per copy")
    ap.add_argument("--buffer-sizes", default="default", help="staging_buffer_size values, comma-separated "
                    "('default': the engine's)")
    ap.add_argument("--engine", action="append", default=[], help="NAME=PYTHONPATH of another build to compare")
    ap.add_argument("--json", help="write the raw results here")
    a = ap.parse_args()
    engines = [("this", str(REPO / "python"))] + [tuple(e.split("=", 1)) for e in a.engine]
    bufs = [0 if b == "default" else size_arg(b) for b in a.buffer_sizes.split(",")]
    cases = [(e, b) for e in engines for b in bufs]
    results: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        order = cases[r % len(cases):] + cases[: r % len(cases)]
        for (name, path), b in order:
            key = f"{name} buf={b or 'default'}"
            res = run_case(path, a, b)
            results.setdefault(key, []).append(res)
            print(f"round {r + 1} {key}: {res}", file=sys.stderr, flush=True)
    print(f"\nstand-in copies {a.rate / 1e9:.1f} GB/s + {a.latency_us} us/copy; {a.size} x {a.iters}; "
          f"{a.rounds} rounds; VRAM->VRAM / DRAM->DRAM, median (worst)")
    copy_gbps = a.rate * 8 / 1e9
    print(f"{'case':28} {'READ':>16} {'WRITE':>16} {'VRAM READ Gb/s':>15} {'VRAM WRITE Gb/s':>16}"
          f"  of the copy rate ({copy_gbps:.1f} Gb/s), median (worst): READ, WRITE")
    for key, runs in results.items():
        ok = [x for x in runs if "error" not in x]
        if not ok:
            print(f"{key:28} failed: {runs[0]['error']}")
            continue
        row = []
        for op in ("READ", "WRITE"):
            ratios = [x[f"VRAM_{op}"] / x[f"DRAM_{op}"] for x in ok]
            row.append(f"{statistics.median(ratios):.3f} ({min(ratios):.3f})")
        gb = [f"{statistics.median([x[f'VRAM_{op}'] for x in ok]):.1f}" for op in ("READ", "WRITE")]
        effs = [[x[f"VRAM_{op}"] / copy_gbps for x in ok] for op in ("READ", "WRITE")]
        eff = [f"{statistics.median(e):.3f} ({min(e):.3f})" for e in effs]
        print(f"{key:28} {row[0]:>16} {row[1]:>16} {gb[0]:>15} {gb[1]:>16}  {eff[0]}, {eff[1]}"
              + (f"  [{len(runs) - len(ok)} failed]" if len(ok) < len(runs) else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
