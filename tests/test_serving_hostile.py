"""Hostile peers against the serving loop (issue 33), with the raw client (tests/rawpeer.py).

GPU regions live on the stand-in device (tests/test_gpu_staging.py), so the staged paths run in CI.
Every request must be answered, or the connection closed, within a bound: a socket timeout here is
a wedged serving thread.
"""

from __future__ import annotations

import os
import socket
import struct
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


def test_overlapping_vectored_gpu_write_entries_are_refused(gpu_target: Any) -> None:
    """Issue 33: a vectored WRITE into GPU memory goes to one batched copy (one gather-kernel
    launch on CUDA), whose pieces land in no order, so overlapping entries left the bytes they
    share undefined. They are refused (Malformed, naming the bytes), nothing written, the payload
    drained; into host memory they apply in entry order (the later wins)."""
    t, g, h = gpu_target
    G, H = _regions(t, g, h)
    before = bytes(g.to_host()[:64])
    s = rawpeer.connect(t.port)
    s.settimeout(ANSWER_S)
    try:
        for req, pieces in ((1, [(0, 16, 1, 0), (8, 8, 1, 0)]), (2, [(40, 4, 1, 0), (0, 4, 4, 16), (33, 2, 1, 0)])):
            body = rawpeer.vec_body(G["id"], G["key"], pieces)
            payload = bytes(range(1, 1 + sum(n * k for _, n, k, _ in pieces)))
            s.sendall(rawpeer.frame(rawpeer.WRITE_VREQ, body, req) + payload)
            kind, got, resp = rawpeer.read_frame(s)
            status, _, msg = rawpeer.parse_status(resp)
            assert (kind, got, status) == (rawpeer.RESP, req, "Malformed"), (kind, got, status, msg)
            assert "overlap" in msg, msg
        assert bytes(g.to_host()[:64]) == before
        # The stream stayed in step: disjoint entries, out of order, land where they name.
        body = rawpeer.vec_body(G["id"], G["key"], [(16, 4, 1, 0), (0, 4, 1, 0)])
        assert _ask(s, rawpeer.frame(rawpeer.WRITE_VREQ, body, 3) + b"wxyzabcd", 3) == ("Ok", 0)
        assert bytes(g.to_host()[:20]) == b"abcd" + before[4:16] + b"wxyz"
        body = rawpeer.vec_body(H["id"], H["key"], [(0, 4, 1, 0), (2, 4, 1, 0)])
        assert _ask(s, rawpeer.frame(rawpeer.WRITE_VREQ, body, 4) + b"AAAABBBB", 4) == ("Ok", 0)
        assert bytes(h[:6]) == b"AABBBB"
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


def test_a_peer_that_stops_reading_gpu_write_answers_loses_the_connection_in_time() -> None:
    """A peer that pipelines GPU WRITEs and never reads the answers used to keep its serving
    thread (with the fence lock and the pinned staging pool) until a fence or close(): the answers
    of landed GPU WRITEs waited for room on the socket without the request timeout. With one
    authenticated slot, the next peer is let in once the server gave up on the first."""
    t = multirail.Agent("target", {"gpu": "standin", "timeout": 2.0, "max_connections": 1})
    g = DeviceBuffer(4096, kind="standin")
    t.register_memory(g)
    (G,) = _regions(t, g)
    a = rawpeer.connect(t.port)
    try:
        blob = b"".join(rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(G["id"], G["key"], 0, 1), k + 1) + b"x"
                        for k in range(5000))
        a.settimeout(1.0)
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):  # the server stops reading once its answers have no room
            while time.monotonic() - t0 < 60:
                a.sendall(blob)
        deadline = time.monotonic() + 20
        while True:
            b = rawpeer.connect(t.port, name="next", welcome=False)
            b.settimeout(ANSWER_S)
            kind, _, body = rawpeer.read_frame(b)
            b.close()
            if kind == rawpeer.WELCOME:
                break
            assert kind == rawpeer.ERROR and rawpeer.parse_status(body)[0] == "Busy", body
            assert time.monotonic() < deadline, "the connection that stopped reading still holds its slot"
            time.sleep(0.5)
    finally:
        a.close()
        t.close()


