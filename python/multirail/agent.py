"""The Python face of the engine: `Agent`, `AgentConfig`, `XferState`, descriptor lists.

Control plane only. Buffers are turned into (address, length, device) rows here; everything
after that (resolution against registered memory, pairing, striping, the data path) happens in
Rust (`multirail._core`) with the GIL released. Descriptor lists are (N, 3) uint64 numpy arrays
end to end, so N descriptors cost no per-descriptor Python work.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import ctypes
import enum
import ipaddress
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from multirail import _core
from multirail.errors import InvalidArgumentError, MultirailError, StaleMetadataError, TransferTimeoutError

_log = logging.getLogger("multirail")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _warn_if_open(name: str, secret: Any, host: str, rails: Sequence[Any]) -> None:
    """Say loudly when anyone on the network can use this agent's exported memory: it listens on
    an address other than loopback (side channel or a rail) and has no shared secret."""
    if secret is not None:
        return
    open_on = [a for a in [host, *(r[1] for r in rails)] if not _is_loopback(str(a))]
    if open_on:
        _log.warning("agent %r listens on %s without auth_secret: anyone who can reach these addresses can "
                     "read and write its exported memory and push notifications (set auth_secret or "
                     "MULTIRAIL_SECRET; docs/SECURITY.md)", name, ", ".join(sorted(set(map(str, open_on)))))

__version__: str = _core.__version__

_U64 = np.uint64


class XferState(enum.IntEnum):
    """State of a posted transfer (NIXL's "PROC"/"DONE"/"ERR")."""

    IN_PROGRESS = 1
    DONE = 2
    ERROR = 3


# Engine state codes (0 = never posted) -> XferState, without enum construction.
_STATES: tuple[XferState, ...] = (XferState.IN_PROGRESS, XferState.IN_PROGRESS, XferState.DONE, XferState.ERROR)


@dataclass
class AgentConfig:
    """Agent settings. Every field has a sane default; see docs/ARCHITECTURE.md.

    rails: None for one rail on `host`; "auto" to use every up, addressed, non-loopback
    interface (only RDMA-backed ones when any exist); or a list of interface names or IPv4
    addresses. rail_map: explicit (local rail index, remote rail index) pairs; by default rails
    pair by shared subnet (rail i with rail i in a rail-optimized fabric).
    policy: "weighted" (default), "round_robin" or "pinned:N".
    auth_secret: shared secret for the handshake; defaults to $MULTIRAIL_SECRET.
    timeout: connect, handshake and per-request bound, seconds.
    stall_timeout: a rail with requests outstanding that receives no byte for this long is
    declared down and its chunks are reissued (a local link that loses carrier is declared down
    within about 0.1 s regardless).
    progress: how threads wait for data. "adaptive" (default): waiting callers and serving
    connections busy-poll for up to `spin_us` before sleeping in the kernel (over tcp a caller
    does not busy-poll for the answer to a chunk over 256 KiB: bulk bytes take longer than the
    wake-up a spin saves); "poll": a waiting
    caller busy-polls until its transfer completes or times out (serving connections as in
    adaptive); "block": sleep in the kernel at once (least CPU; every round trip then pays a
    scheduler wake-up; steadier where cores are scarce: two agents on 2 cores moved loopback
    KV pages at >= 85% of contiguous in 20 of 20 runs, against 18 of 20 adaptive).
    docs/benchmarks.md has what each costs and buys.
    spin_us: the busy-poll budget of waiting callers (and the ucx transport's threads),
        microseconds.
    serve_spin_us: how long a tcp data connection's serving thread waits on the CPU for the next request
        before sleeping in the kernel, microseconds (default 1000; adaptive under "adaptive").
        Longer than spin_us: with 200, 4 KiB READs every 250 us found the serving thread asleep
        and paid a wake-up each (docs/benchmarks.md, "4 KiB READ latency at a request rate");
        a 1000 us spin_us for everything cost ucx's kv pages 2-4 points on 2 cores.
    metadata: "etcd://HOST:PORT[,HOST:PORT...]/PREFIX" to publish this agent's metadata in etcd
    (PREFIX/agents/NAME, under a lease kept alive every metadata_ttl/2 s, deleted by close())
    and fetch peers by name; None (default): side channel only. docs/etcd.md.
    metadata_ttl: lease TTL, seconds: a killed agent's key disappears within it.
    transport: what carries each rail (docs/transports.md). "auto" (default): ucx on a rail whose
    NIC has an RDMA device and whose loaded UCX has an RDMA transport for it, tcp elsewhere (so
    tcp on hosts without RDMA; never UCX over TCP). "tcp": multirail's own TCP connections.
    "ucx": UCX one-sided get/put, one UCP context per rail restricted to the rail's device (RDMA
    when the rail has an RDMA device and the loaded UCX can drive it, else UCX's tcp, which checks
    no memory bounds: a warning says so). Per rail: a dict by interface name, address or index
    ({"eth0": "ucx", "eth1": "tcp"}; "*" for the rest) or a list with one entry per rail
    (["ucx", "tcp"], also written "ucx,tcp"). UCX comes from `pip install "multirail[ucx]"` (the
    libucx wheel, tcp only), a system libucp (`apt-get install libucx0`), or MULTIRAIL_UCX_LIB.
    The default is $MULTIRAIL_TRANSPORT, else "auto". A ucx agent also serves tcp peers; an agent
    refuses UCX sessions on rails it runs over tcp, clearly. `transport_info()["rails"]` and
    `rail_stats()` say what each rail runs and why.
    fallback_after, fallback_cooldown, fallback_max_switches: a ucx rail whose ucx path fails
    `fallback_after` times (default 3; 0: never) while its IP path works is reopened over tcp on
    the same addresses; ucx is tried again after `fallback_cooldown` seconds (default 5), doubling
    with each fallback, at most `fallback_max_switches` switches per rail (default 8).
    faults: fault injection for testing failover without a network to break (docs/transports.md):
    "RAIL:KIND@AT[+DUR]", comma-separated, KIND one of kill, blackhole, slow=DELAY; e.g.
    "1:kill@200ms+1s" shuts rail 1 200 ms after the link opens and keeps it down for 1 s.
    gpu: which device registers and stages GPU (VRAM) memory: "cuda" (libcudart loaded at run
    time) or "standin" (host memory posing as a GPU, copies on threads: CI and tests); default
    $MULTIRAIL_GPU, else "cuda". docs/gpu.md.
    staging_buffers, staging_buffer_size: the shape of a pinned bounce pool that stages GPU
    memory over tcp rails (default 4 x 1 MiB): a connection borrows one per direction in use.
    staging_pinned_max: the process-wide cap on pinned staging memory, in bytes (default
    256 MiB, at least one pool per direction; the agent made last sets it for the process).
    Registering a GPU region pins a pool per direction for each connection of this agent's
    rails, within the cap; connections borrow idle pools, wait (within their timeout) when
    none is free, and give them back without unpinning (docs/gpu.md, "The pinned budget").
    gpu_ipc: CUDA IPC between agents on one host (default True): a transfer whose remote side
    is the peer's GPU memory becomes one device copy into the peer's allocation, mapped with its
    IPC handle (which exposes the whole allocation holding the region to that authenticated
    peer: docs/SECURITY.md); a target with False hands out no handles. Falls back to staging
    over the rails, with the reason in `peer_counters()["ipc_fallback_reason"]`.
    vectored: vectored requests (default True): many pages of one remote region per request,
    packed by bytes up to chunk_size, over tcp to peers that speak them (docs/PROTOCOL.md).
    False sends one request per contiguous piece, as before (a baseline for benchmarks).
    accept_metaput: let peers push their own metadata here (`send_local_metadata(ip, port)` of
        another agent; MetaPut on a control connection). Off by default: a peer's metadata then
        comes only from this application (fetch_remote_metadata, add_remote_agent, NIXL, a
        metadata store). Even on, a pushed name never replaces a peer this application installed
        (docs/SECURITY.md).
    max_peers: most peers this agent keeps metadata for (default 4096); beyond it a MetaPut is
        refused Busy, and an install by the application takes the place of a peer that came by
        MetaPut, or is refused with an error when the application's own fill the table.
    max_connections: most authenticated inbound connections (default 1024); more are refused Busy.
    max_handshakes: most inbound connections still in their handshake (default 256); they take no
        slot of max_connections, and beyond it the oldest handshake is dropped for the newest.
    fan_in_window: how this agent, as a target, shares each rail's receive window among the
        data connections accepted on that rail, so that many initiators writing into it share a
        bottleneck fairly. "auto" (default): once a rail has 16 data connections, a budget of
        max(2 MiB, the rail's speed x 200 us) for that rail; fewer are left to the kernel's
        autotuning. An int: that budget in bytes, from the first connection (0 or "off": never).
        The budget is split evenly among the peers with data connections on the rail and each
        peer's part among its own k connections: about max(16 KiB, budget / peers / k) each (a
        receive buffer of that size: the window ends between one and two shares), so a peer's
        extra connections shrink only its own part; a peer is its name when auth_secret is set,
        its IP address otherwise. Resized as peers come and go; a budget
        bounds the rail to budget / RTT, so it must be at or above the rail's bandwidth-delay
        product; 2 MiB measured best on the 2 x 2 Gbit/s testbed (docs/ARCHITECTURE.md,
        "Fan-in shares"; docs/benchmarks.md, issue 22).
    metrics_port: serve Prometheus metrics on http://metrics_host:metrics_port/metrics (0: any
    free port, see `Agent.metrics_url`); None (default): no server. docs/metrics.md.
    affinity: which rails carry which memory (docs/topology.md, "The engine"). "auto" (default):
    with rails="auto", a transfer whose local memory is on GPU k stripes over the NICs nearest
    GPU k, host memory over its NUMA node's NICs (tiers by PCIe class, then bandwidth, from
    the topology in $MULTIRAIL_SYSFS_ROOT, default /sys); a farther tier only while every
    nearer rail is down; each rail's threads run on its NIC's local CPUs. "none": every rail
    for everything. "topology": as "auto", over any rail list (the listed rails, tiered). A
    dict {"gpu:0": [["eth0"], ["eth1"]], "numa:0": ["eth1"], "cpus": {...}}: explicit tiers per
    location (any rail list). Default $MULTIRAIL_AFFINITY, else "auto". multirail.affinity has
    the details; `affinity_info()` says what was chosen.
    """

    host: str = "127.0.0.1"
    port: int = 0
    connections: int = 1
    rails: Any = None
    rail_map: list[tuple[int, int]] | None = None
    policy: str = "weighted"
    chunk_size: int = 1 << 20
    stripe_threshold: int = 256 << 10
    timeout: float = 10.0
    stall_timeout: float = 0.5
    auth_secret: bytes | str | None = None
    bind_device: bool = True
    progress: str = "adaptive"
    spin_us: float = 200.0
    serve_spin_us: float = 1000.0
    transport: Any = field(default_factory=lambda: os.environ.get("MULTIRAIL_TRANSPORT", "auto"))
    fallback_after: int = 3
    fallback_cooldown: float = 5.0
    fallback_max_switches: int = 8
    faults: str = ""
    gpu: str | None = None
    staging_buffers: int = 4
    staging_buffer_size: int = 1 << 20
    staging_pinned_max: int = 256 << 20
    gpu_ipc: bool = True
    vectored: bool = True
    fan_in_window: int | str = "auto"
    accept_metaput: bool = False
    max_peers: int = 4096
    max_connections: int = 1024
    max_handshakes: int = 256
    metadata: str | None = None
    metadata_ttl: float = 10.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    affinity: Any = field(default_factory=lambda: os.environ.get("MULTIRAIL_AFFINITY", "auto"))
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_any(cls, config: "AgentConfig | dict | None") -> "AgentConfig":
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            known = {f for f in cls.__dataclass_fields__}
            bad = sorted(set(config) - known)
            if bad:
                raise InvalidArgumentError(f"unknown config keys {bad}; known: {sorted(known - {'extra'})}")
            return cls(**config)
        raise InvalidArgumentError(f"config must be an AgentConfig or a dict, not {type(config).__name__}")


def _ucx_wheel_dir() -> str | None:
    """The lib directory of the libucx wheel (`pip install "multirail[ucx]"`), if installed;
    found without importing or loading anything."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        lib = os.path.join(d, "lib")
        if os.path.isdir(lib):
            return lib
    return None


def _offer_ucx_wheel() -> None:
    """Offer the libucx wheel's directory to the engine's UCX loader (MULTIRAIL_UCX_WHEEL_DIR,
    after what the user set; the loader prefers an explicit MULTIRAIL_UCX_LIB and a system UCX
    with InfiniBand, docs/ucx.md)."""
    d = _ucx_wheel_dir()
    old = os.environ.get("MULTIRAIL_UCX_WHEEL_DIR")
    if d and d not in (old or "").split(":"):
        os.environ["MULTIRAIL_UCX_WHEEL_DIR"] = f"{old}:{d}" if old else d


def _offer_cuda_wheels() -> None:
    """Offer this interpreter's site-packages to the engine's CUDA runtime loader
    (MULTIRAIL_CUDA_WHEEL_DIRS: where `pip install nvidia-cuda-runtime-cu12` puts libcudart;
    crates/multirail-gpu/src/cuda.rs), after what the user set."""
    import site
    import sysconfig

    dirs = [sysconfig.get_paths().get("purelib", "")] + list(getattr(site, "getsitepackages", lambda: [])())
    old = os.environ.get("MULTIRAIL_CUDA_WHEEL_DIRS", "")
    have = set(old.split(":")) if old else set()
    new = [d for d in dict.fromkeys(dirs) if d and d not in have]
    if new:
        os.environ["MULTIRAIL_CUDA_WHEEL_DIRS"] = ":".join(([old] if old else []) + new)


def _resolve_rails(spec: Any) -> list[tuple]:
    """Turn the `rails` setting into (name, addr, prefix, speed_mbps, mtu, numa, rdma, bind) rows."""
    if spec is None:
        return []
    from multirail import netinfo

    ifaces = netinfo.interfaces()
    if spec == "auto":
        cands = [i for i in ifaces if i.name != "lo" and i.oper_up and i.ipv4]
        rdma = [i for i in cands if i.rdma_dev]
        chosen = [(i, i.ipv4[0]) for i in (rdma or cands)]
        if not chosen:
            raise InvalidArgumentError("rails='auto' found no up, addressed, non-loopback interface")
    else:
        if isinstance(spec, str):
            spec = [s for s in spec.split(",") if s]
        chosen = []
        for item in spec:
            item = str(item).strip()
            try:
                ip = ipaddress.ip_interface(item)
            except ValueError:
                ip = None
            if ip is not None:
                addr = str(ip.ip)
                hit = next((i for i in ifaces for a in i.ipv4 if a[0] == addr), None)
                if hit is None:
                    prefix = ip.network.prefixlen if "/" in item else 32
                    chosen.append((None, (addr, prefix)))
                else:
                    chosen.append((hit, next(a for a in hit.ipv4 if a[0] == addr)))
            else:
                hit = next((i for i in ifaces if i.name == item), None)
                if hit is None:
                    raise InvalidArgumentError(f"rail {item!r} is neither an IPv4 address nor an interface here")
                if not hit.ipv4:
                    raise InvalidArgumentError(f"rail interface {item!r} has no IPv4 address")
                chosen.append((hit, hit.ipv4[0]))
    rows = []
    for iface, (addr, prefix) in chosen:
        if iface is None:
            rows.append((addr, addr, prefix, 0, 0, -1, "", False))
        else:
            rows.append(
                (iface.name, addr, prefix, iface.speed_mbps or 0, iface.mtu or 0,
                 -1 if iface.numa_node is None else iface.numa_node, iface.rdma_dev or "", True)
            )
    return rows


def _fan_in_window(w: int | str) -> str:
    """AgentConfig.fan_in_window as the core parses it: "auto", "off" or a byte count."""
    if isinstance(w, bool) or not isinstance(w, (int, str)):
        raise ValueError(f"fan_in_window: {w!r} is not 'auto', 'off' or a byte count")
    if isinstance(w, int):
        if w < 0:
            raise ValueError(f"fan_in_window: {w} is negative")
        return str(w)
    return w


def _resolve_transport(spec: Any, rows: list[tuple]) -> tuple[str, list[str]]:
    """The `transport` setting as (default kind, per-rail kinds: "" = the default) for the
    resolved rail rows (an agent without rails has one rail, "default")."""
    names = [r[0] for r in rows] or ["default"]
    addrs = [r[1] for r in rows] or [""]
    if isinstance(spec, str) and "," in spec:
        spec = [t.strip() for t in spec.split(",")]
    if isinstance(spec, str):
        return spec, []
    if isinstance(spec, (list, tuple)):
        kinds = [str(t).strip() for t in spec]
        if len(kinds) != len(names):
            raise InvalidArgumentError(f"transport lists {len(kinds)} entries for {len(names)} rails {names}")
        return "auto", kinds
    if isinstance(spec, dict):
        default = str(spec.get("*", spec.get("default", "auto")))
        per = [""] * len(names)
        for key, kind in spec.items():
            if key in ("*", "default"):
                continue
            hits = [i for i in range(len(names))
                    if key == i or (isinstance(key, str) and (key == names[i] or key == addrs[i]))]
            if not hits:
                raise InvalidArgumentError(f"transport names rail {key!r}, which is not one of this agent's rails {names}")
            for i in hits:
                per[i] = str(kind)
        return default, per
    raise InvalidArgumentError(f"transport must be a string, a list or a dict, not {type(spec).__name__}")


# ---------------------------------------------------------------- buffers and descriptors

def _mem_of(obj: Any) -> tuple[int, int, int, str, bool]:
    """(addr, nbytes, dev, mem_type, readonly) of one buffer-like object."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidArgumentError("numpy array must be C-contiguous")
        return obj.ctypes.data, obj.nbytes, 0, "DRAM", not obj.flags.writeable
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor
        if not obj.is_contiguous():
            raise InvalidArgumentError("tensor must be contiguous")
        dev = obj.device
        if dev.type == "cuda":
            return obj.data_ptr(), obj.numel() * obj.element_size(), dev.index or 0, "VRAM", False
        if dev.type != "cpu":
            raise InvalidArgumentError(f"unsupported tensor device {dev}")
        return obj.data_ptr(), obj.numel() * obj.element_size(), 0, "DRAM", False
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:  # CuPy, Numba, multirail.gpu.DeviceBuffer, ...
        return _mem_of_cai(obj, cai)
    if type(obj).__name__ == "PyCapsule" or (
        hasattr(obj, "__dlpack__") and not isinstance(obj, (bytes, bytearray, memoryview))
    ):
        return _mem_of_dlpack(obj)
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InvalidArgumentError(
            f"cannot register {type(obj).__name__}: expected a numpy array, torch tensor, "
            "buffer, DLPack object, (addr, len, dev) tuple or an Nx3 uint64 array"
        ) from None
    if not mv.contiguous:
        raise InvalidArgumentError("buffer must be contiguous")
    arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)
    return arr.ctypes.data if arr.size else 0, mv.nbytes, 0, "DRAM", mv.readonly


