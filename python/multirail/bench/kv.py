"""`multirail bench kv`: KV cache from prefill to decode, page by page, layer by layer.

The workload (docs/bench-kv.md has the whole story):

* A model config (kvmodels.py) gives the KV bytes of one token in one layer on one TP rank;
  a *page* is `--page-tokens` tokens of one layer (K and V together, FlashInfer-style
  `[page][K|V][token][head][dim]`), so `page_bytes = page_tokens x bytes_per_token_layer`.
  A request of `--isl` tokens fills `ceil(isl / page_tokens)` pages in every layer (the last one
  partly; whole pages move, as engines move them).
* Both sides keep a paged pool of `pool_pages` pages per layer (default 2 x concurrency x the
  pages of one request). `--layout layer` (vLLM-style, one KV tensor per layer): layer l's pages
  are one region of the pool, page p of layer l at `(l x pool_pages + p) x page_bytes`.
  `--layout block`: one block holds every layer of a page, layer-major inside,
  page p of layer l at `(p x layers + l) x page_bytes`. Either way one pool is registered per
  side.
* Page ids come from a free list that starts shuffled and gets pages back in completion order,
  as a block manager leaves them: the prefill side picks its pages from its pool, the decode
  side's ids are picked (from its own shuffled free list) by the prefill process on the decode's
  behalf (a real decode would send its block ids; the bench has no reason to pay that round trip).
* Per request, layer by layer: one WRITE per layer with one descriptor per page (local row:
  the prefill page, remote row: the decode page, both `page_bytes` long), carrying a notification
  `bench:kv_layer {"r": request, "l": layer, "n": layers}`; the engine merges rows that happen to
  be contiguous on both sides, which shuffled ids make rare. All layers are posted back to back
  (prefill is modelled as infinitely fast: what remains is the transfer).
* A request is done when decode holds the last layer's notification. Measured two ways:
  `lat_*`: from the start of layer 0's prepare to the moment every layer's WRITE is DONE at the
  prefill side. The engine sends a WRITE's notification only after all its data is acknowledged
  and turns the handle DONE only once the decode agent has acknowledged the notification, so
  this is the moment the prefill side *knows* decode holds every layer's notification.
  `decode_lat_*`: the same start to the moment the decode process's `get_new_notifs` returned
  the last of them (its own clock; on one host, local and testbed, the clocks are the same one;
  across hosts an offset is estimated from `bench:kv_clock` round trips, error = half the best
  round trip, reported). The decode then answers `bench:kv_done` and only then are the request's
  pages returned to the free lists and the slot takes its next request.
* The ceiling, in the same run: the same bytes per request as one contiguous WRITE with one
  notification (`ratio_to_contiguous` = kv Gbps / contiguous Gbps), and, when NIXL is
  importable, the kv workload through NIXL's API (kv_nixl.py).
* Descriptor rate: page descriptors / time spent in `initialize_xfer` + `transfer` calls
  (`--prep fresh`, default: handles are prepared per request and layer, since page ids change with
  every request), or in `transfer` calls only (`--prep reuse`: each concurrency slot keeps its
  pages, handles prepared once per slot and layer and reposted with a new notification, as
  engines with prepped descriptor lists do).

Memory: `--initiator-seg-type` (the prefill pool) and `--target-seg-type` (the decode pool),
DRAM or VRAM (mem.BenchMem on `--device-id`, `--gpu cuda|standin`); with VRAM each row carries
the D2H / wire / H2D staging breakdown of its timed phase (staging.py; the decode side's stages
through `bench:stats`) and the NIXL run is skipped.

Modes, like the rest of bench: `bench kv` (local: a decode process on 127.0.0.1),
`bench kv --testbed [NAME]` (decode in namespace a, prefill in b), and two hosts:
`bench kv --listen HOST:PORT` (decode) with `bench kv --connect HOST:PORT` (prefill), both given
the same model options.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from multirail.bench import protocol as proto
from multirail.bench import staging
from multirail.bench.core import (RailRow, args_config, json_clean, write_json, UsageError, _M1, _M2, _M3, format_rails, format_size,
                                  pattern, percentile)
from multirail.bench.kvmodels import ModelSpec, load_model
from multirail.bench.mem import BenchMem, ipc_config, uses_vram
from multirail.bench.staging import format_breakdown
from multirail.bench.worker import BenchFailure

# Control messages of the kv session (JSON bodies, protocol.py's `bench:` prefix):
#   prefill -> decode  bench:kv_begin {"layout","layers","pool_pages","page_bytes","seed","check"}
#   decode -> prefill  bench:kv_ready {"pool_bytes"}
#   prefill -> decode  bench:kv_clock {"i"}            decode -> prefill  bench:kv_clock {"i","t_ns"}
#   prefill -> decode  bench:kv_req {"r","src","dst"} | {"r","src_off","dst_off","len"}   (check only)
#   (engine notification of each layer's WRITE)  bench:kv_layer {"r","l","n"}
#   decode -> prefill  bench:kv_done {"r","t_ns","layers","ok","bad_pages","first_bad"}
KV_BEGIN, KV_READY, KV_CLOCK, KV_REQ, KV_LAYER, KV_DONE = (
    "kv_begin", "kv_ready", "kv_clock", "kv_req", "kv_layer", "kv_done")
LAYOUTS = ("layer", "block")
PREP_MODES = ("fresh", "reuse")
DEFAULT_SEED = 0xC0FFEE


# -- geometry --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KvPlan:
    model: ModelSpec
    tp: int
    isl: int
    page_tokens: int
    layout: str
    requests: int
    concurrency: int
    pool_pages: int

    @property
    def layers(self) -> int:
        return self.model.layers

    @property
    def token_bytes(self) -> int:
        return self.model.bytes_per_token_layer(self.tp)

    @property
    def page_bytes(self) -> int:
        return self.token_bytes * self.page_tokens

    @property
    def pages(self) -> int:
        """Pages of one request in one layer."""
        return -(-self.isl // self.page_tokens)

    @property
    def descs_per_request(self) -> int:
        return self.pages * self.layers

    @property
    def request_bytes(self) -> int:
        return self.descs_per_request * self.page_bytes

    @property
    def pool_bytes(self) -> int:
        return self.pool_pages * self.layers * self.page_bytes

    def offsets(self, layer: int | np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Byte offsets in the pool of pages `ids` of `layer` (broadcasts: layer as a column)."""
        ids = ids.astype(np.uint64, copy=False)
        lay = np.asarray(layer, dtype=np.uint64)
        if self.layout == "layer":
            return (lay * np.uint64(self.pool_pages) + ids) * np.uint64(self.page_bytes)
        return (ids * np.uint64(self.layers) + lay) * np.uint64(self.page_bytes)

    def rows(self, base: int, ids: np.ndarray, dev: int = 0) -> np.ndarray:
        """(layers, pages, 3) uint64 descriptor rows (addr, len, dev) of one request's pages."""
        n = len(ids)
        out = np.empty((self.layers, n, 3), dtype=np.uint64)
        out[:, :, 0] = self.offsets(np.arange(self.layers, dtype=np.uint64)[:, None], ids[None, :])
        out[:, :, 0] += np.uint64(base)
        out[:, :, 1] = self.page_bytes
        out[:, :, 2] = dev
        return out

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model.name, "attention": self.model.attention, "tp": self.tp, "isl": self.isl,
                "page_tokens": self.page_tokens, "layout": self.layout, "layers": self.layers,
                "bytes_per_token_layer": self.token_bytes, "page_bytes": self.page_bytes,
                "pages_per_layer": self.pages, "descs_per_request": self.descs_per_request,
                "request_bytes": self.request_bytes, "requests": self.requests,
                "concurrency": self.concurrency, "pool_pages": self.pool_pages, "pool_bytes": self.pool_bytes}

    def describe(self) -> list[str]:
        m = self.model
        shape = (f"{m.layers} layers x latent {m.kv_lora_rank}+{m.qk_rope_head_dim}" if m.attention == "mla"
                 else f"{m.layers} layers x {m.kv_heads} KV heads x {m.head_dim} head dim")
        where = ("page p of layer l at (l x pool_pages + p) x page_bytes: one region per layer" if self.layout == "layer"
                 else "page p of layer l at (p x layers + l) x page_bytes: one block holds every layer of a page")
        return [
            f"model {m.name} ({m.attention}, {shape}, {m.dtype}), tp {self.tp}: {self.token_bytes} B per token "
            f"per layer = {m.formula(self.tp)}",
            f"request: isl {self.isl} tokens = {self.pages} pages of {self.page_tokens} tokens "
            f"({format_size(self.page_bytes)}) per layer x {self.layers} layers = {self.descs_per_request} page "
            f"descriptors, {format_size(self.request_bytes)} ({self.request_bytes} B)",
            f"layout {self.layout}: {where}; pools of {self.pool_pages} pages per layer "
            f"({format_size(self.pool_bytes)}) per side, page ids shuffled; one WRITE per layer "
            f"({self.pages} descriptors) + one notification; concurrency {self.concurrency}",
        ]


