#!/usr/bin/env python3
"""Time preparing a READ of N descriptors of S bytes from Nx3 uint64 arrays:
get_xfer_descs on both lists + initialize_xfer, for multirail and (when importable) NIXL,
in the same run. Two agents on loopback; nothing is transferred.

    .venv/bin/python benchmarks/prep_descs.py [--count 65536] [--size 16384] [--reps 20]
    NIXL: pip install nixl-cu12 into the same environment (optional)
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def rows(base: int, n: int, size: int) -> np.ndarray:
    a = np.empty((n, 3), dtype=np.uint64)
    a[:, 0] = base + np.arange(n, dtype=np.uint64) * size
    a[:, 1] = size
    a[:, 2] = 0
    return a


def time_multirail(n: int, size: int, reps: int) -> list[float]:
    import multirail

    t = multirail.Agent("prep-target")
    i = multirail.Agent("prep-init")
    src, dst = np.zeros(n * size, np.uint8), np.zeros(n * size, np.uint8)
    t.register_memory(src)
    i.register_memory(dst)
    i.fetch_remote_metadata("prep-target", "127.0.0.1", t.port)
    lr, rr = rows(dst.ctypes.data, n, size), rows(src.ctypes.data, n, size)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        h = i.initialize_xfer("READ", i.get_xfer_descs(lr), i.get_xfer_descs(rr), "prep-target")
        out.append(time.perf_counter() - t0)
        i.release_xfer_handle(h)
    i.close()
    t.close()
    return out


def time_nixl(n: int, size: int, reps: int) -> list[float] | None:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:  # the PyPI wheel nixl-cu12 installs the module as nixl_cu12
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError:
            return None
    t = nixl_agent("nt", nixl_agent_config(backends=["UCX"]))
    i = nixl_agent("ni", nixl_agent_config(backends=["UCX"]))
    src, dst = np.zeros(n * size, np.uint8), np.zeros(n * size, np.uint8)
    t.register_memory(t.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
    i.register_memory(i.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
    i.add_remote_agent(t.get_agent_metadata())
    lr, rr = rows(dst.ctypes.data, n, size), rows(src.ctypes.data, n, size)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        h = i.initialize_xfer("READ", i.get_xfer_descs(lr, "DRAM"), i.get_xfer_descs(rr, "DRAM"), "nt")
        out.append(time.perf_counter() - t0)
        i.release_xfer_handle(h)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=65536)
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    for name, fn in (("multirail", time_multirail), ("nixl", time_nixl)):
        r = fn(a.count, a.size, a.reps)
        if r is None:
            print(f"{name:10s} not installed (skipped)")
            continue
        print(f"{name:10s} {a.count} x {a.size} B: median {statistics.median(r) * 1e3:.2f} ms, "
              f"min {min(r) * 1e3:.2f} ms over {a.reps} reps")


if __name__ == "__main__":
    main()
