"""NIXL-compatible Python API on top of the multirail engine.

`from multirail.nixl import nixl_agent, nixl_agent_config` replaces
`from nixl._api import nixl_agent, nixl_agent_config`; method names, argument names, defaults
and return conventions follow NIXL's `_api.py` (states are the strings "DONE"/"PROC"/"ERR",
notifications are `{agent_name: [bytes]}`, descriptor lists come from `get_xfer_descs`,
handles have `.release()`). Both the older signatures (with `is_sorted`) and the newer ones
(without) are accepted.

Model: descriptor lists are kept here as a C-contiguous Nx3 uint64 array (address, length,
device) plus a memory type. An Nx3 uint64 array given to `get_xfer_descs` is kept as is (no
copy, no per-row Python work) and its data pointer goes straight to the engine when a transfer
is prepared; the engine reads the rows in place and merges runs of descriptors that are
contiguous on both sides as it pairs them (NIXL's descriptor-merging optimization, cf. its
deprecated `skip_desc_merge`), so the same bytes move with far less work per transfer; errors
name the caller's rows. Lists serialise to a
small fixed binary format (magic b"MRXD", version, memory type, count, rows; never pickle), so
`get_serialized_descs`/`deserialize_descs` are safe on untrusted bytes.

Differences (see docs/nixl.md): backends are ignored (multirail picks its transports);
only DRAM ("cpu") and VRAM ("cuda") memory; the listener binds 127.0.0.1 unless
`MULTIRAIL_NIXL_HOST` (or `listen_host=`) names an address; `enable_listen_thread=False` still
listens (the engine needs a side channel), on an ephemeral port.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from multirail.errors import InvalidArgumentError, MetadataError, MultirailError

logger = logging.getLogger("multirail.nixl")

DEFAULT_COMM_PORT = 8888
NIXL_INIT_AGENT = ""

_MEM_TYPES = {"DRAM": "DRAM", "cpu": "DRAM", "VRAM": "VRAM", "cuda": "VRAM"}
_MAGIC, _VERSION = b"MRXD", 1
_HEADER = struct.Struct("<4sBBxxQ")  # magic, version, mem type code, pad, count
_MEM_CODES = {"DRAM": 0, "VRAM": 1}
_MAX_DESCS = 1 << 24


class nixl_agent_config:
    """NIXL's agent config. Extra multirail options are keyword-only."""

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = 0, capture_telemetry: Any = False, num_threads: int = 0,
                 backends: Optional[list[str]] = None, *, listen_host: Optional[str] = None,
                 rails: Optional[list[str]] = None, policy: str = "weighted", connections: int = 1,
                 chunk_size: int = 1 << 20, timeout: float = 10.0, auth_secret: Optional[str] = None):
        if isinstance(capture_telemetry, list):  # older NIXL: 4th positional was `backends`
            backends, capture_telemetry = capture_telemetry, False
        self.backends = list(backends) if backends is not None else ["UCX"]
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = bool(capture_telemetry)
        self.num_threads = num_threads
        self.listen_host = listen_host
        self.rails, self.policy, self.connections = rails, policy, connections
        self.chunk_size, self.timeout, self.auth_secret = chunk_size, timeout, auth_secret


class nixl_xfer_dlist:
    """A descriptor list: rows of (address, length, device) and a memory type."""

    def __init__(self, mem_type: str, rows: np.ndarray, keep: Any = None) -> None:
        self.mem_type = mem_type
        self.rows = rows
        self._keep = keep  # the tensors/arrays the rows point into

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        a, n, d = self.rows[i]
        return int(a), int(n), int(d)

    def descCount(self) -> int:
        return len(self)

    def getType(self) -> str:
        return self.mem_type

    def total_bytes(self) -> int:
        return int(self.rows[:, 1].sum()) if len(self) else 0

    def __repr__(self) -> str:
        return f"nixl_xfer_dlist({self.mem_type}, {len(self)} descs, {self.total_bytes()} bytes)"


class nixl_reg_dlist(nixl_xfer_dlist):
    """A registration list; also holds the engine's registration for `deregister_memory`."""

    engine_reg: Any = None


