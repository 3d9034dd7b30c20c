"""The worker abstraction and the sweep harness (style item 11).

A `Worker` knows how to move `batch_size` blocks of `block_size` bytes once (`run_once`),
how to verify the last result (`verify`), and what its own per-rail accounting says
(`engine_rails`). `run_sweep` is the one harness: for each block size it prepares the
worker (handles are built once per size and reused: no per-iteration planning), runs warmup
iterations, then the timed loop (one latency sample per transfer; throughput = bytes / wall
time of the whole loop), reading the rail counters just before and just after the loop.

`EngineWorker` drives `multirail.Agent` against a `bench target`; the baselines (iperf3,
mr-pingpong, in baseline.py) produce the same `BenchRow`s so one table prints both.

A worker may also offer `staging_snapshot()` / `staging_breakdown(before, after, wall_s)`:
`run_sweep` then reads the staging totals just outside each timed loop and puts the per-stage
breakdown (bench/staging.py) on the row. EngineWorker does when a side is VRAM.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from typing import Any, Callable, Protocol

import numpy as np

from multirail.bench import protocol as proto
from multirail.bench import staging
from multirail.bench.core import (TARGET_SEED, BenchRow, Progress, RailRow, format_size,
                                  first_mismatch, make_row, seed_for)
from multirail.bench.mem import BenchMem, ipc_config
from multirail.bench.rails import RailCounters

STATS_TIMEOUT_S = 5.0  # a target that does not answer bench:stats by then is not asked again


class BenchFailure(RuntimeError):
    """A runtime failure of the bench itself (exit code 1), with a readable message."""


class Worker(Protocol):
    name: str

    def prepare(self, block_size: int, batch_size: int, check: bool) -> None: ...
    @property
    def handle(self) -> Any:
        """The transfer handle built by the last `prepare` (for callers that post it themselves)."""
        return self._handle

    def run_once(self) -> None: ...
    def verify(self) -> str | None: ...          # None when the data is right, else why not
    def engine_rails(self) -> dict[str, int]: ...  # rail name -> bytes so far
    def finish_size(self) -> None: ...
    def close(self) -> None: ...


def run_sweep(worker: Worker, op: str, sizes: list[int], batch_size: int, iters: int,
              warmup: int, check: bool, counters: RailCounters | None,
              progress: Progress, keepalive: Callable[[], None] | None = None,
              trace: bool = False) -> list[BenchRow]:
    """Per block size: warm-up, then `iters` timed transfers. `trace`: keep each timed transfer's
    latency and per-rail trace (`XferHandle.trace`) in `BenchRow.traces`."""
    rows: list[BenchRow] = []
    stage_snap = getattr(worker, "staging_snapshot", None)
    for bs in sizes:
        label = f"{op} {format_size(bs)} x{batch_size}"
        worker.prepare(bs, batch_size, check)
        try:
            for i in range(warmup):
                progress.update(f"{label}: warmup {i + 1}/{warmup}")
                worker.run_once()
            st_before = stage_snap() if stage_snap else None
            eng_before = worker.engine_rails()
            before = counters.snapshot() if counters else {}
            lat: list[float] = []
            traces: list[dict[str, Any]] | None = [] if trace else None
            step = max(1, iters // 50)
            cpu_start = time.thread_time()  # this thread posts and waits: what waiting costs
            t_start = time.perf_counter()
            for i in range(iters):
                t0 = time.perf_counter()
                worker.run_once()
                lat.append(time.perf_counter() - t0)
                if traces is not None:
                    traces.append({"lat_us": lat[-1] * 1e6, **(worker.handle.trace() or {})})
                if i % step == 0:
                    progress.update(f"{label}: iter {i + 1}/{iters}")
            wall = time.perf_counter() - t_start
            cpu = time.thread_time() - cpu_start
            after = counters.snapshot() if counters else {}
            eng_after = worker.engine_rails()
            st_after = stage_snap() if stage_snap else None
            row = make_row(op, bs, batch_size, lat, wall, worker=worker.name)
            row.traces = traces
            if st_before is not None and st_after is not None:
                row.staging = worker.staging_breakdown(st_before, st_after, wall)  # type: ignore[attr-defined]
            row.cpu_pct = 100.0 * cpu / wall if wall > 0 else None
            if counters:
                row.rails = counters.delta(before, after, wall)
            row.engine_rails = [
                RailRow(name=k, bytes=max(0, eng_after[k] - eng_before.get(k, 0)),
                        gbps=max(0, eng_after[k] - eng_before.get(k, 0)) * 8 / wall / 1e9,
                        source="engine")
                for k in eng_after]
            if check:
                progress.update(f"{label}: verifying")
                problem = worker.verify()
                row.consistency = "ok" if problem is None else f"FAILED: {problem}"
            rows.append(row)
        finally:
            worker.finish_size()
        if keepalive:
            keepalive()
    progress.clear()
    return rows


def local_addr_towards(host: str, port: int) -> str:
    """The local IPv4 address the kernel would use to reach host:port (UDP connect, no traffic)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port or 9))
            return s.getsockname()[0]
        except OSError as e:
            raise BenchFailure(f"no route to {host}: {e}") from None


