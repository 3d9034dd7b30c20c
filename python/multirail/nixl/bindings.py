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
import enum
import hashlib
import hmac
import itertools
import logging
import math
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

from multirail import errors as _mr

_log = logging.getLogger("multirail.nixl.bindings")

# ------------------------------------------------------------------------ enums and constants


class _Enum(enum.IntEnum):
    """pybind11-style enum: compares equal to its int, `str` is "type.NAME"."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {int(self)}>"


class nixl_mem_t(_Enum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(_Enum):
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_status_t(_Enum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


class nixl_thread_sync_t(_Enum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0  # alias of NONE, as in NIXL


class nixl_cost_t(_Enum):
    NIXL_COST_ANALYTICAL_BACKEND = 0


for _e in (nixl_mem_t, nixl_xfer_op_t, nixl_status_t, nixl_cost_t):  # pybind11 export_values()
    globals().update(_e.__members__)
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT

NIXL_INIT_AGENT = ""
DEFAULT_COMM_PORT = 8888
# multirail has no GPU device-side API (prep_mem_view: GPU kernels posting transfers); VRAM
# itself registers and moves like DRAM (docs/gpu.md).
HAVE_UCX_GPU_DEVICE_API = False

# Plugins: names NIXL scripts ask for that mean "the multirail engine".
_PLUGINS = ("UCX", "MULTIRAIL")
_PLUGIN_MEMS = ["DRAM_SEG", "VRAM_SEG"]

# --------------------------------------------------------------------------------- exceptions


class nixlNotPostedError(Exception):
    """NIXL_ERR_NOT_POSTED"""


class nixlInvalidParamError(Exception):
    """NIXL_ERR_INVALID_PARAM"""


class nixlBackendError(Exception):
    """NIXL_ERR_BACKEND"""


class nixlNotFoundError(Exception):
    """NIXL_ERR_NOT_FOUND"""


class nixlMismatchError(Exception):
    """NIXL_ERR_MISMATCH"""


class nixlNotAllowedError(Exception):
    """NIXL_ERR_NOT_ALLOWED"""


class nixlRepostActiveError(Exception):
    """NIXL_ERR_REPOST_ACTIVE"""


class nixlUnknownError(Exception):
    """NIXL_ERR_UNKNOWN"""


class nixlNotSupportedError(Exception):
    """NIXL_ERR_NOT_SUPPORTED"""


class nixlRemoteDisconnectError(Exception):
    """NIXL_ERR_REMOTE_DISCONNECT"""


class nixlCancelledError(Exception):
    """NIXL_ERR_CANCELED"""


class nixlNoTelemetryError(Exception):
    """NIXL_ERR_NO_TELEMETRY"""


_STATUS_NAME = {
    nixlNotPostedError: "NIXL_ERR_NOT_POSTED", nixlInvalidParamError: "NIXL_ERR_INVALID_PARAM",
    nixlBackendError: "NIXL_ERR_BACKEND", nixlNotFoundError: "NIXL_ERR_NOT_FOUND",
    nixlMismatchError: "NIXL_ERR_MISMATCH", nixlNotAllowedError: "NIXL_ERR_NOT_ALLOWED",
    nixlRepostActiveError: "NIXL_ERR_REPOST_ACTIVE", nixlUnknownError: "NIXL_ERR_UNKNOWN",
    nixlNotSupportedError: "NIXL_ERR_NOT_SUPPORTED", nixlRemoteDisconnectError: "NIXL_ERR_REMOTE_DISCONNECT",
    nixlCancelledError: "NIXL_ERR_CANCELED", nixlNoTelemetryError: "NIXL_ERR_NO_TELEMETRY",
}

# multirail error class -> NIXL exception class (most specific first; see docs/nixl.md).
_ERROR_MAP: tuple[tuple[type, type], ...] = (
    (_mr.UnknownPeerError, nixlNotFoundError),
    (_mr.NotRegisteredError, nixlNotFoundError),
    (_mr.OutOfBoundsError, nixlNotFoundError),
    (_mr.LengthMismatchError, nixlInvalidParamError),
    (_mr.InvalidArgumentError, nixlInvalidParamError),
    (_mr.AccessDeniedError, nixlNotAllowedError),
    (_mr.AuthenticationError, nixlNotAllowedError),
    (_mr.VersionMismatchError, nixlMismatchError),
    (_mr.MetadataError, nixlMismatchError),
    (_mr.PeerLostError, nixlRemoteDisconnectError),
    (_mr.ProtocolError, nixlBackendError),
    (_mr.TransferTimeoutError, nixlBackendError),
    (_mr.AddressInUseError, nixlBackendError),
    (_mr.TransferError, nixlBackendError),
    (_mr.GpuError, nixlBackendError),  # as NIXL's backend failing to register GPU memory
) + (((_mr.MetadataStoreError, nixlBackendError),) if hasattr(_mr, "MetadataStoreError") else ())
_COMBINED: dict[tuple[type, type], type] = {}


def _err(cls: type, msg: str = "") -> Exception:
    """A NIXL exception with NIXL's status text (and our explanation after it)."""
    name = _STATUS_NAME[cls]
    return cls(f"{name}: {msg}" if msg else name)


