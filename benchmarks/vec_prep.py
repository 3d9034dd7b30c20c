#!/usr/bin/env python3
"""Prepare + post rate of page descriptors (issue 22): explicit rows vs strided rows.

One target and one initiator agent on loopback (tcp), a registered buffer of N pages of S bytes
on each side. Per round, in a rotating order, each of:

  explicit   an Nx3 list of the N pages in a random order on each side (no two adjacent rows
             contiguous, so nothing merges): `initialize_xfer` + `transfer`;
  strided    the same N pages as R Nx5 rows (address, len, device, stride, count) of N/R pages
             each, strided 2 pages apart locally (the odd pages) and 1 apart remotely:
             `initialize_xfer_strided` + `transfer` (the rows stay compressed);
  reposted   the strided handle of the first round posted again (`transfer` only).

The clock covers prepare and post only; each transfer is then awaited (untimed) and released,
and the first round's bytes are checked. Reports page descriptors per second (N / time), the
median and the worst of the rounds.

    .venv/bin/python benchmarks/vec_prep.py [--pages 16384] [--page-size 4096] [--rows 16] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import multirail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=16, help="strided rows (pages / rows pages each)")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    n, page = a.pages, a.page_size
    if n % a.rows:
        raise SystemExit("--pages must be a multiple of --rows")
    t = multirail.Agent("vp-target", {})
    i = multirail.Agent("vp-init", {"timeout": 30.0})
    try:
        remote = np.random.default_rng(1).integers(0, 256, page * n, dtype=np.uint8)
        local = np.zeros(page * 2 * n, np.uint8)  # strided: odd pages of a twice-as-large buffer
        t.register_memory(remote)
        i.register_memory(local)
        i.fetch_remote_metadata("vp-target", "127.0.0.1", t.port)
        L, R = local.ctypes.data, remote.ctypes.data
        rng = np.random.default_rng(2)
        perm = rng.permutation(n).astype(np.uint64)
        lrows = np.stack([L + perm * page, np.full(n, page, np.uint64), np.zeros(n, np.uint64)], axis=1).astype(np.uint64)
        rrows = np.stack([R + perm * page, np.full(n, page, np.uint64), np.zeros(n, np.uint64)], axis=1).astype(np.uint64)
        per = n // a.rows
        ls = np.array([[L + page + 2 * page * per * k, page, 0, 2 * page, per] for k in range(a.rows)], dtype=np.uint64)
        rs = np.array([[R + page * per * k, page, 0, page, per] for k in range(a.rows)], dtype=np.uint64)
        reuse = None
        res: dict[str, list[float]] = {"explicit": [], "strided": [], "reposted": []}
        order = list(res)
        for rnd in range(a.rounds):
            for name in order[rnd % 3:] + order[:rnd % 3]:
                if name == "reposted" and reuse is None:
                    continue
                t0 = time.perf_counter()
                if name == "explicit":
                    h = i.initialize_xfer("READ", lrows, rrows, "vp-target")
                elif name == "strided":
                    h = i.initialize_xfer_strided("READ", ls, rs, "vp-target")
                else:
                    h = reuse
                i.transfer(h)
                dt = time.perf_counter() - t0
                i.wait(h, 60)
                res[name].append(n / dt)
                if name == "explicit" and rnd == 0:
                    assert np.array_equal(local[:page * n].reshape(n, page)[perm.astype(np.int64)],
                                          remote.reshape(n, page)[perm.astype(np.int64)]), "explicit READ wrong"
                if name == "strided" and reuse is None:
                    assert np.array_equal(local.reshape(2 * n, page)[1::2], remote.reshape(n, page)), "strided READ wrong"
                    reuse = h
                elif h is not reuse:
                    i.release_xfer_handle(h)
        print(f"{n} pages of {page} B; strided as {a.rows} rows of {per}; {a.rounds} rounds")
        for name, v in res.items():
            print(f"{name:10s} median {statistics.median(v) / 1e6:8.2f} M desc/s   worst {min(v) / 1e6:8.2f} M desc/s")
    finally:
        i.close()
        t.close()


if __name__ == "__main__":
    main()
