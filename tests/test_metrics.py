"""Prometheus metrics (python/multirail/metrics.py): scrapes of real agents during transfers,
the bench's --metrics-port, and (root + network namespaces) a striped transfer over two
testbed rails whose byte counters both move, then a rail taken down and readmitted.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from typing import Any, Callable

import numpy as np
import pytest
from conftest import ENV, engine_available, engine_python, netns_unavailable
from etcd_server import free_port

try:
    import prometheus_client  # noqa: F401
    _SKIP = None if engine_available() else "the engine extension is not built"
except ImportError:
    _SKIP = "prometheus_client is not installed (pip install prometheus-client; a dependency in pyproject.toml)"
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
MiB = 1 << 20


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """{sample name: [(labels, value)]} of one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers.get("Content-Type", "").startswith("text/plain")
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def value(samples: dict[str, Any], name: str, **labels: str) -> float | None:
    for lab, v in samples.get(name, []):
        if all(lab.get(k) == want for k, want in labels.items()):
            return v
    return None


def _pair(agents: Callable[..., Any], size: int) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    target = agents(f"mt-{uuid.uuid4().hex[:6]}")
    src = np.arange(size, dtype=np.uint64).view(np.uint8)[:size].copy() if size >= 8 else np.zeros(size, np.uint8)
    target.register_memory(src)
    init = agents(f"mi-{uuid.uuid4().hex[:6]}", {"metrics_port": 0})
    dst = np.zeros(size, dtype=np.uint8)
    init.register_memory(dst)
    init.fetch_remote_metadata(target.name, "127.0.0.1", target.port)
    return target, init, src, dst


def test_scrape_during_transfers_shows_counters_moving(agents: Callable[..., Any]) -> None:
    target, init, src, dst = _pair(agents, 64 * MiB)
    assert init.metrics_url and init.metrics_url.startswith("http://127.0.0.1:")
    h = init.initialize_xfer("READ", [dst], [src], target.name)
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                init.transfer_sync(h, 30)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=loop)
    t.start()
    seen: list[tuple[float, float, float]] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len({b for b, _, _ in seen}) < 4:
            s = scrape(init.metrics_url)
            b = value(s, "multirail_rail_bytes_total", peer=target.name)
            if b is not None:
                seen.append((b, value(s, "multirail_rail_chunks_total", peer=target.name) or 0.0,
                             value(s, "multirail_peer_transfers_total", peer=target.name, op="read", outcome="done") or 0))
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    bytes_seen = [b for b, _, _ in seen]
    assert bytes_seen == sorted(bytes_seen), "a counter went backwards"
    assert len(set(bytes_seen)) >= 4, f"rail bytes did not move between scrapes: {bytes_seen}"
    assert seen[-1][1] > seen[0][1] and seen[-1][2] > seen[0][2]
    s = scrape(init.metrics_url)
    assert value(s, "multirail_rail_up", peer=target.name) == 1
    assert value(s, "multirail_rail_weight", peer=target.name) == pytest.approx(1.0)
    assert (value(s, "multirail_rail_rate_bytes_per_second", peer=target.name) or 0) > 0
    assert value(s, "multirail_registered_bytes", agent=init.name, mem_type="DRAM") == 64 * MiB
    assert value(s, "multirail_agent_info", agent=init.name, incarnation=f"{init.incarnation:016x}") == 1


