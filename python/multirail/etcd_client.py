"""etcd for the metadata store: defaults, store addresses (`etcd://HOST:PORT[,...]/PREFIX`) and
`EtcdClient`, the bounded HTTP client of etcd's JSON gateway (etcd3gw underneath). Part of
`multirail.metadata` (docs/etcd.md), which re-exports every name here."""

from __future__ import annotations

import base64
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from multirail.errors import InvalidArgumentError, MetadataStoreError


DEFAULT_TTL = 10.0
DEFAULT_TIMEOUT = 5.0
DEFAULT_PREFIX = "/multirail"
DEFAULT_PORT = 2379
ENVELOPE_VERSION = 1
#: etcd's default request limit is 1.5 MiB; refuse a value that cannot fit rather than fail later.
MAX_VALUE_BYTES = 1_400_000
#: gRPC-gateway API path of etcd >= 3.4 (3.3 only had /v3beta). $ETCD3GW_API_PATH overrides.
API_PATH = os.environ.get("ETCD3GW_API_PATH") or "/v3/"
#: A long-lived watch is re-created after this long without a byte (a dead connection that
#: TCP keep-alive has not caught yet); events are never lost: it resumes at the next revision.
WATCH_IDLE_S = 300.0

T = TypeVar("T")


# ------------------------------------------------------------------------------ addresses

@dataclass(frozen=True)
class StoreAddress:
    """Where the store is: etcd endpoints (tried in turn), URL scheme and key prefix."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str = DEFAULT_PREFIX
    scheme: str = "http"

    def __str__(self) -> str:
        hosts = ",".join(_hostport_text(h, p) for h, p in self.endpoints)
        return f"etcd://{hosts}{self.prefix}"


def _hostport_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_hostport(text: str, what: str) -> tuple[str, int]:
    text = text.strip()
    if not text:
        raise InvalidArgumentError(f"{what}: empty endpoint")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise InvalidArgumentError(f"{what}: unclosed '[' in {text!r}")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not host:
        raise InvalidArgumentError(f"{what}: no host in {text!r}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgumentError(f"{what}: bad port in {text!r}")
    return host, int(port_text)


def parse_url(url: str) -> StoreAddress:
    """``etcd://HOST:PORT[,HOST:PORT...]/PREFIX`` (port default 2379, prefix default
    ``/multirail``) -> StoreAddress. Raises InvalidArgumentError."""
    if not isinstance(url, str):
        raise InvalidArgumentError(f"metadata must be an etcd:// URL string, not {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "etcd":
        raise InvalidArgumentError(f"metadata URL must look like etcd://HOST:PORT[,HOST:PORT]/PREFIX, not {url!r}")
    hosts, slash, prefix = rest.partition("/")
    endpoints = tuple(_parse_hostport(h, "metadata URL") for h in hosts.split(","))
    prefix = "/" + prefix.strip("/") if prefix.strip("/") else DEFAULT_PREFIX
    return StoreAddress(endpoints, prefix, "http")


def parse_endpoints(text: str) -> StoreAddress:
    """nixlbench's ``--etcd-endpoints``: ``http://HOST:PORT[,http://HOST:PORT]`` (the scheme may
    be left out; all endpoints share one). Raises InvalidArgumentError."""
    endpoints, schemes = [], set()
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        scheme, sep, rest = item.partition("://")
        if not sep:
            scheme, rest = "http", item
        if scheme not in ("http", "https"):
            raise InvalidArgumentError(f"etcd endpoint {item!r}: scheme must be http or https")
        schemes.add(scheme)
        endpoints.append(_parse_hostport(rest.rstrip("/"), "etcd endpoint"))
    if not endpoints:
        raise InvalidArgumentError("no etcd endpoint given")
    if len(schemes) > 1:
        raise InvalidArgumentError("etcd endpoints mix http and https")
    return StoreAddress(tuple(endpoints), DEFAULT_PREFIX, schemes.pop())


# ------------------------------------------------------------------------------ the client

def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def _range_end(prefix: bytes) -> bytes:
    """The end of the key range that holds every key starting with `prefix`."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"
    b[-1] += 1
    return bytes(b)


def _deps() -> tuple[Any, Any]:
    try:
        import etcd3gw
        import requests
    except ImportError as e:  # pragma: no cover - packaging problem
        raise MetadataStoreError(f"the etcd client is not installed ({e}): pip install etcd3gw") from None
    return etcd3gw, requests


