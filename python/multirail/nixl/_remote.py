"""What the NIXL agent knows of and asks remote agents: multirail metadata blobs, the side-channel
control client, and the etcd keys of NIXL's (partial) metadata (part of `multirail.nixl.bindings`,
which re-exports every name here)."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from typing import Any, Optional

import numpy as np

from multirail import errors as _mr


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
