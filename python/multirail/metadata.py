"""Agent metadata in etcd: publish under a leased key, fetch or wait by name (issue #11).

An agent created with ``{"metadata": "etcd://HOST:PORT[,HOST:PORT...]/PREFIX"}`` publishes its
metadata (`Agent.get_agent_metadata()`) at ``PREFIX/agents/NAME`` under an etcd lease that a
daemon thread keeps alive (TTL ``metadata_ttl``, default 10 s): a killed agent's key vanishes
within the TTL, ``close()`` deletes it at once. ``fetch_remote_metadata(name)`` (no address)
reads a peer's key; ``wait_for_peer(name, timeout)`` watches for it. The side channel
(``fetch_remote_metadata(name, ip, port)``) stays the default; etcd only carries the metadata,
the data-plane handshake still runs between the agents. docs/etcd.md has the design.

Public API (the Agent uses it; so can the NIXL layer or any tool)::

    store = MetadataStore("etcd://127.0.0.1:2379/multirail", ttl=10.0, timeout=5.0)
    store.publish("decode-0", blob, incarnation=inc, host="10.0.0.1", port=5555)  # leased key
    rec = store.fetch("decode-0")            # PeerRecord; UnknownPeerError when absent
    rec = store.wait_for("decode-0", 30.0)   # GET, then a watch; TransferTimeoutError after 30 s
    store.unpublish("decode-0"); store.close()

Every call is bounded by ``timeout`` (HTTP connect and read timeouts, endpoints tried in turn
within one deadline) and raises `MetadataStoreError` when etcd is down or unreachable; nothing
blocks forever. Threads (lease keep-alive, watches) are daemon threads stopped by ``close()``.

Value stored at the key (JSON, so ``etcdctl get`` is readable)::

    {"v": 1, "name": NAME, "incarnation": "<16 hex digits>", "host": H, "port": P,
     "metadata": "<base64 of the engine's metadata blob>"}

Client: etcd3gw (OpenStack; etcd's grpc-gateway JSON API over HTTP, etcd >= 3.4) for every
KV, transaction and lease call except the periodic keep-alive, which goes over etcd's native
gRPC ``LeaseKeepAlive`` stream on the same client port (grpcio, no protobuf codegen: the two
tiny messages are encoded here), one long-lived stream per lease, one small message per
refresh; any gRPC trouble falls back to the gateway's HTTP keep-alive for that round, and
without grpcio the gateway is used throughout. Watches read the same gateway's ``/v3/watch`` stream with our
own reader: etcd3gw's ``Watcher`` has no connect/read timeout and ends silently when etcd
restarts, which a long-lived watch must notice and resume from the next revision.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from multirail.errors import (InvalidArgumentError, MetadataError, MetadataStoreError,
                              TransferTimeoutError, UnknownPeerError)

from multirail.etcd_client import (  # noqa: F401  (moved there; names kept here)
    DEFAULT_TTL,
    DEFAULT_TIMEOUT,
    DEFAULT_PREFIX,
    DEFAULT_PORT,
    ENVELOPE_VERSION,
    MAX_VALUE_BYTES,
    API_PATH,
    WATCH_IDLE_S,
    T,
    StoreAddress,
    _hostport_text,
    _parse_hostport,
    parse_url,
    parse_endpoints,
    _b64,
    _unb64,
    _range_end,
    _deps,
    _session,
    EtcdClient,
)
from multirail.etcd_keepalive import (  # noqa: F401  (moved there; names kept here)
    GRPC_KEEPALIVE,
    GRPC_STREAM_S,
    GRPC_RETRY_S,
    GRPC_RETRY_MAX_S,
    KEEPALIVE_DIVISOR,
    KEEPALIVE_ALIGN,
    _GRPC_METHOD,
    _U64,
    _varint,
    _read_varint,
    _int64,
    encode_keepalive_request,
    encode_keepalive_response,
    decode_keepalive_response,
    _grpc,
    GrpcKeepAlive,
)
from multirail.etcd_watch import (  # noqa: F401  (moved there; names kept here)
    Watch,
    _json_lines,
    _shutdown,
    wait_for_key,
)

log = logging.getLogger("multirail.metadata")


# ------------------------------------------------------------------------------ leases

class Lease:
    """One etcd lease, the keys written under it, and the daemon thread that keeps it alive.

    The thread refreshes the lease every TTL/2 (KEEPALIVE_DIVISOR), on a wall-clock slot
    (KEEPALIVE_ALIGN): on a `GrpcKeepAlive` stream when grpcio is there and the stream works,
    else (and for GRPC_RETRY_S after a gRPC failure) through the HTTP gateway. Each try is
    bounded by half of what is left before the lease would expire (counted from the start of
    the last refresh that etcd answered), so a lost or slow refresh is retried in time. When
    etcd cannot be reached it retries with backoff (0.2 s doubling to min(interval, 2 s), never
    more than a quarter of what is left of the lease); when the lease is gone (it expired while etcd
    was unreachable from here, or etcd lost its data) it grants a new one and puts every key
    again; keys changed while etcd was away are put as soon as it answers. `close()` stops the
    thread and revokes the lease, so every key under it disappears at once.

    Shared: `acquire_lease` hands every store of this process with the same endpoints and TTL
    the same lease (one keep-alive for all of them; they die together anyway)."""

    def __init__(self, address: StoreAddress, ttl: float, timeout: float, *,
                 grpc_keepalive: bool | None = None) -> None:
        if not ttl >= 1:
            raise InvalidArgumentError("metadata_ttl must be at least 1 s (etcd leases count whole seconds)")
        self.address = address
        self.ttl = float(ttl)
        self.interval = max(0.3, self.ttl / KEEPALIVE_DIVISOR)
        self.align = KEEPALIVE_ALIGN
        # A keep-alive that waits longer than the interval risks the lease: bound it (each try
        # is bounded further by `_budget`).
        self.client = EtcdClient(address, min(float(timeout), max(0.5, self.interval)))
        # Time (monotonic) before which etcd cannot have expired the lease: the start of the
        # last answered grant/refresh plus its TTL. A margin is kept for etcd's 500 ms tick.
        self.expires_at = 0.0
        self._margin = min(0.5, self.ttl / 10.0)
        self._open_timeout = float(timeout)
        self.lease_id: int | None = None
        self._keys: dict[bytes, tuple[bytes, int]] = {}  # key -> (value, version)
        self._dirty: set[bytes] = set()
        self._doomed: set[bytes] = set()  # keys whose delete failed: retried when etcd answers
        self._version = 0
        self._cv = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.refs = 0
        self.pid = os.getpid()
        self.up = False
        self.last_error: str | None = None
        self.grants = 0  # leases granted (1 + re-grants after a loss)
        self.keepalives = 0
        self.grpc_keepalives = 0  # of them: answered on the gRPC stream
        self.http_keepalives = 0  # of them: answered by the HTTP gateway
        self.grpc_failures = 0
        self.grpc_error: str | None = None
        self.keepalive_via: str | None = None  # "grpc" or "http": how the last one went
        self.puts = 0
        self.failures = 0
        self._grpc_wanted = GRPC_KEEPALIVE if grpc_keepalive is None else bool(grpc_keepalive)
        if self._grpc_wanted and _grpc() is None:
            log.info("grpcio is not installed: etcd lease keep-alives use the HTTP gateway (pip install grpcio)")
            self._grpc_wanted = False
        self._grpc: GrpcKeepAlive | None = None
        self._grpc_retry_at = 0.0
        self._grpc_backoff = GRPC_RETRY_S

    def open(self) -> None:
        """Grant the lease now (raises MetadataStoreError) and start the keep-alive thread."""
        t0 = time.monotonic()
        self.lease_id = self.client.grant(max(1, round(self.ttl)), timeout=self._open_timeout)
        self.expires_at = t0 + max(1, round(self.ttl))
        self.grants += 1
        self.up = True
        self._thread = threading.Thread(target=self._run, name="multirail-etcd-keepalive", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and not self._closing and self.pid == os.getpid()

    # -- keys ----------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes, *, must: bool, timeout: float | None = None) -> bool:
        """Record `value` for `key` and write it under the lease. must=True: now, or raise
        MetadataStoreError. must=False: now if etcd is up (errors are left to the keep-alive
        thread, which writes it as soon as etcd answers); returns whether it was written."""
        if len(value) > MAX_VALUE_BYTES:
            raise MetadataStoreError(f"value for {key.decode(errors='replace')!r} is {len(value)} bytes; etcd "
                                     f"accepts about {MAX_VALUE_BYTES} (register fewer, larger regions)")
        with self._cv:
            self._version += 1
            self._keys[key] = (value, self._version)
            self._dirty.add(key)
            up = self.up
            self._cv.notify_all()
        if not (must or up):
            return False
        try:
            self._put_one(key, timeout)
            return True
        except MetadataStoreError:
            with self._cv:
                self.up = False  # later callers do not wait for it; the thread retries
                self._cv.notify_all()
            if must:
                raise
            return False

    def forget(self, key: bytes, timeout: float | None = None) -> None:
        """Stop keeping `key` and delete it from etcd. When etcd cannot be reached, raises
        MetadataStoreError and the keep-alive thread deletes it once etcd answers (the lease
        may live on for other keys, so the key would not expire by itself)."""
        with self._cv:
            self._keys.pop(key, None)
            self._dirty.discard(key)
            self._doomed.add(key)
        self.client.delete(key, timeout=timeout)
        with self._cv:
            if key not in self._keys:
                self._doomed.discard(key)

    def create(self, key: bytes, value: bytes, timeout: float | None = None) -> bool:
        """Create `key` under the lease only if it does not exist (not re-put after a loss)."""
        lease = self.lease_id
        if lease is None:
            raise MetadataStoreError("no etcd lease (etcd unreachable)")
        return self.client.create(key, value, lease, timeout=timeout)

    def _put_one(self, key: bytes, timeout: float | None = None) -> None:
        written: list[int] = []

        def op(c: Any) -> None:
            # Read under the client lock: the newest value wins, a forgotten key stays gone,
            # and nothing is ever written without a lease (it would never expire).
            with self._cv:
                item = self._keys.get(key)
                lease = self.lease_id
            if item is None:
                return
            if lease is None:
                raise MetadataStoreError("no etcd lease (etcd unreachable; re-granted when it answers)")
            c.post(c.get_url("/kv/put"), json={"key": _b64(key), "value": _b64(item[0]), "lease": lease})
            written.append(item[1])

        self.client.call("put", op, timeout)
        if written:
            self.puts += 1
            with self._cv:
                item = self._keys.get(key)
                if item is not None and item[1] == written[0]:
                    self._dirty.discard(key)

    # -- keep-alive thread -----------------------------------------------------------------

    def _next_due(self) -> float:
        """When the next refresh is due (monotonic): one interval from now, or with alignment
        the next wall-clock multiple of the interval (never later than one interval)."""
        now = time.monotonic()
        if not self.align:
            return now + self.interval
        w = time.time()
        return now + ((w // self.interval) + 1) * self.interval - w

    def _budget(self) -> float:
        """How long one refresh try may take: half of what is left before the lease could
        expire (so a try lost to a slow round trip leaves time for another), at least 0.25 s,
        at most the client's timeout. A lease already past its expiry gets the full timeout
        (etcd will say whether it is gone)."""
        left = self.expires_at - self._margin - time.monotonic()
        if left <= 0:
            return self.client.timeout
        return min(self.client.timeout, max(0.25, left / 2))

    def _run(self) -> None:
        backoff = 0.2
        due = self._next_due()
        while True:
            with self._cv:
                while not self._closing and time.monotonic() < due and not (self._dirty and self.up):
                    self._cv.wait(max(0.0, due - time.monotonic()))
                if self._closing:
                    return
                dirty = list(self._dirty)
            try:
                if self.lease_id is None:
                    self._regrant()
                elif time.monotonic() >= due:
                    t0 = time.monotonic()
                    ttl = self._keepalive(self.lease_id, self._budget())
                    self.keepalives += 1
                    if ttl > 0:
                        self.expires_at = t0 + ttl
                    else:  # expired while we could not reach etcd, or etcd lost it
                        log.warning("etcd lease %x is gone; granting a new one and publishing again", self.lease_id)
                        with self._cv:
                            self.lease_id = None
                        self._regrant()
                    due = self._next_due()
                for key in dirty:
                    self._put_one(key)
                with self._cv:
                    doomed = list(self._doomed)
                for key in doomed:
                    self.client.delete(key)
                    with self._cv:
                        if key not in self._keys:
                            self._doomed.discard(key)
                if not self.up:
                    log.info("etcd at %s answers again", self.client.endpoints_text)
                self.up, backoff = True, 0.2
            except Exception as e:  # noqa: BLE001 - MetadataStoreError; anything else must not end the thread
                if not isinstance(e, MetadataStoreError):
                    log.exception("etcd keep-alive: unexpected error")
                elif self.up:
                    log.warning("etcd unreachable, retrying: %s", e)
                self.up, self.last_error = False, str(e)
                self.failures += 1
                left = self.expires_at - self._margin - time.monotonic()
                wait = min(backoff, max(0.05, left / 4)) if left > 0 else backoff
                due = time.monotonic() + wait
                backoff = min(backoff * 2, min(self.interval, 2.0))

    def _keepalive(self, lease_id: int, budget: float | None = None) -> int:
        """One refresh within `budget` s (default: the client's timeout): on the gRPC stream
        when it works (at most half the budget), else through the HTTP gateway with what is
        left (which raises MetadataStoreError when etcd is down). After a gRPC failure the
        gateway is used for GRPC_RETRY_S (doubling to GRPC_RETRY_MAX_S while it keeps
        failing), then the stream is tried again."""
        budget = self.client.timeout if budget is None else max(0.1, float(budget))
        deadline = time.monotonic() + budget
        if self._grpc_wanted and time.monotonic() >= self._grpc_retry_at:
            try:
                if self._grpc is None:
                    self._grpc = GrpcKeepAlive(self.address, self.client._good)
                ttl = self._grpc.keepalive(lease_id, max(0.05, budget / 2))
                self.grpc_keepalives += 1
                self.keepalive_via = "grpc"
                self._grpc_backoff = GRPC_RETRY_S
                return ttl
            except MetadataStoreError as e:
                self.grpc_failures += 1
                self.grpc_error = str(e)
                self._grpc_retry_at = time.monotonic() + self._grpc_backoff
                log.info("%s; HTTP keep-alive for the next %g s", e, self._grpc_backoff)
                self._grpc_backoff = min(self._grpc_backoff * 2, GRPC_RETRY_MAX_S)
        ttl = self.client.keepalive(lease_id, timeout=max(0.05, deadline - time.monotonic()))
        self.http_keepalives += 1
        self.keepalive_via = "http"
        return ttl

    def _regrant(self) -> None:
        t0 = time.monotonic()
        lease = self.client.grant(max(1, round(self.ttl)))
        with self._cv:
            self.lease_id = lease
            self.expires_at = t0 + max(1, round(self.ttl))
            self._dirty.update(self._keys)
            self._doomed.clear()  # they were under the lost lease: etcd deleted them
        self.grants += 1

    def close(self, timeout: float = 2.0) -> None:
        """Stop the keep-alive thread and revoke the lease (its keys go at once). Bounded."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        lease, self.lease_id = self.lease_id, None
        if lease is not None and self.pid == os.getpid():
            try:
                self.client.revoke(lease, timeout=timeout)
            except MetadataStoreError as e:
                log.info("etcd lease revoke failed (its keys expire within %g s): %s", self.ttl, e)
        if self._grpc is not None:
            self._grpc.close()
        self.client.close()


_LEASES: dict[tuple[Any, ...], Lease] = {}
_LEASES_LOCK = threading.Lock()


def acquire_lease(address: StoreAddress, ttl: float, timeout: float, shared: bool = True) -> Lease:
    """A started lease for `address`: this process's shared one for (endpoints, TTL) when
    `shared`, else a new one. Pair with `release_lease`. Raises MetadataStoreError."""
    key = (os.getpid(), address.endpoints, address.scheme, float(ttl))
    with _LEASES_LOCK:
        lease = _LEASES.get(key) if shared else None
        if lease is None or not lease.alive:
            lease = Lease(address, ttl, timeout)
            lease.open()
            if shared:
                _LEASES[key] = lease
        lease.refs += 1
        return lease


def release_lease(lease: Lease, timeout: float = 2.0) -> None:
    with _LEASES_LOCK:
        lease.refs -= 1
        if lease.refs > 0:
            return
        for k, v in list(_LEASES.items()):
            if v is lease:
                del _LEASES[k]
    lease.close(timeout)


# ------------------------------------------------------------------------------ the store

@dataclass(frozen=True)
class PeerRecord:
    """One agent's entry in the store."""

    name: str
    incarnation: int
    metadata: bytes
    host: str
    port: int
    revision: int  # etcd mod revision of the key when read
    read_revision: int = 0  # the store's revision at the read (watch from the next one)

    def __repr__(self) -> str:
        return (f"PeerRecord({self.name!r}, incarnation={self.incarnation:#x}, {len(self.metadata)} bytes, "
                f"side channel {self.host}:{self.port}, revision {self.revision})")


def encode_record(name: str, metadata: bytes, incarnation: int, host: str = "", port: int = 0) -> bytes:
    return json.dumps({"v": ENVELOPE_VERSION, "name": name, "incarnation": f"{int(incarnation) & (2**64 - 1):016x}",
                       "host": host, "port": int(port), "metadata": _b64(bytes(metadata))},
                      separators=(",", ":")).encode()


def decode_record(value: bytes, revision: int = 0, where: str = "etcd", read_revision: int = 0) -> PeerRecord:
    """Parse a stored value; MetadataError when it is not a multirail agent record."""
    try:
        d = json.loads(value)
        if not isinstance(d, dict) or d.get("v") != ENVELOPE_VERSION:
            raise ValueError(f"unknown record version {d.get('v') if isinstance(d, dict) else d!r}")
        return PeerRecord(str(d["name"]), int(d["incarnation"], 16), _unb64(d["metadata"]), str(d.get("host", "")),
                          int(d.get("port", 0)), int(revision), int(read_revision or revision))
    except (ValueError, KeyError, TypeError) as e:
        raise MetadataError(f"{where}: not a multirail agent record ({e})") from None


class MetadataStore:
    """Agent metadata in etcd under ``PREFIX/agents/NAME`` (see the module docstring).

    `publish`, `update` and `unpublish` write this process's agents (under a lease shared by
    every store of the process with the same endpoints and TTL unless ``share_lease=False``);
    `get`, `fetch`, `wait_for` and `records` read anyone's; `watch` follows every agent key.
    Thread-safe. Every call is bounded by `timeout` seconds (or its own `timeout=`)."""

    def __init__(self, url: str | StoreAddress, ttl: float = DEFAULT_TTL, timeout: float = DEFAULT_TIMEOUT,
                 *, share_lease: bool = True) -> None:
        self.address = url if isinstance(url, StoreAddress) else parse_url(url)
        if not float(ttl) >= 1:
            raise InvalidArgumentError("metadata_ttl must be at least 1 s (etcd leases count whole seconds)")
        self.ttl, self.timeout, self.share_lease = float(ttl), float(timeout), share_lease
        self.client = EtcdClient(self.address, self.timeout)
        self._lease: Lease | None = None
        self._lease_lock = threading.Lock()
        self._mine: set[bytes] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"MetadataStore({self.address})"

    def __str__(self) -> str:
        return str(self.address)

    @property
    def agents_prefix(self) -> bytes:
        return (self.address.prefix.rstrip("/") + "/agents/").encode()

    def key(self, name: str) -> bytes:
        if not name:
            raise InvalidArgumentError("agent name must not be empty")
        return self.agents_prefix + name.encode()

    def name_of(self, key: bytes) -> str | None:
        p = self.agents_prefix
        return key[len(p):].decode(errors="replace") if key.startswith(p) else None

    @property
    def lease(self) -> Lease | None:
        return self._lease

    @property
    def up(self) -> bool:
        """False while the keep-alive thread cannot reach etcd."""
        return self._lease.up if self._lease is not None else True

    # -- writing ---------------------------------------------------------------------------

    def _ensure_lease(self) -> Lease:
        with self._lease_lock:
            if self._closed:
                raise MetadataStoreError(f"{self} is closed")
            if self._lease is None:
                self._lease = acquire_lease(self.address, self.ttl, self.timeout, self.share_lease)
            return self._lease

    def publish(self, name: str, metadata: bytes, *, incarnation: int, host: str = "", port: int = 0,
                timeout: float | None = None) -> None:
        """Write `name`'s record under the lease now; raises MetadataStoreError. The keep-alive
        thread keeps it (and writes it again after etcd lost it) until `unpublish`/`close`."""
        key = self.key(name)
        lease = self._ensure_lease()
        self._mine.add(key)
        lease.put(key, encode_record(name, metadata, incarnation, host, port), must=True,
                  timeout=self.timeout if timeout is None else timeout)

    def update(self, name: str, metadata: bytes, *, incarnation: int, host: str = "", port: int = 0) -> bool:
        """Like `publish`, but never raises for an unreachable etcd and does not wait for one
        known to be down: the keep-alive thread writes it when etcd answers. True if written."""
        key = self.key(name)
        lease = self._ensure_lease()
        self._mine.add(key)
        return lease.put(key, encode_record(name, metadata, incarnation, host, port), must=False)

    def unpublish(self, name: str, timeout: float | None = None) -> None:
        """Delete `name`'s record now and stop keeping it. Raises MetadataStoreError."""
        key = self.key(name)
        self._mine.discard(key)
        if self._lease is not None:
            self._lease.forget(key, timeout=timeout)
        else:
            self.client.delete(key, timeout=timeout)

    # -- reading ---------------------------------------------------------------------------

    def get(self, name: str, timeout: float | None = None) -> PeerRecord | None:
        value, mod, rev = self.client.get(self.key(name), timeout)
        return None if value is None else decode_record(value, mod, f"{self} agent {name!r}", rev)

    def fetch(self, name: str, timeout: float | None = None) -> PeerRecord:
        """`name`'s record; UnknownPeerError when no such agent is published."""
        rec = self.get(name, timeout)
        if rec is None:
            raise UnknownPeerError(f"no agent {name!r} in {self} (not started, closed, or its lease expired)")
        return rec

    def wait_for(self, name: str, timeout: float) -> PeerRecord:
        """`name`'s record, waiting (an etcd watch) up to `timeout` s for it to appear.
        TransferTimeoutError when it does not, MetadataStoreError when etcd is unreachable."""
        try:
            value, mod = wait_for_key(self.client, self.key(name), timeout)
        except TransferTimeoutError:
            raise TransferTimeoutError(f"agent {name!r} did not appear in {self} within {timeout:g} s") from None
        return decode_record(value, mod, f"{self} agent {name!r}")

    def records(self, timeout: float | None = None) -> list[PeerRecord]:
        """Every agent record under the prefix (unparseable values are skipped)."""
        out = []
        for key, value, mod in self.client.get_prefix(self.agents_prefix, timeout):
            try:
                out.append(decode_record(value, mod))
            except MetadataError:
                log.info("skipping %r: not a multirail agent record", key)
        return out

    def revision(self, timeout: float | None = None) -> int:
        """The store's current revision."""
        return self.client.get(self.agents_prefix, timeout)[2]

    def watch(self, on_put: Callable[[PeerRecord], None], on_delete: Callable[[str, int], None] | None = None,
              on_reset: Callable[[], None] | None = None, start_revision: int | None = None) -> Watch:
        """Follow every agent key from `start_revision` (default: now). Callbacks run on the
        watch's daemon thread; stop it with `.stop()`."""
        def on_event(kind: str, key: bytes, value: bytes, mod: int) -> None:
            name = self.name_of(key)
            if name is None:
                return
            if kind == "DELETE":
                if on_delete is not None:
                    on_delete(name, mod)
                return
            try:
                rec = decode_record(value, mod)
            except MetadataError:
                return
            on_put(rec)

        rev = self.revision() + 1 if start_revision is None else start_revision
        return Watch(self.client, self.agents_prefix, prefix=True, start_revision=rev, on_event=on_event,
                     on_reset=on_reset, name="multirail-etcd-peers")

    def close(self) -> None:
        """Delete this store's records (revoking the lease when no other store shares it)."""
        with self._lease_lock:
            if self._closed:
                return
            self._closed = True
            lease, self._lease = self._lease, None
        if lease is not None:
            budget = min(self.timeout, 2.0)
            if lease.refs > 1:  # shared: delete our own keys, the others stay
                for key in list(self._mine):
                    try:
                        lease.forget(key, timeout=budget)
                    except MetadataStoreError as e:
                        log.info("could not delete %r now (the keep-alive thread retries): %s", key, e)
            release_lease(lease, budget)
        self.client.close()

    def __enter__(self) -> "MetadataStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------ the agent's side

class AgentStore:
    """What a `multirail.Agent` created with ``{"metadata": URL}`` keeps: its published record
    and the records of the peers it loaded from the store.

    Peers are watched (one prefix watch, started on the first load) so that a peer whose key
    now holds another incarnation is marked stale: the Agent then refuses it with
    StaleMetadataError until its metadata is loaded again. `stale` is the Agent's own dict
    (name -> (cached incarnation, current incarnation)), updated in place."""

    def __init__(self, url: str, ttl: float, timeout: float, *, name: str, incarnation: int, host: str,
                 port: int, metadata: bytes, stale: dict[str, tuple[int, int]]) -> None:
        self.store = MetadataStore(url, ttl, timeout)
        self.name, self.incarnation, self.host, self.port = name, incarnation, host, port
        self.stale = stale
        self.published = False
        self._loaded: dict[str, PeerRecord] = {}   # peers loaded from the store
        self._seen: dict[str, tuple[int, int | None]] = {}  # name -> (mod revision, incarnation) from the watch
        self._lock = threading.Lock()
        self._watch: Watch | None = None
        try:
            self.publish(metadata)
        except BaseException:
            self.store.close()
            raise

    def __repr__(self) -> str:
        return f"AgentStore({self.name!r} in {self.store})"

    def publish(self, metadata: bytes) -> None:
        """Write this agent's record now (raises MetadataStoreError)."""
        self.store.publish(self.name, metadata, incarnation=self.incarnation, host=self.host, port=self.port)
        self.published = True

    def republish(self, metadata: bytes) -> None:
        """After a registration change: best effort, never raises for etcd trouble (the
        keep-alive thread writes it when etcd answers). Nothing while unpublished."""
        if self.published:
            try:
                self.store.update(self.name, metadata, incarnation=self.incarnation, host=self.host, port=self.port)
            except MetadataStoreError as e:  # e.g. a record too large for etcd
                log.warning("could not publish %s's metadata: %s", self.name, e)

    def unpublish(self) -> None:
        self.published = False
        self.store.unpublish(self.name)

    def load(self, add_remote: Callable[[bytes], str], name: str, wait: float | None) -> str:
        """Read `name` from the store (waiting up to `wait` s when given), install it with
        `add_remote`, and watch it from then on. Returns the name."""
        rec = self.store.fetch(name) if wait is None else self.store.wait_for(name, wait)
        if rec.name != name:
            raise MetadataError(f"{self.store}: the record of {name!r} names agent {rec.name!r}")
        got = add_remote(rec.metadata)
        with self._lock:
            self._loaded[got] = rec
            self.stale.pop(got, None)
            seen = self._seen.get(got)
            if seen is not None and seen[0] > rec.revision and seen[1] is not None and seen[1] != rec.incarnation:
                self.stale[got] = (rec.incarnation, seen[1])  # restarted while we were loading it
            start = self._watch is None
        if start:
            self._start_watch(max(rec.revision, rec.read_revision) + 1)
        return got

    def forget(self, name: str) -> None:
        with self._lock:
            self._loaded.pop(name, None)
            self.stale.pop(name, None)

    def loaded(self, name: str) -> bool:
        return name in self._loaded

    def _start_watch(self, start_revision: int) -> None:
        try:
            w = self.store.watch(self._on_put, self._on_delete, self._on_reset, start_revision=start_revision)
        except MetadataStoreError as e:
            log.warning("cannot watch %s for peer restarts: %s", self.store, e)
            return
        with self._lock:
            if self._watch is None:
                self._watch, w = w, None
        if w is not None:
            w.stop()

    def _on_put(self, rec: PeerRecord) -> None:
        with self._lock:
            self._seen[rec.name] = (rec.revision, rec.incarnation)
            mine = self._loaded.get(rec.name)
            if mine is not None and rec.revision > mine.revision and rec.incarnation != mine.incarnation:
                self.stale[rec.name] = (mine.incarnation, rec.incarnation)

    def _on_delete(self, name: str, mod: int) -> None:
        with self._lock:
            self._seen[name] = (mod, None)

    def _on_reset(self) -> None:
        for name in list(self._loaded):
            try:
                rec = self.store.get(name)
            except (MetadataStoreError, MetadataError):
                continue
            if rec is not None:
                self._on_put(rec)

    def status(self) -> dict[str, Any]:
        lease = self.store.lease
        return {"url": str(self.store), "published": self.published, "up": self.store.up,
                "lease_grants": lease.grants if lease else 0, "publishes": lease.puts if lease else 0,
                "keepalive_failures": lease.failures if lease else 0,
                "keepalive_via": lease.keepalive_via if lease else None,
                "grpc_keepalives": lease.grpc_keepalives if lease else 0,
                "last_error": lease.last_error if lease else None,
                "stale_peers": sorted(self.stale), "loaded_peers": sorted(self._loaded)}

    def close(self) -> None:
        with self._lock:
            w, self._watch = self._watch, None
        if w is not None:
            w.stop()
        self.published = False
        self.store.close()