class nixl_prepped_dlist_handle:
    def __init__(self, agent: "nixl_agent", peer: str, descs: nixl_xfer_dlist, engine_handle: Any) -> None:
        self._agent, self.peer, self.descs, self._handle = agent, peer, descs, engine_handle
        self._released = False

    def release(self) -> None:
        self._released = True  # prepared lists hold no engine resources beyond Python references


@dataclass
class nixl_xfer_telemetry:
    """NIXL's per-request telemetry: times in microseconds."""

    startTime: int
    postDuration: int
    xferDuration: int
    totalBytes: int
    descCount: int


class nixl_xfer_handle:
    def __init__(self, agent: "nixl_agent", engine_handle: Any, notif: bytes, total_bytes: int,
                 desc_count: int) -> None:
        self._agent, self._handle, self._notif = agent, engine_handle, notif
        self._released = False
        self._total, self._count = total_bytes, desc_count
        self._t_start = self._t_posted = self._t_done = 0.0

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._agent._engine.release_xfer_handle(self._handle)
            # Drop the reference too: the engine frees the request's region pins only when
            # its handle object is collected (seen with the first engine build).
            self._handle = None

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(released={self._released})"


def serialize_descs(descs: nixl_xfer_dlist) -> bytes:
    """Fixed binary layout, no pickle: header then count x (addr, len, dev) little-endian u64."""
    rows = np.ascontiguousarray(descs.rows, dtype="<u8")
    return _HEADER.pack(_MAGIC, _VERSION, _MEM_CODES[descs.mem_type], len(descs)) + rows.tobytes()


def deserialize_descs(serialized_descs: bytes) -> nixl_xfer_dlist:
    """Parse `serialize_descs` output; MetadataError (never a crash) on anything else."""
    data = bytes(serialized_descs)
    if len(data) < _HEADER.size:
        raise MetadataError("serialized descriptor list is truncated")
    magic, version, code, count = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise MetadataError("not a multirail.nixl descriptor list (bad magic)")
    if version != _VERSION:
        raise MetadataError(f"descriptor list version {version} is not supported (expected {_VERSION})")
    mem = {v: k for k, v in _MEM_CODES.items()}.get(code)
    if mem is None or count > _MAX_DESCS or len(data) != _HEADER.size + 24 * count:
        raise MetadataError("malformed descriptor list (memory type, count or length)")
    rows = np.frombuffer(data, dtype="<u8", offset=_HEADER.size).reshape(count, 3).astype(np.uint64)
    return nixl_xfer_dlist(mem, rows)


def _to_bytes(msg: Union[bytes, str, None]) -> bytes:
    if msg is None:
        return b""
    return msg.encode() if isinstance(msg, str) else bytes(msg)


def _sorted_compat(is_sorted: Any, backends: Optional[list[str]]) -> Optional[list[str]]:
    """Older NIXL had `is_sorted` where newer has `backends`; accept either positionally."""
    return is_sorted if isinstance(is_sorted, list) else backends


