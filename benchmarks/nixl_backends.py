"""NIXL+MULTIRAIL against NIXL+UCX on the emulated testbed, in one run (issue 20, partial).

    sudo .venv/bin/python benchmarks/nixl_backends.py [--rails 2] [--rate 1gbit] [--size-mib 128] [--runs 5]

Per run: a fresh target (namespace a) and initiator (namespace b) of tests/nixl_plugin_peer.py,
NIXL's own Python API, one READ and one WRITE of SIZE through the named backend; MULTIRAIL gets
MULTIRAIL_RAILS set to each side's rail addresses. Prints READ/WRITE Gbit/s per backend (median
and worst of the runs) and the MULTIRAIL/UCX ratio of each run. Not yet: iperf3 per rail, the
native-API column, NIC-counter splits (docs/nixl-plugin.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "python"), str(REPO / "tests")]
PEER = str(REPO / "tests" / "nixl_plugin_peer.py")


def one(tb, plugin_dir: Path, backend: str, size: int) -> dict:
    rails = {s: ",".join(tb.addrs(s)) for s in ("a", "b")}
    env = {"NIXL_PLUGIN_DIR": str(plugin_dir), "PYTHONPATH": f"{REPO / 'python'}:{REPO / 'tests'}"}
    cfg = {"size": size, "backends": [backend], "params": {}}
    with tempfile.TemporaryDirectory() as d:
        def argv(side, rest):
            e = [f"{k}={v}" for k, v in env.items()] + [f"MULTIRAIL_RAILS={rails[side]}"]
            if backend == "UCX":
                # both namespaces share one kernel: without this UCX moves the bytes through shared
                # memory and never touches the rails
                e += ["UCX_TLS=tcp", "UCX_NET_DEVICES=" + ",".join(r.devs[side] for r in tb.rails)]
            return tb.exec_argv(side, ["env", *e, sys.executable, PEER, *rest])
        tgt = subprocess.Popen(argv("a", ["target", d, json.dumps(cfg)]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            t = time.monotonic()
            while not (Path(d) / "meta.bin").exists():
                if tgt.poll() is not None or time.monotonic() - t > 60:
                    raise RuntimeError("target did not start")
                time.sleep(0.02)
            res = subprocess.run(argv("b", ["init", "stripe", d, json.dumps(cfg)]), capture_output=True, text=True, timeout=300)
            out = json.loads([x for x in res.stdout.splitlines() if x.startswith("{")][-1])
            if not out.get("ok"):
                raise RuntimeError(f"{backend}: {out} {res.stderr[-2000:]}")
            return out
        finally:
            tgt.kill()
            tgt.wait()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rails", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--size-mib", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    from multirail.nixl_plugin import make_dir
    from multirail.testbed import Testbed

    size = a.size_mib << 20
    plugin_dir = make_dir(tempfile.mkdtemp(prefix="nixl-plugins-"))
    res: dict[str, dict[str, list[float]]] = {b: {"READ": [], "WRITE": []} for b in ("MULTIRAIL", "UCX")}
    ratios = []
    with Testbed(f"nb{uuid.uuid4().hex[:6]}", rails=a.rails, rate=a.rate) as tb:
        for _ in range(a.runs):
            run = {}
            for b in ("MULTIRAIL", "UCX"):
                o = one(tb, plugin_dir, b, size)
                run[b] = {op: size * 8 / o[k] / 1e9 for op, k in (("READ", "read_s"), ("WRITE", "write_s"))}
                for op in run[b]:
                    res[b][op].append(run[b][op])
            ratios.append({op: run["MULTIRAIL"][op] / run["UCX"][op] for op in ("READ", "WRITE")})
    print(f"testbed {a.rails} x {a.rate}, {a.size_mib} MiB, {a.runs} fresh runs (Gbit/s: median / worst)")
    for b, ops in res.items():
        print(f"  NIXL+{b:9s} " + "  ".join(f"{op} {statistics.median(v):.2f} / {min(v):.2f}" for op, v in ops.items()))
    for op in ("READ", "WRITE"):
        r = [x[op] for x in ratios]
        print(f"  MULTIRAIL/UCX {op}: median {statistics.median(r):.2f}x, worst {min(r):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
