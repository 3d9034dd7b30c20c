"""`bench kv`'s prefill side: `KvInitiator` writes each request's pages layer by layer and times them;
`KvRow` is one workload's result. Part of `multirail.bench.kv` (docs/bench-kv.md), which
re-exports every name here."""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from multirail.bench import protocol as proto
from multirail.bench import staging
from multirail.bench.core import RailRow, format_size, percentile
from multirail.bench.mem import BenchMem, ipc_config
from multirail.bench.worker import BenchFailure
from multirail.bench.kv_plan import DEFAULT_SEED, KV_BEGIN, KV_CLOCK, KV_DONE, KV_LAYER, KV_READY, KV_REQ, KvPlan, PagePool


@dataclass
class KvRow:
    """One workload of one run (the unit of the table and of the JSON file)."""

    worker: str
    workload: str  # kv | contiguous
    requests: int
    concurrency: int
    request_bytes: int
    total_bytes: int
    seconds: float
    gbps: float
    gb_per_s: float
    lat_avg_us: float
    lat_p50_us: float
    lat_p99_us: float
    lat_min_us: float
    lat_max_us: float
    decode_lat_p50_us: float | None = None
    decode_lat_p99_us: float | None = None
    transfers: int = 0          # WRITEs posted (one per layer, or one per request)
    descs: int = 0              # page descriptors posted
    prep: str = "fresh"
    prep_s: float = 0.0         # in initialize_xfer
    post_s: float = 0.0         # in transfer
    build_s: float = 0.0        # forming the numpy rows
    prep_once_s: float = 0.0    # --prep reuse: preparing each slot's handles once (not in the rates)
    descs_per_s: float | None = None       # descs / (prep_s + post_s)
    prep_descs_per_s: float | None = None  # descs / prep_s
    post_descs_per_s: float | None = None  # descs / post_s
    build_descs_per_s: float | None = None
    capacity_gbps: float | None = None
    pct_of_capacity: float | None = None
    consistency: str = "not checked"
    rails: list[RailRow] = field(default_factory=list)
    engine_rails: list[RailRow] = field(default_factory=list)
    latencies_us: list[float] = field(default_factory=list)
    decode_latencies_us: list[float] = field(default_factory=list)
    cpu_pct: float | None = None
    staging: dict[str, Any] | None = None  # runs with VRAM: per-stage breakdown (bench/staging.py)
    rounds: int = 1             # timed segments, interleaved with the other workload's (--rounds)
    # The engine's failure handling during the timed requests, summed over rails (rail_stats):
    # stalls, times_down, readmissions, reissued. A slow run with all zero was not failover.
    rail_events: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def set_capacity(self, caps_gbps: list[float | None]) -> None:
        for i, rail in enumerate(self.rails):
            if i < len(caps_gbps) and caps_gbps[i]:
                rail.capacity_gbps = caps_gbps[i]
        caps = [r.capacity_gbps for r in self.rails]
        if self.rails and all(caps):
            self.capacity_gbps = float(sum(c for c in caps if c))
            self.pct_of_capacity = 100.0 * self.gbps / self.capacity_gbps if self.capacity_gbps else None


def kv_row(worker: str, workload: str, plan: KvPlan, lat_ns: list[int], wall_s: float,
           decode_ns: list[int] | None = None, **extra: Any) -> KvRow:
    n = len(lat_ns)
    total = plan.request_bytes * n
    us = sorted(x / 1e3 for x in lat_ns)
    dus = sorted(x / 1e3 for x in decode_ns) if decode_ns else []
    gbs = total / wall_s / 1e9 if wall_s > 0 else 0.0
    row = KvRow(worker=worker, workload=workload, requests=n, concurrency=plan.concurrency,
                request_bytes=plan.request_bytes, total_bytes=total, seconds=wall_s, gbps=8 * gbs, gb_per_s=gbs,
                lat_avg_us=sum(us) / n if n else float("nan"), lat_p50_us=percentile(us, 50),
                lat_p99_us=percentile(us, 99), lat_min_us=us[0] if n else float("nan"),
                lat_max_us=us[-1] if n else float("nan"),
                decode_lat_p50_us=percentile(dus, 50) if dus else None,
                decode_lat_p99_us=percentile(dus, 99) if dus else None,
                latencies_us=us, decode_latencies_us=dus, **extra)
    if row.descs:
        if row.prep_s + row.post_s > 0:
            row.descs_per_s = row.descs / (row.prep_s + row.post_s)
        row.prep_descs_per_s = row.descs / row.prep_s if row.prep_s > 0 else None
        row.post_descs_per_s = row.descs / row.post_s if row.post_s > 0 else None
        row.build_descs_per_s = row.descs / row.build_s if row.build_s > 0 else None
    return row


