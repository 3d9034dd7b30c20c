"""`nixl._bindings` on multirail: enums, constants, exception classes, descriptor lists and the
low-level `nixlAgent` (NIXL's C++ agent API as its pybind module exposes it).

Replace `import nixl._bindings` by `import multirail.nixl.bindings`. Names, argument names,
return values and the exception raised for each failure follow NIXL's `_bindings` (1.5):

* a failing call raises the class of NIXL's status (`nixlNotFoundError` for NIXL_ERR_NOT_FOUND,
  ...). Raised for an engine error, the class also derives from the multirail error it stands
  for (`except multirail.OutOfBoundsError` keeps working) and its message is
  "NIXL_ERR_...: <what the engine said>";
* descriptor lists are NIXL's (`descCount`, `getType`, `isEmpty`, `addDesc`/`append`, `remDesc`,
  `index`, `clear`, `print`, `trim`, indexing, `==`, pickling) kept as an (N, 3) uint64 array: a
  C-contiguous uint64 array given to the constructor is used in place (NIXL copies it), so a
  transfer hands the engine the caller's rows without a copy;
* the agent runs on one multirail engine (`multirail.Agent`); the plugins "UCX" and "MULTIRAIL"
  both stand for it (multirail chooses transports and rails itself).

Importing this module does not need the engine extension (it is loaded when an agent is made).
"""

from __future__ import annotations

import ctypes
import datetime
import itertools
import logging
import math
import os
import struct
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

from multirail import errors as _mr

from ._enums import (  # noqa: F401  (moved there; names kept here)
    _Enum,
    nixl_mem_t,
    nixl_xfer_op_t,
    nixl_status_t,
    nixl_thread_sync_t,
    nixl_cost_t,
    NIXL_THREAD_SYNC_NONE,
    NIXL_THREAD_SYNC_STRICT,
    NIXL_THREAD_SYNC_RW,
    NIXL_THREAD_SYNC_DEFAULT,
    NIXL_INIT_AGENT,
    DEFAULT_COMM_PORT,
    HAVE_UCX_GPU_DEVICE_API,
    _PLUGINS,
    _PLUGIN_MEMS,
    nixlNotPostedError,
    nixlInvalidParamError,
    nixlBackendError,
    nixlNotFoundError,
    nixlMismatchError,
    nixlNotAllowedError,
    nixlRepostActiveError,
    nixlUnknownError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlCancelledError,
    nixlNoTelemetryError,
    _STATUS_NAME,
    _ERROR_MAP,
    _COMBINED,
    _err,
    _nixl_error,
    _U64,
    _mem_arg,
    _MEM_NAMES,
    _MEM_STR,
    _u,
    _meta_bytes,
    _rows_from_array,
)
for _e in (nixl_mem_t, nixl_xfer_op_t, nixl_status_t, nixl_cost_t):  # pybind11 export_values()
    globals().update(_e.__members__)

from ._dlist import (  # noqa: F401  (moved there; names kept here)
    _DList,
    type_name,
    nixlXferDList,
    nixlRegDList,
    nixlRemoteDList,
    _MAGIC,
    _HEADER,
    _HEADER_V1,
    _MAX_DESCS,
    _KINDS,
    _serialize,
    _deserialize,
    _restore,
)
from ._remote import (  # noqa: F401  (moved there; names kept here)
    _MD_MAGIC,
    _PARTIAL_MAGIC,
    _Meta,
    _FRAME,
    _K_HELLO,
    _K_CHALLENGE,
    _K_AUTH,
    _K_WELCOME,
    _K_RESP,
    _K_METAGET,
    _K_META,
    _K_METAPUT,
    _K_ERROR,
    _control,
    _recv_exact,
    _STATUS_ERRORS,
    _status_error,
    STORE_FACTORY,
    _etcd_url,
    _EngineKV,
)

_log = logging.getLogger("multirail.nixl.bindings")

# ------------------------------------------------------------------------ enums and constants


# ------------------------------------------------------------------- config and telemetry


class nixlAgentConfig:
    """NIXL's agent config. Positional form as in NIXL: (useProgThread, useListenThread,
    listenPort, syncMode, numWorkers, pthrDelay, lthrDelay, captureTelemetry). `multirail` holds
    the multirail options (listen_host, rails, policy, connections, chunk_size, timeout,
    auth_secret) that `nixl_agent_config` passes through."""

    def __init__(self, useProgThread: bool = False, useListenThread: bool = False, listenPort: int = DEFAULT_COMM_PORT,
                 syncMode: Any = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT, numWorkers: int = 1,
                 pthrDelay: int = 0, lthrDelay: int = 100000, captureTelemetry: bool = False) -> None:
        self.useProgThread = bool(useProgThread)
        self.useListenThread = bool(useListenThread)
        self.listenPort = int(listenPort)
        self.syncMode = nixl_thread_sync_t(int(syncMode))
        self.numWorkers = int(numWorkers)
        self.pthrDelay = int(pthrDelay)
        self.lthrDelay = int(lthrDelay)
        self.captureTelemetry = bool(captureTelemetry)
        self.etcdWatchTimeout = datetime.timedelta(seconds=5)
        self.multirail: dict[str, Any] = {}