def test_transfer_outcomes_bytes_by_direction_and_registrations(agents: Callable[..., Any]) -> None:
    import multirail

    target, init, src, dst = _pair(agents, 4 * MiB)
    rd = init.initialize_xfer("READ", [dst], [src], target.name)
    wr = init.initialize_xfer("WRITE", [dst[:MiB]], [src[:MiB]], target.name)
    for _ in range(3):
        init.transfer_sync(rd, 20)
    init.transfer(wr)
    init.wait(wr, 20)
    init.transfer(wr)
    while init.check_xfer_state(wr) == multirail.XferState.IN_PROGRESS:
        pass
    assert init.check_xfer_state(wr) == multirail.XferState.DONE  # seen twice, counted once
    extra = init.register_memory([np.zeros(MiB, np.uint8), np.zeros(2 * MiB, np.uint8)])
    s = scrape(init.metrics_url)
    p = target.name
    assert value(s, "multirail_peer_transfers_total", peer=p, op="read", outcome="done") == 3
    assert value(s, "multirail_peer_transfers_total", peer=p, op="write", outcome="done") == 2
    assert value(s, "multirail_peer_transfers_total", peer=p, op="read", outcome="failed") == 0
    assert value(s, "multirail_peer_transfer_bytes_total", peer=p, direction="read") == 12 * MiB
    assert value(s, "multirail_peer_transfer_bytes_total", peer=p, direction="write") == 2 * MiB
    # the engine's own per-rail counters, by direction
    assert value(s, "multirail_rail_bytes_total", peer=p, direction="read") == 12 * MiB
    assert value(s, "multirail_rail_bytes_total", peer=p, direction="write") == 2 * MiB
    assert value(s, "multirail_rail_chunks_total", peer=p, direction="read") >= 3
    assert value(s, "multirail_rail_readmissions_total", peer=p) == 0
    assert value(s, "multirail_peer_fenced_connections_total", peer=p) == 0
    assert value(s, "multirail_registered_bytes", agent=init.name) == 7 * MiB
    assert value(s, "multirail_registered_regions", agent=init.name) == 3
    init.deregister_memory(extra)
    # the peer goes away: the next transfer fails and is counted as failed
    target.close()
    with pytest.raises(multirail.MultirailError):
        init.transfer_sync(rd, 10)
    s = scrape(init.metrics_url)
    assert value(s, "multirail_peer_transfers_total", peer=p, op="read", outcome="failed") == 1
    assert value(s, "multirail_registered_bytes", agent=init.name) == 4 * MiB


def test_engine_counters_initiator_and_serving_side() -> None:
    """Every counter comes from the engine: the initiator side from rail_stats/peer_counters,
    the serving side (and the inbound fence count) from served_stats."""
    from multirail.metrics import AgentCollector

    class Fake:
        name, incarnation, host, port = "fake", 1, "127.0.0.1", 1
        _regs: dict = {}
        _xstats: dict = {}
        _stale: dict = {}
        _store = None
        _peers = {"p": None}

        def __init__(self) -> None:
            self.served: list[dict[str, Any]] = []

        def refused_requests(self) -> int:
            return 0

        def served_stats(self) -> list[dict[str, Any]]:
            return self.served

        def rail_stats(self, peer: str) -> list[dict[str, Any]]:
            return [{"name": "r0", "up": True, "rate_gbps": 1.0, "bytes_read": 5, "bytes_written": 7, "readmissions": 0},
                    {"name": "r1", "up": False, "rate_gbps": 1.0, "stalls": 2, "readmissions": 1}]

        def peer_counters(self, peer: str) -> dict[str, int]:
            return {"transfers_done": 3, "transfers_failed": 1, "fenced_connections": 2}

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    fake = Fake()
    reg = CollectorRegistry()
    reg.register(AgentCollector(lambda: [fake]))

    def get(name: str, **labels: str) -> float | None:
        out: dict[str, Any] = {}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for smp in fam.samples:
                out.setdefault(smp.name, []).append((dict(smp.labels), smp.value))
        return value(out, name, **labels)

    assert get("multirail_rail_bytes_total", rail="r0", direction="read") == 5
    assert get("multirail_rail_bytes_total", rail="r0", direction="write") == 7
    assert get("multirail_rail_stalls_total", rail="r1") == 2
    assert get("multirail_rail_readmissions_total", rail="r1") == 1
    assert get("multirail_peer_fenced_connections_total", peer="p") == 2
    assert get("multirail_rail_weight", rail="r0") == 1.0 and get("multirail_rail_weight", rail="r1") == 0.0
    assert get("multirail_served_bytes_total") is None and get("multirail_fenced_connections_total") is None
    row = {"bytes_read": 0, "requests_read": 0, "bytes_written": 0, "requests_written": 0, "refused": 0,
           "refused_by_status": {}, "connections": 1, "ucx_sessions": 0, "fenced": 0}
    fake.served = [
        {**row, "peer": "q", "rail": "side", "rail_index": None, "fenced": 1},
        {**row, "peer": "q", "rail": "eth0", "rail_index": 0, "bytes_read": 11, "requests_read": 2, "bytes_written": 13,
         "requests_written": 1, "refused": 3, "refused_by_status": {"BadKey": 2, "ReadOnly": 1}, "fenced": 2},
        {**row, "peer": "q", "rail": "eth0", "rail_index": 1, "bytes_read": 17, "connections": 4, "ucx_sessions": 4},
    ]
    assert get("multirail_served_bytes_total", peer="q", rail="eth0", index="0", direction="read") == 11
    assert get("multirail_served_bytes_total", peer="q", rail="eth0", index="0", direction="write") == 13
    assert get("multirail_served_bytes_total", peer="q", rail="eth0", index="1", direction="read") == 17
    assert get("multirail_served_requests_total", peer="q", index="0", direction="read") == 2
    assert get("multirail_served_requests_total", peer="q", index="0", direction="write") == 1
    assert get("multirail_served_refused_total", peer="q", index="0", status="BadKey") == 2
    assert get("multirail_served_refused_total", peer="q", index="0", status="ReadOnly") == 1
    assert get("multirail_served_refused_total", peer="q", index="1") is None  # only statuses that occurred
    assert get("multirail_served_connections_total", peer="q", rail="side", index="side") == 1
    assert get("multirail_served_connections_total", peer="q", index="1") == 4
    assert get("multirail_served_ucx_sessions_total", peer="q", index="1") == 4
    assert get("multirail_fenced_connections_total", peer="q") == 3  # summed over the local rails