def _nixl_error(e: BaseException, cls: Optional[type] = None) -> Exception:
    """The NIXL exception for a multirail error: an instance of both (so either `except` works)."""
    if cls is None:
        cls = next((n for m, n in _ERROR_MAP if isinstance(e, m)), nixlUnknownError)
    key = (cls, type(e))
    both = _COMBINED.get(key)
    if both is None:
        try:
            both = type(cls.__name__, (cls, type(e)), {"__module__": __name__, "__str__": Exception.__str__})
        except TypeError:  # incompatible layouts: the NIXL class alone
            both = cls
        _COMBINED[key] = both
    out = both(f"{_STATUS_NAME[cls]}: {e}")
    out.__cause__ = e
    return out


# ----------------------------------------------------------------------- descriptor lists

_U64 = np.uint64


def _mem_arg(mem: Any) -> nixl_mem_t:
    if isinstance(mem, nixl_mem_t):
        return mem
    if isinstance(mem, str):  # multirail extension: "DRAM", "VRAM", "cpu", "cuda", "DRAM_SEG", ...
        got = _MEM_NAMES.get(mem)
        if got is None:
            raise TypeError(f"unknown memory type {mem!r}")
        return got
    if isinstance(mem, (int, np.integer)) and not isinstance(mem, bool):
        return nixl_mem_t(int(mem))
    raise TypeError(f"memory type must be a nixl_mem_t, not {type(mem).__name__}")


_MEM_NAMES = {"DRAM": DRAM_SEG, "VRAM": VRAM_SEG, "FILE": FILE_SEG, "BLOCK": BLK_SEG, "BLK": BLK_SEG,  # noqa: F821
              "OBJ": OBJ_SEG, "cpu": DRAM_SEG, "cuda": VRAM_SEG}  # noqa: F821
_MEM_NAMES.update({m.name: m for m in nixl_mem_t})
_MEM_STR = {nixl_mem_t.DRAM_SEG: "DRAM", nixl_mem_t.VRAM_SEG: "VRAM", nixl_mem_t.BLK_SEG: "BLOCK",
            nixl_mem_t.OBJ_SEG: "OBJ", nixl_mem_t.FILE_SEG: "FILE"}


def _u(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"descriptor {what} must be an int, not {type(v).__name__}")
    v = int(v)
    if v < 0 or v >= 1 << 64:
        raise ValueError(f"descriptor {what} {v} does not fit in 64 unsigned bits")
    return v


def _meta_bytes(m: Any) -> bytes:
    if isinstance(m, str):
        return m.encode()
    if isinstance(m, (bytes, bytearray, memoryview)):
        return bytes(m)
    raise TypeError(f"descriptor metadata must be str or bytes, not {type(m).__name__}")


