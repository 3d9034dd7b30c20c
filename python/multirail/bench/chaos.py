"""`multirail bench local --testbed NAME --chaos rail-flap`: transfers while rails flap.

The run is the ``flap`` failover drill (drill.py: target in namespace a, initiator in b,
links taken down and up with `Testbed.set_link`) driven for ``--chaos-duration`` seconds with
mixed sizes and, with ``--op MIXED``, READs and WRITEs alternating. Every transfer is checked
byte for byte (READ: against the target's pattern; WRITE: the target verifies the fresh
pattern of each transfer). While it runs, the host samples the RSS, open fds and threads of
both processes by PID (procstat.py).

``--flap-how link`` (default) sets the rail's device on side a down, so side b loses carrier;
``blackhole`` makes side a silently drop what it sends on the rail (carrier intact: only the
stall timeout notices, and frames already sent may sit in the path).

Pass/fail (exit 1 on any): a corrupted byte; a transfer lost (neither completed nor failed
within ``--timeout`` + stall timeout + 5 s); a failed transfer while some rail was up (failures
are excused only while no rail's link was up); a WRITE whose verification never came back; no
flap or no completed transfer; after the last flap, a transfer that is not clean.
`benchmarks/soak.py` runs the same for minutes and adds the resource-growth check.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from multirail.bench.core import UsageError, format_size, parse_size

MODES = ("rail-flap",)
DEFAULT_DURATION_S = 30.0
DEFAULT_DOWN_S = 2.0
DEFAULT_UP_S = 2.0
DEFAULT_SIZES = "4KiB,1MiB,16MiB"
DEFAULT_SAMPLE_S = 2.0


@dataclass
class ChaosOptions:
    """One chaos run (the `bench local --chaos` flags, or what soak.py passes)."""

    testbed: str
    op: str = "READ"                       # READ, WRITE or MIXED (alternating)
    sizes: list[int] = field(default_factory=lambda: parse_sizes(DEFAULT_SIZES))
    duration_s: float = DEFAULT_DURATION_S
    down_s: float = DEFAULT_DOWN_S
    up_s: float = DEFAULT_UP_S
    flap_rails: list[int] | None = None    # None: every rail but rail 0 (rail 0 on a 1-rail testbed)
    how: str = "link"                      # link: device down (carrier lost); blackhole: silent drop
    connections: int = 1
    policy: str = "weighted"
    chunk_size: str = "1MiB"
    stall_timeout: float = 0.5
    timeout: float = 10.0
    secret: str | None = None              # None: $MULTIRAIL_SECRET as inherited
    transport: str = "tcp"                 # tcp or ucx, both processes
    sample_s: float = DEFAULT_SAMPLE_S

    def lost_after_s(self) -> float:
        return self.timeout + self.stall_timeout + 5.0

    def buffer_size(self) -> int:
        return max(self.sizes) * (2 if self.op == "MIXED" else 1)

    def config(self) -> dict[str, Any]:
        d = asdict(self)
        d["secret"] = "(set)" if self.secret else None  # never written out
        return d


def parse_sizes(text: str) -> list[int]:
    sizes = [parse_size(x) for x in text.split(",") if x.strip()]
    if not sizes:
        raise UsageError(f"--chaos-sizes needs at least one size, got {text!r}")
    return sizes


def parse_rail_list(text: str) -> list[int]:
    out: list[int] = []
    for item in (x.strip() for x in text.split(",")):
        if not item.isdigit():
            raise UsageError(f"--flap-rails takes testbed rail indices such as 1 or 1,2, not {text!r}")
        if int(item) in out:
            raise UsageError(f"--flap-rails lists rail {item} twice")
        out.append(int(item))
    return out


def default_flap_rails(n_rails: int) -> list[int]:
    """Every rail but rail 0, one at a time (rail 0 stays up); rail 0 when it is the only one."""
    return list(range(1, n_rails)) or [0]


CHAOS_ONLY = ("chaos_duration", "flap_down_s", "flap_up_s", "flap_rails", "chaos_sizes", "flap_how")
HOWS = ("link", "blackhole")


def options_from_args(args: argparse.Namespace) -> ChaosOptions:
    """Validate the `bench local` flags of a chaos run (UsageError: exit 2)."""
    if not args.testbed:
        raise UsageError("--chaos needs --testbed [NAME]: it takes the testbed's rail links down and up "
                         "(create one with `multirail testbed up --name mrtb --rails 2 --rate 1gbit`)")
    if os.geteuid() != 0:
        raise UsageError("--chaos needs root: it sets testbed links down and up (ip link) in network namespaces")
    if args.baseline:
        raise UsageError("--baseline cannot be combined with --chaos")
    if args.rails:
        raise UsageError("--chaos uses every rail of the testbed; choose the ones that flap with --flap-rails")
    opts = ChaosOptions(
        testbed=args.testbed, op=args.op,
        sizes=parse_sizes(args.chaos_sizes or DEFAULT_SIZES),
        duration_s=DEFAULT_DURATION_S if args.chaos_duration is None else args.chaos_duration,
        down_s=DEFAULT_DOWN_S if args.flap_down_s is None else args.flap_down_s,
        up_s=DEFAULT_UP_S if args.flap_up_s is None else args.flap_up_s,
        flap_rails=parse_rail_list(args.flap_rails) if args.flap_rails else None,
        how=args.flap_how or "link", connections=args.connections, policy=args.policy, chunk_size=args.chunk_size,
        stall_timeout=args.stall_timeout, timeout=args.timeout, secret=args.secret,
        transport=str(getattr(args, "transport", "auto")).replace(" ", ""))
    check(opts)
    return opts


def check(opts: ChaosOptions) -> None:
    if opts.op not in ("READ", "WRITE", "MIXED"):
        raise UsageError(f"--op must be READ, WRITE or MIXED, not {opts.op!r}")
    if opts.how not in HOWS:
        raise UsageError(f"--flap-how must be link or blackhole, not {opts.how!r}")
    if opts.down_s <= 0 or opts.up_s <= 0:
        raise UsageError("--flap-down-s and --flap-up-s must be positive")
    if opts.duration_s < opts.up_s / 2 + opts.down_s:
        raise UsageError(f"--chaos-duration {opts.duration_s:g} s leaves no room for one flap "
                         f"(needs at least --flap-up-s/2 + --flap-down-s = {opts.up_s / 2 + opts.down_s:g} s)")
    if opts.timeout <= 0 or opts.stall_timeout <= 0 or opts.connections < 1:
        raise UsageError("--timeout and --stall-timeout must be positive, --connections at least 1")
    if not opts.transport or any(k not in ("tcp", "ucx", "auto") for k in str(opts.transport).split(",")):
        raise UsageError(f"--transport must be tcp, ucx, auto or one per rail (ucx,tcp), not {opts.transport!r}")
    parse_size(opts.chunk_size)


def run_chaos(tb: Any, opts: ChaosOptions, sampler: Any = None, keep_samples: bool = False) -> dict[str, Any]:
    """Run the flap drill on testbed `tb` (a multirail.testbed.Testbed); return the result
    document (with "problems" and "ok"). `sampler`: a procstat.ProcSampler (one is made when
    None). Raises DrillError when the drill cannot run at all."""
    from multirail.bench.drill import run_drill
    from multirail.bench.procstat import ProcSampler

    check(opts)
    n_rails = len(tb.addrs("a"))
    rails = opts.flap_rails if opts.flap_rails is not None else default_flap_rails(n_rails)
    bad = [r for r in rails if not 0 <= r < n_rails]
    if bad:
        raise UsageError(f"--flap-rails {bad} not on testbed {tb.name!r} (rails 0..{n_rails - 1})")
    spec = {"mode": "flap", "op": opts.op, "size": opts.buffer_size(), "sizes": opts.sizes,
            "duration_s": opts.duration_s, "flap_rails": rails, "how": opts.how, "down_s": opts.down_s, "up_s": opts.up_s,
            "stall_timeout": opts.stall_timeout, "connections": opts.connections,
            "chunk_size": opts.chunk_size, "policy": opts.policy, "timeout": opts.timeout,
            "lost_after_s": opts.lost_after_s(), "transport": opts.transport}
    env = {**os.environ, "MULTIRAIL_SECRET": opts.secret} if opts.secret else None  # off the command line
    sampler = sampler or ProcSampler(opts.sample_s)
    limit = opts.duration_s + 3 * opts.lost_after_s() + 90.0
    try:
        out = run_drill(tb, spec, timeout=limit, env=env, sampler=sampler)
    finally:  # the initiator may have died mid-flap: give the testbed back with every rail up
        restore(tb, rails, opts.how)
    doc: dict[str, Any] = {"chaos": "rail-flap", "testbed": tb.name, "n_rails": n_rails, "op": opts.op, **out}
    doc["resources"] = sampler.to_json(with_samples=keep_samples)
    doc["config"] = opts.config()
    doc["problems"] = verdict(doc)
    doc["ok"] = not doc["problems"]
    return doc


def restore(tb: Any, rails: list[int], how: str) -> None:
    """Every flapped rail up again (idempotent); problems here must not hide the run's result."""
    for r in rails:
        try:
            if how == "blackhole":
                tb.set_blackhole(r, False)
            else:
                tb.set_link(r, True)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            print(f"multirail bench: warning: could not bring rail {r} back up: {e}", file=sys.stderr)


