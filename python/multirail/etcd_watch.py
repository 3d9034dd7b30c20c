"""Watches on a key or prefix through the gateway's `/v3/watch` stream, resumed across etcd
restarts, and `wait_for_key`. Part of `multirail.metadata` (docs/etcd.md), which re-exports
every name here."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

from multirail.errors import MetadataStoreError, TransferTimeoutError
from multirail.etcd_client import EtcdClient, WATCH_IDLE_S, _b64, _deps, _hostport_text, _range_end, _session, _unb64

log = logging.getLogger("multirail.metadata")

# ------------------------------------------------------------------------------ watches

class Watch:
    """A watch on one key or a key prefix, kept up across etcd restarts.

    A daemon thread reads the gateway's ``/v3/watch`` stream (newline-separated JSON) and calls
    ``on_event(kind, key, value, mod_revision)`` (kind "PUT" or "DELETE") for every event from
    `start_revision` on. When the stream breaks (etcd restarted, connection lost, nothing for
    WATCH_IDLE_S) it is re-created from the next revision, endpoints in turn, with backoff
    (0.1 s doubling to 2 s); no event is lost unless etcd compacted it away, in which case
    ``on_reset()`` is called (re-read what you need) and the watch continues from there.
    `stop()` ends it at once (the stream's socket is shut down)."""

    def __init__(self, client: EtcdClient, key: bytes, *, prefix: bool = False, start_revision: int,
                 on_event: Callable[[str, bytes, bytes, int], None],
                 on_reset: Callable[[], None] | None = None, idle_timeout: float = WATCH_IDLE_S,
                 name: str = "multirail-etcd-watch") -> None:
        self._client, self._key, self._prefix = client, key, prefix
        self._next = max(1, int(start_revision))
        self._on_event, self._on_reset = on_event, on_reset
        self._idle = float(idle_timeout)
        self._stop = threading.Event()
        self.connected = threading.Event()  # set while the watch is established
        self.ever_connected = False
        self.last_error: str | None = None
        self._resp: Any = None
        self._resp_lock = threading.Lock()
        self._ep = client._good
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def next_revision(self) -> int:
        return self._next

    def stop(self, join_timeout: float = 2.0) -> None:
        self._stop.set()
        with self._resp_lock:
            _shutdown(self._resp)
        if threading.current_thread() is not self._thread:
            self._thread.join(join_timeout)

    def _run(self) -> None:
        _, requests = _deps()
        session = _session()
        backoff = 0.1
        clients = self._client._clients
        try:
            while not self._stop.is_set():
                c = clients[self._ep % len(clients)]
                create: dict[str, Any] = {"key": _b64(self._key), "start_revision": self._next}
                if self._prefix:
                    create["range_end"] = _b64(_range_end(self._key))
                try:
                    resp = session.post(c.get_url("/watch"), json={"create_request": create}, stream=True,
                                        timeout=(min(self._client.timeout, 5.0), self._idle))
                    with self._resp_lock:
                        if self._stop.is_set():
                            resp.close()
                            break
                        self._resp = resp
                    if resp.status_code != 200:
                        raise MetadataStoreError(f"watch: HTTP {resp.status_code} {resp.text[:200]}")
                    for msg in _json_lines(resp):
                        self._handle(msg)
                        backoff = 0.1
                    if not self._stop.is_set():
                        self.last_error = "watch stream closed by etcd"
                except (requests.RequestException, MetadataStoreError, ValueError, KeyError, OSError) as e:
                    if not self._stop.is_set():
                        self.last_error = f"{_hostport_text(c.host, c.port)}: {type(e).__name__}: {e}"
                        self._ep += 1  # try the next endpoint
                finally:
                    self.connected.clear()
                    with self._resp_lock:
                        resp_, self._resp = self._resp, None
                    if resp_ is not None:
                        resp_.close()
                if self._stop.wait(backoff):
                    break
                backoff = min(backoff * 2, 2.0)
        finally:
            session.close()

    def _handle(self, msg: dict[str, Any]) -> None:
        if "error" in msg:
            err = msg["error"]
            raise MetadataStoreError(f"watch: {err.get('message', err) if isinstance(err, dict) else err}")
        res = msg.get("result") or {}
        if res.get("created"):
            self.connected.set()
            self.ever_connected = True
        compact = int(res.get("compact_revision", 0) or 0)
        if compact:
            # The revisions we wanted are gone: the caller re-reads, we resume at `compact`.
            self._next = max(self._next, compact)
            if self._on_reset is not None:
                try:
                    self._on_reset()
                except Exception:  # noqa: BLE001 - a callback must not kill the watch
                    log.exception("watch reset callback failed")
        if res.get("canceled"):
            raise MetadataStoreError(f"watch canceled by etcd: {res.get('cancel_reason', 'no reason given')}")
        for ev in res.get("events") or []:
            kv = ev.get("kv") or {}
            mod = int(kv.get("mod_revision", 0))
            kind = ev.get("type", "PUT")  # the gateway omits the default (PUT)
            try:
                self._on_event(kind, _unb64(kv.get("key", "")), _unb64(kv.get("value", "")), mod)
            except Exception:  # noqa: BLE001 - a callback must not kill the watch
                log.exception("watch event callback failed")
            self._next = max(self._next, mod + 1)


def _json_lines(resp: Any) -> Iterator[dict[str, Any]]:
    buf = b""
    for chunk in resp.iter_content(chunk_size=None):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)
    if buf.strip():
        yield json.loads(buf)


def _shutdown(resp: Any) -> None:
    """Wake a thread blocked reading `resp` (shutdown(2) on its socket; close() would not)."""
    if resp is None:
        return
    try:
        fd = resp.raw._fp.fileno()
        s = socket.socket(fileno=os.dup(fd))
        try:
            s.shutdown(socket.SHUT_RDWR)
        finally:
            s.close()
    except Exception:  # noqa: BLE001 - the stream may be gone already
        pass


def wait_for_key(client: EtcdClient, key: bytes, timeout: float) -> tuple[bytes, int]:
    """(value, mod revision) of `key` once it exists: read, then watched from the revision of
    that read, so a put in between is not missed. Raises TransferTimeoutError after `timeout`
    seconds, MetadataStoreError when etcd cannot be reached."""
    deadline = time.monotonic() + max(0.0, float(timeout))
    value, mod, rev = client.get(key, timeout=max(0.05, min(client.timeout, deadline - time.monotonic())))
    if value is not None:
        return value, mod
    got: list[tuple[bytes, int]] = []
    ev = threading.Event()

    def on_event(kind: str, k: bytes, v: bytes, m: int) -> None:
        if kind == "PUT" and k == key and not got:
            got.append((v, m))
            ev.set()

    w = Watch(client, key, start_revision=rev + 1, on_event=on_event,
              idle_timeout=max(1.0, deadline - time.monotonic() + 1.0), name="multirail-etcd-wait")
    try:
        ev.wait(max(0.0, deadline - time.monotonic()))
    finally:
        w.stop()
    if got:
        return got[0]
    if not w.ever_connected and w.last_error:
        raise MetadataStoreError(f"etcd watch on {key.decode(errors='replace')!r} failed: {w.last_error}")
    raise TransferTimeoutError(f"{key.decode(errors='replace')!r} did not appear in etcd at "
                               f"{client.endpoints_text} within {timeout:g} s")
