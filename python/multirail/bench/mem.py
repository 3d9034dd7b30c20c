"""The bench's buffers: host memory (DRAM, a numpy array) or device memory (VRAM, a
`multirail.gpu.DeviceBuffer`) behind one small interface, so the sweep, the target and the kv
workload fill, check and corrupt either the same way (nixlbench's `--initiator-seg-type` /
`--target-seg-type`).

DRAM reads are numpy views (no copy); VRAM goes through `copy_from_host` / `copy_to_host`, in
chunks of at most 64 MiB so a large pool never needs a second full-size host copy.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from multirail.bench.core import UsageError, pattern

SEG_TYPES = ("DRAM", "VRAM")
GPU_KINDS = ("cuda", "standin")
CHUNK = 64 << 20


def add_mem_opts(p: argparse.ArgumentParser) -> None:
    """--initiator-seg-type, --target-seg-type, --device-id and --gpu (every bench mode)."""
    g = p.add_argument_group("memory (docs/bench.md)")
    g.add_argument("--initiator-seg-type", default="DRAM", type=str.upper, choices=list(SEG_TYPES),
                   help="initiator's buffer: DRAM (host, default) or VRAM (GPU memory, staged over tcp rails)")
    g.add_argument("--target-seg-type", default="DRAM", type=str.upper, choices=list(SEG_TYPES),
                   help="target's buffer: DRAM (default) or VRAM; the target process allocates it")
    g.add_argument("--device-id", type=int, default=0, help="GPU of the VRAM buffers (default 0)")
    g.add_argument("--gpu", default=None, type=_gpu_arg, metavar="K|cuda|standin",
                   help="K (a GPU index): the initiator's buffer is VRAM on GPU K (--device-id K), and the run "
                        "reports which rails the engine chose for GPU K and why (class per rail; "
                        "docs/topology.md); the GPU kind is then $MULTIRAIL_GPU, else cuda. cuda or standin: "
                        "the GPU kind of VRAM buffers and of the agents (standin: host memory posing as a GPU; "
                        "MULTIRAIL_STANDIN_RATE sets its copy rate). Default: $MULTIRAIL_GPU, else cuda")
    g.add_argument("--gpu-ipc", default=None, choices=["on", "off"],
                   help="CUDA IPC between agents on one host (AgentConfig.gpu_ipc, every agent of the run): on, "
                        "a transfer to the peer's VRAM is one device copy instead of the rails; off: staged over "
                        "the rails (what the per-stage breakdown measures). Default: the engine's (on)")


def _gpu_arg(v: str) -> str | int:
    """--gpu: a GPU index K, or a GPU kind."""
    v = v.strip()
    if v.isdigit():
        return int(v)
    if v in GPU_KINDS:
        return v
    raise argparse.ArgumentTypeError(f"invalid choice: {v!r} (a GPU index K, or one of {', '.join(GPU_KINDS)})")


def apply_gpu_index(args: argparse.Namespace) -> int | None:
    """`--gpu K`: the initiator's buffer becomes VRAM on GPU K (kind from $MULTIRAIL_GPU, else
    cuda); returns K (kept in args.gpu_index), or None without an index. Idempotent."""
    k = getattr(args, "gpu", None)
    if isinstance(k, int) and not isinstance(k, bool):
        if getattr(args, "device_id", 0) not in (0, k):
            raise UsageError(f"--gpu {k} and --device-id {args.device_id} disagree; give one")
        args.gpu_index, args.gpu, args.device_id = k, None, k
        args.initiator_seg_type = "VRAM"
        # The engine tiers the listed rails by the topology for GPU K (multirail.affinity).
        os.environ.setdefault("MULTIRAIL_AFFINITY", "topology")
    return getattr(args, "gpu_index", None)


def uses_vram(args: argparse.Namespace) -> bool:
    apply_gpu_index(args)
    return "VRAM" in (getattr(args, "initiator_seg_type", "DRAM"), getattr(args, "target_seg_type", "DRAM"))


def gpu_kind(args: argparse.Namespace) -> str:
    """--gpu, else $MULTIRAIL_GPU, else cuda (checked: a bad environment value is a usage error)."""
    apply_gpu_index(args)
    kind = getattr(args, "gpu", None) or os.environ.get("MULTIRAIL_GPU") or "cuda"
    if kind not in GPU_KINDS:
        raise UsageError(f"MULTIRAIL_GPU={kind!r}: expected one of {', '.join(GPU_KINDS)}")
    return kind


def check_mem_opts(args: argparse.Namespace, transport: str) -> str | None:
    """Validates the memory options; returns the agents' `gpu` setting (the resolved kind when a
    side is VRAM, else --gpu as given: None lets the engine use $MULTIRAIL_GPU)."""
    apply_gpu_index(args)
    for side in ("initiator_seg_type", "target_seg_type"):
        v = getattr(args, side, "DRAM")
        if v not in SEG_TYPES:  # argparse's choices catch the CLI; this guards programmatic callers
            raise UsageError(f"--{side.replace('_', '-')} must be DRAM or VRAM, not {v!r}")
    if getattr(args, "device_id", 0) < 0:
        raise UsageError("--device-id must be >= 0")
    if not uses_vram(args):
        return getattr(args, "gpu", None)
    # ucx moves VRAM only with GPUDirect RDMA on every rail, which the engine decides per agent
    # and rails (a GpuError naming the missing piece otherwise): not guessed here.
    return gpu_kind(args)


def gpu_ipc_setting(args: argparse.Namespace) -> bool | None:
    """--gpu-ipc as AgentConfig.gpu_ipc (None: the engine's default); a usage error when this
    engine has no such setting."""
    v = getattr(args, "gpu_ipc", None)
    if v is None:
        return None
    from multirail import AgentConfig  # lazy: the tool must import without the extension

    if "gpu_ipc" not in AgentConfig.__dataclass_fields__:
        raise UsageError("--gpu-ipc: this engine has no CUDA IPC setting (AgentConfig.gpu_ipc); leave it out")
    return v == "on"


def ipc_config(gpu_ipc: bool | None) -> dict[str, bool]:
    """The AgentConfig keyword for --gpu-ipc: none at all when not given (older engines lack it)."""
    return {} if gpu_ipc is None else {"gpu_ipc": gpu_ipc}


def check_gpu(args: argparse.Namespace) -> None:
    """Fail fast, in this process, when a side is VRAM and its GPU cannot be opened (no CUDA
    runtime, no device): the engine's GpuError, before any child process is started."""
    if uses_vram(args):
        gpu_info(args.device_id, gpu_kind(args))


def gpu_info(device: int, kind: str | None) -> dict[str, Any]:
    """{"kind", "device", "name"} of a GPU (multirail.gpu.info: kind None is $MULTIRAIL_GPU, else
    cuda, as the engine resolves it; GpuError when there is none)."""
    from multirail import gpu

    info = gpu.info(device, kind)
    return {"kind": info.get("kind", kind), "device": int(info.get("device", device)), "name": info.get("name")}


class BenchMem:
    """`nbytes` of DRAM (numpy, zeroed) or VRAM (DeviceBuffer on `device` of `kind`)."""

    def __init__(self, nbytes: int, seg_type: str = "DRAM", device: int = 0, kind: str | None = None) -> None:
        self.nbytes = int(nbytes)
        self.mem_type = seg_type
        self.kind = kind
        self.device = int(device) if seg_type == "VRAM" else 0
        self.host: np.ndarray | None = None
        self.dev_buf: Any = None
        self.gpu: dict[str, Any] | None = None  # VRAM: gpu_info of its device
        if seg_type == "VRAM":
            from multirail.gpu import DeviceBuffer

            self.dev_buf = DeviceBuffer(self.nbytes, self.device, kind)
            self.addr = int(self.dev_buf.addr)
            self.gpu = gpu_info(self.device, kind)
        else:
            self.host = np.zeros(self.nbytes, dtype=np.uint8)
            self.addr = int(self.host.ctypes.data)

    def __len__(self) -> int:
        return self.nbytes

    @property
    def is_vram(self) -> bool:
        return self.dev_buf is not None

    def register(self, agent: Any, access: str = "rw") -> Any:
        return agent.register_memory(self.dev_buf if self.is_vram else self.host, access=access)

    def descs(self, agent: Any, rows: np.ndarray) -> Any:
        """Descriptor rows (addr, len, dev) of this memory, with its mem type. DRAM rows pass as
        they are (the engine's fast path for numpy rows)."""
        return agent.get_xfer_descs(rows, "VRAM") if self.is_vram else rows

    # -- contents -------------------------------------------------------------------------------

    def write(self, offset: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint8)
        if self.host is not None:
            self.host[offset:offset + len(data)] = data
        else:
            self.dev_buf.copy_from_host(data, offset)

    def read(self, offset: int, length: int) -> np.ndarray:
        """Bytes [offset, offset+length): a view for DRAM, a host copy for VRAM."""
        if self.host is not None:
            return self.host[offset:offset + length]
        out = np.empty(length, dtype=np.uint8)
        if length:
            self.dev_buf.copy_to_host(out, offset)
        return out

    def fill_byte(self, value: int, offset: int = 0, length: int | None = None) -> None:
        length = self.nbytes - offset if length is None else length
        if self.host is not None:
            self.host[offset:offset + length] = value
            return
        block = np.full(min(length, CHUNK), value, dtype=np.uint8)
        for off in range(offset, offset + length, CHUNK):
            n = min(CHUNK, offset + length - off)
            self.dev_buf.copy_from_host(block[:n], off)

    def zero(self, offset: int = 0, length: int | None = None) -> None:
        self.fill_byte(0, offset, length)

    def fill_pattern(self, seed: int, offset: int = 0, length: int | None = None) -> None:
        """core.pattern(seed) over [offset, offset+length), in chunks."""
        length = self.nbytes - offset if length is None else length
        for off in range(offset, offset + length, CHUNK):
            n = min(CHUNK, offset + length - off)
            self.write(off, pattern(seed, off, n))

    def flip(self, offset: int) -> None:
        """Inverts byte `offset` (the hidden --corrupt-offset)."""
        if self.host is not None:
            self.host[offset] ^= 0xFF
            return
        b = self.read(offset, 1)
        b[0] ^= 0xFF
        self.write(offset, b)

    def free(self) -> None:
        if self.dev_buf is not None:
            self.dev_buf.free()

    def describe(self) -> str:
        return f"VRAM ({self.kind or 'default'} GPU {self.device})" if self.is_vram else "DRAM"