# ------------------------------------------------------------------ MetaPut (H2)

def _renamed(blob: bytes, name: str) -> bytes:
    """A metadata blob with its agent name replaced (schema in docs/PROTOCOL.md)."""
    (n,) = struct.unpack_from("<H", blob, 6)
    nb = name.encode()
    return blob[:6] + struct.pack("<H", len(nb)) + nb + blob[8 + n:]


def _meta_put(port: int, name: str, blob: bytes, role: int = 1) -> tuple[str, str]:
    s = rawpeer.connect(port, name=name, role=role)
    s.settimeout(ANSWER_S)
    try:
        s.sendall(rawpeer.frame(rawpeer.META_PUT, blob, 7))
        kind, req, body = rawpeer.read_frame(s)
        assert (kind, req) == (rawpeer.RESP, 7), (kind, req, body)
        status, _, msg = rawpeer.parse_status(body)
        return status, msg
    finally:
        s.close()


def test_metaput_only_where_the_application_opted_in_and_on_control_connections() -> None:
    plain = multirail.Agent("plain")
    opted = multirail.Agent("opted", {"accept_metaput": True})
    try:
        blob = _renamed(plain.get_agent_metadata(), "raw")
        status, msg = _meta_put(plain.port, "raw", blob)
        assert status == "Unexpected" and "accept_metaput" in msg
        assert not plain.check_remote_metadata("raw")
        status, msg = _meta_put(opted.port, "raw", blob, role=2)  # a data connection (any rail port)
        assert status == "Unexpected" and "control" in msg
        assert not opted.check_remote_metadata("raw")
        assert _meta_put(opted.port, "raw", blob) == ("Ok", "")
        assert opted.check_remote_metadata("raw")
        # The name must be the connection's own.
        status, _ = _meta_put(opted.port, "other", blob)
        assert status == "Unexpected" and not opted.check_remote_metadata("other")
    finally:
        opted.close()
        plain.close()


def test_metaput_cannot_replace_a_peer_the_application_installed() -> None:
    """H2: a MetaPut naming an installed peer used to replace it (redirecting later transfers)."""
    t = multirail.Agent("target")
    impostor = multirail.Agent("impostor")
    i = multirail.Agent("initiator", {"accept_metaput": True, "timeout": 5.0})
    try:
        real, fake = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        t.register_memory(real)
        impostor.register_memory(fake)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        status, msg = _meta_put(i.port, "target", _renamed(impostor.get_agent_metadata(), "target"))
        assert status == "Unexpected" and "installed by the application" in msg
        src = np.full(4096, 0x5A, np.uint8)
        i.register_memory(src)
        h = i.initialize_xfer("WRITE", [src], [(real.ctypes.data, 4096, 0)], "target")
        i.transfer(h)
        i.wait(h, 10)
        i.release_xfer_handle(h)
        assert (real == 0x5A).all() and (fake == 0).all()
    finally:
        i.close()
        impostor.close()
        t.close()


def test_metaput_cannot_change_the_regions_of_a_peer_the_application_installed() -> None:
    """Metadata of an installed peer's own life (same incarnation and rails) only updates its
    regions, in place (issue 36 item 6). From MetaPut it must not: the peer came from the
    application (`Peer::same_life` compares the origin), so the push is refused and the
    application's regions stay (a WRITE still lands)."""
    t = multirail.Agent("target")
    i = multirail.Agent("initiator", {"accept_metaput": True, "timeout": 5.0})
    try:
        bare = t.get_agent_metadata()  # the target's own life, before it exported a region
        real = np.zeros(4096, np.uint8)
        t.register_memory(real)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        status, msg = _meta_put(i.port, "target", bare)
        assert status == "Unexpected" and "installed by the application" in msg, (status, msg)
        src = np.full(4096, 0x5A, np.uint8)
        i.register_memory(src)
        h = i.initialize_xfer("WRITE", [src], [(real.ctypes.data, 4096, 0)], "target")
        i.transfer(h)
        i.wait(h, 10)
        i.release_xfer_handle(h)
        assert (real == 0x5A).all()
    finally:
        i.close()
        t.close()