def _session() -> Any:
    """A requests session whose connections use TCP keep-alive (a silently dead etcd host is
    noticed in ~25 s even on a long-idle watch)."""
    _, requests = _deps()
    from requests.adapters import HTTPAdapter
    from urllib3.connection import HTTPConnection

    opts = list(HTTPConnection.default_socket_options) + [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), val))

    class _KeepAlive(HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            kwargs["socket_options"] = opts
            super().init_poolmanager(*args, **kwargs)

    s = requests.Session()
    s.mount("http://", _KeepAlive())
    s.mount("https://", _KeepAlive())
    return s


class EtcdClient:
    """Bounded etcd v3 calls through etcd3gw clients, one per endpoint, tried in turn.

    Every call has one deadline (`timeout` unless given): each HTTP request gets what is left
    of it as its connect and read timeout, so the whole call, failover included, ends within
    it. Calls are serialised per client (a lock), so one thread's value is never overwritten by
    an older one still in flight. Any failure is a `MetadataStoreError` naming each endpoint's
    error."""

    def __init__(self, address: StoreAddress, timeout: float = DEFAULT_TIMEOUT) -> None:
        etcd3gw, _ = _deps()
        if not timeout > 0:
            raise InvalidArgumentError("etcd timeout must be positive")
        self.address = address
        self.timeout = float(timeout)
        self._etcd3gw = etcd3gw
        self._clients = []
        for host, port in address.endpoints:
            c = etcd3gw.client(host=host, port=port, protocol=address.scheme, timeout=self.timeout,
                               api_path=API_PATH)
            c.session = _session()
            self._clients.append(c)
        self._lock = threading.Lock()
        self._good = 0  # index of the endpoint that answered last

    def __repr__(self) -> str:
        return f"EtcdClient({self.address})"

    @property
    def endpoints_text(self) -> str:
        return ",".join(_hostport_text(h, p) for h, p in self.address.endpoints)

    def call(self, what: str, fn: Callable[[Any], T], timeout: float | None = None) -> T:
        """Run `fn(etcd3gw_client)` on the first endpoint that answers within the deadline."""
        _, requests = _deps()
        budget = self.timeout if timeout is None else max(0.0, float(timeout))
        deadline = time.monotonic() + budget
        if not self._lock.acquire(timeout=budget):
            raise MetadataStoreError(f"etcd {what}: another request to {self.endpoints_text} held the client "
                                     f"for {budget:g} s")
        try:
            errors: list[str] = []
            n = len(self._clients)
            for k in range(n):
                i = (self._good + k) % n
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                c = self._clients[i]
                # Connect may use only this endpoint's share, so a blackholed first endpoint
                # leaves time for the others; the read may use everything left.
                c.timeout = (max(0.05, left / (n - k)), max(0.05, left))
                try:
                    out = fn(c)
                except (self._etcd3gw.exceptions.Etcd3Exception, requests.RequestException, ValueError,
                        KeyError, TypeError, OSError) as e:
                    detail = getattr(e, "detail_text", None) or str(e) or type(e).__name__
                    errors.append(f"{_hostport_text(c.host, c.port)}: {type(e).__name__}: {detail.strip()[:300]}")
                    continue
                self._good = i
                return out
            if not errors:
                errors.append(f"no answer within {budget:g} s")
            raise MetadataStoreError(f"etcd {what} failed ({'; '.join(errors)})")
        finally:
            self._lock.release()

    # -- operations (keys and values are bytes; names are UTF-8) -------------------------

    def get(self, key: bytes, timeout: float | None = None) -> tuple[bytes | None, int, int]:
        """(value or None, the key's mod revision, the store's revision at the read)."""
        def op(c: Any) -> tuple[bytes | None, int, int]:
            r = c.post(c.get_url("/kv/range"), json={"key": _b64(key)})
            rev = int(r.get("header", {}).get("revision", 0))
            kvs = r.get("kvs") or []
            if not kvs:
                return None, 0, rev
            return _unb64(kvs[0].get("value", "")), int(kvs[0].get("mod_revision", 0)), rev
        return self.call("get", op, timeout)

    def get_prefix(self, prefix: bytes, timeout: float | None = None) -> list[tuple[bytes, bytes, int]]:
        """[(key, value, mod revision)] of every key under `prefix`, sorted by key."""
        def op(c: Any) -> list[tuple[bytes, bytes, int]]:
            r = c.post(c.get_url("/kv/range"), json={"key": _b64(prefix), "range_end": _b64(_range_end(prefix))})
            return [(_unb64(kv["key"]), _unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)))
                    for kv in r.get("kvs") or []]
        return self.call("get", op, timeout)

    def put(self, key: bytes, value: bytes, lease: int | None, timeout: float | None = None) -> int:
        """Put; returns the store revision of the write."""
        def op(c: Any) -> int:
            body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease:
                body["lease"] = lease
            return int(c.post(c.get_url("/kv/put"), json=body).get("header", {}).get("revision", 0))
        return self.call("put", op, timeout)

    def create(self, key: bytes, value: bytes, lease: int | None, timeout: float | None = None) -> bool:
        """Put only if the key does not exist (one transaction). True when this call created it."""
        def op(c: Any) -> bool:
            put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease:
                put["lease"] = lease
            txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                   "success": [{"request_put": put}], "failure": []}
            return bool(c.transaction(txn).get("succeeded", False))
        return self.call("create", op, timeout)

    def delete(self, key: bytes, prefix: bool = False, timeout: float | None = None) -> int:
        """Delete a key (or every key under it with prefix=True); returns how many went."""
        def op(c: Any) -> int:
            body = {"key": _b64(key)}
            if prefix:
                body["range_end"] = _b64(_range_end(key))
            return int(c.post(c.get_url("/kv/deleterange"), json=body).get("deleted", 0))
        return self.call("delete", op, timeout)

    def grant(self, ttl: int, timeout: float | None = None) -> int:
        return self.call("lease grant", lambda c: int(c.lease(int(ttl)).id), timeout)

    def keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Refresh a lease; returns its new TTL, or <= 0 when etcd no longer knows it."""
        return self.call("lease keep-alive", lambda c: int(self._etcd3gw.Lease(lease, client=c).refresh()), timeout)

    def revoke(self, lease: int, timeout: float | None = None) -> None:
        self.call("lease revoke", lambda c: self._etcd3gw.Lease(lease, client=c).revoke(), timeout)

    def close(self) -> None:
        for c in self._clients:
            try:
                c.session.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
