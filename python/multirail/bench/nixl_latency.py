"""NIXL latency baseline for `multirail bench --baseline`: 4 KiB READ round trips through NIXL's
own Python API (UCX backend), timed the way multirail's loop is timed, in the same run.

Two processes, like multirail's bench: a NIXL target registers a buffer and prints its agent
metadata and serialized descriptors (hex, one JSON line); a NIXL initiator registers its own
buffer, loads the target's metadata, prepares one READ handle and then, `iters` times, posts it
(`transfer`) and polls `check_xfer_state` until "DONE" — NIXL's documented completion loop, so
it busy-polls as NIXL users do. It prints one JSON line: p50/p99/avg/min/max in microseconds
and the waiting thread's CPU use (thread CPU time over wall time).

UCX picks its transports from UCX_TLS; unless the caller set it, this baseline sets
`UCX_TLS=tcp` so NIXL moves the bytes over TCP sockets as multirail does (on one host UCX would
otherwise use shared memory, a different thing). The row's worker name carries the choice.

Needs NIXL (`pip install nixl-cu12`); `nixl_available()` says whether it is importable.
Run as `python -m multirail.bench.nixl_latency target|initiator ...` (what `run_nixl_latency`
does).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

import numpy as np

from multirail.bench.core import BenchRow


def nixl_api() -> ModuleType | None:
    for mod in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(mod)
        except ImportError:
            continue
    return None


def nixl_available(python: str | None = None) -> bool:
    """Whether `python` (default: this interpreter) can import NIXL."""
    if python is None or python == sys.executable:
        return nixl_api() is not None
    code = "import multirail.bench.nixl_latency as m, sys; sys.exit(0 if m.nixl_api() else 1)"
    return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0


def _agent(api: ModuleType, name: str) -> Any:
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _target(size: int, idle_s: float) -> int:
    api = nixl_api()
    if api is None:
        print(json.dumps({"error": "NIXL is not importable"}), flush=True)
        return 1
    agent = _agent(api, "nixl-lat-target")
    buf = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, size, 0, "")], "DRAM"))
    descs = agent.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
    print(json.dumps({"meta": agent.get_agent_metadata().hex(),
                      "descs": agent.get_serialized_descs(descs).hex()}), flush=True)
    # Serve (UCX's progress thread answers the READs) until stdin closes or idle_s passes.
    import select
    select.select([sys.stdin], [], [], idle_s)
    return 0


def _initiator(size: int, iters: int, warmup: int, meta_hex: str, descs_hex: str) -> int:
    api = nixl_api()
    if api is None:
        print(json.dumps({"error": "NIXL is not importable"}), flush=True)
        return 1
    agent = _agent(api, "nixl-lat-init")
    dst = np.zeros(size, np.uint8)
    agent.register_memory(agent.get_reg_descs([(dst.ctypes.data, size, 0, "")], "DRAM"))
    peer = agent.add_remote_agent(bytes.fromhex(meta_hex))
    local = agent.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM")
    remote = agent.deserialize_descs(bytes.fromhex(descs_hex))
    deadline = time.monotonic() + 30
    while True:  # the first handle may fail until UCX has connected
        try:
            h = agent.initialize_xfer("READ", local, remote, peer)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    lat: list[int] = []
    cpu0 = wall0 = 0.0
    for k in range(warmup + iters):
        if k == warmup:
            cpu0, wall0 = time.thread_time(), time.perf_counter()
        t0 = time.perf_counter_ns()
        state = agent.transfer(h)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(h)
        t1 = time.perf_counter_ns()
        if state == "ERR":
            print(json.dumps({"error": f"NIXL READ failed at iteration {k}"}), flush=True)
            return 1
        if k >= warmup:
            lat.append(t1 - t0)
    cpu_pct = 100.0 * (time.thread_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    us = np.sort(np.array(lat, dtype=np.float64) / 1e3)
    print(json.dumps({
        "size": size, "iters": iters, "avg_us": float(us.mean()), "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)), "min_us": float(us[0]), "max_us": float(us[-1]),
        "cpu_pct": cpu_pct, "ucx_tls": os.environ.get("UCX_TLS", ""),
    }), flush=True)
    agent.release_xfer_handle(h)
    return 0


def run_nixl_latency(size: int, iters: int, warmup: int, python: str | None = None,
                     timeout_s: float = 120.0) -> BenchRow:
    """Run the NIXL target and initiator processes; return the latency row."""
    from multirail.bench.worker import BenchFailure

    py = python or sys.executable
    env = dict(os.environ)
    env.setdefault("UCX_TLS", "tcp")
    env.setdefault("UCX_LOG_LEVEL", "error")
    cmd = [py, "-m", "multirail.bench.nixl_latency"]
    target = subprocess.Popen([*cmd, "target", str(size), str(timeout_s)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first: dict[str, Any] = {"error": "NIXL target exited without its metadata"}
        for line in target.stdout if target.stdout else []:  # NIXL logs to stdout too
            if line.startswith("{"):
                first = json.loads(line)
                break
        if "error" in first:
            raise BenchFailure(f"NIXL baseline: {first['error']}")
        try:
            res = subprocess.run([*cmd, "initiator", str(size), str(iters), str(warmup), first["meta"],
                                  first["descs"]], capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchFailure(f"NIXL initiator did not finish within {timeout_s:.0f} s") from None
        out = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        d = json.loads(out[-1]) if out else {"error": f"NIXL initiator failed: {res.stderr.strip()[-500:]}"}
        if "error" in d:
            raise BenchFailure(f"NIXL baseline: {d['error']}")
    finally:
        if target.stdin:
            target.stdin.close()
        try:
            target.wait(10)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()
    seconds = d["avg_us"] * iters / 1e6
    gb_per_s = size * iters / seconds / 1e9 if seconds > 0 else 0.0
    return BenchRow(op="READ", block_size=size, batch_size=1, iterations=iters, seconds=seconds,
                    total_bytes=size * iters, gbps=gb_per_s * 8, gb_per_s=gb_per_s,
                    lat_avg_us=d["avg_us"], lat_p50_us=d["p50_us"], lat_p99_us=d["p99_us"],
                    lat_min_us=d["min_us"], lat_max_us=d["max_us"], worker=f"nixl-ucx({env['UCX_TLS']})",
                    cpu_pct=d["cpu_pct"])


def main(argv: list[str]) -> int:
    if argv[:1] == ["target"] and len(argv) == 3:
        return _target(int(argv[1]), float(argv[2]))
    if argv[:1] == ["initiator"] and len(argv) == 6:
        return _initiator(int(argv[1]), int(argv[2]), int(argv[3]), argv[4], argv[5])
    print("usage: python -m multirail.bench.nixl_latency target SIZE IDLE_S | "
          "initiator SIZE ITERS WARMUP META_HEX DESCS_HEX", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
