"""Striping and failover on the emulated testbed (issues 3 and 4), end to end.

Every test builds its own uniquely named testbed (python/multirail/testbed.py: two network
namespaces joined by tbf-shaped veth rails) and always tears it down. The target runs in
namespace a, the initiator in namespace b, each in its own process:

* striping: `multirail bench local --testbed NAME --check-consistency --json -` (the bench
  tool itself), checking the per-rail NIC counters read inside b and the engine's accounting;
* failover: the drills of python/multirail/bench/drill.py, which take rails down with
  `Testbed.set_link` in the middle of a transfer and report what the engine saw.

Needs root, network namespaces and the built engine; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import netns_unavailable

from multirail.bench.drill import run_drill

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "python")}
MiB = 1 << 20
STALL_S = 1.0


def _why_not() -> str | None:
    try:
        import multirail._core  # noqa: F401
    except ImportError as e:
        return f"the engine extension is not built ({e})"
    return netns_unavailable()


_SKIP = _why_not()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture
def testbed(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh testbed named uniquely for this test; removed even when the test fails.
    Parametrise with indirect=True: {"rails": N, "rate": R} or {"rates": [...]}."""
    from multirail.testbed import Testbed

    spec = dict(getattr(request, "param", {"rails": 2, "rate": "1gbit"}))
    tb = Testbed(f"rt{uuid.uuid4().hex[:6]}", **spec)
    with tb:
        yield tb


def bench_testbed(tb: Any, *args: str, timeout: float = 90) -> dict[str, Any]:
    """Run `multirail bench local --testbed` on `tb`; return its JSON document."""
    cmd = [sys.executable, "-m", "multirail", "bench", "local", "--testbed", tb.name,
           "--start-block-size", "64MiB", "--max-block-size", "64MiB", "--warmup-iter", "1",
           "--json", "-", *args]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert cp.returncode == 0, f"bench failed ({cp.returncode}): {cp.stderr[-1500:]}"
    doc: dict[str, Any] = json.loads(cp.stdout)
    return doc


def shares(rails: list[dict[str, Any]]) -> list[float]:
    total = sum(r["bytes"] for r in rails)
    assert total > 0, rails
    return [r["bytes"] / total for r in rails]


@pytest.mark.parametrize("testbed", [{"rails": 2, "rate": "2gbit"}], indirect=True)
def test_two_rails_read_and_write_stripe_byte_exact(testbed: Any) -> None:
    for op in ("READ", "WRITE"):
        row = bench_testbed(testbed, "--op", op, "--num-iter", "4", "--check-consistency")["rows"][0]
        assert row["consistency"] == "ok", row
        nic = row["rails"]
        assert [r["name"] for r in nic] == [r.devs["b"] for r in testbed.rails]
        assert all(r["source"].startswith("netdev") for r in nic)
        assert min(shares(nic)) >= 0.30, f"{op}: one rail idle: {nic}"
        # the counters see the payload plus headers: at least what the engine moved
        assert sum(r["bytes"] for r in nic) >= row["total_bytes"]
        assert sum(r["bytes"] for r in row["engine_rails"]) >= row["total_bytes"]
        assert all(r["capacity_gbps"] == pytest.approx(2.0) for r in nic)


@pytest.mark.parametrize("testbed", [{"rates": ["2gbit", "1gbit"]}], indirect=True)
def test_heterogeneous_rails_split_by_rate(testbed: Any) -> None:
    row = bench_testbed(testbed, "--op", "READ", "--num-iter", "6")["rows"][0]
    eng = [r["bytes"] for r in row["engine_rails"]]
    assert eng[1] > 0, row["engine_rails"]
    # 2:1 within 15%: an equal split (what ignoring the rates gives) is 1:1. The precision of the
    # split is the benchmark's to measure (docs/benchmarks.md: 0.665-0.667 of the bytes on the
    # 2 Gbit/s rail on a quiet host); on a loaded one (load average 30) a 6-transfer run split
    # 1.79:1, so this bound is a function check, not a precision claim.
    assert 1.7 <= eng[0] / eng[1] <= 2.3, f"engine split {eng} is not within 15% of 2:1"
    nic = shares(row["rails"])
    assert 0.6 <= nic[0] <= 0.733, f"NIC counters split {nic}"


def _check_rail_down(stats: list[dict[str, Any]], rail: int) -> None:
    assert stats[rail]["up"] is False and stats[rail]["down_reason"], stats[rail]
    assert stats[rail]["times_down"] >= 1
    assert all(s["up"] for i, s in enumerate(stats) if i != rail), stats