def _rows_from_array(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """(rows, borrowed) from an Nx3 array: a C-contiguous uint64 one is used as is."""
    if a.ndim != 2 or a.shape[1] != 3:
        raise ValueError("descs must be a Nx3 numpy array")
    if a.dtype.kind not in "ui":
        raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
    if a.dtype not in (np.dtype(np.uint64), np.dtype(np.int64)):
        raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
    if not a.flags.c_contiguous:
        raise ValueError("descs must be a C-contiguous numpy array")
    if a.dtype == _U64:
        return a, True
    if a.size and (a < 0).any():
        raise ValueError("descriptor rows must be non-negative")
    return a.astype(_U64), False


class _DList:
    """Common part of the descriptor lists: rows in a growable uint64 buffer (view `rows`)."""

    _WIDTH = 3
    __hash__ = None  # type: ignore[assignment]  # mutable, like NIXL's lists

    def __init__(self, type: Any = nixl_mem_t.DRAM_SEG, descs: Any = 0, *, init_size: Optional[int] = None) -> None:
        self._type = _mem_arg(type)
        self._meta: Optional[list[bytes]] = None
        self._names: Optional[list[str]] = None
        self._keep: Any = None  # objects the rows point into (tensors/arrays), kept alive
        if init_size is not None:
            descs = init_size
        if isinstance(descs, (int, np.integer)) and not isinstance(descs, bool):
            self._buf, self._n, self._borrowed = np.zeros((int(descs), 3), dtype=_U64), int(descs), False
            if self._WIDTH == 4:
                self._fill_names(int(descs))
        elif isinstance(descs, np.ndarray):
            if self.__class__ is nixlRemoteDList:
                raise TypeError("nixlRemoteDList takes a list of (addr, len, dev_id, agent_name) tuples")
            self._buf, self._borrowed = _rows_from_array(descs)
            self._n = int(self._buf.shape[0])
        elif isinstance(descs, list):
            self._set_from_tuples(descs)
        else:
            raise TypeError(f"descs must be a list of tuples or an Nx3 numpy array, not {type_name(descs)}")

    # -- construction helpers
    def _fill_names(self, n: int) -> None:
        pass

    def _set_from_tuples(self, descs: list) -> None:
        w = self._WIDTH
        if all(type(d) is tuple and len(d) == w for d in descs):
            try:  # fast path: numpy converts the ints (range-checked) in C
                buf = np.array(descs if w == 3 else [d[:3] for d in descs], dtype=_U64).reshape(-1, 3)
                self._buf, self._n, self._borrowed = buf, len(descs), False
                if w == 4:
                    self._set_extra([d[3] for d in descs])
                return
            except (OverflowError, ValueError, TypeError):
                pass  # the loop below names the bad descriptor
        buf = np.empty((len(descs), 3), dtype=_U64)
        extra: list = []
        for i, d in enumerate(descs):
            if not isinstance(d, tuple):
                raise TypeError("Each descriptor must be a tuple when provided as a list")
            if len(d) != w:
                raise ValueError(f"Each descriptor tuple must have exactly {w} elements")
            buf[i] = (_u(d[0], "address"), _u(d[1], "length"), _u(d[2], "device id"))
            if w == 4:
                extra.append(d[3])
        self._buf, self._n, self._borrowed = buf, len(descs), False
        if w == 4:
            self._set_extra(extra)

    def _set_extra(self, extra: list) -> None:
        pass

    # -- storage
    @property
    def rows(self) -> np.ndarray:
        """The (N, 3) uint64 rows (address, length, device): C-contiguous, no copy."""
        return self._buf if self._n == self._buf.shape[0] else self._buf[: self._n]

    @property
    def mem_type(self) -> str:
        """multirail's name of the memory type ("DRAM", "VRAM", "FILE", ...)."""
        return _MEM_STR[self._type]

    def _own(self, extra: int = 0) -> None:
        """Make the buffer ours (copy a borrowed array) with room for `extra` more rows."""
        need = self._n + extra
        if self._borrowed or need > self._buf.shape[0]:
            cap = max(need, 8, 2 * self._buf.shape[0] if extra else need)
            buf = np.zeros((cap, 3), dtype=_U64)
            buf[: self._n] = self._buf[: self._n]
            self._buf, self._borrowed = buf, False

    def _index(self, i: Any) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"descriptor index must be an int, not {type_name(i)}")
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"descriptor index {i} out of range for {self._n} descriptors")
        return i

    # -- NIXL's methods
    def getType(self) -> nixl_mem_t:
        return self._type

    def descCount(self) -> int:
        return self._n

    def isEmpty(self) -> bool:
        return self._n == 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:  # NIXL's lists are always truthy (`if not descs` tests for None)
        return True

    def __iter__(self):
        return (self[i] for i in range(self._n))

    def _row(self, i: int) -> tuple:
        a, n, d = self._buf[i]
        return int(a), int(n), int(d)

    def __getitem__(self, i: Any) -> tuple:
        return self._row(self._index(i))

    def _parse(self, desc: Any) -> tuple:
        if not isinstance(desc, tuple) or len(desc) != self._WIDTH:
            raise ValueError(f"a descriptor is a tuple of {self._WIDTH} elements")
        return (_u(desc[0], "address"), _u(desc[1], "length"), _u(desc[2], "device id")) + tuple(desc[3:])

    def __setitem__(self, i: Any, desc: tuple) -> None:
        i = self._index(i)
        d = self._parse(desc)
        self._own()
        self._buf[i] = d[:3]
        self._set_one(i, d)

    def _set_one(self, i: int, d: tuple) -> None:
        pass

    def addDesc(self, desc: tuple) -> None:
        d = self._parse(desc)
        self._own(1)
        self._buf[self._n] = d[:3]
        self._n += 1
        self._add_one(d)

    append = addDesc

    def _add_one(self, d: tuple) -> None:
        pass

    def remDesc(self, index: int) -> None:
        i = self._index(index)
        self._own()
        self._buf[i : self._n - 1] = self._buf[i + 1 : self._n]
        self._n -= 1
        self._rem_one(i)

    def _rem_one(self, i: int) -> None:
        pass

    def clear(self) -> None:
        self._buf, self._n, self._borrowed = np.zeros((0, 3), dtype=_U64), 0, False
        self._clear_extra()

    def _clear_extra(self) -> None:
        pass

    def index(self, desc: tuple) -> int:
        d = self._parse(desc)
        for i in np.flatnonzero((self.rows == np.array(d[:3], dtype=_U64)).all(axis=1)):
            if self._row_extra(int(i)) == d[3:]:
                return int(i)
        raise _err(nixlNotFoundError, "descriptor not in the list")

    def _row_extra(self, i: int) -> tuple:
        return ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _DList):
            return NotImplemented
        if other.__class__ is not self.__class__ or self._type != other._type or self._n != other._n:
            return False
        if not np.array_equal(self.rows, other.rows):
            return False
        return self._WIDTH == 3 or all(self._row_extra(i) == other._row_extra(i) for i in range(self._n))

    def __ne__(self, other: object) -> bool:
        r = self.__eq__(other)
        return r if r is NotImplemented else not r

    def print(self) -> None:
        print(f"DescList of mem type {int(self._type)}")
        for i in range(self._n):
            print(f"  {self[i]}")
        sys.stdout.flush()

    def __repr__(self) -> str:
        total = int(self.rows[:, 1].sum()) if self._n else 0
        return f"{type(self).__name__}({self._type.name}, {self._n} descs, {total} bytes)"

    def total_bytes(self) -> int:
        return int(self.rows[:, 1].sum()) if self._n else 0

    # -- pickling: the safe binary format below, never a pickle of internals
    def __getstate__(self) -> bytes:
        return _serialize(self)

    def __setstate__(self, state: bytes) -> None:
        other = _deserialize(state)
        if type(other) is not type(self):
            raise TypeError(f"state is a {type(other).__name__}, not a {type(self).__name__}")
        self.__dict__.update(other.__dict__)

    def __reduce__(self):
        return (_restore, (_serialize(self),))


