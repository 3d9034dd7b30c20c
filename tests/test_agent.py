"""The Python engine API: registration, descriptors, metadata, READ/WRITE, notifications,
prepared and reusable handles, asyncio, and every bad input issue 2 lists. Each bad input
checks the specific exception, that the target keeps serving, and that target memory outside
valid requests is untouched."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Callable

import numpy as np
import pytest

from conftest import engine_available

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

if engine_available():
    import multirail
    from multirail import Agent, XferState, errors

import rawpeer

MiB = 1 << 20


@pytest.fixture
def pair():
    t = Agent("target")
    i = Agent("initiator", {"timeout": 5.0, "stall_timeout": 1.0})
    yield t, i
    i.close()
    t.close()


def pattern(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def loaded(t, i, src: np.ndarray, dst: np.ndarray, **kw):
    t.register_memory(src, **kw)
    i.register_memory(dst)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)


def fetch_and_await_metadata(i, t, timeout: float = 10.0, name: str = "target") -> None:
    """Fetch the metadata of `t` (agent `name`) and wait (bounded) until `i` holds it."""
    i.fetch_remote_metadata(name, "127.0.0.1", t.port)
    deadline = time.monotonic() + timeout
    while not i.check_remote_metadata(name):
        assert time.monotonic() < deadline, "metadata never arrived"
        time.sleep(0.01)


def test_read_and_write_round_trip_byte_exact(pair):
    t, i = pair
    src, dst = pattern(8 * MiB + 123), np.zeros(8 * MiB + 123, np.uint8)
    loaded(t, i, src, dst)
    h = i.initialize_xfer("READ", [dst], [src], "target")
    assert i.transfer(h) in (XferState.IN_PROGRESS, XferState.DONE)
    i.wait(h, 10)
    assert i.check_xfer_state(h) == XferState.DONE
    assert np.array_equal(dst, src)
    dst[:] = pattern(dst.size, 2)
    w = i.initialize_xfer("WRITE", [dst], [src], "target")
    i.transfer(w)
    i.wait(w, 10)
    assert np.array_equal(src, dst)


def test_differently_segmented_lists_and_nx3_arrays(pair):
    t, i = pair
    src, dst = pattern(1 * MiB), np.zeros(1 * MiB, np.uint8)
    loaded(t, i, src, dst)
    sa, da = src.ctypes.data, dst.ctypes.data
    # Local: 4 pieces of 256 KiB; remote: 3 uneven pieces. Same total.
    local = np.array([(da + k * (256 << 10), 256 << 10, 0) for k in range(4)], dtype=np.uint64)
    remote = [(sa, 100_000, 0), (sa + 100_000, 600_000, 0), (sa + 700_000, MiB - 700_000, 0)]
    h = i.initialize_xfer("READ", i.get_xfer_descs(local), i.get_xfer_descs(remote), "target")
    i.transfer(h)
    i.wait(h, 10)
    assert np.array_equal(dst, src)


def test_many_descriptors_vectorised(pair):
    t, i = pair
    n, sz = 4096, 256
    src, dst = pattern(n * sz), np.zeros(n * sz, np.uint8)
    loaded(t, i, src, dst)
    offs = np.arange(n, dtype=np.uint64) * sz
    perm = np.random.default_rng(3).permutation(n).astype(np.uint64)
    local = np.stack([dst.ctypes.data + offs, np.full(n, sz, np.uint64), np.zeros(n, np.uint64)], axis=1)
    remote = np.stack([src.ctypes.data + perm * sz, np.full(n, sz, np.uint64), np.zeros(n, np.uint64)], axis=1)
    h = i.initialize_xfer("READ", i.get_xfer_descs(local), i.get_xfer_descs(remote), "target")
    i.transfer(h)
    i.wait(h, 10)
    expect = src.reshape(n, sz)[perm.astype(np.int64)].reshape(-1)
    assert np.array_equal(dst, expect)


def test_reusable_and_prepped_handles(pair):
    t, i = pair
    src, dst = pattern(64 << 10), np.zeros(64 << 10, np.uint8)
    loaded(t, i, src, dst)
    h = i.initialize_xfer("READ", [dst], [src], "target")
    for k in range(5):
        src[:] = k
        i.transfer(h)
        i.wait(h, 5)
        assert (dst == k).all()
    blocks = 16
    bs = src.size // blocks
    lp = i.prep_xfer_dlist("", [(dst.ctypes.data + b * bs, bs, 0) for b in range(blocks)])
    rp = i.prep_xfer_dlist("target", [(src.ctypes.data + b * bs, bs, 0) for b in range(blocks)])
    src[:] = pattern(src.size, 9)
    dst[:] = 0
    ph = i.make_prepped_xfer("READ", lp, [0, 1, 2], rp, [5, 6, 7])
    i.transfer(ph)
    i.wait(ph, 5)
    assert np.array_equal(dst[: 3 * bs], src[5 * bs: 8 * bs])
    with pytest.raises(errors.InvalidArgumentError):
        i.make_prepped_xfer("READ", lp, [99], rp, [0])


def test_notif_arrives_after_data_and_send_notif(pair):
    t, i = pair
    src, dst = np.zeros(4 * MiB, np.uint8), pattern(4 * MiB, 5)
    loaded(t, i, src, dst)
    w = i.initialize_xfer("WRITE", [dst], [src], "target", b"kv-ready")
    i.transfer(w)
    i.wait(w, 10)
    notifs = t.get_new_notifs()
    assert notifs == {"initiator": [b"kv-ready"]}
    # The notification was delivered only after the data: the memory is already complete.
    assert np.array_equal(src, dst)
    i.send_notif("target", b"hello")
    assert t.get_new_notifs() == {"initiator": [b"hello"]}
    assert t.get_new_notifs() == {}


def test_get_new_notifs_sleeps_until_a_notification_comes_and_close_ends_the_wait(pair):
    """`get_new_notifs(timeout)` waits in the engine (GIL released) and returns as the
    notification lands, not at its timeout; with none coming it returns {} after the timeout;
    closing the agent wakes a waiter at once."""
    t, i = pair
    src, dst = pattern(1 * MiB, 6), np.zeros(1 * MiB, np.uint8)
    loaded(t, i, dst, src)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append((t.get_new_notifs(60.0), time.monotonic())))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive(), "returned before any notification came"
    # The transfer needs the GIL on this thread while the other one waits.
    sent = time.monotonic()
    w = i.initialize_xfer("WRITE", [src], [dst], "target", b"layer-79")
    i.transfer(w)
    i.wait(w, 10)
    waiter.join(30)
    assert not waiter.is_alive(), "the wait did not end when the notification came"
    notifs, woke = got[0]
    assert notifs == {"initiator": [b"layer-79"]}
    assert woke - sent < 30, "woke at its timeout, not at the notification"
    assert np.array_equal(src, dst), "the notification came before its data"

    t0 = time.monotonic()
    assert t.get_new_notifs(0.3) == {}
    assert time.monotonic() - t0 >= 0.29
    with pytest.raises(ValueError):
        t.get_new_notifs(float("nan"))

    got.clear()
    waiter = threading.Thread(target=lambda: got.append(t.get_new_notifs(60.0)))
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    t.close()
    waiter.join(30)
    assert not waiter.is_alive() and got == [{}]
    assert time.monotonic() - t0 < 30, "close() did not wake the waiter"


def test_notifications_not_taken_are_bounded_and_the_next_is_refused_clearly(pair):
    """The target queues at most 64 MiB (or 65,536) of notifications the application has not
    taken; beyond that a peer's notification is refused (Busy), never grown without bound.
    Nothing queued is lost, and taking them makes room again. A send_notif refused fails; a
    WRITE's data still lands and its transfer completes (issue 36 item 7: it failed before),
    its notification held by the initiator and delivered once there is room."""
    t, i = pair
    src, dst = pattern(1 * MiB, 8), np.zeros(1 * MiB, np.uint8)
    loaded(t, i, dst, src)
    for k in range(64):
        i.send_notif("target", bytes([k]) * MiB)
    with pytest.raises(errors.TransferError, match="notification queue full"):
        i.send_notif("target", b"one too many")
    w = i.initialize_xfer("WRITE", [src], [dst], "target", b"late")
    i.transfer(w)
    i.wait(w, 10)
    assert np.array_equal(src, dst), "the WRITE's data should have landed"
    got = t.get_new_notifs()["initiator"]
    assert [m[:1] * len(m) == m and len(m) == MiB for m in got] == [True] * 64
    assert [m[0] for m in got] == list(range(64)), "lost or reordered"
    i.send_notif("target", b"after")
    later: list[bytes] = []
    deadline = time.monotonic() + 20
    while sorted(later) != [b"after", b"late"] and time.monotonic() < deadline:
        later += t.get_new_notifs().get("initiator", [])
        time.sleep(0.005)
    assert sorted(later) == [b"after", b"late"], later


@contextlib.contextmanager
def notifying(sender: str, receiver: str, sender_cfg: dict | None = None, receiver_cfg: dict | None = None):
    """Two agents, `sender` holding `receiver`'s metadata, with one notification through (the
    control connection is open); both closed on the way out."""
    s, r = Agent(sender, sender_cfg or {}), Agent(receiver, receiver_cfg or {})
    try:
        fetch_and_await_metadata(s, r, name=receiver)
        s.send_notif(receiver, b"first")
        assert r.get_new_notifs(5.0) == {sender: [b"first"]}
        yield s, r
    finally:
        r.close()
        s.close()


def test_a_notification_to_a_peer_that_closed_fails_at_once():
    """Every rail of a peer that closed refuses the connection: send_notif says so at once
    (PeerLostError), where it used to retry refused dials in a loop for the whole `timeout`,
    taking a core all the while."""
    with notifying("t-gone", "i-gone", sender_cfg={"timeout": 20.0}) as (t, i):
        i.close()
        t0, c0 = time.monotonic(), time.process_time()
        with pytest.raises(errors.PeerLostError, match="every rail refused the connection"):
            t.send_notif("i-gone", b"second")
        assert time.monotonic() - t0 < 10, "waited for the timeout (20 s) instead of failing at once"
        assert time.process_time() - c0 < 2


def test_a_control_connection_does_not_busy_poll_between_notifications():
    """Only data connections spin for their next request. A control connection's serving
    thread spun up to `serve_spin_us` after every notification: ~100 us of CPU per layer of a kv
    request, on the cores the data path needs (issue 22, session 15). With a 300 ms budget, five
    notifications 100 ms apart kept it spinning for ~0.5 s of CPU; now it sleeps in the kernel."""
    with notifying("i-spin", "t-spin", receiver_cfg={"serve_spin_us": 300000.0}) as (i, t):
        time.sleep(1.0)  # the data connections' first (idle) spins run out meanwhile
        c0 = time.process_time()
        for k in range(5):
            i.send_notif("t-spin", b"n%d" % k)
            time.sleep(0.1)
        used = time.process_time() - c0
        assert t.get_new_notifs(5.0) == {"i-spin": [b"n%d" % k for k in range(5)]}
        assert used < 0.2, f"the process took {used:.3f} CPU-s over 0.5 s of five notifications"


def test_many_notifications_posted_at_once_arrive_once_each_after_their_data(pair):
    """200 small WRITEs, each with its own notification, posted back to back: the notifier sends
    the ones queued meanwhile pipelined (`Link::control_batch`). Every notification arrives
    exactly once, and each transfer is DONE only once its notification was answered, so when
    the last wait returns the target already holds all of them, each after its data."""
    t, i = pair
    k, n = 200, 4096
    src, dst = pattern(k * n, 11), np.zeros(k * n, np.uint8)
    loaded(t, i, dst, src)
    hs = [i.initialize_xfer("WRITE", [(src.ctypes.data + j * n, n, 0)], [(dst.ctypes.data + j * n, n, 0)], "target",
                            f"n{j}".encode()) for j in range(k)]
    for h in hs:
        i.transfer(h)
    for h in hs:
        i.wait(h, 20)
    got = t.get_new_notifs()["initiator"]
    assert sorted(got) == sorted(f"n{j}".encode() for j in range(k)), got
    assert np.array_equal(src, dst)
    for h in hs:
        i.release_xfer_handle(h)


def test_asyncio_awaitable(pair):
    t, i = pair
    src, dst = pattern(2 * MiB), np.zeros(2 * MiB, np.uint8)
    loaded(t, i, src, dst)
    h = i.initialize_xfer("READ", [dst], [src], "target")

    async def go():
        await i.transfer_async(h, timeout=10)

    asyncio.run(go())
    assert np.array_equal(dst, src)


def test_metadata_exchange_both_ways_and_serialised_descs(pair):
    t, i = pair
    src = pattern(4096)
    reg = t.register_memory(src)
    blob = t.get_serialized_descs(reg)
    d = i.deserialize_descs(blob)
    assert d.arr.tolist() == [[src.ctypes.data, 4096, 0]] and d.mem_type == "DRAM"
    assert not i.check_remote_metadata("target")
    # A push (MetaPut) is served only by an agent that opted in (accept_metaput, issue 33).
    with pytest.raises(errors.MultirailError, match="accept_metaput"):
        t.send_local_metadata("127.0.0.1", i.port)
    assert not i.check_remote_metadata("target")
    r = Agent("receiver", {"accept_metaput": True})
    try:
        t.send_local_metadata("127.0.0.1", r.port)
        assert r.check_remote_metadata("target")
        r.remove_remote_agent("target")
        assert not r.check_remote_metadata("target")
    finally:
        r.close()
    assert i.add_remote_agent(t.get_agent_metadata()) == "target"
    with pytest.raises(errors.UnknownPeerError):
        i.remove_remote_agent("nobody")


def test_register_kinds():
    with Agent("reg") as a:
        arr = np.zeros(100, np.float32)
        ba = bytearray(64)
        r1 = a.register_memory(arr)
        r2 = a.register_memory(ba)
        r3 = a.register_memory([(arr.ctypes.data, 16, 0)])
        r4 = a.register_memory(np.array([[arr.ctypes.data, 8, 0]], dtype=np.uint64))
        assert len(r1) == len(r2) == len(r3) == len(r4) == 1
        assert r1[0] == (arr.ctypes.data, 400, 0)
        with pytest.raises(errors.InvalidArgumentError):
            a.register_memory(b"immutable")  # read-only buffer needs access="ro"
        a.register_memory(b"immutable", access="ro")
        with pytest.raises(errors.InvalidArgumentError):
            a.register_memory(np.zeros((4, 4))[:, 1])  # not contiguous
        with pytest.raises(errors.InvalidArgumentError):
            a.register_memory(object())
        for r in (r1, r2, r3, r4):
            a.deregister_memory(r)
        torch = pytest.importorskip("torch", reason="torch not installed")
        t = torch.arange(10, dtype=torch.int64)
        rt = a.register_memory(t)
        assert rt[0] == (t.data_ptr(), 80, 0)


# ------------------------------------------------------------------------ bad input

def test_unknown_peer(pair):
    t, i = pair
    dst = np.zeros(16, np.uint8)
    i.register_memory(dst)
    with pytest.raises(errors.UnknownPeerError):
        i.initialize_xfer("READ", [dst], [(1, 16, 0)], "nobody")
    with pytest.raises(errors.UnknownPeerError):
        i.send_notif("nobody", b"x")


def test_descriptors_outside_registered_regions(pair):
    t, i = pair
    src, dst = pattern(4096), np.zeros(4096, np.uint8)
    loaded(t, i, src, dst)
    with pytest.raises(errors.OutOfBoundsError):
        i.initialize_xfer("READ", [(dst.ctypes.data, 4096, 0)], [(src.ctypes.data + 1, 4096, 0)], "target")
    with pytest.raises(errors.NotRegisteredError):
        i.initialize_xfer("READ", [(dst.ctypes.data + 8, 4096, 0)], [(src.ctypes.data, 4096, 0)], "target")
    with pytest.raises(errors.InvalidArgumentError):
        i.initialize_xfer("FETCH", [dst], [src], "target")


def test_mismatched_total_lengths(pair):
    t, i = pair
    src, dst = pattern(4096), np.zeros(4096, np.uint8)
    loaded(t, i, src, dst)
    with pytest.raises(errors.LengthMismatchError):
        i.initialize_xfer("READ", [dst[:100]], [src[:99]], "target")


def _block_rows(base: int, order, bs: int) -> np.ndarray:
    """Nx3 uint64 rows: row k is block order[k] (bs bytes) of the buffer at base."""
    r = np.zeros((len(order), 3), dtype=np.uint64)
    r[:, 0] = base + np.asarray(order, dtype=np.uint64) * np.uint64(bs)
    r[:, 1] = bs
    return r


def _runs(lorder, rorder) -> int:
    """Pairs of a 1:1 block pairing once runs contiguous on both sides are merged."""
    lo, ro = np.asarray(lorder), np.asarray(rorder)
    return 1 + int(np.count_nonzero((np.diff(lo) != 1) | (np.diff(ro) != 1))) if len(lo) else 0


def test_prepare_merges_runs_contiguous_on_both_sides(pair):
    """Rows are paired in one pass that merges runs contiguous on both sides (within one
    registered region on each side): the handle has one piece per run, and moves exactly the
    bytes the rows name, READ and WRITE, contiguous or scattered."""
    t, i = pair
    n, bs = 256, 4096
    src = pattern(n * bs)
    half = n * bs // 2
    # Two adjacent regions on each side: a run is cut where it crosses from one to the other.
    t.register_memory([(src.ctypes.data, half, 0), (src.ctypes.data + half, half, 0)])
    dst = np.zeros(n * bs, np.uint8)
    i.register_memory([(dst.ctypes.data, half, 0), (dst.ctypes.data + half, half, 0)])
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    ident = np.arange(n)
    perm = np.random.default_rng(5).permutation(n)
    runs = np.concatenate([np.arange(200, 256), np.arange(0, 100), np.arange(100, 200)[::-1]])
    for lorder, rorder in ((ident, ident), (perm, perm), (ident, perm), (runs, ident), (runs, runs)):
        dst[:] = 0
        h = i.initialize_xfer("READ", i.get_xfer_descs(_block_rows(dst.ctypes.data, lorder, bs)),
                              i.get_xfer_descs(_block_rows(src.ctypes.data, rorder, bs)), "target")
        # A run crossing the middle of either buffer crosses a region boundary: one more piece.
        cross = sum(1 for k in range(n - 1) if lorder[k + 1] == lorder[k] + 1 and rorder[k + 1] == rorder[k] + 1
                    and (lorder[k + 1] * bs == half or rorder[k + 1] * bs == half))
        assert (h._h.num_pieces, h.total_bytes) == (_runs(lorder, rorder) + cross, n * bs)
        i.transfer(h)
        i.wait(h, 10)
        expect = np.empty_like(dst)
        expect.reshape(n, bs)[lorder] = src.reshape(n, bs)[rorder]
        assert np.array_equal(dst, expect)
    # WRITE, local blocks scattered, remote contiguous; a different segmentation on each side.
    out = pattern(n * bs, 9)
    i.register_memory(out)
    w = i.initialize_xfer("WRITE", i.get_xfer_descs(_block_rows(out.ctypes.data, perm, bs)),
                          [(src.ctypes.data, half, 0), (src.ctypes.data + half, half, 0)], "target")
    i.transfer(w)
    i.wait(w, 10)
    assert np.array_equal(src, out.reshape(n, bs)[perm].reshape(-1))


def test_prepare_reads_rows_in_place_even_unaligned(pair):
    """Rows are read where they are; an Nx3 uint64 array at an address that is not 8-byte
    aligned (np.frombuffer at an odd offset) still works (it is copied first)."""
    t, i = pair
    n, bs = 64, 512
    src, dst = pattern(n * bs), np.zeros(n * bs, np.uint8)
    loaded(t, i, src, dst)
    perm = np.random.default_rng(2).permutation(n)
    rows = _block_rows(dst.ctypes.data, perm, bs)
    raw = bytearray(rows.nbytes + 4)
    raw[4:] = rows.tobytes()
    unaligned = np.frombuffer(raw, dtype=np.uint64, offset=4).reshape(n, 3)
    assert unaligned.ctypes.data % 8 != 0
    h = i.initialize_xfer("READ", i.get_xfer_descs(unaligned), i.get_xfer_descs(_block_rows(src.ctypes.data, perm, bs)),
                          "target")
    i.transfer(h)
    i.wait(h, 10)
    assert np.array_equal(dst, src)


def test_prepare_errors_name_the_callers_rows_first_error_first(pair):
    """Errors name the row as given, even inside a run that would be merged, and when several
    things are wrong the first of these is reported: a local row not registered, the
    notification too large, a remote row out of bounds, a WRITE to a read-only region, totals
    that differ."""
    t, i = pair
    n, bs = 64, 4096
    src, dst = pattern(n * bs), np.zeros(n * bs, np.uint8)
    loaded(t, i, src, dst, access="ro")
    good_l, good_r = _block_rows(dst.ctypes.data, range(n), bs), _block_rows(src.ctypes.data, range(n), bs)
    bad_l, bad_r = _block_rows(dst.ctypes.data, range(1, n + 1), bs), _block_rows(src.ctypes.data, range(1, n + 1), bs)
    short_r = good_r[:-1]
    big = b"x" * ((1 << 20) + 1)

    def prep(op, lr, rr, notif=b""):
        return i.initialize_xfer(op, i.get_xfer_descs(lr), i.get_xfer_descs(rr), "target", notif)

    with pytest.raises(errors.OutOfBoundsError, match=r"remote descriptor 63 "):
        prep("READ", good_l, bad_r)
    with pytest.raises(errors.NotRegisteredError, match=r"local descriptor 63 "):
        prep("READ", bad_l, good_r)
    with pytest.raises(errors.NotRegisteredError, match=r"local descriptor 63 "):
        prep("WRITE", bad_l, bad_r[:3], big)
    with pytest.raises(errors.InvalidArgumentError, match="notification"):
        prep("WRITE", good_l, bad_r, big)
    with pytest.raises(errors.OutOfBoundsError, match=r"remote descriptor 63 "):
        prep("WRITE", good_l, bad_r)
    with pytest.raises(errors.ReadOnlyError):
        prep("WRITE", good_l, short_r)
    with pytest.raises(errors.LengthMismatchError, match=f"total {n * bs} bytes but remote descriptors total {(n - 1) * bs}"):
        prep("READ", good_l, short_r)
    # An empty row counts as a row: outside every region it is an error too, wherever it is.
    empty = np.array([[8, 0, 0]], dtype=np.uint64)
    with pytest.raises(errors.NotRegisteredError, match=r"local descriptor 64 "):
        prep("READ", np.concatenate([good_l, empty]), good_r)
    with pytest.raises(errors.OutOfBoundsError, match=r"remote descriptor 64 "):
        prep("READ", good_l, np.concatenate([good_r, empty]))
    # Empty rows inside registered memory are fine anywhere; nothing failed above for good.
    zl, zr = good_l[:1].copy(), good_r[-1:].copy()
    zl[:, 1] = zr[:, 1] = 0
    h = prep("READ", np.concatenate([zl, good_l]), np.concatenate([good_r, zr]))
    assert (h._h.num_pieces, h.total_bytes) == (1, n * bs)
    i.transfer(h)
    i.wait(h, 10)
    assert np.array_equal(dst, src)


def _tampered_meta(t, mutate) -> bytes:
    blob = bytearray(t.get_agent_metadata())
    for r in rawpeer.parse_regions(bytes(blob)):
        mutate(blob, r)
    return bytes(blob)


def _check_survivor(t, src_expected: np.ndarray):
    """A fresh, well-behaved peer still gets correct data from the target."""
    with Agent("bystander") as b:
        out = np.zeros(src_expected.size, np.uint8)
        b.register_memory(out)
        b.fetch_remote_metadata("target", "127.0.0.1", t.port)
        h = b.initialize_xfer("READ", [out], [(t_region_base(t), src_expected.size, 0)], "target")
        b.transfer(h)
        b.wait(h, 10)
        assert np.array_equal(out, src_expected)


def t_region_base(t) -> int:
    return rawpeer.parse_regions(t.get_agent_metadata())[0]["base"]


def test_wrong_key_is_refused_by_target(pair):
    t, i = pair
    src, dst = pattern(64 << 10), np.zeros(64 << 10, np.uint8)
    loaded(t, i, src, dst)
    keep = src.copy()

    def flip_key(blob, r):
        blob[r["offset"] + 30] ^= 0xFF

    i.add_remote_agent(_tampered_meta(t, flip_key))
    h = i.initialize_xfer("READ", [dst], [src], "target")
    i.transfer(h)
    with pytest.raises(errors.AccessDeniedError, match="wrong key"):
        i.wait(h, 5)
    assert i.check_xfer_state(h) == XferState.ERROR
    assert isinstance(i.xfer_error(h), errors.AccessDeniedError)
    # The destination of a failed READ is unspecified (as with RDMA); the target's is untouched.
    w = i.initialize_xfer("WRITE", [dst], [src], "target")
    i.transfer(w)
    with pytest.raises(errors.AccessDeniedError):
        i.wait(w, 5)
    assert np.array_equal(src, keep), "a refused WRITE touched target memory"
    assert t.refused_requests() >= 2
    _check_survivor(t, keep)


def test_write_into_read_only_region(pair):
    t, i = pair
    src, dst = pattern(64 << 10), pattern(64 << 10, 7)
    loaded(t, i, src, dst, access="ro")
    keep = src.copy()
    # Refused up front by the initiator, which knows the access right ...
    with pytest.raises(errors.ReadOnlyError):
        i.initialize_xfer("WRITE", [dst], [src], "target")

    # ... and by the target, for a peer that lies about it.
    def make_rw(blob, r):
        blob[r["offset"] + 29] = 2

    i.add_remote_agent(_tampered_meta(t, make_rw))
    w = i.initialize_xfer("WRITE", [dst], [src], "target")
    i.transfer(w)
    with pytest.raises(errors.ReadOnlyError):
        i.wait(w, 5)
    assert np.array_equal(src, keep)
    # READ is still fine.
    h = i.initialize_xfer("READ", [dst], [src], "target")
    i.transfer(h)
    i.wait(h, 5)
    assert np.array_equal(dst, keep)


def _wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def test_fence_stops_a_connection_mid_write(pair):
    """FENCE (sent by an initiator before it reissues a dead rail's WRITEs) aborts the named
    connections of the same peer; bytes that reach the target on them afterwards never land."""
    t, _ = pair
    buf = np.zeros(64 << 10, np.uint8)
    t.register_memory(buf)
    r = rawpeer.parse_regions(t.get_agent_metadata())[0]
    ida, idb = os.urandom(16), os.urandom(16)
    a = rawpeer.connect(t.port, name="raw", nonce=ida)
    b = rawpeer.connect(t.port, name="raw", nonce=idb)
    other = rawpeer.connect(t.port, name="other")
    try:
        # A WRITE of 64 KiB whose first 16 KiB arrive, then the "rail" dies.
        a.sendall(rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(r["id"], r["key"], 0, 64 << 10), 1) + b"\xAA" * (16 << 10))
        assert _wait_until(lambda: bool((buf[:16 << 10] == 0xAA).all()))
        # Another peer cannot fence this peer's connections: acknowledged, nothing happens.
        other.sendall(rawpeer.frame(rawpeer.FENCE, rawpeer.fence_body([ida]), 5))
        k, req, body = rawpeer.read_frame(other)
        assert (k, req, rawpeer.parse_status(body)[0]) == (rawpeer.RESP, 5, "Ok")
        # The peer itself fences it over its other connection; the answer means "nothing more lands".
        b.sendall(rawpeer.frame(rawpeer.FENCE, rawpeer.fence_body([ida, os.urandom(16)]), 6))
        k, req, body = rawpeer.read_frame(b)
        assert (k, req, rawpeer.parse_status(body)[0]) == (rawpeer.RESP, 6, "Ok")
        # The rest of the stale WRITE arrives late: it must not land.
        try:
            a.sendall(b"\xBB" * (48 << 10))
        except OSError:
            pass  # already reset: fine
        time.sleep(0.3)
        assert (buf[16 << 10:] == 0).all(), "a fenced connection wrote memory"
        with pytest.raises((ConnectionError, OSError)):
            a.settimeout(2)
            rawpeer.read_frame(a)
        # The fencing connection keeps working.
        b.sendall(rawpeer.frame(rawpeer.READ_REQ, rawpeer.op_body(r["id"], r["key"], 0, 16), 7))
        k, req, body = rawpeer.read_frame(b)
        assert rawpeer.parse_status(body)[:2] == ("Ok", 16) and rawpeer.recv_exact(b, 16) == b"\xAA" * 16
        # A connection id already in use is refused, in place of the Welcome.
        dup = rawpeer.connect(t.port, name="raw", nonce=idb, welcome=False)
        k, _, body = rawpeer.read_frame(dup)
        dup.close()
        assert k == rawpeer.ERROR and rawpeer.parse_status(body)[0] == "Unexpected"
        # Bounded: more than 256 ids is a malformed frame and the connection is dropped.
        b.sendall(rawpeer.frame(rawpeer.FENCE, rawpeer.fence_body([bytes(16)] * 257), 8))
        k, _, body = rawpeer.read_frame(b)
        assert k == rawpeer.ERROR and rawpeer.parse_status(body)[0] == "TooLarge"
    finally:
        for s in (a, b, other):
            s.close()


def test_forged_requests_on_the_wire(pair):
    """Out-of-bounds, wrong-key and unknown-region requests from a raw client."""
    t, i = pair
    src = pattern(4096)
    t.register_memory(src)
    keep = src.copy()
    r = rawpeer.parse_regions(t.get_agent_metadata())[0]
    s = rawpeer.connect(t.port)
    cases = [
        (rawpeer.READ_REQ, rawpeer.op_body(r["id"], r["key"], 4000, 200), "OutOfBounds"),
        (rawpeer.READ_REQ, rawpeer.op_body(r["id"], r["key"], 2**64 - 8, 16), "OutOfBounds"),
        (rawpeer.READ_REQ, rawpeer.op_body(r["id"], bytes(16), 0, 16), "BadKey"),
        (rawpeer.READ_REQ, rawpeer.op_body(r["id"] + 99, r["key"], 0, 16), "UnknownRegion"),
    ]
    for n, (kind, body, want) in enumerate(cases):
        s.sendall(rawpeer.frame(kind, body, req_id=n))
        k, req, b = rawpeer.read_frame(s)
        assert (k, req, rawpeer.parse_status(b)[0]) == (rawpeer.RESP, n, want)
    # A refused WRITE: its payload is drained and the connection stays usable.
    s.sendall(rawpeer.frame(rawpeer.WRITE_REQ, rawpeer.op_body(r["id"], bytes(16), 0, 1024), 7) + b"\xAA" * 1024)
    k, req, b = rawpeer.read_frame(s)
    assert rawpeer.parse_status(b)[0] == "BadKey"
    s.sendall(rawpeer.frame(rawpeer.READ_REQ, rawpeer.op_body(r["id"], r["key"], 0, 16), 8))
    k, req, b = rawpeer.read_frame(s)
    assert rawpeer.parse_status(b)[:2] == ("Ok", 16) and rawpeer.recv_exact(s, 16) == keep[:16].tobytes()
    s.close()
    assert np.array_equal(src, keep)


def test_forged_vectored_requests_on_the_wire(pair):
    """Issue 22: vectored READ/WRITE (Hello v2) from a raw client written from
    docs/PROTOCOL.md: pieces land and come back as the document says; a piece past the region,
    a wrong key or a read-only region is refused before anything is touched, the refused
    WRITE's payload drained and the connection kept; malformed piece tables close it."""
    t, i = pair
    src = pattern(1 << 16)
    t.register_memory(src)
    r = rawpeer.parse_regions(t.get_agent_metadata())[0]
    s = rawpeer.connect(t.port, hello_version=2)
    # WRITE 3 strided 100-byte pieces and one plain piece, then READ them back in one stream.
    pieces = [(1000, 100, 3, 4096), (60000, 7, 1, 0)]
    data = bytes(range(256))[:107] * 3
    data = data[:307]
    s.sendall(rawpeer.frame(rawpeer.WRITE_VREQ, rawpeer.vec_body(r["id"], r["key"], pieces), 1) + data)
    k, req, b = rawpeer.read_frame(s)
    assert (k, req, rawpeer.parse_status(b)[:2]) == (rawpeer.RESP, 1, ("Ok", 0))
    got = b"".join(src[o + j * st:o + j * st + n].tobytes() for o, n, c, st in pieces for j in range(c))
    assert got == data
    s.sendall(rawpeer.frame(rawpeer.READ_VREQ, rawpeer.vec_body(r["id"], r["key"], pieces), 2))
    k, req, b = rawpeer.read_frame(s)
    assert rawpeer.parse_status(b)[:2] == ("Ok", 307) and rawpeer.recv_exact(s, 307) == data
    keep = src.copy()
    # Refused: the last strided piece ends one byte past the region; a wrong key. The WRITEs'
    # payloads are drained and nothing lands.
    past = [(0, 8, 1, 0), ((1 << 16) - 4096 * 3, 4096, 2, 4097 * 1 + 4096)]
    for n, (body, ln, want) in enumerate([
        (rawpeer.vec_body(r["id"], r["key"], past), 8 + 8192, "OutOfBounds"),
        (rawpeer.vec_body(r["id"], bytes(16), [(0, 64, 1, 0)]), 64, "BadKey"),
        (rawpeer.vec_body(r["id"] + 99, r["key"], [(0, 64, 1, 0)]), 64, "UnknownRegion"),
    ]):
        s.sendall(rawpeer.frame(rawpeer.WRITE_VREQ, body, 10 + n) + b"\xEE" * ln)
        k, req, b = rawpeer.read_frame(s)
        assert (k, req, rawpeer.parse_status(b)[0]) == (rawpeer.RESP, 10 + n, want)
        s.sendall(rawpeer.frame(rawpeer.READ_VREQ, body, 20 + n))
        k, req, b = rawpeer.read_frame(s)
        assert (k, req, rawpeer.parse_status(b)[:2]) == (rawpeer.RESP, 20 + n, (want, 0))
    assert np.array_equal(src, keep)
    s.close()
    # Malformed tables close the connection: no entries, a zero-length piece, overlapping
    # strided pieces, more entries than the body holds.
    for body in (
        rawpeer.vec_body(r["id"], r["key"], []),
        rawpeer.vec_body(r["id"], r["key"], [(0, 0, 1, 0)]),
        rawpeer.vec_body(r["id"], r["key"], [(0, 64, 2, 32)]),
        rawpeer.vec_body(r["id"], r["key"], [(0, 64, 1, 0)])[:-4],
    ):
        s = rawpeer.connect(t.port, hello_version=2)
        s.sendall(rawpeer.frame(rawpeer.READ_VREQ, body, 3))
        k, _, b = rawpeer.read_frame(s)
        assert k == rawpeer.ERROR and rawpeer.parse_status(b)[0] in ("Malformed", "TooLarge"), (k, b)
        s.close()
    assert np.array_equal(src, keep)


@pytest.mark.parametrize("port_kind", ["side", "data"])
@pytest.mark.parametrize(
    "name,payload,expect",
    [
        ("garbage", b"\x00\xffGET / HTTP/1.1\r\n\r\n" * 4, "Malformed"),
        ("version", rawpeer.header(rawpeer.HELLO, 0, version=9), "VersionMismatch"),
        ("oversized", rawpeer.header(rawpeer.HELLO, 1 << 30), "TooLarge"),
        ("unknown-kind", rawpeer.header(99, 0), "Malformed"),
        ("truncated", rawpeer.header(rawpeer.HELLO, 40) + b"\x01\x00", None),
    ],
)
def test_hostile_frames_before_handshake(name, payload, expect, port_kind):
    with Agent("target", {"rails": ["127.0.0.1"], "timeout": 1.0}) as t:
        src = pattern(4096)
        t.register_memory(src)
        keep = src.copy()
        port = t.port if port_kind == "side" else t.rails()[0][2]
        assert port_kind == "side" or port != t.port
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(payload)
        if expect is not None:
            k, _, b = rawpeer.read_frame(s)
            assert k == rawpeer.ERROR and rawpeer.parse_status(b)[0] == expect
        else:
            s.shutdown(socket.SHUT_WR)  # a truncated frame, then the peer goes away
        s.settimeout(5)
        assert s.recv(1) == b"", "the server must close a hostile connection"
        s.close()
        _check_survivor(t, keep)


def test_hostile_frames_after_handshake(pair):
    t, i = pair
    src = pattern(4096)
    t.register_memory(src)
    for bad in (rawpeer.header(rawpeer.READ_REQ, 1 << 20), rawpeer.header(rawpeer.WELCOME, 32) + bytes(32), b"XX" + bytes(14)):
        s = rawpeer.connect(t.port)
        s.sendall(bad)
        k, _, b = rawpeer.read_frame(s)
        assert k == rawpeer.ERROR
        s.settimeout(5)
        assert s.recv(1) == b""
    _check_survivor(t, src.copy())


class FakeServer:
    """A listener that answers the first frame with a canned reply (or silence)."""

    def __init__(self, reply: bytes | None, complete_handshake: bool = False):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.reply, self.complete = reply, complete_handshake
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            try:
                rawpeer.read_frame(c)
                if self.complete:
                    name = b"fake"
                    c.sendall(rawpeer.frame(rawpeer.CHALLENGE, b"\x00" + struct.pack("<Q", 77) + bytes(16) + struct.pack("<H", 4) + name))
                    rawpeer.read_frame(c)
                    c.sendall(rawpeer.frame(rawpeer.WELCOME, bytes(32)))
                elif self.reply is not None:
                    c.sendall(self.reply)
            except (OSError, AssertionError, ConnectionError):
                pass

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_protocol_version_mismatch_from_peer():
    fake = FakeServer(rawpeer.header(rawpeer.CHALLENGE, 0, version=2))
    try:
        with Agent("me", {"timeout": 2.0}) as a:
            with pytest.raises(errors.VersionMismatchError):
                a.fetch_remote_metadata("x", "127.0.0.1", fake.port)
            blob = bytearray(a.get_agent_metadata())
            blob[4] = 2  # metadata schema version
            with pytest.raises(errors.VersionMismatchError):
                a.add_remote_agent(bytes(blob))
            with pytest.raises(errors.MetadataError):
                a.add_remote_agent(b"definitely not metadata")
            with pytest.raises(errors.ProtocolError):
                a.deserialize_descs(b"MRDL\x01\x00\x00" + struct.pack("<I", 10**6))
    finally:
        fake.close()


def test_peer_that_stops_answering_times_out():
    """A peer that accepts a READ and never answers (its kernel acknowledges, its application
    is silent): the rail is held, not stalled, but only up to the request `timeout` (2 s here):
    ERROR then, no hang."""
    fake = FakeServer(None, complete_handshake=True)
    try:
        with Agent("me", {"timeout": 2.0, "stall_timeout": 0.5}) as a:
            meta = _fake_meta("fake", 77, fake.port, base=1 << 32, length=1 << 20)
            a.add_remote_agent(meta)
            dst = np.zeros(1 << 20, np.uint8)
            a.register_memory(dst)
            h = a.initialize_xfer("READ", [dst], [(1 << 32, 1 << 20, 0)], "fake")
            t0 = time.monotonic()
            a.transfer(h)
            with pytest.raises(errors.PeerLostError, match="stalled"):
                a.wait(h, 10)
            assert time.monotonic() - t0 < 3.0
    finally:
        fake.close()


def _fake_meta(name: str, inc: int, port: int, base: int, length: int) -> bytes:
    nb = name.encode()
    out = b"MRMD" + struct.pack("<H", 1) + struct.pack("<H", len(nb)) + nb + struct.pack("<Q", inc)
    rail = struct.pack("<H", 4) + b"fake" + struct.pack("<H", 9) + b"127.0.0.1" + bytes([0]) + struct.pack("<HQIi", port, 0, 0, -1) + struct.pack("<H", 0)
    out += struct.pack("<I", 1) + rail
    out += struct.pack("<I", 1) + struct.pack("<QQQIBB", 1, base, length, 0, 0, 2) + bytes(16)
    return out


TARGET_SCRIPT = r"""
import sys, time, numpy as np, multirail
n, port = int(sys.argv[1]), int(sys.argv[2])
t = multirail.Agent("target", {"port": port})
buf = np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8)
reg = t.register_memory(buf)
print(t.port, t.get_serialized_descs(reg).hex(), flush=True)
deadline = time.time() + 60
while time.time() < deadline:
    got = t.get_new_notifs().get("initiator", [])
    if b"verify" in got:
        print("sum", int(buf.astype(np.uint64).sum()), flush=True)
    if b"done" in got:
        break
    time.sleep(0.01)
"""


def _spawn_target(n: int, port: int = 0):
    """A target agent in its own process; returns (process, port, its buffer's descriptors)."""
    p = subprocess.Popen([sys.executable, "-c", TARGET_SCRIPT, str(n), str(port)], stdout=subprocess.PIPE, text=True)
    port_s, descs = p.stdout.readline().split()
    return p, int(port_s), bytes.fromhex(descs)


def test_two_processes_byte_exact():
    n = 32 * MiB
    p, port, blob = _spawn_target(n)
    try:
        with Agent("initiator") as i:
            dst = np.zeros(n, np.uint8)
            i.register_memory(dst)
            i.fetch_remote_metadata("target", "127.0.0.1", port)
            remote = i.deserialize_descs(blob)
            h = i.initialize_xfer("READ", [dst], remote, "target")
            i.transfer(h)
            i.wait(h, 30)
            assert np.array_equal(dst, np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8))
            dst[:] = 3
            w = i.initialize_xfer("WRITE", [dst], remote, "target", b"verify")
            i.transfer(w)
            i.wait(w, 30)
            assert p.stdout.readline().split() == ["sum", str(3 * n)]
            i.send_notif("target", b"done")
        assert p.wait(10) == 0
    finally:
        p.kill()
        p.wait()


