#!/usr/bin/env python3
"""Many peers on one testbed: fan-in N -> 1, fan-out 1 -> M, and idle peers on one target.

Run as root, e.g. ``python3 benchmarks/fan_in.py --name mrfan --rails 2 --rate 2gbit``
(``--fan-in 32,8 --fan-out 4 --idle 64``). On one testbed (python/multirail/testbed.py;
brought up here unless one with the same spec is up, and then left as it was):

1. each rail's capacity: iperf3 alone on that rail (b -> a, one stream), summed; measured
   before and after the engine runs, and the mean of the two is the reference.
2. **fan-in N -> 1**: one target process in namespace a (one agent, one registered buffer,
   every rail) and N initiator processes in namespace b, each its own agent over every rail,
   each WRITEs ``--block`` (4 MiB) at a time, back to back, during one common window of
   ``--seconds`` (all start at the same wall-clock instant, after every one has connected and
   warmed up). A transfer that straddles an end of the window counts pro rata. Reported: the
   aggregate (sum over initiators / window) against the iperf3 sum, Jain's fairness index
   over the initiators' rates, and the initiators' rail counters (stalls, times down,
   readmissions).
3. **fan-out 1 -> M**: M target processes in namespace a, one initiator process in b with one
   thread per target, each READing ``--block`` at a time from its target during the window;
   Jain's index over the targets.
4. **idle peers**: one target process and ``--idle`` initiator agents (``--idle-per-proc`` per
   process) that connect every rail to it and then do nothing. The target's threads, open file
   descriptors and RSS before and after they connected, and its CPU over ``--idle-seconds``
   while they sit idle (from /proc).

Every process is started by this script, bounded in time (each exits by itself after its
window) and killed by PID in a ``finally``. ``--json FILE`` writes everything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PORT_BASE = 7900
WARMUP_S = 1.0


def _load_cr() -> Any:
    spec = importlib.util.spec_from_file_location("compare_rails", HERE / "compare_rails.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compare_rails"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def jain(xs: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2); 1 when all are equal."""
    s2 = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * s2) if s2 > 0 else 0.0