def type_name(o: Any) -> str:
    return type(o).__name__


class nixlXferDList(_DList):
    """NIXL's transfer descriptor list: (address, length, device id) rows of one memory type."""


class nixlRegDList(_DList):
    """NIXL's registration list: (address, length, device id, metadata) rows; `trim()` gives
    the transfer list of the same rows."""

    _WIDTH = 4

    def _set_extra(self, extra: list) -> None:
        metas = [_meta_bytes(m) for m in extra]
        self._meta = metas if any(metas) else None

    def _metas(self) -> list[bytes]:
        if self._meta is None:
            self._meta = [b""] * self._n
        return self._meta

    def _row_extra(self, i: int) -> tuple:
        return (self._meta[i] if self._meta is not None else b"",)

    def _parse(self, desc: Any) -> tuple:
        d = super()._parse(desc)
        return d[:3] + (_meta_bytes(d[3]),)

    def _row(self, i: int) -> tuple:
        return super()._row(i) + self._row_extra(i)

    def _set_one(self, i: int, d: tuple) -> None:
        if d[3] or self._meta is not None:
            self._metas()[i] = d[3]

    def _add_one(self, d: tuple) -> None:
        if d[3] or self._meta is not None:
            m = self._metas() if self._meta is not None else [b""] * (self._n - 1)
            m.append(d[3])
            self._meta = m

    def _rem_one(self, i: int) -> None:
        if self._meta is not None:
            del self._meta[i]

    def _clear_extra(self) -> None:
        self._meta = None

    def trim(self) -> nixlXferDList:
        out = nixlXferDList(self._type, self.rows.copy())
        out._keep = self._keep
        return out


