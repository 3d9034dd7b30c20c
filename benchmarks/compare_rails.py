#!/usr/bin/env python3
"""Compare what the testbed's rails carry: iperf3 per rail, iperf3 on all rails, MPTCP, multirail.

Run as root, e.g. ``python3 benchmarks/compare_rails.py --rails 2 --rate 2gbit``. In one go, on
one testbed (python/multirail/testbed.py; brought up here unless one with the same spec is
already up, and then left as it was):

1. iperf3 on each rail alone, one after the other: server in namespace a bound to the rail's
   address, client in namespace b bound to its own; this is each rail's capacity.
2. iperf3 on all rails at once, one stream per rail: the rails' summed capacity.
3. MPTCP, one connection with one subflow per rail: the server (``mptcpize run iperf3 -s``)
   listens on 0.0.0.0 in namespace a, which announces rails 1..N-1 (``ip mptcp endpoint add
   ... signal``); the client connects to rail 0's address.
4. multirail: ``multirail bench target`` in namespace a and ``multirail bench initiator`` in
   namespace b, 64 MiB blocks, READ and WRITE; reported as skipped when the engine extension
   (``multirail._core``) is not built.

Steps 1-3 send from b to a (the WRITE direction); multirail READ moves data from a to b.
Every row also shows how the bytes split over the rails, from the receiving side's per-device
counters (``ip -s link``), so a method that quietly used one rail is visible.

Output: one markdown table with Gbps, % of the summed nominal rail rates (for a single-rail
row: of that rail's rate) and % of the summed per-rail iperf3 results; ``--json FILE`` also
writes everything as JSON. Every server is started by this script, bounded in time and killed
by PID in a ``finally``; every client runs under a timeout.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
try:
    import multirail.testbed as tbm
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(REPO / "python"))
    import multirail.testbed as tbm

Testbed = tbm.Testbed

BASE_PORT = 5201
MR_PORT = 7800
SERVER_READY_S = 10.0
SLACK_S = 20.0


@dataclasses.dataclass
class Row:
    """One line of the table."""

    method: str
    op: str
    gbps: float | None
    nominal_bps: int | None  # reference rate for "% of nominal" (None: unshaped)
    rail_share: list[float] = dataclasses.field(default_factory=list)
    note: str = ""
    pct_nominal: float | None = None
    pct_iperf3: float | None = None


# --------------------------------------------------------------------------- process helpers


def _env() -> dict[str, str]:
    """The environment of every child: this repository's python/ on PYTHONPATH, after any the
    caller set (so an A/B run can put another build's package first)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{path + os.pathsep if path else ''}{REPO / 'python'}"}


def run(argv: Sequence[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command to completion under a timeout."""
    cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=_env())
    if check and cp.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({cp.returncode}): {(cp.stderr or cp.stdout).strip()[-400:]}")
    return cp


class Servers:
    """Background processes started by this script; `stop` kills each by PID."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: Sequence[str], stdout: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
        p = subprocess.Popen(list(argv), stdout=stdout, stderr=subprocess.PIPE, text=True, env=_env())
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
                print(f"warning: PID {p.pid} did not exit after SIGKILL", file=sys.stderr)
        self.procs.clear()


def wait_listening(tb: Testbed, port: int, proc: subprocess.Popen[str]) -> None:
    """Wait until something listens on `port` in namespace a (or the server died)."""
    deadline = time.monotonic() + SERVER_READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early ({proc.returncode}): {proc.stderr.read()[-400:] if proc.stderr else ''}")
        if run(tb.exec_argv("a", ["ss", "-Htln", f"sport = :{port}"]), timeout=10).stdout.strip():
            return
        time.sleep(0.05)
    raise RuntimeError(f"no server listening on port {port} after {SERVER_READY_S:.0f}s")


def rx_bytes(tb: Testbed, side: str) -> list[int]:
    """Bytes received so far on each rail's device on `side`."""
    links = {l["ifname"]: l for l in json.loads(run(["ip", "-n", tb.ns(side), "-s", "-j", "link", "show"], 10).stdout)}
    return [int(links.get(r.devs[side], {}).get("stats64", {}).get("rx", {}).get("bytes", 0)) for r in tb.rails]


def measured(tb: Testbed, receiver: str, fn: Callable[[], float]) -> tuple[float, list[float]]:
    """Run `fn` (returns bit/s) and the split of received bytes over the rails, in %."""
    before = rx_bytes(tb, receiver)
    bps = fn()
    delta = [after - b for after, b in zip(rx_bytes(tb, receiver), before)]
    total = sum(delta) or 1
    return bps, [100.0 * d / total for d in delta]


# --------------------------------------------------------------------------- iperf3 and MPTCP


def _iperf3_received_bps(out: str) -> float:
    doc = json.loads(out)
    if "error" in doc:
        raise RuntimeError(f"iperf3: {doc['error']}")
    return float(doc["end"]["sum_received"]["bits_per_second"])


def iperf3_each(tb: Testbed, rails: list[int], seconds: int, mptcp: bool = False,
                reverse: bool = False) -> list[float]:
    """Goodput of one iperf3 stream per listed rail, all at once, one figure per rail (b -> a;
    a -> b with `reverse`, iperf3's -R: the direction of the engine's READ, where the target in
    namespace a sends).

    With `mptcp`, there is a single connection to rail 0 (server on 0.0.0.0) and the kernel
    adds the other rails as subflows."""
    wrap = ["mptcpize", "run"] if mptcp else []
    rev = ["-R"] if reverse else []
    servers = Servers()
    try:
        clients = []
        for k, i in enumerate(rails):
            port = BASE_PORT + k
            a, b = tb.rails[i].addrs["a"], tb.rails[i].addrs["b"]
            bind = [] if mptcp else ["-B", a]
            srv = servers.start(tb.exec_argv("a", [*wrap, "iperf3", "-s", "-1", "-p", str(port), *bind]))
            wait_listening(tb, port, srv)
            client_bind = [] if mptcp else ["-B", b]
            clients.append(servers.start(tb.exec_argv("b", [*wrap, "iperf3", "-c", a, "-p", str(port), *client_bind,
                                                            "-t", str(seconds), "-J", *rev]), stdout=subprocess.PIPE))
        each = []
        for c in clients:
            out, err = c.communicate(timeout=seconds + SLACK_S)
            if c.returncode != 0:
                raise RuntimeError(f"iperf3 client failed ({c.returncode}): {(err or out)[-400:]}")
            each.append(_iperf3_received_bps(out))
        return each
    finally:
        servers.stop()


def iperf3_rails(tb: Testbed, rails: list[int], seconds: int, mptcp: bool = False) -> float:
    """Summed goodput of one iperf3 stream per listed rail, all at once (b -> a)."""
    return sum(iperf3_each(tb, rails, seconds, mptcp))


def mptcp_setup(tb: Testbed) -> None:
    """Announce rails 1..N-1 from the server side; allow N-1 subflows on both sides."""
    n = tb.n_rails
    for side in ("a", "b"):
        run(["ip", "-n", tb.ns(side), "mptcp", "endpoint", "flush"], 10)
        run(["ip", "-n", tb.ns(side), "mptcp", "limits", "set", "subflows", str(n), "add_addr_accepted", str(n)], 10)
    for r in tb.rails[1:]:
        run(["ip", "-n", tb.ns("a"), "mptcp", "endpoint", "add", r.addrs["a"], "dev", r.devs["a"],
             "id", str(r.index), "signal"], 10)


def mptcp_teardown(tb: Testbed) -> None:
    for side in ("a", "b"):
        run(["ip", "-n", tb.ns(side), "mptcp", "endpoint", "flush"], 10, check=False)


# --------------------------------------------------------------------------- multirail


def engine_built() -> tuple[bool, str]:
    cp = run([sys.executable, "-c", "import multirail._core"], 60, check=False)
    return cp.returncode == 0, (cp.stderr.strip().splitlines() or [""])[-1]


def multirail_op(tb: Testbed, op: str, num_iter: int, warmup_iter: int, timeout_s: float) -> float:
    """One `multirail bench` run over every rail: target in a, initiator in b; bit/s of 64 MiB blocks."""
    a_addrs, b_addrs = ",".join(tb.addrs("a")), ",".join(tb.addrs("b"))
    listen = f"{tb.addrs('a')[0]}:{MR_PORT}"
    mr = [sys.executable, "-m", "multirail", "bench"]
    servers = Servers()
    with tempfile.TemporaryDirectory(prefix="compare-rails-") as tmp:
        out_json = Path(tmp) / "bench.json"
        try:
            target = servers.start(tb.exec_argv("a", [*mr, "target", "--listen", listen, "--rails", a_addrs,
                                                      "--duration", str(int(timeout_s)), "--idle-timeout", "60"]),
                                   stdout=subprocess.PIPE)
            wait_listening(tb, MR_PORT, target)
            cp = run(tb.exec_argv("b", [*mr, "initiator", "--connect", listen, "--rails", b_addrs, "--op", op,
                                        "--start-block-size", "64MiB", "--max-block-size", "64MiB",
                                        "--num-iter", str(num_iter), "--warmup-iter", str(warmup_iter),
                                        "--json", str(out_json)]), timeout=timeout_s, check=False)
            if cp.returncode != 0:
                raise RuntimeError(f"multirail bench initiator failed ({cp.returncode}): {cp.stderr.strip()[-400:]}")
            rows = json.loads(out_json.read_text())["rows"]
            return float(rows[0]["gbps"]) * 1e9
        finally:
            servers.stop()


# --------------------------------------------------------------------------- driver


def _pct(value: float | None, ref: float | None) -> float | None:
    return None if value is None or not ref else 100.0 * value / ref


def _attempt(rows: list[Row], tb: Testbed, method: str, op: str, nominal: int | None, receiver: str,
             fn: Callable[[], float]) -> None:
    """Append a row for `fn`'s result (bit/s; bytes counted on `receiver`'s rails), or a row
    saying why it failed (the other steps still run)."""
    try:
        bps, share = measured(tb, receiver, fn)
        rows.append(Row(method, op, bps / 1e9, nominal, share))
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
        rows.append(Row(method, op, None, nominal, note=f"failed: {e}"))


def compare(tb: Testbed, seconds: int, ops: list[str], num_iter: int, warmup_iter: int,
            skip_mptcp: bool, skip_multirail: bool) -> list[Row]:
    rows: list[Row] = []
    nominal_sum = None if any(r is None for r in tb.rates) else sum(r for r in tb.rates if r is not None)
    for r in tb.rails:
        _attempt(rows, tb, f"iperf3 rail {r.index} alone", "b->a", r.rate_bps, "a",
                 functools.partial(iperf3_rails, tb, [r.index], seconds))
    per_rail = [row.gbps for row in rows]
    per_rail_sum = None if any(g is None for g in per_rail) else sum(g for g in per_rail if g is not None) * 1e9
    for row in rows:
        row.pct_iperf3 = 100.0 if row.gbps is not None else None
    _attempt(rows, tb, "iperf3 all rails (1 stream/rail)", "b->a", nominal_sum, "a",
             functools.partial(iperf3_rails, tb, list(range(tb.n_rails)), seconds))
    if skip_mptcp:
        rows.append(Row("MPTCP (1 subflow/rail)", "b->a", None, nominal_sum, note="skipped (--skip-mptcp)"))
    else:
        try:
            mptcp_setup(tb)
            _attempt(rows, tb, "MPTCP (1 subflow/rail)", "b->a", nominal_sum, "a",
                     functools.partial(iperf3_rails, tb, [0], seconds, mptcp=True))
        finally:
            mptcp_teardown(tb)
    built, why = (False, "") if skip_multirail else engine_built()
    for op in ops:
        method = "multirail (64 MiB blocks)"
        if skip_multirail:
            rows.append(Row(method, op, None, nominal_sum, note="skipped (--skip-multirail)"))
        elif not built:
            rows.append(Row(method, op, None, nominal_sum, note=f"skipped: engine not built ({why})"))
        else:
            receiver = "b" if op == "READ" else "a"
            _attempt(rows, tb, method, f"{op} ({'a->b' if op == 'READ' else 'b->a'})", nominal_sum, receiver,
                     functools.partial(multirail_op, tb, op, num_iter, warmup_iter, 120 + 2.0 * num_iter))
    for row in rows[len(per_rail):]:
        row.pct_iperf3 = _pct(row.gbps and row.gbps * 1e9, per_rail_sum)
    for row in rows:
        row.pct_nominal = _pct(row.gbps and row.gbps * 1e9, row.nominal_bps)
    return rows


def markdown(rows: list[Row]) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = ["| method | op | Gbps | % of nominal | % of per-rail iperf3 sum | rail split (% of bytes) | note |",
             "|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        split = "/".join(f"{s:.0f}" for s in r.rail_share) if r.rail_share else "-"
        lines.append(f"| {r.method} | {r.op} | {f(r.gbps, '.3f')} | {f(r.pct_nominal, '.1f')} | "
                     f"{f(r.pct_iperf3, '.1f')} | {split} | {r.note} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Needs root, iperf3, and mptcpize (Debian package mptcpd) for the MPTCP row.")
    p.add_argument("--name", default="mrcmp", help="testbed name (default mrcmp)")
    p.add_argument("--rails", type=int, default=None, help="number of rails (default 2)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rate", default="2gbit", help="rate of every rail (default 2gbit; 'none' = unshaped)")
    g.add_argument("--rates", default=None, help="comma-separated rate per rail, e.g. 2gbit,1gbit")
    p.add_argument("--time", type=int, default=5, help="seconds per iperf3/MPTCP run (default 5)")
    p.add_argument("--ops", default="READ,WRITE", help="multirail ops (default READ,WRITE)")
    p.add_argument("--num-iter", type=int, default=20, help="multirail timed iterations of 64 MiB (default 20)")
    p.add_argument("--warmup-iter", type=int, default=2, help="multirail warm-up iterations (default 2)")
    p.add_argument("--skip-mptcp", action="store_true")
    p.add_argument("--skip-multirail", action="store_true")
    p.add_argument("--keep", action="store_true", help="leave the testbed up afterwards")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-' for stdout)")
    args = p.parse_args(argv)
    if not 1 <= args.time <= 120:
        p.error("--time must be between 1 and 120 s")
    if not 1 <= args.num_iter <= 1000 or not 0 <= args.warmup_iter <= 100:
        p.error("--num-iter must be 1..1000 and --warmup-iter 0..100")
    ops = [o.strip().upper() for o in args.ops.split(",") if o.strip()]
    if not ops or any(o not in ("READ", "WRITE") for o in ops):
        p.error("--ops takes READ, WRITE or READ,WRITE")
    args.ops = ops
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tbm.require_root()
        if args.rates is not None:
            tb = Testbed(args.name, rails=args.rails, rates=args.rates.split(","))
        else:
            tb = Testbed(args.name, rails=args.rails, rate=args.rate)
        missing = [t for t in ("iperf3", "ss") if not _which(t)] + ([] if args.skip_mptcp or _which("mptcpize")
                                                                    else ["mptcpize (use --skip-mptcp)"])
        if missing:
            raise tbm.TestbedError(f"missing tools: {', '.join(missing)}")
        action = tb.up()
    except tbm.TestbedPermissionError as e:
        print(f"compare_rails: {e}", file=sys.stderr)
        return 2
    except tbm.TestbedError as e:
        print(f"compare_rails: error: {e}", file=sys.stderr)
        return 1
    try:
        print(f"testbed {tb.name}: {action}; rails: {', '.join(tbm.format_rate(r) for r in tb.rates)}", file=sys.stderr)
        rows = compare(tb, args.time, args.ops, args.num_iter, args.warmup_iter, args.skip_mptcp, args.skip_multirail)
    finally:
        if action != "unchanged" and not args.keep:
            tb.down()
    title = (f"{tb.n_rails} rails ({', '.join(tbm.format_rate(r) for r in tb.rates)}), MTU {tb.mtu}, "
             f"iperf3/MPTCP -t {args.time}")
    print(f"{title}\n\n{markdown(rows)}")
    if args.json:
        doc = {"testbed": {"name": tb.name, "rails": tb.n_rails, "rates_bps": tb.rates, "mtu": tb.mtu},
               "seconds": args.time, "rows": [dataclasses.asdict(r) for r in rows]}
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    failed = [r for r in rows if r.note.startswith("failed")]
    return 1 if failed else 0


def _which(tool: str) -> bool:
    return shutil.which(tool) is not None


if __name__ == "__main__":
    sys.exit(main())
