"""Lease keep-alives over etcd's native gRPC `LeaseKeepAlive` stream: the two tiny protobuf
messages encoded by hand and `GrpcKeepAlive`, one long-lived stream per lease. Part of
`multirail.metadata` (docs/etcd.md), which re-exports every name here."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterator

from multirail.errors import MetadataStoreError
from multirail.etcd_client import StoreAddress, _hostport_text


# ------------------------------------------------------------------------------ gRPC keep-alive

#: Lease keep-alives go over etcd's native gRPC LeaseKeepAlive stream (one long-lived stream per
#: lease; each keep-alive is one small message) when grpcio is importable; $MULTIRAIL_ETCD_GRPC=0
#: (or setting this to False before a lease is created) keeps them on the HTTP gateway.
GRPC_KEEPALIVE = os.environ.get("MULTIRAIL_ETCD_GRPC", "1").strip().lower() not in ("0", "false", "no", "off")
#: A keep-alive stream is renewed (closed cleanly, a new one opened) after this long; its gRPC
#: deadline is this plus a minute, so no stream outlives that even if renewal never runs.
GRPC_STREAM_S = 300.0
#: After a gRPC failure, keep-alives use HTTP for this long (doubling to GRPC_RETRY_MAX_S while
#: the stream keeps failing), then the stream is tried again.
GRPC_RETRY_S = 10.0
GRPC_RETRY_MAX_S = 60.0
#: A lease is refreshed every TTL/KEEPALIVE_DIVISOR (etcd's own clients use 3). With 2 a
#: refresh that is lost or slow still leaves half the TTL: each try is bounded by half of what
#: is left before the lease would expire (see `Lease._budget`), so at least two more tries fit.
KEEPALIVE_DIVISOR = 2.0
#: Refreshes go out on wall-clock slots (multiples of the interval since the epoch), so the
#: keep-alives of every process with the same TTL reach etcd together and it serves them in one
#: wake-up instead of one each: its CPU per keep-alive roughly halves (docs/etcd.md). The gap
#: between two refreshes never exceeds the interval. $MULTIRAIL_ETCD_ALIGN=0 turns it off.
KEEPALIVE_ALIGN = os.environ.get("MULTIRAIL_ETCD_ALIGN", "1").strip().lower() not in ("0", "false", "no", "off")
_GRPC_METHOD = "/etcdserverpb.Lease/LeaseKeepAlive"
_U64 = 1 << 64


def _varint(n: int) -> bytes:
    """Protobuf varint of an int64 (negative: two's complement, 10 bytes)."""
    u = int(n) & (_U64 - 1)
    out = bytearray()
    while True:
        b = u & 0x7F
        u >>= 7
        if u:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(unsigned value, next position); ValueError when truncated or longer than 10 bytes."""
    result = shift = 0
    for i in range(10):
        if pos + i >= len(data):
            raise ValueError("truncated varint")
        b = data[pos + i]
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if result >= _U64:
                raise ValueError("varint overflows 64 bits")
            return result, pos + i + 1
        shift += 7
    raise ValueError("varint longer than 10 bytes")


def _int64(u: int) -> int:
    return u - _U64 if u >= 1 << 63 else u


def encode_keepalive_request(lease_id: int) -> bytes:
    """``LeaseKeepAliveRequest { int64 ID = 1; }`` in protobuf wire format."""
    lease_id = int(lease_id)
    if not -(1 << 63) <= lease_id < 1 << 63:
        raise ValueError(f"lease ID {lease_id} is not an int64")
    return b"\x08" + _varint(lease_id) if lease_id else b""


def encode_keepalive_response(lease_id: int, ttl: int, header: bytes = b"") -> bytes:
    """``LeaseKeepAliveResponse`` (for tests: etcd is the one that sends these)."""
    out = b"\x0a" + _varint(len(header)) + header if header else b""
    if lease_id:
        out += b"\x10" + _varint(lease_id)
    if ttl:
        out += b"\x18" + _varint(ttl)
    return out


def decode_keepalive_response(data: bytes) -> tuple[int, int]:
    """``LeaseKeepAliveResponse { ResponseHeader header = 1; int64 ID = 2; int64 TTL = 3; }``
    -> (ID, TTL); a TTL <= 0 means etcd does not know the lease. Unknown fields are skipped;
    truncated or malformed input raises ValueError."""
    data = bytes(data)
    lease_id = ttl = 0
    pos = 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire == 0:
            value, pos = _read_varint(data, pos)
            if field == 2:
                lease_id = _int64(value)
            elif field == 3:
                ttl = _int64(value)
        elif wire == 2:
            n, pos = _read_varint(data, pos)
            if n > len(data) - pos:
                raise ValueError("truncated length-delimited field")
            pos += n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if n > len(data) - pos:
                raise ValueError("truncated fixed-width field")
            pos += n
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if field in (2, 3) and wire != 0:
            raise ValueError(f"field {field} has wire type {wire}, not varint")
    return lease_id, ttl


def _grpc() -> Any:
    try:
        import grpc
    except ImportError:
        return None
    return grpc


class GrpcKeepAlive:
    """One lease's keep-alive stream on etcd's native gRPC API (same client port as the
    gateway): ``keepalive(lease, timeout)`` sends one LeaseKeepAliveRequest on a long-lived
    LeaseKeepAlive stream and waits at most `timeout` s for the answer. Any trouble (no answer
    in time, a gRPC error, a malformed or foreign response) raises `MetadataStoreError` after
    cancelling the stream; the caller then uses the HTTP keep-alive. A reader thread per open
    stream (daemon, "multirail-etcd-grpc") turns the blocking response iterator into a queue;
    `close()` ends both. Not thread-safe: the lease's keep-alive thread is its only user."""

    def __init__(self, address: StoreAddress, first: int = 0) -> None:
        grpc = _grpc()
        if grpc is None:
            raise MetadataStoreError("grpcio is not installed")
        self._grpc = grpc
        self.address = address
        self._ep = first
        self._channel: Any = None
        self._call: Any = None
        self._requests: Any = None
        self._responses: Any = None
        self._reader: threading.Thread | None = None
        self._opened = 0.0
        self.streams = 0  # streams opened

    def _target(self) -> tuple[str, str]:
        host, port = self.address.endpoints[self._ep % len(self.address.endpoints)]
        return _hostport_text(host, port), self.address.scheme

    def _open(self) -> None:
        import queue

        grpc = self._grpc
        if self._channel is None:
            target, scheme = self._target()
            # Own subchannel pool: one connection per lease holder, as separate processes have.
            opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]
            self._channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials(), options=opts)
                             if scheme == "https" else grpc.insecure_channel(target, options=opts))
        method = self._channel.stream_stream(_GRPC_METHOD, request_serializer=bytes,
                                             response_deserializer=decode_keepalive_response)
        requests: Any = queue.Queue()
        responses: Any = queue.Queue()

        def request_iter() -> Iterator[bytes]:
            while True:
                item = requests.get()
                if item is None:
                    return
                yield item

        call = method(request_iter(), timeout=GRPC_STREAM_S + 60.0)

        def read() -> None:
            try:
                for msg in call:
                    responses.put(msg)
                responses.put(MetadataStoreError("etcd ended the keep-alive stream"))
            except Exception as e:  # noqa: BLE001 - grpc.RpcError, a decode ValueError, ...
                responses.put(e)

        self._requests, self._responses, self._call = requests, responses, call
        self._reader = threading.Thread(target=read, name="multirail-etcd-grpc", daemon=True)
        self._reader.start()
        self._opened = time.monotonic()
        self.streams += 1

    def _end_stream(self, cancel: bool) -> None:
        call, reader, requests = self._call, self._reader, self._requests
        self._call = self._reader = self._requests = self._responses = None
        if requests is not None:
            requests.put(None)  # ends the request side: etcd ends the stream
        if call is not None and cancel:
            call.cancel()
        if reader is not None and reader is not threading.current_thread():
            reader.join(1.0)
            if reader.is_alive() and call is not None:
                call.cancel()
                reader.join(1.0)

    def keepalive(self, lease_id: int, timeout: float) -> int:
        """The lease's new TTL (<= 0: etcd does not know it). Raises MetadataStoreError."""
        import queue

        if self._call is not None and (time.monotonic() - self._opened > GRPC_STREAM_S
                                       or (self._reader is not None and not self._reader.is_alive())):
            self._end_stream(cancel=False)  # renew an old stream, or replace one that ended
        try:
            if self._call is None:
                self._open()
            self._requests.put(encode_keepalive_request(lease_id))
            got = self._responses.get(timeout=max(0.05, timeout))
        except queue.Empty:
            self._fail()
            raise MetadataStoreError(f"etcd gRPC keep-alive: no answer within {timeout:g} s") from None
        except Exception as e:  # noqa: BLE001 - grpc raises its own errors on open
            self._fail()
            raise MetadataStoreError(f"etcd gRPC keep-alive: {type(e).__name__}: {e}") from None
        if isinstance(got, BaseException):
            self._fail()
            detail = got.details() if hasattr(got, "details") and callable(got.details) else str(got)
            code = got.code() if hasattr(got, "code") and callable(got.code) else type(got).__name__
            raise MetadataStoreError(f"etcd gRPC keep-alive: {code}: {detail}")
        rid, ttl = got
        if rid != lease_id:
            self._fail()
            raise MetadataStoreError(f"etcd gRPC keep-alive: answer for lease {rid:x}, not {lease_id:x}")
        return ttl

    def _fail(self) -> None:
        """Drop the stream and the channel; the next try uses the next endpoint."""
        self._end_stream(cancel=True)
        self._close_channel()
        self._ep += 1

    def _close_channel(self) -> None:
        ch, self._channel = self._channel, None
        if ch is not None:
            try:
                ch.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    def close(self) -> None:
        self._end_stream(cancel=True)
        self._close_channel()