def stream_handle(stream: Any) -> int | None:
    """The raw `cudaStream_t` of `stream` (None stays None: each GPU's legacy default stream).
    Takes an int, `__cuda_stream__` (the CUDA stream protocol: a `(version, handle)` pair),
    torch's `.cuda_stream`, CuPy's `.ptr`, or `multirail.gpu.Stream`'s `.handle`."""
    if stream is None:
        return None
    if isinstance(stream, int) and not isinstance(stream, bool):
        h = stream
    elif hasattr(stream, "__cuda_stream__"):
        proto = stream.__cuda_stream__()
        h = proto[1] if isinstance(proto, tuple) else proto
    else:
        h = next((getattr(stream, a) for a in ("cuda_stream", "ptr", "handle") if hasattr(stream, a)), None)
    if not isinstance(h, int) or isinstance(h, bool) or h < 0 or h >= 1 << 64:
        raise InvalidArgumentError(f"stream must be a CUDA stream or a raw cudaStream_t, not {type(stream).__name__}")
    return int(h)


# The device kind ("cuda", "standin") of the agent whose register_memory is running.
_REG_GPU_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar("multirail_reg_gpu_kind", default=None)


def _sync_producer_stream(handle: int, device: int) -> None:
    """Registration consumes a CUDA array: wait for the stream its producer named (the CUDA
    Array Interface v3 and DLPack protocols), so registration sees the data as produced."""
    from multirail import _core

    _core.gpu_stream_synchronize(handle, device, _REG_GPU_KIND.get())


