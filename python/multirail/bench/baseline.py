"""Baselines run next to the engine by `bench local --baseline`.

* iperf3 (`-P <connections>`, bounded `-t`, `-R` for READ so data flows server -> client like
  a READ flows target -> initiator): the throughput the kernel's TCP gives the same host
  pair. The server is started with `-1` (serve one test, then exit) and killed by PID in
  `finally` regardless.
* mr-pingpong (benchmarks/pingpong, Rust, std only): N-byte request, N-byte echo over one
  TCP_NODELAY connection; its p50/p99 are the raw-TCP round-trip floor for small transfers.
  Blocking sockets by default; `poll=True` passes `--poll` to both ends, which then busy-poll
  non-blocking sockets (the comparison for the engine's polling progress mode). The row
  carries the client thread's CPU use (`cpu_pct`, CPU time / wall time in percent).

Both return `BenchRow`s (worker "iperf3 -P n" / "mr-pingpong" or "mr-pingpong-poll") so they
print in the same table.
Commands can be prefixed (e.g. `ip netns exec NS`) for the testbed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from multirail.bench.core import BenchRow
from multirail.bench.worker import BenchFailure

REPO_ROOT = Path(__file__).resolve().parents[3]


def find_pingpong(build: bool = True) -> Path:
    """target/release/mr-pingpong (or $MR_PINGPONG); builds it with cargo when missing."""
    env = os.environ.get("MR_PINGPONG")
    if env:
        if Path(env).is_file():
            return Path(env)
        raise BenchFailure(f"MR_PINGPONG={env} does not exist")
    path = REPO_ROOT / "target" / "release" / "mr-pingpong"
    if path.is_file():
        return path
    cargo = shutil.which("cargo")
    if build and cargo and (REPO_ROOT / "Cargo.toml").is_file():
        try:
            subprocess.run([cargo, "build", "--release", "-p", "mr-pingpong"], cwd=REPO_ROOT,
                           capture_output=True, timeout=600, check=False)
        except subprocess.TimeoutExpired:
            pass
        if path.is_file():
            return path
    raise BenchFailure(f"mr-pingpong not found at {path}; build it with "
                       "`cargo build --release -p mr-pingpong` (or set MR_PINGPONG=/path/to/it)")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listening(port: int, prefix: list[str]) -> bool:
    """Is a TCP socket listening on `port` (in the namespace the prefix enters)?"""
    if prefix:
        try:
            out = subprocess.run(prefix + ["cat", "/proc/net/tcp"], capture_output=True, text=True, timeout=5).stdout
        except subprocess.TimeoutExpired:
            return False
    else:
        out = Path("/proc/net/tcp").read_text()
    for line in out.splitlines()[1:]:
        f = line.split()
        if len(f) > 3 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
            return True
    return False


def _stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()  # by PID (Popen.kill signals exactly this child)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def run_iperf3(host: str, connections: int, seconds: int, op: str,
               server_prefix: list[str] | None = None, client_prefix: list[str] | None = None) -> BenchRow:
    exe = shutil.which("iperf3")
    if not exe:
        raise BenchFailure("iperf3 is not installed (apt-get install iperf3)")
    server_prefix, client_prefix = server_prefix or [], client_prefix or []
    port = free_port(host) if not server_prefix else 5201 + os.getpid() % 1000
    server = subprocess.Popen(server_prefix + [exe, "-s", "-1", "-B", host, "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not _listening(port, server_prefix):
            if server.poll() is not None or time.monotonic() > deadline:
                err = server.stderr.read().decode(errors="replace") if server.stderr and server.poll() is not None else ""
                raise BenchFailure(f"iperf3 server did not start on {host}:{port} {err.strip()}")
            time.sleep(0.05)
        cmd = client_prefix + [exe, "-c", host, "-p", str(port), "-P", str(connections),
                               "-t", str(seconds), "-J"] + (["-R"] if op == "READ" else [])
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            raise BenchFailure(f"iperf3 client did not finish within {seconds + 30} s") from None
        try:
            data = json.loads(res.stdout)
            bps = float(data["end"]["sum_received"]["bits_per_second"])
            secs = float(data["end"]["sum_received"]["seconds"])
            nbytes = int(data["end"]["sum_received"]["bytes"])
        except (ValueError, KeyError, TypeError):
            raise BenchFailure(f"iperf3 failed: {(res.stderr or res.stdout).strip()[:300]}") from None
    finally:
        _stop(server)
    nan = float("nan")
    return BenchRow(op=op, block_size=0, batch_size=connections, iterations=1, seconds=secs,
                    total_bytes=nbytes, gbps=bps / 1e9, gb_per_s=bps / 8e9, lat_avg_us=nan,
                    lat_p50_us=nan, lat_p99_us=nan, lat_min_us=nan, lat_max_us=nan,
                    worker=f"iperf3 -P {connections}")


def run_pingpong(size: int, iters: int, warmup: int, host: str = "127.0.0.1",
                 server_prefix: list[str] | None = None, client_prefix: list[str] | None = None,
                 poll: bool = False) -> BenchRow:
    """One mr-pingpong server + client run; worker "mr-pingpong-poll" when `poll`, else "mr-pingpong"."""
    exe = str(find_pingpong())
    mode = ["--poll"] if poll else []
    server = subprocess.Popen((server_prefix or []) + [exe, "server", "--listen", f"{host}:0", "--size", str(size),
                                                      "--idle-timeout", "30"] + mode,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        ready = server.stdout.readline()  # printed right after bind; the process exits on errors
        try:
            port = int(json.loads(ready)["port"])
        except (ValueError, KeyError, TypeError):
            err = server.stderr.read() if server.stderr and server.poll() is not None else ""
            raise BenchFailure(f"mr-pingpong server did not start: {ready.strip()} {err.strip()}") from None
        try:
            res = subprocess.run((client_prefix or []) + [exe, "client", "--connect", f"{host}:{port}", "--size", str(size),
                                                          "--iters", str(iters), "--warmup", str(warmup)] + mode,
                                 capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise BenchFailure("mr-pingpong client did not finish within 120 s") from None
        if res.returncode != 0:
            raise BenchFailure(f"mr-pingpong failed: {res.stderr.strip()}")
        d = json.loads(res.stdout)
    finally:
        _stop(server)
    want = "poll" if poll else "block"
    if d.get("mode", "block") != want:  # an older binary prints no mode (and only blocks)
        raise BenchFailure(f"mr-pingpong ran in mode {d.get('mode')!r}, not {want!r}; rebuild it "
                           "(cargo build --release -p mr-pingpong)")
    cpu = d.get("client_cpu_pct")
    avg = float(d["avg_us"])
    secs = avg * iters / 1e6
    return BenchRow(op="PING", block_size=size, batch_size=1, iterations=iters, seconds=secs,
                    total_bytes=2 * size * iters, gbps=size * 8 / (avg * 1e3) if avg else 0.0,
                    gb_per_s=size / (avg * 1e3) if avg else 0.0, lat_avg_us=avg,
                    lat_p50_us=float(d["p50_us"]), lat_p99_us=float(d["p99_us"]),
                    lat_min_us=float(d["min_us"]), lat_max_us=float(d["max_us"]),
                    worker="mr-pingpong-poll" if poll else "mr-pingpong",
                    cpu_pct=float(cpu) if cpu is not None else None)
