"""A serving node's GPUs on the stand-in (issue 35): several devices with per-device memory that
another device's kernels reach only with peer access (a touch without it is a sticky illegal
address, as on hardware), graph capture in global mode, failing event queries, and runtime calls
that make a context on device 0 on a thread that has none. Each test fails on an engine with the
defect it names (docs/gpu.md, "Several GPUs")."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from conftest import engine_available, pattern
from gpu_peer import Target

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

if engine_available():
    import multirail
    from multirail import errors, gpu
    from multirail.gpu import DeviceBuffer

MiB = 1 << 20
SI = "standin"
# In-process tests use stand-in GPUs 20-25, which no other test file uses (the stand-in counts
# allocations per device, and test_gpu_hazards checks those counts on its own devices).
PAGE = 4096
PAGES = 64

# KV pages between two GPUs by CUDA IPC: the initiator's buffer on `ldev`, the target's on
# another GPU; page k goes to remote slot PAGES-1-k (no two adjacent: one copy each, so the
# batch goes to the gather kernel). Prints what it saw as JSON.
IPC_KV = r"""
import json, sys
import numpy as np
import multirail
from multirail import gpu
from multirail.gpu import DeviceBuffer
port, addr, ldev, page, pages = (int(a) for a in sys.argv[1:6])
n = page * pages
i = multirail.Agent("initiator", {"gpu": "standin", "timeout": 5.0})
src = DeviceBuffer(n, device=ldev, kind="standin")
back = DeviceBuffer(n, device=ldev, kind="standin")
src.copy_from_host(np.frombuffer(bytes((k * 7 + 3) % 251 for k in range(n)), np.uint8))
i.register_memory(src)
i.register_memory(back)
i.fetch_remote_metadata("target", "127.0.0.1", port)
rd = i.get_xfer_descs([(addr + (pages - 1 - k) * page, page, 0) for k in range(pages)], "VRAM")
out = {"ok": True}
try:
    for op, buf in (("WRITE", src), ("READ", back)):
        ld = i.get_xfer_descs([(buf.addr + k * page, page, ldev) for k in range(pages)], "VRAM")
        h = i.initialize_xfer(op, ld, rd, "target")
        i.transfer_sync(h, 30)
        i.release_xfer_handle(h)
    out["round_trip"] = bool(np.array_equal(back.to_host(), src.to_host()))
except Exception as e:
    out = {"ok": False, "error": type(e).__name__ + ": " + str(e)}
out["counters"] = {k: v for k, v in i.peer_counters("target").items() if k.startswith("ipc_")}
out["contexts"] = gpu.standin_contexts()
out["peers"] = gpu.standin_peers()
out["sticky"] = [d for d in range(2) if gpu.standin_sticky(d)]
i.close()
print(json.dumps(out), flush=True)
"""


def _run(script: str, args: list[Any], env: dict[str, str]) -> dict:
    cp = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=120,
                        env={**os.environ, **env})
    assert cp.returncode == 0, cp.stderr
    return {**json.loads(cp.stdout.strip().splitlines()[-1]), "stderr": cp.stderr}


def _expected_remote() -> bytes:
    data = bytes((k * 7 + 3) % 251 for k in range(PAGE * PAGES))
    return b"".join(data[(PAGES - 1 - s) * PAGE:(PAGES - s) * PAGE] for s in range(PAGES))


def test_ipc_kv_pages_between_two_gpus_run_on_the_local_buffers_gpu() -> None:
    """Target's memory on GPU 1, the initiator's KV pages on GPU 0, every GPU visible to both
    (one process per GPU, as torchrun or vLLM run): the handle is opened on GPU 0 with peer
    access to GPU 1, the gather kernel runs on GPU 0, the bytes land, both ways, and the
    initiator makes no context on GPU 1. An engine that opens the handle on the exporter's GPU
    runs the kernel there against GPU 0's memory: a sticky illegal address on GPU 1."""
    env = {"MULTIRAIL_STANDIN_DEVICES": "2"}
    tgt = Target(PAGE * PAGES, off=0, device=1, env=env)
    try:
        got = _run(IPC_KV, [tgt.port, tgt.addr, 0, PAGE, PAGES], env)
        assert got["ok"], got
        assert got["round_trip"], got
        assert tgt.ask("digest") == hashlib.sha256(_expected_remote()).hexdigest()
    finally:
        tgt.close()
    c = got["counters"]
    assert c["ipc_transfers"] == 2 and c["ipc_devices"] == [0], got
    assert c["ipc_copy_path"].startswith("gather-copy kernel"), got
    assert got["sticky"] == [], got
    assert got["contexts"] == [0], "no context on the GPU this process does not use"
    assert got["peers"] == [[0, 1]], got


