"""The 4 KiB READ latency part of benchmarks/nixl_backends.py alone (its `lat` scenario, back to
back and paced every 250 us), NIXL+MULTIRAIL and NIXL+UCX on a fresh 2 x 2 Gbit/s testbed, with
the voluntary context switches per READ of each thread of the initiator and of the target:

    sudo .venv/bin/python benchmarks/nixl_lat_paced.py [ROUNDS]

A serving thread (`mr-serve`) at ~1 switch per READ sleeps in the kernel before every request
(docs/benchmarks.md, "4 KiB READ paced every 250 us: the serving thread's spin budget").
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import uuid

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "python"), str(REPO / "tests")]

import nixl_backends as nb  # noqa: E402
from multirail.nixl_plugin import make_dir  # noqa: E402
from multirail.testbed import Testbed  # noqa: E402


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    plugin_dir = make_dir(pathlib.Path(tempfile.mkdtemp()))
    with Testbed(f"mrlt{uuid.uuid4().hex[:4]}", rails=2, rate="2gbit") as tb:
        for _ in range(rounds):
            for backend in ("MULTIRAIL", "UCX"):
                for gap in (0, 250):
                    o = nb.run_peer(tb, plugin_dir, backend, "lat", {"size": 1 << 20, "iters": 1000, "gap_us": gap})
                    print(f"{backend} gap {gap} us: p50 {o['p50_us']:.1f} us p99 {o['p99_us']:.1f} us; switches/READ "
                          f"initiator {o['switches_by_thread']} target {o['target_switches_by_thread']}", flush=True)


if __name__ == "__main__":
    main()