class nixlRemoteDList(_DList):
    """NIXL's remote descriptor list: (address, length, device id, agent name) rows (used by
    `prep_mem_view`, which needs the GPU device API multirail does not have)."""

    _WIDTH = 4

    def _fill_names(self, n: int) -> None:
        self._names = [""] * n

    def _set_extra(self, extra: list) -> None:
        self._names = [str(x) for x in extra]

    def _row_extra(self, i: int) -> tuple:
        return (self._names[i],) if self._names is not None else ("",)

    def _row(self, i: int) -> tuple:
        return super()._row(i) + self._row_extra(i)

    def _parse(self, desc: Any) -> tuple:
        d = super()._parse(desc)
        return d[:3] + (str(d[3]),)

    def _set_one(self, i: int, d: tuple) -> None:
        self._names[i] = d[3]  # type: ignore[index]

    def _add_one(self, d: tuple) -> None:
        self._names = (self._names or [])
        self._names.append(d[3])

    def _rem_one(self, i: int) -> None:
        del self._names[i]  # type: ignore[union-attr]

    def _clear_extra(self) -> None:
        self._names = []

    def index(self, desc: tuple) -> int:  # not in NIXL's nixlRemoteDList
        raise AttributeError("index")


# Serialized lists: fixed binary layout, never pickle. "MRXD", u8 version, u8 memory type,
# u8 kind (0 xfer, 1 reg), pad, u64 count, count x (addr, len, dev) little-endian u64, then for
# a registration list count x (u32 length + metadata bytes). Version 1 (no kind, DRAM/VRAM
# only) is still read.
_MAGIC = b"MRXD"
_HEADER = struct.Struct("<4sBBBxQ")
_HEADER_V1 = struct.Struct("<4sBBxxQ")
_MAX_DESCS = 1 << 24
_KINDS = {0: nixlXferDList, 1: nixlRegDList}


def _serialize(d: _DList) -> bytes:
    if isinstance(d, nixlRemoteDList):
        raise TypeError("nixlRemoteDList is not serializable")
    kind = 1 if isinstance(d, nixlRegDList) else 0
    rows = np.ascontiguousarray(d.rows, dtype="<u8")
    out = [_HEADER.pack(_MAGIC, 2, int(d._type), kind, d._n), rows.tobytes()]
    if kind:
        metas = d._meta if d._meta is not None else [b""] * d._n
        out += [struct.pack("<I", len(m)) + m for m in metas]
    return b"".join(out)