def _served(samples: dict[str, Any], name: str, **labels: str) -> float:
    """Sum of `name` over the samples matching `labels` (e.g. over every rail)."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == want for k, want in labels.items()))


def _scrape_until(url: str, name: str, want: float, **labels: str) -> tuple[dict[str, Any], float]:
    """Scrape until `_served(name, **labels)` reaches `want` (5 s at most): a served READ is
    counted just after its last byte is sent, which the initiator may see complete first."""
    deadline = time.monotonic() + 5
    while True:
        s = scrape(url)
        got = _served(s, name, **labels)
        if got == want or time.monotonic() > deadline:
            return s, got
        time.sleep(0.02)


def test_target_serves_metrics_of_what_peers_read_and_wrote(agents: Callable[..., Any]) -> None:
    """The serving side: a target agent's own /metrics counts what an initiator READ from it and
    WROTE into it, per peer and local rail, exactly the payload bytes the initiator moved."""
    rails = ["127.0.0.1", "127.0.0.1"]
    target = agents(f"st-{uuid.uuid4().hex[:6]}", {"metrics_port": 0, "rails": rails})
    init = agents(f"si-{uuid.uuid4().hex[:6]}", {"rails": rails})
    size = 4 * MiB + 12345  # not a multiple of any chunk size
    src = np.arange(size, dtype=np.uint8)
    target.register_memory(src)
    dst = np.zeros(size, np.uint8)
    init.register_memory(dst)
    init.fetch_remote_metadata(target.name, "127.0.0.1", target.port)
    s = scrape(target.metrics_url)
    assert _served(s, "multirail_served_bytes_total", peer=init.name) == 0
    rd = init.initialize_xfer("READ", [dst], [src], target.name)
    wr = init.initialize_xfer("WRITE", [dst[:MiB + 7]], [src[1:MiB + 8]], target.name)
    for _ in range(3):
        init.transfer_sync(rd, 20)
    for _ in range(2):
        init.transfer_sync(wr, 20)
    read_b, write_b = 3 * size, 2 * (MiB + 7)
    s, got = _scrape_until(target.metrics_url, "multirail_served_bytes_total", read_b, peer=init.name, direction="read")
    assert got == read_b
    assert _served(s, "multirail_served_bytes_total", peer=init.name, direction="write") == write_b
    # the initiator's own view of the same transfers agrees, rail by rail
    ini = init.rail_stats(target.name)
    assert sum(r["bytes_read"] for r in ini) == read_b and sum(r["bytes_written"] for r in ini) == write_b
    by_rail = {lab["index"]: v for lab, v in s["multirail_served_bytes_total"]
               if lab["peer"] == init.name and lab["direction"] == "read"}
    assert sorted(v for i, v in by_rail.items() if i != "side") == sorted(r["bytes_read"] for r in ini)
    assert all(v > 0 for i, v in by_rail.items() if i != "side"), f"a rail served nothing: {by_rail}"
    assert {lab["rail"] for lab, _ in s["multirail_served_bytes_total"] if lab["index"] != "side"} \
        == {r[0] for r in target.rails()}
    reqs = _served(s, "multirail_served_requests_total", peer=init.name, direction="read")
    assert reqs >= 3 and reqs == sum(r["chunks_read"] for r in ini)
    assert _served(s, "multirail_served_requests_total", peer=init.name, direction="write") \
        == sum(r["chunks_written"] for r in ini)
    for i in ("0", "1"):
        assert (value(s, "multirail_served_connections_total", peer=init.name, index=i) or 0) >= 1
    assert _served(s, "multirail_served_refused_total", peer=init.name) == 0
    # the Python API behind it
    rows = target.served_stats()
    assert sum(r["bytes_read"] for r in rows if r["peer"] == init.name) == read_b
    assert {r["rail_index"] for r in rows if r["peer"] == init.name} >= {0, 1}
    # the initiator served nothing
    assert init.served_stats() == [] or all(r["bytes_read"] == r["bytes_written"] == 0 for r in init.served_stats())


def test_served_refusals_and_fences_are_counted_per_peer(agents: Callable[..., Any]) -> None:
    """Bad requests from a raw-protocol client (tests/rawpeer.py): a WRITE into a read-only
    region and a READ with a wrong key count as refused under the client's name, by status; a
    bad handshake counts under _unauthenticated; a Fence counts the connection it aborted."""
    import rawpeer

    target = agents(f"sr-{uuid.uuid4().hex[:6]}", {"metrics_port": 0})
    ro = np.arange(64 << 10, dtype=np.uint8)
    target.register_memory(ro, access="ro")
    r = rawpeer.parse_regions(target.get_agent_metadata())[0]
    c = rawpeer.connect(target.port, name="raw-peer")
    other_id = os.urandom(16)
    c2 = rawpeer.connect(target.port, name="raw-peer", nonce=other_id)
    try:
        # WRITE of 4 KiB into the read-only region: refused, payload drained, nothing lands.
        c.sendall(rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(r["id"], r["key"], 0, 4096), 1) + b"\xAA" * 4096)
        k, req, body = rawpeer.read_frame(c)
        assert (k, req, rawpeer.parse_status(body)[0]) == (rawpeer.RESP, 1, "ReadOnly")
        # READ with a wrong key: refused.
        c.sendall(rawpeer.frame(rawpeer.READ_REQ, rawpeer.op_body(r["id"], bytes(16), 0, 4096), 2))
        k, req, body = rawpeer.read_frame(c)
        assert (k, req, rawpeer.parse_status(body)[0]) == (rawpeer.RESP, 2, "BadKey")
        # a valid READ of 1000 bytes is served (and counted) on the same connection
        c.sendall(rawpeer.frame(rawpeer.READ_REQ, rawpeer.op_body(r["id"], r["key"], 0, 1000), 3))
        k, req, body = rawpeer.read_frame(c)
        assert (k, req, rawpeer.parse_status(body)[:2]) == (rawpeer.RESP, 3, ("Ok", 1000))
        assert rawpeer.recv_exact(c, 1000) == ro[:1000].tobytes()
        # the peer fences its second connection over the first
        c.sendall(rawpeer.frame(rawpeer.FENCE, rawpeer.fence_body([other_id]), 4))
        k, req, body = rawpeer.read_frame(c)
        assert (k, req, rawpeer.parse_status(body)[0]) == (rawpeer.RESP, 4, "Ok")
    finally:
        c.close()
        c2.close()
    # a connection that never says Hello: refused before any name is proven
    bad = socket.create_connection(("127.0.0.1", target.port), timeout=5)
    try:
        bad.sendall(rawpeer.frame(rawpeer.PING, b""))
        k, _, body = rawpeer.read_frame(bad)
        assert k == rawpeer.ERROR
    finally:
        bad.close()
    assert (ro == np.arange(64 << 10, dtype=np.uint8)).all()
    rail = target.rails()[0][0]  # one-rail agent: the side channel is its rail
    lab = {"peer": "raw-peer", "rail": rail, "index": "0"}
    want = {
        ("multirail_served_refused_total", (("status", "ReadOnly"), *lab.items())): 1,
        ("multirail_served_refused_total", (("status", "BadKey"), *lab.items())): 1,
        ("multirail_served_bytes_total", (("direction", "read"), *lab.items())): 1000,
        ("multirail_served_bytes_total", (("direction", "write"), *lab.items())): 0,
        ("multirail_served_requests_total", (("direction", "read"), *lab.items())): 1,
        ("multirail_served_connections_total", tuple(lab.items())): 2,
        ("multirail_fenced_connections_total", (("peer", "raw-peer"),)): 1,
        ("multirail_served_refused_total", (("peer", "_unauthenticated"), ("status", "Unexpected"))): 1,
        ("multirail_refused_requests_total", (("agent", target.name),)): 3,
    }
    # The server's threads count a refusal or a fence right after answering it (the bad
    # handshake's after its Error frame): the counts settle within moments of the answers.
    deadline = time.monotonic() + 5.0
    while True:
        s = scrape(target.metrics_url)
        got = {k: value(s, k[0], **dict(k[1])) for k in want}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == want


def test_metrics_port_in_use_is_a_typed_error(agents: Callable[..., Any]) -> None:
    import multirail

    a = agents("holder", {"metrics_port": 0})
    port = int(a.metrics_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(multirail.AddressInUseError, match="already in use"):
        multirail.Agent("clash", {"metrics_port": port})
    assert not any(x.name == "clash" and not x._closed for x in list(multirail.agent._LIVE))
    a.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_process_wide_server_reports_every_agent(agents: Callable[..., Any]) -> None:
    from multirail import metrics

    a, _ = agents("pw-a"), agents("pw-b")
    with metrics.serve(0) as srv:
        s = scrape(srv.url)
        names = {lab["agent"] for lab, _ in s["multirail_agent_info"]}
        assert {"pw-a", "pw-b"} <= names
        assert "process_cpu_seconds_total" in s
        a.close()
        names = {lab["agent"] for lab, _ in scrape(srv.url)["multirail_agent_info"]}
        assert "pw-a" not in names and "pw-b" in names


def test_bench_metrics_port_scraped_during_a_run() -> None:
    py = engine_python()
    assert py
    port = free_port()
    cmd = [py, "-m", "multirail", "bench", "local", "--op", "READ", "--start-block-size", "16MiB",
           "--max-block-size", "16MiB", "--num-iter", "300", "--warmup-iter", "2", "--metrics-port", str(port),
           "--idle-timeout", "60", "--duration", "120"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    seen: list[float] = []
    try:
        deadline = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < deadline:
            try:
                s = scrape(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                time.sleep(0.1)
                continue
            b = value(s, "multirail_rail_bytes_total")
            if b is not None and (not seen or b != seen[-1]):
                seen.append(b)
            if len(seen) >= 3:
                break
            time.sleep(0.05)
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
    assert p.returncode == 0, err[-1500:]
    assert len(seen) >= 3 and seen == sorted(seen), seen


# ------------------------------------------------------------------ two testbed rails (root)

# Runs in namespace b: an EngineWorker READing 64 MiB from the target in a loop on a thread,
# with the process-wide metrics server; answers "scrape" on stdin with one JSON line of
# {rail: {"bytes", "up", "down", "readmit"}}, "quit" ends it.
STRIPE_CHILD = r"""
import json, sys, threading, urllib.request
from prometheus_client.parser import text_string_to_metric_families
from multirail import metrics
from multirail.bench.worker import EngineWorker
host, port, rails = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
srv = metrics.serve(0)
w = EngineWorker(op="READ", target_host=host, target_port=port, target_name="mr-bench-target",
                 buffer_size=64 << 20, connections=1, rails=rails, policy="weighted", chunk_size=1 << 20,
                 timeout=30, fill_target=False, stall_timeout=1.0)