def test_peer_killed_mid_transfer_then_restarted():
    """Killed mid-transfer: ERROR within the timeout. Restarted: stale metadata is refused
    (new incarnation) until fetched again, then transfers work."""
    n = 128 * MiB
    p, port, blob = _spawn_target(n)
    with Agent("initiator", {"timeout": 2.0, "stall_timeout": 1.0}) as i:
        dst = np.zeros(n, np.uint8)
        i.register_memory(dst)
        i.fetch_remote_metadata("target", "127.0.0.1", port)
        h = i.initialize_xfer("READ", [dst], i.deserialize_descs(blob), "target")
        killer = threading.Timer(0.3, p.kill)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(errors.PeerLostError):
            while time.monotonic() - t0 < 20:
                i.transfer(h)
                i.wait(h, 10)
        killed_at = t0 + 0.3
        # The kill resets the connections (seen at once); the bound is the configured timeout
        # plus slack for a loaded machine.
        assert time.monotonic() - killed_at < 2.0 + 1.5, "error must come within the configured timeout"
        p.wait()
        p2, port2, blob2 = _spawn_target(n, port)
        try:
            assert port2 == port
            with pytest.raises((errors.StaleMetadataError, errors.PeerLostError)):
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    i.transfer(h)
                    i.wait(h, 10)
            with pytest.raises(errors.StaleMetadataError):
                i.initialize_xfer("READ", [dst], i.deserialize_descs(blob), "target")
            i.fetch_remote_metadata("target", "127.0.0.1", port)
            h2 = i.initialize_xfer("READ", [dst], i.deserialize_descs(blob2), "target")
            i.transfer(h2)
            i.wait(h2, 30)
            assert np.array_equal(dst, np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8))
            i.send_notif("target", b"done")
        finally:
            p2.kill()
            p2.wait()