#: the longest the reply pump sleeps in the engine before it looks at its slot threads again
PUMP_WAIT_S = 0.005
#: rail_stats counters of the engine's failure handling, tallied over the timed requests.
RAIL_EVENTS = ("stalls", "times_down", "readmissions", "reissued")


class _Mailbox:
    """Replies from the decode side, by (kind, request); filled by the thread that pumps."""

    def __init__(self, agent: Any, peer: str) -> None:
        self.agent, self.peer = agent, peer
        self.cond = threading.Condition()
        self.box: dict[tuple[str, Any], dict[str, Any]] = {}

    def pump(self, wait: float = 0.0) -> None:
        """File what has arrived; with nothing queued, sleep in the engine up to `wait` s for it."""
        got = self.agent.get_new_notifs(wait).get(self.peer, [])
        if not got:
            return
        with self.cond:
            for msg in got:
                d = proto.decode(msg)
                if d is not None:
                    self.box[(d[0], d[1].get("r", d[1].get("i")))] = d[1]
            self.cond.notify_all()

    def take(self, kind: str, key: Any, timeout: float, pump: bool = False) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while (kind, key) not in self.box:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchFailure(f"timed out after {timeout:.0f} s waiting for the decode side's "
                                       f"{kind!r} reply ({key})")
                if pump:
                    self.cond.release()
                    try:
                        self.pump(min(left, PUMP_WAIT_S))
                    finally:
                        self.cond.acquire()
                else:
                    self.cond.wait(min(left, 0.05))
            return self.box.pop((kind, key))


@dataclass
class _Phase:
    lat_ns: list[int] = field(default_factory=list)
    decode_ns: list[int] = field(default_factory=list)
    prep_s: float = 0.0
    post_s: float = 0.0
    build_s: float = 0.0
    transfers: int = 0
    descs: int = 0
    prep_once_s: float = 0.0  # --prep reuse: the first request of each slot
    bad: list[str] = field(default_factory=list)
    t_end: int = 0