def test_peer_table_is_bounded() -> None:
    a = multirail.Agent("a", {"accept_metaput": True, "max_peers": 3})
    try:
        blob = a.get_agent_metadata()
        for k in range(3):
            assert _meta_put(a.port, f"p{k}", _renamed(blob, f"p{k}")) == ("Ok", "")
        status, msg = _meta_put(a.port, "p3", _renamed(blob, "p3"))
        assert status == "Busy" and "max_peers" in msg
        # A known name may still be updated.
        assert _meta_put(a.port, "p1", _renamed(blob, "p1")) == ("Ok", "")
    finally:
        a.close()


def test_peers_pushed_from_the_wire_never_keep_the_applications_out() -> None:
    """A table filled by MetaPut (any client, where accepted) used to refuse the application's own
    installs (fetch_remote_metadata, add_remote_agent, NIXL): now they take a pushed peer's place;
    the application's own installs alone hit the cap."""
    a = multirail.Agent("a", {"accept_metaput": True, "max_peers": 3})
    try:
        blob = a.get_agent_metadata()
        for k in range(3):
            assert _meta_put(a.port, f"p{k}", _renamed(blob, f"p{k}")) == ("Ok", "")
        for k in range(3):
            a.add_remote_agent(_renamed(blob, f"app{k}"))
        assert all(a.check_remote_metadata(f"app{k}") for k in range(3))
        assert not any(a.check_remote_metadata(f"p{k}") for k in range(3))
        with pytest.raises(multirail.errors.MultirailError, match="max_peers"):
            a.add_remote_agent(_renamed(blob, "app3"))
        status, msg = _meta_put(a.port, "p9", _renamed(blob, "p9"))
        assert status == "Busy" and "max_peers" in msg
    finally:
        a.close()


# ------------------------------------------------------------------ startup warning

def test_an_agent_open_to_the_network_without_a_secret_says_so(caplog: Any) -> None:
    caplog.set_level("WARNING", logger="multirail")
    a = multirail.Agent("loud", {"host": "0.0.0.0"})
    a.close()
    assert any("without auth_secret" in r.getMessage() and "read and write" in r.getMessage() for r in caplog.records)
    caplog.clear()
    for cfg in ({"host": "127.0.0.1"}, {"host": "0.0.0.0", "auth_secret": "s3cret"}):
        b = multirail.Agent("quiet", cfg)
        b.close()
    assert not [r for r in caplog.records if "without auth_secret" in r.getMessage()]


# ------------------------------------------------------------------ before authentication (item 5)

def test_a_large_frame_before_the_handshake_is_refused_before_its_body() -> None:
    """Only a Hello's header is accepted before the handshake: a 16 MiB MetaPut header used to be
    waited on (and its body allocated) until the handshake timed out."""
    a = multirail.Agent("preauth", {"timeout": 10.0})
    s = socket.create_connection(("127.0.0.1", a.port), timeout=ANSWER_S)
    try:
        s.sendall(rawpeer.header(rawpeer.META_PUT, 16 << 20))
        kind, _, body = rawpeer.read_frame(s)
        assert kind == rawpeer.ERROR and rawpeer.parse_status(body)[0] == "Unexpected", body
    finally:
        s.close()
        a.close()