def verdict(doc: dict[str, Any]) -> list[str]:
    """Why the run failed (empty: it passed)."""
    p: list[str] = []
    if doc["bytes_corrupted"] or doc["corrupt_transfers"]:
        p.append(f"{doc['bytes_corrupted']} bytes corrupted in {doc['corrupt_transfers']} transfer(s): "
                 + "; ".join(doc["corrupt_details"][:3]))
    if doc["lost"]:
        p.append(f"{doc['lost']} transfer(s) lost (neither completed nor failed within {doc['lost_after_s']:g} s)")
    if doc["failed_with_rail_up"]:
        p.append(f"{doc['failed_with_rail_up']} transfer(s) failed while a rail was up: "
                 + "; ".join(doc["failures"][:3]))
    if doc["unverified"]:
        p.append(f"{doc['unverified']} WRITE(s) not verified: " + "; ".join(doc["unverified_details"][:2]))
    if doc["flap_error"]:
        p.append("flapping failed: " + "; ".join(doc["flap_error"]))
    if not doc["flaps"]:
        p.append("no flap happened")
    if not doc["completed"]:
        p.append("no transfer completed")
    for f in doc.get("final_transfers", []):
        if not f["ok"] or f["corrupt"]:
            p.append(f"after the last flap a {f['op']} of {format_size(f['size'])} was not clean: "
                     f"{f['error'] or f['corrupt']}")
    if doc.get("readmit_after_last_flap_s") is None:
        p.append("a flapped rail was not readmitted within 10 s of the last flap")
    return p


