#!/usr/bin/env python3
"""CPU seconds per GB moved, both sides, READ and WRITE, against iperf3 in the same run (issue 22 item 5).

Each run starts fresh processes for every worker, in a rotating order so that a noisy phase of a
shared host hits every worker alike:

  multirail READ / WRITE, per --progress mode: a `bench target` process and an initiator process
      (this script with --role initiator: EngineWorker, `transfer_sync` of one --size block in a
      loop). Both are warmed up (--warmup iterations, the buffers faulted in and filled with a
      pattern) before the window opens; the window covers only the timed loop (about --seconds).
  iperf3 (client + server, one stream per connection, `-R` for READ so that bytes flow server ->
      client as a READ's flow target -> initiator): a fresh server per measurement.

CPU is read from /proc/PID/stat (utime + stime of the whole process, every thread, exited threads
included) of both processes right before the driver tells the initiator to start and right after
it reports the loop done, so process startup, connection setup and warm-up are not counted. For
iperf3 the same /proc deltas of both PIDs are taken over its steady part (from --iperf3-skip s
after the client starts, for about --seconds), and the bytes of that window come from iperf3's own
per-interval report (0.1 s intervals). CPU per GB = (initiator + target CPU s) / (bytes / 1e9).

The kernel may defer loopback/veth receive processing to its ksoftirqd threads when the host is
loaded; that CPU is charged to no measured process, so each row also shows the ksoftirqd CPU of
its window per GB (system-wide: other load counts there too). A run where it is large for one
worker and not the other is skewed.

With --floor, a third baseline runs in every run: a plain socket pair (this script, --role
floor-send / floor-recv) that moves the same --size buffer as the engine, filled with real bytes,
in --chunk-size send() / recv_into(MSG_WAITALL) calls cycling over it, one connection, the bulk
bytes flowing the op's way. iperf3 sends and receives one 128 KiB buffer over and over (it stays
in the L2 cache); the floor has the application's memory footprint, so multirail / floor is the
engine's own overhead, and floor / iperf3 the cost of that footprint.

Prints every run, then per op and progress mode the median and the worst ratio (multirail CPU/GB
over iperf3 CPU/GB of the same op, same run), and the split by side (the side that sends the bulk
bytes and the side that receives them, against iperf3's sender and receiver).

    .venv/bin/python benchmarks/cpu_per_byte.py [--runs 5] [--size 64MiB] [--seconds 2]
        [--progress adaptive,block] [--ops READ,WRITE] [--connections 1] [--json FILE]
    # on the testbed (root; `multirail testbed up --rails 2 --rate 2gbit` first):
    .venv/bin/python benchmarks/cpu_per_byte.py --testbed [NAME] --rails 0,1

Bounded: every child has a timeout and is killed by PID in `finally`; --deadline (default 900 s)
stops starting new runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import selectors
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
# The multirail build this process uses (--build gives children another one, e.g. a copy of
# main's python/ tree with its _core extension, for before/after in one run).
sys.path.insert(0, os.environ.get("MR_CPB_PYROOT") or str(ROOT / "python"))

from multirail.bench.core import parse_size  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
GB = 1e9


class Failure(RuntimeError):
    pass


# -- CPU accounting ------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads, exited ones included), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # comm may hold spaces or parentheses: the fields start after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def ksoftirqd_seconds() -> float:
    """CPU seconds of the kernel's ksoftirqd threads so far. Loopback and veth receive
    processing runs in softirq context, normally charged to the process that sent, but on a
    loaded host the kernel defers it to ksoftirqd, charged to no process measured here: the
    delta over a window (system-wide, so other load counts too) shows how much went there."""
    total = 0.0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/comm") as f:
                if not f.read().startswith("ksoftirqd"):
                    continue
            total += cpu_seconds(int(d))
        except (OSError, ValueError):
            continue
    return total


# -- child processes -----------------------------------------------------------------------------

def _env(pyroot: str | None = None) -> dict[str, str]:
    root = pyroot or str(ROOT / "python")
    return {**os.environ, "MR_CPB_PYROOT": root, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _read_event(proc: subprocess.Popen[str], want: str, timeout: float, who: str) -> dict[str, Any]:
    """The next JSON line of `proc`'s stdout whose "event" is `want` (others are skipped)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.2):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("event") == want:
                return ev
            if isinstance(ev, dict) and ev.get("event") == "error":
                raise Failure(f"{who}: {ev.get('error')}")
    finally:
        sel.close()
    raise Failure(f"{who} did not report {want!r} within {timeout:.0f} s (exit {proc.poll()})")


