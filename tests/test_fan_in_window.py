"""`AgentConfig.fan_in_window`: a target splits a rail's receive window among the peers with data
connections on that rail (each peer's part among its connections), and regrows the others' shares
when one leaves
(crates/multirail/src/fanin.rs). Observed from outside, with `ss` (the kernel's receive buffer of
each accepted socket: twice the share), on loopback."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import engine_available

pytestmark = [
    pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)"),
    pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read socket buffers"),
]

KiB = 1 << 10
# Small enough that the buffers asked for (a share each) stay under a stock net.core.rmem_max
# (212992), so the test does not depend on the capability to force a buffer; no share's buffer
# equals the kernel's default receive buffer.
BUDGET = 150 * KiB


def served_rcvbufs(port: int, peer: str | None = None) -> list[int]:
    """The receive buffer (skmem rb) of every established socket whose local port is `port`
    (and whose remote address is `peer`, when given)."""
    flt = f"( sport = :{port} )" if peer is None else f"( sport = :{port} and dst {peer} )"
    out = subprocess.run(["ss", "-tmnH", "state", "established", flt],
                         capture_output=True, text=True, timeout=10, check=True).stdout
    return [int(x) for x in re.findall(r"\brb(\d+)", out)]


def wait_for(pred, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(0.02)


def connected(agents, target, k: int):
    import multirail

    ins = []
    for j in range(k):
        i = agents(f"fanin-i{j}", {"timeout": 5.0})
        i.fetch_remote_metadata(target.name, "127.0.0.1", target.port)
        assert wait_for(lambda i=i: i.check_remote_metadata(target.name))
        i.make_connection(target.name)
        ins.append(i)
    assert isinstance(ins[0], multirail.Agent)
    return ins


def test_shares_split_the_rail_and_regrow_when_a_peer_leaves(agents):
    t = agents("fanin-t", {"fan_in_window": BUDGET})
    src = np.arange(4 << 20, dtype=np.uint32).view(np.uint8)[: 4 << 20].copy()
    t.register_memory(src)
    ins = connected(agents, t, 3)
    share3 = 2 * (BUDGET // 3)
    assert wait_for(lambda: served_rcvbufs(t.port) == [share3] * 3), served_rcvbufs(t.port)
    # The window bounds the rate, not what arrives: a READ and a WRITE through clamped sockets
    # are byte-exact.
    dst = np.zeros(4 << 20, dtype=np.uint8)
    ins[0].register_memory(dst)
    ins[0].fetch_remote_metadata(t.name, "127.0.0.1", t.port)
    h = ins[0].initialize_xfer("READ", ins[0].get_xfer_descs(dst), t_descs(ins[0], src), t.name)
    ins[0].transfer_sync(h, timeout=30)
    assert np.array_equal(dst, src)
    ins[2].close()
    share2 = 2 * (BUDGET // 2)
    assert wait_for(lambda: served_rcvbufs(t.port) == [share2] * 2), served_rcvbufs(t.port)


def test_one_peers_idle_connections_do_not_shrink_another_peers_share(agents):
    """Issue 33: the shares were per connection, so a peer that opened many idle data
    connections shrank every other peer's window. Without a secret a peer is its address: here
    an initiator agent on 127.0.0.1, and a raw client (tests/rawpeer.py) on 127.0.0.2 that
    opens one data connection, then seven more it never uses."""
    import rawpeer

    t = agents("fanin-th", {"fan_in_window": BUDGET})
    t.register_memory(np.zeros(1 << 20, dtype=np.uint8))
    (i,) = connected(agents, t, 1)
    assert wait_for(lambda: served_rcvbufs(t.port, "127.0.0.1") == [2 * BUDGET]), served_rcvbufs(t.port)
    half = 2 * (BUDGET // 2)
    raw = [rawpeer.connect(t.port, name="idle", source="127.0.0.2")]
    try:
        assert wait_for(lambda: served_rcvbufs(t.port) == [half, half]), served_rcvbufs(t.port)
        raw += [rawpeer.connect(t.port, name=f"idle{k}", source="127.0.0.2") for k in range(7)]
        # The eight split the raw peer's half (down to the 16 KiB floor); the agent keeps its half.
        floor = 2 * max(16 * KiB, BUDGET // 2 // 8)
        assert wait_for(lambda: served_rcvbufs(t.port, "127.0.0.2") == [floor] * 8), served_rcvbufs(t.port)
        assert served_rcvbufs(t.port, "127.0.0.1") == [half], served_rcvbufs(t.port)
        # And the agent's traffic runs through that window, byte-exact.
        src = np.arange(1 << 20, dtype=np.uint8)
        t_src = np.zeros(1 << 20, dtype=np.uint8)
        t.register_memory(t_src)
        i.register_memory(src)
        i.fetch_remote_metadata(t.name, "127.0.0.1", t.port)
        h = i.initialize_xfer("WRITE", i.get_xfer_descs(src), t_descs(i, t_src), t.name)
        i.transfer_sync(h, timeout=30)
        assert np.array_equal(t_src, src)
    finally:
        for s in raw:
            s.close()
    assert wait_for(lambda: served_rcvbufs(t.port, "127.0.0.1") == [2 * BUDGET]), served_rcvbufs(t.port)


def t_descs(i, src: np.ndarray):
    return i.get_xfer_descs(np.array([[src.ctypes.data, src.nbytes, 0]], dtype=np.uint64))


@pytest.mark.parametrize("setting", [None, "off", 0])
def test_default_auto_and_off_leave_a_few_connections_to_the_kernel(agents, setting):
    # The default ("auto") starts a rail's shares at 16 data connections only; "off"/0 never.
    t = agents("fanin-t0", {} if setting is None else {"fan_in_window": setting})
    t.register_memory(np.zeros(1 << 20, dtype=np.uint8))
    connected(agents, t, 2)
    bufs = wait_for(lambda: served_rcvbufs(t.port) if len(served_rcvbufs(t.port)) == 2 else [])
    assert len(bufs) == 2
    # No share was set: an idle accepted socket keeps the kernel's initial receive buffer
    # (net.ipv4.tcp_rmem's default, which autotuning grows only under traffic).
    default = int(open("/proc/sys/net/ipv4/tcp_rmem").read().split()[1])
    assert bufs == [default, default], bufs


def test_auto_starts_the_shares_at_16_connections_on_a_rail(agents):
    # One initiator with 16 connections per rail: the rail (here the loopback listener, whose
    # speed is unknown) reaches the threshold, and every connection gets 2 MiB / 16 = 128 KiB
    # (a buffer of 128 KiB, which the kernel doubles and which stays under a stock rmem_max).
    t = agents("fanin-ta")
    t.register_memory(np.zeros(1 << 20, dtype=np.uint8))
    i = agents("fanin-ia", {"timeout": 5.0, "connections": 16})
    i.fetch_remote_metadata(t.name, "127.0.0.1", t.port)
    assert wait_for(lambda: i.check_remote_metadata(t.name))
    i.make_connection(t.name)
    want = 2 * ((2 << 20) // 16)
    assert wait_for(lambda: sorted(served_rcvbufs(t.port))[-16:] == [want] * 16, 10.0), served_rcvbufs(t.port)


@pytest.mark.parametrize("bad", [-1.0, 2e6])
def test_a_bad_serve_spin_is_refused_clearly(agents, bad):
    with pytest.raises(ValueError, match="serve_spin_us"):
        agents("spin-bad", {"serve_spin_us": bad})


@pytest.mark.parametrize("bad", ["x", "2Q", -1, 1.5, True])
def test_a_bad_fan_in_window_is_refused_clearly(agents, bad):
    with pytest.raises(ValueError, match="fan_in_window"):
        agents("fanin-bad", {"fan_in_window": bad})
