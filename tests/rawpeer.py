"""A hand-rolled multirail wire client for hostile-input tests (docs/PROTOCOL.md).

Written from the protocol document, independently of the Rust codec, so the tests also check
that the document is right.
"""

from __future__ import annotations

import os
import socket
import struct

VERSION = 1
HELLO, CHALLENGE, AUTH, WELCOME = 1, 2, 3, 4
READ_REQ, WRITE_REQ, NOTIF, PING, FENCE = 10, 11, 12, 13, 14
READ_VREQ, WRITE_VREQ = 15, 16
RESP, META_GET, META, META_PUT, ERROR = 20, 30, 31, 32, 40
STATUS = {0: "Ok", 1: "UnknownRegion", 2: "BadKey", 3: "OutOfBounds", 4: "ReadOnly", 5: "TooLarge",
          6: "Malformed", 7: "VersionMismatch", 8: "AuthFailed", 9: "Unexpected", 10: "Busy", 11: "Internal"}


def header(kind: int, body_len: int, req_id: int = 0, version: int = VERSION, magic: bytes = b"MR") -> bytes:
    return magic + bytes([version, kind]) + struct.pack("<IQ", body_len, req_id)


def frame(kind: int, body: bytes, req_id: int = 0) -> bytes:
    return header(kind, len(body), req_id) + body


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += b
    return out


def read_frame(s: socket.socket) -> tuple[int, int, bytes]:
    h = recv_exact(s, 16)
    assert h[:2] == b"MR", h
    kind = h[3]
    (blen, req) = struct.unpack("<IQ", h[4:])
    return kind, req, recv_exact(s, blen)


def parse_status(body: bytes) -> tuple[str, int, str]:
    st, bulk, mlen = struct.unpack("<HQH", body[:12])
    return STATUS.get(st, str(st)), bulk, body[12:12 + mlen].decode()


def connect(port: int, name: str = "raw", role: int = 2, host: str = "127.0.0.1",
            nonce: bytes | None = None, hello_version: int = VERSION, welcome: bool = True,
            source: str | None = None) -> socket.socket:
    """Open a connection and complete an unauthenticated handshake. `nonce` (16 bytes, random
    by default) is the connection's id for FENCE. `welcome=False`: stop after Auth, leaving the
    server's answer (Welcome, or an Error in its place) unread. `source`: the local address to
    connect from (another loopback address is another peer to a target without a secret)."""
    s = socket.create_connection((host, port), timeout=5, source_address=(source, 0) if source else None)
    nb = name.encode()
    body = struct.pack("<HBQH", hello_version, role, 1234, len(nb)) + nb + (nonce if nonce is not None else os.urandom(16))
    s.sendall(frame(HELLO, body))
    kind, _, b = read_frame(s)
    assert kind == CHALLENGE, kind
    s.sendall(frame(AUTH, bytes(32)))
    if not welcome:
        return s
    kind, _, b = read_frame(s)
    assert kind == WELCOME, (kind, b)
    return s


def fence_body(ids: list[bytes]) -> bytes:
    return struct.pack("<H", len(ids)) + b"".join(ids)


def vec_body(region: int, key: bytes, pieces: list[tuple[int, int, int, int]]) -> bytes:
    """A ReadVReq / WriteVReq body: pieces (offset, len, count, stride); the stride is on the
    wire only when count != 1."""
    out = struct.pack("<Q", region) + key + struct.pack("<I", len(pieces))
    for off, ln, count, stride in pieces:
        out += struct.pack("<QII", off, ln, count) + (struct.pack("<Q", stride) if count != 1 else b"")
    return out


def op_body(region: int, key: bytes, offset: int, length: int) -> bytes:
    return struct.pack("<Q", region) + key + struct.pack("<QQ", offset, length)


def parse_regions(meta: bytes) -> list[dict]:
    """Regions from a metadata blob (schema in docs/PROTOCOL.md)."""
    p = 4 + 2
    (n,) = struct.unpack_from("<H", meta, p)
    p += 2 + n + 8
    (nr,) = struct.unpack_from("<I", meta, p)
    p += 4
    for _ in range(nr):
        for _ in range(2):
            (k,) = struct.unpack_from("<H", meta, p)
            p += 2 + k
        p += 1 + 2 + 8 + 4 + 4
        (k,) = struct.unpack_from("<H", meta, p)
        p += 2 + k
    (ng,) = struct.unpack_from("<I", meta, p)
    p += 4
    out = []
    for _ in range(ng):
        rid, base, ln, dev, mem, acc = struct.unpack_from("<QQQIBB", meta, p)
        key = meta[p + 30:p + 46]
        out.append({"id": rid, "base": base, "len": ln, "dev": dev, "mem": mem, "access": acc, "key": key, "offset": p})
        p += 46
    return out