def _stop(proc: subprocess.Popen[Any] | None, grace: float = 5.0) -> None:
    """Close stdin, give the child `grace` s to exit, then kill it (by PID: our own child)."""
    if proc is None:
        return
    if proc.stdin:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)


def _tail(f: IO[str] | None) -> str:
    if f is None:
        return ""
    f.seek(0)
    return f.read().strip()[-600:]


def _timed_window(a: argparse.Namespace, driver: subprocess.Popen[str], pids: tuple[int, int], who: str,
                  err: IO[str]) -> tuple[dict[str, Any], float, float, float]:
    """Tell `driver` to go and wait for its "done": (done event, CPU s of each of `pids` and the
    ksoftirqd CPU s over exactly that window)."""
    k0 = ksoftirqd_seconds()
    c0 = (cpu_seconds(pids[0]), cpu_seconds(pids[1]))
    assert driver.stdin is not None
    driver.stdin.write("go\n")
    driver.stdin.flush()
    try:
        done = _read_event(driver, "done", a.seconds * 10 + 60, who)
    except Failure as e:
        raise Failure(f"{e}: {_tail(err)}") from None
    c1 = (cpu_seconds(pids[0]), cpu_seconds(pids[1]))
    k1 = ksoftirqd_seconds()
    return done, c1[0] - c0[0], c1[1] - c0[1], k1 - k0


def run_multirail(a: argparse.Namespace, op: str, progress: str, net: dict[str, Any],
                  build: tuple[str, str | None] = ("", None)) -> dict[str, Any]:
    """One fresh target + initiator pair (of `build`: (label, python root)); CPU of both over
    the timed loop only."""
    import tempfile

    from multirail.bench.target import launch, stop

    size = parse_size(a.size)
    engine = ["--connections", str(a.connections), "--chunk-size", a.chunk_size, "--progress", progress,
              "--total-buffer-size", str(size)]
    tcmd = net["prefix_a"] + [sys.executable, "-m", "multirail", "bench", "target", "--listen", f"{net['host']}:0",
                              "--duration", str(a.child_timeout), "--idle-timeout", str(a.child_timeout)] + engine
    tcmd += ["--rails", net["t_rails"]] if net["t_rails"] else []
    try:
        target, ready, terr = launch(tcmd, env=_env(build[1]))
    except RuntimeError as e:
        raise Failure(str(e)) from None
    init: subprocess.Popen[str] | None = None
    ierr = tempfile.TemporaryFile(mode="w+")
    try:
        icmd = net["prefix_b"] + [sys.executable, str(Path(__file__).resolve()), "--role", "initiator",
                                  "--connect", f"{net['host']}:{ready['port']}", "--op", op, "--size", a.size,
                                  "--seconds", str(a.seconds), "--warmup", str(a.warmup),
                                  "--connections", str(a.connections), "--chunk-size", a.chunk_size,
                                  "--progress", progress, "--child-timeout", str(a.child_timeout)]
        icmd += ["--rails", net["i_rails"]] if net["i_rails"] else []
        init = subprocess.Popen(icmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=ierr, text=True,
                                env=_env(build[1]))
        try:
            ev = _read_event(init, "ready", a.child_timeout, "initiator")
        except Failure as e:
            raise Failure(f"{e}: {_tail(ierr)}") from None
        done, ini, tgt, ksoft = _timed_window(a, init, (int(ev["pid"]), int(ready["pid"])), "initiator", ierr)
    finally:
        _stop(init)
        stop(target)
        ierr.close()
        terr.close()
    nbytes = int(done["bytes"])
    # READ: the target sends the bulk bytes; WRITE: the initiator does.
    send, recv = (tgt, ini) if op == "READ" else (ini, tgt)
    return {"worker": f"multirail-{progress}{build[0]}", "op": op, "bytes": nbytes, "wall_s": float(done["wall_s"]),
            "iters": int(done["iters"]), "initiator_cpu_s": ini, "target_cpu_s": tgt,
            "cpu_per_gb": (ini + tgt) / (nbytes / GB), "send_cpu_per_gb": send / (nbytes / GB),
            "recv_cpu_per_gb": recv / (nbytes / GB), "gbps": nbytes * 8 / float(done["wall_s"]) / 1e9,
            "ksoftirqd_per_gb": ksoft / (nbytes / GB)}


