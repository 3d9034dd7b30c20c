#!/usr/bin/env python3
"""Failover on a 2-rail testbed: kill a rail halfway through large transfers, or flap it.

Run as root (the engine must be built; see the Makefile), e.g.::

    .venv/bin/python benchmarks/failover.py --rate 1gbit --size 512MiB --repeat 3
    .venv/bin/python benchmarks/failover.py --flap 5 --size 64MiB

Default mode, ``--repeat N`` times: on a fresh testbed (target in namespace a, initiator in b,
python/multirail/bench/drill.py), one transfer on both rails (baseline), then one during which
rail 1's link goes down once half of its share is done, then one with the rail still down (the
one-rail rate of the same run), then the link back up and one more transfer that must use the
rail again. Every transfer is checked byte for byte. Reported per run: completion, the time from
link down to the engine marking the rail down (`rail_stats` polled every 1-2 ms), the throughput
of the remainder of the transfer after the link went down (the dead rail's in-flight chunks
included, so the detection stall counts), the same as % of the one-rail rate, and the time until
the rail is readmitted.

``--flap N``: transfers back to back while rail 1 goes down for ``--down-s`` and up for
``--up-s``, N times; reports transfers completed, failed, and bytes corrupted (READ: every byte
compared with the target's pattern; WRITE: the target verifies every transfer's fresh pattern).

The testbed is created here under a unique name and always removed (``finally``); every process
runs under a timeout and is killed by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
try:
    from multirail.bench.core import UsageError, format_size, parse_size
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(REPO / "python"))
    from multirail.bench.core import UsageError, format_size, parse_size
from multirail.bench.drill import DrillError, run_drill
from multirail.testbed import Testbed, TestbedError


def _fmt(x: float | None, unit: str = "", nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def failover_runs(tb: Testbed, args: argparse.Namespace, size: int) -> list[dict[str, Any]]:
    runs = []
    for i in range(args.repeat):
        out = run_drill(tb, {"mode": "failover", "op": args.op, "size": size, "rail": 1,
                             "stall_timeout": args.stall_timeout, "connections": args.connections, "how": args.how,
                             "chunk_size": args.chunk_size, "timeout": 60.0}, timeout=args.limit)
        fo, one = out["failover"], out["one_rail"]
        row = {
            "run": i + 1,
            "completed": fo["ok"] and fo["corrupt"] is None,
            "error": fo["error"] or fo["corrupt"],
            "baseline_gbps": out["baseline"]["gbps"],
            "failover_xfer_gbps": fo["gbps"],
            "detect_s": fo["detect_s"],
            "remainder_gbps": fo["remainder_gbps"],
            "one_rail_gbps": one["gbps"],
            "remainder_pct_of_one_rail": 100.0 * fo["remainder_gbps"] / one["gbps"] if one["gbps"] else None,
            "readmit_s": out["readmit_s"],
            "after_readmit_rail_bytes": out["after_readmit"]["rail_bytes"],
            "all_byte_exact": all(out[k]["ok"] and out[k]["corrupt"] is None
                                  for k in ("baseline", "failover", "one_rail", "after_readmit")),
            "down_reason": fo["rail_stats"][1]["down_reason"],
        }
        runs.append(row)
        print(f"run {i + 1}: completed={row['completed']} detect={_fmt(row['detect_s'], ' s')} "
              f"remainder={_fmt(row['remainder_gbps'], ' Gbps')} "
              f"({_fmt(row['remainder_pct_of_one_rail'], '%', 1)} of one rail {_fmt(row['one_rail_gbps'], ' Gbps')}) "
              f"readmit={_fmt(row['readmit_s'], ' s')} byte-exact={row['all_byte_exact']}", flush=True)
    return runs


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace, size: int) -> str:
    lines = [f"2 x {args.rate} rails, {args.op} {format_size(size)}, failure {args.how}, stall_timeout {args.stall_timeout} s, "
             f"{args.connections} connection(s)/rail, chunk {args.chunk_size}", "",
             "| run | completed | byte-exact | detect s | remainder Gbps | one rail Gbps | remainder % of one rail | readmit s |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['run']} | {r['completed']} | {r['all_byte_exact']} | {_fmt(r['detect_s'])} | "
                     f"{_fmt(r['remainder_gbps'])} | {_fmt(r['one_rail_gbps'])} | "
                     f"{_fmt(r['remainder_pct_of_one_rail'], '', 1)} | {_fmt(r['readmit_s'])} |")
    pct = [r["remainder_pct_of_one_rail"] for r in runs if r["remainder_pct_of_one_rail"] is not None]
    det = [r["detect_s"] for r in runs if r["detect_s"] is not None]
    if pct and det:
        lines += ["", f"median: detect {statistics.median(det):.3f} s, remainder {statistics.median(pct):.1f}% "
                      f"of the one-rail rate (target >= 90%)"]
    return "\n".join(lines)


def flap_run(tb: Testbed, args: argparse.Namespace, size: int) -> dict[str, Any]:
    out = run_drill(tb, {"mode": "flap", "op": args.op, "size": size, "rail": 1, "flaps": args.flap,
                         "down_s": args.down_s, "up_s": args.up_s, "stall_timeout": args.stall_timeout,
                         "connections": args.connections, "chunk_size": args.chunk_size, "timeout": 60.0},
                    timeout=args.limit)
    keys = ("flaps", "transfers", "completed", "failed", "corrupt_transfers", "bytes_corrupted",
            "gbps_overall", "readmit_after_last_flap_s", "corrupt_details", "stale_replies", "last_rail_bytes", "failures", "flap_error")
    return {k: out[k] for k in keys} | {"last_ok": out["last"]["ok"] and out["last"]["corrupt"] is None,
                                        "events": out["events"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="rate of both rails (default 1gbit)")
    p.add_argument("--op", default="READ", type=str.upper, choices=["READ", "WRITE"])
    p.add_argument("--size", default=None, help="transfer size (default 512MiB; 64MiB with --flap)")
    p.add_argument("--repeat", type=int, default=3, help="failover runs (default 3)")
    p.add_argument("--flap", type=int, default=0, metavar="N", help="flap rail 1 N times instead")
    p.add_argument("--down-s", type=float, default=1.0, help="--flap: seconds down (default 1)")
    p.add_argument("--up-s", type=float, default=2.0, help="--flap: seconds up between flaps (default 2)")
    p.add_argument("--stall-timeout", type=float, default=0.5, help="engine stall_timeout (default 0.5 s, the engine's)")
    p.add_argument("--how", default="link", choices=["link", "blackhole"],
                   help="failure: link = rail device down on side a (carrier loss); blackhole = side a silently "
                        "drops what it sends on the rail (only the stall timeout can see it)")
    p.add_argument("--connections", type=int, default=1)
    p.add_argument("--chunk-size", default="1MiB")
    p.add_argument("--limit", type=float, default=300.0, help="seconds allowed per drill (default 300)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    try:
        size = parse_size(args.size or ("64MiB" if args.flap else "512MiB"))
        parse_size(args.chunk_size)
        if args.repeat < 1 or args.flap < 0 or args.down_s <= 0 or args.up_s <= 0 or args.stall_timeout <= 0:
            raise UsageError("--repeat must be >= 1, --flap >= 0, times positive")
    except UsageError as e:
        print(f"failover.py: error: {e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("failover.py: needs root (network namespaces)", file=sys.stderr)
        return 2
    tb = Testbed(f"mrfo{os.getpid() % 100000}", rails=2, rate=args.rate)
    try:
        tb.up()
        if args.flap:
            res: Any = flap_run(tb, args, size)
            print(json.dumps({k: v for k, v in res.items() if k != "events"}, indent=1))
            bad = res["failed"] or res["bytes_corrupted"] or res["corrupt_transfers"] or not res["last_ok"]
        else:
            res = failover_runs(tb, args, size)
            print(summarize(res, args, size))
            bad = not all(r["completed"] and r["all_byte_exact"] for r in res)
    except (DrillError, TestbedError) as e:
        print(f"failover.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        tb.down()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": res}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
