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
   for each mode in ``--modes``: ``own`` (one lease per publisher, **each in its own process**,
   as 200 single-agent processes hold them) and ``shared`` (the default inside one process:
   every store with the same endpoints and TTL shares one lease; measured in this process),
   for each keep-alive transport in ``--keepalive``: ``grpc`` (etcd's native LeaseKeepAlive
   stream, one per lease, the default when grpcio is installed) and ``http`` (one gateway
   request per keep-alive), and for each keep-alive schedule in ``--schedule``: ``ttl/2+align``
   (the default: every TTL/2, on wall-clock slots), ``ttl/3`` (the old one: every TTL/3 from
   the last refresh), ``ttl/2``, ``ttl/3+align``. Before each configuration etcd's idle CPU is
   measured (``--idle-seconds``, nothing connected); after publishing, ``--seconds`` of steady
   state: etcd's CPU (utime+stime from ``/proc/PID/stat``), the increment over that idle
   level, and the publishers' CPU (their ``/proc/PID/stat``, or ``getrusage`` in-process).

etcd runs with its defaults (single member, ``--heartbeat-interval 100``, ``--election-timeout
1000``, no lease checkpointing; ``--log-level error``); ``--etcd-flag=--X=Y`` adds flags.

``--json FILE`` writes everything. Results and the command that produced them: docs/etcd.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
sys.path.insert(0, str(REPO / "tests"))  # etcd_server: the tests' etcd launcher


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Etcd:
    """The tests' etcd (tests/etcd_server.py: one member on free loopback ports, stopped by PID),
    plus its CPU time."""

    def __init__(self, data: Path, extra: list[str] | None = None) -> None:
        from etcd_server import ETCD_MISSING, EtcdServer

        if ETCD_MISSING:
            sys.exit(ETCD_MISSING)
        try:
            self.server = EtcdServer(data, name="bench", extra=extra)
        except RuntimeError as e:
            sys.exit(str(e))
        self.port = self.server.client_port

    def cpu_s(self) -> float:
        return _proc_cpu_s(self.server.pid)

    def idle_pct(self, seconds: float) -> float:
        c0, w0 = self.cpu_s(), time.monotonic()
        time.sleep(seconds)
        return 100 * (self.cpu_s() - c0) / (time.monotonic() - w0)

    def stop(self) -> None:
        self.server.stop()


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


SCHEDULES = {"ttl/2+align": (2.0, True), "ttl/2": (2.0, False), "ttl/3": (3.0, False), "ttl/3+align": (3.0, True)}

# One publisher in its own process: argv url name ttl transport divisor align. Prints "ready"
# once published, then a JSON line of its lease counters when stdin closes.
PUBLISHER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[8])
from multirail import metadata
url, name, ttl, transport, div, align = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], float(sys.argv[5]), sys.argv[6] == "1"
metadata.GRPC_KEEPALIVE = transport == "grpc"
metadata.KEEPALIVE_DIVISOR, metadata.KEEPALIVE_ALIGN = div, align
s = metadata.MetadataStore(url, ttl=ttl, timeout=5.0, share_lease=False)
s.publish(name, os.urandom(600), incarnation=int(sys.argv[7]), host="127.0.0.1", port=10000)
print("ready", flush=True)
sys.stdin.read()
l = s.lease
print(json.dumps({"keepalives": l.keepalives, "grpc": l.grpc_keepalives, "http": l.http_keepalives,
                  "grpc_failures": l.grpc_failures, "failures": l.failures, "grants": l.grants}), flush=True)