class EngineWorker:
    """Initiator side: a multirail Agent reading from / writing to a `bench target`."""

    name = "multirail"

    def __init__(self, *, op: str, target_host: str, target_port: int, target_name: str,
                 buffer_size: int, connections: int, rails: list[str] | None, policy: str,
                 chunk_size: int, timeout: float, fill_target: bool, stall_timeout: float = 0.5,
                 secret: str | None = None, progress: str = "adaptive", spin_us: float = 200.0,
                 transport: str = "tcp", gpu: str | None = None, seg_type: str = "DRAM",
                 target_seg_type: str = "DRAM", device: int = 0, gpu_ipc: bool | None = None) -> None:
        import multirail  # lazy: the tool must import without the extension

        self.mr = multirail
        self.op = op
        self.transport = transport
        self.timeout = timeout
        self.gpu = gpu
        local = rails[0] if rails and _looks_like_ip(rails[0]) else local_addr_towards(target_host, target_port)
        cfg = multirail.AgentConfig(host=local, port=0, connections=connections, rails=rails,
                                    policy=policy, chunk_size=chunk_size, timeout=timeout,
                                    stall_timeout=stall_timeout, auth_secret=secret,  # None: $MULTIRAIL_SECRET
                                    progress=progress, spin_us=spin_us, transport=transport, gpu=gpu,
                                    **ipc_config(gpu_ipc))
        self.agent = multirail.Agent(f"mr-bench-initiator-{os.getpid()}", cfg)
        self.peer = target_name
        self.mem: BenchMem | None = None
        self.reg: Any = None
        self._handle: Any = None
        self._layout = (0, 0)
        self._span = 0
        self._stopped = False
        self.stale_replies = 0  # replies skipped because they answered an earlier request
        self.last_verified: dict[str, Any] = {}  # the target's last `bench:verified` reply
        self._stats_seq = 0
        self.target_stats_note: str | None = None  # why the target's staging is not measured
        self._moved = 0  # bytes of the transfers done (warmup included): what the target staged for us
        try:
            self.mem = BenchMem(buffer_size, seg_type, device, gpu)
            self.reg = self.mem.register(self.agent)
        except BaseException:
            self.agent.close()
            if self.mem is not None:
                self.mem.free()
            raise
        self.buf = self.mem.host  # DRAM: the numpy array (None for VRAM)
        try:
            self.agent.fetch_remote_metadata(target_name, target_host, target_port)
            self._wait_for(lambda: self.agent.check_remote_metadata(target_name),
                           f"metadata of {target_name!r} from {target_host}:{target_port}")
            self.agent.send_local_metadata(target_host, target_port)
            self.agent.send_notif(self.peer, proto.encode(proto.HELLO, {"fill": fill_target}))
            info = self._await_reply(proto.INFO)
        except BaseException:
            self._stopped = True
            self._release()
            raise
        self.remote_addr, self.remote_len, self.remote_dev = int(info["addr"]), int(info["len"]), int(info.get("dev", 0))
        self.remote_mem = str(info.get("mem") or "DRAM")  # an older target sends none: DRAM
        self.target_gpu = info.get("gpu")
        self.measure_staging = "VRAM" in (self.mem.mem_type, self.remote_mem)
        if self.remote_mem != target_seg_type:
            self._stopped = True  # a usage mistake on this side: leave the target serving
            self.close()
            raise BenchFailure(f"the target serves {self.remote_mem} but --target-seg-type is {target_seg_type}: "
                               f"start the target with --target-seg-type {target_seg_type} (or run this side "
                               f"with --target-seg-type {self.remote_mem})")
        if self.remote_len < buffer_size:
            self.close()
            raise BenchFailure(f"target buffer is {format_size(self.remote_len)}, smaller than "
                               f"--total-buffer-size {format_size(buffer_size)}; start the target "
                               "with a larger --total-buffer-size")

    def _wait_for(self, cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not cond():
            if time.monotonic() > deadline:
                raise BenchFailure(f"timed out after {self.timeout:.0f} s waiting for {what}")
            time.sleep(0.005)

    def _await_reply(self, kind: str, match: dict[str, Any] | None = None,
                     timeout: float | None = None) -> dict[str, Any]:
        """The next `kind` reply whose body agrees with `match` (older or duplicate replies, e.g.
        of a notification the engine delivered twice, are skipped)."""
        deadline = time.monotonic() + (max(self.timeout, 30.0) if timeout is None else timeout)
        while (left := deadline - time.monotonic()) > 0:
            for msg in self.agent.get_new_notifs(min(left, 0.05)).get(self.peer, []):
                decoded = proto.decode(msg)
                if decoded and decoded[0] == kind:
                    if match and any(k in decoded[1] and decoded[1][k] != v for k, v in match.items()):
                        self.stale_replies += 1
                        continue
                    return decoded[1]
        raise BenchFailure(f"timed out waiting for the target's {kind!r} reply")

    def prepare(self, block_size: int, batch_size: int, check: bool) -> None:
        assert self.mem is not None
        span = block_size * batch_size
        if span > len(self.mem):
            raise BenchFailure(f"block {format_size(block_size)} x batch {batch_size} = "
                               f"{format_size(span)} exceeds the buffer ({format_size(len(self.mem))})")
        offsets = np.arange(batch_size, dtype=np.uint64) * np.uint64(block_size)
        local = np.stack([offsets + np.uint64(self.mem.addr), np.full(batch_size, block_size, np.uint64),
                          np.full(batch_size, self.mem.device, np.uint64)], axis=1)
        remote = np.stack([offsets + np.uint64(self.remote_addr),
                           np.full(batch_size, block_size, np.uint64),
                           np.full(batch_size, self.remote_dev, np.uint64)], axis=1)
        if check:
            if self.op == "READ":
                self.mem.zero(0, span)  # stale data from a previous size must not pass the check
            else:
                self.mem.fill_pattern(seed_for(block_size, self.op), 0, span)
        self._layout = (block_size, batch_size)
        self._span = span
        self._handle = self.agent.initialize_xfer(
            self.op, self.agent.get_xfer_descs(local, self.mem.mem_type),
            self.agent.get_xfer_descs(remote, self.remote_mem), self.peer)

    @property
    def handle(self) -> Any:
        """The transfer handle built by the last `prepare` (for callers that post it themselves)."""
        return self._handle

    def run_once(self) -> None:
        # Post + wait in one engine call (Agent.transfer_sync): the blocking round trip.
        self.agent.transfer_sync(self._handle, timeout=self.timeout)
        self._moved += self._span

    def verify(self) -> str | None:
        bs, batch = self._layout
        span = bs * batch
        if self.op == "READ":
            assert self.mem is not None
            bad = first_mismatch(self.mem.read(0, span), TARGET_SEED, 0)
            return None if bad is None else f"byte at offset {bad} differs from the target's pattern"
        return self.verify_remote(seed_for(bs, self.op), 0, span)

    def verify_remote(self, seed: int, offset: int, length: int) -> str | None:
        """Ask the target to check its range [offset, offset+length) against `pattern(seed)`."""
        self.agent.send_notif(self.peer, proto.encode(
            proto.VERIFY, {"seed": seed, "offset": offset, "length": length}))
        res = self._await_reply(proto.VERIFIED, {"seed": seed, "offset": offset, "length": length})
        self.last_verified = res
        if res.get("ok"):
            return None
        n = res.get("bad_bytes")
        return (f"target reports byte at offset {res.get('first_bad')} differs from what was written"
                + (f" ({n} bytes differ)" if n is not None else ""))

    def engine_rails(self) -> dict[str, int]:
        try:
            stats = self.agent.rail_stats(self.peer)
        except (AttributeError, NotImplementedError):
            return {}
        return {str(s.get("name", i)): int(s.get("bytes", 0)) for i, s in enumerate(stats)}

    def transport_report(self) -> dict[str, Any]:
        """The configured transport, what the engine loaded, each rail's transport string and GPU
        path, and "memory" (memory_report)."""
        out = transport_report(self.agent, self.peer, self.transport)
        assert self.mem is not None
        out["memory"] = memory_report(self.mem, self.remote_mem, self.target_gpu, self.gpu,
                                      peer_counters(self.agent, self.peer))
        return out

    # -- staging breakdown (runs with VRAM) -------------------------------------------------------

    def staging_snapshot(self) -> dict[str, Any] | None:
        """The initiator's staging totals (rail_stats to the target, summed over rails) and the
        target's for this initiator (bench:stats), or None when no side is VRAM."""
        if not self.measure_staging:
            return None
        return {**self._initiator_staging(), "target": self._target_staging()}

    def _initiator_staging(self) -> dict[str, Any]:
        """The initiator's totals once they include every transfer done so far. A staged WRITE
        chunk adds its totals when its sender returns from the socket, which can be after the
        target's answer completed the transfer (a preempted sender): for WRITEs of VRAM the
        D2H bytes are awaited (up to 1 s) until they reach what was written (less CUDA IPC),
        as the target's are for READs."""
        deadline = time.monotonic() + 1.0
        while True:
            init, ipc = staging.initiator_side(self.agent, self.peer)
            if self.op != "WRITE" or self.mem.mem_type != "VRAM" or time.monotonic() > deadline:
                return {"initiator": init, "ipc": ipc}
            if init["d2h"]["bytes"] >= self._moved - (ipc or {"bytes": 0})["bytes"]:
                return {"initiator": init, "ipc": ipc}
            time.sleep(0.001)

    def _target_staging(self) -> dict[str, Any] | None:
        """The target's totals once they include every transfer done so far. A served READ of
        VRAM adds its totals just after its last bytes are sent, so the initiator can hold them
        before the target's counters do: for READs the target's D2H bytes are awaited (up to
        1 s) until they reach what was read (less what went by CUDA IPC). WRITEs are counted
        before the target answers them."""
        deadline = time.monotonic() + 1.0
        while self.target_stats_note is None:
            self._stats_seq += 1
            got, self.target_stats_note = ask_target_staging(
                self.agent, self.peer, self._stats_seq,
                lambda i: self._await_reply(proto.STATS, {"i": i}, timeout=STATS_TIMEOUT_S))
            if got is None or self.op != "READ" or self.remote_mem != "VRAM" or time.monotonic() > deadline:
                return got
            ipc = staging.ipc_counters(peer_counters(self.agent, self.peer)) or {"bytes": 0}
            if got["d2h"]["bytes"] >= self._moved - ipc["bytes"]:
                return got
            time.sleep(0.001)
        return None

    def staging_breakdown(self, before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
        assert self.mem is not None
        return stage_breakdown(before, after, wall_s, self.target_stats_note,
                               {"initiator": self.mem.mem_type, "target": self.remote_mem})

    def finish_size(self) -> None:
        if self._handle is not None:
            self.agent.release_xfer_handle(self._handle)
            self._handle = None

    def keepalive(self) -> None:
        self.agent.send_notif(self.peer, proto.encode(proto.KEEPALIVE))

    def close(self) -> None:
        try:
            if not self._stopped:
                self._stopped = True
                self.agent.send_notif(self.peer, proto.encode(proto.STOP))
        except self.mr.MultirailError:
            pass  # the target also stops on its idle timeout
        finally:
            self._release()

    def _release(self) -> None:
        try:
            if self.reg is not None:
                self.agent.deregister_memory(self.reg)
                self.reg = None
        finally:
            self.agent.close()
            if self.mem is not None:
                self.mem.free()  # after close: nothing of the engine touches it any more


def transport_report(agent: Any, peer: str, configured: str) -> dict[str, Any]:
    """{"transport": the --transport asked for, "engine": what the agent runs ("tcp"/"ucx"),
    "ucx_version", "rails": [{"name", "transport"}] from `rail_stats(peer)` ("tcp", "ucx/tcp",
    "ucx/rc_mlx5", ...)}. Read while the link to `peer` is up (before close). Never raises."""
    out: dict[str, Any] = {"transport": configured, "engine": None, "ucx_version": None, "rails": []}
    try:
        info = agent.transport_info()
        out["engine"], out["ucx_version"] = info.get("transport"), info.get("ucx_version")
    except Exception:  # noqa: BLE001 - an older engine without transport_info
        pass
    try:
        out["rails"] = [{"name": str(s.get("name", i)), "transport": s.get("transport"),
                         "transport_reason": s.get("transport_reason"), "fallbacks": s.get("fallbacks"),
                         "transport_switches": s.get("transport_switches"),
                         "gpu_path": s.get("gpu_path"), "gpu_path_reason": s.get("gpu_path_reason"),
                         "tier_location": s.get("tier_location"), "tier": s.get("tier"),
                         "tier_class": s.get("tier_class"), "tier_reason": s.get("tier_reason"),
                         "fallback_bytes": s.get("fallback_bytes")}
                        for i, s in enumerate(agent.rail_stats(peer))]
    except Exception:  # noqa: BLE001 - no link (yet) to the peer
        pass
    try:
        out["affinity"] = agent.affinity_info()
    except Exception:  # noqa: BLE001 - an engine without rail choice by location
        out["affinity"] = None
    return out


def format_affinity(report: dict[str, Any], gpu: int | None = None) -> str | None:
    """One human line on the rail choice by memory location (issue 34): `rail choice (topology of
    /sys): gpu:0: tier 0 PIX [eth0, eth1], tier 1 NODE [eth2]; numa:0: ...`; with `gpu`, only
    that GPU's location (and the host's). None when the agent tiers nothing."""
    aff = report.get("affinity") or {}
    locs = aff.get("locations") or {}
    if not locs:
        if gpu is not None:
            why = "; ".join(aff.get("notes") or []) or "no topology"
            return f"rail choice: every rail for gpu:{gpu} ({why})"
        return None
    keep = {k: v for k, v in locs.items() if gpu is None or k == f"gpu:{gpu}" or k.startswith("numa:")}
    parts = []
    for loc, tiers in keep.items():
        parts.append(f"{loc}: " + ", ".join(f"tier {t['tier']} {t['class']} [{', '.join(t['rails'])}]" for t in tiers))
    if gpu is not None and f"gpu:{gpu}" not in keep:
        parts.insert(0, f"gpu:{gpu}: every rail (the topology pairs no rail with it)")
    return f"rail choice ({aff.get('source')}): " + "; ".join(parts)


def ask_target_staging(agent: Any, peer: str, seq: int, take: Callable[[int], dict[str, Any]]
                       ) -> tuple[dict[str, Any] | None, str | None]:
    """Sends `bench:stats {"i": seq}` and waits with `take(seq)` (the reply's body, or
    BenchFailure on timeout): (the target's staging totals, None) or (None, why not)."""
    from multirail.errors import MultirailError

    try:
        agent.send_notif(peer, proto.encode(proto.STATS, {"i": seq}))
        res = take(seq)
    except BenchFailure:
        return None, f"the target did not answer bench:stats within {STATS_TIMEOUT_S:g} s (an older bench?)"
    except MultirailError as e:
        return None, f"bench:stats could not be sent: {e}"
    if not isinstance(res.get("staging"), dict):
        return None, f"the target reports no staging totals: {res.get('error', 'no staging')}"
    return res["staging"], None


def peer_counters(agent: Any, peer: str) -> dict[str, Any] | None:
    try:
        return dict(agent.peer_counters(peer))
    except Exception:  # noqa: BLE001 - an engine without peer_counters, or no link
        return None


def stage_breakdown(before: dict[str, Any], after: dict[str, Any], wall_s: float, target_note: str | None,
                    seg_types: dict[str, str]) -> dict[str, Any]:
    """staging.breakdown of two snapshots {"initiator", "ipc", "target" (None: not reachable)}."""
    tgt = (before["target"], after["target"]) if before.get("target") and after.get("target") else None
    return staging.breakdown(wall_s, (before["initiator"], after["initiator"]), tgt,
                             None if tgt else (target_note or "not reachable"),
                             ipc=(before.get("ipc"), after.get("ipc")), seg_types=seg_types)


def memory_report(mem: BenchMem, target_seg_type: str, target_gpu: dict[str, Any] | None,
                  kind: str | None, counters: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"initiator_seg_type", "target_seg_type", "gpu_kind" (None when no side is VRAM),
    "device_id", "initiator_gpu", "target_gpu" ({"kind", "device", "name"} of each VRAM side),
    "ipc": {"transfers", "bytes", "regions_mapped", "fallback_reason"} from peer_counters (None:
    no side is VRAM, or an engine without CUDA IPC)}."""
    vram = "VRAM" in (mem.mem_type, target_seg_type)
    ipc = None
    if vram and counters and "ipc_transfers" in counters:
        ipc = {"transfers": counters.get("ipc_transfers"), "bytes": counters.get("ipc_bytes"),
               "regions_mapped": counters.get("ipc_regions_mapped"),
               "fallback_reason": counters.get("ipc_fallback_reason") or None}
    return {"initiator_seg_type": mem.mem_type, "target_seg_type": target_seg_type,
            "gpu_kind": (kind or (mem.gpu or target_gpu or {}).get("kind")) if vram else None,
            "device_id": mem.device if mem.is_vram else (target_gpu or {}).get("device"),
            "initiator_gpu": mem.gpu, "target_gpu": target_gpu, "ipc": ipc}


def format_memory(memory: dict[str, Any] | None, report: dict[str, Any] | None = None) -> str:
    """One human line: the seg types, each VRAM side's GPU, and each rail's GPU path, e.g.
    `memory: initiator VRAM, target DRAM; initiator GPU: standin 0 "stand-in 0 (host memory)";
    gpu path: default=staged (tcp rails carry host memory only: ...)`."""
    if not memory:
        return "memory: initiator DRAM, target DRAM"
    line = f"memory: initiator {memory.get('initiator_seg_type')}, target {memory.get('target_seg_type')}"
    if not memory.get("gpu_kind"):
        return line
    for who in ("initiator", "target"):
        g = memory.get(f"{who}_gpu")
        if g:
            line += f'; {who} GPU: {g.get("kind")} {g.get("device")} "{g.get("name")}"'
    rails = [r for r in (report or {}).get("rails", []) if r.get("gpu_path")]
    if rails:
        reasons = {r.get("gpu_path_reason") for r in rails}
        line += "; gpu path: " + ", ".join(f"{r.get('name')}={r.get('gpu_path')}" for r in rails)
        if len(reasons) == 1 and None not in reasons:
            line += f" ({reasons.pop()})"
        else:
            line += "".join(f"; {r.get('name')}: {r.get('gpu_path_reason')}" for r in rails if r.get("gpu_path_reason"))
    ipc = memory.get("ipc")
    if ipc:
        if ipc.get("transfers"):
            line += f"; CUDA IPC: {ipc['transfers']} transfers ({ipc.get('bytes')} B) as device copies"
        if ipc.get("fallback_reason"):
            line += f"; CUDA IPC not used: {ipc['fallback_reason']}"
    return line


def label_rail_transports(rows: list[Any], report: dict[str, Any]) -> None:
    """Name each engine rail row's transport (RailRow.transport) from a transport report."""
    by_name = {r.get("name"): r.get("transport") for r in report.get("rails", [])}
    for row in rows:
        for i, e in enumerate(row.engine_rails):
            t = by_name.get(e.name)
            if t is None and i < len(report.get("rails", [])):
                t = report["rails"][i].get("transport")
            e.transport = t


def format_transport(report: dict[str, Any]) -> str:
    """One human line: `transport: auto (UCX 1.13.1 ...); rails: r0=ucx/rc_mlx5 (auto: RDMA device
    mlx5_0, UCX has ib), r1=tcp (auto: no RDMA device)`; a rail that switched says how often."""
    line = f"transport: {report.get('transport')}"
    if report.get("ucx_version"):
        line += f" (UCX {report['ucx_version']})"
    rails = report.get("rails") or []

    def one(r: dict[str, Any]) -> str:
        txt = f"{r.get('name')}={r.get('transport')}"
        if r.get("transport_reason"):
            txt += f" ({r['transport_reason']})"
        if r.get("transport_switches"):
            txt += f" [{r.get('fallbacks') or 0} fallback(s), {r['transport_switches']} switch(es)]"
        if r.get("tier_location") is not None:
            txt += f" [{r['tier_location']} tier {r.get('tier')} {r.get('tier_class')}"
            if r.get("fallback_bytes"):
                txt += f", {r['fallback_bytes']} B as fallback"
            txt += "]"
        return txt

    if rails:
        line += "; rails: " + ", ".join(one(r) for r in rails)
    if report.get("target_transport"):
        line += f"; target: {report['target_transport']}"
    return line


def _looks_like_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False