def test_gpus_without_peer_access_stage_and_say_so_loudly() -> None:
    """GPUs that cannot reach each other (no P2P): the transfer is staged, byte-exact, the
    reason names both GPUs in `ipc_fallback_reason`, and a warning goes to stderr once."""
    env = {"MULTIRAIL_STANDIN_DEVICES": "2", "MULTIRAIL_STANDIN_PEERS": "none"}
    tgt = Target(PAGE * PAGES, off=0, device=1, env=env)
    try:
        got = _run(IPC_KV, [tgt.port, tgt.addr, 0, PAGE, PAGES], env)
        assert got["ok"] and got["round_trip"], got
        assert tgt.ask("digest") == hashlib.sha256(_expected_remote()).hexdigest()
    finally:
        tgt.close()
    c = got["counters"]
    assert c["ipc_transfers"] == 0, got
    assert "GPU 0" in c["ipc_fallback_reason"] and "GPU 1" in c["ipc_fallback_reason"], got
    assert got["stderr"].count("CUDA IPC is not used") == 1, got["stderr"]
    assert got["sticky"] == [] and 1 not in got["contexts"], got


def test_an_ordinal_beyond_the_devices_is_refused() -> None:
    code = "from multirail.gpu import DeviceBuffer\ntry:\n    DeviceBuffer(4096, device=2, kind='standin')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env={**os.environ, "MULTIRAIL_STANDIN_DEVICES": "2"})
    assert "GpuError" in cp.stdout and "2" in cp.stdout, (cp.stdout, cp.stderr)


def _write_behind_producer(t: Any, i: Any, dev: int, fail: str) -> tuple[Exception | None, bool]:
    """A WRITE from GPU memory whose producer is still queued, with the next `fail` call
    ("query" or "synchronize") on that GPU failing: (what the transfer raised, whether the
    target got the stale bytes)."""
    n = MiB + 7
    remote = np.zeros(n, np.uint8)
    t.register_memory(remote)
    src = DeviceBuffer(n, device=dev, kind=SI)
    src.copy_from_host(np.full(n, 0xEE, np.uint8))  # stale
    i.register_memory(src)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    s = gpu.Stream(dev, SI)
    s.sleep(0.5)
    src.copy_from_host(pattern(n, 5), stream=s)
    h = i.initialize_xfer("WRITE", [src], [remote], "target")
    raised = None
    try:
        gpu.standin_fail(fail, 1, dev)
        try:
            i.transfer(h, stream=s)
            i.wait(h, 30)
        except Exception as e:  # noqa: BLE001 - returned for the caller to check
            raised = e
    finally:
        gpu.standin_fail(fail, 0, dev)
        s.close()
        i.release_xfer_handle(h)
    return raised, bool(remote[0] == 0xEE)


def test_a_failed_event_query_fails_the_transfer(standin_pair: Any) -> None:
    """`cudaEventQuery` on the producer's event fails (another thread capturing in global mode,
    a sticky error): the transfer fails with that error, it does not count as "ready" and send
    the bytes the producer has not written yet."""
    t, i = standin_pair
    raised, stale = _write_behind_producer(t, i, 20, "query")
    assert isinstance(raised, errors.GpuError) and "cudaEventQuery" in str(raised), (raised, stale)


def test_a_failed_wait_fails_the_transfer(standin_pair: Any) -> None:
    t, i = standin_pair
    raised, _ = _write_behind_producer(t, i, 21, "synchronize")
    assert isinstance(raised, errors.GpuError) and "cudaEventSynchronize" in str(raised), raised


def test_a_failed_event_query_fails_an_ipc_transfer() -> None:
    n = MiB + 3
    tgt = Target(n)
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
    try:
        src = DeviceBuffer(n, device=22, kind=SI)
        i.register_memory(src)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        rd = i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM")
        s = gpu.Stream(22, SI)
        s.sleep(0.3)
        h = i.initialize_xfer("WRITE", [src], rd, "target")
        gpu.standin_fail("query", 1, 22)
        try:
            with pytest.raises(errors.GpuError, match="cudaEventQuery"):
                i.transfer(h, stream=s)
                i.wait(h, 30)
        finally:
            gpu.standin_fail("query", 0, 22)
            s.close()
            i.release_xfer_handle(h)
    finally:
        i.close()
        tgt.close()


def test_a_capturing_stream_is_refused_and_the_capture_survives(standin_pair: Any) -> None:
    t, i = standin_pair
    remote = np.zeros(4096, np.uint8)
    t.register_memory(remote)
    src = DeviceBuffer(4096, device=23, kind=SI)
    i.register_memory(src)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    h = i.initialize_xfer("WRITE", [src], [remote], "target")
    s = gpu.Stream(23, SI)
    s.begin_capture()
    try:
        with pytest.raises(errors.InvalidArgumentError, match="captured into a CUDA graph"):
            i.transfer(h, stream=s)
    finally:
        s.end_capture()  # raises if the refusal invalidated the capture
        s.close()
    i.transfer_sync(h, 30)  # refused, not broken: the handle still posts
    i.release_xfer_handle(h)