s.close()
"""


def _publishers_in_processes(url: str, n: int, ttl: float, transport: str, div: float, align: bool) -> list[Any]:
    procs = []
    for i in range(n):
        procs.append(subprocess.Popen([sys.executable, "-c", PUBLISHER, url, f"pub-{i:04d}", str(ttl), transport,
                                       str(div), "1" if align else "0", str(i + 1), str(REPO / "python")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        if (i + 1) % 16 == 0:  # do not start 200 interpreters at once on a small machine
            for p in procs[-16:]:
                p.stdout.readline()
    for p in procs[(n // 16) * 16:]:
        p.stdout.readline()
    return procs


def keepalive_cpu(url: str, etcd: Etcd, publishers: int, seconds: float, shared: bool, ttl: float,
                  transport: str = "grpc", schedule: str = "ttl/2+align", idle_seconds: float = 20.0) -> dict[str, Any]:
    from multirail import metadata
    from multirail.metadata import MetadataStore

    div, align = SCHEDULES[schedule]
    idle = etcd.idle_pct(idle_seconds)  # nothing connected: etcd's own level, this minute
    t0 = time.monotonic()
    stores: list[Any] = []
    procs: list[Any] = []
    if shared:
        metadata.GRPC_KEEPALIVE = transport == "grpc"  # read when a lease is created
        metadata.KEEPALIVE_DIVISOR, metadata.KEEPALIVE_ALIGN = div, align
        blob = os.urandom(600)  # about one agent with a few regions
        for i in range(publishers):
            s = MetadataStore(url, ttl=ttl, timeout=5.0, share_lease=True)
            s.publish(f"pub-{i:04d}", blob, incarnation=i + 1, host="127.0.0.1", port=10000 + i)
            stores.append(s)
    else:
        procs = _publishers_in_processes(url, publishers, ttl, transport, div, align)
    publish_s = time.monotonic() - t0
    time.sleep(max(ttl, 5.0))  # past the first refresh rounds: steady state

    def client_cpu() -> float:
        if shared:
            ru = resource.getrusage(resource.RUSAGE_SELF)
            return ru.ru_utime + ru.ru_stime
        return sum(_proc_cpu_s(p.pid) for p in procs)

    k0 = stores[0].lease.keepalives if shared else None
    c0, e0, w0 = client_cpu(), etcd.cpu_s(), time.monotonic()
    time.sleep(seconds)
    c1, e1, w1 = client_cpu(), etcd.cpu_s(), time.monotonic()
    wall = w1 - w0
    if shared:
        lease = stores[0].lease
        kas = lease.keepalives - k0
        counts = {"keepalives": lease.keepalives, "grpc": lease.grpc_keepalives, "http": lease.http_keepalives,
                  "grpc_failures": lease.grpc_failures, "failures": lease.failures, "grants": lease.grants}
        leases = 1
        for s in stores:
            s.close()
    else:
        rows = []
        for p in procs:
            out, _ = p.communicate("", timeout=60)
            rows.append(json.loads(out.strip().splitlines()[-1]))
        counts = {k: sum(r[k] for r in rows) for k in rows[0]}
        leases = len(rows)
        kas = round(wall * leases * div / ttl)  # the schedule's rate (counts above are all-time)
    etcd_pct = 100 * (e1 - e0) / wall
    return {"mode": "shared" if shared else "own", "transport": transport, "schedule": schedule,
            "processes": 1 if shared else publishers, "publishers": publishers, "leases": leases, "ttl_s": ttl,
            "publish_all_s": publish_s, "window_s": wall, "keepalives_per_s": kas / wall, "all_time": counts,
            "client_cpu_pct_of_core": 100 * (c1 - c0) / wall,
            "etcd_idle_cpu_pct_of_core": idle, "etcd_cpu_pct_of_core": etcd_pct,
            "etcd_increment_pct_of_core": etcd_pct - idle,
            "etcd_us_per_keepalive_above_idle": 1e4 * (etcd_pct - idle) / (kas / wall) if kas else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fetches", type=int, default=2000)
    ap.add_argument("--publishers", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--ttl", type=float, default=10.0)
    ap.add_argument("--modes", default="own,shared")
    ap.add_argument("--keepalive", default="grpc,http", help="keep-alive transports to compare (grpc, http)")
    ap.add_argument("--schedule", default="ttl/2+align", help=f"keep-alive schedules to compare ({', '.join(SCHEDULES)})")
    ap.add_argument("--idle-seconds", type=float, default=20.0, help="etcd idle window before each configuration")
    ap.add_argument("--etcd-flag", action="append", default=[], metavar="FLAG", help="extra etcd flag (repeatable)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    out: dict[str, Any] = {"host": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}}
    with tempfile.TemporaryDirectory() as d:
        etcd = Etcd(Path(d) / "data", args.etcd_flag)
        out["etcd_flags"] = ["defaults", *args.etcd_flag]
        try:
            url = f"etcd://127.0.0.1:{etcd.port}/bench"
            ver = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{etcd.port}/version", timeout=5).read())
            out["etcd_version"] = ver.get("etcdserver")
            if args.fetches:
                out["fetch"] = f = fetch_latency(url, args.fetches)
                print(f"fetch by name via etcd: p50 {f['etcd']['p50_us']:.0f} us, p99 {f['etcd']['p99_us']:.0f} us; "
                      f"side channel: p50 {f['side_channel']['p50_us']:.0f} us, p99 {f['side_channel']['p99_us']:.0f} us "
                      f"({args.fetches} each, interleaved)", flush=True)
            out["keepalive"] = []
            configs = [(m.strip(), t.strip(), c.strip()) for m in args.modes.split(",") if m.strip()
                       for t in args.keepalive.split(",") if t.strip() for c in args.schedule.split(",") if c.strip()]
            for mode, transport, sched in configs:
                if transport not in ("grpc", "http"):
                    sys.exit(f"--keepalive: {transport!r} is not grpc or http")
                if sched not in SCHEDULES:
                    sys.exit(f"--schedule: {sched!r} is not one of {', '.join(SCHEDULES)}")
                r = keepalive_cpu(url, etcd, args.publishers, args.seconds, mode == "shared", args.ttl, transport,
                                  sched, args.idle_seconds)
                out["keepalive"].append(r)
                a = r["all_time"]
                per = (f", {r['etcd_us_per_keepalive_above_idle']:.0f} us each" if r["etcd_us_per_keepalive_above_idle"]
                       else "")
                print(f"{r['publishers']} publishers in {r['processes']} process(es), {r['leases']} lease(s), "
                      f"{transport}, {sched}, TTL {r['ttl_s']:g} s: {r['keepalives_per_s']:.1f} keep-alives/s; "
                      f"etcd {r['etcd_cpu_pct_of_core']:.2f}% of a core, idle {r['etcd_idle_cpu_pct_of_core']:.2f}%, "
                      f"increment {r['etcd_increment_pct_of_core']:.2f}%{per}; publishers "
                      f"{r['client_cpu_pct_of_core']:.2f}% (over {r['window_s']:.0f} s; all-time {a['grpc']} gRPC, "
                      f"{a['http']} HTTP keep-alives, {a['grpc_failures']} gRPC failures, {a['failures']} failures, "
                      f"{a['grants']} grants)", flush=True)
        finally:
            etcd.stop()
    out["host"]["load_avg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