def _s(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f} s"


def _bytes(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.2f} {unit}"
    return f"{n} B"


def format_summary(doc: dict[str, Any]) -> str:
    rails = ",".join(str(r) for r in doc["flap_rails"])
    lines = [
        f"chaos rail-flap on testbed {doc['testbed']} ({doc['n_rails']} rail{'s' if doc['n_rails'] != 1 else ''}): {doc['op']} "
        f"{'/'.join(format_size(s) for s in doc['sizes'])}, {doc['duration_s']:g} s, rail(s) {rails} "
        f"{'down' if doc['how'] == 'link' else 'blackholed'} {doc['down_s']:g} s / up {doc['up_s']:g} s",
        f"  flaps done        {doc['flaps']}",
        f"  transfers         {doc['transfers']}: completed {doc['completed']}, failed {doc['failed']} "
        f"({doc['failed_no_rail_up']} while no rail was up, {doc['failed_with_rail_up']} with a rail up), "
        f"lost {doc['lost']}",
        f"  bytes moved       {_bytes(doc['bytes_moved'])} ({doc['gbps_overall']:.2f} Gbps while transferring)",
        f"  bytes corrupted   {doc['bytes_corrupted']} (in {doc['corrupt_transfers']} transfers)",
    ]
    for op, t in doc["by_op"].items():
        lines.append(f"    {op:<6} {t['completed']} completed, {t['failed']} failed, {t['lost']} lost, "
                     f"{_bytes(t['bytes_moved'])}, {t['bytes_corrupted']} bytes corrupted")
    for r in doc["per_rail"]:
        lines.append(f"  rail {r['rail']}: {r['flaps']} flaps; down detected after median {_s(r['detect_median_s'])} "
                     f"(max {_s(r['detect_max_s'])}, {r['undetected']} not detected while down); readmitted after "
                     f"median {_s(r['readmit_median_s'])} (max {_s(r['readmit_max_s'])})")
    for name, proc in doc.get("resources", {}).get("processes", {}).items():
        m = proc.get("max")
        if m:  # peaks (the first sample is the process starting, the last may be it closing)
            lines.append(f"  {name:<9} pid {proc['pid']}: peak RSS {m['rss_kib'] / 1024:.1f} MiB, fds {m['fds']}, "
                         f"threads {m['threads']} ({proc['n']} samples; benchmarks/soak.py checks growth)")
    lines.append("  result            " + ("OK" if doc["ok"] else "FAILED: " + " | ".join(doc["problems"])))
    return "\n".join(lines)


def cmd_chaos(opts: ChaosOptions, json_path: str | None) -> int:
    """`bench local --chaos`: run, print the summary, write JSON; 0 when the run passed."""
    from multirail.bench.drill import DrillError
    from multirail.bench.worker import BenchFailure
    from multirail.testbed import Testbed, TestbedError

    try:
        tb = Testbed.load(opts.testbed)
    except TestbedError as e:
        raise BenchFailure(str(e)) from None
    if tb is None:
        raise BenchFailure(f"testbed {opts.testbed!r} is not recorded")
    try:
        doc = run_chaos(tb, opts)
    except DrillError as e:
        raise BenchFailure(f"chaos run failed: {e}") from None
    text_out = sys.stderr if json_path == "-" else sys.stdout
    print(format_summary(doc), file=text_out, flush=True)
    if json_path:
        from multirail.bench.core import write_json

        write_json(doc, json_path)
    if not doc["ok"]:
        print("multirail bench: chaos run FAILED: " + " | ".join(doc["problems"]), file=sys.stderr)
        return 1
    return 0
