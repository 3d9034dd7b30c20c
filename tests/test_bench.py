"""Tests of `multirail bench`: pure pieces, CLI errors, harness, counters, baselines, and (when
the engine extension is built) real `bench local` runs with consistency checks."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from multirail.bench import ratios
from multirail.bench.core import (BenchRow, Progress, UsageError, block_sizes, first_mismatch,
                                  format_size, format_table, make_row, parse_size, pattern)
from multirail.bench.worker import run_sweep

from conftest import ENV, REPO, engine_python  # noqa: E402
RUNNER = ("import argparse, sys; from multirail import bench; p = argparse.ArgumentParser(prog='multirail'); "
          "s = p.add_subparsers(); bench.register(s); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")


ENGINE_PY = engine_python()
needs_engine = pytest.mark.skipif(ENGINE_PY is None, reason="multirail._core (the engine extension) is not built")


def bench(*args: str, py: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([py or sys.executable, "-c", RUNNER, "bench", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


# -- sizes and ladder ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [("4096", 4096), ("4KiB", 4096), ("4k", 4096), ("4KB", 4000),
                                        ("64MiB", 64 << 20), ("1GiB", 1 << 30), ("1.5MiB", 3 << 19), (" 2 MiB ", 2 << 20)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "0", "-4KiB", "4XB", "KiB", "1.5", "4 K iB", "0.3B"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(UsageError):
        parse_size(text)


def test_format_and_ladder() -> None:
    assert [format_size(x) for x in (4096, 64 << 20, 1 << 30, 1000)] == ["4KiB", "64MiB", "1GiB", "1000B"]
    assert block_sizes(4096, 32768) == [4096, 8192, 16384, 32768]
    assert block_sizes(4096, 10000) == [4096, 8192, 10000]
    assert block_sizes(4096, 4096) == [4096]
    with pytest.raises(UsageError, match="smaller"):
        block_sizes(8192, 4096)


# -- pattern and statistics ---------------------------------------------------------------------

def test_pattern_is_position_dependent_and_sliceable() -> None:
    whole = pattern(7, 0, 1 << 16)
    assert np.array_equal(pattern(7, 12345, 999), whole[12345:12345 + 999])
    assert not np.array_equal(pattern(8, 0, 4096), whole[:4096])
    assert first_mismatch(whole.copy(), 7) is None
    corrupt = whole.copy()
    corrupt[40000] ^= 1
    assert first_mismatch(corrupt, 7) == 40000
    swapped = whole.copy()  # two 4 KiB blocks swapped: a periodic pattern would miss this
    swapped[:4096], swapped[4096:8192] = whole[4096:8192], whole[:4096]
    assert first_mismatch(swapped, 7) is not None


def test_make_row_and_table() -> None:
    row = make_row("READ", 1 << 20, 2, [0.001] * 99 + [0.010], wall_s=0.109)
    assert row.total_bytes == 100 * 2 << 20
    assert row.gb_per_s == pytest.approx(row.total_bytes / 0.109 / 1e9)
    assert row.gbps == pytest.approx(row.gb_per_s * 8)
    assert row.lat_p50_us == pytest.approx(1000) and row.lat_p99_us == pytest.approx(1000)
    assert row.lat_max_us == pytest.approx(10000)
    assert "1MiB" in format_table([row])


def test_ratios() -> None:
    nan = float("nan")
    big = make_row("READ", 64 << 20, 1, [0.01] * 10, 0.1)
    small = make_row("READ", 4096, 1, [20e-6] * 100, 0.002)
    iperf = BenchRow("READ", 0, 1, 1, 1.0, 0, big.gbps * 2, 0, nan, nan, nan, nan, nan, worker="iperf3 -P 1")
    ping = BenchRow("PING", 4096, 1, 1, 1.0, 0, 0, 0, 10, 10, 10, 10, 10, worker="mr-pingpong")
    ping_poll = BenchRow("PING", 4096, 1, 1, 1.0, 0, 0, 0, 5, 5, 5, 5, 5, worker="mr-pingpong-poll")
    nixl = BenchRow("READ", 4096, 1, 1, 1.0, 0, 0, 0, 40, 40, 80, 40, 40, worker="nixl-ucx(tcp)", cpu_pct=70.0)
    small.cpu_pct = 99.0
    r = ratios([small, big], [iperf, ping, ping_poll, nixl], "block")
    assert r["throughput_pct_of_iperf3"] == pytest.approx(50.0)
    assert r["p50_x_pingpong"] == pytest.approx(2.0) and r["pingpong_worker"] == "mr-pingpong"
    assert "64MiB = 50.0% of iperf3 -P 1" in r["throughput_text"]
    # like with like: a polling engine is compared with the polling ping-pong; NIXL in any mode
    r = ratios([small, big], [iperf, ping, ping_poll, nixl], "adaptive")
    assert r["p50_x_pingpong"] == pytest.approx(4.0) and r["pingpong_worker"] == "mr-pingpong-poll"
    assert r["p50_x_nixl"] == pytest.approx(0.5) and r["p99_x_nixl"] == pytest.approx(0.25)
    assert r["waiter_cpu_pct"] == pytest.approx(99.0) and "NIXL's: 70%" in r["cpu_text"]


# -- harness with an in-memory worker ---------------------------------------------------------

class MemcpyWorker:
    """Copies from a 'remote' numpy buffer: exercises run_sweep without the engine."""

    name = "memcpy"

    def __init__(self, corrupt_at: int | None = None) -> None:
        self.remote = pattern(1, 0, 1 << 20)
        self.local = np.zeros(1 << 20, np.uint8)
        self.corrupt_at = corrupt_at
        self.span = 0
        self.moved = 0

    def prepare(self, block_size: int, batch_size: int, check: bool) -> None:
        self.span = block_size * batch_size
        self.local[:self.span] = 0

    def run_once(self) -> None:
        self.local[:self.span] = self.remote[:self.span]
        if self.corrupt_at is not None and self.corrupt_at < self.span:
            self.local[self.corrupt_at] ^= 0x55
        self.moved += self.span

    def verify(self) -> str | None:
        bad = first_mismatch(self.local[:self.span], 1)
        return None if bad is None else f"offset {bad}"

    def engine_rails(self) -> dict[str, int]:
        return {"mem": self.moved}

    def finish_size(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_run_sweep_rows_and_consistency() -> None:
    w = MemcpyWorker()
    rows = run_sweep(w, "READ", [4096, 65536], 2, 20, 2, True, None, Progress(False))
    assert [r.block_size for r in rows] == [4096, 65536]
    for r in rows:
        assert r.iterations == 20 and r.batch_size == 2 and r.consistency == "ok"
        assert r.total_bytes == r.block_size * 2 * 20 and r.gbps > 0
        assert 0 < r.lat_min_us <= r.lat_p50_us <= r.lat_p99_us <= r.lat_max_us
        assert r.engine_rails[0].bytes == r.total_bytes  # warmup excluded
    bad = run_sweep(MemcpyWorker(corrupt_at=5000), "READ", [4096, 8192], 1, 3, 0, True, None, Progress(False))
    assert bad[0].consistency == "ok"  # 4 KiB span does not reach byte 5000
    assert bad[1].consistency == "FAILED: offset 5000"


# -- CLI errors (no engine needed: validation runs before the engine is touched) ----------------

@pytest.mark.parametrize("args,needle", [
    (["local", "--start-block-size", "4XB"], "invalid size"),
    (["local", "--start-block-size", "1MiB", "--max-block-size", "4KiB"], "smaller than"),
    (["local", "--total-buffer-size", "4KiB", "--max-block-size", "1MiB"], "--total-buffer-size"),
    (["local", "--batch-size", "0"], "--batch-size"),
    (["local", "--connections", "0"], "--connections"),
    (["initiator", "--connect", "nohostport"], "HOST:PORT"),
    (["target", "--listen", "127.0.0.1:99999"], "HOST:PORT"),
    (["local", "--op", "COPY"], "invalid choice"),
])
def test_cli_usage_errors(args: list[str], needle: str) -> None:
    res = bench(*args)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr


# -- counters and baselines ---------------------------------------------------------------------

def test_loopback_counters_see_traffic() -> None:
    pytest.importorskip("multirail.netinfo")
    from multirail.bench.rails import RailCounters, resolve_rails

    specs = resolve_rails(["127.0.0.1"])
    if not specs or specs[0].ifname != "lo":
        pytest.skip(f"127.0.0.1 does not map to lo here: {specs}")
    counters = RailCounters(specs, "READ")
    before = counters.snapshot()
    srv = socket.create_server(("127.0.0.1", 0))
    payload = b"x" * (4 << 20)

    def sink() -> None:
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1 << 16):
                pass

    t = threading.Thread(target=sink)
    t.start()
    with socket.create_connection(srv.getsockname(), timeout=10) as c:
        c.sendall(payload)
    t.join(10)
    srv.close()
    rows = counters.delta(before, counters.snapshot(), 1.0)
    assert rows[0].name == "lo" and rows[0].bytes >= len(payload)


def pingpong_path() -> Path | None:
    p = Path(os.environ.get("MR_PINGPONG", REPO / "target" / "release" / "mr-pingpong"))
    return p if p.is_file() else None


@pytest.mark.skipif(pingpong_path() is None, reason="mr-pingpong not built (cargo build --release -p mr-pingpong)")
@pytest.mark.parametrize("poll", [False, True], ids=["block", "poll"])
def test_pingpong_baseline(poll: bool) -> None:
    from multirail.bench.baseline import run_pingpong

    row = run_pingpong(4096, 300, 30, poll=poll)  # raises unless the binary reports the asked-for mode
    assert row.worker == ("mr-pingpong-poll" if poll else "mr-pingpong") and row.iterations == 300
    assert row.lat_p50_us > 0
    assert 0 < row.lat_min_us <= row.lat_p50_us <= row.lat_p99_us <= row.lat_max_us
    assert row.cpu_pct is not None and row.cpu_pct >= 0
    assert json.loads(json.dumps(row.to_json()))["cpu_pct"] == row.cpu_pct


@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed")
def test_iperf3_baseline() -> None:
    from multirail.bench.baseline import run_iperf3

    row = run_iperf3("127.0.0.1", 2, 1, "READ")
    assert row.worker == "iperf3 -P 2" and row.gbps > 0.1 and row.total_bytes > 0


# -- real runs against the engine ---------------------------------------------------------------

@needs_engine
def test_local_small_run_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = bench("local", "--start-block-size", "4KiB", "--max-block-size", "1MiB", "--num-iter", "8",
                "--warmup-iter", "2", "--json", str(out), py=ENGINE_PY, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["block_size"] for r in rows] == [4096 << i for i in range(9)]
    for r in rows:
        for k in ("block_size", "batch_size", "op", "gbps", "gb_per_s", "lat_avg_us", "lat_p50_us",
                  "lat_p99_us", "iterations", "rails"):
            assert k in r
        assert r["op"] == "READ" and r["iterations"] == 8 and r["gbps"] > 0
        assert r["gbps"] == pytest.approx(r["gb_per_s"] * 8)
        assert 0 < r["lat_p50_us"] <= r["lat_p99_us"]
    assert "GB/s" in res.stdout


@needs_engine
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_consistency_passes_and_detects_corruption(op: str, tmp_path: Path) -> None:
    common = ["local", "--op", op, "--start-block-size", "64KiB", "--max-block-size", "256KiB",
              "--batch-size", "4", "--num-iter", "4", "--warmup-iter", "1", "--check-consistency"]
    ok = bench(*common, "--json", str(tmp_path / "ok.json"), py=ENGINE_PY, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert all(r["consistency"] == "ok" for r in json.loads((tmp_path / "ok.json").read_text())["rows"])
    bad = bench(*common, "--corrupt-offset", "300000", py=ENGINE_PY, timeout=120)
    assert bad.returncode == 1
    assert "consistency check FAILED" in bad.stderr and "300000" in bad.stderr


def test_a_reply_to_a_peer_that_left_is_dropped_and_the_target_serves_on(capsys: pytest.CaptureFixture[str]) -> None:
    """An initiator may close right after its request (one that is told its --target-seg-type is
    wrong does): the target's reply then fails with the engine's error. The target drops that
    reply with a line on stderr and keeps serving; a peer whose metadata has not arrived yet is
    retried; the others are sent."""
    from multirail import errors
    from multirail.bench.target import send_replies

    sent = []

    class Agent:
        def send_notif(self, peer: str, msg: bytes) -> None:
            if peer == "gone":
                raise errors.PeerLostError("peer gone: connection refused on every rail")
            if peer == "early":
                raise errors.UnknownPeerError("early")
            sent.append((peer, msg))

    class Mr:
        MultirailError, UnknownPeerError = errors.MultirailError, errors.UnknownPeerError

    left = send_replies(Agent(), [("gone", b"a"), ("early", b"b"), ("here", b"c")], Mr)
    assert left == [("early", b"b")] and sent == [("here", b"c")]
    assert "dropped a reply to gone: PeerLostError" in capsys.readouterr().err


@needs_engine
def test_connect_failure_is_clean() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    res = bench("initiator", "--connect", f"127.0.0.1:{port}", "--timeout", "2", py=ENGINE_PY, timeout=60)
    assert res.returncode == 1 and "error" in res.stderr and "Traceback" not in res.stderr


@needs_engine
@pytest.mark.skipif(shutil.which("iperf3") is None or pingpong_path() is None,
                    reason="needs iperf3 and a built mr-pingpong")
def test_local_baseline(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    res = bench("local", "--start-block-size", "1MiB", "--max-block-size", "1MiB", "--num-iter", "10",
                "--baseline", "--baseline-time", "1", "--latency-iter", "200", "--json", str(out),
                py=ENGINE_PY, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    from multirail.bench.nixl_latency import nixl_available

    workers = {b["worker"] for b in doc["baselines"]}
    assert {"iperf3 -P 1", "mr-pingpong", "mr-pingpong-poll"} <= workers
    if nixl_available(ENGINE_PY):
        assert "nixl-ucx(tcp)" in workers and doc["ratios"]["p50_x_nixl"] > 0
    else:
        assert any("NIXL latency baseline skipped" in p for p in doc["problems"]), doc["problems"]
    assert doc["ratios"]["throughput_pct_of_iperf3"] > 0 and doc["ratios"]["p50_x_pingpong"] > 0
    # the default (adaptive) engine polls: compared with the polling ping-pong
    assert doc["ratios"]["pingpong_worker"] == "mr-pingpong-poll"
    assert doc["ratios"]["waiter_cpu_pct"] > 0
    assert "of iperf3 -P 1" in res.stdout and "polling raw TCP ping-pong" in res.stdout
    assert "progress: adaptive (spin 200 us)" in res.stdout


@pytest.mark.skipif(ENGINE_PY is None, reason="no interpreter can import the engine")
def test_nixl_latency_baseline_runs_nixl_or_says_why_not() -> None:
    """With NIXL installed, its 4 KiB READ loop yields a latency row; without, a clear error."""
    from multirail.bench.nixl_latency import nixl_available, run_nixl_latency

    if not nixl_available(ENGINE_PY):
        res = subprocess.run([ENGINE_PY, "-m", "multirail.bench.nixl_latency", "initiator", "4096", "10", "1", "00", "00"],
                             capture_output=True, text=True, timeout=60, env=ENV)
        assert res.returncode == 1 and "NIXL is not importable" in res.stdout
        pytest.skip("NIXL (nixl-cu12) is not installed: only the error path ran")
    row = run_nixl_latency(4096, 200, 20, python=ENGINE_PY)
    assert row.worker == "nixl-ucx(tcp)" and row.iterations == 200
    assert 0 < row.lat_min_us <= row.lat_p50_us <= row.lat_p99_us <= row.lat_max_us
    assert row.cpu_pct is not None and row.cpu_pct > 0