def test_restarted_peer_is_reported_stale_at_once():
    """A peer that died long enough ago for the background probe to back off (2 s) and then
    restarted: the next initialize_xfer with the old metadata is refused as stale at once (the
    caller probes a link whose every rail is down) instead of succeeding until the probe's next
    try; after a fresh fetch, transfers work."""
    n = 1 * MiB
    p, port, blob = _spawn_target(n)
    with Agent("initiator", {"timeout": 2.0, "stall_timeout": 0.5}) as i:
        dst = np.zeros(n, np.uint8)
        i.register_memory(dst)
        i.fetch_remote_metadata("target", "127.0.0.1", port)
        h = i.initialize_xfer("READ", [dst], i.deserialize_descs(blob), "target")
        i.transfer_sync(h, 10)
        p.kill()
        p.wait()
        with pytest.raises(errors.PeerLostError):
            i.transfer_sync(h, 10)
        time.sleep(3.0)  # the background probe's backoff reaches its 2 s cap
        p2, port2, blob2 = _spawn_target(n, port)
        try:
            assert port2 == port
            with pytest.raises(errors.StaleMetadataError):
                i.initialize_xfer("READ", [dst], i.deserialize_descs(blob), "target")
            with pytest.raises(errors.StaleMetadataError):
                i.transfer_sync(h, 10)
            i.fetch_remote_metadata("target", "127.0.0.1", port)
            h2 = i.initialize_xfer("READ", [dst], i.deserialize_descs(blob2), "target")
            i.transfer_sync(h2, 10)
            assert np.array_equal(dst, np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8))
            i.send_notif("target", b"done")
        finally:
            p2.kill()
            p2.wait()


