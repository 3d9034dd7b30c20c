"""Pure pieces of `multirail bench`: size strings, the block-size ladder, the consistency
pattern, latency statistics, result rows, the table and the progress line.

Nothing here touches the engine or the network, so it is unit-tested directly.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence, TextIO

import numpy as np

from multirail.bench.staging import format_breakdown


class UsageError(ValueError):
    """A bad command-line value (exit code 2)."""


_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000**2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse "4096", "4KiB", "4K" (binary), "4KB" (decimal), "1.5MiB" into bytes (> 0)."""
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"invalid size {text!r} (use e.g. 4096, 4KiB, 64MiB, 1GiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value) or int(value) <= 0:
        raise UsageError(f"invalid size {text!r}: must be a positive whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """Inverse of parse_size for exact binary multiples: 65536 -> "64KiB", 1000 -> "1000B"."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


def block_sizes(start: int, maximum: int) -> list[int]:
    """Doubling ladder start, 2*start, ... up to and including maximum (maximum always last)."""
    if start <= 0 or maximum <= 0:
        raise UsageError("block sizes must be positive")
    if maximum < start:
        raise UsageError(f"--max-block-size ({format_size(maximum)}) is smaller than "
                         f"--start-block-size ({format_size(start)})")
    sizes = []
    s = start
    while s < maximum:
        sizes.append(s)
        s *= 2
    sizes.append(maximum)
    return sizes


# -- consistency pattern ---------------------------------------------------------------------

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


def pattern(seed: int, offset: int, length: int) -> np.ndarray:
    """Deterministic bytes for buffer range [offset, offset+length) under `seed`.

    splitmix64 of the 8-byte word index, so a misplaced, swapped or shifted block (of any
    size) shows as a mismatch, unlike a short periodic pattern.
    """
    if length <= 0:
        return np.zeros(0, dtype=np.uint8)
    first, last = offset // 8, (offset + length + 7) // 8
    with np.errstate(over="ignore"):
        z = (np.arange(first, last, dtype=np.uint64) + np.uint64(seed & 0xFFFFFFFF)) * _M1
        z ^= z >> np.uint64(30)
        z *= _M2
        z ^= z >> np.uint64(27)
        z *= _M3
        z ^= z >> np.uint64(31)
    raw = z.view(np.uint8)
    skip = offset - first * 8
    return raw[skip:skip + length]


def first_mismatch(buf: np.ndarray, seed: int, offset: int = 0) -> int | None:
    """Offset (relative to the buffer range start) of the first byte that breaks the pattern."""
    expect = pattern(seed, offset, len(buf))
    bad = np.flatnonzero(buf != expect)
    return int(bad[0]) if bad.size else None


def seed_for(block_size: int, op: str) -> int:
    """Seed of the data an initiator WRITEs at one block size (distinct per size and op)."""
    return (block_size * 2654435761 + (1 if op == "WRITE" else 0)) & 0xFFFFFFFF


TARGET_SEED = 0x5EED


# -- statistics and rows ---------------------------------------------------------------------

def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not sorted_samples:
        return float("nan")
    rank = math.ceil(q / 100.0 * len(sorted_samples))
    return float(sorted_samples[min(max(rank, 1), len(sorted_samples)) - 1])


@dataclass
class RailRow:
    """Bytes one rail carried during a timed loop, and the rate that makes."""

    name: str
    bytes: int
    gbps: float
    source: str = ""
    capacity_gbps: float | None = None
    transport: str | None = None  # engine rails: "tcp", "ucx/tcp", "ucx/rc_mlx5", ...


@dataclass
class BenchRow:
    """One block size of one sweep (the unit of the table and of the JSON file)."""

    op: str
    block_size: int
    batch_size: int
    iterations: int
    seconds: float
    total_bytes: int
    gbps: float
    gb_per_s: float
    lat_avg_us: float
    lat_p50_us: float
    lat_p99_us: float
    lat_min_us: float
    lat_max_us: float
    worker: str = "multirail"
    consistency: str = "not checked"
    rails: list[RailRow] = field(default_factory=list)
    engine_rails: list[RailRow] = field(default_factory=list)
    cpu_pct: float | None = None  # CPU time / wall time of the measuring thread (%), where known
    staging: dict[str, Any] | None = None  # runs with VRAM: per-stage breakdown (bench/staging.py)
    # --trace: per timed transfer, its latency and what each rail did (XferHandle.trace)
    traces: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_row(op: str, block_size: int, batch_size: int, latencies_s: Sequence[float],
             wall_s: float, worker: str = "multirail") -> BenchRow:
    """Summarise one timed loop: throughput = bytes moved / wall time of the whole loop."""
    n = len(latencies_s)
    total = block_size * batch_size * n
    lat_us = sorted(x * 1e6 for x in latencies_s)
    gb_per_s = total / wall_s / 1e9 if wall_s > 0 else 0.0
    return BenchRow(
        op=op, block_size=block_size, batch_size=batch_size, iterations=n, seconds=wall_s,
        total_bytes=total, gbps=gb_per_s * 8, gb_per_s=gb_per_s,
        lat_avg_us=sum(lat_us) / n if n else float("nan"),
        lat_p50_us=percentile(lat_us, 50), lat_p99_us=percentile(lat_us, 99),
        lat_min_us=lat_us[0] if n else float("nan"), lat_max_us=lat_us[-1] if n else float("nan"),
        worker=worker,
    )


# -- output -----------------------------------------------------------------------------------

def format_table(rows: Sequence[BenchRow]) -> str:
    """The human table: one line per block size, then per-rail shares under each line."""
    head = (f"{'op':<5} {'block':>8} {'batch':>5} {'iters':>6} {'GB/s':>8} {'Gbps':>8} "
            f"{'avg us':>10} {'p50 us':>10} {'p99 us':>10}  check")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.op:<5} {format_size(r.block_size):>8} {r.batch_size:>5} {r.iterations:>6} "
            f"{r.gb_per_s:>8.3f} {r.gbps:>8.2f} {r.lat_avg_us:>10.1f} {r.lat_p50_us:>10.1f} "
            f"{r.lat_p99_us:>10.1f}  {r.consistency}")
        lines.extend(format_rails(r))
        lines.extend(format_breakdown(r.staging))
    return "\n".join(lines)


