#!/usr/bin/env python3
"""Transports side by side (issue 9): NIXL/UCX vs multirail over UCX vs multirail over TCP.

Run as root: ``.venv/bin/python benchmarks/ucx_side_by_side.py [--rails 2x2g|2g+1g] [--rounds 3]
[--size 128MiB] [--iters 8] [--lat-iters 2000] [--json FILE]``. On one emulated testbed
(python/multirail/testbed.py: two namespaces, rate-limited veth rails; brought up here unless
one with the same spec is up, and then left as it was), in one run:

1. each rail's capacity: iperf3 alone on that rail (b -> a), before and after the workers;
   the mean of the two is the reference (compare_rails.py's helpers, as uneven_rails.py does);
2. ``--rounds`` rounds; in each, every worker once, the order rotated by one per round:
   * ``nixl-ucx``: NIXL 1.5 (UCX backend) with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` set to
     each side's rail devices (as bench/kv_nixl.py drives it);
   * ``multirail-ucx``: ``multirail.Agent(..., transport="ucx")`` over every rail;
   * ``multirail-tcp``: the same with ``transport="tcp"``;
   * ``multirail-mixed`` (``--workers ...,mr-mixed``, issue 21): one link of mixed rails,
     ``transport="ucx,tcp"``: rail 0 over UCX (its tcp transport here, asked for by name), rail 1
     over multirail's tcp, striped by one planner;
   * ``multirail-ucx 1 rail`` (``--single-rail-baseline``, on by default): rail 0 only, for
     "2 rails >= 1.9x one".
   Each worker is a target process in namespace a (one buffer of ``--size``, filled with a
   pattern) and an initiator in namespace b with a buffer of the same size: READ of the whole
   buffer ``--iters`` times (after a warm-up), then WRITE the same way, then ``--lat-iters``
   4 KiB READ round trips (p50/p99). Per timed loop the initiator reads its rails' NIC counters
   (/sys/class/net/<veth>/statistics: rx for READ, tx for WRITE), so the per-rail split is the
   kernel's, not the engine's word.
3. Byte checks: after the READ loop the initiator's buffer must equal the target's pattern;
   after the WRITE loop it zeroes its buffer, READs the target's buffer back once and compares
   it with what it wrote (so a WRITE that did not land, or landed elsewhere, is seen the same
   way for every worker).

Output: per worker the medians over the rounds (READ / WRITE Gbps, % of the per-rail iperf3
sum, rail split, 4 KiB READ p50/p99), then the issue-9 targets with met / NOT met. Exit 1 on
any byte mismatch or a failed multirail worker; NIXL missing (or failing) is reported in its
rows and the rest still runs. Every process is started here, bounded in time and killed by PID.

Internal: ``ucx_side_by_side.py _target KIND ...`` / ``_initiator KIND ...`` are the worker
processes (run inside the namespaces).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

LAT_SIZE = 4096
TARGET_SEED = 0x5EED
WRITE_SEED = 0xB0B
TARGET_NAME = "sbs-target"
RAIL_PRESETS = {"2x2g": ["2gbit", "2gbit"], "2g+1g": ["2gbit", "1gbit"]}


# =========================================================================== worker processes

def _pattern(seed: int, size: int) -> Any:
    from multirail.bench.core import pattern
    return pattern(seed, 0, size).copy()


def _emit(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


def _wait_stdin(limit_s: float) -> None:
    """Serve until the parent closes our stdin (or `limit_s` passes)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        r, _, _ = select.select([sys.stdin], [], [], 1.0)
        if r and not sys.stdin.readline():
            return


def _nixl_api() -> Any:
    from multirail.bench.nixl_latency import nixl_api
    return nixl_api()


