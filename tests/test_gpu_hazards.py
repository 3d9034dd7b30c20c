"""What a real GPU would hit first (issue 19), on the stand-in device, which models the hazards:
a producer's work still pending on the application's stream (the stream contract), the calling
thread's current device, and a stream named by a CUDA array at registration. Each test fails on
an engine that ignores the hazard: without the stream contract the WRITE sends the stale bytes
that were in the buffer before the producer's copy landed."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from conftest import engine_available, pattern
from gpu_peer import Target as _Target

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

if engine_available():
    import multirail
    from multirail import errors, gpu
    from multirail.gpu import DeviceBuffer

MiB = 1 << 20
SI = "standin"


@pytest.fixture
def pair(standin_pair: tuple[Any, Any]) -> tuple[Any, Any]:
    return standin_pair


def produce_later(b: DeviceBuffer, data: np.ndarray, delay: float = 0.4) -> "gpu.Stream":
    """Queue, on a new stream, a 'kernel' of `delay` seconds and then the copy that produces
    `data` in `b`: the producer is still running when this returns."""
    s = gpu.Stream(b.device, SI)
    s.sleep(delay)
    b.copy_from_host(data, stream=s)
    return s


@pytest.mark.parametrize("n", [4095, 3 * MiB + 1])
@pytest.mark.parametrize("sync", [False, True])
def test_a_write_is_ordered_after_the_producers_stream(pair: Any, n: int, sync: bool) -> None:
    """Staged over tcp: WRITE from local GPU memory whose producer is still queued on a stream,
    posted with stream=: the target receives the produced bytes, not the stale ones."""
    t, i = pair
    remote = np.zeros(n, np.uint8)
    t.register_memory(remote)
    src = DeviceBuffer(n, kind=SI)
    src.copy_from_host(np.full(n, 0xEE, np.uint8))  # stale contents
    i.register_memory(src)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    new = pattern(n, 3)
    s = produce_later(src, new)
    try:
        h = i.initialize_xfer("WRITE", [src], [remote], "target")
        if sync:
            i.transfer_sync(h, 30, stream=s)
        else:
            i.transfer(h, stream=s)
            i.wait(h, 30)
        i.release_xfer_handle(h)
        ok = bool(np.array_equal(remote, new))
    finally:
        s.close()  # waits for the producer: nothing writes `src` after this
    assert ok, "the bytes sent are the ones the producer wrote"


def test_a_read_waits_for_the_stream_before_landing(pair: Any) -> None:
    """READ into local GPU memory that the application's stream still writes: the engine's
    bytes land after that work, so they are what the buffer holds afterwards."""
    t, i = pair
    n = 2 * MiB + 5
    remote = pattern(n, 9)
    t.register_memory(remote)
    dst = DeviceBuffer(n, kind=SI)
    i.register_memory(dst)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    s = produce_later(dst, np.full(n, 0x55, np.uint8))  # the application's pending write
    try:
        h = i.initialize_xfer("READ", [dst], [remote], "target")
        i.transfer(h, stream=s)
        i.wait(h, 30)
        i.release_xfer_handle(h)
    finally:
        s.close()
    assert np.array_equal(dst.to_host(), remote), "the READ landed after the stream's write"


def test_an_ipc_write_is_ordered_after_the_producers_stream() -> None:
    """Same host, CUDA IPC (the target in another process): the device copy into the peer's
    mapping also waits for the producer."""
    import hashlib

    n = MiB + 3
    tgt = _Target(n)
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
    try:
        src = DeviceBuffer(n, kind=SI)
        i.register_memory(src)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        rd = i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM")
        new = pattern(n, 21)
        s = produce_later(src, new)
        try:
            h = i.initialize_xfer("WRITE", [src], rd, "target")
            i.transfer(h, stream=s)
            i.wait(h, 30)
            i.release_xfer_handle(h)
        finally:
            s.close()
        assert i.peer_counters("target")["ipc_transfers"] == 1
        assert tgt.ask("digest") == hashlib.sha256(new.tobytes()).hexdigest()
    finally:
        i.close()
        tgt.close()


def test_a_post_behind_one_waiting_for_its_stream_waits_too() -> None:
    """Posting order holds across a stream wait (docs/gpu.md): WRITE A's producer is still
    queued on its stream when A is posted, so A waits for it off the caller's thread; WRITE B,
    from host memory (nothing to wait for), is posted to the same peer right after. B queues
    behind A: the target holds A's notification before B's, and both land byte-exact. An
    engine that let B overtake A would deliver "b" first (A waits 0.4 s, B takes ~1 ms)."""
    import hashlib

    half = MiB + 3
    n = 2 * half
    tgt = _Target(n)
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
    try:
        src = DeviceBuffer(half, kind=SI)
        host_src = pattern(half, 33)
        i.register_memory(src)
        i.register_memory(host_src)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        a = i.initialize_xfer("WRITE", [src], i.get_xfer_descs([(tgt.addr, half, 0)], "VRAM"), "target", b"a")
        b = i.initialize_xfer("WRITE", [host_src], i.get_xfer_descs([(tgt.addr + half, half, 0)], "VRAM"), "target", b"b")
        new = pattern(half, 31)
        s = produce_later(src, new)
        try:
            i.transfer(a, stream=s)
            i.transfer(b)
            for h in (b, a):
                i.wait(h, 30)
                i.release_xfer_handle(h)
        finally:
            s.close()
        assert tgt.ask("notifs") == '{"initiator": ["a", "b"]}'
        assert tgt.ask("digest") == hashlib.sha256(new.tobytes() + host_src.tobytes()).hexdigest()
    finally:
        i.close()
        tgt.close()


def test_streams_are_checked(pair: Any) -> None:
    t, i = pair
    remote = np.zeros(4096, np.uint8)
    t.register_memory(remote)
    src = DeviceBuffer(4096, kind=SI)
    i.register_memory(src)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    h = i.initialize_xfer("WRITE", [src], [remote], "target")
    with pytest.raises(errors.InvalidArgumentError, match="stream must be"):
        i.transfer(h, stream="default")
    with pytest.raises(errors.GpuError, match="not a stream of this device"):
        i.transfer(h, stream=0xDEAD0000)
    i.transfer(h, stream=None)  # each GPU's default stream
    i.wait(h, 30)
    # A host-only transfer takes any stream and ignores it: it has no GPU memory to order.
    ones = np.ones(4096, np.uint8)
    i.register_memory(ones)
    hh = i.initialize_xfer("WRITE", [ones], [remote], "target")
    i.transfer(hh, stream=12345)
    i.wait(hh, 30)


def test_the_callers_current_device_is_left_alone(pair: Any) -> None:
    """Registration, transfer and wait on stand-in GPU 1 leave the calling thread's current
    device where the application put it (torch's next allocation would otherwise land on the
    wrong GPU), and a thread that never chose one still has none."""
    t, i = pair
    gpu.set_current_device(0)
    try:
        n = MiB + 1
        remote = np.zeros(n, np.uint8)
        t.register_memory(remote)
        src = DeviceBuffer(n, device=1, kind=SI)
        src.copy_from_host(pattern(n, 4))
        assert gpu.current_device() == 0
        i.register_memory(src)
        assert gpu.current_device() == 0
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        for op in ("WRITE", "READ"):
            h = i.initialize_xfer(op, [src], [remote], "target")
            i.transfer(h)
            assert gpu.current_device() == 0, f"{op}: transfer()"
            i.wait(h, 30)
            assert gpu.current_device() == 0, f"{op}: wait()"
            i.transfer_sync(h, 30)
            assert gpu.current_device() == 0, f"{op}: transfer_sync()"
            i.release_xfer_handle(h)
        seen: list[Any] = []

        def fresh() -> None:
            h = i.initialize_xfer("WRITE", [src], [remote], "target")
            i.transfer_sync(h, 30)
            i.release_xfer_handle(h)
            seen.append(gpu.current_device())

        th = threading.Thread(target=fresh)
        th.start()
        th.join(60)
        assert seen == [None], "a thread that never chose a device still has none"
    finally:
        gpu.set_current_device(None)


class _CAI:
    """A CUDA array whose producer names its stream (CUDA Array Interface v3)."""

    def __init__(self, b: DeviceBuffer, stream: int):
        self.b, self.stream = b, stream

    @property
    def __cuda_array_interface__(self) -> dict:
        d = dict(self.b.__cuda_array_interface__)
        d["stream"] = self.stream
        return d


def test_registration_synchronises_with_the_stream_a_cuda_array_names() -> None:
    a = multirail.Agent("reg", {"gpu": SI})
    try:
        n = MiB
        b = DeviceBuffer(n, kind=SI)
        new = pattern(n, 8)
        s = produce_later(b, new, 0.3)
        a.register_memory(_CAI(b, s.handle))
        # Registration returned after the producer: the data is there (read on another stream).
        assert np.array_equal(b.to_host(), new)
        with pytest.raises(errors.InvalidArgumentError, match="stream"):
            a.register_memory(_CAI(DeviceBuffer(64, kind=SI), 0))
        s.close()
    finally:
        a.close()


def _settle(value: Any, quiet: float = 0.3, limit: float = 10.0) -> None:
    """Wait (bounded) until `value()` has not changed for `quiet` seconds."""
    import time

    end, last, since = time.monotonic() + limit, value(), time.monotonic()
    while time.monotonic() < end and time.monotonic() - since < quiet:
        time.sleep(0.05)
        v = value()
        if v != last:
            last, since = v, time.monotonic()


def test_pools_are_pinned_at_registration_and_reused_across_connections() -> None:
    """Registration of the first GPU region pins the staging pools (nothing is pinned
    mid-transfer), and a connection that closes gives its pools back: a new agent's transfers
    reuse them (no cudaMallocHost, and no cudaFreeHost, which can wait for the whole device)."""
    n = 2 * MiB + 1
    tdev, idev = 5, 6  # devices of their own: the stand-in counts pinned allocations per device
    t = multirail.Agent("target", {"gpu": SI})
    remote = DeviceBuffer(n, device=tdev, kind=SI)
    remote.copy_from_host(pattern(n, 1))
    t_before = gpu.info(tdev, SI)["pinned_allocs"]
    t.register_memory(remote)
    t_pinned = gpu.info(tdev, SI)["pinned_allocs"]
    assert t_pinned > t_before, "registration pinned the pools"
    local = DeviceBuffer(n, device=idev, kind=SI)
    try:
        for k in range(2):  # the second initiator reuses what the first gave back
            i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
            try:
                i.register_memory(local)
                i_pinned = gpu.info(idev, SI)["pinned_allocs"]
                if k == 0:
                    first = i_pinned
                else:
                    assert i_pinned == first, "the second agent pinned nothing: it reused the first's pools"
                i.fetch_remote_metadata("target", "127.0.0.1", t.port)
                for op in ("READ", "WRITE", "READ"):
                    h = i.initialize_xfer(op, [local], [remote], "target")
                    i.transfer(h)
                    i.wait(h, 30)
                    i.release_xfer_handle(h)
                assert gpu.info(idev, SI)["pinned_allocs"] == i_pinned, f"round {k}: pinned mid-transfer"
                assert gpu.info(tdev, SI)["pinned_allocs"] == t_pinned, f"round {k}: the target pinned mid-transfer"
                assert np.array_equal(local.to_host(), pattern(n, 1))
            finally:
                i.close()
            # The connection threads give their pools back as they exit, just after close().
            _settle(lambda: gpu.info(idev, SI)["idle_pool_bytes"])
        assert gpu.info(idev, SI)["idle_pool_bytes"] > 0, "closed connections gave their pools back"
    finally:
        t.close()


def test_staging_pipelines_across_chunks() -> None:
    """A multi-chunk transfer of GPU memory runs through one staging pipeline per connection and
    direction instead of filling and draining at every 1 MiB planner chunk: the initiator's
    WRITE sender takes the next chunk while the current one is on the wire, the target serving
    READs takes the requests queued behind, and both directions stay byte-exact."""
    import os

    n = 16 * MiB + 123
    dev = 7  # opened here first, with slow copies (the rate is read when a device is first opened)
    old = os.environ.get("MULTIRAIL_STANDIN_RATE")
    os.environ["MULTIRAIL_STANDIN_RATE"] = str(400e6)
    try:
        src = DeviceBuffer(n, device=dev, kind=SI)
    finally:
        if old is None:
            del os.environ["MULTIRAIL_STANDIN_RATE"]
        else:
            os.environ["MULTIRAIL_STANDIN_RATE"] = old
    dst = DeviceBuffer(n, device=dev, kind=SI)
    data = pattern(n, 12)
    src.copy_from_host(data)
    with multirail.Agent("target", {"gpu": SI}) as t, multirail.Agent("initiator", {"gpu": SI, "timeout": 10.0}) as i:
        t.register_memory(src)
        i.register_memory(dst)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        h = i.initialize_xfer("READ", [dst], [src], "target")
        i.transfer(h)
        i.wait(h, 60)
        assert np.array_equal(dst.to_host(), data)
        served = next(r for r in t.served_stats() if r["peer"] == "initiator")["staging"]
        assert served["overlapped"] > 0, served  # the target's READ sender took queued requests
        new = pattern(n, 13)
        dst.copy_from_host(new)
        h2 = i.initialize_xfer("WRITE", [dst], [src], "target")
        i.transfer(h2)
        i.wait(h2, 60)
        assert np.array_equal(src.to_host(), new)
        st = i.rail_stats("target")[0]["staging"]
        assert st["overlapped"] > 0, st  # the initiator's WRITE sender took the next chunks
        assert st["d2h"]["bytes"] == n and st["h2d"]["bytes"] == n, st


def test_transfer_returns_at_once_while_the_producer_runs(pair: Any) -> None:
    """Ordering after the stream does not block the caller: transfer() returns while the
    producer is still queued (the post enters the link once it is done), and a release while it
    waits means the transfer never starts."""
    import time

    t, i = pair
    n = MiB
    remote = np.zeros(n, np.uint8)
    t.register_memory(remote)
    src = DeviceBuffer(n, kind=SI)
    i.register_memory(src)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    new = pattern(n, 31)
    s = produce_later(src, new, delay=2.0)
    try:
        h = i.initialize_xfer("WRITE", [src], [remote], "target")
        t0 = time.monotonic()
        i.transfer(h, stream=s)
        assert time.monotonic() - t0 < 1.5, "transfer() waited for the producer"
        assert i.check_xfer_state(h) == multirail.XferState.IN_PROGRESS
        i.wait(h, 30)
        assert np.array_equal(remote, new)
        # Released while waiting for the stream: never starts, the memory is left alone.
        remote[:] = 0
        s.sleep(1.0)
        h2 = i.initialize_xfer("WRITE", [src], [remote], "target")
        i.transfer(h2, stream=s)
        i.release_xfer_handle(h2)
    finally:
        s.close()
    time.sleep(0.2)
    assert not remote.any(), "a released transfer wrote after all"