def _deserialize(blob: Any) -> _DList:
    """Parse `_serialize` output; MetadataError (never a crash) on anything else."""
    data = bytes(blob)
    if len(data) < 8 or data[:4] != _MAGIC:
        raise _mr.MetadataError("not a multirail.nixl descriptor list (bad magic or truncated)")
    version = data[4]
    if version == 1:
        if len(data) < _HEADER_V1.size:
            raise _mr.MetadataError("serialized descriptor list is truncated")
        _, _, code, count = _HEADER_V1.unpack_from(data)
        kind, off = 0, _HEADER_V1.size
        if code not in (0, 1):
            raise _mr.MetadataError("malformed descriptor list (memory type)")
    elif version == 2:
        if len(data) < _HEADER.size:
            raise _mr.MetadataError("serialized descriptor list is truncated")
        _, _, code, kind, count = _HEADER.unpack_from(data)
        off = _HEADER.size
    else:
        raise _mr.MetadataError(f"descriptor list version {version} is not supported (expected 1 or 2)")
    if code not in nixl_mem_t._value2member_map_ or kind not in _KINDS or count > _MAX_DESCS:
        raise _mr.MetadataError("malformed descriptor list (memory type, kind or count)")
    end = off + 24 * count
    if len(data) < end or (kind == 0 and len(data) != end):
        raise _mr.MetadataError("malformed descriptor list (length)")
    rows = np.frombuffer(data, dtype="<u8", count=3 * count, offset=off).reshape(count, 3).astype(_U64)
    out = _KINDS[kind](nixl_mem_t(code), rows)
    if kind == 1:
        metas, p = [], end
        for _ in range(count):
            if p + 4 > len(data):
                raise _mr.MetadataError("malformed registration list (metadata truncated)")
            (n,) = struct.unpack_from("<I", data, p)
            if p + 4 + n > len(data):
                raise _mr.MetadataError("malformed registration list (metadata truncated)")
            metas.append(data[p + 4 : p + 4 + n])
            p += 4 + n
        if p != len(data):
            raise _mr.MetadataError("malformed registration list (trailing bytes)")
        out._meta = metas if any(metas) else None
    return out


def _restore(blob: bytes) -> _DList:
    return _deserialize(blob)


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

_MD_MAGIC = b"MRMD"
_PARTIAL_MAGIC = b"MRPM"  # partial metadata: b"MRPM", u8 flags (1: connection info), MRMD blob


class _Meta:
    """A decoded multirail metadata blob (name, incarnation, rails, regions by id)."""

    __slots__ = ("name", "incarnation", "rails", "regions")

    def __init__(self, name: str, incarnation: int, rails: list[bytes], regions: dict[int, tuple]) -> None:
        self.name, self.incarnation, self.rails, self.regions = name, incarnation, rails, regions

    @classmethod
    def decode(cls, blob: bytes) -> "_Meta":
        try:
            return cls._decode(bytes(blob))
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise _mr.MetadataError(f"cannot parse metadata: {e}") from None

    @classmethod
    def _decode(cls, b: bytes) -> "_Meta":
        if b[:4] != _MD_MAGIC:
            raise _mr.MetadataError("cannot parse metadata: not multirail metadata (bad magic)")
        (ver,) = struct.unpack_from("<H", b, 4)
        if ver != 1:
            raise _mr.VersionMismatchError(f"metadata schema version {ver}, expected 1")
        p = 6
        (n,) = struct.unpack_from("<H", b, p)
        name = b[p + 2 : p + 2 + n].decode()
        p += 2 + n
        (inc, nr) = struct.unpack_from("<QI", b, p)
        p += 12
        rails = []
        for _ in range(nr):
            s = p
            for _ in range(2):
                (k,) = struct.unpack_from("<H", b, p)
                p += 2 + k
            p += 1 + 2 + 8 + 4 + 4
            (k,) = struct.unpack_from("<H", b, p)
            p += 2 + k
            rails.append(b[s:p])
        (ng,) = struct.unpack_from("<I", b, p)
        p += 4
        regions = {}
        for _ in range(ng):
            rid, base, ln, dev, mem, acc = struct.unpack_from("<QQQIBB", b, p)
            regions[rid] = (base, ln, dev, mem, acc, b[p + 30 : p + 46])
            p += 46
        if p != len(b):
            raise _mr.MetadataError("cannot parse metadata: trailing bytes")
        return cls(name, inc, rails, regions)

    def encode(self) -> bytes:
        nb = self.name.encode()
        out = [_MD_MAGIC, struct.pack("<HH", 1, len(nb)), nb, struct.pack("<QI", self.incarnation, len(self.rails))]
        out += self.rails
        out.append(struct.pack("<I", len(self.regions)))
        for rid, (base, ln, dev, mem, acc, key) in self.regions.items():
            out.append(struct.pack("<QQQIBB", rid, base, ln, dev, mem, acc) + key)
        return b"".join(out)

    def with_host(self, ip: str) -> "_Meta":
        """Rails published with an unspecified address (0.0.0.0) reached at `ip` instead."""
        rails = []
        for r in self.rails:
            (k,) = struct.unpack_from("<H", r, 0)
            p = 2 + k
            (k2,) = struct.unpack_from("<H", r, p)
            addr = r[p + 2 : p + 2 + k2].decode()
            if addr in ("0.0.0.0", "::") and ip:
                ib = ip.encode()
                r = r[: p] + struct.pack("<H", len(ib)) + ib + r[p + 2 + k2 :]
            rails.append(r)
        return _Meta(self.name, self.incarnation, rails, dict(self.regions))

    def covers(self, rows: np.ndarray) -> bool:
        """Whether every (addr, len) row lies inside one region."""
        if not self.regions:
            return len(rows) == 0
        regs = np.array([(b, b + n) for b, n, *_ in self.regions.values()], dtype=np.float64)
        order = np.argsort(regs[:, 0])
        starts, ends = regs[order, 0], regs[order, 1]
        a = rows[:, 0].astype(np.float64)
        e = a + rows[:, 1].astype(np.float64)
        k = np.searchsorted(starts, a, side="right") - 1
        ok = k >= 0
        return bool(np.all(ok) and np.all(e <= ends[np.clip(k, 0, None)]))