@pytest.mark.parametrize("mode", ["adaptive", "poll", "block"])
def test_polled_multi_piece_writes_complete(mode: str):
    """Post, then poll check_xfer_state (NIXL's loop), for WRITEs of four unmerged 256 B pieces:
    their responses arrive together, and the caller's read-ahead takes them all while it
    completes the first. The rest must still be completed, by the poller or the receiver; they
    used to sit in the read-ahead, unannounced by the socket, until the stall timeout (8 of 40
    failed)."""
    with Agent("target", {"progress": mode}) as t, Agent("initiator", {"progress": mode, "timeout": 5.0}) as i:
        dst, src = np.zeros(1 << 16, np.uint8), pattern(1 << 16, 3)
        t.register_memory(dst)
        i.register_memory(src)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        for k in range(40):
            lo = np.array([(src.ctypes.data + j * 4096 + k, 256, 0) for j in range(4)], np.uint64)
            ro = np.array([(dst.ctypes.data + j * 8192 + k, 256, 0) for j in range(4)], np.uint64)
            h = i.initialize_xfer("WRITE", i.get_xfer_descs(lo), i.get_xfer_descs(ro), "target")
            i.transfer(h)
            deadline = time.monotonic() + 5
            while (s := i.check_xfer_state(h)) == XferState.IN_PROGRESS:
                assert time.monotonic() < deadline, f"WRITE {k} never completed"
            assert s == XferState.DONE, (k, i.xfer_error(h) if hasattr(i, "xfer_error") else s)
            i.release_xfer_handle(h)
            for j in range(4):
                assert np.array_equal(dst[j * 8192 + k:j * 8192 + k + 256], src[j * 4096 + k:j * 4096 + k + 256])


