"""`bench kv`'s decode side (`bench kv --listen`): the agent that owns the KV pool and answers the
prefill side's session. Part of `multirail.bench.kv` (docs/bench-kv.md), which re-exports every
name here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from multirail.bench import protocol as proto
from multirail.bench.mem import BenchMem, ipc_config
from multirail.bench.kv_plan import DEFAULT_SEED, KV_BEGIN, KV_CLOCK, KV_DONE, KV_LAYER, KV_READY, KV_REQ, KvPlan, verify_pages, verify_range


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

    def run(self, duration: float, idle_timeout: float) -> str:
        from multirail.bench.target import RETRY_S, WAIT_S, _handle, send_replies

        start = last = time.monotonic()
        while True:
            now = time.monotonic()
            if now - start > duration:
                return "duration"
            if now - last > idle_timeout:
                return "idle"
            # Sleep in the engine until a notification comes: decode latency is measured from
            # the wake-up, and a poll loop would take the cores the transfers run on.
            for peer, msgs in self.agent.get_new_notifs(RETRY_S if self.outbox else WAIT_S).items():
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
                        reply = self._kv(kind, body, t_ns)
                    else:
                        reply = _handle(kind, body, self.buf, None, self.agent, peer)
                    if reply is not None:
                        self.outbox.append((peer, reply))
            self.outbox = send_replies(self.agent, self.outbox, self.mr)

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
