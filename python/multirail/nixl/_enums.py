"""NIXL's enums, constants and exception classes, and how engine errors and arguments map onto them
(part of `multirail.nixl.bindings`, which re-exports every name here)."""

from __future__ import annotations

import enum
from typing import Any, Optional

import numpy as np

from multirail import errors as _mr


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