def test_port_already_in_use():
    with Agent("first") as a:
        with pytest.raises(errors.AddressInUseError):
            Agent("second", {"port": a.port})


def test_config_errors():
    with pytest.raises(errors.InvalidArgumentError, match="unknown config keys"):
        Agent("x", {"hots": "1.2.3.4"})
    with pytest.raises(ValueError):
        Agent("x", {"policy": "fastest"})
    with pytest.raises(errors.InvalidArgumentError):
        Agent("x", {"rails": ["no-such-interface0"]})


def test_auth_secret_required_and_checked():
    with Agent("target", {"auth_secret": "s3cret"}) as t:
        src = pattern(4096)
        t.register_memory(src)
        with Agent("anon") as a:
            with pytest.raises(errors.AuthenticationError, match="requires a shared secret"):
                a.fetch_remote_metadata("target", "127.0.0.1", t.port)
        with Agent("liar", {"auth_secret": "guess"}) as a:
            with pytest.raises(errors.AuthenticationError):
                a.fetch_remote_metadata("target", "127.0.0.1", t.port)
        with Agent("friend", {"auth_secret": b"s3cret"}) as a:
            a.fetch_remote_metadata("target", "127.0.0.1", t.port)
            dst = np.zeros(4096, np.uint8)
            a.register_memory(dst)
            h = a.initialize_xfer("READ", [dst], [src], "target")
            a.transfer(h)
            a.wait(h, 5)
            assert np.array_equal(dst, src)
        # A raw client that skips the proof is refused.
        with pytest.raises((AssertionError, ConnectionError)):
            rawpeer.connect(t.port)