class nixlXferTelemetry:
    """Per-request telemetry: `startTime` (us since the epoch), `postDuration` and `xferDuration`
    (us, measured around the post and until DONE was seen), `totalBytes`, `descCount`."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0, totalBytes: int = 0,
                 descCount: int = 0) -> None:
        self.startTime, self.postDuration, self.xferDuration = startTime, postDuration, xferDuration
        self.totalBytes, self.descCount = totalBytes, descCount

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})")


_TRUE = {"y", "yes", "on", "1", "true", "enable"}
_FALSE = {"n", "no", "off", "0", "false", "disable"}


def _telemetry_enabled(requested: bool) -> bool:
    """NIXL's rule: NIXL_TELEMETRY_ENABLE, when set, decides; otherwise the config does."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if env is None:
        return bool(requested)
    v = env.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        if requested:
            _log.warning("NIXL telemetry is disabled; ignoring telemetry requested through agent config")
        return False
    raise RuntimeError(f"Conversion to bool failed for NIXL_TELEMETRY_ENABLE={env!r}")


# -------------------------------------------------------------- metadata blobs (docs/PROTOCOL.md)


# ------------------------------------------------------------------------------- the agent


class _Regs:
    """What `multirail.Agent.deregister_memory` reads of a registration: its region ids."""

    __slots__ = ("region_ids",)

    def __init__(self, ids: list[int]) -> None:
        self.region_ids = ids


class _Xfer:
    """A transfer request: the engine handle plus what telemetry needs."""

    __slots__ = ("h", "total", "count", "t_start", "t_posted", "t_done", "wall", "state", "write", "posted")

    def __init__(self, h: Any, total: int, count: int, write: bool = False) -> None:
        self.h, self.total, self.count, self.write, self.posted = h, total, count, write, False
        self.t_start = self.t_posted = self.t_done = self.wall = 0.0
        self.state = 0  # 0 never posted, then nixl_status_t values


class _Prepped:
    __slots__ = ("peer", "rows", "mem", "loopback", "strided")

    def __init__(self, peer: str, rows: np.ndarray, mem: nixl_mem_t, loopback: bool,
                 strided: np.ndarray | None = None) -> None:
        self.peer, self.rows, self.mem, self.loopback = peer, rows, mem, loopback
        # The Nx5 rows the list was prepared from (issue 22): a request over all of both
        # sides' descriptors goes to the engine compressed (initialize_xfer_strided).
        self.strided = strided


def _engine_call(f, *args, **kw):
    try:
        return f(*args, **kw)
    except _mr.MultirailError as e:
        raise _nixl_error(e) from e


