"""Device memory without a framework: what the bench and the tests register as VRAM.

`DeviceBuffer(nbytes)` allocates GPU memory through the same device layer the engine stages
with: CUDA (libcudart loaded at run time) or the stand-in (host memory posing as a GPU, for CI).
It exposes `__cuda_array_interface__`, so `Agent.register_memory(buf)` takes it as VRAM exactly
like a CuPy array or a torch CUDA tensor.

    from multirail.gpu import DeviceBuffer
    buf = DeviceBuffer(64 << 20, device=0)          # kind: $MULTIRAIL_GPU, else "cuda"
    buf.copy_from_host(np.arange(64 << 20, dtype=np.uint8))
    reg = agent.register_memory(buf)                # mem type VRAM
    host = buf.to_host()                            # a numpy copy, for checking

`Stream(device)` is a stream of the same device layer, for ordering: a producer queues work on
it (`buf.copy_from_host(arr, stream=s)`; on the stand-in, `s.sleep(t)` stands in for a kernel
still running) and `agent.transfer(h, stream=s)` orders the transfer after it (docs/gpu.md, the
stream contract).

The kind ("cuda" or "standin") must match the agent's `gpu` setting: a stand-in buffer is not
GPU memory to CUDA, and the other way round. Errors are `multirail.errors.GpuError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from multirail import _core
from multirail.agent import _offer_cuda_wheels
from multirail.errors import InvalidArgumentError


def info(device: int = 0, kind: str | None = None) -> dict:
    """{"kind", "device", "name"} of a device (stand-in: plus its allocation counters
    pinned_allocs, pinned_frees, device_allocs, live_allocs), and the process-wide pinned
    staging budget: pinned_bytes (pools alive, never above pinned_max), pinned_max,
    idle_pool_bytes, pinned_on_demand (pools pinned on the data path: docs/gpu.md)."""
    _offer_cuda_wheels()
    return dict(_core.gpu_info(device, kind))


def current_device() -> int | None:
    """The calling thread's current stand-in device (the stand-in's `cudaGetDevice`; None when
    the thread never chose one). The engine restores it around every call it makes."""
    return _core.gpu_current_device()


def set_current_device(device: int | None) -> None:
    """Sets the calling thread's current stand-in device (the stand-in's `cudaSetDevice`)."""
    _core.gpu_set_current_device(device)


def standin_fail(op: str, n: int = 1, device: int = 0, persistent: bool = False) -> None:
    """Stand-in only: the `n`-th next call of `op` ("query", "synchronize", "copy": a
    `cudaMemcpyAsync`) on `device` fails (n=0 clears it); `persistent`: every call of `op` fails
    until cleared, as with a sticky device error."""
    _core.gpu_standin(f"fail_{op}", device, (1 << 64) - 1 if persistent else n)


def standin_contexts() -> list[int]:
    """Stand-in only: the devices on which this process has made a context (a runtime call on
    a thread with none makes one on device 0, as CUDA's does)."""
    return list(_core.gpu_standin("contexts"))


def standin_peers() -> list[tuple[int, int]]:
    """Stand-in only: the (from, to) pairs with peer access enabled."""
    f = list(_core.gpu_standin("peers"))
    return list(zip(f[0::2], f[1::2]))


def standin_sticky(device: int) -> bool:
    """Stand-in only: whether `device` has a sticky error (an illegal address)."""
    return bool(_core.gpu_standin("sticky", device))


class Stream:
    """A stream on `device` (non-blocking, like the ones torch and CuPy make). `handle` is its
    raw `cudaStream_t` (a stand-in handle on the stand-in); `Agent.transfer(h, stream=s)` takes
    it, as it takes a torch or CuPy stream."""

    def __init__(self, device: int = 0, kind: str | None = None):
        _offer_cuda_wheels()
        self.device = int(device)
        self.kind = kind
        self.handle = _core.gpu_stream_create(self.device, kind)
        self._keep: list[Any] = []  # host arrays of queued copies, alive until synchronize

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    def sleep(self, seconds: float) -> None:
        """Stand-in only: queue a pause, as a kernel still running would hold the stream."""
        _core.gpu_stream_sleep(self.handle, float(seconds))

    def begin_capture(self) -> None:
        """Stand-in only: start capturing this stream into a graph, in global mode (torch's
        default): until `end_capture`, a call that capture forbids from any thread not in relaxed
        mode invalidates it."""
        _core.gpu_standin("begin_capture", self.device, 0, self.handle)

    def end_capture(self) -> None:
        """Stand-in only: end the capture; raises GpuError when it was invalidated."""
        _core.gpu_standin("end_capture", self.device, 0, self.handle)

    def synchronize(self) -> None:
        """Blocks until everything queued so far has run."""
        _core.gpu_stream_synchronize(self.handle, self.device, self.kind)
        self._keep.clear()

    def close(self) -> None:
        if self.handle:
            h, self.handle = self.handle, 0
            _core.gpu_stream_destroy(h)
            self._keep.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class DeviceBuffer:
    """`nbytes` of device memory on `device`, freed by `free()` (or when collected)."""

    def __init__(self, nbytes: int, device: int = 0, kind: str | None = None):
        if int(nbytes) <= 0:
            raise InvalidArgumentError("nbytes must be positive")
        _offer_cuda_wheels()
        self.nbytes = int(nbytes)
        self.device = int(device)
        self.kind = kind
        self.addr = _core.gpu_alloc(self.nbytes, self.device, kind)

    @property
    def __cuda_array_interface__(self) -> dict:
        self._live()
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.addr, False), "version": 3, "strides": None}

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCUDA, device): which GPU, for consumers of the CUDA array interface."""
        return (2, self.device)

    def _live(self) -> None:
        if not self.addr:
            raise InvalidArgumentError("device buffer already freed")

    def _host(self, arr: Any, offset: int, writable: bool) -> np.ndarray:
        a = np.asarray(arr)
        if not a.flags.c_contiguous or (writable and not a.flags.writeable):
            raise InvalidArgumentError("host array must be C-contiguous" + (" and writable" if writable else ""))
        if offset < 0 or offset + a.nbytes > self.nbytes:
            raise InvalidArgumentError(f"{a.nbytes} bytes at offset {offset} do not fit in {self.nbytes}")
        return a

    def copy_from_host(self, arr: Any, offset: int = 0, stream: Stream | None = None) -> None:
        """Copies a host array into the buffer at `offset`: synchronous, or queued on `stream`
        (returns at once; the stream keeps `arr` and this buffer alive until its `synchronize`
        or `close`, so neither is freed under the copy)."""
        self._live()
        a = self._host(arr, offset, False)
        if not a.nbytes:
            return
        if stream is None:
            _core.gpu_copy(self.addr + offset, a.ctypes.data, a.nbytes, "h2d", self.device, self.kind)
        else:
            stream._keep.append((a, self))  # both ends stay alive until the stream has run it
            _core.gpu_copy_async(self.addr + offset, a.ctypes.data, a.nbytes, "h2d", stream.handle)

    def copy_to_host(self, out: np.ndarray, offset: int = 0) -> np.ndarray:
        """Copies `out.nbytes` bytes at `offset` into `out` (synchronous); returns `out`."""
        self._live()
        a = self._host(out, offset, True)
        if a.nbytes:
            _core.gpu_copy(a.ctypes.data, self.addr + offset, a.nbytes, "d2h", self.device, self.kind)
        return out

    def to_host(self) -> np.ndarray:
        """The whole buffer as a new uint8 numpy array."""
        return self.copy_to_host(np.empty(self.nbytes, dtype=np.uint8))

    def free(self) -> None:
        """Frees the memory. Deregister it from agents first (the agent refuses to deregister
        memory a transfer still holds)."""
        if self.addr:
            addr, self.addr = self.addr, 0
            _core.gpu_free(addr, self.device, self.kind)

    def __enter__(self) -> "DeviceBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to report to
            pass

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.nbytes} bytes on {self.kind or 'default'} GPU {self.device} at {self.addr:#x})"
