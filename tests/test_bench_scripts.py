"""The diagnosis benchmarks of issue 22 that docs/benchmarks.md quotes: benchmarks/uneven_rails.py
(its per-run columns, above all the adjacent iperf3 reference each run is set against) and
benchmarks/slow_requests.py (typical against slow transfers). The report arithmetic is checked on
made-up rows; one short real run of each checks that every column is measured (no rate is
asserted: the CPUs are shared)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import engine_available
from multirail.testbed import Testbed

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
ENV = {**os.environ, "PYTHONPATH": str(REPO / "python")}


def _uneven() -> ModuleType:
    """benchmarks/uneven_rails.py as a module (the benchmarks are scripts, not a package)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("uneven_rails")
    finally:
        sys.path.remove(str(BENCH))


def _row(gbps: float, rail_bytes: list[int], nic_gbps: list[float], lat_ms: tuple[float, float, float]) -> dict[str, Any]:
    return {"gbps": gbps, "engine_rails": [{"bytes": b} for b in rail_bytes],
            "rails": [{"gbps": g} for g in nic_gbps],
            "lat_min_us": lat_ms[0] * 1e3, "lat_p50_us": lat_ms[1] * 1e3, "lat_max_us": lat_ms[2] * 1e3}


def test_adjacent_reference_is_the_mean_of_what_was_measured():
    m = _uneven()
    before, after = m.Ref("READ", [2.0e9, 1.0e9]), m.Ref("READ", [1.8e9, 0.9e9])
    assert m.adjacent(before, after) == pytest.approx([1.9e9, 0.95e9])
    assert m.adjacent(None, after) == [1.8e9, 0.9e9]
    assert m.adjacent(None, None) is None


def test_summary_sets_each_run_against_its_own_adjacent_reference():
    m = _uneven()
    cap = [2.0e9, 1.0e9]
    first = _row(2.97, [2 << 30, 1 << 30], [1.98, 0.99], (180, 181, 190))
    first |= {"tcp": {"RetransSegs": 12, "TCPTimeouts": 0, "TCPLossProbes": 3}, "host_busy_pct": 55.0}

    def trace(lat_ms: float, done_ms: list[float | None], start_ms: float = 0.0) -> dict[str, Any]:
        return {"lat_us": lat_ms * 1e3, "total_us": max(d or 0 for d in done_ms) * 1e3,
                "rails": [{"bytes": 0 if d is None else 1, "chunks": 0 if d is None else 1,
                           "first_issue_us": None if d is None else start_ms * 1e3,
                           "last_done_us": None if d is None else d * 1e3, "rate_gbps_at_post": 2.0 - k}
                          for k, d in enumerate(done_ms)]}
    # the slowest transfer (190 ms): one rail 9 ms behind the other, where the others' rails
    # finished 1 ms apart; a rail that carried nothing does not count in the spread
    first["traces"] = [trace(181, [180, 179]), trace(190, [180, 189], start_ms=0.5), trace(180, [179, 178]),
                       trace(182, [181, None])]
    rows = {"READ": [first,
                     # a slow run in a slow stretch: 2.70 of 3.0 capacity, but of 2.75 adjacent
                     _row(2.70, [2 << 30, 1 << 30], [1.80, 0.90], (180, 200, 260))],
            "WRITE": [_row(2.95, [3, 1], [2.0, 0.95], (181, 182, 183))]}
    adj = {"READ": [[2.0e9, 1.0e9], [1.85e9, 0.9e9]], "WRITE": [None]}
    lines, runs, ok = m.summarize(rows, cap, adj, 97.0)
    r0, r1 = runs["READ"]
    assert r0["pct"] == pytest.approx(99.0) and r0["pct_of_adjacent"] == pytest.approx(99.0)
    assert r1["pct"] == pytest.approx(90.0) and r1["pct_of_adjacent"] == pytest.approx(100 * 2.70 / 2.75)
    assert r1["nic_pct_of_adjacent"] == pytest.approx([100 * 1.80 / 1.85, 100.0])
    assert r1["split"] == pytest.approx([2 / 3, 1 / 3]) and r1["lat_ms"] == [180, 200, 260]
    assert r1["adjacent_bps"] == [1.85e9, 0.9e9] and r1["nic_gbps"] == [1.80, 0.90]
    w = runs["WRITE"][0]  # no adjacent reference measured: said so, not made up
    assert w["pct_of_adjacent"] is None and w["nic_pct_of_adjacent"] is None and w["split"] == [0.75, 0.25]
    assert not ok  # the verdict stays on the capacity: READ run 2 missed it
    text = "\n".join(lines)
    assert "READ: min 90.0%, median 94.5%, max 99.0% of capacity (floor 97.0%: NOT met)" in text
    assert "READ: of the adjacent iperf3: min 98.2%" in text
    assert "WRITE: min 98.3%" in text and "(floor 97.0%: met)" in text
    assert "WRITE: of the adjacent" not in text
    assert "| 1 | 2.970 | 99.0% | 99.0% | 0.667:0.333 | 0.667:0.333 | 99% 99% | 180.0 / 181.0 / 190.0 | 180 / 189 (start 0.5; spread 9.0; median 1.0) | 12 / 0 / 3 | 55% |" in text
    assert r0["tcp"]["RetransSegs"] == 12 and r0["host_busy_pct"] == 55.0
    assert r0["slowest"] == {"lat_ms": 190, "spread_ms": 9, "start_ms": 0.5, "median_spread_ms": 1,
                             "rails": [{"bytes": 1, "last_done_ms": 180, "rate_gbps_at_post": 2.0},
                                       {"bytes": 1, "last_done_ms": 189, "rate_gbps_at_post": 1.0}]}
    assert r1["slowest"] is None  # no trace: a dash
    # counters not taken: a dash, not a zero
    assert "| 2 | 2.700 | 90.0% | 98.2% | 0.667:0.333 | 0.667:0.333 | 97% 100% | 180.0 / 200.0 / 260.0 | - | - / - / - | - |" in text