class nixlAgent:
    """NIXL's C++ agent as its Python bindings expose it, on one multirail engine.

    Handles (backends, prepared lists, transfer requests) are ints, as in NIXL.
    """

    def __init__(self, name: str, config: nixlAgentConfig) -> None:
        if not isinstance(name, str):
            raise TypeError("agent name must be a str")
        if not name:
            raise ValueError("Agent needs a non-empty name")
        import multirail  # lazy: importing this module must not need the extension
        from multirail.agent import DescList

        self._mr, self._DescList = multirail, DescList
        extra = dict(getattr(config, "multirail", {}) or {})
        host = extra.pop("listen_host", None) or os.environ.get("MULTIRAIL_NIXL_HOST") or "127.0.0.1"
        port = int(config.listenPort) if config.useListenThread else 0
        kw = {k: v for k, v in extra.items() if v is not None}
        # NIXL's listen thread is where peers' sendLocalMD lands: it opts in to MetaPut.
        kw.setdefault("accept_metaput", bool(config.useListenThread))
        self._ns = "/nixl/agents"
        self._store: Any = None
        self._store_error = ""
        endpoints = os.environ.get("NIXL_ETCD_ENDPOINTS", "").strip()
        if endpoints:
            ns = os.environ.get("NIXL_ETCD_NAMESPACE", "/nixl/agents/").rstrip("/") or "/nixl/agents"
            self._ns = ns
            if STORE_FACTORY is None:
                if "metadata" in getattr(multirail.AgentConfig, "__dataclass_fields__", {}):
                    kw["metadata"] = _etcd_url(endpoints, ns)
                else:
                    self._store_error = ("NIXL_ETCD_ENDPOINTS is set but this multirail build has no etcd "
                                         "metadata store (AgentConfig(metadata='etcd://HOST:PORT/PREFIX'))")
        self._secret = kw.get("auth_secret") if kw.get("auth_secret") is not None else os.environ.get("MULTIRAIL_SECRET")
        if isinstance(self._secret, str):
            self._secret = self._secret.encode()
        try:
            self._cfg = multirail.AgentConfig(host=host, port=port, **kw)
            self._engine = multirail.Agent(name, self._cfg)
        except _mr.MultirailError as e:
            raise _nixl_error(e) from e
        self._engine_store = False
        if endpoints:
            if STORE_FACTORY is not None:
                self._store = STORE_FACTORY(endpoints, self._ns)
            elif not self._store_error:
                ms = getattr(self._engine, "metadata_store", None)
                if ms is None:
                    self._store_error = "the multirail engine has no metadata store (Agent.metadata_store)"
                else:
                    self._store = _EngineKV(ms.store)
                    self._ns = self._store.prefix
                    self._engine_store = True
        self.name = name
        self._config = config
        self._telemetry = _telemetry_enabled(bool(getattr(config, "captureTelemetry", False)))
        self._lock = threading.RLock()
        self._next = itertools.count(0x1000, 0x10)  # handle values (atomic under the GIL)
        self._backends: dict[int, str] = {}
        self._regs: dict[tuple, list[int]] = {}  # (mem, addr, len, dev) -> engine region ids
        self._twin_regs: dict[tuple, list[int]] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._dlists: dict[int, _Prepped] = {}
        self._known: dict[str, _Meta] = {}  # peers whose metadata passed through this layer
        self._sent: dict[Any, dict[int, tuple]] = {}  # partial metadata sent, per destination
        self._twin: Any = None
        self._twin_name = ""
        self._twin_dirty = False
        self._self_notifs: list[bytes] = []
        self._fetchers: list[threading.Thread] = []
        self._timeout = float(self._cfg.timeout)
        self._scratch: Any = None  # (mmap, engine registration, address) for _covers
        self._scratch_len = 0
        self._ever_registered = False
        self._from_store: set[str] = set()  # peers loaded from the metadata store
        self._inval_watch: Any = None

    def _handle(self) -> int:
        return next(self._next)

    # ---------------------------------------------------------------- plugins and backends
    def getAvailPlugins(self) -> list[str]:
        return list(_PLUGINS)

    def getPluginParams(self, type: str) -> tuple[dict[str, str], list[str]]:
        if type not in _PLUGINS:
            raise _err(nixlNotFoundError, f"plugin {type!r} is not available (multirail offers {list(_PLUGINS)})")
        return {}, list(_PLUGIN_MEMS)

    def getBackendParams(self, backend: int) -> tuple[dict[str, str], list[str]]:
        if backend not in self._backends:
            raise _err(nixlInvalidParamError, "unknown backend handle")
        return {}, list(_PLUGIN_MEMS)

    def createBackend(self, type: str, initParams: Any = None) -> int:
        if type not in _PLUGINS:
            raise _err(nixlNotFoundError, f"backend plugin {type!r} is not available in multirail "
                       f"(network plugins {list(_PLUGINS)} map onto the multirail engine; storage plugins "
                       "are not supported)")
        if type in self._backends.values():
            raise _err(nixlInvalidParamError, f"backend already created for type {type!r}")
        h = self._handle()
        self._backends[h] = type
        return h

    def queryMem(self, descs: nixlRegDList, backend: int) -> list:
        raise _err(nixlNotSupportedError, "queryMem needs a storage backend; multirail has none")

    # ---------------------------------------------------------------------------- memory
    def registerMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> nixl_status_t:
        if not isinstance(descs, nixlRegDList):
            raise TypeError("registerMem(): descs must be a nixlRegDList")
        self._check_mem(descs.getType(), "register")
        if not self._backends:
            raise _err(nixlNotFoundError, "no backend was created to register memory with (create_backend('UCX'))")
        rows = descs.rows
        if not len(rows):
            return nixl_status_t.NIXL_SUCCESS
        reg = _engine_call(self._engine.register_memory, np.ascontiguousarray(rows), mem_type=_MEM_STR[descs.getType()])
        with self._lock:
            keys = [(int(descs.getType()), int(a), int(n), int(d)) for a, n, d in rows]
            for k, rid in zip(keys, reg.region_ids):
                self._regs.setdefault(k, []).append(rid)
            self._ever_registered = True
            if self._twin is not None:
                self._twin_register(keys)
        return nixl_status_t.NIXL_SUCCESS

    def _check_mem(self, mem: nixl_mem_t, what: str) -> None:
        # GPU memory goes through the engine like host memory: staged over the rails, by CUDA IPC
        # on one host, or directly with GPUDirect RDMA (docs/gpu.md). CUDA (or the stand-in,
        # $MULTIRAIL_GPU=standin) says at registration whether it really is GPU memory.
        if mem in (nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG):
            return
        raise _err(nixlNotFoundError, f"no backend supports {mem.name} memory (storage backends are not "
                   "supported by multirail)")

    def deregisterMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> nixl_status_t:
        if not isinstance(descs, nixlRegDList):
            raise TypeError("deregisterMem(): descs must be a nixlRegDList")
        with self._lock:
            keys = [(int(descs.getType()), int(a), int(n), int(d)) for a, n, d in descs.rows]
            need: dict[tuple, int] = {}
            for k in keys:
                need[k] = need.get(k, 0) + 1
                if len(self._regs.get(k, ())) < need[k]:
                    raise _err(nixlNotFoundError, f"descriptor {k[1:]} is not registered")
            for k in keys:
                rid = self._regs[k].pop()
                if not self._regs[k]:
                    del self._regs[k]
                _engine_call(self._engine.deregister_memory, _Regs([rid]))
                tw = self._twin_regs.get(k)
                if tw:
                    self._twin._core.deregister(tw.pop())
                    if not tw:
                        del self._twin_regs[k]
                    self._twin_dirty = True
        return nixl_status_t.NIXL_SUCCESS

    # -------------------------------------------------------------------------- metadata
    def getLocalMD(self) -> bytes:
        return self._engine.get_agent_metadata()

    def getLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool = False, backends: Sequence[int] = ()) -> bytes:
        return _PARTIAL_MAGIC + bytes([1 if inc_conn_info else 0]) + self._partial(descs).encode()

    def _partial(self, descs: nixlRegDList) -> _Meta:
        """This agent's metadata with only the regions registered for `descs`."""
        full = _Meta.decode(self._engine.get_agent_metadata())
        keep: dict[int, tuple] = {}
        with self._lock:
            for a, n, d in descs.rows:
                ids = self._regs.get((int(descs.getType()), int(a), int(n), int(d)))
                if not ids:
                    raise _err(nixlNotFoundError, f"descriptor {(int(a), int(n), int(d))} is not registered")
                for rid in ids:
                    if rid in full.regions:
                        keep[rid] = full.regions[rid]
        return _Meta(full.name, full.incarnation, full.rails, keep)

    def loadRemoteMD(self, remote_metadata: Any) -> bytes:
        blob = remote_metadata.encode("latin-1") if isinstance(remote_metadata, str) else bytes(remote_metadata)
        return self._load(blob).encode()

    def _load(self, blob: bytes, ip: str = "") -> str:
        partial = blob[:4] == _PARTIAL_MAGIC
        try:
            meta = _Meta.decode(blob[5:] if partial else blob)
        except _mr.MultirailError as e:
            raise _nixl_error(e, nixlMismatchError) from e
        if meta.name == self.name:
            raise _err(nixlInvalidParamError, "metadata is this agent's own")
        if ip:
            meta = meta.with_host(ip)
        with self._lock:
            old = self._known.get(meta.name)
            if partial and old is not None and old.incarnation == meta.incarnation:
                merged = dict(old.regions)
                merged.update(meta.regions)
                meta = _Meta(meta.name, meta.incarnation, meta.rails or old.rails, merged)
            name = _engine_call(self._engine.add_remote_agent, meta.encode())
            self._known[name] = meta
        return name

    def invalidateRemoteMD(self, remote_agent: str) -> nixl_status_t:
        with self._lock:
            self._known.pop(remote_agent, None)
        try:
            self._engine.remove_remote_agent(remote_agent)
        except _mr.UnknownPeerError:
            return nixl_status_t.NIXL_ERR_NOT_FOUND
        except _mr.MultirailError:
            return nixl_status_t.NIXL_ERR_BACKEND
        return nixl_status_t.NIXL_SUCCESS

    def checkRemoteMD(self, remote_name: str, descs: Optional[nixlXferDList] = None) -> nixl_status_t:
        if remote_name == self.name:  # as NIXL: loopback metadata exists once memory was registered
            if not self._ever_registered:
                return nixl_status_t.NIXL_ERR_NOT_FOUND
            if descs is not None and descs.descCount() and len(descs.rows):
                try:
                    self._engine._core.check_local(descs.rows.ctypes.data, len(descs.rows))
                except _mr.MultirailError:
                    return nixl_status_t.NIXL_ERR_NOT_FOUND
            return nixl_status_t.NIXL_SUCCESS
        if not self._engine.check_remote_metadata(remote_name):
            return nixl_status_t.NIXL_ERR_NOT_FOUND
        if descs is not None and descs.descCount():
            if descs.getType() != nixl_mem_t.DRAM_SEG or not self._covers(remote_name, descs.rows):
                return nixl_status_t.NIXL_ERR_NOT_FOUND
        return nixl_status_t.NIXL_SUCCESS

    def _covers(self, peer: str, rows: np.ndarray) -> bool:
        """Whether the metadata loaded for `peer` covers every row. Known from the blob when it
        passed through this layer; otherwise (the peer pushed it to the engine) by preparing a
        READ into a private scratch region and releasing it unposted (no data moves)."""
        known = self._known.get(peer)
        if known is not None:
            return known.covers(rows)
        need = int(rows[:, 1].max()) if len(rows) else 0
        with self._lock:
            if need > self._scratch_len:
                import mmap

                size = max(need, 1 << 20)
                m = mmap.mmap(-1, size)  # virtual memory only: no page is touched
                addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
                if self._scratch is not None:
                    self._engine.deregister_memory(self._scratch[1])
                self._scratch = (m, self._engine.register_memory([(addr, size, 0)], "DRAM", access="local"), addr)
                self._scratch_len = size
            local = np.empty_like(rows)
            local[:, 0] = self._scratch[2]
            local[:, 1] = rows[:, 1]
            local[:, 2] = 0
        try:
            h = self._engine.initialize_xfer("READ", self._DescList(local, "DRAM"), self._DescList(rows, "DRAM"), peer)
        except (_mr.OutOfBoundsError, _mr.UnknownPeerError):
            return False
        self._engine.release_xfer_handle(h)
        return True

    def _no_transport(self) -> Exception:
        return _err(nixlInvalidParamError, "no peer address provided and no centralized store configured "
                    "(set NIXL_ETCD_ENDPOINTS)")

    def _kv(self) -> Any:
        if self._store is None:
            if self._store_error:
                raise _err(nixlNotSupportedError, self._store_error)
            raise self._no_transport()
        return self._store

    def _key(self, agent: str, label: str) -> str:
        return f"{self._ns}/{agent}/{label}"

    def sendLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        if ip_addr:
            _engine_call(self._engine.send_local_metadata, ip_addr, int(port) or DEFAULT_COMM_PORT)
            return
        if self._engine_store:  # the engine's own record, which native multirail agents read too
            _engine_call(self._engine.send_local_metadata)
            return
        _engine_call(self._kv().put, self._key(self.name, "metadata"), self._engine.get_agent_metadata())

    def sendLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool = False, backends: Sequence[int] = (),
                           ip_addr: str = "", port: int = 0, label: str = "") -> None:
        part = self._partial(descs)
        if ip_addr:
            # The engine on the other side installs what it is sent as the whole of this agent's
            # metadata, so send everything sent there so far plus these regions (a merge there).
            dest = (ip_addr, int(port) or DEFAULT_COMM_PORT)
            with self._lock:
                sent = self._sent.setdefault(dest, {})
                sent.update(part.regions)
                body = _Meta(part.name, part.incarnation, part.rails, dict(sent)).encode()
            kind, resp = _engine_call(_control, dest[0], dest[1], self.name, self._secret, _K_METAPUT, body, self._timeout)
            if kind != _K_RESP or struct.unpack_from("<H", resp)[0] != 0:
                raise _nixl_error(_status_error(dest[0], dest[1], resp))
            return
        if not label:
            raise _err(nixlInvalidParamError, "metadata label is required for etcd send of local partial metadata")
        blob = _PARTIAL_MAGIC + bytes([1 if inc_conn_info else 0]) + part.encode()
        _engine_call(self._kv().put, self._key(self.name, label), blob)

    def fetchRemoteMD(self, remote_agent: str, ip_addr: str = "", port: int = 0, label: str = "") -> None:
        if ip_addr:
            port = int(port) or DEFAULT_COMM_PORT
            kind, blob = _engine_call(_control, ip_addr, port, self.name, self._secret, _K_METAGET, b"", self._timeout)
            if kind != _K_META:
                raise _nixl_error(_status_error(ip_addr, port, blob))
            try:
                got = _Meta.decode(blob).name
            except _mr.MultirailError as e:
                raise _nixl_error(e, nixlMismatchError) from e
            if remote_agent and got != remote_agent:
                raise _err(nixlMismatchError, f"agent at {ip_addr}:{port} is {got!r}, not {remote_agent!r}")
            self._load(blob, ip_addr)
            return
        store = self._kv()
        label = label or "metadata"
        key = self._key(remote_agent, label)
        if self._engine_store:
            self._watch_invalidations()
        # As NIXL: the fetch returns at once; the metadata is loaded when it appears (poll
        # check_remote_metadata), or an error is logged after the watch timeout.
        target = self._fetch_record if self._engine_store and label == "metadata" else self._fetch_from_store
        t = threading.Thread(target=target, args=(store, key, remote_agent), daemon=True,
                             name=f"nixl-fetch-{remote_agent}")
        self._fetchers.append(t)
        t.start()

    def _fetch_record(self, store: Any, key: str, remote_agent: str) -> None:
        """The peer's full metadata: its engine record (waiting for it up to the watch timeout)."""
        try:
            with self._lock:
                self._known.pop(remote_agent, None)
            self._engine.wait_for_peer(remote_agent, self._config.etcdWatchTimeout.total_seconds())
            self._from_store.add(remote_agent)
        except Exception as e:  # noqa: BLE001 - logged as NIXL does
            _log.error("Failed to fetch metadata from etcd for agent %s: %s", remote_agent, e)

    def _watch_invalidations(self) -> None:
        """As NIXL's etcd watcher: a peer loaded from etcd whose record is deleted
        (invalidate_local_metadata, close, or its lease expired) is removed here too."""
        with self._lock:
            if self._inval_watch is not None:
                return
            ms = self._store.ms

            def on_delete(name: str, _mod: int) -> None:
                if name in self._from_store:
                    self._from_store.discard(name)
                    self.invalidateRemoteMD(name)

            try:
                self._inval_watch = ms.watch(lambda rec: None, on_delete)
            except _mr.MultirailError as e:
                _log.warning("cannot watch %s for invalidated agents: %s", ms, e)

    def _fetch_from_store(self, store: Any, key: str, remote_agent: str) -> None:
        deadline = time.monotonic() + self._config.etcdWatchTimeout.total_seconds()
        while True:
            try:
                blob = store.get(key)
            except Exception as e:  # noqa: BLE001 - logged as NIXL does
                _log.error("Failed to fetch metadata from etcd for agent %s: %s", remote_agent, e)
                return
            if blob:
                try:
                    name = self._load(bytes(blob))
                except Exception as e:  # noqa: BLE001
                    _log.error("Failed to load remote metadata for agent %s: %s", remote_agent, e)
                    return
                if name != remote_agent:
                    _log.error("Metadata mismatch for agent %s from md: %s", remote_agent, name)
                else:
                    self._from_store.add(name)
                return
            if time.monotonic() > deadline:
                _log.error("Watch timed out for key: %s", key)
                return
            time.sleep(0.01)

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        if ip_addr:
            # No "forget me" message exists in the engine's protocol: send metadata without any
            # region, so the peer can no longer address this agent's memory.
            full = _Meta.decode(self._engine.get_agent_metadata())
            body = _Meta(full.name, full.incarnation, full.rails, {}).encode()
            try:
                _control(ip_addr, int(port) or DEFAULT_COMM_PORT, self.name, self._secret, _K_METAPUT, body, self._timeout)
            except _mr.MultirailError as e:
                _log.info("invalidate_local_metadata(%s, %s): %s", ip_addr, port, e)
            self._sent.pop((ip_addr, int(port) or DEFAULT_COMM_PORT), None)
            return
        _engine_call(self._kv().delete_prefix, f"{self._ns}/{self.name}/")
        if self._engine_store:
            _engine_call(self._engine.invalidate_local_metadata)

    def makeConnection(self, remote_agent: str, backends: Sequence[int] = ()) -> nixl_status_t:
        if remote_agent == self.name:
            self._loopback_peer()
            return nixl_status_t.NIXL_SUCCESS
        if not self._engine.check_remote_metadata(remote_agent):
            raise _err(nixlNotFoundError, f"no metadata loaded for agent {remote_agent!r}")
        _engine_call(self._engine.make_connection, remote_agent)
        return nixl_status_t.NIXL_SUCCESS

    # -------------------------------------------------------------------------- loopback
    def _loopback_peer(self) -> str:
        """A hidden second engine in this process that mirrors every registration: transfers
        to this agent's own name go to it (the engine refuses its own metadata)."""
        with self._lock:
            if self._twin is None:
                self._twin_name = f"{self.name}.loopback-{os.urandom(4).hex()}"
                self._twin = self._mr.Agent(self._twin_name, self._mr.AgentConfig(
                    host=self._cfg.host, port=0, auth_secret=self._cfg.auth_secret, timeout=self._cfg.timeout))
                self._twin_register(list(k for k, ids in self._regs.items() for _ in ids))
            if self._twin_dirty or not self._engine.check_remote_metadata(self._twin_name):
                self._engine.add_remote_agent(self._twin.get_agent_metadata())
                self._twin_dirty = False
            return self._twin_name

    def _twin_register(self, keys: list[tuple]) -> None:
        for k in keys:
            self._twin_regs.setdefault(k, []).append(self._twin._core.register(k[1], k[2], k[3], _MEM_STR[nixl_mem_t(k[0])], "rw"))
        self._twin_dirty = bool(keys) or self._twin_dirty

    def _peer(self, agent_name: str) -> tuple[str, bool]:
        if agent_name == self.name:
            return self._loopback_peer(), True
        return agent_name, False

    # -------------------------------------------------------------------------- transfers
    def prepXferDlist(self, *args: Any, **kw: Any) -> int:
        """prepXferDlist(agent_name, descs, backend=[]) | prepXferDlist(descs, backend=[]) |
        prepXferDlist(agent_name, mem_type, Nx5 array, backend=[]) (strided descriptors)."""
        args = list(args)
        if args and isinstance(args[0], _DList):
            args.insert(0, NIXL_INIT_AGENT)
        agent_name = kw.pop("agent_name", args.pop(0) if args else NIXL_INIT_AGENT)
        strided = None
        if args and isinstance(args[0], (nixl_mem_t, str)) and len(args) > 1 and isinstance(args[1], np.ndarray):
            descs = nixlXferDList(_mem_arg(args[0]), _strided_rows(args[1]))
            strided = np.ascontiguousarray(args[1], dtype=_U64)
            args = args[2:]
        else:
            descs = kw.pop("descs", args.pop(0) if args else None)
        if not isinstance(descs, nixlXferDList):
            raise TypeError("prepXferDlist(): descs must be a nixlXferDList")
        self._check_mem(descs.getType(), "prepare")
        rows = descs.rows
        if agent_name == NIXL_INIT_AGENT:
            if len(rows):
                _engine_call(self._engine._core.check_local, rows.ctypes.data, len(rows))
            peer, loop = "", False
        else:
            peer, loop = self._peer(agent_name)
            if not loop:
                if not self._engine.check_remote_metadata(peer):
                    raise _err(nixlNotFoundError, f"no metadata loaded for agent {peer!r}")
                if len(rows) and not self._covers(peer, rows):
                    raise _err(nixlNotFoundError, f"descriptors are not in the metadata of agent {peer!r}")
        h = self._handle()
        self._dlists[h] = _Prepped(peer, rows, descs.getType(), loop, strided)
        return h

    def releasedDlistH(self, handle: int) -> nixl_status_t:
        if self._dlists.pop(int(handle), None) is None:
            raise _err(nixlInvalidParamError, "unknown prepared descriptor list handle")
        return nixl_status_t.NIXL_SUCCESS

    def makeXferReq(self, operation: Any, local_side: int, local_indices: Any, remote_side: int, remote_indices: Any,
                    notif_msg: Any = "", backend: Sequence[int] = (), skip_desc_merg: bool = False) -> int:
        op = _op(operation)
        local, remote = self._dlists.get(int(local_side)), self._dlists.get(int(remote_side))
        if local is None or remote is None:
            raise _err(nixlInvalidParamError, "unknown prepared descriptor list handle")
        li, ri = _indices(local_indices, len(local.rows)), _indices(remote_indices, len(remote.rows))
        if len(li) != len(ri):
            raise _err(nixlInvalidParamError, f"{len(li)} local and {len(ri)} remote indices")
        peer = self._loopback_peer() if remote.loopback else remote.peer
        whole = lambda idx, n: len(idx) == n and (n == 0 or (idx[0] == 0 and bool(np.all(np.diff(idx) == 1))))  # noqa: E731
        if (local.strided is not None and remote.strided is not None and local.mem == nixl_mem_t.DRAM_SEG
                and remote.mem == nixl_mem_t.DRAM_SEG and whole(li, len(local.rows)) and whole(ri, len(remote.rows))):
            h = _engine_call(self._engine.initialize_xfer_strided, op, local.strided, remote.strided, peer, _bytes(notif_msg))
            handle = self._handle()
            self._xfers[handle] = _Xfer(h, int(h.total_bytes), len(local.rows), op == "WRITE")
            return handle
        return self._create(op, local.rows[li], remote.rows[ri], peer, notif_msg)

    def createXferReq(self, operation: Any, local_descs: nixlXferDList, remote_descs: nixlXferDList, remote_agent: str,
                      notif_msg: Any = "", backend: Sequence[int] = ()) -> int:
        op = _op(operation)
        if not isinstance(local_descs, nixlXferDList) or not isinstance(remote_descs, nixlXferDList):
            raise TypeError("createXferReq(): local_descs and remote_descs must be nixlXferDList")
        if local_descs._n != remote_descs._n:
            raise _err(nixlInvalidParamError, f"{local_descs._n} local and {remote_descs._n} remote descriptors")
        for d in (local_descs, remote_descs):
            if d._type not in (nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG):
                raise _err(nixlNotFoundError, f"no registered {d._type.name} memory: multirail moves DRAM and VRAM")
        peer, _ = self._peer(remote_agent)
        return self._create(op, local_descs.rows, remote_descs.rows, peer, notif_msg)

    def _create(self, op: str, lrows: np.ndarray, rrows: np.ndarray, peer: str, notif_msg: Any) -> int:
        D = self._DescList
        h = _engine_call(self._engine.initialize_xfer, op, D(lrows, "DRAM"), D(rrows, "DRAM"), peer, _bytes(notif_msg))
        handle = self._handle()
        self._xfers[handle] = _Xfer(h, int(h.total_bytes), len(lrows), op == "WRITE")
        return handle

    def _xfer(self, reqh: int) -> _Xfer:
        x = self._xfers.get(int(reqh))
        if x is None:
            raise _err(nixlInvalidParamError, "unknown transfer request handle")
        return x

    def estimateXferCost(self, req_handle: int) -> tuple[int, int, int]:
        self._xfer(req_handle)
        return 0, 0, -1  # no cost model: NIXL's "UNKNOWN" method

    def postXferReq(self, reqh: int, notif_msg: Any = "") -> nixl_status_t:
        x = self._xfer(reqh)
        msg = _bytes(notif_msg)
        if self._telemetry:
            x.wall, x.t_start, x.t_done = time.time(), time.perf_counter(), 0.0
        try:
            st = self._engine.transfer(x.h, msg or None)
        except _mr.InvalidArgumentError as e:
            if "progress" in str(e) or "active" in str(e) or "posted" in str(e):
                raise _nixl_error(e, nixlRepostActiveError) from e
            raise _nixl_error(e) from e
        except _mr.MultirailError as e:
            raise _nixl_error(e) from e
        x.posted = True
        if st == 3:
            err = self._engine.xfer_error(x.h)
            raise _nixl_error(err) if err is not None else _err(nixlBackendError, "transfer failed")
        done = st == 2
        if self._telemetry:
            x.t_posted = time.perf_counter()
            if done:
                x.t_done = x.t_posted
        x.state = 0 if done else 1
        return nixl_status_t.NIXL_SUCCESS if done else nixl_status_t.NIXL_IN_PROG

    def getXferStatus(self, reqh: int) -> nixl_status_t:
        x = self._xfer(reqh)
        try:
            st = self._engine.check_xfer_state(x.h)
        except _mr.InvalidArgumentError as e:
            if "never posted" in str(e):
                raise _nixl_error(e, nixlNotPostedError) from e
            raise _nixl_error(e) from e
        if st == 2:
            if self._telemetry and not x.t_done:
                x.t_done = time.perf_counter()
            return nixl_status_t.NIXL_SUCCESS
        if st == 1:
            return nixl_status_t.NIXL_IN_PROG
        err = self._engine.xfer_error(x.h)
        if err is None:
            raise _err(nixlBackendError, "transfer failed")
        raise _nixl_error(err) from err

    def getXferTelemetry(self, reqh: int) -> nixlXferTelemetry:
        x = self._xfer(reqh)
        if not self._telemetry:
            raise _err(nixlNoTelemetryError, "telemetry is disabled (nixl_agent_config(capture_telemetry=True) "
                       "or NIXL_TELEMETRY_ENABLE=y)")
        if not x.t_start:
            raise _err(nixlNotPostedError, "the transfer was never posted")
        post = math.ceil((x.t_posted - x.t_start) * 1e6) if x.t_posted else 0
        xfer = math.ceil((x.t_done - x.t_start) * 1e6) if x.t_done else 0
        return nixlXferTelemetry(int(x.wall * 1e6), max(post, 1), max(xfer, post, 1) if x.t_done else 0, x.total, x.count)

    def queryXferBackend(self, reqh: int) -> int:
        self._xfer(reqh)
        return next(iter(self._backends), 0)

    def releaseXferReq(self, reqh: int) -> nixl_status_t:
        x = self._xfers.pop(int(reqh), None)
        if x is None:
            raise _err(nixlInvalidParamError, "unknown transfer request handle")
        self._engine.release_xfer_handle(x.h)
        x.h = None  # the engine frees the request's region pins when its handle is collected
        return nixl_status_t.NIXL_SUCCESS

    # ------------------------------------------------------------------------ notifications
    def getNotifs(self, notif_map: Any, backends: Sequence[int] = ()) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = notif_map if isinstance(notif_map, dict) else dict(notif_map)
        for peer, msgs in self._engine.get_new_notifs().items():
            out.setdefault(peer, []).extend(msgs)
        if self._twin is not None:
            for msgs in self._twin.get_new_notifs().values():
                out.setdefault(self.name, []).extend(msgs)
        if self._self_notifs:
            with self._lock:
                mine, self._self_notifs = self._self_notifs, []
            out.setdefault(self.name, []).extend(mine)
        return out

    def genNotif(self, remote_agent: str, msg: Any, backends: Sequence[int] = ()) -> nixl_status_t:
        m = _bytes(msg)
        if remote_agent == self.name:
            with self._lock:
                self._self_notifs.append(m)
            return nixl_status_t.NIXL_SUCCESS
        if not self._engine.check_remote_metadata(remote_agent):
            raise _err(nixlNotFoundError, f"no metadata loaded for agent {remote_agent!r}")
        _engine_call(self._engine.send_notif, remote_agent, m)
        return nixl_status_t.NIXL_SUCCESS

    # ------------------------------------------------------------------------- GPU views
    def prepMemView(self, dlist: Any, backends: Sequence[int] = ()) -> int:
        raise _err(nixlNotSupportedError, "prep_mem_view needs the UCX GPU device API; multirail has none "
                   "(HAVE_UCX_GPU_DEVICE_API is False)")

    def releaseMemView(self, mvh: int) -> None:
        raise _err(nixlNotSupportedError, "release_mem_view: multirail has no memory views")

    # ---------------------------------------------------------------------- multirail extras
    @property
    def engine(self) -> Any:
        """The `multirail.Agent` underneath."""
        return self._engine

    def close(self) -> None:
        """Stop the engine (and the loopback twin) now instead of at garbage collection."""
        if self._inval_watch is not None:
            self._inval_watch.stop()
        if self._twin is not None:
            self._twin.close()
        self._engine.close()


