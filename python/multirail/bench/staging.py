"""Per-stage breakdown of staged GPU transfers (D2H, wire, H2D) for one timed loop.

The engine keeps running totals per rail (`Agent.rail_stats(peer)[i]["staging"]`, the initiator's
own staging: D2H for WRITEs from its VRAM, wire + H2D for READs into it) and per peer and rail
of what a target staged (`Agent.served_stats()[j]["staging"]`: D2H + wire serving READs of its
VRAM, wire + H2D landing WRITEs into it): {"d2h"|"wire"|"h2d": {"ops", "bytes", "busy_s"},
"chunks", "pool_bytes", "pools"}. The bench sums them over rails, takes the difference across
the timed loop and turns each stage into time per operation and % busy (busy_s / the loop's
wall time). busy_s sums over every staging pipeline (one per connection and direction), so with
several rails or connections a stage can exceed 100 %; the bottleneck is the side and stage
with the highest % busy.

Transfers to a peer's VRAM on the same host may go by CUDA IPC instead (one device copy, no
staging, `peer_counters()["ipc_transfers"/"ipc_bytes"]`); the breakdown counts those too, as
"ipc", so a loop with nothing staged says why.

Pure functions (no engine): unit-testable.
"""

from __future__ import annotations

from typing import Any, Iterable

STAGES = ("d2h", "wire", "h2d")
LABELS = {"d2h": "D2H", "wire": "wire", "h2d": "H2D"}


def empty() -> dict[str, Any]:
    out: dict[str, Any] = {s: {"ops": 0, "bytes": 0, "busy_s": 0.0} for s in STAGES}
    out.update(chunks=0, pool_bytes=0, pools=0)
    return out