def make_plan(model: str, isl: int, page_tokens: int = 16, tp: int = 1, layout: str = "layer",
              requests: int = 10, concurrency: int = 1, pool_pages: int | None = None) -> KvPlan:
    """Validate the workload options (UsageError names what is wrong)."""
    spec = load_model(model)
    if isl is None or isl < 1:
        raise UsageError(f"--isl must be at least 1 token, not {isl}")
    if page_tokens < 1:
        raise UsageError(f"--page-tokens must be at least 1, not {page_tokens}")
    if layout not in LAYOUTS:
        raise UsageError(f"--layout must be layer or block, not {layout!r}")
    if requests < 1 or concurrency < 1:
        raise UsageError("--requests and --concurrency must be at least 1")
    spec.bytes_per_token_layer(tp)  # checks tp against the KV heads
    pages = -(-isl // page_tokens)
    need = concurrency * pages
    if pool_pages is None:
        pool_pages = 2 * need
    elif pool_pages < need:
        raise UsageError(f"--pool-pages {pool_pages} cannot hold {concurrency} request(s) of {pages} pages "
                         f"(need at least {need})")
    return KvPlan(spec, tp, isl, page_tokens, layout, requests, concurrency, pool_pages)


class PagePool:
    """A block manager's free list: starts shuffled, freed pages go to the back. Thread-safe."""

    def __init__(self, n_pages: int, rng: np.random.Generator) -> None:
        self.free = list(rng.permutation(n_pages).astype(np.int64))
        self.rng = rng
        self.lock = threading.Lock()

    def alloc(self, n: int) -> np.ndarray:
        with self.lock:
            if n > len(self.free):
                raise BenchFailure(f"page pool exhausted ({n} pages wanted, {len(self.free)} free)")
            ids, self.free = self.free[:n], self.free[n:]
        return np.array(ids, dtype=np.int64)

    def release(self, ids: np.ndarray) -> None:
        with self.lock:
            self.free.extend(int(i) for i in ids)


# -- consistency ------------------------------------------------------------------------------------

def page_patterns(seed: int, offsets: np.ndarray, page_bytes: int) -> np.ndarray:
    """(n, page_bytes) uint8: `core.pattern(seed, off, page_bytes)` for every offset, at once."""
    offsets = np.asarray(offsets, dtype=np.uint64)
    if page_bytes % 8 or np.any(offsets % np.uint64(8)):
        return np.stack([pattern(seed, int(o), page_bytes) for o in offsets]) if len(offsets) else \
            np.zeros((0, page_bytes), np.uint8)
    words = (offsets // np.uint64(8))[:, None] + np.arange(page_bytes // 8, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        z = (words + np.uint64(seed & 0xFFFFFFFF)) * _M1
        z ^= z >> np.uint64(30)
        z *= _M2
        z ^= z >> np.uint64(27)
        z *= _M3
        z ^= z >> np.uint64(31)
    return z.view(np.uint8).reshape(len(offsets), page_bytes)


def fill_pattern(buf: np.ndarray, seed: int, chunk: int = 64 << 20) -> None:
    for off in range(0, len(buf), chunk):
        n = min(chunk, len(buf) - off)
        buf[off:off + n] = pattern(seed, off, n)


def verify_pages(plan: KvPlan, buf: np.ndarray | BenchMem, seed: int, src: np.ndarray, dst: np.ndarray,
                 zero_after: bool = True) -> tuple[int, int | None]:
    """Check that every layer's decode pages `dst` hold the prefill pages `src` (whose content is
    pattern(seed, prefill offset)); zero them afterwards so stale data cannot pass a later check.
    `buf`: the pool (numpy, or a BenchMem: VRAM pages are copied out one by one).
    Returns (bad pages, decode offset of the first bad byte or None)."""
    pb = plan.page_bytes
    mem = buf if isinstance(buf, BenchMem) else None
    host = mem.host if mem is not None else buf
    if host is None:  # VRAM: pages copied out (and zeroed) one by one
        assert mem is not None
        zeros = np.zeros(pb, dtype=np.uint8)

        def read(do: np.ndarray) -> np.ndarray:
            return np.stack([mem.read(int(o), pb) for o in do]) if len(do) else np.zeros((0, pb), np.uint8)

        def zero(do: np.ndarray) -> None:
            for o in do:
                mem.write(int(o), zeros)
    else:
        pages2d = host[:plan.pool_bytes].reshape(-1, pb)

        def read(do: np.ndarray) -> np.ndarray:
            return pages2d[(do // np.uint64(pb)).astype(np.int64)]

        def zero(do: np.ndarray) -> None:
            pages2d[(do // np.uint64(pb)).astype(np.int64)] = 0
    bad, first = 0, None
    for layer in range(plan.layers):
        so, do = plan.offsets(layer, src), plan.offsets(layer, dst)
        differ = read(do) != page_patterns(seed, so, pb)
        rows = np.flatnonzero(differ.any(axis=1))
        if rows.size:
            bad += int(rows.size)
            if first is None:
                r = int(rows[0])
                first = int(do[r]) + int(np.argmax(differ[r]))
        if zero_after:
            zero(do)
    return bad, first


def verify_range(buf: np.ndarray | BenchMem, seed: int, src_off: int, dst_off: int, length: int,
                 zero_after: bool = True) -> tuple[int, int | None]:
    got = buf.read(dst_off, length) if isinstance(buf, BenchMem) else buf[dst_off:dst_off + length]
    differ = got != pattern(seed, src_off, length)
    n = int(np.count_nonzero(differ))
    if zero_after:
        if isinstance(buf, BenchMem):
            buf.zero(dst_off, length)
        else:
            buf[dst_off:dst_off + length] = 0
    return n, (dst_off + int(np.argmax(differ)) if n else None)


# -- decode side (`bench kv --listen`) --------------------------------------------------------------

def serve(*, host: str, port: int, name: str, pool_bytes: int, connections: int, rails: list[str] | None,
          policy: str, chunk_size: int, timeout: float, stall_timeout: float, duration: float,
          idle_timeout: float, secret: str | None = None, progress: str = "adaptive",
          spin_us: float = 200.0, transport: str = "tcp", gpu: str | None = None, seg_type: str = "DRAM",
          device: int = 0, gpu_ipc: bool | None = None) -> int:
    """The decode side: one registered pool (DRAM, or VRAM on GPU `device`), answers the bench
    and kv control messages. Prints the same ready line as `bench target` (target.run_served)."""
    from multirail.bench.target import run_served

    engine = dict(host=host, port=port, connections=connections, rails=rails, policy=policy, chunk_size=chunk_size,
                  timeout=timeout, stall_timeout=stall_timeout, auth_secret=secret, progress=progress,
                  spin_us=spin_us, transport=transport, gpu=gpu, **ipc_config(gpu_ipc))
    return run_served(name, pool_bytes, engine,
                      lambda agent, buf, mr: _DecodeLoop(agent, buf, mr).run(duration, idle_timeout), prefault=True,
                      seg_type=seg_type, device=device)


class _DecodeLoop:
    def __init__(self, agent: Any, buf: BenchMem, mr: Any) -> None:
        self.agent, self.buf, self.mr = agent, buf, mr
        self.plan: KvPlan | None = None
        self.geom: dict[str, Any] = {}
        self.open: dict[Any, set[int]] = {}      # request -> layers seen
        self.mapping: dict[Any, dict[str, Any]] = {}  # request -> kv_req body (check mode)
        self.done: set[Any] = set()
        self.outbox: list[tuple[str, bytes]] = []
        self.fast = False

    def run(self, duration: float, idle_timeout: float) -> str:
        from multirail.bench.target import _handle

        start = last = time.monotonic()
        while True:
            now = time.monotonic()
            if now - start > duration:
                return "duration"
            if now - last > idle_timeout:
                return "idle"
            for peer, msgs in self.agent.get_new_notifs().items():
                for msg in msgs:
                    decoded = proto.decode(msg)
                    if decoded is None:
                        continue
                    t_ns = time.monotonic_ns()
                    last = time.monotonic()
                    kind, body = decoded
                    if kind == proto.STOP:
                        return "stop"
                    if kind.startswith("kv_"):
                        self.fast = True
                        reply = self._kv(kind, body, t_ns)
                    else:
                        reply = _handle(kind, body, self.buf, None, self.agent, peer)
                    if reply is not None:
                        self.outbox.append((peer, reply))
            pending = []
            for peer, reply in self.outbox:
                try:
                    self.agent.send_notif(peer, reply)
                except self.mr.UnknownPeerError:
                    pending.append((peer, reply))
            self.outbox = pending
            time.sleep(0.0001 if self.fast else 0.002)

    def _kv(self, kind: str, body: dict[str, Any], t_ns: int) -> bytes | None:
        if kind == KV_LAYER:
            r, n = body.get("r"), int(body.get("n", 1))
            if r in self.done:
                return None  # a notification delivered twice (at-least-once on failover)
            seen = self.open.setdefault(r, set())
            seen.add(int(body.get("l", 0)))
            if len(seen) < n:
                return None
            del self.open[r]
            self.done.add(r)
            out: dict[str, Any] = {"r": r, "t_ns": t_ns, "layers": len(seen), "ok": True}
            req = self.mapping.pop(r, None)
            if req is not None:
                out.update(self._verify(req))
            return proto.encode(KV_DONE, out)
        if kind == KV_CLOCK:
            return proto.encode(KV_CLOCK, {"i": body.get("i"), "t_ns": time.monotonic_ns()})
        if kind == KV_REQ:
            self.mapping[body.get("r")] = body
            return None
        if kind == KV_BEGIN:
            self.geom = body
            self.done.clear()
            return proto.encode(KV_READY, {"pool_bytes": len(self.buf), "mem": self.buf.mem_type})
        return None

    def _verify(self, req: dict[str, Any]) -> dict[str, Any]:
        g = self.geom
        seed = int(g.get("seed", DEFAULT_SEED))
        try:
            if "len" in req:
                bad, first = verify_range(self.buf, seed, int(req["src_off"]), int(req["dst_off"]), int(req["len"]))
                return {"ok": bad == 0, "bad_bytes": bad, "first_bad": first}
            plan = _geom_plan(g)
            bad, first = verify_pages(plan, self.buf, seed, np.asarray(req["src"], np.int64),
                                      np.asarray(req["dst"], np.int64))
            return {"ok": bad == 0, "bad_pages": bad, "first_bad": first}
        except (KeyError, TypeError, ValueError, IndexError) as e:
            return {"ok": False, "error": f"cannot verify: {e}"}


@dataclass(frozen=True)
class _Geom:
    """The part of a KvPlan the decode side needs to verify pages (from bench:kv_begin)."""

    layout: str
    layers: int
    pool_pages: int
    page_bytes: int

    offsets = KvPlan.offsets

    @property
    def pool_bytes(self) -> int:
        return self.pool_pages * self.layers * self.page_bytes


def _geom_plan(g: dict[str, Any]) -> Any:
    return _Geom(str(g["layout"]), int(g["layers"]), int(g["pool_pages"]), int(g["page_bytes"]))


# -- prefill side ----------------------------------------------------------------------------------

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


class _Mailbox:
    """Replies from the decode side, by (kind, request); filled by the thread that pumps."""

    def __init__(self, agent: Any, peer: str) -> None:
        self.agent, self.peer = agent, peer
        self.cond = threading.Condition()
        self.box: dict[tuple[str, Any], dict[str, Any]] = {}

    def pump(self) -> None:
        got = self.agent.get_new_notifs().get(self.peer, [])
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
                        self.pump()
                        time.sleep(0.0002)
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
            self.mail.pump()
            time.sleep(0.0002)
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

    def engine_rails(self) -> dict[str, int]:
        try:
            stats = self.agent.rail_stats(self.peer)
        except (AttributeError, NotImplementedError, self.mr.MultirailError):
            return {}
        return {str(s.get("name", i)): int(s.get("bytes", 0)) for i, s in enumerate(stats)}

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
    try:
        for workload in ("contiguous", "kv"):
            warm_bad: list[str] = []
            if warm:
                warm_bad = init.run_phase(workload, warm, progress, f"{workload} warmup").bad
            init.keepalive()
            init.corrupt_next = workload == "kv" and args.corrupt_mapping
            st_before = init.staging_snapshot()
            before, eng_before = counters.snapshot(), init.engine_rails()
            cpu0, t_start = time.process_time(), time.monotonic_ns()
            ph = init.run_phase(workload, plan.requests, progress, workload)
            wall = max(ph.t_end - t_start, 1) / 1e9
            cpu = time.process_time() - cpu0
            after, eng_after = counters.snapshot(), init.engine_rails()
            st_after = init.staging_snapshot()
            extra: dict[str, Any] = dict(transfers=ph.transfers)
            if workload == "kv":
                extra.update(descs=ph.descs, prep=args.prep, prep_s=ph.prep_s, post_s=ph.post_s, build_s=ph.build_s,
                             prep_once_s=ph.prep_once_s)
            row = kv_row(f"multirail {workload}", workload, plan, ph.lat_ns, wall,
                         ph.decode_ns, **extra)
            row.cpu_pct = 100.0 * cpu / wall
            if st_before is not None and st_after is not None:
                row.staging = init.staging_breakdown(st_before, st_after, wall)
            row.rails = counters.delta(before, after, wall)
            row.engine_rails = [RailRow(name=k, bytes=max(0, v - eng_before.get(k, 0)),
                                        gbps=max(0, v - eng_before.get(k, 0)) * 8 / wall / 1e9, source="engine")
                                for k, v in eng_after.items()]
            row.set_capacity([r.capacity_gbps for r in row.rails])
            if args.check_consistency:
                bad = warm_bad + ph.bad
                row.consistency = "ok" if not bad else f"FAILED: {bad[0]}" + (
                    f" (+{len(bad) - 1} more requests)" if len(bad) > 1 else "")
            rows.append(row)
            init.keepalive()
        from multirail.bench.worker import label_rail_transports, transport_report
        report = transport_report(init.agent, init.peer, init.transport)
        report["memory"] = init.memory_report()
        label_rail_transports(rows, report)
    finally:
        progress.clear()
        init.close()
    return {"rows": rows, "problems": list(counters.problems), "transport": report,
            "clock": {"same_clock": same_clock, "offset_ns": init.clock_offset_ns, "err_us": init.clock_err_ns / 1e3}}


# -- CLI ---------------------------------------------------------------------------------------------

def add_parser(sub: Any, add_engine_opts: Callable[[argparse.ArgumentParser], None],
               add_target_opts: Callable[[argparse.ArgumentParser], None], default_testbed: str) -> argparse.ArgumentParser:
    k = sub.add_parser("kv", help="KV-cache transfer, prefill -> decode: shuffled pages, one WRITE per layer",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = k.add_argument_group("workload")
    w.add_argument("--model", required=True, metavar="NAME|FILE.yaml",
                   help="bundled: llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, deepseek-r1 (MLA); or a YAML file")
    w.add_argument("--isl", type=int, required=True, metavar="TOKENS", help="input sequence length per request")
    w.add_argument("--page-tokens", type=int, default=16, help="tokens per page (default 16)")
    w.add_argument("--tp", type=int, default=1, help="tensor parallelism: the bench moves one rank's share (default 1)")
    w.add_argument("--requests", type=int, default=10, help="timed requests per workload (default 10)")
    w.add_argument("--warmup-requests", type=int, default=1, help="untimed requests per workload first (default 1)")
    w.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default 1)")
    w.add_argument("--layout", default="layer", choices=list(LAYOUTS),
                   help="layer: one pool region per layer (vLLM); block: all layers of a page in one block")
    w.add_argument("--pool-pages", type=int, default=None,
                   help="pages per layer in each pool (default 2 x concurrency x pages per request)")
    w.add_argument("--prep", default="fresh", choices=list(PREP_MODES),
                   help="fresh: initialize_xfer per request and layer (default); reuse: each slot keeps its pages, "
                        "handles prepared once per slot and layer and reposted")
    w.add_argument("--check-consistency", action="store_true",
                   help="the decode side verifies every page of every request (timings then include it)")
    w.add_argument("--no-nixl", action="store_true", help="skip the NIXL run even when NIXL is installed")
    w.add_argument("--json", metavar="FILE", help="write results as JSON ('-' for stdout)")
    w.add_argument("--plot", metavar="FILE.png", help="draw the latency CDF and per-rail throughput (matplotlib)")
    w.add_argument("--seed", type=int, default=DEFAULT_SEED, help=argparse.SUPPRESS)
    w.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # run by `bench kv --testbed`
    w.add_argument("--corrupt-mapping", action="store_true", help=argparse.SUPPRESS)
    m = k.add_argument_group("where")
    m.add_argument("--listen", metavar="HOST:PORT", help="be the decode side (two hosts)")
    m.add_argument("--connect", metavar="HOST:PORT", help="be the prefill side against a `bench kv --listen`")
    m.add_argument("--testbed", nargs="?", const=default_testbed, default=None, metavar="NAME",
                   help=f"decode in the testbed's namespace a, prefill in b (default name {default_testbed}); "
                        "--rails then takes rail indices")
    add_engine_opts(k)
    add_target_opts(k)
    return k


def plan_from_args(args: argparse.Namespace) -> KvPlan:
    if args.warmup_requests < 0:
        raise UsageError("--warmup-requests must be >= 0")
    if args.total_buffer_size:
        raise UsageError("--total-buffer-size does not apply to bench kv: the pools follow from the model, "
                         "--isl, --concurrency and --pool-pages")
    if sum(x is not None and x is not False for x in (args.listen, args.connect, args.testbed)) > 1:
        raise UsageError("--listen, --connect and --testbed exclude each other")
    if args.child and not (args.connect and args.json and args.json != "-"):
        raise UsageError("--child is internal (bench kv --testbed): it needs --connect and --json FILE")
    return make_plan(args.model, args.isl, args.page_tokens, args.tp, args.layout, args.requests,
                     args.concurrency, args.pool_pages)


def cmd_kv(args: argparse.Namespace) -> int:
    from multirail.bench import _engine_kwargs, _hostport

    plan = plan_from_args(args)
    eng = _engine_kwargs(args)
    if args.plot:
        from multirail.bench.plot import require_matplotlib
        require_matplotlib()
    if args.duration <= 0 or args.idle_timeout <= 0:
        raise UsageError("--duration and --idle-timeout must be positive")
    if args.listen:
        host, port = _hostport(args.listen)
        return serve(host=host, port=port, name=args.target_name, pool_bytes=plan.pool_bytes,
                     duration=args.duration, idle_timeout=args.idle_timeout, seg_type=args.target_seg_type,
                     device=args.device_id, **eng)
    out = sys.stderr if args.json == "-" else sys.stdout
    if not args.child:
        for line in plan.describe():
            print(line, file=out, flush=True)
    if args.connect:
        host, port = _hostport(args.connect)
        # --child: started by `bench kv --testbed` on this host, so both sides read one clock
        doc = run_prefill(args, plan, host, port, None, same_clock=args.child)
        if not args.child and doc["clock"]["err_us"] is not None:
            doc["problems"].append(f"decode_lat_* uses an estimated clock offset (error <= "
                                   f"{doc['clock']['err_us']:.0f} us)")
        return _emit(args, plan, doc)
    from multirail.bench import check_transport
    check_transport(args)  # before the decode process starts: the engine's own message, at once
    from multirail.bench.mem import check_gpu
    check_gpu(args)
    if args.testbed:
        doc = _run_testbed(args, plan)
    else:
        doc = _run_local(args, plan)
    _nixl(args, plan, doc)
    return _emit(args, plan, doc)


def _kv_argv(args: argparse.Namespace, plan: KvPlan) -> list[str]:
    argv = ["--model", plan.model.source if plan.model.source else args.model, "--isl", str(plan.isl),
            "--page-tokens", str(plan.page_tokens), "--tp", str(plan.tp), "--requests", str(plan.requests),
            "--warmup-requests", str(args.warmup_requests), "--concurrency", str(plan.concurrency),
            "--layout", plan.layout, "--pool-pages", str(plan.pool_pages), "--prep", args.prep,
            "--seed", str(args.seed)]
    argv += ["--check-consistency"] if args.check_consistency else []
    argv += ["--corrupt-mapping"] if args.corrupt_mapping else []
    return argv


def _engine_argv(args: argparse.Namespace, rails: str | None) -> list[str]:
    argv = ["--connections", str(args.connections), "--policy", args.policy, "--chunk-size", args.chunk_size,
            "--timeout", str(args.timeout), "--stall-timeout", str(args.stall_timeout),
            "--target-name", args.target_name, "--progress", args.progress, "--spin-us", str(args.spin_us),
            "--transport", eng_transport(args)]
    from multirail.bench import mem_argv
    return argv + mem_argv(args) + (["--rails", rails] if rails else [])


def eng_transport(args: argparse.Namespace) -> str:
    from multirail.bench import _transport
    return _transport(args)


def _start_decode(args: argparse.Namespace, plan: KvPlan, prefix: list[str], listen: str,
                  rails: str | None) -> tuple[subprocess.Popen[str], dict[str, Any], Any]:
    from multirail.bench import _child_env
    from multirail.bench.target import launch

    cmd = prefix + [sys.executable, "-m", "multirail", "bench", "kv", "--listen", listen,
                    "--duration", str(args.duration), "--idle-timeout", str(args.idle_timeout)]
    cmd += _kv_argv(args, plan) + _engine_argv(args, rails)
    try:
        return launch(cmd, ready_timeout=60.0 + plan.pool_bytes / 2e8, env=_child_env(args))
    except RuntimeError as e:
        raise BenchFailure(str(e).replace("bench target", "bench kv --listen")) from None


def _run_local(args: argparse.Namespace, plan: KvPlan) -> dict[str, Any]:
    from multirail.bench.target import stop

    proc, ready, errf = _start_decode(args, plan, [], "127.0.0.1:0", args.rails)
    try:
        doc = run_prefill(args, plan, "127.0.0.1", int(ready["port"]), None, same_clock=True)
    finally:
        stop(proc)
        errf.close()
    doc["transport"]["target_transport"] = ready.get("transport")
    return doc


def _run_testbed(args: argparse.Namespace, plan: KvPlan) -> dict[str, Any]:
    from multirail.bench import _child_env, _select_testbed_rails, _testbed
    from multirail.bench.target import stop

    tb = _select_testbed_rails(_testbed(args.testbed), args.rails)
    prefix_a, prefix_b = ["ip", "netns", "exec", tb["ns_a"]], ["ip", "netns", "exec", tb["ns_b"]]
    host = tb["a"][0]
    proc, ready, errf = _start_decode(args, plan, prefix_a, f"{host}:0", ",".join(tb["a"]))
    try:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "kv.json")
            cmd = prefix_b + [sys.executable, "-m", "multirail", "bench", "kv", "--connect",
                              f"{host}:{ready['port']}", "--json", out, "--child", "--no-nixl"]
            cmd += _kv_argv(args, plan) + _engine_argv(args, ",".join(tb["b"]))
            limit = args.duration
            try:  # its stderr is ours: progress shows live, and so do its errors
                res = subprocess.run(cmd, stdout=subprocess.DEVNULL, text=True, timeout=limit, env=_child_env(args))
            except subprocess.TimeoutExpired:
                raise BenchFailure(f"prefill side in the testbed did not finish within {limit:.0f} s") from None
            if not os.path.exists(out):
                raise BenchFailure(f"prefill side in namespace {tb['ns_b']} failed (exit {res.returncode}; "
                                   "its message is above)")
            with open(out) as f:
                data = json.load(f)
    finally:
        stop(proc)
        errf.close()
    rows = [_row_from_json(r) for r in data["rows"]]
    caps = [float(r) / 1e9 if r else None for r in tb["rates"]]
    for row in rows:
        row.set_capacity(caps)
    report = data.get("transport") or {"transport": eng_transport(args), "rails": []}
    report["target_transport"] = ready.get("transport")
    if data.get("memory") and "memory" not in report:
        report["memory"] = data["memory"]
    return {"rows": rows, "problems": list(data.get("problems", [])), "clock": data.get("clock", {}),
            "transport": report, "testbed": {"name": args.testbed, "ns_a": tb["ns_a"], "ns_b": tb["ns_b"], "a": tb["a"], "b": tb["b"],
                        "rates_bps": tb["rates"]}}


def _row_from_json(d: dict[str, Any]) -> KvRow:
    d = dict(d)
    d["rails"] = [RailRow(**x) for x in d.get("rails", [])]
    d["engine_rails"] = [RailRow(**x) for x in d.get("engine_rails", [])]
    return KvRow(**d)


def _nixl(args: argparse.Namespace, plan: KvPlan, doc: dict[str, Any]) -> None:
    if args.no_nixl:
        return
    if uses_vram(args):
        doc["problems"].append("NIXL kv run skipped: the bench runs NIXL on DRAM only")
        return
    from multirail.bench.kv_nixl import run_nixl_kv
    from multirail.bench.nixl_latency import nixl_available

    if not nixl_available():
        doc["problems"].append("NIXL kv run skipped: NIXL is not installed (pip install nixl-cu12)")
        return
    tb = doc.get("testbed")
    try:
        row = run_nixl_kv(plan, args.warmup_requests, args.seed, tb, timeout_s=args.duration)
    except BenchFailure as e:
        doc["problems"].append(f"NIXL kv run skipped: {e}")
        return
    if tb:
        row.set_capacity([float(r) / 1e9 if r else None for r in tb["rates_bps"]])
    doc["rows"].append(row)


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"


def format_kv_table(rows: list[KvRow]) -> str:
    head = (f"{'workload':<24} {'reqs':>5} {'Gbps':>7} {'p50 ms':>9} {'p99 ms':>9} {'dec p50':>9} "
            f"{'desc/s':>8} {'%cap':>6}  check")
    lines = [head, "-" * len(head)]
    for r in rows:
        dec = f"{r.decode_lat_p50_us / 1e3:9.2f}" if r.decode_lat_p50_us is not None else f"{'-':>9}"
        cap = f"{r.pct_of_capacity:5.1f}%" if r.pct_of_capacity is not None else f"{'-':>6}"
        lines.append(f"{r.worker:<24} {r.requests:>5} {r.gbps:7.3f} {r.lat_p50_us / 1e3:9.2f} "
                     f"{r.lat_p99_us / 1e3:9.2f} {dec} {_fmt_rate(r.descs_per_s):>8} {cap}  {r.consistency}")
        lines.extend(format_rails(r))  # type: ignore[arg-type]
        lines.extend(format_breakdown(r.staging))
    return "\n".join(lines)


def summary(rows: list[KvRow]) -> dict[str, Any]:
    kv = next((r for r in rows if r.worker == "multirail kv"), None)
    contig = next((r for r in rows if r.worker == "multirail contiguous"), None)
    nixl = next((r for r in rows if r.worker.startswith("nixl")), None)
    out: dict[str, Any] = {"ratio_to_contiguous": None, "ratio_to_nixl": None}
    if kv and contig and contig.gbps > 0:
        out["ratio_to_contiguous"] = kv.gbps / contig.gbps
        out["contiguous_text"] = (f"kv / contiguous = {100 * kv.gbps / contig.gbps:.1f}% ({kv.gbps:.3f} vs "
                                  f"{contig.gbps:.3f} Gbps; p50 {kv.lat_p50_us / 1e3:.2f} vs "
                                  f"{contig.lat_p50_us / 1e3:.2f} ms)")
    if kv and nixl and nixl.gbps > 0:
        out["ratio_to_nixl"] = kv.gbps / nixl.gbps
        out["nixl_text"] = (f"kv multirail / {nixl.worker} = {kv.gbps / nixl.gbps:.2f}x Gbps ({kv.gbps:.3f} vs "
                            f"{nixl.gbps:.3f}); p50 {kv.lat_p50_us / 1e3:.2f} vs {nixl.lat_p50_us / 1e3:.2f} ms; "
                            f"desc/s {_fmt_rate(kv.descs_per_s)} vs {_fmt_rate(nixl.descs_per_s)}")
    if kv:
        out.update(lat_p50_us=kv.lat_p50_us, lat_p99_us=kv.lat_p99_us, gbps=kv.gbps, descs_per_s=kv.descs_per_s,
                   pct_of_capacity=kv.pct_of_capacity, capacity_gbps=kv.capacity_gbps)
        if kv.descs_per_s:
            out["descs_text"] = (f"descriptors ({kv.prep}): {_fmt_rate(kv.descs_per_s)}/s prepare+post "
                                 f"({kv.descs} page descriptors in {kv.transfers} WRITEs; prepare "
                                 f"{_fmt_rate(kv.prep_descs_per_s)}/s, post {_fmt_rate(kv.post_descs_per_s)}/s, "
                                 f"forming the rows {_fmt_rate(kv.build_descs_per_s)}/s)")
        if kv.pct_of_capacity is not None:
            out["capacity_text"] = (f"kv {kv.gbps:.3f} Gbps = {kv.pct_of_capacity:.1f}% of the rails' capacity "
                                    f"({kv.capacity_gbps:.2f} Gbps)")
    return out


def _emit(args: argparse.Namespace, plan: KvPlan, doc: dict[str, Any]) -> int:
    rows: list[KvRow] = doc["rows"]
    if args.child:  # the parent prints, draws and decides
        with open(args.json, "w") as f:
            json.dump(json_clean({"rows": [r.to_json() for r in rows], "problems": doc.get("problems", []),
                              "clock": doc.get("clock", {}), "transport": doc.get("transport")}), f)
        return 0
    text_out = sys.stderr if args.json == "-" else sys.stdout
    print(format_kv_table(rows), file=text_out)
    from multirail.bench.worker import format_memory, format_transport
    transport = dict(doc.get("transport") or {"transport": eng_transport(args), "rails": []})
    memory = transport.pop("memory", None)
    print(format_transport(transport) + " (multirail rows)", file=text_out)
    print(format_memory(memory, transport), file=text_out)
    summ = summary(rows)
    for key in ("contiguous_text", "capacity_text", "descs_text", "nixl_text"):
        if key in summ:
            print(summ[key], file=text_out)
    problems = list(doc.get("problems", []))
    for note in sorted({r.staging["target_note"] for r in rows if r.staging and r.staging.get("target_note")}):
        problems.append(f"decode-side staging not measured ({note}): the breakdown shows the prefill side's stages only")
    for p in problems:
        print(f"note: {p}", file=sys.stderr)
    failed = [r for r in rows if r.consistency.startswith("FAILED")]
    checked = [r for r in rows if r.consistency != "not checked"]
    consistency = ("FAILED" if failed else "ok") if checked else "not checked"
    full = {"kv": plan.to_json(), "model": plan.model.to_json(), "rows": [r.to_json() for r in rows],
            **{k: v for k, v in summ.items() if not k.endswith("_text")}, "consistency": consistency,
            "clock": doc.get("clock", {}), "problems": problems, "transport": transport, "memory": memory,
            "config": args_config(args)}
    if "testbed" in doc:
        full["testbed"] = doc["testbed"]
    full = json_clean(full)
    if args.json:
        write_json(full, args.json)
    if args.plot:
        from multirail.bench.plot import plot_kv
        plot_kv(full, args.plot)
        print(f"plot: {args.plot}", file=text_out)
    if failed:
        print(f"multirail bench kv: consistency check FAILED: {failed[0].consistency}", file=sys.stderr)
        return 1
    return 0