def _bytes(msg: Any) -> bytes:
    if msg is None:
        return b""
    if isinstance(msg, str):
        return msg.encode()
    return bytes(msg)


def _op(operation: Any) -> str:
    try:
        return "WRITE" if nixl_xfer_op_t(int(operation)) == nixl_xfer_op_t.NIXL_WRITE else "READ"
    except (TypeError, ValueError):
        raise TypeError(f"operation must be a nixl_xfer_op_t, not {operation!r}") from None


def _indices(idx: Any, n: int) -> np.ndarray:
    if isinstance(idx, np.ndarray):
        if idx.ndim != 1:
            raise ValueError("indices numpy array must be 1D")
        if idx.dtype.kind not in "ui":
            raise ValueError("indices numpy array must be 1D of uint32 or int32")
        a = idx.astype(np.int64, copy=False)
    else:
        a = np.fromiter((int(i) for i in idx), dtype=np.int64)
    if len(a) and (a.min() < 0 or a.max() >= n):
        raise _err(nixlInvalidParamError, f"index out of range for {n} prepared descriptors")
    return a


def _strided_rows(a: np.ndarray) -> np.ndarray:
    """Nx5 (address, len, device, stride, count) -> the Nx3 rows it stands for."""
    if a.ndim != 2 or a.shape[1] != 5 or a.dtype.kind not in "ui":
        raise ValueError("strided descriptors must be an Nx5 integer array")
    a = a.astype(_U64)
    counts = a[:, 4].astype(np.int64)
    rep = np.repeat(np.arange(len(a)), counts)
    k = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.empty((len(rep), 3), dtype=_U64)
    out[:, 0] = a[rep, 0] + k.astype(_U64) * a[rep, 3]
    out[:, 1] = a[rep, 1]
    out[:, 2] = a[rep, 2]
    return out


__all__ = [n for n in dir() if n.startswith(("nixl", "NIXL_")) or n.endswith("_SEG")] + [
    "DEFAULT_COMM_PORT", "HAVE_UCX_GPU_DEVICE_API"]

# Classes moved to _enums/_dlist keep this module's name (what NIXL's `_bindings` shows in
# reprs, and where pickles of descriptor lists find them).
for _c in list(globals().values()):
    if isinstance(_c, type) and _c.__module__ in (f"{__package__}._enums", f"{__package__}._dlist") and _c.__name__.startswith("nixl"):
        _c.__module__ = __name__