def test_transfer_sync_and_timeout_validation(pair):
    t, i = pair
    src, dst = pattern(64 << 10), np.zeros(64 << 10, np.uint8)
    loaded(t, i, src, dst)
    h = i.initialize_xfer("READ", [dst], [src], "target")
    i.transfer_sync(h, timeout=5)
    assert np.array_equal(dst, src) and i.check_xfer_state(h) == XferState.DONE
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(errors.InvalidArgumentError, match="timeout"):
            i.wait(h, bad)
        with pytest.raises(errors.InvalidArgumentError, match="timeout"):
            i.transfer_sync(h, timeout=bad)
    i.release_xfer_handle(h)


def run_concurrently(*workers: Callable[[], None], timeout: float = 120) -> None:
    """Runs each worker on its own thread and fails the test if one raised (its first error) or
    is still running after `timeout` seconds (a hang)."""
    errs: list[BaseException] = []

    def run(f: Callable[[], None]) -> None:
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - reported below
            errs.append(e)

    threads = [threading.Thread(target=run, args=(f,)) for f in workers]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), "a transfer thread hung"
    assert not errs, errs[0]


def test_concurrent_small_and_bulk_transfers_share_connections(pair):
    """Caller-driven completion (a waiting thread reads its own responses) and the receiver
    threads must never lose, duplicate or misroute a response: several Python threads run small
    READs/WRITEs with transfer_sync, wait and check_xfer_state polling while bulk READs run."""
    t, i = pair
    n_small, small = 6, 4096
    src = pattern(16 * MiB + n_small * small, 3)
    t.register_memory(src)
    dst = np.zeros(src.size, np.uint8)
    i.register_memory(dst)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    bulk = 16 * MiB

    def small_worker(k: int) -> None:
        off = bulk + k * small
        r = i.initialize_xfer("READ", [(dst.ctypes.data + off, small, 0)], [(src.ctypes.data + off, small, 0)], "target")
        w = i.initialize_xfer("WRITE", [(dst.ctypes.data + off, small, 0)], [(src.ctypes.data + off, small, 0)], "target")
        for it in range(300):
            mode = (it + k) % 3
            if mode == 0:
                i.transfer_sync(r, timeout=10)
            elif mode == 1:
                i.transfer(r)
                i.wait(r, 10)
            else:
                i.transfer(r)
                deadline = time.monotonic() + 10
                while i.check_xfer_state(r) == XferState.IN_PROGRESS:
                    assert time.monotonic() < deadline, "polled READ never finished"
            assert np.array_equal(dst[off:off + small], src[off:off + small])
            if it % 50 == 0:
                i.transfer_sync(w, timeout=10)  # writes back the same bytes
        i.release_xfer_handle(r)
        i.release_xfer_handle(w)

    def bulk_worker() -> None:
        h = i.initialize_xfer("READ", [(dst.ctypes.data, bulk, 0)], [(src.ctypes.data, bulk, 0)], "target")
        for _ in range(4):
            i.transfer_sync(h, timeout=30)
            assert np.array_equal(dst[:bulk], src[:bulk])
        i.release_xfer_handle(h)

    run_concurrently(*(functools.partial(small_worker, k) for k in range(n_small)), bulk_worker)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("progress", ["adaptive", "block", "poll"])
