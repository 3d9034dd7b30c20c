"""The worker abstraction and the sweep harness (style item 11).

A `Worker` knows how to move `batch_size` blocks of `block_size` bytes once (`run_once`),
how to verify the last result (`verify`), and what its own per-rail accounting says
(`engine_rails`). `run_sweep` is the one harness: for each block size it prepares the
worker (handles are built once per size and reused: no per-iteration planning), runs warmup
iterations, then the timed loop (one latency sample per transfer; throughput = bytes / wall
time of the whole loop), reading the rail counters just before and just after the loop.

`EngineWorker` drives `multirail.Agent` against a `bench target`; the baselines (iperf3,
mr-pingpong, in baseline.py) produce the same `BenchRow`s so one table prints both.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from typing import Any, Callable, Protocol

import numpy as np

from multirail.bench import protocol as proto
from multirail.bench.core import (TARGET_SEED, BenchRow, Progress, RailRow, format_size,
                                  first_mismatch, make_row, pattern, seed_for)
from multirail.bench.rails import RailCounters


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
              progress: Progress, keepalive: Callable[[], None] | None = None) -> list[BenchRow]:
    rows: list[BenchRow] = []
    for bs in sizes:
        label = f"{op} {format_size(bs)} x{batch_size}"
        worker.prepare(bs, batch_size, check)
        try:
            for i in range(warmup):
                progress.update(f"{label}: warmup {i + 1}/{warmup}")
                worker.run_once()
            eng_before = worker.engine_rails()
            before = counters.snapshot() if counters else {}
            lat: list[float] = []
            step = max(1, iters // 50)
            cpu_start = time.thread_time()  # this thread posts and waits: what waiting costs
            t_start = time.perf_counter()
            for i in range(iters):
                t0 = time.perf_counter()
                worker.run_once()
                lat.append(time.perf_counter() - t0)
                if i % step == 0:
                    progress.update(f"{label}: iter {i + 1}/{iters}")
            wall = time.perf_counter() - t_start
            cpu = time.thread_time() - cpu_start
            after = counters.snapshot() if counters else {}
            eng_after = worker.engine_rails()
            row = make_row(op, bs, batch_size, lat, wall, worker=worker.name)
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
                 transport: str = "tcp") -> None:
        import multirail  # lazy: the tool must import without the extension

        self.mr = multirail
        self.op = op
        self.transport = transport
        self.timeout = timeout
        local = rails[0] if rails and _looks_like_ip(rails[0]) else local_addr_towards(target_host, target_port)
        cfg = multirail.AgentConfig(host=local, port=0, connections=connections, rails=rails,
                                    policy=policy, chunk_size=chunk_size, timeout=timeout,
                                    stall_timeout=stall_timeout, auth_secret=secret,  # None: $MULTIRAIL_SECRET
                                    progress=progress, spin_us=spin_us, transport=transport)
        self.agent = multirail.Agent(f"mr-bench-initiator-{os.getpid()}", cfg)
        self.peer = target_name
        self.buf = np.zeros(buffer_size, dtype=np.uint8)
        self.reg = self.agent.register_memory(self.buf)
        self._handle: Any = None
        self._layout = (0, 0)
        self._stopped = False
        self.stale_replies = 0  # replies skipped because they answered an earlier request
        self.last_verified: dict[str, Any] = {}  # the target's last `bench:verified` reply
        try:
            self.agent.fetch_remote_metadata(target_name, target_host, target_port)
            self._wait_for(lambda: self.agent.check_remote_metadata(target_name),
                           f"metadata of {target_name!r} from {target_host}:{target_port}")
            self.agent.send_local_metadata(target_host, target_port)
            self.agent.send_notif(self.peer, proto.encode(proto.HELLO, {"fill": fill_target}))
            info = self._await_reply(proto.INFO)
        except BaseException:
            self.agent.close()
            raise
        self.remote_addr, self.remote_len, self.remote_dev = int(info["addr"]), int(info["len"]), int(info.get("dev", 0))
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

    def _await_reply(self, kind: str, match: dict[str, Any] | None = None) -> dict[str, Any]:
        """The next `kind` reply whose body agrees with `match` (older or duplicate replies, e.g.
        of a notification the engine delivered twice, are skipped)."""
        deadline = time.monotonic() + max(self.timeout, 30.0)
        while time.monotonic() < deadline:
            for msg in self.agent.get_new_notifs().get(self.peer, []):
                decoded = proto.decode(msg)
                if decoded and decoded[0] == kind:
                    if match and any(k in decoded[1] and decoded[1][k] != v for k, v in match.items()):
                        self.stale_replies += 1
                        continue
                    return decoded[1]
            time.sleep(0.002)
        raise BenchFailure(f"timed out waiting for the target's {kind!r} reply")

    def prepare(self, block_size: int, batch_size: int, check: bool) -> None:
        span = block_size * batch_size
        if span > len(self.buf):
            raise BenchFailure(f"block {format_size(block_size)} x batch {batch_size} = "
                               f"{format_size(span)} exceeds the buffer ({format_size(len(self.buf))})")
        offsets = np.arange(batch_size, dtype=np.uint64) * np.uint64(block_size)
        local = np.stack([offsets + np.uint64(self.buf.ctypes.data),
                          np.full(batch_size, block_size, np.uint64), np.zeros(batch_size, np.uint64)], axis=1)
        remote = np.stack([offsets + np.uint64(self.remote_addr),
                           np.full(batch_size, block_size, np.uint64),
                           np.full(batch_size, self.remote_dev, np.uint64)], axis=1)
        if check:
            if self.op == "READ":
                self.buf[:span] = 0  # stale data from a previous size must not pass the check
            else:
                self.buf[:span] = pattern(seed_for(block_size, self.op), 0, span)
        self._layout = (block_size, batch_size)
        self._handle = self.agent.initialize_xfer(
            self.op, self.agent.get_xfer_descs(local), self.agent.get_xfer_descs(remote), self.peer)

    @property
    def handle(self) -> Any:
        """The transfer handle built by the last `prepare` (for callers that post it themselves)."""
        return self._handle

    def run_once(self) -> None:
        # Post + wait in one engine call (Agent.transfer_sync): the blocking round trip.
        self.agent.transfer_sync(self._handle, timeout=self.timeout)

    def verify(self) -> str | None:
        bs, batch = self._layout
        span = bs * batch
        if self.op == "READ":
            bad = first_mismatch(self.buf[:span], TARGET_SEED, 0)
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
        """The configured transport, what the engine loaded and each rail's transport string."""
        return transport_report(self.agent, self.peer, self.transport)

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
            try:
                self.agent.deregister_memory(self.reg)
            finally:
                self.agent.close()


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
        out["rails"] = [{"name": str(s.get("name", i)), "transport": s.get("transport")}
                        for i, s in enumerate(agent.rail_stats(peer))]
    except Exception:  # noqa: BLE001 - no link (yet) to the peer
        pass
    return out


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
    """One human line: `transport: ucx (UCX 1.13.1 ...); rails: r0=ucx/tcp, r1=ucx/tcp`."""
    line = f"transport: {report.get('transport')}"
    if report.get("ucx_version"):
        line += f" (UCX {report['ucx_version']})"
    rails = report.get("rails") or []
    if rails:
        line += "; rails: " + ", ".join(f"{r.get('name')}={r.get('transport')}" for r in rails)
    if report.get("target_transport"):
        line += f"; target: {report['target_transport']}"
    return line


def _looks_like_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False
