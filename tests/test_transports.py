"""Transport conformance (issue 9): the same behaviour, checked the same way, for every transport
behind the seam (crates/multirail/src/transport/): "tcp", "ucx" (UCX's tcp transport here;
no RDMA NIC on this machine), and "mixed" (issue 21): a link of two rails, rail 0 forced over
UCX (its tcp transport) and rail 1 over multirail's tcp, striped by one planner.

What every transport must do (docs/transports.md):
* READ and WRITE byte-exact for odd sizes, scattered descriptors, large transfers, mixed with
  notifications, which arrive after the data;
* refuse bad descriptors before touching memory, keep serving after;
* report what carries each rail in rail_stats();
* a peer that vanishes mid-transfer: an error within the timeout, never a hang;
* close() while transfers are in flight: once it returns, nothing touches the memory;
* on the emulated testbed: stripe over both rails, and survive a rail dying mid-transfer
  (link down, silent blackhole) byte-exact, fencing WRITEs so nothing stale lands.

UCX tests skip with the reason when no UCX library can be loaded (`pip install "multirail[ucx]"`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any, Iterator

import numpy as np
import pytest

from conftest import engine_available, netns_unavailable, wait_stopped

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

MiB = 1 << 20
STALL_S = 1.0


def _ucx_unavailable() -> str | None:
    if not engine_available():
        return "engine not built"
    import multirail

    try:
        a = multirail.Agent("ucx-probe", {"transport": "ucx", "auth_secret": "probe"})
    except multirail.errors.TransportUnavailableError as e:
        return f"UCX cannot be loaded here: {e}"
    a.close()
    return None


_UCX_SKIP = _ucx_unavailable()


@pytest.fixture(autouse=True)
def _shared_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX sessions need a shared secret (issue 33): every agent here, and every process the
    tests start, gets the same one."""
    monkeypatch.setenv("MULTIRAIL_SECRET", "transport-tests")
_NEEDS_UCX = pytest.mark.skipif(_UCX_SKIP is not None, reason=_UCX_SKIP or "")
TRANSPORTS = ["tcp", pytest.param("ucx", marks=_NEEDS_UCX), pytest.param("mixed", marks=_NEEDS_UCX)]
LOOP2 = ["127.0.0.1", "127.0.0.1"]


def agent_cfg(tr: str) -> dict[str, Any]:
    """An agent's config for transport `tr` ("mixed": two loopback rails, ucx + tcp)."""
    if tr == "mixed":
        return {"transport": ["ucx", "tcp"], "rails": LOOP2}
    return {"transport": tr}


def tr_spec(tr: str) -> str:
    """`tr` as a --transport / MULTIRAIL_TRANSPORT value (per rail, comma-separated)."""
    return "ucx,tcp" if tr == "mixed" else tr


def rail_kinds(tr: str, n: int) -> list[str]:
    """What each of `n` rails of a link runs under `tr`."""
    return ["ucx", "tcp"][:n] if tr == "mixed" else [tr] * n


def assert_rails_run(stats: list[dict[str, Any]], tr: str, wrapped: str = "") -> None:
    """Each rail's transport string names the transport it is meant to run (inside `faulty(`)."""
    for s, kind in zip(stats, rail_kinds(tr, len(stats)), strict=True):
        assert s["transport"].startswith(wrapped + kind), stats


def pattern(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture(params=TRANSPORTS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any, str]]:
    import multirail

    tr = request.param
    t = multirail.Agent("target", agent_cfg(tr))
    i = multirail.Agent("initiator", {**agent_cfg(tr), "timeout": 5.0, "stall_timeout": 1.0})
    yield t, i, tr
    i.close()
    t.close()


def connect(t: Any, i: Any, remote: Any = None, local: Any = None) -> None:
    """Register `remote` on the target and `local` on the initiator (when given), then fetch
    the target's metadata."""
    if remote is not None:
        t.register_memory(remote)
    if local is not None:
        i.register_memory(local)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)


@pytest.mark.parametrize("n", [1, 4095, MiB + 7, 64 * MiB])
def test_read_and_write_byte_exact(pair: Any, n: int) -> None:
    t, i, _ = pair
    remote, local = pattern(n, 3), np.zeros(n, np.uint8)
    connect(t, i, remote, local)
    h = i.initialize_xfer("READ", [local], [remote], "target")
    i.transfer(h)
    i.wait(h, 30)
    assert np.array_equal(local, remote)
    local[:] = pattern(n, 4)
    w = i.initialize_xfer("WRITE", [local], [remote], "target", b"written")
    i.transfer(w)
    i.wait(w, 30)
    assert np.array_equal(local, remote)
    assert t.get_new_notifs() == {"initiator": [b"written"]}


def test_scattered_descriptors_both_ways(pair: Any) -> None:
    """512 shuffled 4 KiB pages on each side (a KV-cache layout): every page lands where its
    descriptor says."""
    t, i, _ = pair
    page, n = 4096, 512
    remote, local = pattern(page * n, 5), np.zeros(page * n, np.uint8)
    connect(t, i, remote, local)
    rng = np.random.default_rng(7)
    lp, rp = rng.permutation(n), rng.permutation(n)
    ldesc = [(local.ctypes.data + int(p) * page, page, 0) for p in lp]
    rdesc = [(remote.ctypes.data + int(p) * page, page, 0) for p in rp]
    h = i.initialize_xfer("READ", ldesc, rdesc, "target")
    i.transfer(h)
    i.wait(h, 30)
    lv, rv = local.reshape(n, page), remote.reshape(n, page)
    assert all(np.array_equal(lv[a], rv[b]) for a, b in zip(lp, rp))
    local[:] = pattern(page * n, 8)
    w = i.initialize_xfer("WRITE", ldesc, rdesc, "target")
    i.transfer(w)
    i.wait(w, 30)
    assert all(np.array_equal(lv[a], rv[b]) for a, b in zip(lp, rp))