def test_transfers_do_not_invalidate_a_graph_captured_on_another_thread() -> None:
    """An application thread captures a graph in global mode (torch's default) while staged
    and IPC transfers of GPU memory run: the engine's event queries and syncs, allocations and
    stream creation happen in relaxed mode, so the capture ends valid."""
    n = 2 * MiB + 1
    tgt = Target(n)
    t = multirail.Agent("host-target", {"gpu": SI})
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
    cap = gpu.Stream(24, SI)
    try:
        remote = np.zeros(n, np.uint8)
        t.register_memory(remote)
        src = DeviceBuffer(n, device=24, kind=SI)
        src.copy_from_host(pattern(n, 11))
        cap.begin_capture()
        err: list[BaseException] = []

        def run() -> None:
            try:
                i.register_memory(src)
                i.fetch_remote_metadata("host-target", "127.0.0.1", t.port)
                i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
                for peer, rd in (("host-target", [remote]), ("target", i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM"))):
                    for op in ("WRITE", "READ"):
                        h = i.initialize_xfer(op, [src], rd, peer)
                        i.transfer(h)
                        i.wait(h, 30)
                        i.release_xfer_handle(h)
            except BaseException as e:  # noqa: BLE001 - reported below
                err.append(e)

        th = threading.Thread(target=run)
        th.start()
        th.join(120)
        assert not th.is_alive() and not err, err
        assert i.peer_counters("target")["ipc_transfers"] == 2
        cap.end_capture()
    finally:
        cap.close()
        i.close()
        t.close()
        tgt.close()


CONTEXTS = r"""
import json, threading
import numpy as np
import multirail
from multirail import gpu
from multirail.gpu import DeviceBuffer
t = multirail.Agent("target", {"gpu": "standin"})
i = multirail.Agent("initiator", {"gpu": "standin", "timeout": 5.0})
n = (1 << 20) + 3
remote = np.zeros(n, np.uint8)
t.register_memory(remote)
buf = DeviceBuffer(n, device=1, kind="standin")
buf.copy_from_host(np.arange(n, dtype=np.uint64).astype(np.uint8))
seen = {}
def fresh():
    # A thread with no current device (an asyncio executor, a NIXL caller thread).
    i.register_memory(buf)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    for op in ("WRITE", "READ"):
        h = i.initialize_xfer(op, [buf], [remote], "target")
        i.transfer(h)
        i.wait(h, 30)
        i.release_xfer_handle(h)
    seen["current"] = gpu.current_device()
th = threading.Thread(target=fresh)
th.start()
th.join(60)
seen["contexts"] = gpu.standin_contexts()
i.close()
t.close()
print(json.dumps(seen), flush=True)
"""


def test_no_context_is_made_on_gpu0_from_a_thread_without_one() -> None:
    """Registration, post and wait for GPU 1 memory from a fresh thread: nothing the engine
    calls makes a context on GPU 0 (the runtime makes one there for a call on a thread with no
    current context; classification goes through the driver API, the rest through the device
    guard)."""
    got = _run(CONTEXTS, [], {"MULTIRAIL_STANDIN_DEVICES": "2"})
    assert got["contexts"] == [1], got
    assert got["current"] is None, got


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_persistent_staging_error_fails_the_transfer_not_the_rails(standin_pair: Any, op: str) -> None:
    """Every staging copy on the GPU fails (a broken device, a sticky error): the GPU WRITE from
    it, or the READ into it, fails promptly with the CUDA error, the rails stay up (a device
    error is not a network error: no rail goes down, is probed and readmitted, no chunk is
    reissued), and a host-memory transfer to the same peer posted at the same time completes
    with its bytes (docs/gpu.md, "Device errors"). A READ's payload that the error cut short is
    read and dropped, so its connection stays in step."""
    t, i = standin_pair
    dev, n = 25, 4 * MiB
    remote, host_remote = pattern(n, 5), np.zeros(n, np.uint8)
    t.register_memory(remote)
    t.register_memory(host_remote)
    buf = DeviceBuffer(n, device=dev, kind=SI)
    buf.copy_from_host(pattern(n, 9))
    hsrc = pattern(n, 11)
    i.register_memory(buf)
    i.register_memory(hsrc)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    hg = i.initialize_xfer(op, [buf], [remote], "target")
    hh = i.initialize_xfer("WRITE", [hsrc], [host_remote], "target")
    gpu.standin_fail("copy", device=dev, persistent=True)
    raised = None
    try:
        t0 = time.monotonic()
        i.transfer(hg)
        i.transfer(hh)
        try:
            i.wait(hg, 30)
        except Exception as e:  # noqa: BLE001 - checked below
            raised = e
        took = time.monotonic() - t0
        i.wait(hh, 30)
    finally:
        gpu.standin_fail("copy", 0, dev)
        i.release_xfer_handle(hg)
        i.release_xfer_handle(hh)
    assert isinstance(raised, errors.GpuError) and "cudaMemcpyAsync" in str(raised), raised
    assert took < 10, took
    assert np.array_equal(host_remote, hsrc)
    rails = i.rail_stats("target")
    assert all(r["up"] and r["times_down"] == 0 and r["reissued"] == 0 for r in rails), rails
    # The connection that carried the broken stream is still in step: the same transfer works.
    h2 = i.initialize_xfer(op, [buf], [remote], "target")
    i.transfer_sync(h2, 30)
    i.release_xfer_handle(h2)
    assert np.array_equal(remote, buf.to_host())


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_persistent_staging_error_on_the_target_fails_the_transfer_not_the_rails(standin_pair: Any, op: str) -> None:
    """Every staging copy on the target's GPU fails: a WRITE into its GPU region (H2D there) or a
    READ of it (D2H there) fails promptly with the target's error, the rails stay up, a
    host-memory transfer to the same peer completes, and once the device works again the same
    connection serves the same transfer (the target read and dropped the rest of the WRITE's
    payload, and answered a READ that had not begun with the error: the stream stayed in step)."""
    t, i = standin_pair
    dev, n = 26, 4 * MiB
    region = DeviceBuffer(n, device=dev, kind=SI)
    region.copy_from_host(pattern(n, 3))
    host_remote = np.zeros(n, np.uint8)
    t.register_memory(region)
    t.register_memory(host_remote)
    local, hsrc = pattern(n, 7), pattern(n, 11)
    i.register_memory(local)
    i.register_memory(hsrc)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    hg = i.initialize_xfer(op, [local], [region], "target")
    hh = i.initialize_xfer("WRITE", [hsrc], [host_remote], "target")
    gpu.standin_fail("copy", device=dev, persistent=True)
    raised = None
    try:
        t0 = time.monotonic()
        i.transfer(hg)
        i.transfer(hh)
        try:
            i.wait(hg, 30)
        except Exception as e:  # noqa: BLE001 - checked below
            raised = e
        took = time.monotonic() - t0
        i.wait(hh, 30)
    finally:
        gpu.standin_fail("copy", 0, dev)
        i.release_xfer_handle(hg)
        i.release_xfer_handle(hh)
    assert isinstance(raised, errors.MultirailError), raised
    assert "GPU staging failed on the target" in str(raised) and "cudaMemcpyAsync" in str(raised), raised
    assert took < 10, took
    assert np.array_equal(host_remote, hsrc)
    rails = i.rail_stats("target")
    assert all(r["up"] and r["times_down"] == 0 and r["reissued"] == 0 for r in rails), rails
    # The target counts the failed requests as refused, never as served: what it served is the
    # host WRITE alone.
    served = t.served_stats()
    total = {k: sum(r[k] for r in served) for k in ("bytes_read", "requests_read", "bytes_written")}
    assert total == {"bytes_read": 0, "requests_read": 0, "bytes_written": n}, (total, served)
    assert sum(r["refused_by_status"].get("Internal", 0) for r in served) >= 1, served
    h2 = i.initialize_xfer(op, [local], [region], "target")
    i.transfer_sync(h2, 30)
    i.release_xfer_handle(h2)
    assert np.array_equal(local, region.to_host())


DESTROY = r"""
import json, threading
from multirail import gpu
s = gpu.Stream(1, "standin")   # made on GPU 1 (this thread keeps no current device)
seen = {"before": gpu.standin_contexts()}
th = threading.Thread(target=s.close)   # destroyed on a thread with no context
th.start()
th.join(60)
seen["contexts"] = gpu.standin_contexts()
print(json.dumps(seen), flush=True)
"""


def test_destroying_a_stream_on_a_thread_without_a_context_makes_none_on_gpu0() -> None:
    """`cudaStreamDestroy` (and `cudaEventDestroy`) run on the device the object was made on,
    through the device guard: a destroy from a thread with no current context makes no context
    on GPU 0 (defect 4 of issue 35, the destroy paths)."""
    got = _run(DESTROY, [], {"MULTIRAIL_STANDIN_DEVICES": "2"})
    assert got["before"] == [1], got
    assert got["contexts"] == [1], got