def total(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The staging dicts of `rows` (rail_stats / served_stats rows) summed; rows without one
    count nothing."""
    out = empty()
    for row in rows:
        st = row.get("staging") if isinstance(row, dict) else None
        if not isinstance(st, dict):
            continue
        for s in STAGES:
            for k in ("ops", "bytes", "busy_s"):
                out[s][k] += (st.get(s) or {}).get(k, 0) or 0
        for k in ("chunks", "pool_bytes", "pools"):
            out[k] += st.get(k, 0) or 0
    return out


def side(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """One side's stages over a loop: per stage ops, bytes, busy_s (deltas), us_per_op and
    busy_pct; chunks (delta); pool_bytes and pools as they stand after the loop."""
    out: dict[str, Any] = {}
    for s in STAGES:
        ops = max(0, int(after[s]["ops"]) - int(before[s]["ops"]))
        nbytes = max(0, int(after[s]["bytes"]) - int(before[s]["bytes"]))
        busy = max(0.0, float(after[s]["busy_s"]) - float(before[s]["busy_s"]))
        out[s] = {"ops": ops, "bytes": nbytes, "busy_s": busy,
                  "us_per_op": busy / ops * 1e6 if ops else None,
                  "busy_pct": 100.0 * busy / wall_s if wall_s > 0 else None}
    out["chunks"] = max(0, int(after["chunks"]) - int(before["chunks"]))
    out["pool_bytes"] = int(after["pool_bytes"])
    out["pools"] = int(after["pools"])
    return out


def initiator_side(agent: Any, peer: str) -> tuple[dict[str, Any], dict[str, int] | None]:
    """The initiator's own staging totals to `peer` (rail_stats, summed over rails; empty when
    there is no link) and its CUDA IPC counts (peer_counters; None for an engine without)."""
    try:
        init = total(agent.rail_stats(peer))
    except Exception:  # noqa: BLE001 - MultirailError: no link to the peer yet
        init = empty()
    try:
        counters = dict(agent.peer_counters(peer))
    except Exception:  # noqa: BLE001 - an engine without peer_counters, or no link
        counters = None
    return init, ipc_counters(counters)


def ipc_counters(counters: dict[str, Any] | None) -> dict[str, Any] | None:
    """{"transfers", "bytes", "copies", "copy_calls", "copy_path"} of CUDA IPC from
    `peer_counters()`; None for an engine without."""
    if not counters or "ipc_transfers" not in counters:
        return None
    return {"transfers": int(counters.get("ipc_transfers") or 0), "bytes": int(counters.get("ipc_bytes") or 0),
            "copies": int(counters.get("ipc_copies") or 0), "copy_calls": int(counters.get("ipc_copy_calls") or 0),
            "copy_path": str(counters.get("ipc_copy_path") or "")}


def breakdown(wall_s: float, init: tuple[dict[str, Any], dict[str, Any]],
              target: tuple[dict[str, Any], dict[str, Any]] | None, target_note: str | None = None,
              ipc: tuple[dict[str, int] | None, dict[str, int] | None] | None = None,
              seg_types: dict[str, str] | None = None) -> dict[str, Any]:
    """{"wall_s", "seg_types": {"initiator", "target"}, "initiator": side, "target": side | None,
    "target_note": why the target's stages are missing (None when present), "ipc": {"transfers",
    "bytes"} moved by CUDA IPC in the loop (None: the engine does not count them), "bottleneck":
    "target D2H" | None, "bottleneck_busy_pct"}."""
    out: dict[str, Any] = {"wall_s": wall_s, "seg_types": seg_types,
                           "initiator": side(init[0], init[1], wall_s),
                           "target": side(target[0], target[1], wall_s) if target else None,
                           "target_note": None if target else (target_note or "not reachable"),
                           "ipc": None}
    if ipc and ipc[0] is not None and ipc[1] is not None:
        out["ipc"] = {k: max(0, ipc[1].get(k, 0) - ipc[0].get(k, 0)) for k in ("transfers", "bytes", "copies", "copy_calls")}
        out["ipc"]["copy_path"] = ipc[1].get("copy_path", "")
    best: tuple[float, str] | None = None
    for who in ("initiator", "target"):
        sd = out[who]
        if not sd:
            continue
        for s in STAGES:
            pct = sd[s]["busy_pct"]
            if sd[s]["ops"] and pct is not None and (best is None or pct > best[0]):
                best = (pct, f"{who} {LABELS[s]}")
    out["bottleneck"] = best[1] if best else None
    out["bottleneck_busy_pct"] = best[0] if best else None
    return out


def _fmt_size(n: int) -> str:
    from multirail.bench.core import format_size

    return format_size(n) if n else "0"


def _stage_text(st: dict[str, Any]) -> str:
    if not st["ops"]:
        return "-"
    return f"{st['us_per_op']:.1f} us/op {st['busy_pct']:.0f}%"


def format_breakdown(b: dict[str, Any] | None, indent: str = "      ") -> list[str]:
    """Lines under a row: each side's D2H / wire / H2D (time per op, % busy), its pinned pool,
    what CUDA IPC moved, and the bottleneck."""
    if not b:
        return []
    lines = []
    for who in ("initiator", "target"):
        sd = b.get(who)
        if not sd:
            lines.append(f"{indent}staging {who:<9} (not measured: {b.get('target_note')})")
            continue
        if not any(sd[s]["ops"] for s in STAGES):
            seg = (b.get("seg_types") or {}).get(who)
            why = "its memory is DRAM" if seg == "DRAM" else "nothing staged in this loop"
            lines.append(f"{indent}staging {who:<9} none ({why})")
            continue
        stages = ", ".join(f"{LABELS[s]} {_stage_text(sd[s])}" for s in STAGES)
        lines.append(f"{indent}staging {who:<9} {stages}; pool {_fmt_size(sd['pool_bytes'])} "
                     f"in {sd['pools']} pool(s)")
    ipc = b.get("ipc") or {}
    if ipc.get("transfers"):
        calls = (f": {ipc['copies']} copies in {ipc['copy_calls']} calls, {ipc['copy_path']}"
                 if ipc.get("copies") else "")
        lines.append(f"{indent}CUDA IPC  {ipc['transfers']} transfers, {ipc['bytes']} B as device copies "
                     f"(same host: not staged){calls}")
    if b.get("bottleneck"):
        lines.append(f"{indent}bottleneck: {b['bottleneck']} ({b['bottleneck_busy_pct']:.0f}% busy)")
    else:
        lines.append(f"{indent}bottleneck: none (nothing was staged in this loop"
                     f"{': CUDA IPC moved it' if ipc.get('transfers') else ''})")
    return lines
