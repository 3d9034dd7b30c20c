#!/usr/bin/env python3
"""Time preparing a READ of N descriptors of S bytes from two Nx3 uint64 numpy arrays
(local and remote rows), three ways in the same run:

  NIXL            nixl._api (or nixl_cu12._api): get_xfer_descs(rows, "DRAM") on both lists,
                  then initialize_xfer                       (skipped when NIXL is not importable)
  native          multirail.Agent: get_xfer_descs(rows) on both lists, then initialize_xfer
  multirail.nixl  multirail.nixl.nixl_agent, NIXL's calls exactly: get_xfer_descs(rows, "DRAM")
                  on both lists, then initialize_xfer

Rows describe N consecutive S-byte blocks of one registered buffer on each side (--scatter:
the same blocks in a random order, identical on both sides, so that no two adjacent rows are
contiguous and the engine's merging of contiguous runs cannot apply: every row is resolved,
validated and paired, 65,536 pairs by default).
Two agents per path on loopback; nothing is transferred. Repetitions are interleaved (every
round times each path once, in a rotating order) so that a noisy machine slows all paths alike;
releasing and freeing each handle happens outside the timed region for every path. Reports
p50/min/p90 per path and the ratios multirail.nixl / NIXL (target <= 0.8) and
multirail.nixl / native.

    .venv/bin/python benchmarks/prep_descs.py [--count 65536] [--size 16384] [--reps 20] [--scatter]
    NIXL (measurement only): .venv/bin/pip install nixl-cu12==1.5.1
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, Optional

import numpy as np

import multirail.nixl
from multirail.bench.nixl_latency import nixl_api

TARGET = 0.8  # multirail.nixl / NIXL


ORDER: Optional[np.ndarray] = None  # block order (--scatter); None: 0..N-1


def rows(base: int, n: int, size: int) -> np.ndarray:
    a = np.empty((n, 3), dtype=np.uint64)
    blocks = np.arange(n, dtype=np.uint64) if ORDER is None else ORDER
    a[:, 0] = base + blocks * np.uint64(size)
    a[:, 1] = size
    a[:, 2] = 0
    return a


# Each setup returns (one timed preparation -> seconds, cleanup). The timed callable does the
# whole prepare (both get_xfer_descs + initialize_xfer) between two perf_counter calls, then
# releases and drops the handle untimed.

Step = Callable[[], float]


def setup_native(src: np.ndarray, dst: np.ndarray, n: int, size: int) -> tuple[Step, Callable[[], None]]:
    import multirail

    t = multirail.Agent("prep-target")
    i = multirail.Agent("prep-init")
    t.register_memory(src)
    i.register_memory(dst)
    i.add_remote_agent(t.get_agent_metadata())
    lr, rr = rows(dst.ctypes.data, n, size), rows(src.ctypes.data, n, size)

    def step() -> float:
        t0 = time.perf_counter()
        h = i.initialize_xfer("READ", i.get_xfer_descs(lr), i.get_xfer_descs(rr), "prep-target")
        dt = time.perf_counter() - t0
        i.release_xfer_handle(h)
        del h
        return dt

    def close() -> None:
        i.close()
        t.close()

    return step, close


def setup_nixl_api(api, prefix: str, src: np.ndarray, dst: np.ndarray, n: int, size: int) -> tuple[Step, Callable[[], None]]:
    """Two agents of a module with NIXL's Python API (NIXL itself, or multirail.nixl) and the
    timed step: get_xfer_descs on both Nx3 arrays, then initialize_xfer, as NIXL scripts do."""
    t = api.nixl_agent(f"{prefix}t", api.nixl_agent_config(backends=["UCX"]))
    i = api.nixl_agent(f"{prefix}i", api.nixl_agent_config(backends=["UCX"]))
    t.register_memory(t.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
    i.register_memory(i.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
    i.add_remote_agent(t.get_agent_metadata())
    lr, rr = rows(dst.ctypes.data, n, size), rows(src.ctypes.data, n, size)

    def step() -> float:
        t0 = time.perf_counter()
        h = i.initialize_xfer("READ", i.get_xfer_descs(lr, "DRAM"), i.get_xfer_descs(rr, "DRAM"), f"{prefix}t")
        dt = time.perf_counter() - t0
        i.release_xfer_handle(h)
        del h
        return dt

    def close() -> None:
        for a in (i, t):
            if hasattr(a, "close"):  # multirail.nixl stops its engine; NIXL's agents have no close
                a.close()

    return step, close


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=65536)
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--scatter", action="store_true",
                    help="blocks in a random order (same on both sides): no contiguous runs")
    a = ap.parse_args()
    if a.scatter:
        global ORDER
        ORDER = np.random.default_rng(1).permutation(a.count).astype(np.uint64)

    # Two shared buffers (untouched pages: nothing is transferred), registered by every path.
    src, dst = np.zeros(a.count * a.size, np.uint8), np.zeros(a.count * a.size, np.uint8)
    paths: dict[str, tuple[Step, Callable[[], None]]] = {}
    api = nixl_api()
    if api is None:
        print("NIXL            not importable (pip install nixl-cu12==1.5.1): skipped, no ratio to NIXL")
    else:
        paths["NIXL"] = setup_nixl_api(api, "n", src, dst, a.count, a.size)
    paths["native"] = setup_native(src, dst, a.count, a.size)
    paths["multirail.nixl"] = setup_nixl_api(multirail.nixl, "mn", src, dst, a.count, a.size)

    names = list(paths)
    for _ in range(a.warmup):
        for name in names:
            paths[name][0]()
    times: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    for r in range(a.reps):
        for k in range(len(names)):  # rotate the order each round
            name = names[(r + k) % len(names)]
            times[name].append(paths[name][0]())
    for _, close in paths.values():
        close()

    def p(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    layout = "scattered (random block order)" if a.scatter else "contiguous blocks"
    print(f"prepare READ of {a.count} x {a.size} B descriptors, {layout} (get_xfer_descs x2 + initialize_xfer), "
          f"{a.reps} interleaved reps after {a.warmup} warm-up:")
    labels = {"NIXL": "NIXL 1.5 (nixl._api)", "native": "multirail native (multirail.Agent)",
              "multirail.nixl": "multirail.nixl (NIXL API on multirail)"}
    for name in names:
        ts = times[name]
        print(f"  {labels[name]:40s} p50 {med[name]:7.3f} ms   min {min(ts) * 1e3:7.3f} ms   p90 {p(ts, 0.9):7.3f} ms")
    print("ratios (p50):")
    if "NIXL" in med:
        ratio = med["multirail.nixl"] / med["NIXL"]
        verdict = "met" if ratio <= TARGET else "NOT met"
        print(f"  multirail.nixl / NIXL    {ratio:5.2f}x   (target <= {TARGET}x: {verdict})")
        print(f"  native / NIXL            {med['native'] / med['NIXL']:5.2f}x")
    print(f"  multirail.nixl / native  {med['multirail.nixl'] / med['native']:5.2f}x")


if __name__ == "__main__":
    main()
