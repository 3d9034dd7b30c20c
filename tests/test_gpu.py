"""GPU memory (issue 10), what runs without a GPU: every way GPU memory could be misused fails
with a typed error instead of a crash. VRAM registration asks CUDA (loaded at run time,
crates/multirail-gpu) whether the range is device memory; no transport of this build moves GPU
memory yet, so a transfer naming a GPU region on either side is refused at `initialize_xfer`,
and a target never serves a GPU region as host memory. Tests that need a real GPU are marked
`gpu` and skip with the reason here; `make test-gpu` runs them on the GPU machine.
"""

from __future__ import annotations

import struct

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


def _meta_with_gpu_region(name: str, port: int, base: int, length: int) -> bytes:
    """A peer's metadata (the wire format of crates/multirail-proto/src/meta.rs) exporting one
    region of GPU memory (mem type 1)."""
    nb = name.encode()
    out = b"MRMD" + struct.pack("<H", 1) + struct.pack("<H", len(nb)) + nb + struct.pack("<Q", 99)
    rail = (struct.pack("<H", 4) + b"fake" + struct.pack("<H", 9) + b"127.0.0.1" + bytes([0])
            + struct.pack("<HQIi", port, 0, 0, -1) + struct.pack("<H", 0))
    out += struct.pack("<I", 1) + rail
    out += struct.pack("<I", 1) + struct.pack("<QQQIBB", 1, base, length, 0, 1, 2) + bytes(16)
    return out


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_transfer_to_a_peers_gpu_region_is_refused_before_anything_moves(op: str) -> None:
    with multirail.Agent("a") as a:
        a.add_remote_agent(_meta_with_gpu_region("gpu-peer", 9, 1 << 40, 1 << 20))
        buf = np.zeros(1 << 20, np.uint8)
        a.register_memory(buf)
        with pytest.raises(errors.GpuError, match="no transport of this build moves GPU memory"):
            a.initialize_xfer(op, [buf], [(1 << 40, 1 << 20, 0)], "gpu-peer")


@pytest.mark.gpu
def test_torch_cuda_tensor_registers_and_is_refused_for_transfer_until_staging_lands() -> None:
    why = _has_cuda_torch()
    if why:
        pytest.skip(why)
    import torch

    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    with multirail.Agent("a") as a, multirail.Agent("b") as b:
        a.register_memory(t)  # CUDA says it is device memory
        src = np.ones(1 << 20, np.uint8)
        b.register_memory(src)
        a.fetch_remote_metadata("b", "127.0.0.1", b.port)
        with pytest.raises(errors.GpuError):
            a.initialize_xfer("READ", [t], [src], "b")