def _free_port(host: str, prefix: list[str]) -> int:
    if prefix:  # another namespace: a port unlikely to be in use there
        return 20000 + os.getpid() % 20000
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_iperf3(a: argparse.Namespace, op: str, net: dict[str, Any]) -> dict[str, Any]:
    """A fresh iperf3 server + client; /proc CPU deltas of both over the steady window, and the
    bytes of that window from iperf3's 0.1 s intervals."""
    exe = shutil.which("iperf3")
    if not exe:
        raise Failure("iperf3 is not installed (apt-get install iperf3)")
    host = net["host"]
    port = _free_port(host, net["prefix_a"])
    total = int(math.ceil(a.iperf3_skip + a.seconds + 1.0))  # iperf3 -t takes whole seconds
    server = subprocess.Popen(net["prefix_a"] + [exe, "-s", "-1", "-B", host, "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client: subprocess.Popen[str] | None = None
    try:
        from multirail.bench.baseline import _listening

        deadline = time.monotonic() + 10
        while not _listening(port, net["prefix_a"]):
            if server.poll() is not None or time.monotonic() > deadline:
                raise Failure(f"iperf3 server did not start on {host}:{port}")
            time.sleep(0.02)
        cmd = net["prefix_b"] + [exe, "-c", host, "-p", str(port), "-P", str(a.connections), "-t", str(total),
                                 "-i", "0.1", "-J"] + (["-R"] if op == "READ" else [])
        cmd += ["-B", net["i_host"]] if net.get("i_host") else []
        client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t_start = time.monotonic()
        time.sleep(a.iperf3_skip)
        k0 = ksoftirqd_seconds()
        c0 = (cpu_seconds(client.pid), cpu_seconds(server.pid), time.monotonic() - t_start)
        time.sleep(a.seconds)
        c1 = (cpu_seconds(client.pid), cpu_seconds(server.pid), time.monotonic() - t_start)
        k1 = ksoftirqd_seconds()
        try:
            out, err = client.communicate(timeout=total + 30)
        except subprocess.TimeoutExpired:
            raise Failure(f"iperf3 client did not finish within {total + 30:.0f} s") from None
    finally:
        _stop(client, grace=0.0)
        _stop(server, grace=2.0)
    try:
        data = json.loads(out)
        intervals = data["intervals"]
        own = data["end"].get("cpu_utilization_percent", {})
    except (ValueError, KeyError, TypeError):
        raise Failure(f"iperf3 failed: {(err or out).strip()[:300]}") from None
    # Bytes received in [c0[2], c1[2]] (client time ~ our time since its start, ~ms skew): the
    # intervals inside the window, the edge ones pro rata.
    t_a, t_b = c0[2], c1[2]
    nbytes = 0.0
    for iv in intervals:
        s = iv["sum"]
        lo, hi = float(s["start"]), float(s["end"])
        if hi <= lo:
            continue
        overlap = max(0.0, min(hi, t_b) - max(lo, t_a))
        nbytes += float(s["bytes"]) * overlap / (hi - lo)
    if nbytes <= 0:
        raise Failure("iperf3 reported no bytes in the measured window")
    cli, srv = c1[0] - c0[0], c1[1] - c0[1]
    send, recv = (srv, cli) if op == "READ" else (cli, srv)
    return {"worker": "iperf3", "op": op, "bytes": int(nbytes), "wall_s": t_b - t_a, "client_cpu_s": cli,
            "server_cpu_s": srv, "cpu_per_gb": (cli + srv) / (nbytes / GB), "send_cpu_per_gb": send / (nbytes / GB),
            "recv_cpu_per_gb": recv / (nbytes / GB), "gbps": nbytes * 8 / (t_b - t_a) / 1e9,
            "iperf3_own_cpu_pct": {"host": own.get("host_total"), "remote": own.get("remote_total")},
            "ksoftirqd_per_gb": (k1 - k0) / (nbytes / GB)}


def run_floor(a: argparse.Namespace, op: str, net: dict[str, Any]) -> dict[str, Any]:
    """The socket floor (--floor): a fresh receiver + sender pair with the engine's buffers; CPU
    of both over the sender's timed loop only."""
    import tempfile

    # READ: bulk bytes flow target (namespace a) -> initiator (b); WRITE: b -> a.
    r_prefix, s_prefix = (net["prefix_b"], net["prefix_a"]) if op == "READ" else (net["prefix_a"], net["prefix_b"])
    r_host = (net.get("i_host") or net["host"]) if op == "READ" else net["host"]
    me = [sys.executable, str(Path(__file__).resolve()), "--size", a.size, "--chunk-size", a.chunk_size,
          "--seconds", str(a.seconds), "--warmup", str(a.warmup), "--child-timeout", str(a.child_timeout)]
    errs = [tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")]
    recv: subprocess.Popen[str] | None = None
    send: subprocess.Popen[str] | None = None
    try:
        recv = subprocess.Popen(r_prefix + me + ["--role", "floor-recv", "--connect", f"{r_host}:0"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=errs[0], text=True)
        rr = _read_event(recv, "ready", a.child_timeout, "floor receiver")
        send = subprocess.Popen(s_prefix + me + ["--role", "floor-send", "--connect", f"{r_host}:{rr['port']}"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs[1], text=True)
        try:
            sr = _read_event(send, "ready", a.child_timeout, "floor sender")
        except Failure as e:
            raise Failure(f"{e}: {_tail(errs[1])} {_tail(errs[0])}") from None
        done, snd, rcv, ksoft = _timed_window(a, send, (int(sr["pid"]), int(rr["pid"])), "floor sender", errs[1])
    finally:
        _stop(send)
        _stop(recv)
        for f in errs:
            f.close()
    nbytes = int(done["bytes"])
    return {"worker": "floor", "op": op, "bytes": nbytes, "wall_s": float(done["wall_s"]), "send_cpu_s": snd,
            "recv_cpu_s": rcv, "cpu_per_gb": (snd + rcv) / (nbytes / GB), "send_cpu_per_gb": snd / (nbytes / GB),
            "recv_cpu_per_gb": rcv / (nbytes / GB), "gbps": nbytes * 8 / float(done["wall_s"]) / 1e9,
            "ksoftirqd_per_gb": ksoft / (nbytes / GB)}


def floor_main(a: argparse.Namespace) -> int:
    """--role floor-recv / floor-send: one connection, a --size buffer of real bytes on each side,
    --chunk-size calls cycling over it."""
    import socket

    import numpy as np

    def emit(ev: dict[str, Any]) -> None:
        print(json.dumps(ev), flush=True)

    size, chunk = parse_size(a.size), parse_size(a.chunk_size)
    chunk = min(chunk, size)
    buf = np.empty(size, np.uint8)
    buf[:] = 7  # faulted in, real pages
    view = memoryview(buf)
    host, _, port = a.connect.rpartition(":")
    if a.role == "floor-recv":
        with socket.socket() as ls:
            ls.bind((host, int(port)))
            ls.listen(1)
            ls.settimeout(a.child_timeout)
            emit({"event": "ready", "pid": os.getpid(), "port": ls.getsockname()[1]})
            c, _ = ls.accept()
        with c:
            c.settimeout(a.child_timeout)
            off = 0
            while True:
                end = min(off + chunk, size)
                n = c.recv_into(view[off:end], end - off, socket.MSG_WAITALL)
                if n == 0:
                    return 0
                off = off + n if off + n < size else 0
    with socket.create_connection((host, int(port)), timeout=a.child_timeout) as c:
        c.settimeout(a.child_timeout)
        offs = list(range(0, size - chunk + 1, chunk))

        def send_block() -> int:
            for o in offs:
                c.sendall(view[o:o + chunk])
            return len(offs) * chunk

        for _ in range(a.warmup):
            send_block()
        emit({"event": "ready", "pid": os.getpid()})
        if sys.stdin.readline().strip() != "go":
            return 1
        sent, t0 = 0, time.perf_counter()
        while True:
            sent += send_block()
            wall = time.perf_counter() - t0
            if wall >= a.seconds or wall > a.child_timeout:
                break
        emit({"event": "done", "bytes": sent, "wall_s": wall})
        sys.stdin.readline()  # the driver reads our CPU, then closes stdin
    return 0


# -- the initiator child -------------------------------------------------------------------------

def initiator_main(a: argparse.Namespace) -> int:
    from multirail.bench.worker import EngineWorker

    def emit(ev: dict[str, Any]) -> None:
        print(json.dumps(ev), flush=True)

    host, _, port = a.connect.rpartition(":")
    size = parse_size(a.size)
    w = None
    try:
        w = EngineWorker(op=a.op, target_host=host, target_port=int(port), target_name="mr-bench-target",
                         buffer_size=size, connections=a.connections,
                         rails=a.rails.split(",") if a.rails else None, policy="weighted",
                         chunk_size=parse_size(a.chunk_size), timeout=30.0, fill_target=True, progress=a.progress)
        assert w.mem is not None
        w.mem.fill_pattern(7)  # real bytes (not the shared zero page) on the sending side
        w.prepare(size, 1, False)
        for _ in range(a.warmup):
            w.run_once()
        emit({"event": "ready", "pid": os.getpid()})
        line = sys.stdin.readline()
        if line.strip() != "go":
            return 1
        iters = 0
        t0 = time.perf_counter()
        while True:
            w.run_once()
            iters += 1
            wall = time.perf_counter() - t0
            if wall >= a.seconds or wall > a.child_timeout:
                break
        emit({"event": "done", "bytes": iters * size, "iters": iters, "wall_s": wall})
        sys.stdin.readline()  # wait for the driver to read our CPU, then close
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the run
        emit({"event": "error", "error": f"{type(e).__name__}: {e}"})
        return 1
    finally:
        if w is not None:
            try:
                w.finish_size()  # releases the handle, so the region can be deregistered
            finally:
                w.close()


# -- the driver ----------------------------------------------------------------------------------

def _network(a: argparse.Namespace) -> dict[str, Any]:
    if not a.testbed:
        return {"host": "127.0.0.1", "prefix_a": [], "prefix_b": [], "t_rails": None, "i_rails": None}
    from multirail.bench import _select_testbed_rails, _testbed

    tb = _select_testbed_rails(_testbed(a.testbed), a.rails)
    return {"host": tb["a"][0], "i_host": tb["b"][0], "prefix_a": ["ip", "netns", "exec", tb["ns_a"]],
            "prefix_b": ["ip", "netns", "exec", tb["ns_b"]], "t_rails": ",".join(tb["a"]), "i_rails": ",".join(tb["b"])}


def _fmt(r: dict[str, Any]) -> str:
    return (f"{r['op']:<5} {r['worker']:<20} {r['cpu_per_gb']:6.3f} CPU-s/GB  (send {r['send_cpu_per_gb']:.3f}, "
            f"recv {r['recv_cpu_per_gb']:.3f}; ksoftirqd {r['ksoftirqd_per_gb']:.3f})  {r['gbps']:6.2f} Gbit/s "
            f"over {r['wall_s']:.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="fresh runs (default 5)")
    ap.add_argument("--ops", default="READ,WRITE")
    ap.add_argument("--progress", default="adaptive,block", help="multirail progress modes (comma list)")
    ap.add_argument("--size", default="64MiB", help="block per transfer (default 64MiB)")
    ap.add_argument("--seconds", type=float, default=2.0, help="timed window per worker (default 2)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed transfers first (default 5)")
    ap.add_argument("--iperf3-skip", type=float, default=0.5, help="iperf3 seconds not counted at its start")
    ap.add_argument("--connections", type=int, default=1, help="connections per rail = iperf3 -P (default 1)")
    ap.add_argument("--chunk-size", default="1MiB")
    ap.add_argument("--testbed", nargs="?", const="mrtb", default=None, metavar="NAME",
                    help="run in the testbed's namespaces (root; `multirail testbed up` first)")
    ap.add_argument("--rails", default=None, help="with --testbed: rail indices, e.g. 0,1")
    ap.add_argument("--deadline", type=float, default=900.0, help="start no new run after this many s")
    ap.add_argument("--child-timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=DIR",
                    help="also run the multirail build whose python/ tree (package + _core extension) is DIR, "
                         "as workers multirail-MODE@LABEL (repeatable; e.g. a copy of main's for before/after)")
    ap.add_argument("--floor", action="store_true",
                    help="also run the socket floor: a plain socket pair with the engine's buffers (see above)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--role", default="driver", choices=["driver", "initiator", "floor-send", "floor-recv"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--connect", help=argparse.SUPPRESS)
    ap.add_argument("--op", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "initiator":
        return initiator_main(a)
    if a.role in ("floor-send", "floor-recv"):
        return floor_main(a)
    if a.runs < 1 or a.seconds <= 0 or a.warmup < 0:
        ap.error("--runs and --seconds must be positive, --warmup >= 0")
    ops = [o.strip().upper() for o in a.ops.split(",") if o.strip()]
    modes = [m.strip() for m in a.progress.split(",") if m.strip()]
    if not ops or any(o not in ("READ", "WRITE") for o in ops):
        ap.error("--ops takes READ and/or WRITE")
    if not modes or any(m not in ("adaptive", "poll", "block") for m in modes):
        ap.error("--progress takes adaptive, poll and/or block")
    if a.rails and not a.testbed:
        ap.error("--rails is for --testbed (loopback has one rail)")
    builds: dict[str, tuple[str, str | None]] = {"": ("", None)}
    for spec in a.build:
        label, sep, d = spec.partition("=")
        if not sep or not label or not (Path(d) / "multirail" / "__init__.py").is_file():
            ap.error(f"--build {spec!r}: want LABEL=DIR with DIR/multirail/__init__.py")
        builds["@" + label] = ("@" + label, str(Path(d).resolve()))
    net = _network(a)
    names = [f"multirail-{m}{b}" for b in builds for m in modes]
    workers = [(op, w) for op in ops for w in ["iperf3"] + (["floor"] if a.floor else []) + names]
    runs: list[list[dict[str, Any]]] = []
    t_begin = time.monotonic()
    for r in range(a.runs):
        if time.monotonic() - t_begin > a.deadline:
            print(f"deadline reached after {len(runs)} run(s)", file=sys.stderr)
            break
        k = r % len(workers)
        rows = []
        for op, w in workers[k:] + workers[:k]:
            try:
                if w == "iperf3":
                    row = run_iperf3(a, op, net)
                elif w == "floor":
                    row = run_floor(a, op, net)
                else:
                    mode, _, label = w.split("-", 1)[1].partition("@")
                    row = run_multirail(a, op, mode, net, builds["@" + label if label else ""])
            except Failure as e:
                print(f"cpu_per_byte: run {r + 1}, {op} {w}: {e}", file=sys.stderr)
                return 1
            rows.append(row)
            print(f"run {r + 1}/{a.runs}  {_fmt(row)}", file=sys.stderr, flush=True)
        runs.append(rows)
    if not runs:
        return 1
    summary: dict[str, Any] = {}
    print(f"\nCPU seconds per GB (initiator + target; iperf3 client + server), {len(runs)} fresh run(s), "
          f"{a.size} blocks, {a.seconds:g} s windows, {'testbed ' + a.testbed if a.testbed else 'loopback'}")
    print(f"{'op':<5} {'worker':<20} {'CPU/GB med':>10} {'ratio med':>9} {'ratio worst':>11} "
          f"{'send x':>7} {'recv x':>7} {'Gbit/s':>7} {'ksoftirqd/GB':>12}" + ("  x floor med (worst)" if a.floor else ""))
    for op in ops:
        for w in (["floor"] if a.floor else []) + names:
            ratios, sends, recvs, cpg, rates, ksi, floors = [], [], [], [], [], [], []
            for rows in runs:
                base = next(x for x in rows if x["op"] == op and x["worker"] == "iperf3")
                mine = next(x for x in rows if x["op"] == op and x["worker"] == w)
                if a.floor:
                    floor = next(x for x in rows if x["op"] == op and x["worker"] == "floor")
                    floors.append(mine["cpu_per_gb"] / floor["cpu_per_gb"])
                ratios.append(mine["cpu_per_gb"] / base["cpu_per_gb"])
                sends.append(mine["send_cpu_per_gb"] / base["send_cpu_per_gb"])
                recvs.append(mine["recv_cpu_per_gb"] / base["recv_cpu_per_gb"])
                cpg.append(mine["cpu_per_gb"])
                rates.append(mine["gbps"])
                ksi.append(mine["ksoftirqd_per_gb"])
            summary[f"{op}/{w}"] = {"ratio_median": statistics.median(ratios), "ratio_worst": max(ratios),
                                   "ratios": ratios, "cpu_per_gb_median": statistics.median(cpg),
                                   "send_ratio_median": statistics.median(sends),
                                   "recv_ratio_median": statistics.median(recvs)}
            if floors:
                summary[f"{op}/{w}"].update({"floor_ratio_median": statistics.median(floors), "floor_ratio_worst": max(floors),
                                             "floor_ratios": floors})
            print(f"{op:<5} {w:<20} {statistics.median(cpg):10.3f} {statistics.median(ratios):8.2f}x "
                  f"{max(ratios):10.2f}x {statistics.median(sends):6.2f}x {statistics.median(recvs):6.2f}x "
                  f"{statistics.median(rates):7.2f} {statistics.median(ksi):12.3f}"
                  + (f"  {statistics.median(floors):.2f}x ({max(floors):.2f}x)" if floors else ""))
        base = [next(x for x in rows if x["op"] == op and x["worker"] == "iperf3") for rows in runs]
        print(f"{op:<5} {'iperf3':<20} {statistics.median(b['cpu_per_gb'] for b in base):10.3f} {'1.00x':>9} "
              f"{'':>11} {'':>7} {'':>7} {statistics.median(b['gbps'] for b in base):7.2f} "
              f"{statistics.median(b['ksoftirqd_per_gb'] for b in base):12.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
