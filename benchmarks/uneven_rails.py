#!/usr/bin/env python3
"""Uneven rails, every time: N fresh engines, each from a cold start, on 2 Gbit/s + 1 Gbit/s.

Run as root: ``python3 benchmarks/uneven_rails.py [--runs 10] [--iters 10] [--rates 2gbit,1gbit]``.
On one testbed (brought up here unless one with the same spec is up, and then left as it was):

1. each rail's capacity: iperf3 alone on that rail (b -> a), summed; measured before and after
   the runs, and the mean of the two is the reference (the same run, so a noisy host shifts both);
2. ``--runs`` times: a new ``multirail bench target`` (namespace a) and ``initiator``
   (namespace b) over every rail, ``--iters`` timed 64 MiB transfers and **no warm-up**, so every
   run starts with fresh weights and its first transfer includes the convergence (the planner
   must converge within the first ~100 MiB). Per run: Gbps, % of the capacity, and the
   engine's byte split between the rails against the capacities' split;
3. around every run (``--adjacent-time`` s, 0 to skip), an **adjacent reference**: one iperf3
   stream per rail, all rails at once, in the run's direction (``-R`` for READ, where the target
   sends), right before and right after it. The mean of the two is what the host delivered in
   those seconds, so a run that misses the capacity while its adjacent reference drops as much
   was a slow stretch of the host, and one that misses while the reference holds is the
   engine's. Each rail's NIC rate during the run is set against that rail's adjacent rate;
4. per run, the TCP retransmissions, RTOs and tail-loss probes of both namespaces and the host's
   busy and steal CPU over the engine run: whether a slow transfer was loss recovery on a shaped
   rail or a busier host;
5. per run, the slowest transfer's trace (``bench initiator --trace``): when each rail's last
   chunk completed, and how far apart the rails finished against the run's median spread. All
   rails late together is the host (or a rail idle mid-transfer, its share taken by the others);
   one rail late is that rail: its share, its rate estimate, or its completions came late.

The verdict: every run >= 97% of the capacity (``--floor``); the adjacent ratio is reported
beside it and does not change the exit status. ``--json FILE`` writes everything.
Every server is started by the script, bounded in time and killed by PID (compare_rails.py's
helpers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("compare_rails", HERE / "compare_rails.py")
assert _spec and _spec.loader
cr = importlib.util.module_from_spec(_spec)
sys.modules["compare_rails"] = cr  # dataclasses look their module up there
_spec.loader.exec_module(cr)
tbm = cr.tbm


# TCP counters that say whether a slow transfer was loss recovery on a shaped rail (the
# namespaces carry nothing but this script's traffic), and the host's CPU time (the engine's
# included: a busier host than in the other runs is load from elsewhere).
TCP_KEYS = {"Tcp": ("RetransSegs",), "TcpExt": ("TCPTimeouts", "TCPLossProbes")}


def tcp_counters(tb: Any) -> dict[str, int]:
    """RetransSegs, TCPTimeouts and TCPLossProbes of namespaces a and b, summed."""
    out = {k: 0 for ks in TCP_KEYS.values() for k in ks}
    for side in ("a", "b"):
        cp = cr.run(tb.exec_argv(side, ["cat", "/proc/net/snmp", "/proc/net/netstat"]), 10)
        lines = cp.stdout.splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            group, _, names = names.partition(": ")
            for k, v in zip(names.split(), values.partition(": ")[2].split()):
                if k in TCP_KEYS.get(group, ()):
                    out[k] += int(v)
    return out


def host_cpu() -> tuple[int, int, int]:
    """(busy, steal, total) clock ticks of the whole host so far (/proc/stat: idle and iowait are
    not busy; steal is time the hypervisor gave to someone else)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], ticks[7], sum(ticks)


