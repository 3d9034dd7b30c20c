#!/usr/bin/env python3
"""Shuffled small pages on both sides, vectored vs one request per page (issue 22).

One target and one initiator agent on loopback over TRANSPORT; N pages of S bytes in a random
order on each side; READ and WRITE of all of them, 5 posts each of one prepared handle, every
byte checked; prints the best post's rate. `--per-page` sets AgentConfig(vectored=False) (one
request, or one get/put, per page: the baseline).

    .venv/bin/python benchmarks/vec_pages.py [--transport tcp|ucx] [--pages 8192] [--page-size 4096] [--per-page]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import multirail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--pages", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=4096)
    ap.add_argument("--per-page", action="store_true")
    a = ap.parse_args()
    t = multirail.Agent("vpg-target", {"transport": a.transport})
    i = multirail.Agent("vpg-init", {"transport": a.transport, "vectored": not a.per_page, "timeout": 30.0})
    try:
        page, n = a.page_size, a.pages
        remote = np.random.default_rng(1).integers(0, 256, page * n, dtype=np.uint8)
        local = np.zeros(page * n, np.uint8)
        t.register_memory(remote)
        i.register_memory(local)
        i.fetch_remote_metadata("vpg-target", "127.0.0.1", t.port)
        rng = np.random.default_rng(7)
        lp, rp = rng.permutation(n), rng.permutation(n)
        ld = [(local.ctypes.data + int(p) * page, page, 0) for p in lp]
        rd = [(remote.ctypes.data + int(p) * page, page, 0) for p in rp]
        lv, rv = local.reshape(n, page), remote.reshape(n, page)
        for op in ("READ", "WRITE"):
            h = i.initialize_xfer(op, ld, rd, "vpg-target")
            best = float("inf")
            for k in range(5):
                if op == "WRITE":
                    local[:] = k + 1
                t0 = time.perf_counter()
                i.transfer(h)
                i.wait(h, 60)
                best = min(best, time.perf_counter() - t0)
                assert np.array_equal(lv[lp], rv[rp]), f"{op} post {k}: pages not where their descriptors say"
            mode = "per-page" if a.per_page else "vectored"
            print(f"{a.transport} {mode:8s} {op:5s} {n} x {page} B: {page * n * 8 / best / 1e9:6.2f} Gbit/s (best of 5)")
    finally:
        i.close()
        t.close()


if __name__ == "__main__":
    main()
