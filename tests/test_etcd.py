"""The etcd metadata store (python/multirail/metadata.py) and `multirail bench run`, against a
real etcd (tests/etcd_server.py: Debian's etcd-server on free loopback ports, stopped by PID).

Agents in other processes are the .venv interpreter running AGENT_CHILD; every wait is bounded
(lease TTL + generous slack: the host is a loaded 2-core VM) and nothing asserts a timing
beyond those bounds. Skips with a reason when etcd or the engine is missing.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from conftest import ENV, engine_available, engine_python, netns_unavailable
from etcd_server import ETCD_MISSING, EtcdServer, free_port

def _why_not() -> str | None:
    if ETCD_MISSING:
        return ETCD_MISSING
    if not engine_available():
        return "the engine extension is not built"
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "etcd3gw is not installed (pip install etcd3gw; a dependency in pyproject.toml)"
    return None


_SKIP = _why_not()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

SLACK = 15.0  # seconds on top of any TTL or timeout: the VM is loaded
MiB = 1 << 20

# An agent in its own process. argv: name url ttl. Prints one JSON line per event; commands on
# stdin: "register" (another buffer), "close", "exit".
AGENT_CHILD = r"""
import json, sys, numpy as np, multirail
name, url, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
a = multirail.Agent(name, {"metadata": url, "metadata_ttl": ttl})
bufs = [np.arange(1 << 20, dtype=np.uint64).view(np.uint8)[: 1 << 20].copy()]
a.register_memory(bufs[0])
def say(**kw):
    print(json.dumps(kw), flush=True)
say(event="ready", incarnation=a.incarnation, addr=int(bufs[0].ctypes.data), len=len(bufs[0]), port=a.port)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "register":
        b = np.full(1 << 20, len(bufs) & 0xFF, dtype=np.uint8)
        bufs.append(b)
        a.register_memory(b)
        say(event="registered", addr=int(b.ctypes.data), len=len(b))
    elif cmd == "close":
        a.close()
        say(event="closed")
    elif cmd == "exit":
        break
"""


def _pattern(n: int) -> np.ndarray:
    return np.arange(1 << 20, dtype=np.uint64).view(np.uint8)[:n]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    srv = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd this test may kill and restart."""
    srv = EtcdServer(tmp_path / "data")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def url(etcd: EtcdServer) -> str:
    return etcd.url(f"t-{uuid.uuid4().hex[:8]}")