def test_bulk_caller_and_async_transfers_on_one_connection(progress: str):
    """One connection, 1 MiB chunks (bulk: adaptive callers do not spin for them): a thread
    drives bulk READs and WRITEs with transfer_sync (its caller owns the connection, the
    receiver stays parked meanwhile) while another posts asynchronous transfers on the same
    connection and polls them. Every byte lands and every transfer completes: the caller that
    leaves with the other's responses still due kicks the parked receiver, which reads them."""
    t = Agent("target")
    i = Agent("initiator", {"connections": 1, "chunk_size": 1 << 20, "progress": progress, "timeout": 10.0})
    try:
        bulk, small = 8 * MiB, 64 << 10
        src = pattern(2 * bulk + 16 * small, 11)
        dst = np.zeros(src.size, np.uint8)
        t.register_memory(src)
        i.register_memory(dst)
        fetch_and_await_metadata(i, t)
        base_s, base_d = src.ctypes.data, dst.ctypes.data

        def bulk_worker() -> None:
            rd = i.initialize_xfer("READ", [(base_d, bulk, 0)], [(base_s, bulk, 0)], "target")
            # WRITE the READ's bytes back into the target's second half, then read it back.
            wr = i.initialize_xfer("WRITE", [(base_d, bulk, 0)], [(base_s + bulk, bulk, 0)], "target")
            back = i.initialize_xfer("READ", [(base_d + bulk, bulk, 0)], [(base_s + bulk, bulk, 0)], "target")
            for _ in range(6):
                i.transfer_sync(rd, timeout=30)
                i.transfer_sync(wr, timeout=30)
                i.transfer_sync(back, timeout=30)
            for h in (rd, wr, back):
                i.release_xfer_handle(h)

        def async_worker() -> None:
            off = 2 * bulk
            hs = [i.initialize_xfer("READ", [(base_d + off + k * small, small, 0)],
                                    [(base_s + off + k * small, small, 0)], "target") for k in range(16)]
            for _ in range(10):
                for h in hs:
                    i.transfer(h)
                for h in hs:
                    deadline = time.monotonic() + 30
                    while i.check_xfer_state(h) == XferState.IN_PROGRESS:
                        assert time.monotonic() < deadline, "an asynchronous READ never finished"
                        time.sleep(0.0005)
                    assert i.check_xfer_state(h) == XferState.DONE
            for h in hs:
                i.release_xfer_handle(h)

        run_concurrently(bulk_worker, async_worker)
        assert np.array_equal(dst[:bulk], src[:bulk])
        assert np.array_equal(src[bulk:2 * bulk], src[:bulk]), "the WRITEs did not land"
        assert np.array_equal(dst[bulk:2 * bulk], src[:bulk])
        assert np.array_equal(dst[2 * bulk:], src[2 * bulk:])
    finally:
        i.close()
        t.close()


@pytest.mark.parametrize("progress", ["adaptive", "block"])
def test_bulk_reads_and_writes_interleave_on_one_connection_whose_receiver_refills(progress: str):
    """One connection, 64 KiB chunks: during a bulk READ the receiver thread sends the next READ
    requests itself (`tcp::refill`) while the sender thread sleeps. Bulk WRITEs and vectored
    READs posted meanwhile on the same connection are handed to the sender (the receiver never
    writes while a WRITE is in flight, so neither side can block the other). Every byte lands
    where it should and nothing hangs, asynchronous posts and transfer_sync alike."""
    t = Agent("target")
    i = Agent("initiator", {"connections": 1, "chunk_size": 64 << 10, "progress": progress, "timeout": 10.0})
    try:
        bulk, page = 8 * MiB, 4096
        src = pattern(3 * bulk, 23)
        dst = np.zeros(3 * bulk, np.uint8)
        wsrc = pattern(bulk, 24)
        t.register_memory(src)
        i.register_memory(dst)
        i.register_memory(wsrc)
        fetch_and_await_metadata(i, t)
        base_s, base_d = src.ctypes.data, dst.ctypes.data

        def reader() -> None:
            rd = i.initialize_xfer("READ", [(base_d, bulk, 0)], [(base_s, bulk, 0)], "target")
            for k in range(8):
                if k % 2:
                    i.transfer_sync(rd, timeout=30)
                else:
                    i.transfer(rd)
                    i.wait(rd, 30)
                assert np.array_equal(dst[:bulk], src[:bulk])
                dst[:bulk] = 0
            i.release_xfer_handle(rd)

        def writer() -> None:
            wr = i.initialize_xfer("WRITE", [(wsrc.ctypes.data, bulk, 0)], [(base_s + bulk, bulk, 0)], "target")
            for _ in range(8):
                i.transfer(wr)
                i.wait(wr, 30)
            i.release_xfer_handle(wr)

        def pages() -> None:
            # Every other page of the third part: a vectored READ (handed to the sender).
            n = bulk // (2 * page)
            loc = [(base_d + 2 * bulk + 2 * k * page, page, 0) for k in range(n)]
            rem = [(base_s + 2 * bulk + 2 * k * page, page, 0) for k in range(n)]
            h = i.initialize_xfer("READ", loc, rem, "target")
            for _ in range(8):
                i.transfer_sync(h, timeout=30)
            i.release_xfer_handle(h)

        run_concurrently(reader, writer, pages)
        assert np.array_equal(src[bulk:2 * bulk], wsrc), "the WRITEs did not land"
        got = dst[2 * bulk:].reshape(-1, 2, page)
        want = src[2 * bulk:].reshape(-1, 2, page)
        assert np.array_equal(got[:, 0], want[:, 0]), "a page of the vectored READ is wrong"
        assert not got[:, 1].any(), "the vectored READ wrote between its pages"
    finally:
        i.close()
        t.close()


