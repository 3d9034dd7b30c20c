"""`nixl._utils` on multirail: NIXL's test helpers over libc (ctypes), same names and behaviour.

Replace `import nixl._utils` by `import multirail.nixl.utils`.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_ALIGN = 4096  # as NIXL: page-aligned, so the buffers also suit O_DIRECT storage IO

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.aligned_alloc.restype = ctypes.c_void_p
_libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]


def malloc_passthru(size: int) -> int:
    """Allocate `size` bytes aligned to 4096 (C `aligned_alloc`); returns the address.
    Raises MemoryError when the allocation fails (NIXL returns 0)."""
    size = int(size)
    if size < 0:
        raise ValueError("size must be non-negative")
    rounded = max(_ALIGN, -(-size // _ALIGN) * _ALIGN)  # aligned_alloc wants a multiple
    addr = _libc.aligned_alloc(_ALIGN, rounded)
    if not addr:
        raise MemoryError(f"aligned_alloc({_ALIGN}, {rounded}) failed")
    return int(addr)


def free_passthru(buf: int) -> None:
    """Free memory from `malloc_passthru`."""
    _libc.free(ctypes.c_void_p(int(buf)))


def ba_buf(addr: int, size: int) -> None:
    """Fill `size` bytes at `addr` with 0xba."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Assert that `size` bytes at `addr1` and `addr2` are equal (AssertionError naming the
    first differing offset otherwise)."""
    n = int(size)
    a, b = ctypes.string_at(int(addr1), n), ctypes.string_at(int(addr2), n)
    if a != b:
        i = next(i for i in range(n) if a[i] != b[i])
        raise AssertionError(f"transfer mismatch at byte {i}: {a[i]:#04x} != {b[i]:#04x}")


__all__ = ["malloc_passthru", "free_passthru", "ba_buf", "verify_transfer"]
