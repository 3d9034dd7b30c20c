"""Resource sampling of running processes by PID, for the chaos runs and the soak.

`ProcSampler` reads, every `interval_s` (+-25% jitter), for each watched PID: resident memory (``VmRSS`` of
``/proc/PID/status``), the number of open file descriptors (``len(os.listdir(/proc/PID/fd))``)
and the thread count (``Threads``). It runs in a daemon thread of the *host* process (the one
that started the target and the initiator), so the processes being measured run no extra
code. A process that has exited simply stops producing samples.

`growth` compares the median of an early window (after a warmup) with the median of the last
window and flags growth beyond given slacks: the soak's leak check.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

FIELDS = ("rss_kib", "fds", "threads")


@dataclass
class Sample:
    t: float          # seconds since the sampler started
    rss_kib: int
    fds: int
    threads: int


def read_proc(pid: int) -> tuple[str, int, int, int] | None:
    """(comm, VmRSS KiB, open fds, threads) of `pid`, or None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in status.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    try:
        rss = int(fields.get("VmRSS", "0 kB").split()[0])
        threads = int(fields.get("Threads", "0"))
    except (ValueError, IndexError):
        return None
    return fields.get("Name", "?"), rss, fds, threads


class ProcSampler:
    """Samples named PIDs every `interval_s` from a background thread (start/stop)."""

    def __init__(self, interval_s: float = 2.0) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.pids: dict[str, int] = {}
        self.comm: dict[str, str] = {}
        self.samples: dict[str, list[Sample]] = {}
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, pid: int) -> None:
        with self._lock:
            self.pids[name] = pid
            self.samples.setdefault(name, [])

    def start(self) -> None:
        if self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="procstat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def sample_once(self) -> None:
        now = time.monotonic() - self._t0
        with self._lock:
            for name, pid in self.pids.items():
                got = read_proc(pid)
                if got is None:
                    continue
                comm, rss, fds, threads = got
                self.comm[name] = comm
                self.samples[name].append(Sample(round(now, 3), rss, fds, threads))

    def _run(self) -> None:
        rng = random.Random(0x5A3)
        while not self._stop.is_set():
            self.sample_once()
            # +-25% jitter: a fixed interval can alias with a periodic load (a rail flapping
            # every 4 s sampled every 2 s always lands in the same two phases)
            self._stop.wait(self.interval_s * rng.uniform(0.75, 1.25))

    def to_json(self, with_samples: bool = True) -> dict[str, Any]:
        """{"interval_s", "processes": {name: {"pid", "comm", "n", "first", "last", "max",
        "samples": [[t, rss_kib, fds, threads], ...]}}}."""
        out: dict[str, Any] = {"interval_s": self.interval_s, "processes": {}}
        with self._lock:
            for name, pid in self.pids.items():
                s = self.samples.get(name, [])
                proc: dict[str, Any] = {"pid": pid, "comm": self.comm.get(name), "n": len(s),
                                        "first": asdict(s[0]) if s else None,
                                        "last": asdict(s[-1]) if s else None,
                                        "max": {f: max(getattr(x, f) for x in s) for f in FIELDS} if s else None}
                if with_samples:
                    proc["samples"] = [[x.t, x.rss_kib, x.fds, x.threads] for x in s]
                out["processes"][name] = proc
        return out


@dataclass
class Limits:
    """Allowed growth between the early and the late window."""

    rss_pct: float = 10.0      # RSS may grow by max(rss_pct % of the early median, rss_mib)
    rss_mib: float = 16.0
    fds: int = 2               # the fd count must come back to the early level +- fds
    threads: int = 2           # same for threads (a probe thread exists while a rail is down)


def _q(xs: list[int], q: float) -> int:
    """Nearest-rank quantile of an ascending list."""
    return xs[min(len(xs) - 1, max(0, int(q * len(xs))))]


def growth(samples: list[Sample], warmup_s: float, window_s: float, limits: Limits) -> dict[str, Any]:
    """Early window (samples in [warmup_s, warmup_s + window_s)) vs late window (the last
    window_s of samples): RSS by median; fds and threads by their p20 and p80 levels (medians
    reported). `problems` says what grew beyond `limits`."""
    if not samples:
        return {"problems": ["no samples"]}
    end = samples[-1].t
    early = [s for s in samples if warmup_s <= s.t < warmup_s + window_s]
    late = [s for s in samples if s.t > end - window_s]
    out: dict[str, Any] = {"warmup_s": warmup_s, "window_s": window_s, "early_n": len(early), "late_n": len(late)}
    problems: list[str] = []
    if len(early) < 3 or len(late) < 3:
        problems.append(f"too few samples to compare ({len(early)} early, {len(late)} late): run longer")
        out["problems"] = problems
        return out
    for f in FIELDS:
        e, l_ = sorted(getattr(s, f) for s in early), sorted(getattr(s, f) for s in late)
        out[f] = {"early_median": statistics.median(e), "late_median": statistics.median(l_),
                  "growth": statistics.median(l_) - statistics.median(e),
                  "early_p20_p80": [_q(e, 0.2), _q(e, 0.8)], "late_p20_p80": [_q(l_, 0.2), _q(l_, 0.8)],
                  "min": min(getattr(s, f) for s in samples), "max": max(getattr(s, f) for s in samples)}
    rss = out["rss_kib"]
    allowed_kib = max(rss["early_median"] * limits.rss_pct / 100.0, limits.rss_mib * 1024.0)
    rss["allowed_growth"] = allowed_kib
    if rss["growth"] > allowed_kib:
        problems.append(f"RSS grew {rss['growth'] / 1024:.1f} MiB ({rss['early_median'] / 1024:.1f} -> "
                        f"{rss['late_median'] / 1024:.1f} MiB; allowed {allowed_kib / 1024:.1f} MiB)")
    # fds and threads are two-valued under flapping (a down rail has no sockets and threads of its
    # own, and a probe thread): a median of a half-and-half mix can sit on either value, so
    # compare like with like, the low (p20) and high (p80) levels of each window, as well
    for f, slack in (("fds", limits.fds), ("threads", limits.threads)):
        d = out[f]
        d["allowed_growth"] = slack
        moved = [abs(b - a) for a, b in zip(d["early_p20_p80"], d["late_p20_p80"])]
        if max(moved) > slack:
            problems.append(f"{f} p20/p80 {d['early_p20_p80'][0]:g}/{d['early_p20_p80'][1]:g} -> "
                            f"{d['late_p20_p80'][0]:g}/{d['late_p20_p80'][1]:g} (allowed +-{slack})")
    # the RSS trend after the warmup, for the report: Theil-Sen (median of pairwise slopes),
    # which a few transient peaks do not move, in KiB per minute
    pts = [(s.t, float(s.rss_kib)) for s in samples if s.t >= warmup_s]
    pts = pts[::max(1, len(pts) // 300)]
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts) for x2, y2 in pts[i + 1:] if x2 > x1]
    if slopes:
        out["rss_trend_kib_per_min"] = statistics.median(slopes) * 60.0
    out["problems"] = problems
    return out