def worker_target(kind: str, size: int, spec: dict[str, Any]) -> int:
    import numpy as np

    buf = _pattern(TARGET_SEED, size)
    assert buf.dtype == np.uint8
    if kind == "nixl":
        api = _nixl_api()
        if api is None:
            _emit({"error": "NIXL is not importable (pip install nixl-cu12)"})
            return 1
        agent = api.nixl_agent("sbs-nixl-target", api.nixl_agent_config(backends=["UCX"]))
        agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, size, 0, "")], "DRAM"))
        _emit({"meta": agent.get_agent_metadata().hex(), "addr": int(buf.ctypes.data)})
        _wait_stdin(spec["lifetime_s"])
        return 0
    import multirail
    agent = multirail.Agent(TARGET_NAME, {"host": spec["rails"][0], "port": 0, "rails": spec["rails"],
                                          "transport": spec["transport"], "timeout": 10.0})
    try:
        agent.register_memory(buf, access="rw")
        _emit({"port": agent.port, "addr": int(buf.ctypes.data), "transport_info": agent.transport_info()})
        _wait_stdin(spec["lifetime_s"])
    finally:
        agent.close()
    return 0


def _counters(devs: list[str], direction: str) -> list[int]:
    out = []
    for d in devs:
        with open(f"/sys/class/net/{d}/statistics/{direction}_bytes") as f:
            out.append(int(f.read()))
    return out



def _rows(local: Any, remote: list[tuple[int, int, int]]) -> tuple[Any, Any]:
    """(local, remote) descriptor rows as Nx3 uint64 arrays: the local buffer whole, and `remote`."""
    import numpy as np

    return np.array([[local.ctypes.data, local.nbytes, 0]], np.uint64), np.array(remote, np.uint64)

class _MrInit:
    def __init__(self, spec: dict[str, Any], size: int, buf: Any, lat: Any) -> None:
        import multirail
        self.agent = multirail.Agent(f"sbs-init-{os.getpid()}", {
            "host": spec["rails"][0], "port": 0, "rails": spec["rails"], "transport": spec["transport"],
            "timeout": 30.0})
        self.agent.register_memory(buf)
        self.agent.register_memory(lat)
        host, port = spec["target_host"], int(spec["target_port"])
        self.agent.fetch_remote_metadata(TARGET_NAME, host, port)
        deadline = time.monotonic() + 30
        while not self.agent.check_remote_metadata(TARGET_NAME):
            if time.monotonic() > deadline:
                raise RuntimeError("no metadata from the target within 30 s")
            time.sleep(0.005)
        raddr = int(spec["target_addr"])
        self.rbuf = [(raddr, size, 0)]
        self.rlat = [(raddr, LAT_SIZE, 0)]

    def handle(self, op: str, local: Any, remote: list[tuple[int, int, int]]) -> Any:
        lrows, rrows = _rows(local, remote)
        return self.agent.initialize_xfer(op, self.agent.get_xfer_descs(lrows), self.agent.get_xfer_descs(rrows),
                                          TARGET_NAME)

    def run(self, h: Any) -> None:
        self.agent.transfer_sync(h, timeout=60.0)

    def rail_info(self) -> list[dict[str, Any]]:
        return [{"name": s.get("name"), "transport": s.get("transport"), "bytes": s.get("bytes"),
                 "bytes_read": s.get("bytes_read"), "bytes_written": s.get("bytes_written"), "up": s.get("up"),
                 "down_reason": s.get("down_reason"), "stalls": s.get("stalls"), "reissued": s.get("reissued")}
                for s in self.agent.rail_stats(TARGET_NAME)]

    def close(self) -> None:
        self.agent.close()