w.prepare(64 << 20, 1, False)
stop, errors = threading.Event(), []
def loop():
    while not stop.is_set():
        try:
            w.run_once()
        except Exception as e:
            errors.append(repr(e))
t = threading.Thread(target=loop, daemon=True)
t.start()
want = {"multirail_rail_bytes_total": "bytes", "multirail_rail_up": "up", "multirail_rail_down_total": "down",
        "multirail_rail_readmissions_total": "readmit"}
print(json.dumps({"event": "ready"}), flush=True)
for line in sys.stdin:
    if line.strip() != "scrape":
        break
    out = {}
    for fam in text_string_to_metric_families(urllib.request.urlopen(srv.url, timeout=10).read().decode()):
        for s in fam.samples:
            if s.name in want and s.labels.get("direction", "read") == "read":  # READs: bytes land here
                out.setdefault(s.labels["rail"], {})[want[s.name]] = s.value
    print(json.dumps({"event": "scrape", "rails": out, "errors": errors[-3:]}), flush=True)
stop.set()
t.join(60)
w.finish_size()
w.close()
srv.close()
"""

_NETNS = netns_unavailable()


@pytest.mark.skipif(_NETNS is not None, reason=_NETNS or "")
def test_striped_transfer_over_two_testbed_rails_moves_both_rail_counters() -> None:
    from multirail.bench.target import launch, stop
    from multirail.testbed import Testbed

    py = engine_python()
    assert py
    with Testbed(f"mx{uuid.uuid4().hex[:5]}", rails=2, rate="1gbit") as tb:
        a, b = tb.addrs("a"), tb.addrs("b")
        proc, ready, errf = launch(tb.exec_argv("a", [py, "-m", "multirail", "bench", "target", "--listen",
                                                      f"{a[0]}:0", "--rails", ",".join(a), "--total-buffer-size",
                                                      "64MiB", "--idle-timeout", "120", "--duration", "300"]),
                                   env=ENV)
        child = subprocess.Popen(tb.exec_argv("b", [py, "-c", STRIPE_CHILD, a[0], str(ready["port"]), ",".join(b)]),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=ENV)
        try:
            assert child.stdout is not None and child.stdin is not None
            assert json.loads(child.stdout.readline() or "{}").get("event") == "ready", child.stderr.read()[-1500:] \
                if child.poll() is not None and child.stderr else "child not ready"

            def sample() -> dict[str, Any]:
                child.stdin.write("scrape\n")
                child.stdin.flush()
                line = child.stdout.readline()
                assert line, child.stderr.read()[-1500:] if child.stderr else "child died"
                return json.loads(line)

            def wait_for(cond: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
                deadline = time.monotonic() + timeout
                while True:
                    s = sample()
                    if cond(s["rails"]):
                        return s
                    assert time.monotonic() < deadline, f"{what}: last scrape {s}"
                    time.sleep(0.2)

            first = wait_for(lambda r: len(r) == 2 and all(v.get("bytes", 0) > 0 for v in r.values()), 60,
                             "both rails carrying bytes")
            names = sorted(first["rails"])
            moved = wait_for(lambda r: all(r[n]["bytes"] > first["rails"][n]["bytes"] for n in names), 60,
                             "both rails' counters moving")
            assert moved["errors"] == [], moved
            # rail 1 down (side a's device): counted down, the other rail keeps moving
            tb.set_link(1, False, side="a")
            down = wait_for(lambda r: sum(v["up"] == 0 for v in r.values()) == 1, 30, "one rail reported down")
            dead = next(n for n in names if down["rails"][n]["up"] == 0)
            live = next(n for n in names if n != dead)
            assert down["rails"][dead]["down"] >= 1
            wait_for(lambda r: r[live]["bytes"] > down["rails"][live]["bytes"], 30, "the live rail moving")
            tb.set_link(1, True, side="a")
            back = wait_for(lambda r: r[dead]["up"] == 1 and r[dead]["readmit"] >= 1, 60, "the rail readmitted")
            wait_for(lambda r: r[dead]["bytes"] > back["rails"][dead]["bytes"], 30, "the readmitted rail moving")
        finally:
            try:
                child.communicate("quit\n", timeout=120)
            except (subprocess.TimeoutExpired, OSError, ValueError):
                child.kill()
                child.communicate(timeout=10)
            stop(proc, grace=15)
            errf.close()


def test_gpu_staging_metrics_on_both_sides(agents: Callable[..., Any]) -> None:
    """GPU memory (stand-in device) staged on both sides: the initiator's per-rail staged bytes
    and the target's served staged bytes match what moved, by stage, and the pinned pool shows."""
    from multirail.gpu import DeviceBuffer

    target = agents(f"gt-{uuid.uuid4().hex[:6]}", {"metrics_port": 0, "gpu": "standin"})
    init = agents(f"gi-{uuid.uuid4().hex[:6]}", {"metrics_port": 0, "gpu": "standin"})
    n = 2 * MiB + 3
    src, dst = DeviceBuffer(n, kind="standin"), DeviceBuffer(n, kind="standin")
    target.register_memory(src)
    init.register_memory(dst)
    init.fetch_remote_metadata(target.name, "127.0.0.1", target.port)
    init.transfer_sync(init.initialize_xfer("READ", [dst], [src], target.name), 20)
    init.transfer_sync(init.initialize_xfer("WRITE", [dst], [src], target.name), 20)
    s = scrape(init.metrics_url)
    assert value(s, "multirail_rail_staged_bytes_total", peer=target.name, stage="h2d") == n
    assert value(s, "multirail_rail_staged_bytes_total", peer=target.name, stage="d2h") == n
    assert value(s, "multirail_rail_staged_bytes_total", peer=target.name, stage="wire") == 2 * n
    assert (value(s, "multirail_rail_staging_busy_seconds_total", peer=target.name, stage="h2d") or 0) > 0
    assert value(s, "multirail_rail_staging_pool_bytes", peer=target.name) == 2 * 4 * (1 << 20)
    assert value(s, "multirail_peer_ipc_bytes_total", peer=target.name) == 0  # one process: staged
    t, got = _scrape_until(target.metrics_url, "multirail_served_staged_bytes_total", n, peer=init.name, stage="d2h")
    assert got == n
    assert _served(t, "multirail_served_staged_bytes_total", peer=init.name, stage="h2d") == n


