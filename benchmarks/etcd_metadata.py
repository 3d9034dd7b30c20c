#!/usr/bin/env python3
"""The etcd metadata store's costs (issue #11): fetch-by-name latency and keep-alive CPU.

``.venv/bin/python benchmarks/etcd_metadata.py [--fetches 2000] [--publishers 200] [--seconds 60]``

Starts its own etcd (``/usr/bin/etcd``, Debian's etcd-server 3.4) on free loopback ports with a
temporary data dir, and stops it by PID at the end. Then:

1. **fetch by name**: a target agent publishes (a 1 MiB registered buffer); an initiator agent
   calls ``fetch_remote_metadata(name)`` (etcd GET + decode + install) ``--fetches`` times,
   interleaved with the side-channel ``fetch_remote_metadata(name, ip, port)`` for
   comparison. p50/p99 of each.
2. **keep-alive CPU**: ``--publishers`` records published with `MetadataStore` (no engines),
   for each mode in ``--modes``: ``own`` (one lease per publisher, as 200 agents on 200 hosts
   would hold: every one refreshes every TTL/3) and ``shared`` (the default inside one
   process: every store with the same endpoints and TTL shares one lease), and for each
   keep-alive transport in ``--keepalive``: ``grpc`` (etcd's native LeaseKeepAlive stream, one
   per lease, the default when grpcio is installed) and ``http`` (one gateway request per
   keep-alive). After publishing, ``--seconds`` of steady state are measured: this process's
   CPU (``getrusage``: the keep-alive threads are all it runs) and etcd's (utime+stime from
   ``/proc/PID/stat``).

``--json FILE`` writes everything. Results and the command that produced them: docs/etcd.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    def __init__(self, data: Path) -> None:
        exe = shutil.which("etcd")
        if not exe:
            sys.exit("etcd is not installed (apt-get install etcd-server)")
        self.port, peer = _free_port(), _free_port()
        c, p = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        self.log = open(data.parent / "etcd.log", "wb")
        self.proc = subprocess.Popen([exe, "--name", "bench", "--data-dir", str(data), "--listen-client-urls", c,
                                      "--advertise-client-urls", c, "--listen-peer-urls", p,
                                      "--initial-advertise-peer-urls", p, "--initial-cluster", f"bench={p}",
                                      "--logger", "zap", "--log-level", "error"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except (OSError, ValueError):
                time.sleep(0.1)
        self.stop()
        sys.exit("etcd did not become healthy")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s))) - 1))]


def fetch_latency(url: str, n: int) -> dict[str, Any]:
    import numpy as np

    import multirail

    target = multirail.Agent("bench-target", {"metadata": url})
    buf = np.zeros(1 << 20, np.uint8)
    target.register_memory(buf)
    init = multirail.Agent("bench-initiator", {"metadata": url})
    etcd_us, side_us = [], []
    try:
        for _ in range(50):  # warm-up: connections, caches
            init.fetch_remote_metadata("bench-target")
            init.fetch_remote_metadata("bench-target", "127.0.0.1", target.port)
        for _ in range(n):
            t0 = time.perf_counter()
            init.fetch_remote_metadata("bench-target")
            t1 = time.perf_counter()
            init.fetch_remote_metadata("bench-target", "127.0.0.1", target.port)
            t2 = time.perf_counter()
            etcd_us.append((t1 - t0) * 1e6)
            side_us.append((t2 - t1) * 1e6)
    finally:
        init.close()
        target.close()
    return {"fetches": n,
            "etcd": {"p50_us": statistics.median(etcd_us), "p99_us": _pct(etcd_us, 99), "avg_us": statistics.fmean(etcd_us)},
            "side_channel": {"p50_us": statistics.median(side_us), "p99_us": _pct(side_us, 99),
                             "avg_us": statistics.fmean(side_us)}}


def keepalive_cpu(url: str, etcd: Etcd, publishers: int, seconds: float, shared: bool, ttl: float,
                  transport: str = "grpc") -> dict[str, Any]:
    from multirail import metadata
    from multirail.metadata import MetadataStore

    metadata.GRPC_KEEPALIVE = transport == "grpc"  # read when a lease is created
    blob = os.urandom(600)  # about one agent with a few regions
    stores = []
    t0 = time.monotonic()
    for i in range(publishers):
        s = MetadataStore(url, ttl=ttl, timeout=5.0, share_lease=shared)
        s.publish(f"pub-{i:04d}", blob, incarnation=i + 1, host="127.0.0.1", port=10000 + i)
        stores.append(s)
    publish_s = time.monotonic() - t0
    time.sleep(min(ttl, 5.0))  # past the first refresh round: steady state
    keepalives0 = sum(s.lease.keepalives for s in stores if s.lease) if not shared else stores[0].lease.keepalives
    ru0, e0, w0 = resource.getrusage(resource.RUSAGE_SELF), etcd.cpu_s(), time.monotonic()
    time.sleep(seconds)
    ru1, e1, w1 = resource.getrusage(resource.RUSAGE_SELF), etcd.cpu_s(), time.monotonic()
    keepalives1 = sum(s.lease.keepalives for s in stores if s.lease) if not shared else stores[0].lease.keepalives
    wall = w1 - w0
    client_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    leases = len({id(s.lease) for s in stores})
    failures = sum(s.lease.failures for s in stores if s.lease)
    leases_ = list({id(s.lease): s.lease for s in stores if s.lease}.values())
    via_grpc = sum(x.grpc_keepalives for x in leases_)
    via_http = sum(x.http_keepalives for x in leases_)
    grpc_failures = sum(x.grpc_failures for x in leases_)
    for s in stores:
        s.close()
    kas = keepalives1 - keepalives0
    return {"mode": "shared" if shared else "own", "transport": transport,
            "keepalives_total_grpc": via_grpc, "keepalives_total_http": via_http, "grpc_failures": grpc_failures,
            "publishers": publishers, "leases": leases, "ttl_s": ttl,
            "publish_all_s": publish_s, "window_s": wall, "keepalives": kas, "keepalives_per_s": kas / wall,
            "client_cpu_pct_of_core": 100 * client_cpu / wall,
            "client_cpu_us_per_keepalive": 1e6 * client_cpu / kas if kas else None,
            "etcd_cpu_pct_of_core": 100 * (e1 - e0) / wall, "keepalive_failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fetches", type=int, default=2000)
    ap.add_argument("--publishers", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--ttl", type=float, default=10.0)
    ap.add_argument("--modes", default="own,shared")
    ap.add_argument("--keepalive", default="grpc,http", help="keep-alive transports to compare (grpc, http)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    out: dict[str, Any] = {"host": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}}
    with tempfile.TemporaryDirectory() as d:
        etcd = Etcd(Path(d) / "data")
        try:
            url = f"etcd://127.0.0.1:{etcd.port}/bench"
            ver = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{etcd.port}/version", timeout=5).read())
            out["etcd_version"] = ver.get("etcdserver")
            if args.fetches:
                out["fetch"] = f = fetch_latency(url, args.fetches)
                print(f"fetch by name via etcd: p50 {f['etcd']['p50_us']:.0f} us, p99 {f['etcd']['p99_us']:.0f} us; "
                      f"side channel: p50 {f['side_channel']['p50_us']:.0f} us, p99 {f['side_channel']['p99_us']:.0f} us "
                      f"({args.fetches} each, interleaved)", flush=True)
            idle0, w0 = etcd.cpu_s(), time.monotonic()
            time.sleep(min(10.0, args.seconds))
            out["etcd_idle_cpu_pct_of_core"] = 100 * (etcd.cpu_s() - idle0) / (time.monotonic() - w0)
            print(f"etcd idle: {out['etcd_idle_cpu_pct_of_core']:.2f}% of a core", flush=True)
            out["keepalive"] = []
            for mode, transport in [(m.strip(), t.strip()) for m in args.modes.split(",") if m.strip()
                                    for t in args.keepalive.split(",") if t.strip()]:
                if transport not in ("grpc", "http"):
                    sys.exit(f"--keepalive: {transport!r} is not grpc or http")
                r = keepalive_cpu(url, etcd, args.publishers, args.seconds, mode == "shared", args.ttl, transport)
                out["keepalive"].append(r)
                per = (f", {r['client_cpu_us_per_keepalive']:.0f} us CPU per keep-alive"
                       if r["client_cpu_us_per_keepalive"] else "")
                print(f"{r['publishers']} publishers, {r['leases']} lease(s) ({mode}), keep-alive over {transport} "
                      f"(all-time: {r['keepalives_total_grpc']} gRPC, {r['keepalives_total_http']} HTTP, "
                      f"{r['grpc_failures']} gRPC failures), TTL {r['ttl_s']:g} s: "
                      f"{r['keepalives_per_s']:.1f} keep-alives/s; publishers' process {r['client_cpu_pct_of_core']:.2f}% "
                      f"of a core{per}; etcd {r['etcd_cpu_pct_of_core']:.2f}% of a core "
                      f"(over {r['window_s']:.0f} s; {r['keepalive_failures']} failures)", flush=True)
        finally:
            etcd.stop()
    out["host"]["load_avg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