class nixl_agent:
    """A NIXL agent backed by `multirail.Agent`."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False) -> None:
        import multirail  # lazy: importing this module must not need the extension

        self._mr = multirail
        conf = nixl_conf or nixl_agent_config()
        host = conf.listen_host or os.environ.get("MULTIRAIL_NIXL_HOST") or "127.0.0.1"
        port = conf.port if conf.enable_listen else 0
        cfg = multirail.AgentConfig(host=host, port=port, connections=conf.connections, rails=conf.rails,
                                    policy=conf.policy, chunk_size=conf.chunk_size, timeout=conf.timeout,
                                    auth_secret=conf.auth_secret)
        self._engine = multirail.Agent(agent_name, cfg)
        self._conf = conf
        self.name = agent_name
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, int] = {b: i for i, b in enumerate(conf.backends)}
        self.plugin_list = ["MULTIRAIL"]
        self.nixl_mems = dict(_MEM_TYPES)
        self.nixl_ops = {"WRITE": "WRITE", "READ": "READ"}
        logger.info("Initialized NIXL agent (multirail): %s", agent_name)

    # -- plugins and backends (multirail has one engine; these are informational) ---------
    def get_plugin_list(self) -> list[str]:
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        return ["DRAM", "VRAM"]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return ["DRAM", "VRAM"]

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return {}

    def create_backend(self, backend: str, initParams: Optional[dict[str, str]] = None) -> None:
        self.backends.setdefault(backend, len(self.backends))

    def get_listen_port(self) -> int:
        return int(self._engine.port)

    # -- descriptors ---------------------------------------------------------------------
    def _mem(self, mem_type: Optional[str]) -> str:
        if mem_type is None:
            return "DRAM"
        if mem_type not in _MEM_TYPES:
            raise InvalidArgumentError(f"memory type {mem_type!r} is not supported by multirail "
                                       "(DRAM/cpu and VRAM/cuda only)")
        return _MEM_TYPES[mem_type]

    def _rows(self, descs: Any, mem_type: Optional[str], width: int) -> Optional[tuple[str, np.ndarray, Any]]:
        """(mem type, Nx3 rows, objects to keep alive) from any NIXL input form, or None."""
        if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] == 3 and mem_type is not None:
            # The fast path: a C-contiguous uint64 array is kept as is (no copy); anything else
            # is converted once, here, never again per transfer.
            return self._mem(mem_type), np.ascontiguousarray(descs, dtype=np.uint64), None
        objs = _buffers(descs)
        if objs is not None:
            rows = np.array([_buffer_row(o) for o in objs], dtype=np.uint64).reshape(-1, 3)
            mem = "VRAM" if objs and _is_cuda(objs[0]) else "DRAM"
            return mem, rows, objs
        if isinstance(descs, (list, tuple)) and descs and all(isinstance(d, tuple) for d in descs):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if any(len(d) != width for d in descs):
                logger.error("%d-tuple list needed", width)
                return None
            return self._mem(mem_type), np.array([d[:3] for d in descs], dtype=np.uint64).reshape(-1, 3), None
        logger.error("unsupported descriptor input of type %s", type(descs).__name__)
        return None

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None, is_sorted: bool = False) -> Optional[nixl_xfer_dlist]:
        if isinstance(descs, nixl_reg_dlist):
            logger.error("RegList type detected for transfer, please use XferList")
            return None
        if isinstance(descs, nixl_xfer_dlist):
            return descs
        got = self._rows(descs, mem_type, 3)
        return None if got is None else nixl_xfer_dlist(got[0], got[1], got[2])

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None, is_sorted: bool = False) -> Optional[nixl_reg_dlist]:
        if isinstance(descs, nixl_reg_dlist):
            return descs
        if isinstance(descs, nixl_xfer_dlist):
            logger.error("XferList type detected for registration, please use RegList")
            return None
        got = self._rows(descs, mem_type, 4)
        return None if got is None else nixl_reg_dlist(got[0], got[1], got[2])

    def get_serialized_descs(self, descs: nixl_xfer_dlist) -> bytes:
        return serialize_descs(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> nixl_xfer_dlist:
        return deserialize_descs(serialized_descs)

    def _engine_descs(self, d: nixl_xfer_dlist) -> Any:
        """Engine descriptors over the list's rows, no copy when they are already a C-contiguous
        uint64 array."""
        return self._engine.get_xfer_descs(_contiguous_rows(d.rows), mem_type=d.mem_type)

    # -- memory ----------------------------------------------------------------------------
    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None, is_sorted: Any = False,
                        backends: Optional[list[str]] = None) -> Optional[nixl_reg_dlist]:
        _sorted_compat(is_sorted, backends)
        reg = self.get_reg_descs(reg_list, mem_type)
        if reg is None:
            return None
        target = reg._keep if reg._keep is not None else [tuple(int(x) for x in r) for r in reg.rows]
        reg.engine_reg = self._engine.register_memory(target, mem_type=reg.mem_type)
        return reg

    def deregister_memory(self, dereg_list: nixl_reg_dlist, backends: Optional[list[str]] = None) -> None:
        if getattr(dereg_list, "engine_reg", None) is None:
            raise InvalidArgumentError("deregister_memory needs the list returned by register_memory")
        self._engine.deregister_memory(dereg_list.engine_reg)
        dereg_list.engine_reg = None

    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> list[Optional[dict[str, str]]]:
        raise NotImplementedError("query_memory (storage backends) is not supported by multirail")

    # -- metadata ---------------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        return self._engine.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        return self._engine.add_remote_agent(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        self._engine.remove_remote_agent(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        if not ip_addr:
            raise InvalidArgumentError("multirail has no central metadata server: pass ip_addr")
        self._engine.send_local_metadata(ip_addr, port)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT,
                              label: str = "") -> None:
        if not ip_addr:
            raise InvalidArgumentError("multirail has no central metadata server: pass ip_addr")
        self._engine.fetch_remote_metadata(remote_agent, ip_addr, port)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Accepted for compatibility; peers drop this agent when it closes."""

    def check_remote_metadata(self, agent: str, descs: Any = None) -> bool:
        return bool(self._engine.check_remote_metadata(agent))

    def make_connection(self, remote_agent: str, backends: Optional[list[str]] = None) -> None:
        """Connections are made on first use; accepted for compatibility."""

    # -- transfers --------------------------------------------------------------------------
    def _op(self, operation: str) -> str:
        if operation not in self.nixl_ops:
            raise InvalidArgumentError(f"Invalid op code {operation!r} (READ or WRITE)")
        return operation

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Optional[str] = None,
                        is_sorted: Any = False, backends: Optional[list[str]] = None) -> nixl_prepped_dlist_handle:
        descs = self.get_xfer_descs(xfer_list, mem_type)
        if descs is None:
            raise InvalidArgumentError("prep_xfer_dlist: unusable descriptor list")
        peer = "" if agent_name in ("NIXL_INIT_AGENT", "") else agent_name
        return nixl_prepped_dlist_handle(self, peer, descs, self._engine.prep_xfer_dlist(peer, self._engine_descs(descs)))

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Any, remote_xfer_side: nixl_prepped_dlist_handle, remote_indices: Any,
                          notif_msg: Union[bytes, str] = b"", backends: Optional[list[str]] = None,
                          skip_desc_merge: bool = False) -> nixl_xfer_handle:
        li, ri = [int(i) for i in local_indices], [int(i) for i in remote_indices]
        op, notif = self._op(operation), _to_bytes(notif_msg)
        h = self._engine.make_prepped_xfer(op, local_xfer_side._handle, li, remote_xfer_side._handle, ri, notif=notif)
        return nixl_xfer_handle(self, h, notif, int(h.total_bytes), len(li))

    def initialize_xfer(self, operation: str, local_descs: nixl_xfer_dlist, remote_descs: nixl_xfer_dlist,
                        remote_agent: str, notif_msg: Union[bytes, str] = b"",
                        backends: Optional[list[str]] = None) -> nixl_xfer_handle:
        if not isinstance(local_descs, nixl_xfer_dlist) or not isinstance(remote_descs, nixl_xfer_dlist):
            raise InvalidArgumentError("initialize_xfer needs descriptor lists from get_xfer_descs/deserialize_descs")
        op, notif = self._op(operation), _to_bytes(notif_msg)
        # The rows go to the engine as they are (no copy when already C-contiguous uint64); it
        # merges contiguous runs itself and names the caller's rows in its errors.
        h = self._engine.initialize_xfer(op, self._engine_descs(local_descs), self._engine_descs(remote_descs),
                                         remote_agent, notif=notif)
        return nixl_xfer_handle(self, h, notif, int(h.total_bytes), len(local_descs))

    def _state(self, state: Any) -> str:
        XferState = self._mr.XferState
        if state == XferState.DONE:
            return "DONE"
        if state == XferState.IN_PROGRESS:
            return "PROC"
        return "ERR"

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Union[bytes, str] = b"") -> str:
        msg = _to_bytes(notif_msg)
        try:
            handle._t_start = time.perf_counter()
            handle._t_done = 0.0
            state = self._state(self._engine.transfer(handle._handle, notif=msg or None))
            handle._t_posted = time.perf_counter()
        except MultirailError as e:
            logger.error("transfer failed: %s: %s", type(e).__name__, e)
            return "ERR"
        if state == "DONE":
            handle._t_done = handle._t_posted
        return state

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        try:
            state = self._state(self._engine.check_xfer_state(handle._handle))
        except MultirailError as e:
            logger.error("transfer failed: %s: %s", type(e).__name__, e)
            return "ERR"
        if state == "DONE" and not handle._t_done:
            handle._t_done = time.perf_counter()
        return state

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixl_xfer_telemetry:
        if not self._conf.capture_telemetry:
            raise InvalidArgumentError("telemetry is disabled: create the agent with "
                                       "nixl_agent_config(capture_telemetry=True)")
        us = 1e6
        post = (handle._t_posted - handle._t_start) * us if handle._t_posted else 0
        xfer = (handle._t_done - handle._t_start) * us if handle._t_done else 0
        return nixl_xfer_telemetry(int(handle._t_start * us), int(post), int(xfer), handle._total, handle._count)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        raise NotImplementedError("estimate_xfer_cost is not supported by multirail")

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        return "MULTIRAIL"

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    # -- notifications ----------------------------------------------------------------------
    def get_new_notifs(self, backends: Optional[list[str]] = None) -> dict[str, list[bytes]]:
        return {k: list(v) for k, v in self._engine.get_new_notifs().items() if v}

    def update_notifs(self, backends: Optional[list[str]] = None) -> dict[str, list[bytes]]:
        for peer, msgs in self.get_new_notifs().items():
            self.notifs.setdefault(peer, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: Union[bytes, str],
                               backends: Optional[list[str]] = None, tag_is_prefix: bool = True) -> bool:
        tag = _to_bytes(lookup_tag)
        self.update_notifs()
        msgs = self.notifs.get(remote_agent_name, [])
        for msg in msgs:
            if (tag_is_prefix and msg.startswith(tag)) or (not tag_is_prefix and tag in msg):
                msgs.remove(msg)
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: Union[bytes, str], backend: Optional[str] = None) -> None:
        self._engine.send_notif(remote_agent_name, _to_bytes(notif_msg))

    def close(self) -> None:
        """multirail extension: stop the engine now instead of at garbage collection."""
        self._engine.close()