def test_rail_transport_and_fallback_metrics(agents: Callable[..., Any]) -> None:
    """Issue 21: per rail, what carries it and why, and its ucx -> tcp fallbacks and switches
    (rail 0's ucx path killed 200 ms in and refused 1 s: it falls back after 2 failures and
    stays on tcp here, its retry 30 s away)."""
    import multirail

    try:
        probe = multirail.Agent("mprobe", {"transport": "ucx", "auth_secret": "probe"})
        probe.close()
    except multirail.errors.TransportUnavailableError as e:
        pytest.skip(f"UCX cannot be loaded here: {e}")
    rails = ["127.0.0.1", "127.0.0.1"]
    target = agents(f"mt-{uuid.uuid4().hex[:6]}", {"transport": "ucx,tcp", "rails": rails, "auth_secret": "metrics"})
    init = agents(f"mi-{uuid.uuid4().hex[:6]}", {"transport": "ucx,tcp", "rails": rails, "metrics_port": 0, "auth_secret": "metrics",
                                                "faults": "0/ucx:kill@200ms+1s", "fallback_after": 2,
                                                "fallback_cooldown": 30.0, "stall_timeout": 0.5})
    n = 16 << 20
    src, dst = np.full(n, 3, np.uint8), np.zeros(n, np.uint8)
    target.register_memory(src)
    init.register_memory(dst)
    init.fetch_remote_metadata(target.name, "127.0.0.1", target.port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        h = init.initialize_xfer("READ", [dst], [src], target.name)
        init.transfer(h)
        init.wait(h, 20)
        if init.rail_stats(target.name)[0]["fallbacks"] >= 1:
            break
    assert np.array_equal(dst, src)
    s = scrape(init.metrics_url)
    lab = {"agent": init.name, "peer": target.name}
    tr = {(d["transport"], d["reason"]) for d, _ in s["multirail_rail_transport"] if d["peer"] == target.name}
    assert tr == {("tcp", "fallback after 2 ucx failures"), ("tcp", "explicit")}, tr
    assert sorted(v for d, v in s["multirail_rail_transport_fallbacks_total"] if d["peer"] == target.name) == [0, 1]
    assert sorted(v for d, v in s["multirail_rail_transport_switches_total"] if d["peer"] == target.name) == [0, 1]
    retry = sorted(v for d, v in s["multirail_rail_ucx_retry_seconds"] if d["peer"] == target.name)
    assert retry[0] == -1 and 0 < retry[1] <= 30, retry
    assert value(s, "multirail_rail_up", **lab) is not None