class Child:
    """An agent in another process (AGENT_CHILD), killed by PID at the end."""

    def __init__(self, name: str, url: str, ttl: float = 10.0) -> None:
        py = engine_python()
        assert py, "no interpreter can import the engine"
        self.proc = subprocess.Popen([py, "-c", AGENT_CHILD, name, url, str(ttl)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        self.ready = self.read("ready")

    def read(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if sel.select(timeout=0.5):
                    line = self.proc.stdout.readline()
                    if not line:
                        break
                    msg = json.loads(line)
                    if msg.get("event") == event:
                        return msg
                elif self.proc.poll() is not None:
                    break
        finally:
            sel.close()
        err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
        raise AssertionError(f"child did not report {event!r} within {timeout:g} s: {err[-1500:]}")

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def sigkill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.sigkill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def children() -> Iterator[Callable[..., Child]]:
    made: list[Child] = []

    def make(*args: Any, **kw: Any) -> Child:
        c = Child(*args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def _store(url: str) -> Any:
    from multirail.metadata import MetadataStore

    return MetadataStore(url, timeout=5.0)


def _eventually(cond: Callable[[], Any], timeout: float, what: str, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:g} s")
        time.sleep(step)


def _read_from(agent: Any, peer: str, addr: int, n: int) -> np.ndarray:
    dst = np.zeros(n, dtype=np.uint8)
    reg = agent.register_memory(dst)
    try:
        h = agent.initialize_xfer("READ", [dst], [(addr, n, 0)], peer)
        agent.transfer_sync(h, 20)
        agent.release_xfer_handle(h)
    finally:
        agent.deregister_memory(reg)
    return dst


# ------------------------------------------------------------------ parsing, no etcd needed

def test_url_parsing() -> None:
    from multirail.errors import InvalidArgumentError
    from multirail.metadata import parse_endpoints, parse_url

    a = parse_url("etcd://10.0.0.1:2379,10.0.0.2,[::1]:2381/kv/cluster-a/")
    assert a.endpoints == (("10.0.0.1", 2379), ("10.0.0.2", 2379), ("::1", 2381))
    assert a.prefix == "/kv/cluster-a" and str(a) == "etcd://10.0.0.1:2379,10.0.0.2:2379,[::1]:2381/kv/cluster-a"
    assert parse_url("etcd://h").prefix == "/multirail"
    for bad in ("http://h:1/x", "etcd://:1/x", "etcd://h:99999/x", "h:2379"):
        with pytest.raises(InvalidArgumentError):
            parse_url(bad)
    e = parse_endpoints("http://a:1, http://b:2")
    assert e.endpoints == (("a", 1), ("b", 2)) and e.scheme == "http"
    with pytest.raises(InvalidArgumentError):
        parse_endpoints("http://a:1,https://b:2")



def test_keepalive_message_encoding() -> None:
    """LeaseKeepAliveRequest/Response, hand-encoded protobuf: round trips, the bytes etcd
    3.4.23 sent, unknown fields skipped, truncated or garbage input rejected."""
    from multirail.metadata import (_varint, decode_keepalive_response, encode_keepalive_request,
                                    encode_keepalive_response)

    assert encode_keepalive_request(0) == b""  # proto3: the default is left out
    assert encode_keepalive_request(1) == b"\x08\x01"
    assert encode_keepalive_request(300) == b"\x08\xac\x02"
    assert len(encode_keepalive_request(-1)) == 11  # negative int64: 10-byte varint
    with pytest.raises(ValueError):
        encode_keepalive_request(1 << 63)
    for lid, ttl in [(1, 10), (0x7587_8D91_6A2B_0F04, 3), ((1 << 63) - 1, 1 << 40), (5, 0), (5, -1), (-7, 9)]:
        hdr = b"\x08" + _varint(0xDEADBEEF) + b"\x10" + _varint(42) + b"\x18\x07" + b"\x20" + _varint(1 << 35)
        for h in (b"", hdr):
            assert decode_keepalive_response(encode_keepalive_response(lid, ttl, h)) == (lid, ttl)
    # a response captured from etcd 3.4.23 (header, ID, TTL 5)
    real = bytes.fromhex("0a18088df4bdeab7e0beec1d10fe8cf8fe9ba0f8fa36180120021086bc878286c1a8bf061805")
    assert decode_keepalive_response(real) == (0x067E_A208_6041_DE06, 5)
    assert decode_keepalive_response(b"") == (0, 0)  # an unknown lease's answer may omit both
    # unknown fields of every skippable wire type are ignored
    extra = b"\x20\x05" + b"\x29" + bytes(8) + b"\x35" + bytes(4) + b"\x3a\x03abc"
    assert decode_keepalive_response(encode_keepalive_response(9, 4) + extra) == (9, 4)
    good = encode_keepalive_response(0x1234_5678_9ABC, 10, b"\x08\x01")
    for cut in range(1, len(good)):
        try:
            decode_keepalive_response(good[:cut])
        except ValueError:
            continue
        # a cut between two fields is a shorter valid message, never a wrong value
        assert decode_keepalive_response(good[:cut]) in {(0, 0), (0x1234_5678_9ABC, 0)}
    for garbage in [b"\x10", b"\x10\x80", b"\x10" + b"\xff" * 11, b"\x0a\x05ab", b"\x0a\xff\xff\xff\xff\x0f",
                    b"\x29\x00", b"\x35\x00\x00", b"\x13", b"\x14", b"\x1e", b"\x00\x01",
                    b"\x12\x01\x00",  # ID as a length-delimited field
                    b"\x10" + b"\xff" * 9 + b"\x7f"]:  # a 10-byte varint above 2**64
        with pytest.raises(ValueError):
            decode_keepalive_response(garbage)
    import random

    rnd = random.Random(11)
    for _ in range(3000):  # random bytes: a result or ValueError, nothing else
        blob = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 24)))
        try:
            lid, ttl = decode_keepalive_response(blob)
        except ValueError:
            continue
        assert -(1 << 63) <= lid < 1 << 63 and -(1 << 63) <= ttl < 1 << 63


# ------------------------------------------------------------------ publish and fetch

def test_publish_fetch_by_name_and_transfer(url: str, agents: Callable[..., Any]) -> None:
    target = agents("tgt", {"metadata": url})
    src = _pattern(MiB).copy()
    target.register_memory(src)
    init = agents("ini", {"metadata": url})
    assert init.fetch_remote_metadata("tgt") == "tgt"
    assert init.check_remote_metadata("tgt")
    got = _read_from(init, "tgt", int(src.ctypes.data), MiB)
    assert (got == src).all()
    rec = _store(url).fetch("tgt")
    assert rec.incarnation == target.incarnation and rec.port == target.port and rec.name == "tgt"
    assert rec.metadata == target.get_agent_metadata()


def test_fetch_unknown_name_and_no_store(url: str, agents: Callable[..., Any]) -> None:
    import multirail

    a = agents("lonely", {"metadata": url})
    with pytest.raises(multirail.UnknownPeerError, match="no agent 'nobody'"):
        a.fetch_remote_metadata("nobody")
    plain = agents("plain")
    with pytest.raises(multirail.InvalidArgumentError, match="no metadata store"):
        plain.fetch_remote_metadata("lonely")
    with pytest.raises(multirail.InvalidArgumentError):
        plain.wait_for_peer("lonely", 1)


def test_agents_in_separate_processes(url: str, agents: Callable[..., Any], children: Any) -> None:
    child = children("proc-a", url)
    me = agents("proc-b", {"metadata": url})
    assert me.fetch_remote_metadata("proc-a") == "proc-a"
    got = _read_from(me, "proc-a", child.ready["addr"], child.ready["len"])
    assert (got == _pattern(MiB)).all()
    # ... and the child found by its own name in the store, from a third agent
    assert _store(url).fetch("proc-a").incarnation == child.ready["incarnation"]


def test_sigkilled_agent_key_expires_within_ttl(url: str, children: Any) -> None:
    ttl = 2.0
    child = children("doomed", url, ttl=ttl)
    store = _store(url)
    assert store.get("doomed") is not None
    child.sigkill()
    t0 = time.monotonic()
    _eventually(lambda: store.get("doomed") is None, ttl + SLACK, "the killed agent's key to expire")
    # etcd counts a lease from its last keep-alive (up to TTL/2 ago) and expires on its own tick
    assert time.monotonic() - t0 <= ttl + SLACK


def test_close_removes_key_at_once(url: str, agents: Callable[..., Any], children: Any) -> None:
    import multirail

    store = _store(url)
    a = agents("closer", {"metadata": url})
    b = agents("stayer", {"metadata": url})  # shares a's lease (same process, endpoints, TTL)
    assert store.get("closer") and store.get("stayer")
    a.close()
    assert store.get("closer") is None, "close() must delete the key before it returns"
    assert store.get("stayer") is not None, "another agent's key under the shared lease stays"
    b.close()
    assert store.records() == []
    # another process: "close" deletes at once too (its lease is revoked)
    child = children("child-closer", url)
    assert store.get("child-closer") is not None
    child.send("close")
    child.read("closed")
    assert store.get("child-closer") is None
    c = agents("refetcher", {"metadata": url})
    with pytest.raises(multirail.UnknownPeerError):
        c.fetch_remote_metadata("child-closer")


def test_republish_after_register_and_deregister(url: str, agents: Callable[..., Any]) -> None:
    import multirail

    target = agents("grower", {"metadata": url})
    first = _pattern(MiB).copy()
    target.register_memory(first)
    init = agents("watcher", {"metadata": url})
    init.fetch_remote_metadata("grower")
    second = np.full(MiB, 7, dtype=np.uint8)
    reg2 = target.register_memory(second)
    # the cached metadata does not have the new region yet
    dst = np.zeros(MiB, dtype=np.uint8)
    init.register_memory(dst)
    with pytest.raises(multirail.OutOfBoundsError):
        init.initialize_xfer("READ", [dst], [(int(second.ctypes.data), MiB, 0)], "grower")
    init.fetch_remote_metadata("grower")  # re-published by register_memory
    assert (_read_from(init, "grower", int(second.ctypes.data), MiB) == 7).all()
    before = _store(url).fetch("grower").metadata
    target.deregister_memory(reg2)
    after = _store(url).fetch("grower").metadata
    assert after != before and after == target.get_agent_metadata()
    # invalidate: gone until published again; registrations do not re-publish meanwhile
    target.invalidate_local_metadata()
    assert _store(url).get("grower") is None
    target.register_memory(np.zeros(4096, np.uint8))
    assert _store(url).get("grower") is None
    target.send_local_metadata()
    assert _store(url).fetch("grower").metadata == target.get_agent_metadata()


def test_wait_for_peer_success(url: str, agents: Callable[..., Any]) -> None:
    waiter = agents("waiter", {"metadata": url})
    made: list[Any] = []

    def late() -> None:
        time.sleep(0.5)
        made.append(agents("late", {"metadata": url}))

    t = threading.Thread(target=late)
    t.start()
    try:
        t0 = time.monotonic()
        assert waiter.wait_for_peer("late", timeout=30) == "late"
        assert time.monotonic() - t0 < 30
    finally:
        t.join(30)
    assert waiter.check_remote_metadata("late")
    # already there: returns at once
    assert waiter.wait_for_peer("late", timeout=5) == "late"


def test_wait_for_peer_timeout(url: str, agents: Callable[..., Any]) -> None:
    import multirail

    waiter = agents("impatient", {"metadata": url})
    t0 = time.monotonic()
    with pytest.raises(multirail.TransferTimeoutError, match="did not appear") as ei:
        waiter.wait_for_peer("never", timeout=1.0)
    assert isinstance(ei.value, TimeoutError)
    assert 0.9 <= time.monotonic() - t0 < 1.0 + SLACK
    _eventually(lambda: not [t for t in threading.enumerate() if t.name == "multirail-etcd-wait"], 5,
                "the wait's watch thread to end")


@pytest.mark.parametrize("where", ["closed port", "blackhole"])
def test_unreachable_store_is_a_typed_error_within_the_timeout(where: str) -> None:
    import multirail

    endpoint = f"127.0.0.1:{free_port()}" if where == "closed port" else "192.0.2.1:2379"  # TEST-NET-1
    timeout = 1.0
    t0 = time.monotonic()
    with pytest.raises(multirail.MetadataStoreError) as ei:
        multirail.Agent("unreachable", {"metadata": f"etcd://{endpoint}/x", "timeout": timeout})
    assert time.monotonic() - t0 < timeout + SLACK
    assert isinstance(ei.value, ConnectionError) and endpoint.split(":")[0] in str(ei.value)
    from multirail.metadata import MetadataStore

    t0 = time.monotonic()
    with pytest.raises(multirail.MetadataStoreError):
        MetadataStore(f"etcd://{endpoint}/x", timeout=timeout).fetch("anyone")
    assert time.monotonic() - t0 < timeout + SLACK


def test_store_down_mid_run_gives_typed_errors_then_recovers(own_etcd: EtcdServer, agents: Callable[..., Any]) -> None:
    """etcd killed and restarted (same data dir): calls fail with MetadataStoreError within
    the timeout, registrations never hang or raise, and the changed record is published when
    etcd is back."""
    import multirail

    url = own_etcd.url("restart")
    a = agents("survivor", {"metadata": url, "metadata_ttl": 3, "timeout": 2.0})
    leaver = agents("leaver", {"metadata": url, "metadata_ttl": 3, "timeout": 2.0})  # shares a's lease
    b = agents("asker", {"metadata": url, "timeout": 2.0})
    b.fetch_remote_metadata("survivor")
    own_etcd.kill()
    t0 = time.monotonic()
    leaver.close()  # its key cannot be deleted now, and the shared lease lives on: deleted later
    assert time.monotonic() - t0 < 2 * 2.0 + SLACK
    t0 = time.monotonic()
    with pytest.raises(multirail.MetadataStoreError):
        b.fetch_remote_metadata("survivor")
    with pytest.raises(multirail.MetadataStoreError):
        b.wait_for_peer("survivor-2", timeout=1.0)
    assert time.monotonic() - t0 < 2 * 2.0 + 1.0 + SLACK
    t0 = time.monotonic()
    extra = np.full(MiB, 3, dtype=np.uint8)
    a.register_memory(extra)  # while etcd is down: no error, bounded
    assert time.monotonic() - t0 < 2.0 + SLACK
    _eventually(lambda: not a.metadata_store.status()["up"], 10, "the keep-alive thread to notice etcd is down")
    own_etcd.start()  # same ports, same data dir
    want = a.get_agent_metadata()
    _eventually(lambda: _try_fetch(url, "survivor") == want, 3 + SLACK, "the re-published record")
    _eventually(lambda: _store(url).get("leaver", timeout=2.0) is None, 3 + SLACK, "the closed agent's key deleted")
    _eventually(lambda: a.metadata_store.status()["up"], 10, "the store to be up again")
    b.fetch_remote_metadata("survivor")
    assert (_read_from(b, "survivor", int(extra.ctypes.data), MiB) == 3).all()


def _try_fetch(url: str, name: str) -> bytes | None:
    from multirail.errors import MetadataStoreError

    try:
        rec = _store(url).get(name, timeout=2.0)
    except MetadataStoreError:
        return None
    return None if rec is None else rec.metadata


def _need_grpc() -> None:
    try:
        import grpc  # noqa: F401
    except ImportError:
        pytest.skip("grpcio is not installed (pip install 'multirail[etcd-grpc]'; make setup installs it)")


def test_grpc_keepalive_keeps_lease_past_its_ttl(url: str) -> None:
    """Keep-alives travel on etcd's gRPC LeaseKeepAlive stream (same client port as the
    gateway): a 2 s lease outlives 5 s with no HTTP keep-alive at all, on one stream."""
    _need_grpc()
    from multirail.metadata import MetadataStore

    s = MetadataStore(url, ttl=2, timeout=5.0, share_lease=False)
    try:
        s.publish("grpc-kept", b"blob", incarnation=7)
        time.sleep(5.0)
        lease = s.lease
        assert lease is not None
        assert s.get("grpc-kept") is not None, "the record expired: its lease was not kept alive"
        assert lease.grpc_keepalives >= 2 and lease.keepalive_via == "grpc", \
            (lease.grpc_keepalives, lease.http_keepalives, lease.grpc_error)
        assert lease.http_keepalives == 0 and lease.grpc_failures == 0, lease.grpc_error
        assert lease._grpc is not None and lease._grpc.streams == 1
        assert lease.grants == 1
    finally:
        s.close()
    assert _store(url).get("grpc-kept") is None


def test_grpc_keepalive_failure_falls_back_to_http(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gRPC stream that fails (here: every try) costs nothing but the gRPC attempt: that
    round's keep-alive goes through the HTTP gateway, the lease lives, the stream is retried."""
    _need_grpc()
    from multirail import metadata
    from multirail.errors import MetadataStoreError

    tries: list[float] = []

    def broken(self: Any, lease_id: int, timeout: float) -> int:
        tries.append(time.monotonic())
        raise MetadataStoreError("etcd gRPC keep-alive: injected failure")

    monkeypatch.setattr(metadata.GrpcKeepAlive, "keepalive", broken)
    monkeypatch.setattr(metadata, "GRPC_RETRY_S", 1.0)
    s = metadata.MetadataStore(url, ttl=2, timeout=5.0, share_lease=False)
    try:
        s.publish("grpc-broken", b"blob", incarnation=8)
        time.sleep(5.0)
        lease = s.lease
        assert lease is not None and s.get("grpc-broken") is not None
        assert lease.http_keepalives >= 2 and lease.keepalive_via == "http" and lease.up
        assert len(tries) >= 2 and lease.grpc_failures == len(tries)  # retried, with backoff
        assert len(tries) < lease.keepalives and "injected" in (lease.grpc_error or "")
        assert lease.grants == 1
    finally:
        s.close()


def test_keepalive_schedule_is_ttl_half_on_wall_clock_slots() -> None:
    """Refreshes are due every TTL/2 on wall-clock multiples of the interval (so every
    process's keep-alives reach etcd together), never more than one interval apart; each try
    may use at most half of what is left of the lease."""
    from multirail import metadata

    lease = metadata.Lease(metadata.parse_url("etcd://127.0.0.1:1/x"), 10.0, 5.0)
    try:
        assert lease.interval == 5.0 and lease.align
        for _ in range(5):
            w, now = time.time(), time.monotonic()
            due = lease._next_due()
            assert 0 < due - now <= lease.interval + 1e-3
            slot = w + (due - now)
            assert abs(slot / lease.interval - round(slot / lease.interval)) < 1e-3, slot
            time.sleep(0.013)
        lease.align = False
        now = time.monotonic()
        assert abs(lease._next_due() - now - lease.interval) < 0.05
        lease.expires_at = time.monotonic() + 5.0  # a refresh due now: 5 s left of a 10 s lease
        assert 2.0 <= lease._budget() <= 2.5  # half of (5 s - 0.5 s margin)
        lease.expires_at = time.monotonic() + 0.6
        assert lease._budget() == 0.25  # the floor
        lease.expires_at = time.monotonic() - 1.0  # past expiry: etcd decides, full timeout
        assert lease._budget() == lease.client.timeout
    finally:
        lease.client.close()


@pytest.mark.parametrize("lost", [1, 2])
def test_lease_survives_lost_renewals(url: str, monkeypatch: pytest.MonkeyPatch, lost: int) -> None:
    """Renewing every TTL/2 leaves room for retries: `lost` refreshes in a row that hang for
    their whole budget and then fail (a lost request, a slow round trip) are retried within
    the rest of the TTL and the key never disappears."""
    from multirail import metadata
    from multirail.errors import MetadataStoreError

    real = metadata.Lease._keepalive
    budgets: list[tuple[float, float]] = []  # (budget, time left before the lease could expire)

    def flaky(self: Any, lease_id: int, budget: float | None = None) -> int:
        budgets.append((budget or 0.0, self.expires_at - time.monotonic()))
        if len(budgets) <= lost:
            time.sleep(budget or 0.0)
            raise MetadataStoreError("etcd lease keep-alive: injected loss")
        return real(self, lease_id, budget)

    monkeypatch.setattr(metadata.Lease, "_keepalive", flaky)
    ttl = 4
    s = metadata.MetadataStore(url, ttl=ttl, timeout=5.0, share_lease=False)
    checker = _store(url)
    try:
        s.publish("survivor", b"blob", incarnation=9)
        deadline = time.monotonic() + 3 * ttl
        while time.monotonic() < deadline:
            assert checker.get("survivor") is not None, f"the key expired after {lost} lost refresh(es): {budgets}"
            time.sleep(0.2)
        lease = s.lease
        assert lease is not None and lease.grants == 1, "the lease was lost and granted again"
        assert lease.failures == lost and len(budgets) > lost + 1, budgets
        for budget, left in budgets:
            assert budget <= max(0.25, left / 2) + 0.01, budgets  # a try leaves room for the next
    finally:
        s.close()


def test_lost_lease_is_regranted_and_record_republished(url: str, agents: Callable[..., Any]) -> None:
    """A lease that expired behind the agent's back (here: revoked by someone else) is noticed
    by the keep-alive thread, which grants a new one and publishes again."""
    a = agents("phoenix", {"metadata": url, "metadata_ttl": 3})
    lease = a.metadata_store.store.lease
    old = lease.lease_id
    _store(url).client.revoke(old)
    assert _store(url).get("phoenix") is None
    _eventually(lambda: _try_fetch(url, "phoenix") == a.get_agent_metadata(), 3 + SLACK, "the record back")
    assert lease.lease_id != old and lease.grants >= 2


def test_restarted_peer_is_stale_until_fetched_again(url: str, agents: Callable[..., Any], children: Any) -> None:
    import multirail

    first = children("phoenix-peer", url)
    me = agents("observer", {"metadata": url})
    me.fetch_remote_metadata("phoenix-peer")
    old_handle_dst = np.zeros(MiB, dtype=np.uint8)
    me.register_memory(old_handle_dst)
    h = me.initialize_xfer("READ", [old_handle_dst], [(first.ready["addr"], MiB, 0)], "phoenix-peer")
    me.transfer_sync(h, 20)
    first.sigkill()
    second = children("phoenix-peer", url)  # same name, new process: a new incarnation
    assert second.ready["incarnation"] != first.ready["incarnation"]
    _eventually(lambda: "phoenix-peer" in me._stale, 10 + SLACK, "the watch to see the new incarnation")
    with pytest.raises(multirail.StaleMetadataError, match="fetch its metadata again"):
        me.initialize_xfer("READ", [old_handle_dst], [(second.ready["addr"], MiB, 0)], "phoenix-peer")
    with pytest.raises(multirail.StaleMetadataError):
        me.transfer_sync(h, 5)
    with pytest.raises(multirail.StaleMetadataError):
        me.transfer(h)
    with pytest.raises(multirail.StaleMetadataError):
        me.make_connection("phoenix-peer")
    # still refused on the next try: nothing was fetched
    with pytest.raises(multirail.StaleMetadataError):
        me.send_notif("phoenix-peer", b"hello?")
    assert me.fetch_remote_metadata("phoenix-peer") == "phoenix-peer"
    assert (_read_from(me, "phoenix-peer", second.ready["addr"], MiB) == _pattern(MiB)).all()


def test_stale_from_the_engine_when_peer_restarts_on_the_same_port(url: str, agents: Callable[..., Any]) -> None:
    """Without waiting for the watch: a peer back on the same address fails the engine's own
    handshake check with StaleMetadataError, and a fetch by name fixes it."""
    import multirail

    port = free_port()
    src = _pattern(MiB).copy()
    t1 = multirail.Agent("fixed", {"metadata": url, "port": port})
    t1.register_memory(src)
    me = agents("fixed-observer", {"metadata": url})
    me.fetch_remote_metadata("fixed", "127.0.0.1", port)  # side channel: not watched in the store
    dst = np.zeros(MiB, dtype=np.uint8)
    me.register_memory(dst)
    h = me.initialize_xfer("READ", [dst], [(int(src.ctypes.data), MiB, 0)], "fixed")
    me.transfer_sync(h, 20)
    t1.close()
    t2 = agents("fixed", {"metadata": url, "port": port})
    t2.register_memory(src)
    with pytest.raises(multirail.StaleMetadataError):
        h2 = me.initialize_xfer("READ", [dst], [(int(src.ctypes.data), MiB, 0)], "fixed")
        me.transfer_sync(h2, 20)
    me.fetch_remote_metadata("fixed")
    dst[:] = 0
    h3 = me.initialize_xfer("READ", [dst], [(int(src.ctypes.data), MiB, 0)], "fixed")
    me.transfer_sync(h3, 20)
    assert (dst == src).all()


def test_threads_are_daemons_and_close_stops_them(url: str) -> None:
    import multirail

    def ours() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("multirail-etcd") and t.is_alive()]

    before = set(ours())
    a = multirail.Agent("threads-a", {"metadata": url, "metadata_ttl": 7})
    b = multirail.Agent("threads-b", {"metadata": url, "metadata_ttl": 7})
    b.fetch_remote_metadata("threads-a")  # starts b's peer watch
    new = [t for t in ours() if t not in before]
    assert new and all(t.daemon for t in new)
    a.close()
    b.close()
    _eventually(lambda: not [t for t in ours() if t not in before], 10, "the etcd threads to stop")


# ------------------------------------------------------------------ bench run

def _bench_run(etcd: EtcdServer, group: str, *extra: str) -> subprocess.Popen[str]:
    py = engine_python()
    assert py
    cmd = [py, "-m", "multirail", "bench", "run", "--etcd-endpoints", etcd.http, "--benchmark-group", group,
           "--start-block-size", "4KiB", "--max-block-size", "256KiB", "--num-iter", "5", "--warmup-iter", "1",
           *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _bench_keys(etcd: EtcdServer, group: str) -> list[bytes]:
    from multirail.metadata import EtcdClient, parse_endpoints

    c = EtcdClient(parse_endpoints(etcd.http), 5.0)
    try:
        return [k for k, _, _ in c.get_prefix(f"/multirail/bench/{group}/".encode())]
    finally:
        c.close()


def _finish(p: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate(timeout=10)
        raise AssertionError(f"bench run did not finish within {timeout:g} s: {err[-1500:]}")
    return p.returncode, out, err


def test_bench_run_two_ranks_through_etcd(etcd: EtcdServer) -> None:
    group = f"g{uuid.uuid4().hex[:6]}"
    a = _bench_run(etcd, group, "--check-consistency", "--json", "-")
    b = _bench_run(etcd, group, "--check-consistency", "--json", "-")
    ra, oa, ea = _finish(a, 180)
    rb, ob, eb = _finish(b, 180)
    assert ra == 0 and rb == 0, f"rank outputs:\n{ea[-1500:]}\n---\n{eb[-1500:]}"
    (out, err), other = ((oa, ea), eb) if "(initiator)" in ea else ((ob, eb), ea)
    assert "rank 1 of benchmark group" in err and "(initiator)" in err
    doc = json.loads(out)
    assert [r["block_size"] for r in doc["rows"]] == [4096 << i for i in range(7)]
    assert all(r["consistency"] == "ok" for r in doc["rows"])
    assert "rank 0" in other and "(target)" in other and "the initiator stopped the target" in other
    assert _bench_keys(etcd, group) == [], "ranks must leave no keys"


def test_bench_run_lone_rank_exits_nonzero_after_coord_timeout(etcd: EtcdServer) -> None:
    group = f"g{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    rc, out, err = _finish(_bench_run(etcd, group, "--coord-timeout", "2"), 90)
    assert rc == 1, err[-1500:]
    assert "no initiator (rank 1) joined benchmark group" in err and "within 2 s" in err
    assert time.monotonic() - t0 < 2 + 60  # interpreter + target start on a loaded VM
    assert _bench_keys(etcd, group) == []


def test_bench_run_killed_rank_leaves_no_keys_and_full_group_is_refused(etcd: EtcdServer) -> None:
    from multirail.metadata import acquire_lease, parse_endpoints, release_lease

    group = f"g{uuid.uuid4().hex[:6]}"
    addr = parse_endpoints(etcd.http)
    holder = acquire_lease(addr, 10, 5.0, shared=False)  # plays a rank 0 that never publishes
    try:
        assert holder.create(f"/multirail/bench/{group}/rank/0".encode(), b'{"host": "test"}')
        p = _bench_run(etcd, group, "--coord-timeout", "120", "--coord-ttl", "2")
        key = f"/multirail/bench/{group}/rank/1".encode()
        try:
            _eventually(lambda: key in _bench_keys(etcd, group), 60, "the process to claim rank 1")
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.communicate(timeout=10)
        _eventually(lambda: key not in _bench_keys(etcd, group), 2 + SLACK, "the killed rank's key to expire")
        # a group with both ranks taken refuses a third process at once
        assert holder.create(key, b'{"host": "test"}')
        rc, _, err = _finish(_bench_run(etcd, group, "--coord-timeout", "5"), 60)
        assert rc == 1 and "already has ranks 0 and 1" in err
    finally:
        release_lease(holder)
    assert _bench_keys(etcd, group) == []


_NETNS = netns_unavailable()


@pytest.mark.skipif(_NETNS is not None, reason=_NETNS or "")
def test_bench_run_across_two_network_namespaces(tmp_path: Path) -> None:
    """The same command in both testbed namespaces; etcd runs in namespace a on its rail address."""
    from multirail.testbed import Testbed

    py = engine_python()
    assert py
    group = f"ns{uuid.uuid4().hex[:6]}"
    with Testbed(f"ec{uuid.uuid4().hex[:5]}", rails=1) as tb:
        srv = EtcdServer(tmp_path / "data", host=tb.addrs("a")[0], netns=tb.ns("a"))
        try:
            cmd = [py, "-m", "multirail", "bench", "run", "--etcd-endpoints", srv.http, "--benchmark-group", group,
                   "--start-block-size", "64KiB", "--max-block-size", "1MiB", "--num-iter", "5", "--warmup-iter", "1",
                   "--check-consistency", "--json", "-", "--coord-timeout", "60"]
            procs = [subprocess.Popen(tb.exec_argv(side, cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=ENV) for side in ("a", "b")]
            results = [_finish(p, 180) for p in procs]
            assert all(rc == 0 for rc, _, _ in results), [err[-1200:] for _, _, err in results]
            out = next(o for _, o, e in results if "(initiator)" in e)
            rows = json.loads(out)["rows"]
            assert len(rows) == 5 and all(r["consistency"] == "ok" for r in rows)
            probe = ("import json, sys; sys.path.insert(0, sys.argv[3]); "
                     "from multirail.metadata import EtcdClient, parse_endpoints; "
                     "c = EtcdClient(parse_endpoints(sys.argv[1]), 5.0); "
                     "print(json.dumps([k.decode() for k, _, _ in c.get_prefix(sys.argv[2].encode())]))")
            cp = subprocess.run(srv.in_ns([py, "-c", probe, srv.http, f"/multirail/bench/{group}/",
                                           str(Path(__file__).resolve().parents[1] / "python")]),
                                capture_output=True, text=True, timeout=60, env=ENV)
            assert cp.returncode == 0 and json.loads(cp.stdout) == [], cp.stdout + cp.stderr
        finally:
            srv.stop()


def test_bench_run_usage_errors() -> None:
    py = engine_python()
    assert py
    for extra in (["--etcd-endpoints", "ftp://x:1"], ["--etcd-endpoints", "http://127.0.0.1:1", "--coord-timeout", "0"],
                  ["--etcd-endpoints", "http://127.0.0.1:1", "--benchmark-group", "a/b"]):
        cp = subprocess.run([py, "-m", "multirail", "bench", "run", *extra], capture_output=True, text=True,
                            timeout=60, env=ENV)
        assert cp.returncode == 2, (extra, cp.stderr)
    cp = subprocess.run([py, "-m", "multirail", "bench", "run", "--etcd-endpoints", f"http://127.0.0.1:{free_port()}",
                         "--coord-timeout", "2"], capture_output=True, text=True, timeout=60, env=ENV)
    assert cp.returncode == 1 and "cannot reach etcd" in cp.stderr