def engine_run(tb: Any, op: str, iters: int, timeout_s: float, warmup: int = 0,
               transport: str = "tcp") -> dict[str, Any]:
    """One fresh target + initiator pair: the 64 MiB row of `multirail bench initiator`."""
    a_addrs, b_addrs = ",".join(tb.addrs("a")), ",".join(tb.addrs("b"))
    listen = f"{tb.addrs('a')[0]}:{cr.MR_PORT}"
    mr = [sys.executable, "-m", "multirail", "bench"]
    tr = ["--transport", transport]
    servers = cr.Servers()
    with tempfile.TemporaryDirectory(prefix="uneven-rails-") as tmp:
        out_json = Path(tmp) / "bench.json"
        try:
            target = servers.start(tb.exec_argv("a", [*mr, "target", "--listen", listen, "--rails", a_addrs,
                                                      "--duration", str(int(timeout_s)), "--idle-timeout", "60", *tr]),
                                   stdout=subprocess.PIPE)
            cr.wait_listening(tb, cr.MR_PORT, target)
            tcp0, cpu0 = tcp_counters(tb), host_cpu()
            cp = cr.run(tb.exec_argv("b", [*mr, "initiator", "--connect", listen, "--rails", b_addrs, "--op", op,
                                           "--start-block-size", "64MiB", "--max-block-size", "64MiB",
                                           "--num-iter", str(iters), "--warmup-iter", str(warmup), "--json", str(out_json),
                                           "--trace", *tr]),
                        timeout=timeout_s, check=False)
            if cp.returncode != 0:
                raise RuntimeError(f"multirail bench initiator failed ({cp.returncode}): {cp.stderr.strip()[-400:]}")
            tcp1, cpu1 = tcp_counters(tb), host_cpu()
            row = json.loads(out_json.read_text())["rows"][0]
            row["tcp"] = {k: tcp1[k] - tcp0[k] for k in tcp0}
            row["host_busy_pct"], row["host_steal_pct"] = (100.0 * (cpu1[j] - cpu0[j]) / max(1, cpu1[2] - cpu0[2])
                                                           for j in (0, 1))
            return row
        finally:
            servers.stop()


def slowest(row: dict[str, Any]) -> dict[str, Any] | None:
    """The run's slowest timed transfer from its trace (`bench initiator --trace`): its time, and
    per rail its bytes, when its last chunk completed and the planner's rate estimate at the post;
    `start_ms` is when the last rail to start was handed its first chunk (a late start delays
    every rail alike); `spread_ms` is how far apart the rails finished (the latest less the earliest rail that
    carried bytes). A slow transfer whose rails all finished late was a slow stretch of the host
    or a rail idle mid-transfer; one whose single rail finished late points at that rail (its
    share, its rate estimate, or its completions came late).
    `median_spread_ms` is the same spread over all the run's transfers, for comparison."""
    traces = [t for t in row.get("traces") or [] if t.get("rails")]
    if not traces:
        return None

    def spread(t: dict[str, Any]) -> float:
        done = [x["last_done_us"] for x in t["rails"] if x["bytes"] and x["last_done_us"] is not None]
        return (max(done) - min(done)) / 1e3 if done else 0.0

    t = max(traces, key=lambda t: t["lat_us"])
    starts = [x["first_issue_us"] for x in t["rails"] if x["first_issue_us"] is not None]
    return {"lat_ms": t["lat_us"] / 1e3, "spread_ms": spread(t),
            "start_ms": max(starts) / 1e3 if starts else None,
            "median_spread_ms": statistics.median(spread(x) for x in traces),
            "rails": [{"bytes": x["bytes"],
                       "last_done_ms": None if x["last_done_us"] is None else x["last_done_us"] / 1e3,
                       "rate_gbps_at_post": x["rate_gbps_at_post"]} for x in t["rails"]]}


@dataclass
class Ref:
    """One adjacent reference: iperf3 per rail, all at once, in one direction."""
    op: str
    bps: list[float]


