#!/usr/bin/env python3
"""Soak: the rail-flap chaos run for minutes, watching both processes for leaks.

Run as root (the engine must be built; see the Makefile), e.g.::

    .venv/bin/python benchmarks/soak.py --minutes 10 --json soak.json
    .venv/bin/python benchmarks/soak.py --minutes 1 --op READ      # a quick check

On a fresh, uniquely named testbed (removed in ``finally``, whatever happens), one target
(namespace a) and one initiator (namespace b) run `multirail bench local --chaos rail-flap`'s
scenario (python/multirail/bench/chaos.py) for the whole duration: transfers of mixed sizes,
READ and WRITE alternating by default, every one checked byte for byte, while rail 1 goes
down and up. Every ``--sample-s`` seconds the host reads, by PID, the RSS (VmRSS of
/proc/PID/status), open file descriptors (/proc/PID/fd) and threads of both processes.

Verdict (exit 1 on any): a corrupted byte, a lost transfer, a failure while a rail was up (the
chaos checks); or growth between the median of the first ``--window-s`` after ``--warmup-s``
and the median of the last ``--window-s``: RSS by more than max(``--rss-pct`` % of the early
median, ``--rss-mib`` MiB); fds or threads by more than ``--fd-slack`` / ``--thread-slack``,
compared by their low and high levels (p20, p80 of each window: both are two-valued while a
rail flaps, and a median of a half-and-half mix could land on either value).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
try:
    from multirail.bench.chaos import ChaosOptions, format_summary, parse_rail_list, parse_sizes, run_chaos
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(REPO / "python"))
    from multirail.bench.chaos import ChaosOptions, format_summary, parse_rail_list, parse_sizes, run_chaos
from multirail.bench.core import UsageError, args_config, parse_size
from multirail.bench.drill import DrillError
from multirail.bench.procstat import Limits, growth
from multirail.testbed import Testbed, TestbedError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    p.add_argument("--op", default="MIXED", type=str.upper, choices=["READ", "WRITE", "MIXED"],
                   help="MIXED (default): READs and WRITEs alternating")
    p.add_argument("--sizes", default="4KiB,1MiB,16MiB", help="transfer sizes, cycled (default 4KiB,1MiB,16MiB)")
    p.add_argument("--rails", type=int, default=2, help="testbed rails (default 2)")
    p.add_argument("--rate", default="1gbit", help="rate of every rail (default 1gbit)")
    p.add_argument("--flap-rails", default=None, help="rail indices that flap in turn (default: all but 0)")
    p.add_argument("--how", default="link", choices=["link", "blackhole"],
                   help="link (default): device down; blackhole: silent drop, carrier intact")
    p.add_argument("--down-s", type=float, default=2.0, help="seconds a rail stays down per flap (default 2)")
    p.add_argument("--up-s", type=float, default=2.0, help="seconds between flaps (default 2)")
    p.add_argument("--stall-timeout", type=float, default=0.5, help="engine stall timeout (default 0.5 s, the engine's)")
    p.add_argument("--timeout", type=float, default=10.0, help="engine timeout; lost after this + stall + 5 s")
    p.add_argument("--connections", type=int, default=1)
    p.add_argument("--chunk-size", default="1MiB")
    p.add_argument("--sample-s", type=float, default=2.0, help="sampling interval (default 2 s)")
    p.add_argument("--warmup-s", type=float, default=30.0,
                   help="samples before this are not compared (default 30 s; at most a quarter of the run)")
    p.add_argument("--window-s", type=float, default=60.0,
                   help="early and late comparison windows (default 60 s; at most a third of what follows the warmup)")
    p.add_argument("--rss-pct", type=float, default=10.0, help="allowed RSS growth, %% of the early median (default 10)")
    p.add_argument("--rss-mib", type=float, default=16.0, help="allowed RSS growth, MiB (default 16; the larger applies)")
    p.add_argument("--fd-slack", type=int, default=2, help="allowed fd-count drift (default 2)")
    p.add_argument("--thread-slack", type=int, default=2, help="allowed thread-count drift (default 2)")
    p.add_argument("--secret", default=None, help="shared secret (default: $MULTIRAIL_SECRET, if set)")
    p.add_argument("--json", metavar="FILE", help="write everything (samples included) as JSON")
    return p


def _windows(args: argparse.Namespace, duration_s: float) -> tuple[float, float]:
    warmup = min(args.warmup_s, duration_s / 4)
    return warmup, min(args.window_s, (duration_s - warmup) / 3)


def _fmt_growth(name: str, g: dict[str, Any]) -> list[str]:
    if "rss_kib" not in g:
        return [f"  {name:<9} " + "; ".join(g["problems"])]
    r, f, t = g["rss_kib"], g["fds"], g["threads"]
    trend = g.get("rss_trend_kib_per_min")
    return [f"  {name:<9} RSS {r['early_median'] / 1024:7.1f} -> {r['late_median'] / 1024:7.1f} MiB "
            f"({r['growth'] / 1024:+.1f}, allowed {r['allowed_growth'] / 1024:.1f}; trend "
            f"{'-' if trend is None else f'{trend:+.0f} KiB/min'})  fds {_lv(f, 'early')} -> {_lv(f, 'late')} "
            f"(max {f['max']})  threads {_lv(t, 'early')} -> {_lv(t, 'late')} (max {t['max']})"]


def _lv(d: dict[str, Any], which: str) -> str:
    """"17/19" (p20/p80 of a window; one number when they agree)."""
    lo, hi = d[f"{which}_p20_p80"]
    return f"{lo}" if lo == hi else f"{lo}/{hi}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.minutes <= 0 or args.sample_s <= 0 or args.rails < 1:
            raise UsageError("--minutes, --sample-s must be positive, --rails at least 1")
        opts = ChaosOptions(testbed="", op=args.op, sizes=parse_sizes(args.sizes), duration_s=args.minutes * 60,
                            down_s=args.down_s, up_s=args.up_s, how=args.how,
                            flap_rails=parse_rail_list(args.flap_rails) if args.flap_rails else None,
                            connections=args.connections, chunk_size=args.chunk_size,
                            stall_timeout=args.stall_timeout, timeout=args.timeout,
                            secret=args.secret, sample_s=args.sample_s)
        parse_size(args.chunk_size)
    except UsageError as e:
        print(f"soak.py: error: {e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("soak.py: needs root (network namespaces)", file=sys.stderr)
        return 2
    from multirail.bench.procstat import ProcSampler

    warmup, window = _windows(args, opts.duration_s)
    limits = Limits(rss_pct=args.rss_pct, rss_mib=args.rss_mib, fds=args.fd_slack, threads=args.thread_slack)
    tb = Testbed(f"sk{os.getpid() % 100000}{secrets.token_hex(1)}", rails=args.rails, rate=args.rate)
    opts.testbed = tb.name
    sampler = ProcSampler(args.sample_s)
    print(f"soak: {args.minutes:g} min of rail-flap chaos on testbed {tb.name} ({args.rails} x {args.rate}), "
          f"{args.op} {args.sizes}; sampling every {args.sample_s:g} s, comparing [{warmup:g}, {warmup + window:g}) s "
          f"with the last {window:g} s", flush=True)
    try:
        tb.up()
        doc = run_chaos(tb, opts, sampler=sampler, keep_samples=True)
    except (DrillError, TestbedError, UsageError) as e:
        print(f"soak.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        tb.down()
    print(format_summary(doc))
    grown: dict[str, Any] = {}
    problems = list(doc["problems"])
    lines = [f"resources (median of [{warmup:g}, {warmup + window:g}) s vs the last {window:g} s):"]
    for name, samples in sampler.samples.items():
        # samples from t = 0 (the initiator starting); the transfers end about duration_s later,
        # then both processes close: those last samples are not part of the comparison
        g = growth([x for x in samples if x.t <= opts.duration_s], warmup, window, limits)
        grown[name] = g
        lines += _fmt_growth(name, g)
        problems += [f"{name}: {p}" for p in g["problems"]]
    print("\n".join(lines))
    ok = not problems
    print("soak: " + ("OK" if ok else "FAILED: " + " | ".join(problems)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": args_config(args),
                       "testbed": tb.name, "warmup_s": warmup, "window_s": window, "chaos": doc,
                       "growth": grown, "problems": problems, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