def test_unauthenticated_sockets_take_no_slot_of_authenticated_peers() -> None:
    a = multirail.Agent("slots", {"max_connections": 2, "max_handshakes": 2, "timeout": 10.0})
    idle: list[socket.socket] = []
    good: list[socket.socket] = []
    try:
        for _ in range(6):  # say nothing: they sit in their handshake
            idle.append(socket.create_connection(("127.0.0.1", a.port), timeout=ANSWER_S))
        time.sleep(0.3)
        for k in range(2):
            g = rawpeer.connect(a.port, name=f"g{k}")
            g.settimeout(ANSWER_S)
            good.append(g)
            assert _ask(g, rawpeer.frame(rawpeer.PING, b"", 1), 1) == ("Ok", 0)
        # Authenticated slots are max_connections: a third authenticated connection is refused.
        s = rawpeer.connect(a.port, name="g2", welcome=False)
        good.append(s)
        kind, _, body = rawpeer.read_frame(s)
        assert kind == rawpeer.ERROR and rawpeer.parse_status(body)[0] == "Busy", body
    finally:
        for s in idle + good:
            s.close()
        a.close()


def test_one_peer_cannot_fill_the_notification_inbox_for_the_others() -> None:
    t = multirail.Agent("inbox")
    try:
        noisy = rawpeer.connect(t.port, name="noisy", role=1)
        noisy.settimeout(ANSWER_S)
        mib = b"n" * (1 << 20)
        statuses = [_ask(noisy, rawpeer.frame(rawpeer.NOTIF, mib, k), k)[0] for k in range(65)]
        assert statuses == ["Ok"] * 64 + ["Busy"]
        quiet = rawpeer.connect(t.port, name="quiet", role=1)
        quiet.settimeout(ANSWER_S)
        assert _ask(quiet, rawpeer.frame(rawpeer.NOTIF, b"layer 0", 1), 1) == ("Ok", 0)
        got = t.get_new_notifs()
        assert len(got["noisy"]) == 64 and got["quiet"] == [b"layer 0"]
    finally:
        t.close()


# ------------------------------------------------------------------ random frame sequences

def _overlap(pieces: list[tuple[int, int, int, int]]) -> bool:
    """Whether two ranges of these vectored pieces (offset, len, count, stride) share a byte."""
    ranges = sorted((o + j * st, ln) for o, ln, c, st in pieces for j in range(c))
    return any(b < a + n for (a, n), (b, _) in zip(ranges, ranges[1:]))


def _random_request(rng: Any, regions: list[dict], req: int) -> tuple[bytes, tuple]:
    """One random request (zero lengths, out of bounds, wrong keys, vectored and strided entries,
    pings, fences of unknown connections, a MetaPut on a data connection) and what its answer must
    be: (kind, req, ok, region id, pieces, payload)."""
    n = 4096
    reg = rng.choice(regions)
    key = reg["key"] if rng.random() > 0.05 else os.urandom(16)

    def span() -> tuple[int, int]:
        c = rng.random()
        if c < 0.15:
            return rng.randint(0, n), 0
        if c < 0.2:
            return rng.randint(n - 10, n + 10), rng.randint(0, 20)
        off = rng.randint(0, n - 1)
        return off, rng.randint(1, min(300, n - off))

    k = rng.random()
    if k < 0.5:
        off, ln = span()
        ok = key == reg["key"] and off + ln <= n
        if k < 0.25:
            data = rng.randbytes(ln)
            return (rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(reg["id"], key, off, ln), req) + data,
                    ("w", req, ok, reg["id"], [(off, ln, 1, ln)], data))
        return rawpeer.frame(rawpeer.READ_REQ, rawpeer.op_body(reg["id"], key, off, ln), req), ("r", req, ok, reg["id"], [(off, ln, 1, ln)], b"")
    if k < 0.85:
        pieces = []
        for _ in range(rng.randint(1, 4)):
            ln, cnt = rng.randint(1, 64), rng.choice([1, 1, 2, 3])
            off = rng.randint(0, n - 1) if rng.random() > 0.1 else rng.randint(n - 100, n + 10)
            pieces.append((off, ln, cnt, ln + rng.randint(0, 64) if cnt > 1 else ln))
        ok = key == reg["key"] and all(o + st * (c - 1) + ln <= n for o, ln, c, st in pieces)
        body = rawpeer.vec_body(reg["id"], key, pieces)
        if k < 0.65:
            # Into GPU memory, entries that overlap are refused (one launch lands them in no order).
            ok = ok and not (reg["mem"] == 1 and _overlap(pieces))
            data = rng.randbytes(sum(ln * c for _, ln, c, _ in pieces))
            return rawpeer.frame(rawpeer.WRITE_VREQ, body, req) + data, ("w", req, ok, reg["id"], pieces, data)
        return rawpeer.frame(rawpeer.READ_VREQ, body, req), ("r", req, ok, reg["id"], pieces, b"")
    if k < 0.9:
        return rawpeer.frame(rawpeer.PING, b"", req), ("p", req, True, 0, [], b"")
    if k < 0.95:
        return rawpeer.frame(rawpeer.FENCE, rawpeer.fence_body([os.urandom(16)]), req), ("p", req, True, 0, [], b"")
    return rawpeer.frame(rawpeer.META_PUT, b"xx", req), ("p", req, False, 0, [], b"")