def format_rails(row: BenchRow) -> list[str]:
    """Per-rail lines: counter bytes and share, next to the engine's own accounting."""
    out: list[str] = []
    total = sum(x.bytes for x in row.rails)
    engine = {x.name: x for x in row.engine_rails}
    for i, rail in enumerate(row.rails):
        share = 100.0 * rail.bytes / total if total else 0.0
        line = (f"      rail {rail.name:<12} {share:5.1f}% {rail.gbps:8.2f} Gbps "
                f"({rail.bytes} B, {rail.source})")
        eng = engine.get(rail.name) or (row.engine_rails[i] if i < len(row.engine_rails) else None)
        if eng is not None:
            line += f"  engine: {eng.gbps:8.2f} Gbps ({eng.bytes} B{', ' + eng.transport if eng.transport else ''})"
        out.append(line)
    if not row.rails and row.engine_rails:
        for eng in row.engine_rails:
            out.append(f"      rail {eng.name:<12} engine: {eng.gbps:8.2f} Gbps ({eng.bytes} B"
                       f"{', ' + eng.transport if eng.transport else ''})")
    caps = [x.capacity_gbps for x in row.rails]
    if row.rails and all(c for c in caps):
        cap_sum = sum(c for c in caps if c)
        out.append(f"      aggregate {row.gbps:.2f} Gbps = {100.0 * row.gbps / cap_sum:.1f}% "
                   f"of the rails' sum ({cap_sum:.2f} Gbps)")
    return out


class Progress:
    """A single updating status line on a terminal's stderr; silent everywhere else."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self._width = 0

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width = len(text)

    def clear(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


def args_config(args: Any) -> dict[str, Any]:
    """The command line's settings for a JSON result: the secret's value never written."""
    return {k: ("(set)" if k == "secret" and v else v) for k, v in vars(args).items() if k != "func"}


def write_json(doc: Any, dest: str) -> None:
    """`doc` (NaNs as null) to `dest`: a file, or stdout for "-"."""
    import json
    import sys

    doc = json_clean(doc)
    if dest == "-":
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        with open(dest, "w") as f:
            json.dump(doc, f, indent=1)


def json_clean(obj: Any) -> Any:
    """JSON has no NaN: NaN floats (latencies a baseline does not measure) become null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_clean(v) for v in obj]
    return obj