# -- buffer helpers -------------------------------------------------------------------------

def _is_tensor(o: Any) -> bool:
    return type(o).__module__.startswith("torch") and hasattr(o, "data_ptr")


def _is_cuda(o: Any) -> bool:
    return _is_tensor(o) and str(o.device).startswith("cuda")


def _buffers(descs: Any) -> Optional[list[Any]]:
    """The tensor/array objects of a tensor, an array, or a list of them; None otherwise."""
    if _is_tensor(descs) or (isinstance(descs, np.ndarray) and not (descs.ndim == 2 and descs.shape[1] == 3 and descs.dtype == np.uint64)):
        return [descs]
    if isinstance(descs, (list, tuple)) and descs and all(_is_tensor(d) or isinstance(d, np.ndarray) for d in descs):
        return list(descs)
    return None


def _contiguous_rows(rows: np.ndarray) -> np.ndarray:
    """`rows` as a C-contiguous uint64 array: the same object when it already is one."""
    if rows.dtype == np.uint64 and rows.flags.c_contiguous:
        return rows
    return np.ascontiguousarray(rows, dtype=np.uint64)


def _buffer_row(o: Any) -> tuple[int, int, int]:
    if _is_tensor(o):
        if not o.is_contiguous():
            raise InvalidArgumentError("Please use a list of contiguous Tensors")
        dev = o.get_device()
        return int(o.data_ptr()), int(o.numel() * o.element_size()), 0 if dev < 0 else int(dev)
    if not o.flags["C_CONTIGUOUS"]:
        raise InvalidArgumentError("numpy arrays must be C-contiguous")
    return int(o.ctypes.data), int(o.nbytes), 0