# ---------------------------------------------------------------- side-channel control client

_FRAME = struct.Struct("<2sBBIQ")
_K_HELLO, _K_CHALLENGE, _K_AUTH, _K_WELCOME, _K_RESP, _K_METAGET, _K_META, _K_METAPUT, _K_ERROR = 1, 2, 3, 4, 20, 30, 31, 32, 40


def _control(ip: str, port: int, name: str, secret: Optional[bytes], kind: int, body: bytes, timeout: float) -> tuple[int, bytes]:
    """One request on a peer's side channel (docs/PROTOCOL.md): handshake, request, answer."""

    def send(s: socket.socket, k: int, b: bytes) -> None:
        s.sendall(_FRAME.pack(b"MR", 1, k, len(b), 0) + b)

    def recv(s: socket.socket) -> tuple[int, bytes]:
        h = _recv_exact(s, _FRAME.size)
        magic, ver, k, n, _ = _FRAME.unpack(h)
        if magic != b"MR" or ver != 1 or n > (16 << 20) + 64:
            raise _mr.ProtocolError(f"{ip}:{port} sent a frame this version does not read")
        return k, _recv_exact(s, n)

    try:
        s = socket.create_connection((ip, int(port)), timeout=timeout)
    except OSError as e:
        raise _mr.PeerLostError(f"cannot reach {ip}:{port}: {e}") from None
    try:
        nonce = os.urandom(16)
        nb = name.encode()
        send(s, _K_HELLO, struct.pack("<HBQH", 1, 1, 0, len(nb)) + nb + nonce)
        k, b = recv(s)
        if k == _K_ERROR:
            raise _status_error(ip, port, b)
        if k != _K_CHALLENGE:
            raise _mr.ProtocolError(f"{ip}:{port}: expected Challenge, got kind {k}")
        auth_required = b[0]
        snonce = b[9:25]
        (sn,) = struct.unpack_from("<H", b, 25)
        sname = b[27 : 27 + sn].decode()
        proof = bytes(32)
        if secret:
            proof = hmac.new(secret, b"multirail-auth-v1 client" + snonce + nonce + nb, hashlib.sha256).digest()
        elif auth_required:
            raise _mr.AuthenticationError(f"{ip}:{port} requires a shared secret (MULTIRAIL_SECRET)")
        send(s, _K_AUTH, proof)
        k, b = recv(s)
        if k == _K_ERROR:
            raise _status_error(ip, port, b)
        if k != _K_WELCOME:
            raise _mr.ProtocolError(f"{ip}:{port}: expected Welcome, got kind {k}")
        if secret:
            want = hmac.new(secret, b"multirail-auth-v1 server" + nonce + snonce + sname.encode(), hashlib.sha256).digest()
            if not hmac.compare_digest(want, b[:32]):
                raise _mr.AuthenticationError(f"{ip}:{port} did not prove the shared secret")
        send(s, kind, body)
        return recv(s)
    except socket.timeout:
        raise _mr.TransferTimeoutError(f"request to {ip}:{port} timed out") from None
    except (ConnectionError, OSError) as e:
        if isinstance(e, _mr.MultirailError):
            raise
        raise _mr.PeerLostError(f"{ip}:{port}: {e}") from None
    finally:
        s.close()


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += b
    return bytes(out)