@pytest.mark.parametrize("seed", range(3))
def test_random_frame_sequences_are_answered_in_order(seed: int) -> None:
    """Issue 33's stateful check: random pipelined request sequences on one connection into a GPU
    region (stand-in) and a host region are each answered, in order, within the timeout, and READs
    return what earlier WRITEs left (a shadow copy; a GPU WRITE whose entries overlap is refused,
    a host one applies them in entry order); a self-fence then ends it."""
    import random

    rng = random.Random(seed)
    t = multirail.Agent("target", {"gpu": "standin", "timeout": ANSWER_S})
    g, h = DeviceBuffer(4096, kind="standin"), np.zeros(4096, np.uint8)
    t.register_memory(g)
    t.register_memory(h)
    G, H = _regions(t, g, h)
    shadow = {G["id"]: np.zeros(4096, np.int16), H["id"]: np.zeros(4096, np.int16)}
    nonce = os.urandom(16)
    s = rawpeer.connect(t.port, nonce=nonce)
    s.settimeout(ANSWER_S)
    req = 0
    try:
        while req < 200:
            out, expect = b"", []
            for _ in range(rng.randint(1, 8)):
                req += 1
                data, e = _random_request(rng, [G, H], req)
                out += data
                expect.append(e)
            s.sendall(out)
            for kind, rq, ok, rid, pieces, data in expect:
                fk, got, body = rawpeer.read_frame(s)
                assert (fk, got) == (rawpeer.RESP, rq), (fk, got, rq, body)
                status, bulk, msg = rawpeer.parse_status(body)
                assert (status == "Ok") == ok, (rq, kind, status, msg, pieces)
                ranges = [(o + j * st, ln) for o, ln, c, st in pieces for j in range(c)]
                if kind == "r" and ok:
                    got_b = np.frombuffer(rawpeer.recv_exact(s, bulk), np.uint8).astype(np.int16)
                    want = np.concatenate([shadow[rid][a:a + ln] for a, ln in ranges]) if ranges else np.zeros(0, np.int16)
                    assert (want == got_b).all(), (rq, pieces)
                elif kind == "w" and ok:
                    p = 0
                    for a, ln in ranges:
                        shadow[rid][a:a + ln] = np.frombuffer(data[p:p + ln], np.uint8)
                        p += ln
        s.sendall(rawpeer.frame(rawpeer.FENCE, rawpeer.fence_body([nonce]), req + 1))
        try:
            assert rawpeer.read_frame(s)[:2] == (rawpeer.RESP, req + 1)
        except (ConnectionError, OSError) as e:
            assert not isinstance(e, socket.timeout), "self-fence never answered"
    finally:
        s.close()
        t0 = time.monotonic()
        t.close()
        assert time.monotonic() - t0 < 4.0, "close() waited on a serving thread"