class _NixlInit:
    def __init__(self, spec: dict[str, Any], size: int, buf: Any, lat: Any) -> None:
        api = _nixl_api()
        if api is None:
            raise RuntimeError("NIXL is not importable (pip install nixl-cu12)")
        self.agent = api.nixl_agent("sbs-nixl-init", api.nixl_agent_config(backends=["UCX"]))
        for b in (buf, lat):
            self.agent.register_memory(self.agent.get_reg_descs([(b.ctypes.data, b.nbytes, 0, "")], "DRAM"))
        self.peer = self.agent.add_remote_agent(bytes.fromhex(spec["target_meta"]))
        raddr = int(spec["target_addr"])
        self.rbuf = [(raddr, size, 0)]
        self.rlat = [(raddr, LAT_SIZE, 0)]

    def handle(self, op: str, local: Any, remote: list[tuple[int, int, int]]) -> Any:
        lrows, rrows = _rows(local, remote)
        deadline = time.monotonic() + 30
        while True:  # the first handle may fail until UCX has connected
            try:
                return self.agent.initialize_xfer(op, self.agent.get_xfer_descs(lrows, "DRAM"),
                                                  self.agent.get_xfer_descs(rrows, "DRAM"), self.peer)
            except Exception:  # noqa: BLE001 - NIXL raises plain exceptions while connecting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def run(self, h: Any) -> None:
        st = self.agent.transfer(h)
        deadline = time.monotonic() + 60.0
        while st not in ("DONE", "ERR"):
            st = self.agent.check_xfer_state(h)
            if time.monotonic() > deadline:
                raise RuntimeError("NIXL transfer did not finish within 60 s")
        if st == "ERR":
            raise RuntimeError("NIXL transfer failed (ERR)")

    def rail_info(self) -> list[dict[str, Any]]:
        return [{"name": d, "transport": "nixl/ucx(" + os.environ.get("UCX_TLS", "") + ")"}
                for d in os.environ.get("UCX_NET_DEVICES", "").split(",") if d]

    def close(self) -> None:
        pass  # NIXL agents are torn down at exit


def worker_initiator(kind: str, size: int, spec: dict[str, Any]) -> int:
    import numpy as np

    devs = list(spec["devs"])
    iters, warm, lat_iters = int(spec["iters"]), int(spec["warmup"]), int(spec["lat_iters"])
    buf = np.zeros(size, np.uint8)
    lat = np.zeros(LAT_SIZE, np.uint8)
    expect_read = _pattern(TARGET_SEED, size)
    to_write = _pattern(WRITE_SEED, size)
    out: dict[str, Any] = {"kind": kind, "problems": []}
    w = (_NixlInit if kind == "nixl" else _MrInit)(spec, size, buf, lat)
    try:
        h_read = w.handle("READ", buf, w.rbuf)
        h_write = w.handle("WRITE", buf, w.rbuf)
        for op, h, direction in (("READ", h_read, "rx"), ("WRITE", h_write, "tx")):
            if op == "WRITE":
                buf[:] = to_write
            for _ in range(warm):
                w.run(h)
            c0 = _counters(devs, direction)
            t0 = time.perf_counter()
            for _ in range(iters):
                w.run(h)
            wall = time.perf_counter() - t0
            c1 = _counters(devs, direction)
            nic = [b - a for a, b in zip(c0, c1)]
            ok = True
            if op == "READ":
                bad = np.flatnonzero(buf != expect_read)
            else:
                buf[:] = 0
                w.run(h_read)  # read back what was written
                bad = np.flatnonzero(buf != to_write)
            if bad.size:
                ok = False
                out["problems"].append(f"{op}: {bad.size} bytes differ, first at offset {int(bad[0])}")
            out[op] = {"gbps": size * iters * 8 / wall / 1e9, "seconds": wall, "bytes": size * iters,
                       "nic_bytes": dict(zip(devs, nic)), "ok": ok}
        h_lat = w.handle("READ", lat, w.rlat)
        samples = []
        for k in range(warm * 20 + lat_iters):
            t0 = time.perf_counter_ns()
            w.run(h_lat)
            if k >= warm * 20:
                samples.append(time.perf_counter_ns() - t0)
        us = np.sort(np.array(samples, np.float64) / 1e3)
        lat_ok = bool(np.array_equal(lat, expect_read[:LAT_SIZE]) or np.array_equal(lat, to_write[:LAT_SIZE]))
        if not lat_ok:
            out["problems"].append("4KiB READ: bytes differ from the target's buffer")
        out["lat"] = {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
                      "iters": lat_iters, "ok": lat_ok}
        out["rails"] = w.rail_info()
        if kind != "nixl":
            out["transport_info"] = w.agent.transport_info()
    finally:
        w.close()
    _emit(out)
    if kind == "nixl":  # NIXL 1.5.1 can crash in its own teardown at exit (SIGSEGV seen): skip it
        sys.stdout.flush()
        os._exit(0)
    return 0


# =========================================================================== driver

