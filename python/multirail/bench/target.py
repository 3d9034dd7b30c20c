"""`multirail bench target`: one registered read-write buffer served until told to stop.

Prints one JSON ready line on stdout ({"event": "ready", "agent", "host", "port",
"buffer_size", "pid"}) once listening, then answers the control messages of protocol.py.
It exits on `bench:stop`, after `--idle-timeout` seconds without a control message, or after
`--duration` seconds in all, so it never runs forever by accident.

`--corrupt-offset K` (hidden, for tests) flips byte K of the buffer after the pattern fill
(READ) or before a verification (WRITE), so the consistency check can be shown to fail.

`--target-seg-type VRAM` makes the buffer GPU memory (mem.BenchMem: a multirail.gpu.DeviceBuffer
on `--device-id` of kind `--gpu`), allocated here in the target process; the ready line and
`bench:info` then say "mem": "VRAM" and name the GPU, and `bench:stats` returns what this agent
staged for the asking initiator (served_stats, summed over rails).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Callable, Sequence

import numpy as np

from multirail.bench import protocol as proto
from multirail.bench import staging
from multirail.bench.core import TARGET_SEED, pattern
from multirail.bench.mem import BenchMem, ipc_config


def serve(*, host: str, port: int, name: str, buffer_size: int, connections: int,
          rails: list[str] | None, policy: str, chunk_size: int, timeout: float,
          stall_timeout: float, duration: float, idle_timeout: float, corrupt_offset: int | None,
          secret: str | None = None, progress: str = "adaptive", spin_us: float = 200.0,
          transport: str = "tcp", gpu: str | None = None, seg_type: str = "DRAM", device: int = 0,
          gpu_ipc: bool | None = None) -> int:
    engine = dict(host=host, port=port, connections=connections, rails=rails, policy=policy, chunk_size=chunk_size,
                  timeout=timeout, stall_timeout=stall_timeout, auth_secret=secret,  # None: $MULTIRAIL_SECRET
                  progress=progress, spin_us=spin_us, transport=transport, gpu=gpu, **ipc_config(gpu_ipc))
    return run_served(name, buffer_size, engine,
                      lambda agent, buf, mr: _loop(agent, buf, duration, idle_timeout, corrupt_offset, mr),
                      seg_type=seg_type, device=device)


def run_served(name: str, buffer_size: int, engine: dict[str, Any],
               loop: Callable[[Any, BenchMem, Any], str], prefault: bool = False,
               seg_type: str = "DRAM", device: int = 0) -> int:
    """A serving bench process (`bench target`, the kv decode side): an agent with `engine`
    (AgentConfig fields) and one registered read-write buffer (`seg_type` DRAM, or VRAM on GPU
    `device` of kind engine["gpu"]); prints the JSON ready line, runs `loop(agent, mem,
    multirail)` until it returns its exit reason, then the exit line. Exit 0 when the initiator
    stopped it. `prefault`: touch the buffer first, so no timed transfer pays its page faults."""
    import multirail  # lazy: the tool must import without the extension

    # The initiator pushes its metadata here (send_local_metadata): this agent opts in to MetaPut.
    agent = multirail.Agent(name, multirail.AgentConfig(**{"accept_metaput": True, **engine}))
    mem: BenchMem | None = None
    try:
        mem = BenchMem(buffer_size, seg_type, device, engine.get("gpu"))
        if prefault:
            mem.zero()
        reg = mem.register(agent, access="rw")
        print(json.dumps({"event": "ready", "agent": agent.name, "host": agent.host,
                          "port": agent.port, "buffer_size": buffer_size, "pid": os.getpid(),
                          "transport": _transport_of(agent), "seg_type": mem.mem_type,
                          "gpu": mem.gpu}),
              flush=True)
        try:
            reason = loop(agent, mem, multirail)
        finally:
            agent.deregister_memory(reg)
    finally:
        agent.close()
        if mem is not None:
            mem.free()
    print(json.dumps({"event": "exit", "reason": reason}), flush=True)
    return 0 if reason == "stop" else 1


def _transport_of(agent: Any) -> str | None:
    """What the serving agent runs: "tcp", "ucx (UCX 1.22.0 (wheel ...))", and per rail when that
    differs from what was asked: "auto [tcp, tcp]", "auto [ucx, tcp] (UCX ...)"."""
    try:
        info = agent.transport_info()
    except Exception:  # noqa: BLE001 - an older engine without transport_info
        return None
    kind = info.get("transport")
    per = [r.get("transport") for r in info.get("rails") or []]
    if per and any(p != kind for p in per):
        kind = f"{kind} [{', '.join(map(str, per))}]"
    return f"{kind} (UCX {info['ucx_version']})" if info.get("ucx_version") else kind


def _corrupt(buf: BenchMem, offset: int | None, limit: int) -> None:
    if offset is not None and 0 <= offset < min(limit, len(buf)):
        buf.flip(offset)


#: the control loop's longest sleep waiting for a notification; with a reply waiting for its
#: peer's metadata, it looks again after RETRY_S
WAIT_S, RETRY_S = 0.05, 0.002


def _loop(agent: Any, buf: BenchMem, duration: float, idle_timeout: float,
          corrupt_offset: int | None, mr: Any) -> str:
    start = last = time.monotonic()
    outbox: list[tuple[str, bytes]] = []
    while True:
        now = time.monotonic()
        if now - start > duration:
            return "duration"
        if now - last > idle_timeout:
            return "idle"
        # Sleep in the engine until a control message comes (one wake-up per batch): a timed
        # loop then costs this process nothing but the messages - its CPU counts in
        # benchmarks/cpu_per_byte.py.
        for peer, msgs in agent.get_new_notifs(RETRY_S if outbox else WAIT_S).items():
            for msg in msgs:
                decoded = proto.decode(msg)
                if decoded is None:
                    continue
                last = time.monotonic()
                kind, body = decoded
                if kind == proto.STOP:
                    return "stop"
                reply = _handle(kind, body, buf, corrupt_offset, agent, peer)
                if reply is not None:
                    outbox.append((peer, reply))
        outbox = send_replies(agent, outbox, mr)


def send_replies(agent: Any, outbox: list[tuple[str, bytes]], mr: Any) -> list[tuple[str, bytes]]:
    """Send each (peer, reply); returns those to retry: the peer's metadata has not arrived yet.
    A reply whose peer is gone (it closed right after its request, or vanished) is dropped
    with a line on stderr, and the target goes on serving the others."""
    pending = []
    for peer, reply in outbox:
        try:
            agent.send_notif(peer, reply)
        except mr.UnknownPeerError:
            pending.append((peer, reply))
        except mr.MultirailError as e:
            print(f"bench target: dropped a reply to {peer}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return pending


def _handle(kind: str, body: dict[str, Any], buf: BenchMem, corrupt_offset: int | None,
            agent: Any = None, peer: str | None = None) -> bytes | None:
    if kind == proto.HELLO:
        if body.get("fill"):
            buf.fill_pattern(TARGET_SEED)
            _corrupt(buf, corrupt_offset, len(buf))
        return proto.encode(proto.INFO, {"addr": buf.addr, "len": len(buf), "dev": buf.device,
                                         "mem": buf.mem_type, "gpu": buf.gpu})
    if kind == proto.STATS:
        return proto.encode(proto.STATS, {"i": body.get("i"), **served_staging(agent, peer)})
    if kind == proto.VERIFY:
        try:
            seed, off, length = int(body["seed"]), int(body["offset"]), int(body["length"])
        except (KeyError, TypeError, ValueError):
            return proto.encode(proto.VERIFIED, {"ok": False, "first_bad": None, "error": "bad request"})
        if off < 0 or length < 0 or off + length > len(buf):
            return proto.encode(proto.VERIFIED, {"ok": False, "first_bad": None, "error": "out of range"})
        _corrupt(buf, corrupt_offset, off + length)
        differ = buf.read(off, length) != pattern(seed, off, length)
        n_bad = int(np.count_nonzero(differ))
        return proto.encode(proto.VERIFIED, {"ok": n_bad == 0, "first_bad": off + int(np.argmax(differ)) if n_bad else None,
                                             "bad_bytes": n_bad, "seed": seed, "offset": off, "length": length})
    return None  # keepalive and unknown kinds only reset the idle timer


def served_staging(agent: Any, peer: str | None) -> dict[str, Any]:
    """{"staging": what this agent staged for `peer` (served_stats rows of that peer, summed
    over rails), "rows": how many} or {"error": why not}."""
    if agent is None:
        return {"error": "no agent"}
    try:
        rows = [r for r in agent.served_stats() if r.get("peer") == peer]
    except Exception as e:  # noqa: BLE001 - an engine without served_stats: the initiator says so
        return {"error": f"served_stats failed: {type(e).__name__}: {e}"}
    if rows and not any(isinstance(r.get("staging"), dict) for r in rows):
        return {"error": "this target's engine reports no staging totals"}
    return {"staging": staging.total(rows), "rows": len(rows)}



# -- starting a target process (used by `bench local` and the failover drills) -------------------

def launch(cmd: Sequence[str], ready_timeout: float = 30.0,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], dict[str, Any], IO[str]]:
    """Start a `bench target` command line (possibly behind `ip netns exec NS`) and wait for its
    ready line. Returns (process, ready dict, stderr file). Raises RuntimeError with the
    target's stderr when it does not become ready; the process is then already stopped."""
    errf = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + ready_timeout
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = proc.stdout.readline()
                if not line:
                    break
                try:
                    ready = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ready, dict) and ready.get("event") == "ready":
                    return proc, ready, errf
            elif proc.poll() is not None:
                break
    finally:
        sel.close()
    stop(proc, grace=0.0)
    errf.seek(0)
    tail = errf.read().strip()[-800:]
    errf.close()
    raise RuntimeError("bench target did not become ready: " + (tail or "no output"))


def stop(proc: subprocess.Popen[str], grace: float = 5.0) -> None:
    """Close its stdin (children that wait for EOF there then finish), wait up to `grace` s for
    the process to exit by itself, then kill it (by PID: exactly the child we started)."""
    if proc.stdin:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=grace) if grace > 0 else None
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)