@pytest.mark.parametrize("sync", [False, True])
def test_wait_on_a_transfer_spread_over_connections_returns_promptly(sync: bool):
    """A transfer striped over several connections: the waiting caller drives one of them and
    must not sit in a read there once its chunks elsewhere complete it (that bug made some
    waits take the 50 ms socket tick). With `transfer_sync` the receivers are parked while the
    caller drives: chunks the sender threads post after the caller left must still be read
    (else a wait sits out the 50 ms parking)."""
    t = Agent("target")
    i = Agent("initiator", {"connections": 3, "chunk_size": 64 << 10, "stripe_threshold": 4096, "timeout": 5.0})
    try:
        # Sync: 8 MiB = 128 chunks, more than the connections' windows hold, so the sender
        # threads post the rest while (or after) the caller drives.
        n = (8 << 20) if sync else (512 << 10)
        src, dst = pattern(n, 5), np.zeros(n, np.uint8)
        loaded(t, i, src, dst)
        h = i.initialize_xfer("READ", [dst], [src], "target")
        took = []
        for _ in range(100 if sync else 300):
            t0 = time.monotonic()
            if sync:
                i.transfer_sync(h, 10)
            else:
                i.transfer(h)
                i.wait(h, 10)
            took.append(time.monotonic() - t0)
        assert np.array_equal(dst, src)
        # The bugs' signature is a wait that sits out a 50 ms tick or parking. On a loaded 2-core
        # machine a few waits are slow for other reasons: count only those that took at least
        # 45 ms and 5x the median, and allow a few (with the parking bug 38 of 100 took ~55 ms
        # against a 6.8 ms median; fixed, 1).
        limit = max(0.045, 5 * sorted(took)[len(took) // 2])
        slow = sum(t > limit for t in took)
        assert slow <= 10, f"{slow} of {len(took)} striped READs of {n >> 10} KiB took > {limit * 1e3:.0f} ms"
        i.release_xfer_handle(h)
    finally:
        i.close()
        t.close()


def _sender_switches() -> int:
    """Voluntary context switches so far of this process's rail sender threads (mr-send-*)."""
    n = 0
    for t in os.scandir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"{t.path}/comm") as f:
                if not f.read().startswith("mr-send-"):
                    continue
            with open(f"{t.path}/status") as f:
                n += next(int(x.split()[1]) for x in f if x.startswith("voluntary_ctxt_switches:"))
        except (OSError, StopIteration):
            pass  # a thread that just exited
    return n


@pytest.mark.parametrize("progress", ["adaptive", "block"])
def test_small_transfers_do_not_wake_the_rail_senders(progress: str):
    # A 4 KiB READ is posted whole from the caller's thread; waking every rail's sender thread
    # for nothing cost one wake-up per rail per READ (2 per READ on 2 rails, found through the
    # NIXL plugin's 4 KiB round trip). A count of wake-ups, not a timing: a sender also wakes
    # every 100 ms on its own, so the bound allows for a slow host.
    rails = ["127.0.0.1", "127.0.0.2"]
    with Agent("target", {"rails": rails}) as t, \
            Agent("initiator", {"rails": rails, "progress": progress, "timeout": 5.0}) as i:
        src, dst = pattern(4096, 3), np.zeros(4096, np.uint8)
        loaded(t, i, src, dst)
        h = i.initialize_xfer("READ", [dst], [src], "target")
        for _ in range(20):  # connect, warm up
            i.transfer(h)
            i.wait(h, 5)
        n, t0 = 400, time.monotonic()
        s0 = _sender_switches()
        for _ in range(n):
            i.transfer(h)
            i.wait(h, 5)
        woke, secs = _sender_switches() - s0, time.monotonic() - t0
        assert np.array_equal(dst, src)
        # 2 senders x 10 timed wake-ups a second, and a margin: far below 2 per READ
        allowed = 0.1 * n + 2 * 10 * (secs + 1)
        assert woke <= allowed, f"{woke} sender wake-ups for {n} 4 KiB READs in {secs:.2f} s"


def test_a_notification_whose_answer_is_lost_is_delivered_once(agents):
    """Issue 36 item 3, the native API: the target loses its answer to the first notification
    (fault injection `lose_answer`), the initiator resends it, the target's inbox has it once."""
    t = agents("target", {"faults": "0:lose_answer@0"})
    i = agents("initiator", {"timeout": 5.0})
    i.add_remote_agent(t.get_agent_metadata())
    i.send_notif("target", b"once")
    i.send_notif("target", b"twice")
    got: list = []
    deadline = time.monotonic() + 10
    while b"twice" not in got and time.monotonic() < deadline:
        got += t.get_new_notifs().get("initiator", [])
        time.sleep(0.01)
    assert got == [b"once", b"twice"], got


def _fill_inbox_but_half_a_mib(t, send) -> None:
    """63 x 1 MiB + 512 KiB from one peer: its next 1 MiB notification is refused (over the
    64 MiB per peer, inbox::PEER_MAX_QUEUED_BYTES) while small ones still fit."""
    for k in range(63):
        send(bytes([k]) * MiB)
    send(b"h" * (MiB // 2))


def _take_until(t, peer: str, n: int, timeout: float = 20.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += t.get_new_notifs().get(peer, [])
        time.sleep(0.005)
    return got


def test_notifications_keep_their_order_behind_a_refused_one(pair):
    """Issue 36 item 3 (order): NIXL delivers one peer's notifications in the order sent. The
    target's inbox has room for small notifications but not for a 1 MiB one: a WRITE's 1 MiB
    notification is refused and held by the initiator (its data landed); the WRITEs'
    notifications and send_notifs after it are delivered after it once the application takes
    its notifications, in the order sent (before: each send_notif went out on the caller's
    thread and was queued at once, before the held one). A send_notif refused fails, and the
    next one, once there is room, is delivered (the target's refusal of what follows a
    refused notification does not outlive it)."""
    t, i = pair
    src, dst = pattern(1 * MiB, 8), np.zeros(1 * MiB, np.uint8)
    loaded(t, i, dst, src)
    _fill_inbox_but_half_a_mib(t, lambda m: i.send_notif("target", m))
    big = b"A" + b"a" * (MiB - 1)
    w = i.initialize_xfer("WRITE", [src], [dst], "target", big)
    i.transfer(w)
    i.wait(w, 10)
    sent: list[bytes] = [big]
    errs: list[BaseException] = []
    calling = threading.Event()

    def more() -> None:
        try:
            for k in range(12):
                m = f"{k}".encode()
                if k % 3 == 0:
                    x = i.initialize_xfer("WRITE", [src[:4096]], [dst[:4096]], "target", b"x" + m)
                    i.transfer(x)
                    i.wait(x, 10)
                    sent.append(b"x" + m)
                else:
                    calling.set()
                    i.send_notif("target", b"n" + m)  # waits behind the held one
                    sent.append(b"n" + m)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    th = threading.Thread(target=more)
    th.start()
    # The sends are under way: a WRITE's notification held behind the big one, and the first
    # send_notif called (on main before the fix it was queued at once, ahead of the held one).
    assert calling.wait(20), errs
    got = _take_until(t, "initiator", 64 + 13)
    th.join(20)
    assert not errs and not th.is_alive(), errs
    assert len(got) == 64 + 13 and got[64:] == sent, [m[:4] for m in got[64:]]
    assert np.array_equal(src, dst)
    # a refused send_notif fails; the next, once the application made room, is delivered
    _fill_inbox_but_half_a_mib(t, lambda m: i.send_notif("target", m))
    with pytest.raises(errors.TransferError, match="notification queue full"):
        i.send_notif("target", big)
    assert len(_take_until(t, "initiator", 64)) == 64
    i.send_notif("target", b"after")
    assert _take_until(t, "initiator", 1) == [b"after"]


def test_the_target_refuses_what_follows_a_refused_notification_in_a_pipelined_batch(pair):
    """Issue 36 item 3 (order), the target's side: numbered notifications pipelined on one
    control connection, the first refused (inbox full for it) and the next small enough to
    fit: the next is refused too (before: queued, ahead of the refused one, which the sender
    then sent again behind it). Sent again oldest first, both are queued in order."""
    t, _i = pair
    s = rawpeer.connect(t.port, name="raw", role=1, hello_version=5)

    def notif(seq: int, msg: bytes) -> bytes:
        return rawpeer.frame(17, struct.pack("<QQ", 7, seq) + msg, req_id=seq)

    def answers(n: int) -> list[str]:
        return [rawpeer.parse_status(rawpeer.read_frame(s)[2])[0] for _ in range(n)]

    try:
        seq = iter(range(1, 1000))
        _fill_inbox_but_half_a_mib(t, lambda m: s.sendall(notif(next(seq), m)))
        assert answers(64) == ["Ok"] * 64
        big, small = b"A" * MiB, b"b"
        s.sendall(notif(100, big) + notif(101, small))
        assert answers(2) == ["Busy", "Busy"]
        assert len(_take_until(t, "raw", 64)) == 64
        s.sendall(notif(100, big) + notif(101, small))
        assert answers(2) == ["Ok", "Ok"]
        assert _take_until(t, "raw", 2) == [big, small]
    finally:
        s.close()