def _load_cr() -> Any:
    spec = importlib.util.spec_from_file_location("compare_rails", HERE / "compare_rails.py")
    assert spec and spec.loader
    cr = importlib.util.module_from_spec(spec)
    sys.modules["compare_rails"] = cr  # dataclasses look their module up there
    spec.loader.exec_module(cr)
    return cr


def _first_json(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """The first stdout line of `proc` that is a JSON object (NIXL also logs to stdout)."""
    from multirail.bench.kv_nixl import ChildLines

    return ChildLines(proc).json(timeout_s)


def run_worker(tb: Any, worker: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    from multirail.bench.target import stop

    """One target + initiator pair for `worker`; the initiator's result (or {"error": ...})."""
    kind, rails = worker["kind"], worker["rails"]
    me = [sys.executable, str(Path(__file__).resolve())]
    # The caller's PYTHONPATH first (an A/B run puts another build there), then this repository's.
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": f"{path + os.pathsep if path else ''}{REPO / 'python'}"}
    env_a, env_b = dict(env), dict(env)
    a_addrs = [tb.rails[i].addrs["a"] for i in rails]
    b_addrs = [tb.rails[i].addrs["b"] for i in rails]
    devs_a = [tb.rails[i].devs["a"] for i in rails]
    devs_b = [tb.rails[i].devs["b"] for i in rails]
    if kind == "nixl":
        for e, devs in ((env_a, devs_a), (env_b, devs_b)):
            e["UCX_TLS"] = "tcp"
            e["UCX_NET_DEVICES"] = ",".join(devs)
            e.setdefault("UCX_LOG_LEVEL", "error")
    else:  # multirail restricts each rail's UCX context itself; do not let a caller's UCX_* leak in
        for e in (env_a, env_b):
            for k in ("UCX_TLS", "UCX_NET_DEVICES"):
                e.pop(k, None)
    limit = 120 + a.iters * 2 * a.size * 8 / 0.5e9 + a.lat_iters * 0.002
    tspec = {"rails": a_addrs, "transport": worker.get("transport", ""), "lifetime_s": limit + 60}
    target = subprocess.Popen(tb.exec_argv("a", [*me, "_target", kind, str(a.size), json.dumps(tspec)]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env_a)
    try:
        ready = _first_json(target, 60 + a.size / 1e8)
        if "error" in ready:
            return {"error": f"target: {ready['error']}"}
        ispec = {"rails": b_addrs, "devs": devs_b, "transport": worker.get("transport", ""),
                 "target_host": a_addrs[0], "target_port": ready.get("port"), "target_addr": ready["addr"],
                 "target_meta": ready.get("meta"), "iters": a.iters, "warmup": a.warmup, "lat_iters": a.lat_iters}
        try:
            cp = subprocess.run(tb.exec_argv("b", [*me, "_initiator", kind, str(a.size), json.dumps(ispec)]),
                                capture_output=True, text=True, timeout=limit, env=env_b)
        except subprocess.TimeoutExpired:
            return {"error": f"initiator did not finish within {limit:.0f} s"}
        lines = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
        if lines and '"error"' in lines[-1] and "error" in json.loads(lines[-1]):
            return {"error": f"initiator: {json.loads(lines[-1])['error']}"}
        if not lines:
            return {"error": f"initiator failed ({cp.returncode}): {(cp.stderr or cp.stdout).strip()[-800:]}"}
        res = dict(json.loads(lines[-1]))
        if cp.returncode != 0:
            res.setdefault("notes", []).append(f"initiator exited {cp.returncode} after its result")
        res["target_transport_info"] = ready.get("transport_info")
        return res
    finally:
        stop(target, grace=10)


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(name: str, results: list[dict[str, Any]], cap_bps: float) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    s: dict[str, Any] = {"worker": name, "runs": len(results), "ok_runs": len(ok),
                         "errors": [r["error"] for r in results if "error" in r]}
    for op in ("READ", "WRITE"):
        g = [r[op]["gbps"] for r in ok]
        s[op] = {"gbps": _med(g), "min": min(g) if g else None, "max": max(g) if g else None,
                 "pct_capacity": 100.0 * _med(g) * 1e9 / cap_bps if g and cap_bps else None}
        splits = []
        for r in ok:
            nic = list(r[op]["nic_bytes"].values())
            tot = sum(nic) or 1
            splits.append([100.0 * b / tot for b in nic])
        s[op]["split_pct"] = [statistics.median(col) for col in zip(*splits)] if splits else []
        s[op]["nic_bytes_per_round"] = [r[op]["nic_bytes"] for r in ok]
    s["lat_p50_us"] = _med([r["lat"]["p50_us"] for r in ok])
    s["lat_p99_us"] = _med([r["lat"]["p99_us"] for r in ok])
    s["mismatches"] = [p for r in ok for p in r.get("problems", [])]
    s["rail_transports"] = ok[-1].get("rails", []) if ok else []
    return s


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def table(summ: list[dict[str, Any]]) -> str:
    lines = ["| worker | rail transports | READ Gbps (min-max) | READ % of iperf3 | READ split | "
             "WRITE Gbps (min-max) | WRITE % of iperf3 | WRITE split | 4 KiB READ p50 / p99 us | bytes |",
             "|---|---|---:|---:|---|---:|---:|---|---:|---|"]
    for s in summ:
        if not s["ok_runs"]:
            lines.append(f"| {s['worker']} | - | - | - | - | - | - | - | - | not run: {s['errors'][0][:160] if s['errors'] else '?'} |")
            continue
        tr = ", ".join(sorted({str(r.get("transport")) for r in s["rail_transports"]})) or "-"
        cells = [s["worker"], tr]
        for op in ("READ", "WRITE"):
            o = s[op]
            cells += [f"{_f(o['gbps'])} ({_f(o['min'])}-{_f(o['max'])})", _f(o["pct_capacity"], ".1f"),
                      "/".join(f"{x:.0f}" for x in o["split_pct"]) or "-"]
        cells.append(f"{_f(s['lat_p50_us'], '.1f')} / {_f(s['lat_p99_us'], '.1f')}")
        bad = len(s["mismatches"])
        cells.append(("ok" if not bad else f"MISMATCH x{bad}")
                     + (f"; {len(s['errors'])} failed run(s)" if s["errors"] else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from multirail.bench.core import UsageError, parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rails", default="2x2g", choices=sorted(RAIL_PRESETS),
                   help="testbed rails: 2x2g (default) or 2g+1g")
    p.add_argument("--rounds", type=int, default=3, help="rounds, every worker once per round (default 3)")
    p.add_argument("--size", default="128MiB", help="buffer size of the bulk READ/WRITE (default 128MiB)")
    p.add_argument("--iters", type=int, default=8, help="timed bulk transfers per op (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed bulk transfers first (default 2)")
    p.add_argument("--lat-iters", type=int, default=2000, help="4 KiB READ round trips (default 2000)")
    p.add_argument("--time", type=int, default=3, help="iperf3 seconds per rail (default 3)")
    p.add_argument("--single-rail-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also run multirail-ucx on rail 0 alone (default on)")
    p.add_argument("--workers", default="nixl,mr-ucx,mr-tcp",
                   help="comma-separated subset of nixl, mr-ucx, mr-tcp, mr-mixed (default: the first three)")
    p.add_argument("--name", default="ucxsbs", help="testbed name (default ucxsbs)")
    p.add_argument("--keep", action="store_true", help="leave the testbed up")
    p.add_argument("--json", metavar="PATH", help="write everything as JSON")
    a = p.parse_args(argv)
    try:
        a.size = parse_size(a.size)
    except UsageError as e:
        p.error(str(e))
    if a.size < LAT_SIZE:
        p.error("--size must be at least 4KiB")
    if a.rounds < 1 or a.iters < 1 or a.warmup < 0 or a.lat_iters < 1:
        p.error("--rounds, --iters, --lat-iters must be >= 1, --warmup >= 0")
    a.workers = [w.strip() for w in a.workers.split(",") if w.strip()]
    if not a.workers or any(w not in ("nixl", "mr-ucx", "mr-tcp", "mr-mixed") for w in a.workers):
        p.error("--workers takes nixl, mr-ucx, mr-tcp, mr-mixed")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cr = _load_cr()
    tbm = cr.tbm
    try:
        tbm.require_root()
        tb = tbm.Testbed(a.name, rates=RAIL_PRESETS[a.rails])
        action = tb.up()
    except tbm.TestbedError as e:
        print(f"ucx_side_by_side: {e}", file=sys.stderr)
        return 2
    all_rails = list(range(tb.n_rails))
    workers: list[dict[str, Any]] = []
    names = {"nixl": ("nixl-ucx", "nixl", ""), "mr-ucx": ("multirail-ucx", "mr", "ucx"),
             "mr-tcp": ("multirail-tcp", "mr", "tcp"), "mr-mixed": ("multirail-mixed", "mr", "ucx,tcp")}
    for w in a.workers:
        label, kind, transport = names[w]
        workers.append({"name": label, "kind": kind, "transport": transport, "rails": all_rails})
    if a.single_rail_baseline and "mr-ucx" in a.workers:
        workers.append({"name": "multirail-ucx 1 rail", "kind": "mr", "transport": "ucx", "rails": [0]})
    nixl_missing = None
    if "nixl" in a.workers:
        from multirail.bench.nixl_latency import nixl_available
        if not nixl_available():
            nixl_missing = "NIXL is not installed (pip install nixl-cu12)"
    results: dict[str, list[dict[str, Any]]] = {w["name"]: [] for w in workers}
    orders: list[list[str]] = []
    try:
        print(f"testbed {tb!r} ({action}); per-rail iperf3 ...", file=sys.stderr, flush=True)
        cap0 = [cr.iperf3_rails(tb, [i], a.time) for i in all_rails]
        for rnd in range(a.rounds):
            k = rnd % len(workers)
            order = workers[k:] + workers[:k]
            orders.append([w["name"] for w in order])
            for w in order:
                if w["kind"] == "nixl" and nixl_missing:
                    results[w["name"]].append({"error": nixl_missing})
                    continue
                t0 = time.monotonic()
                r = run_worker(tb, w, a)
                results[w["name"]].append(r)
                msg = r["error"] if "error" in r else (
                    f"READ {r['READ']['gbps']:.3f} WRITE {r['WRITE']['gbps']:.3f} Gbps, 4KiB p50 "
                    f"{r['lat']['p50_us']:.1f} us" + (f"; PROBLEMS: {r['problems']}" if r.get("problems") else ""))
                print(f"round {rnd + 1}/{a.rounds} {w['name']}: {msg} ({time.monotonic() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
        cap1 = [cr.iperf3_rails(tb, [i], a.time) for i in all_rails]
    finally:
        if action != "unchanged" and not a.keep:
            tb.down()
    cap = [(x + y) / 2 for x, y in zip(cap0, cap1)]
    cap_sum = sum(cap)
    summ = []
    for w in workers:
        ref = cap[0] if w["rails"] == [0] else cap_sum
        summ.append(summarize(w["name"], results[w["name"]], ref))
    by = {s["worker"]: s for s in summ}
    print(f"\nrails {a.rails} ({' + '.join(RAIL_PRESETS[a.rails])}); per-rail iperf3 "
          f"(mean of before/after): {', '.join(f'{c / 1e9:.3f}' for c in cap)} Gbps, sum {cap_sum / 1e9:.3f} Gbps; "
          f"{a.rounds} round(s), {a.iters} x {a.size >> 20} MiB per op, {a.lat_iters} x 4 KiB READ; medians over rounds; "
          f"'1 rail' row: % of rail 0's iperf3\n")
    print(table(summ))
    # ---- targets
    checks: list[dict[str, Any]] = []
    u, n, u1 = by.get("multirail-ucx"), by.get("nixl-ucx"), by.get("multirail-ucx 1 rail")

    def check(what: str, value: float | None, target: float, unit: str, note: str = "") -> None:
        met = value is not None and value >= target
        checks.append({"check": what, "value": value, "target": target, "met": met, "note": note})
        print(f"- {what}: {_f(value, '.2f')}{unit} (target >= {target:g}{unit}): "
              f"{'met' if met else 'NOT met'}{' ' + note if note else ''}")

    print()
    mx = by.get("multirail-mixed")
    if mx and mx["ok_runs"]:
        # Issue 21: one ucx + one tcp rail, the median and the worst of the fresh runs.
        for op in ("READ", "WRITE"):
            check(f"multirail-mixed {op} % of per-rail iperf3 sum (median)", mx[op]["pct_capacity"], 95.0, "%")
            worst = 100.0 * mx[op]["min"] * 1e9 / cap_sum if mx[op]["min"] is not None and cap_sum else None
            check(f"multirail-mixed {op} % of per-rail iperf3 sum (worst of {mx['ok_runs']})", worst, 95.0, "%")
    if u and u["ok_runs"]:
        for op in ("READ", "WRITE"):
            check(f"multirail-ucx {op} % of per-rail iperf3 sum", u[op]["pct_capacity"], 95.0, "%")
        if u1 and u1["ok_runs"]:
            exp = cap_sum / cap[0]
            for op in ("READ", "WRITE"):
                ratios = [r2[op]["gbps"] / r1[op]["gbps"] for r2, r1 in
                          zip(results["multirail-ucx"], results["multirail-ucx 1 rail"])
                          if "error" not in r2 and "error" not in r1 and r1[op]["gbps"] > 0]
                r = _med(ratios)
                check(f"multirail-ucx {op}: 2 rails / 1 rail", r, 1.9, "x",
                      f"(per-round ratios {', '.join(f'{x:.2f}' for x in ratios)}; capacity ratio "
                      f"{exp:.2f}x, so {100 * r / exp if r else 0:.1f}% of ideal scaling"
                      f"{'' if exp >= 1.9 else '; 1.9x is out of reach on these rails'})")
        if n and n["ok_runs"]:
            ratios = [ru["READ"]["gbps"] / rn["READ"]["gbps"] for ru, rn in
                      zip(results["multirail-ucx"], results["nixl-ucx"])
                      if "error" not in ru and "error" not in rn and rn["READ"]["gbps"] > 0]
            ceil = cap_sum / 1e9 / n["READ"]["gbps"] if n["READ"]["gbps"] else 0.0
            check("multirail-ucx READ / NIXL READ", _med(ratios), 1.9, "x",
                  f"(per-round {', '.join(f'{x:.2f}' for x in ratios)}; NIXL READ split "
                  f"{'/'.join(f'{x:.0f}' for x in n['READ']['split_pct'])}; ceiling on these rails = rails' "
                  f"iperf3 sum / NIXL READ = {ceil:.2f}x{'' if ceil >= 1.9 else ': 1.9x is out of reach'})")
        else:
            print(f"- multirail-ucx READ / NIXL READ: not measured ({(n or {}).get('errors', ['NIXL not run'])[0]})")
    mism = [(s["worker"], p) for s in summ for p in s["mismatches"]]
    failed_mr = [(s["worker"], e) for s in summ if not s["worker"].startswith("nixl") for e in s["errors"]]
    for wname, p in mism:
        print(f"BYTE MISMATCH {wname}: {p}", file=sys.stderr)
    for wname, e in failed_mr:
        print(f"FAILED {wname}: {e}", file=sys.stderr)
    for e in (n or {}).get("errors", []):
        print(f"note: nixl-ucx: {e}", file=sys.stderr)
    if a.json:
        doc = {"rails": a.rails, "rates": RAIL_PRESETS[a.rails], "size": a.size, "iters": a.iters,
               "warmup": a.warmup, "lat_iters": a.lat_iters, "rounds": a.rounds, "orders": orders,
               "capacity_bps": cap, "capacity_before_bps": cap0, "capacity_after_bps": cap1,
               "summary": summ, "checks": checks, "results": results, "command": sys.argv}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if mism or failed_mr else 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] in ("_target", "_initiator"):
        fn = worker_target if sys.argv[1] == "_target" else worker_initiator
        try:
            sys.exit(fn(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])))
        except Exception as exc:  # noqa: BLE001 - reported to the driver as one JSON line
            _emit({"error": f"{type(exc).__name__}: {exc}"})
            sys.exit(1)
    sys.exit(main())
