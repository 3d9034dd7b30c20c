"""NIXL's descriptor lists (`nixlXferDList`, `nixlRegDList`, `nixlRemoteDList`) kept as (N, 3) uint64
arrays, and their serialization (part of `multirail.nixl.bindings`, which re-exports every name here)."""

from __future__ import annotations

import struct
import sys
from typing import Any, Optional

import numpy as np

from multirail import errors as _mr

from ._enums import _MEM_STR, _U64, _err, _mem_arg, _meta_bytes, _rows_from_array, _u, nixlNotFoundError, nixl_mem_t


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