def _contiguous_nbytes(shape: Sequence[int], strides: Sequence[int] | None, itemsize: int, what: str) -> int:
    """Bytes of a C-contiguous array; anything strided is refused (a region is one range)."""
    n = itemsize
    for d in shape:
        n *= int(d)
    if strides is not None and n:
        want = itemsize
        for d, st in reversed(list(zip(shape, strides))):
            if int(d) != 1 and int(st) != want:
                raise InvalidArgumentError(f"{what} must be C-contiguous (strides {tuple(strides)})")
            want *= int(d)
    return n


def _mem_of_cai(obj: Any, cai: dict) -> tuple[int, int, int, str, bool]:
    """GPU memory described by `__cuda_array_interface__` (strides in bytes, None = C order)."""
    try:
        ptr, ro = cai["data"]
        itemsize = np.dtype(cai["typestr"]).itemsize
        shape = tuple(cai["shape"])
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"bad __cuda_array_interface__: {e}") from e
    nbytes = _contiguous_nbytes(shape, cai.get("strides"), itemsize, "CUDA array")
    dev = getattr(getattr(obj, "device", None), "id", None)
    if dev is None and hasattr(obj, "__dlpack_device__"):
        dev = obj.__dlpack_device__()[1]
    # CAI v3: "stream" names where the producer queued its work; the consumer synchronises
    # with it before use. (Transfers later follow the stream contract: Agent.transfer.)
    stream = cai.get("stream")
    if stream is not None and nbytes:
        if not isinstance(stream, int) or isinstance(stream, bool) or stream == 0:
            raise InvalidArgumentError(f"bad __cuda_array_interface__ stream {stream!r} (an int, not 0)")
        _sync_producer_stream(stream, int(dev or 0))
    return int(ptr or 0), nbytes, int(dev or 0), "VRAM", bool(ro)


