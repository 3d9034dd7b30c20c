#!/usr/bin/env python3
"""Context switches and syscalls per GB, both processes, for one multirail worker or iperf3
(issue 22 item 5: where a bulk transfer's CPU per byte goes besides the copies).

Starts the same fresh pair as benchmarks/cpu_per_byte.py (a `bench target` and an initiator
looping `transfer_sync` of one 64 MiB block, or an iperf3 server and client), and once the loop
runs attaches `perf stat` (root: syscall tracepoints) to each process for --seconds. GB is the
rate the initiator (or iperf3) reports times the window, so the counts per GB are approximate;
`perf` itself costs CPU, so the CPU per GB printed here reads high: compare CPU with
cpu_per_byte.py, and counts here between builds run alternately in the same minutes.

    .venv/bin/python benchmarks/cpu_wakeups.py --op READ [--progress adaptive] [--build DIR]
    .venv/bin/python benchmarks/cpu_wakeups.py --op READ --iperf3 [--len 128K]
    # where threads sleep (perf record of sched_switch, call graphs): --sched (reports in --out)

Prints one line per side: context switches, futex, poll, receive (recvfrom + readv) and writev
calls per GB. Every child is killed by PID on the way out.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_per_byte as cpb  # noqa: E402

SYSCALLS = "writev write read readv recvfrom sendto poll ppoll select pselect6 futex clock_nanosleep sched_yield".split()


def attach(pid: int, secs: float, out: Path, sched: bool) -> subprocess.Popen[bytes]:
    if sched:
        cmd = ["perf", "record", "-e", "sched:sched_switch", "-g", "-p", str(pid), "-o", str(out), "--", "sleep", str(secs)]
    else:
        ev = ",".join(f"syscalls:sys_enter_{n}" for n in SYSCALLS)
        cmd = ["perf", "stat", "-e", "task-clock,context-switches," + ev, "-p", str(pid), "-o", str(out), "--", "sleep", str(secs)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def counts(path: Path, gb: float) -> str:
    t = path.read_text()

    def g(name: str) -> int:
        m = re.search(r"([\d,]+)\s+" + re.escape(name) + r"\b", t)
        return int(m.group(1).replace(",", "")) if m else 0

    sc = lambda n: g(f"syscalls:sys_enter_{n}")  # noqa: E731
    return (f"cs/GB {g('context-switches') / gb:6.0f}  futex/GB {sc('futex') / gb:6.0f}  poll/GB {sc('poll') / gb:6.0f}  "
            f"recv/GB {(sc('recvfrom') + sc('readv') + sc('read')) / gb:6.0f}  writev/GB {(sc('writev') + sc('write')) / gb:6.0f}  "
            f"yield/GB {sc('sched_yield') / gb:5.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="READ", choices=["READ", "WRITE"])
    ap.add_argument("--progress", default="adaptive", choices=["adaptive", "block", "poll"])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--chunk-size", default="1MiB")
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--iperf3", action="store_true", help="measure iperf3 client + server instead")
    ap.add_argument("--len", default=None, help="iperf3 -l (at most 1M in iperf3 3.12)")
    ap.add_argument("--build", default=None, help="python/ tree of another build (as cpu_per_byte.py --build)")
    ap.add_argument("--sched", action="store_true", help="perf record sched_switch with call graphs instead")
    ap.add_argument("--out", default=None, help="directory for perf's files (default: a temp dir)")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="cpu-wakeups-"))
    out.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        if a.iperf3:
            exe = shutil.which("iperf3")
            if not exe:
                print("iperf3 is not installed", file=sys.stderr)
                return 2
            port = cpb._free_port("127.0.0.1", [])
            srv = subprocess.Popen([exe, "-s", "-1", "-B", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL)
            procs.append(srv)
            time.sleep(0.3)
            cmd = [exe, "-c", "127.0.0.1", "-p", str(port), "-t", str(int(a.seconds + 2)), "-J"]
            cmd += (["-R"] if a.op == "READ" else []) + (["-l", a.len] if a.len else [])
            cli = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            procs.append(cli)
            time.sleep(0.5)
            pids = {"client": cli.pid, "server": srv.pid}
        else:
            from multirail.bench.core import parse_size
            from multirail.bench.target import launch, stop

            engine = ["--connections", "1", "--chunk-size", a.chunk_size, "--progress", a.progress,
                      "--total-buffer-size", str(parse_size(a.size))]
            target, ready, terr = launch([sys.executable, "-m", "multirail", "bench", "target", "--listen", "127.0.0.1:0",
                                          "--duration", "120", "--idle-timeout", "120"] + engine, env=cpb._env(a.build))
            icmd = [sys.executable, str(Path(cpb.__file__).resolve()), "--role", "initiator", "--connect",
                    f"127.0.0.1:{ready['port']}", "--op", a.op, "--size", a.size, "--seconds", str(a.seconds + 1.0),
                    "--warmup", "5", "--connections", "1", "--chunk-size", a.chunk_size, "--progress", a.progress,
                    "--child-timeout", "120"]
            init = subprocess.Popen(icmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=cpb._env(a.build))
            procs.append(init)
            ev = cpb._read_event(init, "ready", 60, "initiator")
            assert init.stdin is not None
            init.stdin.write("go\n")
            init.stdin.flush()
            time.sleep(0.3)
            pids = {"initiator": int(ev["pid"]), "target": int(ready["pid"])}
        files = {k: out / f"{k}.{'sched.data' if a.sched else 'stat.txt'}" for k in pids}
        perfs = [attach(pid, a.seconds, files[k], a.sched) for k, pid in pids.items()]
        c0 = {k: cpb.cpu_seconds(p) for k, p in pids.items()}
        time.sleep(a.seconds)
        c1 = {k: cpb.cpu_seconds(p) for k, p in pids.items()}
        for p in perfs:
            p.wait(timeout=60)
        if a.iperf3:
            o, _ = cli.communicate(timeout=a.seconds + 30)
            s = json.loads(o)["end"]["sum_received"]
            rate = s["bytes"] / s["seconds"]
            label = f"iperf3 {a.op}" + (f" -l {a.len}" if a.len else "")
        else:
            done = cpb._read_event(init, "done", 60, "initiator")
            rate = done["bytes"] / done["wall_s"]
            label = f"multirail {a.op} {a.progress}" + (f" @{a.build}" if a.build else "")
        gb = rate * a.seconds / 1e9
        cpu = sum(c1.values()) - sum(c0.values())
        print(f"{label}: {rate * 8 / 1e9:.1f} Gbit/s, CPU {cpu / gb:.3f} s/GB under perf")
        for k in pids:
            print(f"  {k:<9} " + (f"perf record: {files[k]}" if a.sched else counts(files[k], gb)))
    finally:
        for p in procs:
            cpb._stop(p, grace=2.0)  # closes stdin (the initiator then exits), kills by PID after
        if not a.iperf3 and "target" in locals():
            stop(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
