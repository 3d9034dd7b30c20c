"""`nixl._api` on multirail: `nixl_agent`, `nixl_agent_config` and the handle classes.

Methods, argument names, defaults, return values and exceptions follow NIXL's `_api.py` (1.5):
states are "DONE"/"PROC" (a failure raises the NIXL exception of its status, as in NIXL),
notifications are `{agent_name: [bytes]}`, descriptor lists are `bindings.nixlXferDList` /
`nixlRegDList`, handles have `.release()`. Differences are listed in docs/nixl.md.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any, Optional, Union

import numpy as np

from multirail.nixl import bindings as nixlBind
from multirail.nixl.logging import get_logger

logger = get_logger(__name__)

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT
NIXL_INIT_AGENT = nixlBind.NIXL_INIT_AGENT

nixlXferDList = nixlBind.nixlXferDList
nixlRegDList = nixlBind.nixlRegDList
nixlRemoteDList = nixlBind.nixlRemoteDList
# Names of the earlier multirail.nixl module, kept for its callers.
nixl_xfer_dlist = nixlXferDList
nixl_reg_dlist = nixlRegDList
nixl_xfer_telemetry = nixlBind.nixlXferTelemetry


def serialize_descs(descs: Any) -> bytes:
    """A descriptor list as bytes (fixed binary format, never pickle)."""
    return nixlBind._serialize(descs)


def deserialize_descs(serialized_descs: Any) -> Any:
    """The list `serialize_descs` wrote; `multirail.MetadataError` on anything else."""
    return nixlBind._deserialize(serialized_descs)


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported already
    return torch is not None and isinstance(obj, torch.Tensor)


class nixl_prepped_dlist_handle:
    """Handle of a prepared descriptor list (`prep_xfer_dlist`); `release()` frees it."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent: Any, value: int) -> None:
        self._handle, self._agent, self._released = int(value), agent, False

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            self._agent.releasedDlistH(self._handle)
            self._released = True

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                self._agent.releasedDlistH(self._handle)
            except Exception:  # noqa: BLE001 - finalizer
                pass