# DLPack device types (dlpack.h).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def _dltensor_of(capsule: Any) -> _DLTensor:
    """The DLTensor inside a "dltensor" capsule (DLManagedTensor starts with it). The capsule is
    only read, never consumed: its owner keeps the memory alive while the object lives."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    valid = ctypes.pythonapi.PyCapsule_IsValid
    valid.restype, valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    if not valid(capsule, b"dltensor"):
        raise InvalidArgumentError("not a DLPack capsule (or one already consumed)")
    return _DLTensor.from_address(get(capsule, b"dltensor"))


def _mem_of_dlpack(obj: Any) -> tuple[int, int, int, str, bool]:
    """CPU or CUDA memory exported through DLPack (an object with __dlpack__, or a capsule)."""
    if type(obj).__name__ == "PyCapsule":
        capsule = obj
    else:
        dev_type = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else _DL_CPU
        if dev_type == _DL_CPU:
            try:
                return _mem_of(np.from_dlpack(obj))
            except Exception as e:  # noqa: BLE001 - report what DLPack said
                raise InvalidArgumentError(f"cannot import buffer via DLPack: {e}") from e
        # DLPack's stream protocol: name the stream the consumer uses (1: the legacy default
        # stream), so the producer orders its pending work before it; then wait for that stream.
        try:
            capsule = obj.__dlpack__(stream=1)
            synced_legacy = True
        except (TypeError, ValueError, BufferError):
            capsule = obj.__dlpack__()
            synced_legacy = False
    t = _dltensor_of(capsule)
    dt = t.device.device_type
    if dt not in (_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED):
        raise InvalidArgumentError(f"unsupported DLPack device type {dt} (CPU and CUDA are)")
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = None if not t.strides else [t.strides[i] for i in range(t.ndim)]
    itemsize = (t.dtype.bits * t.dtype.lanes + 7) // 8
    # DLPack strides count elements; convert to bytes for the check.
    nbytes = _contiguous_nbytes(shape, None if strides is None else [st * itemsize for st in strides], itemsize, "DLPack tensor")
    addr = int(t.data or 0) + int(t.byte_offset)
    if dt in (_DL_CUDA, _DL_CUDA_MANAGED):
        if type(obj).__name__ != "PyCapsule" and synced_legacy and nbytes:
            _sync_producer_stream(0, int(t.device.device_id))
        return addr, nbytes, int(t.device.device_id), "VRAM", False
    return addr, nbytes, 0, "DRAM", False


def _is_rows(data: Any) -> bool:
    return isinstance(data, np.ndarray) and data.ndim == 2 and data.shape[1] == 3 and data.dtype.kind in "ui"


class DescList:
    """An (N, 3) uint64 array of (address, length, device) rows, with a memory type."""

    __slots__ = ("arr", "mem_type", "_keep")

    def __init__(self, arr: np.ndarray, mem_type: str = "DRAM", keep: Sequence[Any] = ()):
        self.arr = np.ascontiguousarray(arr, dtype=_U64).reshape(-1, 3)
        self.mem_type = mem_type.upper()
        self._keep = list(keep)

    def __len__(self) -> int:
        return int(self.arr.shape[0])

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            a, n, d = self.arr[i]
            return int(a), int(n), int(d)
        return DescList(self.arr[i], self.mem_type, self._keep)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"DescList({len(self)} x {self.mem_type}, {int(self.arr[:, 1].sum()) if len(self) else 0} bytes)"

    @property
    def total_bytes(self) -> int:
        return int(self.arr[:, 1].sum()) if len(self) else 0

    def _ptr(self) -> tuple[int, int]:
        return (self.arr.ctypes.data if len(self) else 0), len(self)


def make_descs(data: Any, mem_type: str | None = None) -> DescList:
    """Descriptors from tensors/arrays, (addr, len, dev) tuples, or an Nx3 integer array."""
    if isinstance(data, DescList):
        return data
    if _is_rows(data):
        if data.dtype.kind == "i" and len(data) and (data < 0).any():
            raise InvalidArgumentError("descriptor rows must be non-negative")
        return DescList(data, mem_type or "DRAM", ())
    items = data if isinstance(data, (list, tuple)) and not _is_triple(data) else [data]
    if not items:
        return DescList(np.zeros((0, 3), dtype=_U64), mem_type or "DRAM")
    if all(_is_triple(x) for x in items):
        try:
            arr = np.array(items, dtype=_U64).reshape(-1, 3)
        except (OverflowError, ValueError, TypeError) as e:
            raise InvalidArgumentError(f"bad descriptor tuples: {e}") from e
        return DescList(arr, mem_type or "DRAM")
    rows, mems = [], set()
    for x in items:
        addr, n, dev, mem, _ro = _mem_of(x)
        rows.append((addr, n, dev))
        mems.add(mem)
    if len(mems) > 1:
        raise InvalidArgumentError("descriptors mix DRAM and VRAM buffers")
    return DescList(np.array(rows, dtype=_U64).reshape(-1, 3), mem_type or mems.pop(), items)


def _is_triple(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and all(isinstance(v, (int, np.integer)) for v in x)


class RegDescs(DescList):
    """Registered memory: descriptors plus the region ids and the objects kept alive."""

    __slots__ = ("region_ids",)

    def __init__(self, descs: DescList, region_ids: list[int]):
        super().__init__(descs.arr, descs.mem_type, descs._keep)
        self.region_ids = region_ids


class XferHandle:
    """A prepared transfer; post it with `Agent.transfer`, as often as needed."""

    __slots__ = ("_h", "op", "peer", "_acct", "_nbytes", "_pending")

    def __init__(self, h: Any, op: str, peer: str, acct: list[int] | None = None):
        self._h, self.op, self.peer = h, op, peer
        # Metrics: the agent's [done, failed, bytes done] cell for (peer, op), the bytes of one
        # post, and whether the outcome of the last post is still to be counted.
        self._acct = [0, 0, 0] if acct is None else acct
        self._nbytes = h.total_bytes
        self._pending = False

    @property
    def total_bytes(self) -> int:
        return self._h.total_bytes

    def trace(self) -> dict[str, Any] | None:
        """What each rail did for the last post, or None (never posted, or posted by CUDA IPC).

        ``{"total_us": post to last completion (None while running or after a failure),
        "rails": [per rail index: {"bytes", "chunks", "first_issue_us", "last_done_us",
        "rate_gbps_at_post", "rate_gbps_at_end"}]}``; times are since the post, rates the
        planner's estimates. Of a slow transfer it says whether one rail finished late (its share,
        its rate estimate, or its completions came late) or all of them did (docs/planner.md, "Tracing a transfer")."""
        t: dict[str, Any] | None = self._h.trace()
        return t

    def __repr__(self) -> str:
        return f"XferHandle({self.op} {self.total_bytes} bytes with {self.peer!r})"


class PreppedDescs:
    """Descriptors prepared once for `make_prepped_xfer` (NIXL's prep_xfer_dlist)."""

    __slots__ = ("peer", "descs")

    def __init__(self, peer: str, descs: DescList):
        self.peer, self.descs = peer, descs

    def __len__(self) -> int:
        return len(self.descs)


# ---------------------------------------------------------------------------- the agent

class Agent:
    """One endpoint: registered memory, a side channel, and transfers to named peers."""

    def __init__(self, name: str, config: AgentConfig | dict | None = None):
        cfg = AgentConfig.from_any(config)
        secret = cfg.auth_secret if cfg.auth_secret is not None else os.environ.get("MULTIRAIL_SECRET")
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and len(secret) == 0:
            raise InvalidArgumentError("auth_secret must not be empty")
        rails = _resolve_rails(cfg.rails)
        if not cfg.bind_device:
            rails = [r[:7] + (False,) for r in rails]
        self.config = cfg
        transport, rail_transports = _resolve_transport(cfg.transport, rails)
        args = (
            name, cfg.host, int(cfg.port), int(cfg.connections), rails, list(cfg.rail_map or []),
            cfg.policy, int(cfg.chunk_size), int(cfg.stripe_threshold), float(cfg.timeout),
            float(cfg.stall_timeout), secret, str(cfg.progress), float(cfg.spin_us), transport,
            str(cfg.faults or ""), cfg.gpu, int(cfg.staging_buffers), int(cfg.staging_buffer_size),
            bool(cfg.gpu_ipc), rail_transports, int(cfg.fallback_after), float(cfg.fallback_cooldown),
            int(cfg.fallback_max_switches), bool(cfg.vectored), _fan_in_window(cfg.fan_in_window),
            float(cfg.serve_spin_us), bool(cfg.accept_metaput), int(cfg.max_peers),
            int(cfg.max_connections), int(cfg.max_handshakes),
        )
        if {transport, *rail_transports} & {"ucx", "auto"}:
            # The loader looks here last (after MULTIRAIL_UCX_LIB and a system UCX with
            # InfiniBand); under "auto" UCX is loaded only when a rail has an RDMA device.
            _offer_ucx_wheel()
        self._core = _core.Agent(*args, staging_pinned_max=int(cfg.staging_pinned_max))
        _warn_if_open(name, secret, cfg.host, rails)
        _LIVE.add(self)
        from multirail import affinity as _aff

        self._rail_names = [r[0] for r in rails]
        try:
            self._affinity = _aff.resolve(cfg.affinity, cfg.rails, rails)
            self._core.set_topology(*self._affinity.core_args())
        except BaseException:
            self.close()
            raise
        self._regs: dict[int, Any] = {}
        self._closed = False
        self._stale: dict[str, tuple[int, int]] = {}  # peer -> (cached, current) incarnation
        self._xstats: dict[tuple[str, str], list[int]] = {}  # (peer, op) -> [done, failed, bytes]
        self._peers: dict[str, None] = {}  # peers named to this agent (metrics)
        self._store: Any = None  # multirail.metadata.AgentStore
        self._metrics: Any = None  # multirail.metrics.MetricsServer
        try:
            if cfg.metadata:
                from multirail.metadata import AgentStore

                self._store = AgentStore(cfg.metadata, float(cfg.metadata_ttl), float(cfg.timeout), name=self.name,
                                         incarnation=self.incarnation, host=cfg.host, port=self.port,
                                         metadata=self.get_agent_metadata(), stale=self._stale)
            if cfg.metrics_port is not None:
                from multirail.metrics import serve_agent

                self._metrics = serve_agent(self, int(cfg.metrics_port), cfg.metrics_host)
        except BaseException:
            self.close()
            raise

    # identity
    @property
    def name(self) -> str:
        return self._core.name

    @property
    def port(self) -> int:
        return self._core.port

    @property
    def host(self) -> str:
        return self.config.host

    @property
    def incarnation(self) -> int:
        return self._core.incarnation

    # memory
    def register_memory(self, data: Any, mem_type: str | None = None, access: str = "rw") -> RegDescs:
        """Register buffers for transfers. access: "rw", "ro" (peers may only READ) or "local"
        (usable as the local side of transfers, never exported to peers)."""
        if _is_rows(data) or (isinstance(data, (list, tuple)) and data and all(_is_triple(x) for x in data)) or _is_triple(data):
            descs = make_descs(data if not _is_triple(data) else [data], mem_type)
            ro_flags = [False] * len(descs)
        else:
            items = data if isinstance(data, (list, tuple)) else [data]
            tok = _REG_GPU_KIND.set(self.config.gpu)
            try:
                infos = [_mem_of(x) for x in items]
            finally:
                _REG_GPU_KIND.reset(tok)
            descs = DescList(np.array([(a, n, d) for a, n, d, _, _ in infos], dtype=_U64).reshape(-1, 3),
                             mem_type or (infos[0][3] if infos else "DRAM"), items)
            ro_flags = [ro for *_, ro in infos]
        if access == "rw" and any(ro_flags):
            raise InvalidArgumentError("buffer is read-only; register it with access='ro'")
        if descs.mem_type in ("VRAM", "GPU", "CUDA"):
            _offer_cuda_wheels()
        ids: list[int] = []
        try:
            for (addr, n, dev) in descs:
                ids.append(self._core.register(addr, n, dev, descs.mem_type, access))
        except BaseException:
            for i in ids:
                self._core.deregister(i)
            raise
        reg = RegDescs(descs, ids)
        for i in ids:
            self._regs[i] = reg
        if self._store is not None:
            self._store.republish(self.get_agent_metadata())
        return reg

    def deregister_memory(self, reg: RegDescs) -> None:
        """Deregister `reg`'s regions. Returns once no peer can touch them: peers on this host
        that mapped one over CUDA IPC have closed their mappings. A peer that does not confirm
        within the agent's `timeout` raises TransferTimeoutError naming it, after every region is
        deregistered all the same: keep that memory alive until the peer is closed."""
        late: TransferTimeoutError | None = None
        try:
            for i in reg.region_ids:
                if i in self._regs:
                    try:
                        self._core.deregister(i)
                    except TransferTimeoutError as e:
                        # Deregistered, but a peer did not confirm it closed its CUDA IPC
                        # mapping in time: go on with the other regions, then raise.
                        late = late or e
                    del self._regs[i]
            if late is not None:
                raise late
        finally:
            if self._store is not None:
                self._store.republish(self.get_agent_metadata())

    def get_xfer_descs(self, data: Any, mem_type: str | None = None) -> DescList:
        return make_descs(data, mem_type)

    def get_reg_descs(self, data: Any, mem_type: str | None = None) -> DescList:
        return make_descs(data, mem_type)

    def get_serialized_descs(self, descs: Any) -> bytes:
        d = make_descs(descs)
        ptr, n = d._ptr()
        return _core.serialize_descs(ptr, n, d.mem_type)

    def deserialize_descs(self, blob: bytes) -> DescList:
        mem, raw = _core.deserialize_descs(bytes(blob))
        return DescList(np.frombuffer(raw, dtype="<u8").reshape(-1, 3).astype(_U64), mem)

    # metadata
    def get_agent_metadata(self) -> bytes:
        return self._core.metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        name = self._core.add_remote(bytes(metadata))
        self._loaded(name)
        return name

    def remove_remote_agent(self, name: str) -> None:
        self._core.remove_remote(name)
        self._stale.pop(name, None)
        self._peers.pop(name, None)
        if self._store is not None:
            self._store.forget(name)

    def fetch_remote_metadata(self, name: str, ip: str | None = None, port: int | None = None) -> str:
        """Load `name`'s metadata from its side channel at ip:port, or, with no address, from
        the metadata store (config `metadata`); either clears a stale mark. Raises
        UnknownPeerError when the store has no such agent, MetadataStoreError when it cannot
        be reached within `timeout`."""
        if ip is None:
            got = self._need_store("fetch_remote_metadata without an address").load(self._core.add_remote, name, None)
        else:
            if port is None:
                raise InvalidArgumentError("fetch_remote_metadata: pass both ip and port (or neither: metadata store)")
            got = self._core.fetch_remote(name, ip, int(port))
            if self._store is not None:
                self._store.forget(got)
        self._loaded(got)
        return got

    def wait_for_peer(self, name: str, timeout: float | None = None) -> str:
        """Wait (an etcd watch, up to `timeout` s, default the config's `timeout`) until `name`
        is published in the metadata store, then load its metadata. TransferTimeoutError when
        it does not appear in time, MetadataStoreError when the store is unreachable."""
        t = self.config.timeout if timeout is None else float(timeout)
        got = self._need_store("wait_for_peer").load(self._core.add_remote, name, t)
        self._loaded(got)
        return got

    def send_local_metadata(self, ip: str | None = None, port: int | None = None) -> None:
        """Push this agent's metadata to the side channel at ip:port, or, with no address,
        (re)publish it in the metadata store now (raises MetadataStoreError)."""
        if ip is None:
            self._need_store("send_local_metadata without an address").publish(self.get_agent_metadata())
            return
        if port is None:
            raise InvalidArgumentError("send_local_metadata: pass both ip and port (or neither: metadata store)")
        self._core.send_local(ip, int(port))

    def invalidate_local_metadata(self) -> None:
        """Delete this agent's record from the metadata store (and stop re-publishing it on
        registration changes) until `send_local_metadata()`; no-op without a store."""
        if self._store is not None:
            self._store.unpublish()

    @property
    def metadata_store(self) -> Any:
        """The `multirail.metadata.AgentStore` (config `metadata`), or None."""
        return self._store

    @property
    def metrics_url(self) -> str | None:
        """http://HOST:PORT/metrics of this agent's Prometheus endpoint, or None."""
        return None if self._metrics is None else self._metrics.url

    def _need_store(self, what: str) -> Any:
        if self._store is None:
            raise InvalidArgumentError(f"{what}: this agent has no metadata store; create it with "
                                       "{'metadata': 'etcd://HOST:PORT/PREFIX'} or pass the peer's address")
        return self._store

    def _loaded(self, name: str) -> None:
        self._stale.pop(name, None)
        self._peers[name] = None

    def _refuse_stale(self, peer: str) -> None:
        inc = self._stale.get(peer)
        if inc is not None:
            where = self._store.store if self._store is not None else "the metadata store"
            raise StaleMetadataError(f"stale metadata for peer {peer!r}: cached incarnation {inc[0]:#x}, {where} "
                                     f"now holds {inc[1]:#x} (the peer restarted); fetch its metadata again")

    def check_remote_metadata(self, name: str) -> bool:
        return self._core.has_remote(name)

    def make_connection(self, peer: str) -> None:
        """Open the rails to `peer` now rather than on the first transfer."""
        if self._stale:
            self._refuse_stale(peer)
        self._core.connect(peer)

    # transfers
    def initialize_xfer(self, op: str, local_descs: Any, remote_descs: Any, peer: str, notif: bytes = b"") -> XferHandle:
        if self._stale:
            self._refuse_stale(peer)
        loc, rem = make_descs(local_descs), make_descs(remote_descs)
        lp, ln = loc._ptr()
        rp, rn = rem._ptr()
        h = self._core.prepare(str(op), lp, ln, rp, rn, peer, bytes(notif or b""))
        op = str(op).upper()
        acct = self._xstats.get((peer, op))
        if acct is None:  # setdefault: two threads preparing at once share one cell
            acct = self._xstats.setdefault((peer, op), [0, 0, 0])
            self._peers[peer] = None
        return XferHandle(h, op, peer, acct)

    def initialize_xfer_strided(self, op: str, local: Any, remote: Any, peer: str, notif: bytes = b"") -> XferHandle:
        """`initialize_xfer` from strided descriptors: two Nx5 integer arrays of rows (address,
        len, device, stride, count), each row `count` pieces of `len` bytes at `address + k *
        stride` (NIXL 1.5's strided form). Row i of each side pairs with row i of the other;
        when their len and count match and each row's span lies in one host region, the row
        stays one compressed run through the planner to the wire (one strided entry of a
        vectored request), so prepare, post and repost cost nothing per piece. Otherwise the rows
        are expanded and prepared as `initialize_xfer` would."""
        if self._stale:
            self._refuse_stale(peer)
        arrs = []
        for side, a in (("local", local), ("remote", remote)):
            a = np.asarray(a)
            if a.ndim != 2 or a.shape[1] != 5 or a.dtype.kind not in "ui":
                raise InvalidArgumentError(f"{side} strided descriptors must be an Nx5 integer array")
            if a.dtype.kind == "i" and len(a) and a.min() < 0:
                raise InvalidArgumentError(f"{side} strided descriptors must not be negative")
            arrs.append(np.ascontiguousarray(a, dtype=np.uint64))
        lo, re = arrs
        h = self._core.prepare_strided(str(op), lo.ctypes.data, len(lo), re.ctypes.data, len(re), peer, bytes(notif or b""))
        op = str(op).upper()
        acct = self._xstats.get((peer, op))
        if acct is None:
            acct = self._xstats.setdefault((peer, op), [0, 0, 0])
            self._peers[peer] = None
        return XferHandle(h, op, peer, acct)

    def prep_xfer_dlist(self, peer: str, descs: Any, mem_type: str | None = None) -> PreppedDescs:
        d = make_descs(descs, mem_type)
        if peer and peer != "NIXL_INIT_AGENT" and not self.check_remote_metadata(peer):
            from multirail.errors import UnknownPeerError

            raise UnknownPeerError(f"unknown peer {peer!r}: load its metadata first")
        return PreppedDescs(peer, d)

    def make_prepped_xfer(self, op: str, local: PreppedDescs, local_indices: Iterable[int],
                          remote: PreppedDescs, remote_indices: Iterable[int], notif: bytes = b"") -> XferHandle:
        li = np.asarray(list(local_indices) if not isinstance(local_indices, np.ndarray) else local_indices, dtype=np.int64)
        ri = np.asarray(list(remote_indices) if not isinstance(remote_indices, np.ndarray) else remote_indices, dtype=np.int64)
        for idx, p, side in ((li, local, "local"), (ri, remote, "remote")):
            if len(idx) and (idx.min() < 0 or idx.max() >= len(p)):
                raise InvalidArgumentError(f"{side} index out of range for {len(p)} prepared descriptors")
        return self.initialize_xfer(op, DescList(local.descs.arr[li]), DescList(remote.descs.arr[ri]), remote.peer, notif)

    def transfer(self, h: XferHandle, notif: bytes | None = None, stream: Any = None) -> XferState:
        """Post `h` (returns at once; poll `check_xfer_state` or `wait`). GPU memory follows the
        stream contract (docs/gpu.md): the engine touches the transfer's local GPU memory only
        after the work queued on `stream` before this call has completed. `stream` is a
        `torch.cuda.Stream`, a CuPy stream, anything with `__cuda_stream__`, a
        `multirail.gpu.Stream`, or a raw `cudaStream_t` int; None means each GPU's legacy default
        stream (where torch and CuPy queue unless told otherwise)."""
        if self._stale:
            self._refuse_stale(h.peer)
        if h._pending:
            self._settle(h)
        try:
            s = h._h.post(None if notif is None else bytes(notif), stream_handle(stream))
        except MultirailError as e:
            if not isinstance(e, InvalidArgumentError):
                h._acct[1] += 1
            raise
        h._pending = True
        if s > 1:
            self._settle(h, s)
        # Table lookup, not XferState(int): this is on the small-transfer latency path.
        return _STATES[s]

    def transfer_sync(self, h: XferHandle, timeout: float | None = None, notif: bytes | None = None,
                      stream: Any = None) -> None:
        """Post `h` and block until it is DONE (raises its MultirailError on failure or
        TimeoutError): `transfer` + `wait` in one engine call, the lowest-latency form for a
        caller that would wait anyway."""
        if self._stale:
            self._refuse_stale(h.peer)
        if h._pending:
            self._settle(h)
        try:
            h._h.post_wait(None if notif is None else bytes(notif), timeout, stream_handle(stream))
        except TimeoutError:
            h._pending = True  # may still complete: counted when seen
            raise
        except MultirailError as e:
            if not isinstance(e, InvalidArgumentError):
                h._acct[1] += 1
            raise
        a = h._acct
        a[0] += 1
        a[2] += h._nbytes

    def _settle(self, h: XferHandle, state: int | None = None) -> None:
        """Count the outcome of `h`'s last post (metrics), once, when it is DONE or ERROR."""
        s = h._h.state() if state is None else state
        if s == 2:
            h._pending = False
            a = h._acct
            a[0] += 1
            a[2] += h._nbytes
        elif s == 3:
            h._pending = False
            h._acct[1] += 1

    def check_xfer_state(self, h: XferHandle) -> XferState:
        """The transfer's state. While it is in progress this also completes responses that
        have already arrived (progress in the caller's thread, as UCX's worker progress does),
        so a polling loop sees small transfers finish without a thread handoff."""
        s = h._h.progress()
        if s == 0:
            raise InvalidArgumentError("transfer was never posted")
        if s > 1 and h._pending:
            self._settle(h, s)
        return _STATES[s]

    def xfer_error(self, h: XferHandle) -> BaseException | None:
        """The exception a failed transfer would raise, or None."""
        if h._pending:
            self._settle(h)
        try:
            h._h.check()
        except Exception as e:  # noqa: BLE001 - returned, not swallowed
            return e
        return None

    def wait(self, h: XferHandle, timeout: float | None = None) -> None:
        """Block until DONE (GIL released); raise the transfer's MultirailError on failure."""
        try:
            h._h.wait(timeout)
        except MultirailError:
            if h._pending:
                self._settle(h)
            raise
        if h._pending:
            self._settle(h, 2)

    async def wait_async(self, h: XferHandle, timeout: float | None = None) -> None:
        """Awaitable form of `wait`."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.wait, h, timeout)

    async def transfer_async(self, h: XferHandle, notif: bytes | None = None, timeout: float | None = None,
                             stream: Any = None) -> None:
        self.transfer(h, notif, stream)
        await self.wait_async(h, timeout)

    def release_xfer_handle(self, h: XferHandle) -> None:
        if h._pending:
            self._settle(h)
        h._h.release()

    # notifications
    def send_notif(self, peer: str, msg: bytes) -> None:
        if self._stale:
            self._refuse_stale(peer)
        self._core.send_notif(peer, bytes(msg))

    def get_new_notifs(self, timeout: float = 0.0) -> dict[str, list[bytes]]:
        """Notifications received and not yet taken, by peer, in arrival order. With none
        queued, wait up to `timeout` seconds (GIL released) for one: a consumer that waits
        for notifications costs one wake-up per batch, where polling every 100 us costs
        ~10,000 a second on the cores the transfers use. 0 (the default) polls, as NIXL's
        `get_new_notifs`; `close()` ends a wait early."""
        out: dict[str, list[bytes]] = {}
        for name, msg in self._core.take_notifs(timeout):
            out.setdefault(name, []).append(msg)
        return out

    # introspection
    def rail_stats(self, peer: str) -> list[dict]:
        """Per rail to `peer`: name, addresses, connections, transport ("tcp", "ucx/tcp",
        "ucx/rc_mlx5", ...), transport_reason (why: "auto: no RDMA device", "explicit",
        "fallback after 3 ucx failures", ...), fallbacks and transport_switches (ucx -> tcp
        fallbacks and all changes of transport on this link), next_ucx_retry_s (seconds until a
        fallen-back rail tries ucx again; None), one_sided, remote_vram, up, down_reason,
        last_down_reason (why it last went down, kept after readmission), rate_gbps, bytes, chunks,
        reissued, times_down, and (kept across reconnections) bytes_read/bytes_written,
        chunks_read/chunks_written, readmissions, stalls. GPU memory (docs/gpu.md): gpu_path
        ("direct" on ucx rails with GPUDirect RDMA, else "staged": through pinned buffers,
        over tcp connections of the same rails),
        gpu_path_reason, and staging: {"d2h"|"wire"|"h2d": {"ops", "bytes", "busy_s"}, "chunks",
        "pool_bytes", "pools"} for what this side staged (D2H of WRITEs from local GPU memory,
        H2D of READs into it). Transfers by CUDA IPC use no rail: see peer_counters().
        Rail choice by memory location (`affinity`, docs/topology.md): tier_location (where
        the memory of the last tiered transfer on the rail was: "gpu:K", "numa:N"; None),
        tier (the tier the rail served it as, 0 = nearest), tier_class ("PIX", ..., "SYS",
        "tierN" for an explicit mapping), tier_reason, and fallback_bytes (bytes it carried as
        a farther tier, while every nearer rail was down)."""
        out = self._core.rail_stats(peer)
        for r in out:
            r["tier_class"], r["tier_reason"] = self._affinity.tier_class(r.get("tier_location"), r.get("tier"))
            if r.get("tier") and r["tier_reason"] is not None:
                r["tier_reason"] = f"fallback: no rail of tiers 0..{r['tier'] - 1} up; {r['tier_reason']}"
        return out

    def affinity_info(self) -> dict:
        """The rail choice per memory location (`AgentConfig.affinity`): {"source", "notes",
        "locations": {"gpu:0": [{"tier", "class", "rails": [names], "reason"}, ...], ...}}."""
        return self._affinity.describe(self._rail_names)

    def transport_info(self) -> dict:
        """{"transport": what was asked ("auto"|"tcp"|"ucx"), "ucx_version": e.g. "1.22.0 (wheel
        /path/libucp.so.0)" or None (no rail runs ucx), "ucx_rails": each ucx rail's UCX device
        restriction or None, "rails": per local rail {"transport": "tcp"|"ucx", "reason",
        "unprotected": UCX without RDMA, no memory bounds checked (docs/SECURITY.md)}}."""
        kind, version, rails = self._core.transport_info()
        per = [{"transport": t, "reason": why, "unprotected": bare} for t, why, bare in self._core.rail_transports()]
        return {"transport": kind, "ucx_version": version, "ucx_rails": rails, "rails": per}

    def peer_counters(self, peer: str) -> dict:
        """transfers_done, transfers_failed (posts to `peer` by outcome), fenced_connections
        (our dead connections the peer confirmed fenced), and CUDA IPC (same host, docs/gpu.md):
        ipc_transfers, ipc_bytes, ipc_regions_mapped, ipc_devices (local GPU ordinals holding
        mappings: the peer's GPU found by UUID), ipc_regions_revoked (mappings closed because
        the peer deregistered the region or closed), ipc_fallback_reason (why the last transfer
        that could have used IPC was staged instead; empty when none was)."""
        return self._core.peer_counters(peer)

    def served_stats(self) -> list[dict]:
        """What this agent served to peers (the target side), one dict per (peer, local rail):
        peer (the authenticated name; "_other" for names beyond the first 4096,
        "_unauthenticated" for refusals before a handshake completed), rail (the local rail's
        name, "side" for the side channel of an agent with rails), rail_index (None for that
        side channel), bytes_read/requests_read (READs answered: data sent out of our memory),
        bytes_written/requests_written (WRITEs applied: data landed in our memory), refused and
        refused_by_status ({"BadKey": n, ...}), connections (accepted), ucx_sessions (UCX
        sessions among them; their one-sided bytes are not counted), fenced (connections
        the peer's Fence aborted) and staging (as in rail_stats: D2H serving READs of our GPU
        memory, H2D landing WRITEs into it)."""
        return self._core.served_stats()

    def rails(self) -> list[tuple[str, str, int]]:
        """(name, address, data port) of each local rail."""
        return self._core.rails()

    def events(self) -> list[str]:
        return self._core.events()

    def refused_requests(self) -> int:
        return self._core.refused()

    def close(self) -> None:
        """Stop serving and close every link. Once this returns nothing of the agent touches
        registered memory any more (inbound connections are aborted and drained, in-flight
        transfers fail), so the application may free its buffers. Idempotent; also runs at
        `with` exit and at interpreter exit. With a metadata store, the agent's record is
        deleted first (peers stop finding it at once); the metrics server stops."""
        self._closed = True
        m, self._metrics = getattr(self, "_metrics", None), None
        st, self._store = getattr(self, "_store", None), None
        try:
            if m is not None:
                m.close()
            if st is not None:
                st.close()
        finally:
            self._core.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Agents still open at interpreter exit are closed before module teardown frees the buffers
# they serve (atexit handlers run first).
_LIVE: "weakref.WeakSet[Agent]" = weakref.WeakSet()


@atexit.register
def _close_live_agents() -> None:
    for a in list(_LIVE):
        a.close()