@pytest.mark.parametrize("op,how", [("READ", "link"), ("WRITE", "link"), ("WRITE", "blackhole")])
def test_failover_mid_transfer_and_readmit(testbed: Any, op: str, how: str) -> None:
    """`link`: side a's device goes down (side b loses carrier, seen in ~0.1 s); `blackhole`:
    side a silently drops its traffic on the rail, carrier intact (only the stall timeout sees it)."""
    out = run_drill(testbed, {"mode": "failover", "op": op, "size": 256 * MiB, "rail": 1, "how": how,
                              "stall_timeout": STALL_S}, timeout=90)
    for step in ("baseline", "failover", "one_rail", "after_readmit"):
        assert out[step]["ok"] and out[step]["corrupt"] is None, (step, out[step])
    fo = out["failover"]
    assert fo["bytes_before_down"] > 0
    # the dead rail is noticed about stall_timeout after the link went down, not never (timed
    # from the return of the `ip` call that breaks it: that call is the host's, not the engine's)
    assert fo["detect_s"] is not None, ("the rail was never seen down", fo["late_breaks"], fo["rail_stats"])
    assert fo["detect_after_call_s"] <= STALL_S + 1.5, (fo["detect_after_call_s"], fo["link_down_call_s"])
    _check_rail_down(fo["rail_stats"], 1)
    assert any("rail 1" in e and "down" in e for e in out["events"]), out["events"]
    reason = fo["rail_stats"][1]["down_reason"]
    assert ("link down" in reason) if how == "link" else ("stalled" in reason), reason
    assert out["one_rail"]["bytes_on_down_rail"] == 0
    # readmitted within a few seconds, and the next transfer uses it again
    assert out["readmit_s"] is not None and out["readmit_s"] <= 5.0, out["readmit_s"]
    assert any("rail 1 up again" in e for e in out["events"]), out["events"]
    assert min(out["after_readmit"]["rail_bytes"]) >= 0.3 * out["size"], out["after_readmit"]
    assert all(s["up"] for s in out["rail_stats_end"])


def test_failover_when_the_rail_is_deleted(testbed: Any) -> None:
    """The rail's veth pair is deleted mid-WRITE: the transfer completes on the survivor, byte-exact."""
    out = run_drill(testbed, {"mode": "failover", "op": "WRITE", "size": 128 * MiB, "rail": 1, "how": "delete",
                              "stall_timeout": STALL_S}, timeout=90)
    for step in ("baseline", "failover", "one_rail"):
        assert out[step]["ok"] and out[step]["corrupt"] is None, (step, out[step])
    assert out["failover"]["detect_s"] is not None and out["failover"]["detect_s"] <= STALL_S + 1.5, out["failover"]
    _check_rail_down(out["failover"]["rail_stats"], 1)
    assert out["one_rail"]["bytes_on_down_rail"] == 0


def test_notification_fails_over_when_its_rail_dies(testbed: Any) -> None:
    """Notifications ride a control connection opened on one rail; with that rail's link down and
    no data in flight (so no data connection noticed), a notification still goes out over
    another rail within about a second (before: the agent's whole timeout, then an error)."""
    out = run_drill(testbed, {"mode": "notif_failover", "op": "READ", "size": 1 * MiB, "rail": 0,
                              "stall_timeout": STALL_S, "timeout": 10.0}, timeout=90)
    assert out["error"] is None, out
    assert out["notif_s"] < 3.0, out


def test_all_rails_down_fails_fast_naming_each_rail(testbed: Any) -> None:
    out = run_drill(testbed, {"mode": "all_down", "op": "READ", "size": 256 * MiB,
                              "stall_timeout": STALL_S, "wait_limit_s": 20}, timeout=90)
    assert out["warmup"]["ok"], out["warmup"]
    res = out["result"]
    assert not res["ok"] and res["error_type"] == "PeerLostError", res
    assert "rail 0" in res["error"] and "rail 1" in res["error"], res["error"]
    assert out["fail_after_s"] <= STALL_S + 1.5, out["fail_after_s"]
    assert not any(s["up"] for s in out["rail_stats"]), out["rail_stats"]


def test_stale_write_does_not_land_after_the_link_returns(testbed: Any) -> None:
    """A WRITE loses a rail mid-way (frames still queued in the shaped veth), the next WRITE
    overwrites the range, the link comes back: the dead connections were fenced on the target
    before the reissue, so nothing stale lands. Failed about 1 run in 2 before fencing."""
    out = run_drill(testbed, {"mode": "stale_write", "op": "WRITE", "size": 64 * MiB,
                              "stall_timeout": STALL_S}, timeout=90)
    assert out["first"]["ok"] and out["first"]["corrupt"] is None, out["first"]
    assert out["second"]["ok"] and out["second"]["corrupt"] is None, out["second"]
    assert out["second_reverified"] is None, out["second_reverified"]
    assert any("fenced" in e for e in out["events"]), out["events"]