def test_strided_descriptors_both_ways(pair: Any) -> None:
    """Issue 22: Nx5 strided descriptors (address, len, device, stride, count), K and V
    planes interleaved differently on each side: every piece lands where its row says, whether
    the rows pair up (kept compressed) or not (expanded)."""
    t, i, tr = pair
    page, n = 2048, 256
    remote, local = pattern(page * n * 2, 41), np.zeros(page * n * 2, np.uint8)
    connect(t, i, remote, local)
    L, R = local.ctypes.data, remote.ctypes.data
    # Local: K pages at even slots, V at odd; remote: K in the first half, V in the second.
    lrows = np.array([[L, page, 0, 2 * page, n], [L + page, page, 0, 2 * page, n]], dtype=np.uint64)
    rrows = np.array([[R, page, 0, page, n], [R + page * n, page, 0, page, n]], dtype=np.uint64)
    lv, rv = local.reshape(2 * n, page), remote.reshape(2 * n, page)
    want = lambda: np.array_equal(lv[0::2], rv[:n]) and np.array_equal(lv[1::2], rv[n:])  # noqa: E731
    h = i.initialize_xfer_strided("READ", lrows, rrows, "target")
    i.transfer(h)
    i.wait(h, 30)
    assert want()
    local[:] = pattern(page * n * 2, 42)
    w = i.initialize_xfer_strided("WRITE", lrows, rrows, "target")
    for _ in range(2):  # reposted: the same compressed runs
        i.transfer(w)
        i.wait(w, 30)
        assert want()
    # Rows that do not pair (the remote side in 4 rows of half the count): expanded, same bytes.
    r4 = np.array([[R, page, 0, page, n // 2], [R + page * n // 2, page, 0, page, n // 2],
                   [R + page * n, page, 0, page, n // 2], [R + page * n * 3 // 2, page, 0, page, n // 2]], dtype=np.uint64)
    local[:] = 0
    h = i.initialize_xfer_strided("READ", lrows, r4, "target")
    i.transfer(h)
    i.wait(h, 30)
    assert want()
    with pytest.raises(Exception, match="Nx5"):
        i.initialize_xfer_strided("READ", lrows[:, :3], rrows, "target")


def test_many_transfers_in_flight_at_once(pair: Any) -> None:
    t, i, _ = pair
    n, k = 256 << 10, 32
    remote, local = pattern(n * k, 9), np.zeros(n * k, np.uint8)
    connect(t, i, remote, local)
    hs = []
    for j in range(k):
        h = i.initialize_xfer("READ", [local[j * n:(j + 1) * n]], [remote[j * n:(j + 1) * n]], "target")
        i.transfer(h)
        hs.append(h)
    for h in hs:
        i.wait(h, 30)
    assert np.array_equal(local, remote)


def test_bad_descriptors_refused_memory_untouched(pair: Any) -> None:
    import multirail

    t, i, _ = pair
    remote, local = pattern(MiB, 10), np.zeros(2 * MiB, np.uint8)
    before = remote.copy()
    connect(t, i, remote, local)
    with pytest.raises(multirail.errors.OutOfBoundsError):
        i.initialize_xfer("WRITE", [local[: MiB + 1]], [(remote.ctypes.data, MiB + 1, 0)], "target")
    with pytest.raises(multirail.errors.NotRegisteredError):
        i.initialize_xfer("WRITE", [np.zeros(16, np.uint8)], [(remote.ctypes.data, 16, 0)], "target")
    assert np.array_equal(remote, before)
    # still serving
    h = i.initialize_xfer("READ", [local[:MiB]], [remote], "target")
    i.transfer(h)
    i.wait(h, 10)
    assert np.array_equal(local[:MiB], remote)


def test_rail_stats_name_the_transport(pair: Any) -> None:
    t, i, tr = pair
    remote, local = pattern(MiB), np.zeros(MiB, np.uint8)
    connect(t, i, remote, local)
    h = i.initialize_xfer("READ", [local], [remote], "target")
    i.transfer(h)
    i.wait(h, 10)
    stats = i.rail_stats("target")
    assert stats
    assert_rails_run(stats, tr)
    info = i.transport_info()
    assert info["transport"] == ("auto" if tr == "mixed" else tr), info
    assert [r["transport"] for r in info["rails"]] == rail_kinds(tr, len(stats)), info
    if tr != "tcp":
        assert stats[0]["transport"] == "ucx/tcp", stats  # the wheel has no RDMA; lo is not one
        assert info["ucx_version"] and info["ucx_version"].startswith("1."), info
        assert "lo" in info["ucx_rails"], info
        # Asked for by name, without RDMA: said so, per rail.
        assert stats[0]["transport_reason"].startswith("explicit (no RDMA device"), stats
        assert info["rails"][0]["unprotected"], info
    else:
        assert info["ucx_version"] is None, info
        assert stats[0]["transport_reason"] == "explicit", stats
    if tr == "mixed":
        assert stats[1]["transport"] == "tcp" and stats[1]["transport_reason"] == "explicit", stats
        assert not info["rails"][1]["unprotected"], info
    assert all(s["fallbacks"] == 0 and s["transport_switches"] == 0 for s in stats), stats
    assert sum(s["bytes_read"] for s in stats) == MiB


@pytest.mark.parametrize("tr", TRANSPORTS)
def test_a_transfers_trace_says_what_each_rail_did(tr: str) -> None:
    """`XferHandle.trace()`: per rail, the bytes and chunks of the last post, its first issue
    and last completion, and the planner's rate estimates; reset by each post."""
    import multirail

    cfg = {**agent_cfg(tr), "rails": LOOP2}
    with multirail.Agent("target", cfg) as t, \
            multirail.Agent("initiator", {**cfg, "timeout": 10.0, "stall_timeout": 2.0}) as i:
        n = 32 * MiB
        remote, local = pattern(n, 7), np.zeros(n, np.uint8)
        connect(t, i, remote, local)
        h = i.initialize_xfer("READ", [local], [remote], "target")
        assert h.trace() is None  # never posted
        ends: list[list[float]] = []
        for post in range(2):
            t0 = time.perf_counter()
            i.transfer(h)
            i.wait(h, 30)
            wall_us = (time.perf_counter() - t0) * 1e6
            assert np.array_equal(local, remote)
            tr_ = h.trace()
            assert tr_ is not None
            rails = tr_["rails"]
            assert len(rails) == 2, tr_
            # each post's own bytes (reset by the post, not summed over posts)
            assert sum(r["bytes"] for r in rails) == n, (post, tr_)
            assert 0 < tr_["total_us"] <= wall_us, (tr_, wall_us)
            for r in rails:
                if r["bytes"]:
                    assert r["chunks"] >= 1, tr_
                    assert 0 <= r["first_issue_us"] <= r["last_done_us"] <= tr_["total_us"], tr_
                    assert r["rate_gbps_at_end"] > 0, tr_
            # the transfer ends with its latest rail's last chunk
            assert 0 < max(r["last_done_us"] for r in rails if r["bytes"]) <= tr_["total_us"], tr_
            ends.append([r["rate_gbps_at_end"] for r in rails])
            if post:  # no traffic between the posts: the second starts from the first's estimates
                assert [r["rate_gbps_at_post"] for r in rails] == pytest.approx(ends[0]), tr_


def test_close_mid_transfer_then_memory_is_left_alone(pair: Any) -> None:
    """close() with a large READ in flight: the transfer ends in error, and once close() has
    returned no byte of the destination changes any more."""
    t, i, _ = pair
    n = 256 * MiB
    remote, local = np.full(n, 7, np.uint8), np.zeros(n, np.uint8)
    connect(t, i, remote, local)
    h = i.initialize_xfer("READ", [local], [remote], "target")
    i.transfer(h)
    _until_some_landed(local)
    i.close()
    snap = local.copy()
    # close() really came mid-transfer (else this test would prove nothing): not all landed
    assert not np.array_equal(snap, remote), "the READ finished before close(); make it larger"
    time.sleep(0.3)
    assert np.array_equal(local, snap), "memory changed after close() returned"


def _until_some_landed(buf: np.ndarray, timeout: float = 20.0) -> None:
    """Wait (bounded) until the first bytes of a transfer into the zeroed `buf` have landed.
    A fixed sleep is no measure of "mid-transfer": a fast machine moves 256 MiB over loopback
    in under 50 ms. This returns within a fraction of a millisecond of the first bytes."""
    sample = buf[:: 64 * 1024]
    deadline = time.monotonic() + timeout
    while not sample.any():
        assert time.monotonic() < deadline, "no byte of the transfer landed"
        time.sleep(0.0002)


TARGET_SCRIPT = r"""
import json, sys, time, numpy as np, multirail
n, cfg = int(sys.argv[1]), json.loads(sys.argv[2])
t = multirail.Agent("target", cfg)
buf = np.full(n, 5, np.uint8)
t.register_memory(buf)
print(t.port, buf.ctypes.data, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("tr", TRANSPORTS)
def test_peer_killed_mid_transfer_fails_within_the_timeout(tr: str) -> None:
    import multirail

    n = 256 * MiB
    import json

    p = subprocess.Popen([sys.executable, "-c", TARGET_SCRIPT, str(n), json.dumps(agent_cfg(tr))], stdout=subprocess.PIPE,
                         text=True)
    try:
        port, addr = map(int, p.stdout.readline().split())
        with multirail.Agent("initiator", {**agent_cfg(tr), "timeout": 3.0, "stall_timeout": 0.5}) as i:
            dst = np.zeros(n, np.uint8)
            i.register_memory(dst)
            i.fetch_remote_metadata("target", "127.0.0.1", port)
            h = i.initialize_xfer("READ", [dst], [(addr, n, 0)], "target")
            i.transfer(h)
            _until_some_landed(dst)
            # Freeze the target first so that the READ cannot finish before the kill lands
            # (on a fast machine it would in ~50 ms), and check that it really is in flight.
            p.send_signal(signal.SIGSTOP)
            assert i.check_xfer_state(h) == multirail.XferState.IN_PROGRESS, "the READ finished before the kill"
            p.kill()
            t0 = time.monotonic()
            with pytest.raises(multirail.errors.MultirailError):
                i.wait(h, 20)
            assert time.monotonic() - t0 < 8.0
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_a_paused_target_is_a_slow_peer_not_a_dead_rail(op: str) -> None:
    """The target is stopped (SIGSTOP) mid-transfer for 3 x stall_timeout, as a target whose
    serving threads are off the CPU on a loaded host: every byte the initiator sent is
    acknowledged, and the target's kernel answers the path's keepalive probes. No rail is
    declared stalled; once the target runs again the transfer completes byte-exact. A target
    that stays stopped still fails the transfer, after the planner's held_timeout (5 s)."""
    import json

    import multirail

    n = 64 * MiB
    cfg = {"transport": "tcp", "rails": LOOP2}
    p = subprocess.Popen([sys.executable, "-c", TARGET_SCRIPT, str(n), json.dumps(cfg)], stdout=subprocess.PIPE, text=True)
    try:
        port, addr = map(int, p.stdout.readline().split())
        with multirail.Agent("initiator", {**cfg, "timeout": 3.0, "stall_timeout": 0.5}) as i:
            buf = np.zeros(n, np.uint8) if op == "READ" else pattern(n)
            i.register_memory(buf)
            i.fetch_remote_metadata("target", "127.0.0.1", port)
            h = i.initialize_xfer(op, [buf], [(addr, n, 0)], "target")
            for pause in (1.5, None):
                if op == "READ":
                    buf[:] = 0
                i.transfer(h)
                if op == "READ":
                    _until_some_landed(buf)
                else:
                    time.sleep(0.002)
                p.send_signal(signal.SIGSTOP)
                wait_stopped(p.pid)
                if i.check_xfer_state(h) == multirail.XferState.DONE:
                    p.send_signal(signal.SIGCONT)
                    pytest.fail("the transfer finished before the target stopped; make it larger")
                if pause is None:
                    break
                time.sleep(pause)
                stats = i.rail_stats("target")
                assert all(r["up"] and r["stalls"] == 0 for r in stats), stats
                p.send_signal(signal.SIGCONT)
                i.wait(h, 30)
                stats = i.rail_stats("target")
                assert all(r["up"] and r["stalls"] == 0 and r["times_down"] == 0 for r in stats), stats
                if op == "READ":
                    assert (buf == 5).all(), "READ not byte-exact after the pause"
                else:
                    back = np.zeros(n, np.uint8)
                    i.register_memory(back)
                    hb = i.initialize_xfer("READ", [back], [(addr, n, 0)], "target")
                    i.transfer(hb)
                    i.wait(hb, 30)
                    assert np.array_equal(back, buf), "WRITE not byte-exact after the pause"
            # Stopped for good: not held forever.
            t0 = time.monotonic()
            with pytest.raises(multirail.errors.MultirailError):
                i.wait(h, 30)
            took = time.monotonic() - t0
            print(f"stopped for good: failed after {took:.2f} s")
            assert 2.5 < took < 12.0, took  # held up to `timeout` (3 s), then the rails fail
            assert any(r["stalls"] >= 1 for r in i.rail_stats("target")), [(r["stalls"], r["times_down"], r["down_reason"]) for r in i.rail_stats("target")]
    finally:
        p.kill()
        p.wait()


def test_ucx_initiator_against_a_tcp_only_target_is_refused_clearly() -> None:
    if _UCX_SKIP:
        pytest.skip(_UCX_SKIP)
    import multirail

    with multirail.Agent("target") as t, multirail.Agent("initiator", {"transport": "ucx", "timeout": 3.0}) as i:
        remote, local = pattern(MiB), np.zeros(MiB, np.uint8)
        connect(t, i, remote, local)
        with pytest.raises(multirail.errors.ProtocolError, match="does not run the ucx transport"):
            h = i.initialize_xfer("READ", [local], [remote], "target")
            i.transfer(h)
            i.wait(h, 10)


def test_unknown_transport_refused() -> None:
    import multirail

    with pytest.raises(ValueError, match="transport"):
        multirail.Agent("x", {"transport": "carrier-pigeon"})


# ---------------------------------------------------------------------------- testbed

_NETNS = netns_unavailable()


@pytest.fixture
def testbed(request: pytest.FixtureRequest) -> Iterator[Any]:
    if _NETNS:
        pytest.skip(_NETNS)
    from multirail.testbed import Testbed

    spec = dict(getattr(request, "param", {"rails": 2, "rate": "1gbit"}))
    tb = Testbed(f"tt{uuid.uuid4().hex[:6]}", **spec)
    with tb:
        yield tb


def _env(tr: str) -> dict[str, str]:
    return {**os.environ, "MULTIRAIL_TRANSPORT": tr_spec(tr)}


@pytest.mark.parametrize("tr", TRANSPORTS)
@pytest.mark.parametrize("op,how", [("READ", "link"), ("WRITE", "link"), ("WRITE", "blackhole")])
def test_rail_dies_mid_transfer_completes_byte_exact(testbed: Any, tr: str, op: str, how: str) -> None:
    """Both rails carry the transfer; rail 1 dies mid-way (link down: carrier lost; blackhole:
    silently dropped, only the stall timer sees it); the transfer completes byte-exact on rail
    0, and the rail is readmitted and carries data again."""
    from multirail.bench.drill import run_drill

    out = run_drill(testbed, {"mode": "failover", "op": op, "size": 128 * MiB, "rail": 1, "how": how,
                              "stall_timeout": STALL_S, "transport": tr_spec(tr)}, timeout=120, env=_env(tr))
    for step in ("baseline", "failover", "one_rail", "after_readmit"):
        assert out[step]["ok"] and out[step]["corrupt"] is None, (step, out[step])
    fo = out["failover"]
    assert fo["bytes_before_down"] > 0
    # Found dead, within the stall timeout and slack of the break taking effect (timed from the
    # return of the `ip` call that breaks it: that call is the host's, not the engine's).
    assert fo["detect_s"] is not None, ("the rail was never seen down", fo["late_breaks"], fo["rail_stats"])
    assert fo["detect_after_call_s"] <= STALL_S + 2.0, (fo["detect_after_call_s"], fo["link_down_call_s"])
    assert fo["rail_stats"][1]["up"] is False and fo["rail_stats"][1]["down_reason"], fo["rail_stats"]
    assert_rails_run(fo["rail_stats"], tr)
    assert out["one_rail"]["bytes_on_down_rail"] == 0
    assert out["readmit_s"] is not None and out["readmit_s"] <= 6.0, out["readmit_s"]
    assert min(out["after_readmit"]["rail_bytes"]) >= 0.3 * out["size"], out["after_readmit"]


@pytest.mark.parametrize("tr", TRANSPORTS)
def test_stale_write_does_not_land_after_the_link_returns(testbed: Any, tr: str) -> None:
    """A WRITE loses a rail mid-way, the next WRITE overwrites the range, the link comes back:
    the dead rail's paths were fenced on the target before the reissue (over ucx: the target
    destroyed that session's worker), so nothing stale lands."""
    from multirail.bench.drill import run_drill

    out = run_drill(testbed, {"mode": "stale_write", "op": "WRITE", "size": 64 * MiB,
                              "stall_timeout": STALL_S, "transport": tr_spec(tr)}, timeout=120, env=_env(tr))
    assert out["first"]["ok"] and out["first"]["corrupt"] is None, out["first"]
    assert out["second"]["ok"] and out["second"]["corrupt"] is None, out["second"]
    assert out["second_reverified"] is None, out["second_reverified"]
    assert any("fenced" in e for e in out["events"]), out["events"]


# ---------------------------------------------------------------------------- Faulty<T>

def _faulty_pair(tr: str, faults: str, stall: float = 0.3, **extra: Any) -> tuple[Any, Any]:
    import multirail

    t = multirail.Agent("target", {"transport": tr_spec(tr), "rails": LOOP2})
    i = multirail.Agent("initiator", {"transport": tr_spec(tr), "rails": LOOP2, "faults": faults, "timeout": 5.0,
                                      "stall_timeout": stall, "chunk_size": 256 << 10, **extra})
    return t, i


def _run_until(i: Any, t: Any, seconds: float, n: int = 32 * MiB, then_until: Any = None,
               limit: float = 20.0) -> list[dict[str, Any]]:
    """READ and WRITE alternately for `seconds`, each checked byte-exact; returns rail_stats
    snapshots taken after each transfer. With `then_until` (a predicate on a snapshot), goes on
    after `seconds` until it holds, for at most `limit` seconds in all: an event that must come
    (a readmission) may come late on a loaded host."""
    remote, local = pattern(n, 21), np.zeros(n, np.uint8)
    # Each WRITE sends fresh bytes: this pattern xor a per-transfer byte (cheap, so that on a
    # loaded host the snapshots still come often enough to see short-lived states).
    base = pattern(n, 100)
    t.register_memory(remote)
    i.register_memory(local)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    snaps, k, t0 = [], 0, time.monotonic()
    end = t0 + seconds

    def more() -> bool:
        now = time.monotonic()
        if now < end:
            return True
        return then_until is not None and bool(snaps) and not then_until(snaps[-1]) and now < t0 + limit

    while more():
        k += 1
        if k % 2:
            local[:] = 0
            h = i.initialize_xfer("READ", [local], [remote], "target")
            i.transfer(h)
            i.wait(h, 20)
        else:
            np.bitwise_xor(base, np.uint8(k % 255 + 1), out=local)
            h = i.initialize_xfer("WRITE", [local], [remote], "target")
            i.transfer(h)
            i.wait(h, 20)
        assert np.array_equal(local, remote), f"transfer {k} not byte-exact"
        snaps.append(i.rail_stats("target"))
    return snaps


@pytest.mark.parametrize("tr", TRANSPORTS)
def test_faulty_kill_then_readmit(tr: str) -> None:
    """Rail 1 is killed 300 ms in and refused for 1 s: every transfer completes byte-exact on
    rail 0 meanwhile, and rail 1 comes back and carries data again."""
    t, i = _faulty_pair(tr, "1:kill@300ms+1s")
    try:
        snaps = _run_until(i, t, 3.0)
        assert any(not s[1]["up"] and "fault injected" in (s[1]["down_reason"] or "") for s in snaps), snaps[-1]
        end = snaps[-1]
        assert end[1]["up"] and end[1]["times_down"] >= 1 and end[1]["readmissions"] >= 1, end
        assert_rails_run(end, tr, wrapped="faulty(")
        down_at = next(j for j, s in enumerate(snaps) if not s[1]["up"])
        assert end[1]["bytes"] > snaps[down_at][1]["bytes"], "rail 1 carried nothing after readmission"
    finally:
        i.close()
        t.close()


@pytest.mark.parametrize("tr", TRANSPORTS)
def test_faulty_blackhole_is_found_by_the_planners_stall_rule(tr: str) -> None:
    """Rail 1 stops reporting anything 300 ms in (its bytes still flow: nothing else can tell):
    the planner's stall rule declares it down after stall_timeout, its chunks are reissued on
    rail 0 byte-exact, and it is readmitted once the blackhole ends."""
    t, i = _faulty_pair(tr, "1:blackhole@300ms+1s", stall=0.3)
    try:
        snaps = _run_until(i, t, 3.5, then_until=lambda s: s[1]["up"])
        reasons = [s[1]["down_reason"] for s in snaps if s[1]["down_reason"]]
        assert reasons and all("stalled" in r for r in reasons), reasons
        end = snaps[-1]
        assert end[1]["stalls"] >= 1 and end[1]["times_down"] >= 1, end
        assert end[1]["up"], end
    finally:
        i.close()
        t.close()


@pytest.mark.parametrize("tr", TRANSPORTS)
def test_faulty_slow_rail_gets_less_weight(tr: str) -> None:
    """Every completion on rail 1 is reported 20 ms late: the planner measures it slow and moves
    the bulk of the bytes to rail 0."""
    t, i = _faulty_pair(tr, "1:slow=20ms@0", stall=2.0)
    try:
        end = _run_until(i, t, 2.0)[-1]
        assert end[0]["bytes"] > 3 * end[1]["bytes"], [(r["bytes"], r["rate_gbps"]) for r in end]
        assert all(r["up"] for r in end), end
    finally:
        i.close()
        t.close()


def test_a_failed_read_returns_only_once_nothing_of_it_can_land() -> None:
    """Issue 35 (review of 6d4402f): a READ whose chunk from a region the target has withdrawn
    is refused fails at once, while rail 1 (every completion reported 60 ms late) still has
    chunks of it in flight, their responses not yet read. The transfer must not be reported
    failed before those have landed (or their rail is shut): the caller frees or reuses the
    memory as soon as it sees the error. Until the fix the error came back first and the
    rest of the bytes landed in the buffer afterwards. tcp only: the withdrawn region is refused
    by the tcp target; ucx's gets of it are not a refusal."""
    import multirail

    t, i = _faulty_pair("tcp", "1:slow=60ms@0", stall=2.0, chunk_size=64 << 10)
    try:
        n, m = 4 * MiB, 64 << 10
        remote, gone = pattern(n, 41), pattern(m, 42)
        local = np.full(n + m, 0xEE, np.uint8)
        t.register_memory(remote)
        withdrawn = t.register_memory(gone)
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        t.deregister_memory(withdrawn)  # the target refuses READs of it from now on
        half, base = n // 2, local.ctypes.data
        ldesc = [(base, half, 0), (base + n, m, 0), (base + half, n - half, 0)]
        rdesc = [(remote.ctypes.data, half, 0), (gone.ctypes.data, m, 0), (remote.ctypes.data + half, n - half, 0)]
        h = i.initialize_xfer("READ", ldesc, rdesc, "target")
        t0 = time.monotonic()
        with pytest.raises(multirail.errors.MultirailError) as err:
            i.transfer_sync(h, timeout=20.0)
        took = time.monotonic() - t0
        after = local.copy()
        time.sleep(0.5)
        changed = int(np.count_nonzero(local != after))
        assert not isinstance(err.value, TimeoutError), err.value
        assert changed == 0, f"{changed} bytes landed in local memory after the READ failed ({err.value}) in {took:.3f} s"
        i.release_xfer_handle(h)
    finally:
        i.close()
        t.close()


@pytest.mark.parametrize("tr", TRANSPORTS)
def test_scattered_pages_both_sides_survive_a_killed_rail(tr: str) -> None:
    """Issue 22: 4 KiB pages shuffled on BOTH sides (a KV layout), READ and WRITE alternately
    over two rails while rail 1 is killed 200 ms in and refused for 1 s: every byte of every
    transfer lands where its descriptors say, and the pages travel as vectored requests (tcp)
    or one active message per chunk (ucx), far fewer requests than pages, re-cut onto rail 0
    when rail 1 dies."""
    t, i = _faulty_pair(tr, "1:kill@200ms+1s")
    try:
        page, n = 4096, 4096
        remote, local = pattern(page * n, 31), np.zeros(page * n, np.uint8)
        t.register_memory(remote)
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        rng = np.random.default_rng(32)
        lp, rp = rng.permutation(n), rng.permutation(n)
        ldesc = [(local.ctypes.data + int(p) * page, page, 0) for p in lp]
        rdesc = [(remote.ctypes.data + int(p) * page, page, 0) for p in rp]
        lv, rv = local.reshape(n, page), remote.reshape(n, page)
        rd = i.initialize_xfer("READ", ldesc, rdesc, "target")
        wr = i.initialize_xfer("WRITE", ldesc, rdesc, "target")
        snaps, k, end = [], 0, time.monotonic() + 2.5
        while time.monotonic() < end:
            k += 1
            if k % 2:
                local[:] = 0
                i.transfer(rd)
                i.wait(rd, 20)
            else:
                local[:] = pattern(page * n, 200 + k)
                i.transfer(wr)
                i.wait(wr, 20)
            assert np.array_equal(lv[lp], rv[rp]), f"transfer {k}: a page is not where its descriptor says"
            snaps.append(i.rail_stats("target"))
        assert k >= 4, k
        # Killed while transfers ran back to back (a snapshot between two of them may miss the
        # down time on a loaded machine; the counter does not).
        assert snaps[-1][1]["times_down"] >= 1, snaps[-1]
        served = t.served_stats()
        requests = sum(r["requests_read"] + r["requests_written"] for r in served)
        # tcp: vectored requests; ucx (issue 22, session 11): one active message per chunk with
        # its piece list, which the target counts as a served request (RMA would count none).
        assert 0 < requests and requests * 16 < k * n, f"{requests} requests for {k} x {n} pages: not vectored"
    finally:
        i.close()
        t.close()


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_scattered_gpu_pages_both_sides_survive_a_killed_rail(op: str) -> None:
    """Issue 22, GPU memory (the stand-in device): 4 KiB pages shuffled on both sides, both in GPU
    memory, moved back to back over two tcp rails while rail 1 is killed 200 ms in and refused for
    1 s. Every page lands where its descriptors say; the pages travel as vectored requests,
    gathered into and scattered from the pinned staging buffers on both sides (far fewer
    requests than pages), re-cut onto rail 0 when rail 1 dies."""
    import multirail
    from multirail.gpu import DeviceBuffer

    gpu = {"gpu": "standin", "gpu_ipc": False}
    t = multirail.Agent("target", {"rails": LOOP2, **gpu})
    i = multirail.Agent("initiator", {"rails": LOOP2, "faults": "1:kill@200ms+1s", "timeout": 5.0, "stall_timeout": 0.3,
                                      "chunk_size": 256 << 10, **gpu})
    try:
        page, n = 4096, 2048
        remote, local = DeviceBuffer(page * n, kind="standin"), DeviceBuffer(page * n, kind="standin")
        t.register_memory(remote)
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        rng = np.random.default_rng(33)
        lp, rp = rng.permutation(n), rng.permutation(n)
        h = i.initialize_xfer(op, [(local.addr + int(p) * page, page, 0) for p in lp],
                              [(remote.addr + int(p) * page, page, 0) for p in rp], "target")
        lv, rv = np.empty(page * n, np.uint8), np.empty(page * n, np.uint8)
        k, end = 0, time.monotonic() + 2.5
        while time.monotonic() < end:
            k += 1
            (remote if op == "READ" else local).copy_from_host(pattern(page * n, 40 + k))
            i.transfer(h)
            i.wait(h, 20)
            local.copy_to_host(lv)
            remote.copy_to_host(rv)
            assert np.array_equal(lv.reshape(n, page)[lp], rv.reshape(n, page)[rp]), f"transfer {k}: a page is misplaced"
        assert k >= 4, k
        assert i.rail_stats("target")[1]["times_down"] >= 1, i.rail_stats("target")
        served = t.served_stats()
        requests = sum(r["requests_read"] + r["requests_written"] for r in served)
        assert 0 < requests and requests * 16 < k * n, f"{requests} requests for {k} x {n} pages: not vectored"
        staged = sum(r["staging"]["h2d" if op == "WRITE" else "d2h"]["bytes"] for r in served)
        assert staged >= k * page * n, (staged, k)
        # The target ran requests read ahead behind one another through one pipeline (no fill
        # and drain at every vectored request).
        assert sum(r["staging"]["overlapped"] for r in served) > 0, served
        i.release_xfer_handle(h)
    finally:
        i.close()
        t.close()


def test_faulty_schedule_is_validated() -> None:
    import multirail

    with pytest.raises(ValueError, match="RAIL:KIND@AT"):
        multirail.Agent("x", {"faults": "1:explode@1s"})


# ---------------------------------------------------------------------------- fallback (issue 21)

UCX_LINKS = [pytest.param("ucx", marks=_NEEDS_UCX), pytest.param("mixed", marks=_NEEDS_UCX)]


@pytest.mark.parametrize("tr", UCX_LINKS)
def test_ucx_rail_falls_back_to_tcp_and_retries_ucx_after_a_cooldown(tr: str) -> None:
    """Rail 0's ucx path (only it: `0/ucx:`) is killed 300 ms in and refused for 1.5 s, while the
    rail's IP path works: after 3 failures (the kill and two refused reopens) the rail is reopened
    over tcp on the same addresses; 1 s later it retries ucx (the fault is over: it stays). A
    second kill right after: one failure of a retried path falls back at once, and the next
    cool-down is 2 s. Every transfer meanwhile is byte-exact (READs and WRITEs, fenced as for any
    rail failure); rail_stats says what the rail ran and why at each step (each snapshot one
    state of the rail's switch: its carrier with its own reason)."""
    t, i = _faulty_pair(tr, "0/ucx:kill@300ms+1500ms,0/ucx:kill@2600ms+500ms", stall=0.5,
                        fallback_after=3, fallback_cooldown=1.0, fallback_max_switches=8)
    back_on_ucx: list[int] = []

    def settled(s: list[dict[str, Any]]) -> bool:
        """Back on ucx after the second fallback, and carrying data there (the retry is due
        about 5 s in; a loaded host may take longer: it must come, however late)."""
        r = s[0]
        if r["fallbacks"] < 2 or r["transport"] != "faulty(ucx/tcp)" or not r["up"]:
            back_on_ucx.clear()
            return False
        back_on_ucx.append(r["bytes"])
        return back_on_ucx[-1] > back_on_ucx[0]

    try:
        snaps = _run_until(i, t, 6.5, then_until=settled, limit=40.0)
        on_tcp = [s[0] for s in snaps if s[0]["transport"] == "tcp"]
        assert on_tcp, [s[0]["transport"] for s in snaps]
        assert on_tcp[0]["transport_reason"] == "fallback after 3 ucx failures", on_tcp[0]

        def waits(k: int) -> list[float]:
            """Time to the retry seen while on tcp after fallback k (None once the retry began)."""
            return [s["next_ucx_retry_s"] for s in on_tcp if s["fallbacks"] == k and s["next_ucx_retry_s"] is not None]

        assert waits(1) and max(waits(1)) <= 1.0, on_tcp
        # The second fallback waits twice as long.
        assert waits(2) and max(waits(2)) > 1.0, on_tcp
        end = snaps[-1]
        # The rail's ucx part is wrapped by the fault schedule (`0/ucx:`); its tcp part is not.
        assert end[0]["transport"] == "faulty(ucx/tcp)", [s[0]["transport"] for s in snaps]
        assert end[0]["up"] and end[0]["fallbacks"] == 2 and end[0]["transport_switches"] == 4, end[0]
        assert end[0]["transport_reason"].startswith("ucx retried after a cool-down"), end[0]
        # Rail 0 carried data over tcp, and again over ucx after the last retry.
        back = max(j for j, s in enumerate(snaps) if s[0]["transport"] == "tcp")
        assert end[0]["bytes"] > snaps[back][0]["bytes"], "rail 0 carried nothing after ucx came back"
        # The other rail never switched.
        assert all(s[1]["transport_switches"] == 0 for s in snaps), snaps[-1][1]
        assert end[1]["transport"] == ("tcp" if tr == "mixed" else "faulty(ucx/tcp)"), end[1]
        ev = i.events()
        assert any("reopening it over tcp" in e or "fallback after 3 ucx failures" in e for e in ev), ev[-20:]
    finally:
        i.close()
        t.close()


@pytest.mark.parametrize("tr", UCX_LINKS)
def test_fallback_bounded_by_max_switches(tr: str) -> None:
    """With one switch allowed, the rail falls back once and stays on tcp (no retry left)."""
    t, i = _faulty_pair(tr, "0/ucx:kill@200ms+1s", stall=0.5, fallback_after=2, fallback_cooldown=0.2,
                        fallback_max_switches=1)
    try:
        end = _run_until(i, t, 2.5)[-1]
        assert end[0]["transport"] == "tcp" and end[0]["up"], end[0]
        assert (end[0]["fallbacks"], end[0]["transport_switches"]) == (1, 1), end[0]
        assert end[0]["next_ucx_retry_s"] is None and "switch limit 1 reached" in end[0]["transport_reason"], end[0]
    finally:
        i.close()
        t.close()


@pytest.mark.parametrize("tr", UCX_LINKS)
def test_no_fallback_when_the_ip_path_is_down_too(tr: str) -> None:
    """A rail killed whatever it runs (no `/ucx`): its reopens fail over tcp as well, so they do
    not count against ucx, and the rail comes back on ucx."""
    t, i = _faulty_pair(tr, "0:kill@200ms+1200ms", stall=0.5, fallback_after=2, fallback_cooldown=0.5)
    try:
        snaps = _run_until(i, t, 2.5)
        assert any(not s[0]["up"] for s in snaps), snaps[-1]
        end = snaps[-1]
        assert end[0]["up"] and end[0]["transport"].startswith("faulty(ucx"), end[0]
        assert end[0]["fallbacks"] == 0, end[0]
    finally:
        i.close()
        t.close()


def test_auto_is_tcp_without_rdma_and_loads_no_ucx() -> None:
    import multirail

    with multirail.Agent("a", {"transport": "auto", "rails": LOOP2}) as a:
        info = a.transport_info()
        assert info["transport"] == "auto" and info["ucx_version"] is None, info
        assert info["rails"] == [{"transport": "tcp", "reason": "auto: no RDMA device", "unprotected": False}] * 2, info
    # The default is auto.
    env = {k: v for k, v in os.environ.items() if k != "MULTIRAIL_TRANSPORT"}
    out = subprocess.run([sys.executable, "-c", "import multirail; a = multirail.Agent('d'); "
                          "print(a.transport_info()['transport'], a.transport_info()['rails'][0]['reason']); a.close()"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[0] == "auto auto: no RDMA device", (out.stdout, out.stderr)


def test_per_rail_transport_by_index_name_or_list_and_bad_keys_refused() -> None:
    if _UCX_SKIP:
        pytest.skip(_UCX_SKIP)
    import multirail

    for spec in ({0: "ucx", 1: "tcp"}, {"*": "tcp", 0: "ucx"}, ["ucx", "tcp"], "ucx,tcp"):
        with multirail.Agent("a", {"transport": spec, "rails": LOOP2}) as a:
            assert [r["transport"] for r in a.transport_info()["rails"]] == ["ucx", "tcp"], spec
    with pytest.raises(multirail.errors.InvalidArgumentError, match="not one of this agent's rails"):
        multirail.Agent("a", {"transport": {"eth9": "ucx"}, "rails": LOOP2})
    with pytest.raises(multirail.errors.InvalidArgumentError, match="2 rails"):
        multirail.Agent("a", {"transport": ["ucx", "tcp", "tcp"], "rails": LOOP2})
    with pytest.raises(ValueError, match="transport"):
        multirail.Agent("a", {"transport": {0: "rdma"}, "rails": LOOP2})


def test_explicit_ucx_without_rdma_warns_once() -> None:
    """Two rails over UCX's tcp, asked for by name: one warning for the agent, naming the risk
    and both rails; a tcp rail is not named."""
    if _UCX_SKIP:
        pytest.skip(_UCX_SKIP)
    import multirail

    with multirail.Agent("a", {"transport": ["ucx", "ucx", "tcp"], "rails": LOOP2 + ["127.0.0.1"]}) as a:
        warns = [e for e in a.events() if "check no memory bounds" in e]
        assert len(warns) == 1, a.events()
        assert "rail(s) 0 (lo), 1 (lo) run UCX without RDMA" in warns[0] and "SECURITY.md" in warns[0], warns
    with multirail.Agent("b", {"transport": "tcp"}) as b:
        assert not [e for e in b.events() if "memory bounds" in e], b.events()


def test_a_tcp_rail_refuses_ucx_sessions() -> None:
    """The target runs rail 0 over tcp (auto, no RDMA): a peer asking for ucx there is refused,
    clearly (no UCX over TCP without asking)."""
    if _UCX_SKIP:
        pytest.skip(_UCX_SKIP)
    import multirail

    with multirail.Agent("target", {"transport": ["tcp", "ucx"], "rails": LOOP2}) as t, \
            multirail.Agent("initiator", {"transport": "ucx", "rails": LOOP2, "timeout": 3.0,
                                          "rail_map": [(0, 0)], "fallback_after": 0}) as i:
        remote, local = pattern(MiB), np.zeros(MiB, np.uint8)
        connect(t, i, remote, local)
        with pytest.raises(multirail.errors.ProtocolError, match="does not run the ucx transport on rail 0"):
            h = i.initialize_xfer("READ", [local], [remote], "target")
            i.transfer(h)
            i.wait(h, 10)
