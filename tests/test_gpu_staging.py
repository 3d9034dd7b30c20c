"""GPU memory over tcp rails (issue 10), run in CI on the stand-in device: "device memory" is host
memory that only the device layer may touch, copies run on the stand-in's stream threads, and
the engine stages every chunk through its pinned bounce pools exactly as it does with CUDA
(crates/multirail/src/staging.rs). Only the CUDA calls themselves are left for the GPU machine
(`make test-gpu`, tests/test_gpu.py).

What must hold: DRAM<->VRAM and VRAM<->VRAM, READ and WRITE, byte-exact for odd sizes and
scattered pages; striped over several rails, surviving a rail dying mid-transfer; pools made
once per connection (no pinning per transfer) and bounded; rail_stats/served_stats saying which
path and what each stage did; every registration form (`__cuda_array_interface__`, DLPack
capsules, raw rows) recognised, and misuse refused with a GpuError; close() mid-transfer leaves
the device memory alone. Same host, two processes: CUDA IPC (the stand-in maps the peer's
memfd-backed "device memory" as CUDA maps an IPC handle), with fallback to staging.

Agents in one process stage even with IPC on: like CUDA, the stand-in refuses to open a handle
of its own process, so the in-process tests below exercise the staged path.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import pytest

from conftest import engine_available, pattern
from gpu_peer import Target as _Target

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

if engine_available():
    import multirail
    from multirail import errors
    from multirail.gpu import DeviceBuffer

MiB = 1 << 20
SI = "standin"


def buf(kind: str, data: np.ndarray) -> Any:
    """`data` in device memory (kind "V") or in a host array (kind "D")."""
    if kind == "D":
        return data.copy()
    b = DeviceBuffer(len(data), kind=SI)
    b.copy_from_host(data)
    return b


def host(b: Any) -> np.ndarray:
    return b.to_host() if isinstance(b, DeviceBuffer) else b


def run(i: Any, op: str, local: Any, remote: Any, timeout: float = 30) -> None:
    h = i.initialize_xfer(op, local, remote, "target")
    try:
        i.transfer(h)
        i.wait(h, timeout)
    finally:
        i.release_xfer_handle(h)


@pytest.fixture
def pair(standin_pair: tuple[Any, Any]) -> tuple[Any, Any]:
    return standin_pair


@pytest.mark.parametrize("n", [1, 4095, MiB + 7, 16 * MiB + 3])
@pytest.mark.parametrize("lk,rk", [("V", "V"), ("D", "V"), ("V", "D")])
def test_every_direction_byte_exact(pair: Any, n: int, lk: str, rk: str) -> None:
    t, i = pair
    remote, local = buf(rk, pattern(n, 1)), buf(lk, np.zeros(n, np.uint8))
    rr, lr = t.register_memory(remote), i.register_memory(local)
    assert (rr.mem_type, lr.mem_type) == ({"V": "VRAM", "D": "DRAM"}[rk], {"V": "VRAM", "D": "DRAM"}[lk])
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    run(i, "READ", [local], [remote])
    assert np.array_equal(host(local), pattern(n, 1))
    new = pattern(n, 2)
    if lk == "V":
        local.copy_from_host(new)
    else:
        local[:] = new
    run(i, "WRITE", [local], [remote])
    assert np.array_equal(host(remote), new)
    # The stages that must have run, on the side that ran them, and no others.
    st = i.rail_stats("target")[0]
    assert st["gpu_path"] == "staged" and "pinned" in st["gpu_path_reason"], st
    stg = st["staging"]
    assert stg["h2d"]["bytes"] == (n if lk == "V" else 0), stg  # READ landing in local VRAM
    assert stg["d2h"]["bytes"] == (n if lk == "V" else 0), stg  # WRITE sent from local VRAM
    served = next(r for r in t.served_stats() if r["peer"] == "initiator")["staging"]
    assert served["d2h"]["bytes"] == (n if rk == "V" else 0), served  # READ served from VRAM
    assert served["h2d"]["bytes"] == (n if rk == "V" else 0), served  # WRITE landed in VRAM


def test_scattered_pages_vram_to_vram(pair: Any) -> None:
    """512 shuffled 4 KiB pages on each side, both in GPU memory (a paged KV cache): every page
    lands where its descriptor says, both ways. The pages travel in vectored requests (many
    pages per request, gathered into and scattered from the pinned buffers on both sides), not
    one request per page."""
    t, i = pair
    page, n = 4096, 512
    remote, local = buf("V", pattern(page * n, 3)), buf("V", np.zeros(page * n, np.uint8))
    t.register_memory(remote)
    i.register_memory(local)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    rng = np.random.default_rng(7)
    lp, rp = rng.permutation(n), rng.permutation(n)
    ld = i.get_xfer_descs([(local.addr + int(p) * page, page, 0) for p in lp], "VRAM")
    rd = i.get_xfer_descs([(remote.addr + int(p) * page, page, 0) for p in rp], "VRAM")
    run(i, "READ", ld, rd)
    lv, rv = host(local).reshape(n, page), host(remote).reshape(n, page)
    assert all(np.array_equal(lv[a], rv[b]) for a, b in zip(lp, rp))
    local.copy_from_host(pattern(page * n, 8))
    run(i, "WRITE", ld, rd)
    lv, rv = host(local).reshape(n, page), host(remote).reshape(n, page)
    assert all(np.array_equal(lv[a], rv[b]) for a, b in zip(lp, rp))
    served = next(r for r in t.served_stats() if r["peer"] == "initiator")
    reqs = served["requests_read"] + served["requests_written"]
    assert reqs <= 2 * 32, f"{reqs} requests for 2 x {n} pages: not vectored ({served})"
    assert served["staging"]["d2h"]["bytes"] == page * n and served["staging"]["h2d"]["bytes"] == page * n, served
    st = i.rail_stats("target")[0]["staging"]
    assert st["d2h"]["bytes"] == page * n and st["h2d"]["bytes"] == page * n, st


def test_pools_are_made_once_and_bounded(pair: Any) -> None:
    """After the first transfer each way, 20 more pin nothing and allocate no pool: the pinned
    bytes stay what the pools hold (buffers x size per connection and direction)."""
    t, i = pair
    n = 8 * MiB
    remote, local = buf("V", pattern(n, 4)), buf("V", np.zeros(n, np.uint8))
    t.register_memory(remote)
    i.register_memory(local)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    run(i, "READ", [local], [remote])
    run(i, "WRITE", [local], [remote])
    before = multirail.gpu.info(0, SI)["pinned_allocs"]
    for k in range(10):
        run(i, "READ", [local], [remote])
        run(i, "WRITE", [local], [remote])
    assert multirail.gpu.info(0, SI)["pinned_allocs"] == before, "pinned memory allocated per transfer"
    st = i.rail_stats("target")[0]["staging"]
    pool = 4 * (1 << 20)
    assert st["pools"] == 2 and st["pool_bytes"] == 2 * pool, st  # one send, one receive pool
    served = next(r for r in t.served_stats() if r["peer"] == "initiator")["staging"]
    assert served["pools"] == 2 and served["pool_bytes"] == 2 * pool, served
    # 22 transfers of 8 MiB in 1 MiB chunks: every byte went through each stage once; a
    # receiver lands each chunk as a 3/4 and a 1/4 piece (the short last H2D: pipeline.rs).
    assert st["h2d"]["bytes"] == st["d2h"]["bytes"] == 11 * n, st
    assert st["h2d"]["ops"] == 2 * 11 * n // (1 << 20), st
    assert st["wire"]["bytes"] == 22 * n, st


def test_pool_shape_is_configurable_and_checked() -> None:
    with multirail.Agent("a", {"gpu": SI, "staging_buffers": 2, "staging_buffer_size": 64 << 10}) as t, \
            multirail.Agent("b", {"gpu": SI, "staging_buffers": 3, "staging_buffer_size": 1 << 20}) as i:
        n = 3 * MiB + 5
        remote, local = buf("V", pattern(n, 5)), buf("V", np.zeros(n, np.uint8))
        t.register_memory(remote)
        i.register_memory(local)
        i.fetch_remote_metadata("a", "127.0.0.1", t.port)
        h = i.initialize_xfer("READ", [local], [remote], "a")
        i.transfer(h)
        i.wait(h, 30)
        assert np.array_equal(host(local), pattern(n, 5))
        st = i.rail_stats("a")[0]
        assert st["staging"]["pool_bytes"] == 3 << 20 and "3 x 1024 KiB" in st["gpu_path_reason"], st
        served = next(r for r in t.served_stats() if r["peer"] == "b")["staging"]
        assert served["pool_bytes"] == 2 * (64 << 10), served
    for bad in ({"staging_buffers": 1}, {"staging_buffer_size": 100}, {"gpu": "rocm"}):
        with pytest.raises(ValueError):
            multirail.Agent("x", bad)


def test_striped_over_two_rails_survives_one_dying() -> None:
    """Two rails; rail 1 is killed 300 ms in and refused for 1 s while VRAM->VRAM READs and
    WRITEs run back to back: each completes byte-exact (chunks caught mid-staging are reissued
    on rail 0), rail 1 is readmitted and stages again."""
    rails = ["127.0.0.1", "127.0.0.1"]
    t = multirail.Agent("target", {"gpu": SI, "rails": rails})
    i = multirail.Agent("initiator", {"gpu": SI, "rails": rails, "faults": "1:kill@300ms+1s", "timeout": 5.0,
                                      "stall_timeout": 0.5, "chunk_size": 256 << 10})
    try:
        n = 16 * MiB
        remote, local = buf("V", pattern(n, 6)), buf("V", np.zeros(n, np.uint8))
        t.register_memory(remote)
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        snaps, k, end = [], 0, time.monotonic() + 3.0
        while time.monotonic() < end or k < 4:
            k += 1
            if k % 2:
                local.copy_from_host(np.zeros(n, np.uint8))
                run(i, "READ", [local], [remote], 20)
            else:
                local.copy_from_host(pattern(n, 100 + k))
                run(i, "WRITE", [local], [remote], 20)
            assert np.array_equal(host(local), host(remote)), f"transfer {k} not byte-exact"
            snaps.append(i.rail_stats("target"))
        assert any(not s[1]["up"] for s in snaps), "rail 1 never went down"
        last = snaps[-1]
        assert last[1]["up"] and last[1]["readmissions"] >= 1, last[1]
        down_at = next(j for j, s in enumerate(snaps) if not s[1]["up"])
        assert last[1]["staging"]["wire"]["bytes"] > snaps[down_at][1]["staging"]["wire"]["bytes"], \
            "rail 1 staged nothing after readmission"
        assert all(r["staging"]["h2d"]["bytes"] > 0 and r["staging"]["d2h"]["bytes"] > 0 for r in last), last
    finally:
        i.close()
        t.close()


def test_close_mid_transfer_leaves_device_memory_alone() -> None:
    """close() while a large READ into local VRAM is landing: once it returns, no staged copy
    writes that memory any more (the pools wait for their copies before they go)."""
    t = multirail.Agent("target", {"gpu": SI})
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
    n = 256 * MiB
    try:
        remote, local = buf("V", pattern(4 * MiB, 9)), DeviceBuffer(n, kind=SI)
        big = DeviceBuffer(n, kind=SI)
        big.copy_from_host(np.tile(pattern(4 * MiB, 9), n // (4 * MiB)))
        t.register_memory(big)
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        h = i.initialize_xfer("READ", [local], [big], "target")
        i.transfer(h)
        deadline = time.monotonic() + 10
        while i.rail_stats("target")[0]["staging"]["h2d"]["bytes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        landed = i.rail_stats("target")[0]["staging"]["h2d"]["bytes"]
        i.close()
        assert 0 < landed < n, f"close() did not come mid-transfer ({landed} of {n} landed)"
        a = local.to_host()
        time.sleep(0.3)
        assert np.array_equal(a, local.to_host()), "device memory changed after close() returned"
        del remote
    finally:
        i.close()
        t.close()


def test_bad_descriptors_into_a_peers_gpu_region_are_refused(pair: Any) -> None:
    t, i = pair
    remote, local = buf("V", pattern(MiB, 10)), buf("V", np.zeros(2 * MiB, np.uint8))
    t.register_memory(remote)
    i.register_memory(local)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    with pytest.raises(errors.MultirailError):
        i.initialize_xfer("READ", [(local.addr, 2 * MiB, 0)], [(remote.addr, 2 * MiB, 0)], "target")
    with pytest.raises(errors.MultirailError):
        i.initialize_xfer("READ", [(local.addr + 2 * MiB - 10, 20, 0)], [(remote.addr, 20, 0)], "target")
    run(i, "READ", [(local.addr, MiB, 0)], [(remote.addr, MiB, 0)])  # still serving
    assert np.array_equal(local.to_host()[:MiB], pattern(MiB, 10))


# ------------------------------------------------------------------ registration forms


class _CudaArray:
    """A minimal `__cuda_array_interface__` producer (what CuPy and Numba arrays expose)."""

    def __init__(self, b: Any, typestr: str, shape: tuple, strides: tuple | None = None):
        self._b, self._ts, self._shape, self._strides = b, typestr, shape, strides

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"data": (self._b.addr, False), "typestr": self._ts, "shape": self._shape,
                "strides": self._strides, "version": 3}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLManaged(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _CudaDLPack:
    """A CUDA DLPack producer (device type 2, as torch/CuPy export GPU tensors) over a device
    buffer, built by hand: float32, shape (rows, cols), optional byte offset."""

    def __init__(self, b: Any, rows: int, cols: int, offset: int = 0, strides: tuple | None = None):
        self._shape = (ctypes.c_int64 * 2)(rows, cols)
        self._strides = (ctypes.c_int64 * 2)(*strides) if strides else None
        self._t = _DLManaged(b.addr, _DLDevice(2, 0), 2, _DLDataType(2, 32, 1), self._shape,
                             self._strides, offset, None, None)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._t), b"dltensor", None)


def test_cuda_array_interface_and_dlpack_register_as_vram() -> None:
    with multirail.Agent("a", {"gpu": SI}) as a:
        b = DeviceBuffer(64 * 1024, kind=SI)
        r = a.register_memory(_CudaArray(b, "<f4", (128, 128)))
        assert r.mem_type == "VRAM" and r[0] == (b.addr, 64 * 1024, 0)
        d = _CudaDLPack(b, 64, 128, offset=4096)
        r2 = a.register_memory(d)
        assert r2.mem_type == "VRAM" and r2[0] == (b.addr + 4096, 64 * 128 * 4, 0)
        r3 = a.register_memory(d.__dlpack__())  # a bare capsule
        assert r3[0] == r2[0]
        with pytest.raises(errors.InvalidArgumentError, match="contiguous"):
            a.register_memory(_CudaArray(b, "<f4", (64, 64), (512, 4)))  # every other row
        with pytest.raises(errors.InvalidArgumentError, match="contiguous"):
            a.register_memory(_CudaDLPack(b, 64, 64, strides=(128, 1)))


def test_misuse_of_gpu_memory_is_a_gpu_error() -> None:
    with multirail.Agent("a", {"gpu": SI}) as a:
        host_arr = np.zeros(4096, np.uint8)
        with pytest.raises(errors.GpuError, match="not GPU memory"):
            a.register_memory([(host_arr.ctypes.data, 4096, 0)], "VRAM")
        b = DeviceBuffer(8192, kind=SI)
        with pytest.raises(errors.GpuError, match="not GPU memory"):  # runs past the allocation
            a.register_memory([(b.addr, 8192 + 4096 * 4, 0)], "VRAM")
        # Each stand-in device knows only its own allocations (CUDA would say "memory of GPU 0").
        with pytest.raises(errors.GpuError, match=r"not GPU memory \(stand-in 1"):
            a.register_memory([(b.addr, 8192, 1)], "VRAM")
        a.register_memory([(b.addr, 8192, 0)], "VRAM")  # right device
        b.free()
        with pytest.raises(errors.InvalidArgumentError, match="freed"):
            b.copy_from_host(np.zeros(1, np.uint8))
        with pytest.raises(errors.InvalidArgumentError, match="do not fit"):
            DeviceBuffer(16, kind=SI).copy_from_host(np.zeros(17, np.uint8))


def test_device_kind_must_match_the_agents() -> None:
    """A stand-in buffer is not GPU memory to CUDA: an agent on CUDA refuses it with the cause
    (here: no CUDA runtime or no GPU)."""
    b = DeviceBuffer(4096, kind=SI)
    with multirail.Agent("a", {"gpu": "cuda"}) as a:
        with pytest.raises(errors.GpuError):
            a.register_memory(b)


def test_ucx_agents_stage_gpu_memory_over_the_same_rails() -> None:
    """ucx rails take GPU memory directly only with GPUDirect RDMA (not here: this UCX has no
    CUDA transport). Then a ucx agent stages it over the same rails through a tcp link of its
    own, while host memory keeps going over UCX; rail_stats says so and why."""
    try:
        t = multirail.Agent("target", {"transport": "ucx", "gpu": SI, "gpu_ipc": False, "auth_secret": "s"})
    except errors.TransportUnavailableError as e:
        pytest.skip(f"UCX cannot be loaded here: {e}")
    i = multirail.Agent("initiator", {"transport": "ucx", "gpu": SI, "timeout": 5.0, "auth_secret": "s"})
    try:
        n = 4 * MiB + 9
        remote, local = buf("V", pattern(n, 11)), buf("V", np.zeros(n, np.uint8))
        hostmem, hlocal = pattern(MiB, 12), np.zeros(MiB, np.uint8)
        for m in (remote, hostmem):
            t.register_memory(m)
        for m in (local, hlocal):
            i.register_memory(m)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
        run(i, "READ", [hlocal], [hostmem])  # host memory over ucx
        assert np.array_equal(hlocal, hostmem)
        run(i, "READ", [local], [remote])
        assert np.array_equal(host(local), pattern(n, 11))
        local.copy_from_host(pattern(n, 13))
        run(i, "WRITE", [local], [remote])
        assert np.array_equal(host(remote), pattern(n, 13))
        st = i.rail_stats("target")[0]
        assert st["transport"].startswith("ucx"), st
        assert st["gpu_path"] == "staged", st
        assert "cannot take GPU memory directly" in st["gpu_path_reason"] and "no CUDA transport" in st["gpu_path_reason"], st
        assert st["staging"]["h2d"]["bytes"] == n and st["staging"]["d2h"]["bytes"] == n, st
        # Shuffled GPU pages on both sides go vectored over that tcp link too: far fewer
        # requests than pages, every page where its descriptor says.
        page, k = 4096, 256
        rng = np.random.default_rng(14)
        lp, rp = rng.permutation(k), rng.permutation(k)
        ld = [(local.addr + int(p) * page, page, 0) for p in lp]
        rd = [(remote.addr + int(p) * page, page, 0) for p in rp]
        before = next(r for r in t.served_stats() if r["peer"] == "initiator")
        run(i, "READ", ld, rd)
        lv, rv = host(local)[: k * page].reshape(k, page), host(remote)[: k * page].reshape(k, page)
        assert all(np.array_equal(lv[a], rv[b]) for a, b in zip(lp, rp))
        local.copy_from_host(pattern(n, 15))
        run(i, "WRITE", ld, rd)
        lv, rv = host(local)[: k * page].reshape(k, page), host(remote)[: k * page].reshape(k, page)
        assert all(np.array_equal(lv[a], rv[b]) for a, b in zip(lp, rp))
        after = next(r for r in t.served_stats() if r["peer"] == "initiator")
        reqs = sum(after[f] - before[f] for f in ("requests_read", "requests_written"))
        assert 0 < reqs <= 2 * 16, f"{reqs} requests for 2 x {k} pages: not vectored"
    finally:
        i.close()
        t.close()


# ------------------------------------------------------------------ CUDA IPC (same host)

def _sha(a: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(a.tobytes()).hexdigest()


@pytest.mark.parametrize("lk", ["V", "D"])
def test_ipc_between_processes_moves_no_byte_over_the_rails(lk: str) -> None:
    """Same host, two processes: READ and WRITE against the peer's GPU region (its whole
    allocation: only such regions go out by IPC) are device copies into its IPC mapping (D2D from local GPU memory,
    H2D/D2H from host memory): byte-exact, notification after the data, nothing on the rails."""
    n = 3 * MiB + 1
    tgt = _Target(n)
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
    try:
        local = buf(lk, np.zeros(n, np.uint8))
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        rd = i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM")
        run(i, "READ", [local], rd)
        assert _sha(host(local)) == tgt.ask("digest")
        new = pattern(n, 77)
        if lk == "V":
            local.copy_from_host(new)
        else:
            local[:] = new
        h = i.initialize_xfer("WRITE", [local], rd, "target", b"kv-ready")
        i.transfer(h)
        i.wait(h, 30)
        i.release_xfer_handle(h)
        assert tgt.ask("digest") == _sha(new)
        assert '"initiator": ["kv-ready"]' in tgt.ask("notifs")
        pc = i.peer_counters("target")
        assert pc["ipc_transfers"] == 2 and pc["ipc_bytes"] == 2 * n and pc["ipc_regions_mapped"] == 1, pc
        assert pc["ipc_fallback_reason"] == "", pc
        assert all(r["bytes"] == 0 for r in i.rail_stats("target")), i.rail_stats("target")
    finally:
        i.close()
        tgt.close()


@pytest.mark.parametrize("ipc,access,off,why", [(False, "rw", 0, "gpu_ipc=False"), (True, "ro", 0, "read-only"),
                                                (True, "rw", 12345, "part of a larger GPU allocation")])
def test_ipc_refused_by_the_target_falls_back_to_staging(ipc: bool, access: str, off: int, why: str) -> None:
    """A target with IPC off, a read-only region (an IPC mapping is writable), or a region inside a
    larger allocation (a handle maps the whole allocation, neighbours included; issue 33): the
    transfer is staged over the rails instead, byte-exact, and the reason is reported."""
    n = MiB + 3
    tgt = _Target(n, ipc=ipc, access=access, off=off)
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
    try:
        local = buf("V", np.zeros(n, np.uint8))
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        run(i, "READ", [local], i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM"))
        assert _sha(host(local)) == tgt.ask("digest")
        pc = i.peer_counters("target")
        assert pc["ipc_transfers"] == 0 and why in pc["ipc_fallback_reason"], pc
        st = i.rail_stats("target")[0]
        assert st["bytes"] == n and st["staging"]["h2d"]["bytes"] == n, st
    finally:
        i.close()
        tgt.close()


def test_ipc_transfers_queued_back_to_back_land_and_notify_in_order() -> None:
    """Sixteen IPC WRITEs posted back to back, each with its own notification: the copy worker
    queues each on the device without waiting for the one before, the completer waits for them
    in order. Every byte lands, every notification arrives in posting order, and a handle
    released while later ones are queued leaves its memory alone."""
    k, piece = 16, 256 * 1024 + 7
    n = k * piece
    tgt = _Target(n)
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 10.0})
    try:
        src = buf("V", pattern(n, 91))
        i.register_memory(src)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        hs = []
        for j in range(k):
            loc = i.get_xfer_descs([(src.addr + j * piece, piece, 0)], "VRAM")
            rem = i.get_xfer_descs([(tgt.addr + j * piece, piece, 0)], "VRAM")
            hs.append(i.initialize_xfer("WRITE", loc, rem, "target", f"w{j}".encode()))
        for h in hs:
            i.transfer(h)
        for h in hs:
            i.wait(h, 30)
            i.release_xfer_handle(h)
        assert tgt.ask("digest") == _sha(pattern(n, 91))
        assert tgt.ask("notifs") == '{"initiator": [%s]}' % ", ".join(f'"w{j}"' for j in range(k))
        assert i.peer_counters("target")["ipc_transfers"] == k
        # READs into separate slices of one local buffer; the middle one released while the
        # ones after it are queued: once release returns, its slice stays as it is.
        local = np.zeros(n, np.uint8)
        i.register_memory(local)
        hs = [i.initialize_xfer("READ", [(local.ctypes.data + j * piece, piece, 0)],
                                i.get_xfer_descs([(tgt.addr + j * piece, piece, 0)], "VRAM"), "target") for j in range(k)]
        for h in hs:
            i.transfer(h)
        i.release_xfer_handle(hs[k // 2])
        snap = local[(k // 2) * piece:(k // 2 + 1) * piece].copy()
        for j, h in enumerate(hs):
            if j != k // 2:
                i.wait(h, 30)
                i.release_xfer_handle(h)
        time.sleep(0.1)
        assert np.array_equal(snap, local[(k // 2) * piece:(k // 2 + 1) * piece]), "memory changed after release"
        want = pattern(n, 91)
        for j in range(k):
            if j != k // 2:
                assert np.array_equal(local[j * piece:(j + 1) * piece], want[j * piece:(j + 1) * piece]), j
    finally:
        i.close()
        tgt.close()


def test_ipc_release_and_close_leave_memory_alone() -> None:
    """A large IPC READ released right after posting, then close(): once each returns, the
    copy worker writes nothing more into the local buffer (release waits for a copy under way
    or cancels a queued one)."""
    n = 128 * MiB
    tgt = _Target(n)
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 10.0})
    try:
        local = np.zeros(n, np.uint8)
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        rd = i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM")
        for _ in range(3):
            h = i.initialize_xfer("READ", [local], rd, "target")
            i.transfer(h)
            i.release_xfer_handle(h)
            snap = local.copy()
            time.sleep(0.2)
            assert np.array_equal(snap, local), "memory changed after release_xfer_handle returned"
        h = i.initialize_xfer("READ", [local], rd, "target")
        i.transfer(h)
        i.close()
        snap = local.copy()
        time.sleep(0.2)
        assert np.array_equal(snap, local), "memory changed after close returned"
    finally:
        i.close()
        tgt.close()
