"""Hostile peers against the serving loop (issue 33), with the raw client (tests/rawpeer.py).

GPU regions live on the stand-in device (tests/test_gpu_staging.py), so the staged paths run in CI.
Every request must be answered, or the connection closed, within a bound: a socket timeout here is
a wedged serving thread.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import numpy as np
import pytest

import rawpeer
from conftest import engine_available

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

if engine_available():
    import multirail
    from multirail.gpu import DeviceBuffer

ANSWER_S = 5.0


def _regions(t: Any, *bufs: Any) -> list[dict]:
    """The exported regions of `t` whose base is each buffer's address, in that order."""
    regs = rawpeer.parse_regions(t.get_agent_metadata())
    addrs = [b.addr if isinstance(b, DeviceBuffer) else b.ctypes.data for b in bufs]
    return [next(r for r in regs if r["base"] == a) for a in addrs]


def _ask(s: socket.socket, data: bytes, req: int) -> tuple[str, int]:
    """Send one request and read its answer: (status, bulk_len); the bulk bytes are read too."""
    s.sendall(data)
    kind, got, body = rawpeer.read_frame(s)
    assert (kind, got) == (rawpeer.RESP, req), (kind, got, body)
    status, bulk, _ = rawpeer.parse_status(body)
    if bulk:
        rawpeer.recv_exact(s, bulk)
    return status, bulk


@pytest.fixture
def gpu_target() -> Any:
    t = multirail.Agent("target", {"gpu": "standin", "timeout": ANSWER_S})
    g = DeviceBuffer(4096, kind="standin")
    h = np.zeros(4096, np.uint8)
    t.register_memory(g)
    t.register_memory(h)
    yield t, g, h
    t.close()


def test_zero_length_gpu_requests_leave_the_connection_serving(gpu_target: Any) -> None:
    """H1/L3: a zero-length WRITE into a GPU region used to leave the fence lock taken, so the next
    host WRITE on the connection was never answered; a zero-length GPU READ was never answered."""
    t, g, h = gpu_target
    G, H = _regions(t, g, h)
    s = rawpeer.connect(t.port)
    s.settimeout(ANSWER_S)
    try:
        assert _ask(s, rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(G["id"], G["key"], 0, 0), 1), 1) == ("Ok", 0)
        assert _ask(s, rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(H["id"], H["key"], 0, 1), 2) + b"x", 2) == ("Ok", 0)
        assert h[0] == ord("x")
        assert _ask(s, rawpeer.frame(rawpeer.READ_REQ, rawpeer.op_body(G["id"], G["key"], 8, 0), 3), 3) == ("Ok", 0)
        # A zero-length READ behind a staged one (the read-ahead path) is answered too, in order.
        s.sendall(rawpeer.frame(rawpeer.READ_REQ, rawpeer.op_body(G["id"], G["key"], 0, 16), 4)
                  + rawpeer.frame(rawpeer.READ_REQ, rawpeer.op_body(G["id"], G["key"], 0, 0), 5))
        for req, n in ((4, 16), (5, 0)):
            kind, got, body = rawpeer.read_frame(s)
            assert (kind, got, rawpeer.parse_status(body)[:2]) == (rawpeer.RESP, req, ("Ok", n))
            rawpeer.recv_exact(s, n)
        # A GPU write, then a zero-length one, then a host write: all answered in order.
        s.sendall(rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(G["id"], G["key"], 0, 4), 6) + b"abcd"
                  + rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(G["id"], G["key"], 4, 0), 7)
                  + rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(H["id"], H["key"], 1, 1), 8) + b"y")
        for req in (6, 7, 8):
            kind, got, body = rawpeer.read_frame(s)
            assert (kind, got, rawpeer.parse_status(body)[0]) == (rawpeer.RESP, req, "Ok")
        assert bytes(g.to_host()[:4]) == b"abcd" and h[1] == ord("y")
        assert _ask(s, rawpeer.frame(rawpeer.PING, b"", 9), 9) == ("Ok", 0)
    finally:
        s.close()


def test_fences_after_a_zero_length_gpu_write_are_answered(gpu_target: Any) -> None:
    """H1: a Fence naming a connection that wrote zero bytes into a GPU region (from another
    connection, or from itself) returns; the agent then closes without waiting on a wedged thread."""
    t, g, h = gpu_target
    G, _ = _regions(t, g, h)
    ids = [os.urandom(16), os.urandom(16)]
    a, b = (rawpeer.connect(t.port, name="raw", nonce=n) for n in ids)
    for s in (a, b):
        s.settimeout(ANSWER_S)
        assert _ask(s, rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(G["id"], G["key"], 0, 0), 1), 1) == ("Ok", 0)
    try:
        other = rawpeer.connect(t.port, name="raw")
        other.settimeout(ANSWER_S)
        assert _ask(other, rawpeer.frame(rawpeer.FENCE, rawpeer.fence_body([ids[0]]), 2), 2) == ("Ok", 0)
        other.close()
        # A self-fence: answered, or the connection closed (it fenced itself), never silence.
        b.sendall(rawpeer.frame(rawpeer.FENCE, rawpeer.fence_body([ids[1]]), 3))
        try:
            kind, req, body = rawpeer.read_frame(b)
            assert (kind, req) == (rawpeer.RESP, 3), (kind, req, body)
        except (ConnectionError, OSError) as e:
            assert not isinstance(e, socket.timeout), "self-fence never answered"
    finally:
        a.close()
        b.close()
    t0 = time.monotonic()
    t.close()
    assert time.monotonic() - t0 < 4.0, "close() waited on a serving thread"
