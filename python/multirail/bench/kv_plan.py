"""`bench kv`'s workload: the KV plan (pages, layers, pool), page patterns and their verification,
and the names of the kv session's control messages. Part of `multirail.bench.kv`
(docs/bench-kv.md), which re-exports every name here."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from multirail.bench.core import UsageError, _M1, _M2, _M3, format_size, pattern
from multirail.bench.kvmodels import ModelSpec, load_model
from multirail.bench.mem import BenchMem
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