def adjacent(before: Ref | None, after: Ref | None) -> list[float] | None:
    """The per-rail mean of the references measured right before and right after a run (either
    alone where the other is missing; None where neither was measured)."""
    refs = [r.bps for r in (before, after) if r is not None]
    if not refs:
        return None
    return [sum(xs) / len(refs) for xs in zip(*refs)]


def summarize(rows: dict[str, list[dict[str, Any]]], cap: list[float],
              adj: dict[str, list[list[float] | None]], floor: float) -> tuple[list[str], dict[str, Any], bool]:
    """The report: a table per op (one line per run), its verdict, and the JSON `runs`.

    `rows[op][k]` is run k's 64 MiB row of `multirail bench initiator`; `cap` each rail's capacity
    (alone, mean of before/after the runs); `adj[op][k]` run k's adjacent per-rail reference."""
    total = sum(cap)
    want = [c / total for c in cap]
    lines: list[str] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    ok = True
    for op, rs in rows.items():
        lines += ["| {op} run | Gbps | % of capacity | % of adjacent iperf3 | engine split | capacity split "
                  "| NIC / adjacent per rail | transfer ms min / p50 / max | slowest: rails done at ms (its last rail's start; "
                  "spread; median spread) "
                  "| retrans / RTOs / TLPs | host CPU busy |".format(op=op),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        pcts, adj_pcts = [], []
        for k, r in enumerate(rs):
            pct = 100.0 * r["gbps"] * 1e9 / total
            pcts.append(pct)
            eb = [e["bytes"] for e in r["engine_rails"]]
            split = [b / max(1, sum(eb)) for b in eb]
            # Whether a slow run was slow in every transfer (a split or an estimate off from the
            # start) or in a few (a stretch of the host, a late convergence): the spread says.
            lat_ms = [r[key] / 1e3 for key in ("lat_min_us", "lat_p50_us", "lat_max_us")]
            # per rail, from the NIC counters of namespace b (what the wire carried)
            nic = [x["gbps"] for x in r.get("rails", [])]
            ref = adj.get(op, [])[k] if k < len(adj.get(op, [])) else None
            adj_pct = 100.0 * r["gbps"] * 1e9 / sum(ref) if ref else None
            if adj_pct is not None:
                adj_pcts.append(adj_pct)
            per_rail = [100.0 * g * 1e9 / b for g, b in zip(nic, ref)] if ref and len(nic) == len(ref) else None
            # Loss recovery on the rails (both namespaces, the whole engine run) and how busy the
            # host's CPUs were meanwhile: a slow run with neither points at the engine.
            tcp, busy = r.get("tcp", {}), r.get("host_busy_pct")
            slow = slowest(r)
            slow_txt = "-" if slow is None else (
                " / ".join("-" if x["last_done_ms"] is None else f"{x['last_done_ms']:.0f}" for x in slow["rails"])
                + f" (start {slow['start_ms']:.1f}; spread {slow['spread_ms']:.1f}; median "
                f"{slow['median_spread_ms']:.1f})")
            lines.append(
                f"| {k + 1} | {r['gbps']:.3f} | {pct:.1f}% | {'-' if adj_pct is None else f'{adj_pct:.1f}%'} | "
                f"{':'.join(f'{x:.3f}' for x in split)} | {':'.join(f'{w:.3f}' for w in want)} | "
                f"{'-' if per_rail is None else ' '.join(f'{x:.0f}%' for x in per_rail)} | "
                f"{' / '.join(f'{x:.1f}' for x in lat_ms)} | {slow_txt} | "
                f"{' / '.join(str(tcp.get(key, '-')) for key in ('RetransSegs', 'TCPTimeouts', 'TCPLossProbes'))} | "
                f"{'-' if busy is None else f'{busy:.0f}%'} |")
            runs.setdefault(op, []).append({
                "gbps": r["gbps"], "pct": pct, "split": split, "lat_ms": lat_ms, "nic_gbps": nic,
                "adjacent_bps": ref, "pct_of_adjacent": adj_pct, "nic_pct_of_adjacent": per_rail,
                "tcp": tcp, "host_busy_pct": busy, "host_steal_pct": r.get("host_steal_pct"),
                "slowest": slow})
        met = min(pcts) >= floor
        ok &= met
        lines += ["", f"{op}: min {min(pcts):.1f}%, median {statistics.median(pcts):.1f}%, max {max(pcts):.1f}% "
                  f"of capacity (floor {floor}%: {'met' if met else 'NOT met'})"]
        if adj_pcts:
            lines.append(f"{op}: of the adjacent iperf3: min {min(adj_pcts):.1f}%, median "
                         f"{statistics.median(adj_pcts):.1f}%, max {max(adj_pcts):.1f}%")
        lines.append("")
    return lines, runs, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="mruneven")
    ap.add_argument("--rates", default="2gbit,1gbit")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ops", default="READ")
    ap.add_argument("--warmup", type=int, default=0,
                    help="untimed 64 MiB transfers before the timed ones (default 0: the first "
                         "timed transfer includes the convergence)")
    ap.add_argument("--transport", choices=("tcp", "ucx"), default="tcp",
                    help="what carries the engine's rails (default tcp; ucx needs a UCX library)")
    ap.add_argument("--time", type=int, default=3, help="iperf3 seconds per rail (default 3)")
    ap.add_argument("--adjacent-time", type=int, default=2,
                    help="seconds of the all-rails iperf3 right before and after each run (default 2; 0: none)")
    ap.add_argument("--floor", type=float, default=97.0)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    try:
        tbm.require_root()
        tb = tbm.Testbed(a.name, rates=a.rates.split(","))
        action = tb.up()
    except tbm.TestbedError as e:
        print(f"uneven_rails: {e}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"rates": a.rates, "transport": a.transport}
    ops = a.ops.split(",")
    try:
        rails = list(range(tb.n_rails))
        cap0 = [cr.iperf3_rails(tb, [i], a.time) for i in rails]
        rows: dict[str, list[dict[str, Any]]] = {op: [] for op in ops}
        adj: dict[str, list[list[float] | None]] = {op: [] for op in ops}
        last: Ref | None = None  # the latest adjacent reference, reused when it is the same op's

        def reference(op: str) -> Ref | None:
            if a.adjacent_time <= 0:
                return None
            return Ref(op, cr.iperf3_each(tb, rails, a.adjacent_time, reverse=op == "READ"))

        for k in range(a.runs):
            for op in ops:
                before = last if last is not None and last.op == op else reference(op)
                rows[op].append(engine_run(tb, op, a.iters, 300, a.warmup, a.transport))
                last = reference(op)
                adj[op].append(adjacent(before, last))
                r = rows[op][-1]
                print(f"run {k + 1}/{a.runs} {op}: {r['gbps']:.3f} Gbps", file=sys.stderr, flush=True)
        cap1 = [cr.iperf3_rails(tb, [i], a.time) for i in rails]
    finally:
        if action != "unchanged":
            tb.down()
    cap = [(x + y) / 2 for x, y in zip(cap0, cap1)]
    print(f"\n{tb.n_rails} rails ({a.rates}); per-rail iperf3 (mean of before/after): "
          f"{', '.join(f'{c / 1e9:.3f}' for c in cap)} Gbps = {sum(cap) / 1e9:.3f} Gbps; "
          f"{a.runs} fresh {a.transport} engines x {a.iters} x 64 MiB, "
          f"{f'{a.warmup} warm-up' if a.warmup else 'no warm-up'}"
          + (f"; adjacent reference: {a.adjacent_time} s of iperf3 on all rails before and after each run"
             if a.adjacent_time > 0 else "") + "\n")
    lines, runs, ok = summarize(rows, cap, adj, a.floor)
    print("\n".join(lines))
    results |= {"runs": runs, "capacity_bps": cap, "capacity_before_bps": cap0, "capacity_after_bps": cap1,
                "adjacent_time_s": a.adjacent_time, "ok": ok}
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