def proc_usage(pid: int) -> dict[str, Any]:
    """Threads, open fds, RSS (bytes) and CPU seconds (user + system) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return {"threads": int(fields["Threads"].strip()), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss": int(fields["VmRSS"].split()[0]) * 1024, "cpu_s": (int(stat[11]) + int(stat[12])) / tick}


# --------------------------------------------------------------------------- in-namespace roles


def _agent(name: str, rails: list[str], port: int = 0, stall_timeout: float | None = None,
           fan_in_window: str = "auto") -> Any:
    import multirail

    kw: dict[str, Any] = {} if stall_timeout is None else {"stall_timeout": stall_timeout}
    kw["fan_in_window"] = int(fan_in_window) if fan_in_window.isdigit() else fan_in_window
    return multirail.Agent(name, multirail.AgentConfig(host=rails[0], port=port, rails=rails, timeout=30.0, **kw))


def role_target(a: argparse.Namespace) -> int:
    """Serve one buffer until the deadline; print a ready line with its address."""
    import numpy as np

    agent = _agent(a.agent_name, a.rails.split(","), a.port, fan_in_window=a.fan_in_window)
    buf = np.zeros(a.buffer, dtype=np.uint8)
    reg = agent.register_memory(buf)
    print(json.dumps({"event": "ready", "pid": os.getpid(), "addr": int(buf.ctypes.data), "len": a.buffer}), flush=True)
    try:
        time.sleep(max(0.0, a.until - time.time()))
    finally:
        agent.deregister_memory(reg)
        agent.close()
    return 0


class Mover:
    """One peer's transfer loop: `op` of `block` bytes at `remote_addr`, back to back."""

    def __init__(self, agent: Any, peer: str, host: str, port: int, op: str, block: int, remote_addr: int,
                 dev: int = 0) -> None:
        import numpy as np

        self.agent, self.peer, self.block = agent, peer, block
        self.buf = np.ones(block, dtype=np.uint8)
        self.reg = agent.register_memory(self.buf)
        agent.fetch_remote_metadata(peer, host, port)
        deadline = time.monotonic() + 30
        while not agent.check_remote_metadata(peer):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no metadata from {peer}")
            time.sleep(0.01)
        local = np.array([[self.buf.ctypes.data, block, 0]], dtype=np.uint64)
        remote = np.array([[remote_addr, block, dev]], dtype=np.uint64)
        self.h = agent.initialize_xfer(op, agent.get_xfer_descs(local), agent.get_xfer_descs(remote), peer)
        self.done: list[tuple[float, float]] = []  # (post, completion) wall-clock times
        self.error: str | None = None

    def run(self, go: Path) -> None:
        """Warm up until the driver writes the window into `go`, then move back to back until
        its end (every transfer recorded)."""
        try:
            while not go.exists():
                self.agent.transfer_sync(self.h, timeout=30)
            while True:
                try:
                    self.t0, self.t1 = json.loads(go.read_text())
                    t1 = self.t1
                    break
                except ValueError:  # being written
                    time.sleep(0.01)
            while time.time() < self.t0:
                self.agent.transfer_sync(self.h, timeout=30)
            while True:
                s = time.time()
                if s >= t1:
                    break
                self.agent.transfer_sync(self.h, timeout=30)
                self.done.append((s, time.time()))
        except Exception as e:  # noqa: BLE001 - reported, not raised
            self.error = f"{type(e).__name__}: {e}"

    def bytes_in(self, t0: float, t1: float) -> float:
        """Bytes moved inside [t0, t1], a straddling transfer pro rata."""
        total = 0.0
        for s, e in self.done:
            overlap = min(e, t1) - max(s, t0)
            if overlap > 0:
                total += self.block * overlap / max(e - s, 1e-9)
        return total

    def report(self, t0: float, t1: float) -> dict[str, Any]:
        stats = self.agent.rail_stats(self.peer)
        lat = sorted(e - s for s, e in self.done)
        return {"bytes": self.bytes_in(t0, t1), "transfers": len(self.done), "error": self.error,
                "p50_ms": 1e3 * lat[len(lat) // 2] if lat else None, "max_ms": 1e3 * lat[-1] if lat else None,
                "rails": [{k: r.get(k) for k in ("name", "bytes", "stalls", "times_down", "readmissions", "reissued",
                                                 "rate_gbps", "up", "last_down_reason")} for r in stats]}


def role_initiator(a: argparse.Namespace) -> int:
    """One agent, one Mover per target (a thread each); a JSON report per target on stdout."""
    agent = _agent(a.agent_name, a.rails.split(","), stall_timeout=a.stall_timeout)
    try:
        targets = [t.split("@") for t in a.targets.split(",")]  # name@host:port@addr
        movers = [Mover(agent, name, hp.rsplit(":", 1)[0], int(hp.rsplit(":", 1)[1]), a.op, a.block, int(addr))
                  for name, hp, addr in targets]
        print(json.dumps({"event": "ready"}), flush=True)
        threads = [threading.Thread(target=m.run, args=(Path(a.go),)) for m in movers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # The window as each mover read it when it opened (the driver's file is not read
        # again: the run must not depend on a temp file surviving to the end).
        t0, t1 = next(((m.t0, m.t1) for m in movers if hasattr(m, "t1")), (0.0, 0.0))
        print(json.dumps({"event": "report", "peers": [m.report(t0, t1) for m in movers]}), flush=True)
    finally:
        agent.close()
    return 0


def role_idle(a: argparse.Namespace) -> int:
    """`--count` agents that connect every rail to the target, then sit idle until the deadline."""
    agents = []
    try:
        host, port = a.target_hp.rsplit(":", 1)
        for k in range(a.count):
            ag = _agent(f"{a.agent_name}-{k}", a.rails.split(","))
            agents.append(ag)
            ag.fetch_remote_metadata(a.target, host, int(port))
            deadline = time.monotonic() + 30
            while not ag.check_remote_metadata(a.target):
                if time.monotonic() > deadline:
                    raise RuntimeError("no metadata from the target")
                time.sleep(0.01)
            ag.make_connection(a.target)
        print(json.dumps({"event": "ready", "agents": len(agents)}), flush=True)
        time.sleep(max(0.0, a.until - time.time()))
    finally:
        for ag in agents:
            ag.close()
    return 0


# --------------------------------------------------------------------------- driver


class Run:
    """Processes of one scenario, killed by PID at the end."""

    def __init__(self, cr: Any, tb: Any, fan_in_window: str = "auto") -> None:
        self.cr, self.tb, self.servers = cr, tb, cr.Servers()
        self.fan_in_window = fan_in_window

    def start(self, side: str, role: str, *args: str) -> subprocess.Popen[str]:
        argv = [sys.executable, str(Path(__file__).resolve()), role, *args]
        return self.servers.start(self.tb.exec_argv(side, argv), stdout=subprocess.PIPE)

    @staticmethod
    def line(p: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
        """The next JSON line of `p` (its ready or report line), within `timeout`."""
        assert p.stdout is not None
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not box or not box[0].strip():
            err = p.stderr.read()[-600:] if p.poll() is not None and p.stderr else ""
            raise RuntimeError(f"process {p.pid} gave no line within {timeout:.0f}s (rc {p.poll()}): {err}")
        return json.loads(box[0])

    def targets(self, n: int, buffer: int, until: float) -> list[str]:
        """Start n targets; their `name@host:port@addr` specs."""
        a_rails = ",".join(self.tb.addrs("a"))
        host = self.tb.addrs("a")[0]
        out = []
        procs = [self.start("a", "target", "--agent-name", f"fan-t{k}", "--rails", a_rails, "--port",
                            str(PORT_BASE + k), "--buffer", str(buffer), "--until", str(until),
                            "--fan-in-window", str(self.fan_in_window)) for k in range(n)]
        for k, p in enumerate(procs):
            ready = self.line(p, 60)
            out.append(f"fan-t{k}@{host}:{PORT_BASE + k}@{ready['addr']}")
        self.target_pids = [self.line_pid(p) for p in procs]
        return out

    @staticmethod
    def line_pid(p: subprocess.Popen[str]) -> int:
        """PID of the Python process inside `ip netns exec` (exec replaces it: the same PID)."""
        return p.pid

    def stop(self) -> None:
        self.servers.stop()


def movers(cr: Any, tb: Any, n_init: int, n_targets: int, op: str, block: int, seconds: float,
           stall_timeout: float, fan_in_window: str = "auto") -> dict[str, Any]:
    """N initiator processes x M targets (one of the two is 1), one common window."""
    import tempfile

    run = Run(cr, tb, fan_in_window)
    setup_s = 30.0 + 1.5 * n_init
    until = time.time() + setup_s + WARMUP_S + seconds + 60
    try:
        with tempfile.TemporaryDirectory(prefix="mr-fan-") as tmp:
            go = Path(tmp) / "go.json"
            specs = run.targets(n_targets, block * max(1, min(n_init, 8)), until)
            b_rails = ",".join(tb.addrs("b"))
            procs = []
            for i in range(n_init):
                # Initiators of a fan-in write into one of 8 slots of the target's buffer (their
                # data is not checked; the slots only keep the buffer small).
                tspecs = [f"{s.rsplit('@', 1)[0]}@{int(s.rsplit('@', 1)[1]) + block * (i % 8)}" for s in specs]
                procs.append(run.start("b", "initiator", "--agent-name", f"fan-i{i}", "--rails", b_rails,
                                       "--targets", ",".join(tspecs), "--op", op, "--block", str(block),
                                       "--go", str(go), "--stall-timeout", str(stall_timeout)))
            for p in procs:
                run.line(p, setup_s)
            # Everyone is connected and moving: the window opens after a warm-up under full load.
            t0 = time.time() + WARMUP_S
            t1 = t0 + seconds
            tmp_go = go.with_suffix(".tmp")
            tmp_go.write_text(json.dumps([t0, t1]))
            tmp_go.rename(go)
            time.sleep(max(0.0, t0 - time.time()))
            rx0 = cr.rx_bytes(tb, "a" if op == "WRITE" else "b")
            time.sleep(max(0.0, t1 - time.time()))
            rx1 = cr.rx_bytes(tb, "a" if op == "WRITE" else "b")
            peers = []
            for p in procs:
                peers.extend(run.line(p, 90)["peers"])
            for p in procs:
                p.wait(timeout=30)
    finally:
        run.stop()
    rates = [8 * p["bytes"] / seconds for p in peers]
    return {"initiators": n_init, "targets": n_targets, "op": op, "block": block, "seconds": seconds,
            "aggregate_bps": sum(rates), "wire_bps": 8 * sum(b - a for a, b in zip(rx0, rx1)) / seconds,
            "jain": jain(rates), "min_bps": min(rates), "max_bps": max(rates),
            "stalls": sum(r["stalls"] or 0 for p in peers for r in p["rails"]),
            "times_down": sum(r["times_down"] or 0 for p in peers for r in p["rails"]),
            "readmissions": sum(r["readmissions"] or 0 for p in peers for r in p["rails"]),
            "errors": [p["error"] for p in peers if p["error"]],
            "max_latency_ms": max((p["max_ms"] or 0) for p in peers), "peers": peers}


def idle_peers(cr: Any, tb: Any, n: int, per_proc: int, seconds: float, fan_in_window: str = "auto") -> dict[str, Any]:
    run = Run(cr, tb, fan_in_window)
    until = time.time() + 120 + n + seconds
    try:
        specs = run.targets(1, 1 << 20, until)
        pid = run.target_pids[0]
        time.sleep(1.0)
        before = proc_usage(pid)
        host_port = specs[0].split("@")[1]
        b_rails = ",".join(tb.addrs("b"))
        procs = [run.start("b", "idle", "--agent-name", f"fan-idle{k}", "--rails", b_rails, "--target", "fan-t0",
                           "--target-hp", host_port, "--count", str(min(per_proc, n - k * per_proc)),
                           "--until", str(until))
                 for k in range((n + per_proc - 1) // per_proc)]
        for p in procs:
            run.line(p, 120)
        time.sleep(1.0)
        u0 = proc_usage(pid)
        t = time.monotonic()
        time.sleep(seconds)
        u1 = proc_usage(pid)
        cpu = (u1["cpu_s"] - u0["cpu_s"]) / (time.monotonic() - t)
    finally:
        run.stop()
    return {"peers": n, "rails": tb.n_rails, "before": before, "connected": u1, "idle_cpu_core_fraction": cpu,
            "per_peer": {k: (u1[k] - before[k]) / n for k in ("threads", "fds", "rss")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="role")
    t = sub.add_parser("target")
    for s in (t,):
        s.add_argument("--agent-name", required=True)
        s.add_argument("--rails", required=True)
        s.add_argument("--port", type=int, required=True)
        s.add_argument("--buffer", type=int, required=True)
        s.add_argument("--until", type=float, required=True)
        s.add_argument("--fan-in-window", default="auto")
    i = sub.add_parser("initiator")
    i.add_argument("--agent-name", required=True)
    i.add_argument("--rails", required=True)
    i.add_argument("--targets", required=True)
    i.add_argument("--op", default="WRITE")
    i.add_argument("--block", type=int, required=True)
    i.add_argument("--go", required=True, help="file the driver writes [t0, t1] into (wall clock)")
    i.add_argument("--stall-timeout", type=float, default=0.5)
    d = sub.add_parser("idle")
    d.add_argument("--agent-name", required=True)
    d.add_argument("--rails", required=True)
    d.add_argument("--target", required=True)
    d.add_argument("--target-hp", required=True)
    d.add_argument("--count", type=int, required=True)
    d.add_argument("--until", type=float, required=True)
    ap.add_argument("--name", default="mrfan")
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--rate", default="2gbit")
    ap.add_argument("--fan-in", default="32,8", help="initiator counts of the fan-in runs ('' for none)")
    ap.add_argument("--fan-out", default="4", help="target counts of the fan-out runs ('' for none)")
    ap.add_argument("--idle", type=int, default=64, help="idle peers (0: skip)")
    ap.add_argument("--idle-per-proc", type=int, default=8)
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument("--block", type=int, default=4 << 20)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--stall-timeout", type=float, default=0.5)
    ap.add_argument("--time", type=int, default=3, help="iperf3 seconds per rail")
    ap.add_argument("--fan-in-window", default="auto",
                    help="the targets' AgentConfig.fan_in_window: auto (default), off, or bytes per rail")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    if a.role and os.environ.get("MR_FAN_LOG_DIR"):
        # Debugging aid: each role's stderr (engine messages) into its own file.
        fd = os.open(os.path.join(os.environ["MR_FAN_LOG_DIR"], f"{a.agent_name}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
    if a.role == "target":
        return role_target(a)
    if a.role == "initiator":
        return role_initiator(a)
    if a.role == "idle":
        return role_idle(a)

    cr = _load_cr()
    tbm = cr.tbm
    try:
        tbm.require_root()
        tb = tbm.Testbed(a.name, rails=a.rails, rate=a.rate)
        action = tb.up()
    except tbm.TestbedError as e:
        print(f"fan_in: {e}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"rails": a.rails, "rate": a.rate, "fan_in_window": a.fan_in_window, "runs": []}
    try:
        cap0 = [cr.iperf3_rails(tb, [r], a.time) for r in range(tb.n_rails)]
        for n in [int(x) for x in a.fan_in.split(",") if x]:
            print(f"fan-in {n} -> 1 ...", file=sys.stderr, flush=True)
            results["runs"].append(movers(cr, tb, n, 1, "WRITE", a.block, a.seconds, a.stall_timeout,
                                           a.fan_in_window))
        for m in [int(x) for x in a.fan_out.split(",") if x]:
            print(f"fan-out 1 -> {m} ...", file=sys.stderr, flush=True)
            results["runs"].append(movers(cr, tb, 1, m, "READ", a.block, a.seconds, a.stall_timeout,
                                           a.fan_in_window))
        cap1 = [cr.iperf3_rails(tb, [r], a.time) for r in range(tb.n_rails)]
        if a.idle:
            print(f"{a.idle} idle peers ...", file=sys.stderr, flush=True)
            results["idle"] = idle_peers(cr, tb, a.idle, a.idle_per_proc, a.idle_seconds, a.fan_in_window)
    finally:
        if action != "unchanged":
            tb.down()
    cap = sum((x + y) / 2 for x, y in zip(cap0, cap1))
    results |= {"capacity_bps": cap, "capacity_before_bps": cap0, "capacity_after_bps": cap1}
    print(f"\n{a.rails} x {a.rate}; per-rail iperf3 sum (mean of before/after) {cap / 1e9:.3f} Gbps; "
          f"{a.block >> 20} MiB transfers back to back for {a.seconds:.0f} s; targets' fan_in_window "
          f"{a.fan_in_window}\n")
    print("| run | op | aggregate Gbps | % of iperf3 sum | wire % | Jain | min / max Gbps | stalls | times down "
          "| readmissions | slowest transfer ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        name = f"fan-in {r['initiators']} -> 1" if r["targets"] == 1 else f"fan-out 1 -> {r['targets']}"
        print(f"| {name} | {r['op']} | {r['aggregate_bps'] / 1e9:.3f} | {100 * r['aggregate_bps'] / cap:.1f}% | "
              f"{100 * r['wire_bps'] / cap:.1f}% | {r['jain']:.3f} | {r['min_bps'] / 1e9:.3f} / "
              f"{r['max_bps'] / 1e9:.3f} | {r['stalls']} | {r['times_down']} | {r['readmissions']} | "
              f"{r['max_latency_ms']:.0f} |")
        for e in r["errors"][:3]:
            print(f"  error: {e}")
    if "idle" in results:
        d = results["idle"]
        b, c = d["before"], d["connected"]
        print(f"\n{d['peers']} idle peers x {d['rails']} rails: target threads {b['threads']} -> {c['threads']}, "
              f"fds {b['fds']} -> {c['fds']}, RSS {b['rss'] / 2**20:.1f} -> {c['rss'] / 2**20:.1f} MiB, idle CPU "
              f"{100 * d['idle_cpu_core_fraction']:.2f}% of a core; per peer {d['per_peer']['threads']:.2f} threads, "
              f"{d['per_peer']['fds']:.2f} fds, {d['per_peer']['rss'] / 1024:.0f} KiB")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