class KvInitiator:
    """The prefill side: a multirail Agent writing one request's KV pages to the decode side."""

    def __init__(self, plan: KvPlan, *, host: str, port: int, target_name: str, connections: int,
                 rails: list[str] | None, policy: str, chunk_size: int, timeout: float, stall_timeout: float,
                 secret: str | None, progress: str, spin_us: float, check: bool, same_clock: bool,
                 seed: int = DEFAULT_SEED, prep: str = "fresh", transport: str = "tcp", gpu: str | None = None,
                 seg_type: str = "DRAM", target_seg_type: str = "DRAM", device: int = 0,
                 gpu_ipc: bool | None = None) -> None:
        import multirail
        from multirail.bench.worker import _looks_like_ip, local_addr_towards

        self.mr, self.plan, self.check, self.prep = multirail, plan, check, prep
        self.timeout, self.seed = timeout, seed
        self.gpu = gpu
        self.corrupt_next = False  # set for the timed kv phase by --corrupt-mapping
        local = rails[0] if rails and _looks_like_ip(rails[0]) else local_addr_towards(host, port)
        cfg = multirail.AgentConfig(host=local, port=0, connections=connections, rails=rails, policy=policy,
                                    chunk_size=chunk_size, timeout=timeout, stall_timeout=stall_timeout,
                                    auth_secret=secret, progress=progress, spin_us=spin_us, transport=transport,
                                    gpu=gpu, **ipc_config(gpu_ipc))
        self.transport = transport
        self.agent = multirail.Agent(f"mr-kv-prefill-{os.getpid()}", cfg)
        self.peer = target_name
        self.mail = _Mailbox(self.agent, target_name)
        self.stopped = False
        self.mem: BenchMem | None = None
        self.reg = None
        self._rid = 0
        self._rid_lock = threading.Lock()
        self._stats_seq = 0
        self.target_stats_note: str | None = None
        self.remote_mem, self.target_gpu = "DRAM", None
        try:
            self.mem = BenchMem(plan.pool_bytes, seg_type, device, gpu)
            self.buf = self.mem.host  # DRAM: the numpy pool (None for VRAM)
            if check:
                self.mem.fill_pattern(seed)
            else:
                self.mem.fill_byte(0x5A)  # fault the pool in (and not all zeros)
            self.reg = self.mem.register(self.agent, access="local")
            self.agent.fetch_remote_metadata(target_name, host, port)
            deadline = time.monotonic() + timeout
            while not self.agent.check_remote_metadata(target_name):
                if time.monotonic() > deadline:
                    raise BenchFailure(f"timed out after {timeout:.0f} s waiting for the metadata of "
                                       f"{target_name!r} from {host}:{port}")
                time.sleep(0.005)
            self.agent.send_local_metadata(host, port)
            self.agent.send_notif(self.peer, proto.encode(proto.HELLO, {"fill": False}))
            info = self.mail.take(proto.INFO, None, max(timeout, 30.0), pump=True)
            self.remote_addr, self.remote_len = int(info["addr"]), int(info["len"])
            self.remote_dev = int(info.get("dev", 0))
            self.remote_mem, self.target_gpu = str(info.get("mem") or "DRAM"), info.get("gpu")
            if self.remote_mem != target_seg_type:
                raise BenchFailure(f"the decode side's pool is {self.remote_mem} but --target-seg-type is "
                                   f"{target_seg_type}: start it (bench kv --listen) with --target-seg-type "
                                   f"{target_seg_type}")
            if self.remote_len < plan.pool_bytes:
                raise BenchFailure(
                    f"the decode side's pool is {format_size(self.remote_len)}, this workload needs "
                    f"{format_size(plan.pool_bytes)} ({plan.pool_pages} pages per layer); start it with the same "
                    "--model/--isl/--page-tokens/--tp/--concurrency/--pool-pages (bench kv --listen), not "
                    "`bench target`")
            self.agent.send_notif(self.peer, proto.encode(KV_BEGIN, {
                "layout": plan.layout, "layers": plan.layers, "pool_pages": plan.pool_pages,
                "page_bytes": plan.page_bytes, "seed": seed, "check": check}))
            self.mail.take(KV_READY, None, max(timeout, 30.0), pump=True)
            self.clock_offset_ns, self.clock_err_ns = (0, 0) if same_clock else self._clock_sync()
            self.same_clock = same_clock
        except BaseException:
            self.close()
            raise
        rng = np.random.default_rng(seed)
        self.src_pool = PagePool(plan.pool_pages, rng)
        self.dst_pool = PagePool(plan.pool_pages, rng)

    def _clock_sync(self, n: int = 8) -> tuple[int, int]:
        """Offset of the decode's monotonic clock from ours (NTP-style, best of n round trips)."""
        best: tuple[int, int] | None = None
        for i in range(n):
            t0 = time.monotonic_ns()
            self.agent.send_notif(self.peer, proto.encode(KV_CLOCK, {"i": i}))
            r = self.mail.take(KV_CLOCK, i, max(self.timeout, 10.0), pump=True)
            t1 = time.monotonic_ns()
            rtt = t1 - t0
            if best is None or rtt < best[1]:
                best = (int(r["t_ns"]) - (t0 + t1) // 2, rtt)
        assert best is not None
        return best[0], best[1] // 2

    def next_rid(self) -> int:
        with self._rid_lock:
            self._rid += 1
            return self._rid

    # -- one phase: `count` requests of one workload, `concurrency` slots ---------------------------

    def run_phase(self, workload: str, count: int, progress: Any = None,
                  label: str = "") -> _Phase:
        ph = _Phase()
        lock = threading.Lock()
        todo = [count]
        errors: list[BaseException] = []
        slot_fn = self._slot_kv if workload == "kv" else self._slot_contig

        def runner(slot: int) -> None:
            try:
                slot_fn(slot, todo, lock, ph, progress, label)
            except BaseException as e:  # noqa: BLE001 - reported by the phase
                errors.append(e)

        threads = [threading.Thread(target=runner, args=(s,), daemon=True, name=f"kv-slot-{s}")
                   for s in range(self.plan.concurrency)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            # Wakes when a reply comes, else every PUMP_WAIT_S to see whether the slots are done.
            self.mail.pump(PUMP_WAIT_S)
            if errors:
                break
        for t in threads:
            t.join(timeout=self.timeout + 30)
        if errors:
            e = errors[0]
            if isinstance(e, (BenchFailure, self.mr.MultirailError)):
                raise e
            raise BenchFailure(f"{type(e).__name__}: {e}") from e
        return ph

    def _take(self, todo: list[int], lock: threading.Lock) -> bool:
        with lock:
            if todo[0] <= 0:
                return False
            todo[0] -= 1
            return True

    def _wait_timeout(self) -> float:
        return self.timeout + self.plan.request_bytes * 8 / 50e6 * self.plan.concurrency

    def _finish(self, rid: int, t0: int, t_done: int, ph: _Phase, lock: threading.Lock, progress: Any,
                label: str) -> None:
        done = self.mail.take(KV_DONE, rid, self._wait_timeout())
        dec = int(done.get("t_ns", 0)) - self.clock_offset_ns - t0
        with lock:
            ph.lat_ns.append(t_done - t0)
            ph.decode_ns.append(max(dec, 0))
            ph.t_end = max(ph.t_end, t_done)
            if done.get("layers") is not None and not done.get("ok", True):
                what = (f"{done.get('bad_pages')} page(s)" if "bad_pages" in done
                        else f"{done.get('bad_bytes')} byte(s)") if "error" not in done else done["error"]
                ph.bad.append(f"request {rid}: {what} wrong at the decode side (first bad byte at pool "
                              f"offset {done.get('first_bad')})")
        if progress is not None:
            progress.advance(1, label)

    def _descs(self, local: np.ndarray, remote: np.ndarray) -> tuple[Any, Any]:
        """Rows as descriptor lists of each side's mem type (DRAM rows pass as they are)."""
        assert self.mem is not None
        return (self.mem.descs(self.agent, local),
                self.agent.get_xfer_descs(remote, "VRAM") if self.remote_mem == "VRAM" else remote)

    def _slot_kv(self, slot: int, todo: list[int], lock: threading.Lock, ph: _Phase, progress: Any,
                 label: str) -> None:
        plan, agent, peer = self.plan, self.agent, self.peer
        assert self.mem is not None
        base_src, base_dst = self.mem.addr, self.remote_addr
        kept: tuple[np.ndarray, np.ndarray] | None = None  # --prep reuse: this slot's pages
        handles: list[Any] = []
        try:
            while self._take(todo, lock):
                rid = self.next_rid()
                tb = time.perf_counter()
                reuse = kept is not None
                if kept is not None:
                    src, dst = kept
                else:
                    src, dst = self.src_pool.alloc(plan.pages), self.dst_pool.alloc(plan.pages)
                    lrows = plan.rows(base_src, src, self.mem.device)
                    rrows = plan.rows(base_dst, dst, self.remote_dev)
                    with lock:
                        corrupt, self.corrupt_next = self.corrupt_next and plan.pages >= 2, False
                    if corrupt:  # one wrong mapping: layer 0's first two pages swapped on the decode side
                        rrows[0, [0, 1]] = rrows[0, [1, 0]]
                notifs = [proto.encode(KV_LAYER, {"r": rid, "l": lay, "n": plan.layers})
                          for lay in range(plan.layers)]
                build = time.perf_counter() - tb
                if self.check:
                    agent.send_notif(peer, proto.encode(KV_REQ, {"r": rid, "src": src.tolist(), "dst": dst.tolist()}))
                prep = post = 0.0
                t0 = time.monotonic_ns()
                if reuse:
                    for lay, h in enumerate(handles):
                        b = time.perf_counter()
                        agent.transfer(h, notifs[lay])
                        post += time.perf_counter() - b
                else:
                    for lay in range(plan.layers):
                        a = time.perf_counter()
                        h = agent.initialize_xfer("WRITE", *self._descs(lrows[lay], rrows[lay]), peer,
                                                  notif=notifs[lay])
                        b = time.perf_counter()
                        agent.transfer(h)
                        c = time.perf_counter()
                        prep += b - a
                        post += c - b
                        handles.append(h)
                wt = self._wait_timeout()
                for h in handles:
                    agent.wait(h, wt)
                t_done = time.monotonic_ns()
                if self.prep == "reuse" and kept is None:
                    kept = (src, dst)  # prepared once for this slot: kept out of the steady-state rate
                    with lock:
                        ph.prep_once_s += prep
                    prep = 0.0
                with lock:
                    ph.prep_s += prep
                    ph.post_s += post
                    ph.build_s += build
                    ph.transfers += plan.layers
                    ph.descs += plan.descs_per_request
                self._finish(rid, t0, t_done, ph, lock, progress, label)
                if kept is None:
                    for h in handles:
                        agent.release_xfer_handle(h)
                    handles = []
                    self.src_pool.release(src)
                    self.dst_pool.release(dst)
        finally:
            for h in handles:
                try:
                    agent.release_xfer_handle(h)
                except self.mr.MultirailError:
                    pass
            if kept is not None:
                self.src_pool.release(kept[0])
                self.dst_pool.release(kept[1])

    def _slot_contig(self, slot: int, todo: list[int], lock: threading.Lock, ph: _Phase, progress: Any,
                     label: str) -> None:
        plan, agent, peer = self.plan, self.agent, self.peer
        size = plan.request_bytes
        off = slot * size
        assert self.mem is not None
        local = np.array([[self.mem.addr + off, size, self.mem.device]], dtype=np.uint64)
        remote = np.array([[self.remote_addr + off, size, self.remote_dev]], dtype=np.uint64)
        h = agent.initialize_xfer("WRITE", *self._descs(local, remote), peer)  # the ceiling: prepared once
        try:
            while self._take(todo, lock):
                rid = self.next_rid()
                if self.check:
                    agent.send_notif(peer, proto.encode(KV_REQ, {"r": rid, "src_off": off, "dst_off": off,
                                                                 "len": size}))
                t0 = time.monotonic_ns()
                agent.transfer(h, proto.encode(KV_LAYER, {"r": rid, "l": 0, "n": 1}))
                agent.wait(h, self._wait_timeout())
                t_done = time.monotonic_ns()
                with lock:
                    ph.transfers += 1
                self._finish(rid, t0, t_done, ph, lock, progress, label)
        finally:
            agent.release_xfer_handle(h)

    def rail_snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """One read of `rail_stats`: the bytes each rail carried so far, and the counts of the
        engine's failure handling (`RAIL_EVENTS`) summed over the rails; empty without stats."""
        try:
            stats = list(self.agent.rail_stats(self.peer))
        except (AttributeError, NotImplementedError, self.mr.MultirailError):
            return {}, {}
        if not stats:
            return {}, {}
        return ({str(s.get("name", i)): int(s.get("bytes", 0)) for i, s in enumerate(stats)},
                {k: sum(int(s.get(k) or 0) for s in stats) for k in RAIL_EVENTS})

    def keepalive(self) -> None:
        self.agent.send_notif(self.peer, proto.encode(proto.KEEPALIVE))

    @property
    def measure_staging(self) -> bool:
        return self.mem is not None and "VRAM" in (self.mem.mem_type, self.remote_mem)

    def staging_snapshot(self) -> dict[str, Any] | None:
        """Staging totals of both sides (between phases: the mailbox is pumped here), or None
        when no side is VRAM."""
        if not self.measure_staging:
            return None
        from multirail.bench.worker import STATS_TIMEOUT_S, ask_target_staging

        init, ipc = staging.initiator_side(self.agent, self.peer)
        tgt = None
        if self.target_stats_note is None:
            self._stats_seq += 1
            tgt, self.target_stats_note = ask_target_staging(
                self.agent, self.peer, self._stats_seq,
                lambda i: self.mail.take(proto.STATS, i, STATS_TIMEOUT_S, pump=True))
        return {"initiator": init, "ipc": ipc, "target": tgt}

    def staging_breakdown(self, before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
        from multirail.bench.worker import stage_breakdown

        assert self.mem is not None
        return stage_breakdown(before, after, wall_s, self.target_stats_note,
                               {"initiator": self.mem.mem_type, "target": self.remote_mem})

    def memory_report(self) -> dict[str, Any]:
        from multirail.bench.worker import memory_report, peer_counters

        assert self.mem is not None
        return memory_report(self.mem, self.remote_mem, self.target_gpu, self.gpu,
                             peer_counters(self.agent, self.peer))

    def close(self) -> None:
        try:
            if not self.stopped:
                self.stopped = True
                self.agent.send_notif(self.peer, proto.encode(proto.STOP))
        except self.mr.MultirailError:
            pass
        finally:
            try:
                if self.reg is not None:
                    self.agent.deregister_memory(self.reg)
            finally:
                self.agent.close()
                if self.mem is not None:
                    self.mem.free()


def run_prefill(args: argparse.Namespace, plan: KvPlan, host: str, port: int,
                capacities_bps: list[float | None] | None, same_clock: bool) -> dict[str, Any]:
    """Connect to a decode side and run warmup, the contiguous ceiling and the kv workload.
    Returns the result document (rows as KvRow)."""
    from multirail.bench import _engine_kwargs
    from multirail.bench.progress import make_progress
    from multirail.bench.rails import RailCounters, resolve_rails
    from multirail.bench.worker import local_addr_towards

    eng = _engine_kwargs(args)
    rails = eng["rails"] or [local_addr_towards(host, port)]
    counters = RailCounters(resolve_rails(rails, capacities_bps), "WRITE")
    warm = args.warmup_requests
    total = 2 * (warm + plan.requests)
    progress = make_progress(enabled=True, total=total, desc="bench kv")
    init = KvInitiator(plan, host=host, port=port, target_name=args.target_name, check=args.check_consistency,
                       same_clock=same_clock, seed=args.seed, prep=args.prep, seg_type=args.initiator_seg_type,
                       target_seg_type=args.target_seg_type, device=args.device_id, **eng)
    rows: list[KvRow] = []
    rounds = max(1, min(getattr(args, "rounds", 1), plan.requests))
    # The timed requests of each workload in `rounds` segments, alternating which goes first
    # (c k, k c, c k, ...): both workloads then see the same minutes of a noisy host.
    counts = [plan.requests // rounds + (1 if i < plan.requests % rounds else 0) for i in range(rounds)]
    order = [("contiguous", "kv") if i % 2 == 0 else ("kv", "contiguous") for i in range(rounds)]
    try:
        acc: dict[str, dict[str, Any]] = {}
        for workload in ("contiguous", "kv"):
            warm_bad: list[str] = []
            if warm:
                warm_bad = init.run_phase(workload, warm, progress, f"{workload} warmup").bad
            init.keepalive()
            acc[workload] = {"warm_bad": warm_bad, "phases": [], "wall": 0.0, "cpu": 0.0, "nic": {}, "eng": {}, "ev": {},
                             "st_before": None, "st_after": None}
        for r, pair in enumerate(order):
            for workload in pair:
                a = acc[workload]
                init.corrupt_next = workload == "kv" and args.corrupt_mapping
                st_before = init.staging_snapshot()
                before, (eng_before, ev_before) = counters.snapshot(), init.rail_snapshot()
                cpu0, t_start = time.process_time(), time.monotonic_ns()
                ph = init.run_phase(workload, counts[r], progress, workload)
                a["wall"] += max(ph.t_end - t_start, 1) / 1e9
                a["cpu"] += time.process_time() - cpu0
                after, (eng_after, ev_after) = counters.snapshot(), init.rail_snapshot()
                for k, v in ev_after.items():
                    a["ev"][k] = a["ev"].get(k, 0) + max(0, v - ev_before.get(k, 0))
                st_after = init.staging_snapshot()
                a["st_before"] = a["st_before"] if a["st_before"] is not None else st_before
                a["st_after"] = st_after
                a["phases"].append(ph)
                for k, (v, src) in after.items():
                    if k in before:
                        a["nic"][k] = (a["nic"].get(k, (0, src))[0] + max(0, v - before[k][0]), src)
                for k, v in eng_after.items():
                    a["eng"][k] = a["eng"].get(k, 0) + max(0, v - eng_before.get(k, 0))
                init.keepalive()
        for workload in ("contiguous", "kv"):
            a = acc[workload]
            phs: list[_Phase] = a["phases"]
            wall = a["wall"]
            lat = [x for ph in phs for x in ph.lat_ns]
            dec = [x for ph in phs for x in ph.decode_ns]
            extra: dict[str, Any] = dict(transfers=sum(ph.transfers for ph in phs))
            if workload == "kv":
                extra.update(descs=sum(ph.descs for ph in phs), prep=args.prep, prep_s=sum(ph.prep_s for ph in phs),
                             post_s=sum(ph.post_s for ph in phs), build_s=sum(ph.build_s for ph in phs),
                             prep_once_s=sum(ph.prep_once_s for ph in phs))
            row = kv_row(f"multirail {workload}", workload, plan, lat, wall, dec, **extra)
            row.rounds = rounds
            row.rail_events = dict(a["ev"]) or None
            row.cpu_pct = 100.0 * a["cpu"] / wall
            if a["st_before"] is not None and a["st_after"] is not None:
                # one segment per workload (rounds > 1 is refused with VRAM: staging totals are
                # per segment, not per workload)
                row.staging = init.staging_breakdown(a["st_before"], a["st_after"], wall)
            row.rails = counters.delta({k: (0, src) for k, (_, src) in a["nic"].items()}, a["nic"], wall)
            row.engine_rails = [RailRow(name=k, bytes=v, gbps=v * 8 / wall / 1e9, source="engine")
                                for k, v in a["eng"].items()]
            row.set_capacity([r.capacity_gbps for r in row.rails])
            if args.check_consistency:
                bad = a["warm_bad"] + [b for ph in phs for b in ph.bad]
                row.consistency = "ok" if not bad else f"FAILED: {bad[0]}" + (
                    f" (+{len(bad) - 1} more requests)" if len(bad) > 1 else "")
            rows.append(row)
        from multirail.bench.worker import label_rail_transports, transport_report
        report = transport_report(init.agent, init.peer, init.transport)
        report["memory"] = init.memory_report()
        label_rail_transports(rows, report)
    finally:
        progress.clear()
        init.close()
    return {"rows": rows, "problems": list(counters.problems), "transport": report,
            "clock": {"same_clock": same_clock, "offset_ns": init.clock_offset_ns, "err_us": init.clock_err_ns / 1e3}}
