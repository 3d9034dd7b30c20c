"""GPU memory (issue 10) on real CUDA, and what CUDA's absence must look like.

Without a GPU: registering VRAM names the cause (no CUDA runtime, no usable GPU) as a typed
error instead of crashing later. The staged path itself runs in CI on the stand-in device
(tests/test_gpu_staging.py). Tests that need a real GPU are marked `gpu` and skip with the reason
here; `make test-gpu` runs them on the GPU machine: CUDA device memory (multirail.gpu's
DeviceBuffer, torch CUDA tensors) staged over loopback tcp, DRAM<->VRAM and VRAM<->VRAM, READ and
WRITE, byte-exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import engine_available

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

if engine_available():
    import multirail
    from multirail import errors


def _has_cuda_torch() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return None


def test_registering_gpu_memory_without_a_usable_gpu_names_the_cause() -> None:
    with multirail.Agent("a") as a:
        with pytest.raises(errors.GpuError) as ei:
            a.register_memory([(1 << 40, 1 << 20, 0)], "VRAM")
        msg = str(ei.value)
        # no CUDA runtime here: the paths tried and the install hint; with a runtime but no GPU:
        # CUDA's own error (cudaErrorNoDevice / InsufficientDriver)
        assert "GPU" in msg and ("nvidia-cuda-runtime" in msg or "cuda" in msg.lower()), msg
        assert a.get_agent_metadata()  # the agent is fine, nothing registered
        buf = np.zeros(4096, np.uint8)
        a.register_memory(buf)  # DRAM still registers


def _cuda_unavailable() -> str | None:
    try:
        multirail.gpu.info(0, "cuda")
    except errors.GpuError as e:
        return f"no usable CUDA GPU here: {e}"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("lk,rk", [("V", "V"), ("D", "V"), ("V", "D")])
def test_cuda_memory_staged_over_tcp_byte_exact(lk: str, rk: str) -> None:
    why = _cuda_unavailable()
    if why:
        pytest.skip(why)
    from multirail.gpu import DeviceBuffer

    n = 64 * (1 << 20) + 3
    rng = np.random.default_rng(1)
    data, new = rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, n, dtype=np.uint8)

    def make(kind: str, init: np.ndarray) -> object:
        if kind == "D":
            return init.copy()
        b = DeviceBuffer(n, kind="cuda")
        b.copy_from_host(init)
        return b

    def host(b: object) -> np.ndarray:
        return b.to_host() if isinstance(b, DeviceBuffer) else b  # type: ignore[union-attr,return-value]

    with multirail.Agent("t", {"gpu": "cuda"}) as t, multirail.Agent("i", {"gpu": "cuda"}) as i:
        remote, local = make(rk, data), make(lk, np.zeros(n, np.uint8))
        t.register_memory(remote)
        i.register_memory(local)
        i.fetch_remote_metadata("t", "127.0.0.1", t.port)
        for op in ("READ", "WRITE"):
            if op == "WRITE":
                if isinstance(local, DeviceBuffer):
                    local.copy_from_host(new)
                else:
                    local[:] = new  # type: ignore[index]
            h = i.initialize_xfer(op, [local], [remote], "t")
            i.transfer(h)
            i.wait(h, 60)
            i.release_xfer_handle(h)
            assert np.array_equal(host(local), host(remote)), op
        st = i.rail_stats("t")[0]
        assert st["gpu_path"] == "staged", st


@pytest.mark.gpu
def test_torch_cuda_tensors_move_vram_to_vram() -> None:
    why = _has_cuda_torch()
    if why:
        pytest.skip(why)
    import torch

    n = 16 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    # A tensor inside a larger caching-allocator block: an offset, not an allocation's base.
    big = torch.zeros(2 * n, dtype=torch.uint8, device="cuda")
    dst = big[n // 2: n // 2 + n]
    with multirail.Agent("a", {"gpu": "cuda"}) as a, multirail.Agent("b", {"gpu": "cuda"}) as b:
        a.register_memory(dst)
        b.register_memory(src)
        a.fetch_remote_metadata("b", "127.0.0.1", b.port)
        h = a.initialize_xfer("READ", [dst], [src], "b")
        a.transfer(h)
        a.wait(h, 60)
        torch.cuda.synchronize()
        assert torch.equal(dst, src)


@pytest.mark.gpu
def test_cuda_ipc_between_processes_of_a_whole_allocation() -> None:
    """Two processes on one GPU host: the READ and WRITE are CUDA IPC device copies into the
    peer's allocation (the region is the whole allocation: a region inside a larger one is staged,
    issue 33), byte-exact, no byte on the rails."""
    why = _cuda_unavailable()
    if why:
        pytest.skip(why)
    import hashlib

    from gpu_peer import Target
    from multirail.gpu import DeviceBuffer

    n = 32 * (1 << 20) + 5
    tgt = Target(n, kind="cuda")
    i = multirail.Agent("initiator", {"gpu": "cuda"})
    try:
        local = DeviceBuffer(n, kind="cuda")
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        rd = i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM")
        for op in ("READ", "WRITE"):
            if op == "WRITE":
                local.copy_from_host(np.random.default_rng(9).integers(0, 256, n, dtype=np.uint8))
            h = i.initialize_xfer(op, [local], rd, "target")
            i.transfer(h)
            i.wait(h, 60)
            i.release_xfer_handle(h)
            assert hashlib.sha256(local.to_host().tobytes()).hexdigest() == tgt.ask("digest"), op
        pc = i.peer_counters("target")
        assert pc["ipc_transfers"] == 2, pc
        assert all(r["bytes"] == 0 for r in i.rail_stats("target")), i.rail_stats("target")
    finally:
        i.close()
        tgt.close()