class nixl_xfer_handle:
    """Handle of a transfer request; `release()` frees it (also done at garbage collection)."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent: Any, value: int) -> None:
        self._handle, self._agent, self._released = int(value), agent, False

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            self._agent.releaseXferReq(self._handle)
            self._released = True

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                self._agent.releaseXferReq(self._handle)
            except Exception:  # noqa: BLE001 - finalizer
                pass


nixl_backend_handle = int


class nixl_thread_sync_t(Enum):
    """Thread synchronization modes (accepted; the multirail engine is always thread-safe)."""

    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:
    """NIXL's agent configuration. multirail's own options are keyword-only:
    listen_host (default $MULTIRAIL_NIXL_HOST or 127.0.0.1), rails, policy, connections,
    chunk_size, timeout, auth_secret (see multirail.AgentConfig)."""

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = DEFAULT_COMM_PORT, capture_telemetry: Any = False, num_threads: int = 0,
                 backends: Optional[list[str]] = None, sync_mode: Optional[nixl_thread_sync_t] = None, *,
                 listen_host: Optional[str] = None, rails: Any = None, policy: Optional[str] = None,
                 connections: Optional[int] = None, chunk_size: Optional[int] = None, timeout: Optional[float] = None,
                 auth_secret: Optional[Union[str, bytes]] = None) -> None:
        if isinstance(capture_telemetry, list):  # older NIXL: the 4th positional was `backends`
            backends, capture_telemetry = capture_telemetry, False
        self.backends = list(backends) if backends is not None else ["UCX"]
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = bool(capture_telemetry)
        self.num_threads = num_threads
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.sync_mode = sync_mode
        self.listen_host = listen_host
        self.rails, self.policy, self.connections = rails, policy, connections
        self.chunk_size, self.timeout, self.auth_secret = chunk_size, timeout, auth_secret


_OPTIONS = ("listen_host", "rails", "policy", "connections", "chunk_size", "timeout", "auth_secret")


def _handles(agent: "nixl_agent", backends: Optional[list[str]]) -> list[int]:
    return [agent.backends[b] for b in backends or []]


class nixl_agent:
    """A NIXL agent on the multirail engine.

    Args:
        agent_name: Name of the agent (non-empty).
        nixl_conf: Optional configuration, see nixl_agent_config.
        instantiate_all: Create every available backend plugin.
    """

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False) -> None:
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        default_sync = (nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if nixl_conf.enable_listen
                        else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
        cfg = nixlBind.nixlAgentConfig()
        cfg.useProgThread = nixl_conf.enable_pthread
        cfg.useListenThread = nixl_conf.enable_listen
        cfg.listenPort = nixl_conf.port
        cfg.syncMode = (nixl_conf.sync_mode or default_sync).value
        cfg.pthrDelay = 0
        cfg.lthrDelay = 100000
        cfg.captureTelemetry = nixl_conf.capture_telemetry
        cfg.multirail = {k: getattr(nixl_conf, k, None) for k in _OPTIONS}
        self.agent = nixlBind.nixlAgent(agent_name, cfg)  # looked up at call time (tests patch it)

        self.name = agent_name
        self._leaked_xfer_handles: list[int] = []
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, int] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_list = self.agent.getAvailPlugins()
        self.plugin_b_options: dict[str, dict[str, str]] = {}
        self.plugin_mem_types: dict[str, list[str]] = {}
        backends = self.plugin_list if instantiate_all else nixl_conf.backends
        for b in backends:
            if b not in self.plugin_list:
                logger.warning("Skipping backend registration %s due to the missing plugin.", b)
            else:
                init: dict[str, str] = {}
                if nixl_conf.num_threads > 0:
                    init["num_threads"] = str(nixl_conf.num_threads)
                self.create_backend(b, init)
        self.nixl_mems = {
            "DRAM": nixlBind.DRAM_SEG, "VRAM": nixlBind.VRAM_SEG, "FILE": nixlBind.FILE_SEG,
            "BLOCK": nixlBind.BLK_SEG, "OBJ": nixlBind.OBJ_SEG,
            "cpu": nixlBind.DRAM_SEG, "cuda": nixlBind.VRAM_SEG,  # deprecated names, as in NIXL
        }
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
        logger.info("Initialized NIXL agent: %s", agent_name)

    # ------------------------------------------------------------------ plugins and backends
    def _load_plugin_params(self, plugin: str) -> None:
        if plugin not in self.plugin_list:
            return
        opts, mems = self.agent.getPluginParams(plugin)
        self.plugin_b_options[plugin], self.plugin_mem_types[plugin] = opts, mems

    def get_plugin_list(self) -> list[str]:
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        if backend not in self.plugin_mem_types:
            self._load_plugin_params(backend)
        if backend not in self.plugin_mem_types:
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        if backend not in self.plugin_b_options:
            self._load_plugin_params(backend)
        if backend not in self.plugin_b_options:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend: str) -> list[str]:
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend: str) -> dict[str, str]:
        if backend in self.backend_options:
            return self.backend_options[backend]
        logger.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend: str, initParams: Optional[dict[str, str]] = None) -> None:
        self.backends[backend] = self.agent.createBackend(backend, dict(initParams or {}))
        opts, mems = self.agent.getBackendParams(self.backends[backend])
        self.backend_mems[backend], self.backend_options[backend] = mems, opts
        logger.info("Backend %s was instantiated", backend)

    def get_listen_port(self) -> int:
        """multirail extension: the port the side channel listens on."""
        return int(self.agent.engine.port)

    # ------------------------------------------------------------------------------ memory
    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None, is_sorted: Any = False,
                        backends: Optional[list[str]] = None) -> nixlRegDList:
        if isinstance(is_sorted, list):  # older NIXL had is_sorted where newer has backends
            backends = is_sorted
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        if reg_descs is None:
            raise TypeError("registerMem(): unusable registration descriptors (see the logged error)")
        self.agent.registerMem(reg_descs, _handles(self, backends))
        return reg_descs

    def deregister_memory(self, dereg_list: nixlRegDList, backends: Optional[list[str]] = None) -> None:
        self.agent.deregisterMem(dereg_list, _handles(self, backends))

    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> list[Optional[dict[str, str]]]:
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}")
        return self.agent.queryMem(reg_descs, self.backends[backend])

    def make_connection(self, remote_agent: str, backends: Optional[list[str]] = None) -> None:
        self.agent.makeConnection(remote_agent, _handles(self, backends))

    # --------------------------------------------------------------------------- transfers
    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Optional[str] = None,
                        is_sorted: Any = False, backends: Optional[list[str]] = None) -> nixl_prepped_dlist_handle:
        if isinstance(is_sorted, list):
            backends = is_sorted
        if agent_name in ("NIXL_INIT_AGENT", ""):
            agent_name = nixlBind.NIXL_INIT_AGENT
        handles = _handles(self, backends)
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            h = self.agent.prepXferDlist(agent_name, self.nixl_mems[mem_type], xfer_list, handles)
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
            if descs is None:
                raise TypeError("prepXferDlist(): unusable transfer descriptors (see the logged error)")
            h = self.agent.prepXferDlist(agent_name, descs, handles)
        return nixl_prepped_dlist_handle(self.agent, h)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        duration, err_margin, method = self.agent.estimateXferCost(req_handle._handle)
        return duration, err_margin, ("ANALYTICAL_BACKEND" if method == nixlBind.NIXL_COST_ANALYTICAL_BACKEND else "UNKNOWN")

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle, local_indices: Any,
                          remote_xfer_side: nixl_prepped_dlist_handle, remote_indices: Any,
                          notif_msg: Union[bytes, str] = b"", backends: Optional[list[str]] = None,
                          skip_desc_merge: bool = False) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        h = self.agent.makeXferReq(op, local_xfer_side._handle, local_indices, remote_xfer_side._handle,
                                   remote_indices, notif_msg, _handles(self, backends), skip_desc_merge)
        return nixl_xfer_handle(self.agent, h)

    def initialize_xfer(self, operation: str, local_descs: nixlXferDList, remote_descs: nixlXferDList,
                        remote_agent: str, notif_msg: Union[bytes, str] = b"",
                        backends: Optional[list[str]] = None) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        h = self.agent.createXferReq(op, local_descs, remote_descs, remote_agent, notif_msg, _handles(self, backends))
        return nixl_xfer_handle(self.agent, h)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Union[bytes, str] = b"") -> str:
        status = self.agent.postXferReq(handle._handle, notif_msg)
        return "DONE" if status == nixlBind.NIXL_SUCCESS else "PROC" if status == nixlBind.NIXL_IN_PROG else "ERR"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        status = self.agent.getXferStatus(handle._handle)
        return "DONE" if status == nixlBind.NIXL_SUCCESS else "PROC" if status == nixlBind.NIXL_IN_PROG else "ERR"

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlBind.nixlXferTelemetry:
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        b = self.agent.queryXferBackend(handle._handle)
        return next((name for name, h in self.backends.items() if h == b), "MULTIRAIL")

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: Optional[list[str]] = None) -> int:
        return self.agent.prepMemView(dlist, _handles(self, backends))

    def release_mem_view(self, mvh: int) -> None:
        self.agent.releaseMemView(mvh)

    # ----------------------------------------------------------------------- notifications
    def get_new_notifs(self, backends: Optional[list[str]] = None) -> dict[str, list[bytes]]:
        return self.agent.getNotifs({}, _handles(self, backends))

    def update_notifs(self, backends: Optional[list[str]] = None) -> dict[str, list[bytes]]:
        self.notifs = self.agent.getNotifs(self.notifs, _handles(self, backends))
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: Union[bytes, str],
                               backends: Optional[list[str]] = None, tag_is_prefix: bool = True) -> bool:
        tag = lookup_tag.encode() if isinstance(lookup_tag, str) else bytes(lookup_tag)
        self.notifs = self.agent.getNotifs(self.notifs, _handles(self, backends))
        for msg in self.notifs.get(remote_agent_name, []):
            if (tag_is_prefix and msg.startswith(tag)) or (not tag_is_prefix and tag in msg):
                self.notifs[remote_agent_name].remove(msg)
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: Union[bytes, str], backend: Optional[str] = None) -> None:
        if backend is None:
            self.agent.genNotif(remote_agent_name, notif_msg)
        else:
            self.agent.genNotif(remote_agent_name, notif_msg, [self.backends[backend]])

    # ---------------------------------------------------------------------------- metadata
    def get_agent_metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(self, descs: nixlRegDList, inc_conn_info: bool = False,
                                   backends: Optional[list[str]] = None) -> bytes:
        return self.agent.getLocalPartialMD(descs, inc_conn_info, _handles(self, backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata; returns its name as bytes, as NIXL does."""
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(self, descs: nixlRegDList, inc_conn_info: bool = False,
                                    backends: Optional[list[str]] = None, ip_addr: str = "",
                                    port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        self.agent.sendLocalPartialMD(descs, inc_conn_info, _handles(self, backends), ip_addr, port, label)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT,
                              label: str = "") -> None:
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs: Optional[nixlXferDList] = None) -> bool:
        if descs is None:
            descs = nixlBind.nixlXferDList(nixlBind.DRAM_SEG)
        return self.agent.checkRemoteMD(agent, descs) == nixlBind.NIXL_SUCCESS

    # -------------------------------------------------------------------------- descriptors
    @staticmethod
    def _tensor_mem_type(tensor: Any) -> str:
        return "DRAM" if tensor.get_device() == -1 else "VRAM"

    def _from_objects(self, cls: type, descs: Any, mem_type: Optional[str], width: int) -> Any:
        """Lists from tensors and numpy buffers (one descriptor per object); None if unusable."""
        objs = descs if isinstance(descs, (list, tuple)) else [descs]
        rows = np.zeros((len(objs), 3), dtype=np.uint64)
        first = None
        for i, o in enumerate(objs):
            if _is_tensor(o):
                if first is not None and o.device != first:
                    return None
                first = o.device
                if not o.is_contiguous():
                    logger.error("Please use a list of contiguous Tensors")
                    return None
                dev = o.get_device()
                rows[i] = (o.data_ptr(), o.numel() * o.element_size(), 0 if dev == -1 else dev)
            elif isinstance(o, np.ndarray):  # multirail extension: a numpy array is a DRAM buffer
                if not o.flags.c_contiguous:
                    logger.error("Please use C-contiguous numpy arrays")
                    return None
                rows[i] = (o.ctypes.data, o.nbytes, 0)
            else:
                return None
        if first is not None:
            mem_type = self._tensor_mem_type(objs[0])
        out = cls(self.nixl_mems[mem_type or "DRAM"], rows)
        out._keep = objs
        return out

    def _get_descs(self, cls: type, other: type, descs: Any, mem_type: Optional[str], width: int, what: str) -> Any:
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, other):
            logger.error("%s type detected for %s, please use %s",
                         "RegList" if other is nixlRegDList else "XferList", what,
                         "XferList" if cls is nixlXferDList else "RegList")
            return None
        if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] == 3 and descs.dtype.kind in "ui":
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            mem = self.nixl_mems[mem_type]
            if descs.dtype not in (np.uint64, np.int64) or not descs.flags.c_contiguous:
                descs = np.ascontiguousarray(descs, dtype=np.uint64)  # converted once (NIXL refuses these)
            return cls(mem, descs)
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if len(descs[0]) != width:
                logger.error("%d-tuple list needed for %s", width, what)
                return None
            return cls(self.nixl_mems[mem_type], list(descs))
        if isinstance(descs, list) and not descs and mem_type is not None:
            return cls(self.nixl_mems[mem_type])
        if _is_tensor(descs) or isinstance(descs, np.ndarray) or (
                isinstance(descs, (list, tuple)) and descs and all(_is_tensor(d) or isinstance(d, np.ndarray) for d in descs)):
            return self._from_objects(cls, descs, mem_type, width)
        logger.error("Unsupported descriptor input of type %s", type(descs).__name__)
        return None

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None, is_sorted: bool = False) -> Optional[nixlXferDList]:
        """nixlXferDList from: a list of (address, len, device) tuples with mem_type; a tensor or
        list of tensors; an Nx3 integer numpy array with mem_type (a C-contiguous uint64 one is
        used without a copy); a numpy array or list of them (one buffer each, multirail
        extension); or a nixlXferDList (returned as is). None, with an error logged, otherwise."""
        return self._get_descs(nixlXferDList, nixlRegDList, descs, mem_type, 3, "transfer")

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None, is_sorted: bool = False) -> Optional[nixlRegDList]:
        """nixlRegDList from the same inputs as get_xfer_descs, with 4-tuples
        (address, len, device, meta info) instead of 3-tuples."""
        return self._get_descs(nixlRegDList, nixlXferDList, descs, mem_type, 4, "registration")

    def get_remote_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[nixlRemoteDList]:
        if isinstance(descs, nixlRemoteDList):
            return descs
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("Please specify a mem type")
                return None
            if len(descs[0]) != 4:
                logger.error("4-tuple list (addr, len, dev_id, agent_name) needed for remote descriptors")
                return None
            return nixlRemoteDList(self.nixl_mems[mem_type], list(descs))
        return None

    def get_serialized_descs(self, descs: Any) -> bytes:
        """The list as bytes: multirail's fixed binary format (NIXL pickles; this never does)."""
        return nixlBind._serialize(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        """The list `get_serialized_descs` wrote; `multirail.MetadataError` on anything else."""
        return nixlBind._deserialize(serialized_descs)

    # ---------------------------------------------------------------------- multirail extras
    def close(self) -> None:
        """multirail extension: stop the engine now instead of at garbage collection."""
        self.agent.close()


__all__ = ["DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle", "nixl_prepped_dlist_handle",
           "nixl_thread_sync_t", "nixl_xfer_handle"]
