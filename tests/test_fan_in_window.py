"""`AgentConfig.fan_in_window`: a target splits a rail's receive window among the data
connections it accepted on that rail, and regrows the others' shares when one leaves
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


def served_rcvbufs(port: int) -> list[int]:
    """The receive buffer (skmem rb) of every established socket whose local port is `port`."""
    out = subprocess.run(["ss", "-tmnH", "state", "established", f"( sport = :{port} )"],
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