def test_a_callers_pythonpath_goes_before_the_repositorys(monkeypatch: pytest.MonkeyPatch):
    """An A/B run puts another build first on PYTHONPATH; the children the rail-shape scripts
    start must import that build, not this repository's (they did not, until session 17)."""
    cr = _uneven().cr
    monkeypatch.setenv("PYTHONPATH", "/other/build")
    assert cr._env()["PYTHONPATH"].split(os.pathsep) == ["/other/build", str(REPO / "python")]
    monkeypatch.delenv("PYTHONPATH")
    assert cr._env()["PYTHONPATH"] == str(REPO / "python")


def _netns_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2"
    if shutil.which("iperf3") is None:
        return "needs iperf3"
    if not engine_available():
        return "multirail._core is not built (run `make setup`)"
    return None


@pytest.mark.skipif(_netns_reason() is not None, reason=_netns_reason() or "")
def test_uneven_rails_measures_every_column(tmp_path: Path):
    name = f"ur{uuid.uuid4().hex[:6]}"
    out = tmp_path / "ur.json"
    try:
        cp = subprocess.run([sys.executable, str(BENCH / "uneven_rails.py"), "--name", name, "--rates", "1gbit,500mbit",
                             "--runs", "2", "--iters", "2", "--ops", "READ,WRITE", "--time", "1",
                             "--adjacent-time", "1", "--floor", "0", "--json", str(out)],
                            capture_output=True, text=True, env=ENV, timeout=240)
    finally:
        Testbed(name, rails=1).down()
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["adjacent_time_s"] == 1 and len(res["capacity_bps"]) == 2 and all(c > 0 for c in res["capacity_bps"])
    for op in ("READ", "WRITE"):
        assert len(res["runs"][op]) == 2
        for r in res["runs"][op]:
            assert len(r["adjacent_bps"]) == 2 and all(b > 0 for b in r["adjacent_bps"]), r
            assert r["pct_of_adjacent"] > 0 and len(r["nic_pct_of_adjacent"]) == 2
            assert len(r["nic_gbps"]) == 2 and all(g > 0 for g in r["nic_gbps"]), r  # both rails carried bytes
            assert r["lat_ms"][0] <= r["lat_ms"][1] <= r["lat_ms"][2]
            assert set(r["tcp"]) == {"RetransSegs", "TCPTimeouts", "TCPLossProbes"} and all(v >= 0 for v in r["tcp"].values())
            assert 0 < r["host_busy_pct"] <= 100 and 0 <= r["host_steal_pct"] <= 100
            # the slowest of the run's transfers, traced: both rails carried bytes and finished
            slow = r["slowest"]
            assert slow["lat_ms"] == pytest.approx(r["lat_ms"][2], rel=1e-6), (slow, r["lat_ms"])
            assert [x["bytes"] > 0 for x in slow["rails"]] == [True, True], slow
            assert all(0 < x["last_done_ms"] <= slow["lat_ms"] for x in slow["rails"]), slow
            assert 0 <= slow["start_ms"] < slow["lat_ms"] and slow["spread_ms"] >= 0, slow
    assert "| READ run | Gbps | % of capacity | % of adjacent iperf3 |" in cp.stdout
    assert "READ: of the adjacent iperf3: min" in cp.stdout
    assert Testbed.load(name) is None  # the script removed the testbed it created


@pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")
def test_slow_requests_splits_typical_from_slow():
    cp = subprocess.run([sys.executable, str(BENCH / "slow_requests.py"), "--mib", "64", "--transfers", "8"],
                        capture_output=True, text=True, env=ENV, timeout=120)
    assert cp.returncode == 0, cp.stderr[-2000:]
    lines = cp.stdout.splitlines()
    order = next(x for x in lines if x.startswith("order: "))[len("order: "):]
    assert len(order) == 8 and set(order) <= set(".xX")
    assert "8 WRITEs of 64 MiB, progress adaptive" in cp.stdout
    table = {x.split()[0]: x for x in lines[lines.index(next(x for x in lines if x.startswith("mean per transfer"))) + 1:]}
    # the wall time row, the process's CPU and at least one engine thread's CPU were measured
    assert "wall" in table and "process" in table, cp.stdout
    assert any(k.startswith("mr-") for k in table), cp.stdout