_STATUS_ERRORS = {1: _mr.AccessDeniedError, 2: _mr.AccessDeniedError, 3: _mr.OutOfBoundsError, 4: _mr.ReadOnlyError,
                  6: _mr.ProtocolError, 7: _mr.VersionMismatchError, 8: _mr.AuthenticationError, 9: _mr.ProtocolError}


def _status_error(ip: str, port: int, body: bytes) -> Exception:
    st, _, mlen = struct.unpack_from("<HQH", body)
    msg = body[12 : 12 + mlen].decode(errors="replace")
    if st == 6 and "own" in msg:
        return _mr.InvalidArgumentError(f"{ip}:{port}: {msg}")
    return _STATUS_ERRORS.get(st, _mr.TransferError)(f"{ip}:{port}: {msg} (status {st})")


# ------------------------------------------------------------------- metadata store (etcd mode)

# Tests (and embedders) may set this to a callable (endpoints, namespace) -> store, where a
# store has put(key, value: bytes), get(key) -> bytes | None and delete_prefix(prefix).
STORE_FACTORY: Any = None


def _etcd_url(endpoints: str, namespace: str) -> str:
    """NIXL_ETCD_ENDPOINTS ("http://host:port[,http://host:port]") and NIXL_ETCD_NAMESPACE
    (default "/nixl/agents/") -> multirail's "etcd://host:port[,host:port]/PREFIX", where
    PREFIX is the namespace less a trailing "/agents" (multirail keeps agents at PREFIX/agents/NAME,
    so NIXL's default namespace keeps its default place)."""
    hosts = []
    for item in endpoints.split(","):
        item = item.strip()
        if item:
            hosts.append(item.split("://", 1)[-1].rstrip("/"))
    prefix = namespace.rstrip("/")
    if prefix.endswith("/agents"):
        prefix = prefix[: -len("/agents")]
    return f"etcd://{','.join(hosts)}/{prefix.strip('/')}"


class _EngineKV:
    """Keys for labelled (partial) metadata next to the engine's own records in etcd:
    PREFIX/nixl/AGENT/LABEL, written under the agent's etcd lease (so they go with the agent)."""

    def __init__(self, ms: Any) -> None:
        self.ms = ms  # multirail.metadata.MetadataStore
        self.prefix = ms.address.prefix.rstrip("/") + "/nixl"
        self._mine: set[bytes] = set()

    def put(self, key: str, value: bytes) -> None:
        k = key.encode()
        lease = self.ms.lease
        if lease is not None:
            lease.put(k, bytes(value), must=True)
        else:
            self.ms.client.put(k, bytes(value), None)
        self._mine.add(k)

    def get(self, key: str) -> Optional[bytes]:
        return self.ms.client.get(key.encode())[0]

    def delete_prefix(self, prefix: str) -> None:
        p = prefix.encode()
        lease = self.ms.lease
        for k in [k for k in self._mine if k.startswith(p)]:
            self._mine.discard(k)
            if lease is not None:
                lease.forget(k)
        self.ms.client.delete(p, prefix=True)


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
    __slots__ = ("peer", "rows", "mem", "loopback")

    def __init__(self, peer: str, rows: np.ndarray, mem: nixl_mem_t, loopback: bool) -> None:
        self.peer, self.rows, self.mem, self.loopback = peer, rows, mem, loopback


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
        if args and isinstance(args[0], (nixl_mem_t, str)) and len(args) > 1 and isinstance(args[1], np.ndarray):
            descs = nixlXferDList(_mem_arg(args[0]), _strided_rows(args[1]))
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
        self._dlists[h] = _Prepped(peer, rows, descs.getType(), loop)
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
