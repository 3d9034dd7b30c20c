"""`multirail testbed`: emulate two hosts joined by N rails on one Linux machine.

Model
-----
A testbed named NAME is two network namespaces, ``NAME-a`` (the *target* host) and ``NAME-b``
(the *initiator* host), joined by N veth pairs, the *rails*. Rail ``i`` is its own subnet,
``<subnet_base>.<i>.0/24`` (default ``10.231.<i>.0/24``), with ``.1`` on side a (device
``NAMEr<i>a``) and ``.2`` on side b (device ``NAMEr<i>b``), MTU 9000 by default.

Each host is set up the way a rail-optimized multi-NIC host is:

* per-rail source policy routing: ``ip rule add from <rail addr> table <100+i>`` with the rail's
  subnet routed in that table, so traffic sourced from rail i leaves on rail i;
* ``arp_ignore=1``/``arp_announce=2`` (a NIC answers ARP only for its own address) and strict
  ``rp_filter=1`` (a packet arriving on the wrong rail is dropped, as on a real fabric);
* IPv6 off on the rails (no link-local chatter), ``lo`` up.

A rail may be rate limited (``--rate``/``--rates``): a tbf qdisc on *both* veth ends (the egress
of each direction) at the rail rate, with burst ``max(256 KiB, 1 ms at the rate)`` (a smaller
burst makes tbf segment GSO packets in software and costs efficiency) and a queue of
``burst + 5 ms at the rate``.

What ``up`` built is recorded in ``/run/multirail-testbed/NAME.json`` (the *spec*); ``status``
re-derives the rails from that spec and validates every one of them against the live system
(namespaces, devices, addresses, MTU, link state, qdisc rate, rules and routes), so it never
reports a rail that is not there.

``up`` with the same spec on a healthy testbed is a no-op; with a different spec, or when the
live system no longer matches (a deleted rail, a link set down, a half-built testbed), it tears
the old one down and rebuilds it. ``down`` kills processes still running inside the two
namespaces (by PID), deletes the namespaces (which deletes the veths, rules and routes in them)
and the state file; it succeeds when nothing exists.

Pretend GPUs (``--gpu-near 0,1``, issue 34): the rails listed are *near* a pretend GPU 0 and
the others near a pretend GPU 1. ``up`` writes, per side, a small sysfs-like tree
(``/run/multirail-testbed/NAME-sysfs-<side>``: the two GPUs and the side's veths as PCI NICs,
the near ones under GPU 0's PCIe switch, the far ones under GPU 1's, one NUMA node) that an
agent reads with ``MULTIRAIL_SYSFS_ROOT`` (its topology then puts GPU 0's rails in a PIX tier
and the others in a NODE tier: multirail.affinity); ``status`` names it (``topology``), and
``multirail bench --testbed`` hands it to the initiator. The stand-in GPU's device 0 is GPU 0.

Everything needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN); without it the CLI exits with code 2 and a
one-line message. Every subprocess runs with a timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path
from types import TracebackType
from typing import Any, Iterator, Literal, Sequence

from multirail.errors import MultirailError

STATE_DIR = Path("/run/multirail-testbed")
NETNS_DIR = Path("/run/netns")
DEFAULT_NAME = "mrtb"
DEFAULT_MTU = 9000
DEFAULT_SUBNET_BASE = "10.231"
MAX_RAILS = 64
TABLE_BASE = 100
RULE_PREF_BASE = 1000
IFNAMSIZ = 15  # Linux interface names are at most 15 characters.
CMD_TIMEOUT_S = 30.0
STATE_VERSION = 1

#: tbf burst floor: one GSO packet is 64 KiB; 256 KiB keeps tbf from segmenting in software.
TBF_MIN_BURST = 256 * 1024
#: tbf burst is at least this much time at the rail rate.
TBF_BURST_S = Decimal("0.001")
#: tbf queue (limit) beyond the burst, as time at the rail rate.
TBF_QUEUE_S = Decimal("0.005")
#: Rails faster than this are CPU-bound on a small VM (see docs/testbed.md).
CPU_BOUND_RATE_BPS = 4_000_000_000

Side = Literal["a", "b"]
SIDES: tuple[Side, Side] = ("a", "b")
UpAction = Literal["created", "unchanged", "rebuilt"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_RATE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([a-z]*)$")
_RATE_UNITS: dict[str, int] = {
    "": 1, "bit": 1,
    "k": 10**3, "kbit": 10**3,
    "m": 10**6, "mbit": 10**6,
    "g": 10**9, "gbit": 10**9,
    "t": 10**12, "tbit": 10**12,
}
_UNSHAPED_WORDS = ("none", "unshaped", "off")


class TestbedError(MultirailError):
    """The testbed could not be built, inspected or removed; the message says why."""

    __test__ = False  # not a pytest test class


class TestbedPermissionError(TestbedError, PermissionError):
    """The testbed needs root (network namespaces, veth, qdiscs)."""


# --------------------------------------------------------------------------- rates


def parse_rate(text: str) -> int:
    """Parse a rate such as ``2gbit``, ``500mbit``, ``1.5gbit``, ``2g`` or ``750000`` into bits/s.

    Units are decimal (k = 1000) and in *bits* per second. Byte-rate spellings (``gbps``,
    ``mb``) are refused because tc reads ``bps`` as bytes per second. Raises `TestbedError`
    (a `MultirailError`) with a clear message on anything else.
    """
    s = text.strip().lower()
    m = _RATE_RE.match(s)
    if not m:
        raise TestbedError(f"bad rate {text!r}: expected a number with an optional unit, e.g. 2gbit, 500mbit, 1.5g")
    number, unit = m.groups()
    if unit not in _RATE_UNITS:
        hint = " (tc reads 'bps' as bytes/s; write e.g. 2gbit)" if unit.endswith(("bps", "b")) else ""
        raise TestbedError(f"bad rate {text!r}: unknown unit {unit!r}{hint}; use bit, kbit, mbit, gbit, tbit or k/m/g/t")
    try:
        bps = int(Decimal(number) * _RATE_UNITS[unit])
    except InvalidOperation as e:  # pragma: no cover - the regex admits only valid decimals
        raise TestbedError(f"bad rate {text!r}") from e
    if bps < 1000:
        raise TestbedError(f"bad rate {text!r}: must be at least 1kbit")
    if bps > 100 * 10**9:
        raise TestbedError(f"bad rate {text!r}: more than 100gbit is not a rate a veth rail can be shaped to")
    return bps


def parse_rate_or_none(text: str) -> int | None:
    """Like `parse_rate`, but ``none``/``unshaped``/``off`` (or an empty string) mean unshaped."""
    if text.strip().lower() in _UNSHAPED_WORDS + ("",):
        return None
    return parse_rate(text)


def format_rate(bps: int | None) -> str:
    """Human form of a rate: ``2gbit``, ``1.5gbit``, ``500mbit``; ``unshaped`` for None."""
    if bps is None:
        return "unshaped"
    for unit, mult in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= mult:
            text = f"{Decimal(bps) / mult:f}"
            return (text.rstrip("0").rstrip(".") if "." in text else text) + unit
    return f"{bps}bit"


@dataclasses.dataclass(frozen=True)
class TbfParams:
    """What the testbed sets on each veth end of a shaped rail."""

    rate_bps: int
    burst_bytes: int
    limit_bytes: int

    @classmethod
    def for_rate(cls, rate_bps: int) -> TbfParams:
        byte_rate = Decimal(rate_bps) / 8
        burst = max(TBF_MIN_BURST, int(byte_rate * TBF_BURST_S))
        return cls(rate_bps=rate_bps, burst_bytes=burst, limit_bytes=burst + int(byte_rate * TBF_QUEUE_S))

    def tc_args(self) -> str:
        return f"tbf rate {self.rate_bps}bit burst {self.burst_bytes} limit {self.limit_bytes}"

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- rails


@dataclasses.dataclass(frozen=True)
class Rail:
    """One rail of a testbed, derived from the spec (not from the live system)."""

    index: int
    subnet: str
    rate_bps: int | None
    mtu: int
    table: int
    devs: dict[str, str]
    addrs: dict[str, str]

    @property
    def tbf(self) -> TbfParams | None:
        return None if self.rate_bps is None else TbfParams.for_rate(self.rate_bps)


# --------------------------------------------------------------------------- subprocess helpers


def _run(argv: Sequence[str], *, input: str | None = None, check: bool = True,
         timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run a command with a timeout; on failure raise `TestbedError` naming the command."""
    try:
        cp = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise TestbedError(f"{argv[0]}: command not found (install iproute2)") from e
    except subprocess.TimeoutExpired as e:
        raise TestbedError(f"timed out after {timeout:.0f}s: {' '.join(argv)}") from e
    if check and cp.returncode != 0:
        detail = (cp.stderr or cp.stdout).strip().splitlines()
        raise TestbedError(f"command failed ({cp.returncode}): {' '.join(argv)}: {' / '.join(detail) or 'no output'}")
    return cp


def _json_cmd(argv: Sequence[str]) -> list[dict[str, Any]]:
    out = _run(argv).stdout.strip()
    if not out:
        return []
    try:
        data = json.loads(out)
    except json.JSONDecodeError as e:
        raise TestbedError(f"unparsable JSON from {' '.join(argv)}: {e}") from e
    return data if isinstance(data, list) else []


def require_root() -> None:
    """Raise `TestbedPermissionError` unless running as root."""
    if os.geteuid() != 0:
        raise TestbedPermissionError(
            "the testbed needs root (network namespaces, veth pairs, qdiscs): run it with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"{tool}: command not found (install iproute2)")


def _operstate(ns: str, dev: str) -> str | None:
    links = _json_cmd(["ip", "-n", ns, "-j", "link", "show", "dev", dev])
    return links[0].get("operstate") if links else None


def netns_exists(ns: str) -> bool:
    return (NETNS_DIR / ns).exists()


def _kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM each PID, then SIGKILL the ones still alive after `grace_s`."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _pid_alive(p)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours still answers kill(0); reap it if it is ours.
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    return True


# --------------------------------------------------------------------------- the testbed


class Testbed:
    """Two namespaces joined by N rails; see the module docstring for the model.

    ``Testbed(name, rails=2, rate="2gbit")`` or ``Testbed(name, rates=["2gbit", "1gbit"])``
    describes a testbed; `up` builds it, `down` removes it, `status` reads it back from the
    live system. ``with Testbed(...) as tb:`` ups it and always downs it.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, name: str = DEFAULT_NAME, rails: int | None = None,
                 rates: Sequence[int | str | None] | None = None, rate: int | str | None = None,
                 mtu: int = DEFAULT_MTU, subnet_base: str = DEFAULT_SUBNET_BASE,
                 gpu_near: Sequence[int] | None = None) -> None:
        if rates is not None and rate is not None:
            raise TestbedError("give either rate (one rate for every rail) or rates (one per rail), not both")
        if rates is not None:
            if rails is not None and rails != len(rates):
                raise TestbedError(f"{rails} rails but {len(rates)} rates given")
            rails = len(rates)
        n = 2 if rails is None else rails
        if not isinstance(n, int) or not 1 <= n <= MAX_RAILS:
            raise TestbedError(f"rails must be between 1 and {MAX_RAILS}, got {rails!r}")
        self.name = _validate_name(name, n)
        self.n_rails = n
        source = list(rates) if rates is not None else [rate] * n
        self.rates: list[int | None] = [_to_rate(r) for r in source]
        if not isinstance(mtu, int) or not 576 <= mtu <= 65535:
            raise TestbedError(f"mtu must be between 576 and 65535, got {mtu!r}")
        self.mtu = mtu
        self.subnet_base = _validate_subnet_base(subnet_base)
        self.gpu_near = _validate_gpu_near(gpu_near, n)

    # ---- description

    def spec(self) -> dict[str, Any]:
        """What `up` builds; stored in the state file and compared on the next `up`."""
        spec: dict[str, Any] = {"rails": self.n_rails, "rates": list(self.rates), "mtu": self.mtu,
                                "subnet_base": self.subnet_base}
        if self.gpu_near is not None:
            spec["gpu_near"] = list(self.gpu_near)
        return spec

    def sysfs_root(self, side: str) -> Path:
        """The sysfs-like tree of `side` (with ``gpu_near``): an agent's MULTIRAIL_SYSFS_ROOT."""
        self.ns(side)
        return STATE_DIR / f"{self.name}-sysfs-{side}"

    @property
    def rails(self) -> list[Rail]:
        out = []
        for i, rate in enumerate(self.rates):
            net = f"{self.subnet_base}.{i}"
            out.append(Rail(index=i, subnet=f"{net}.0/24", rate_bps=rate, mtu=self.mtu, table=TABLE_BASE + i,
                            devs={s: f"{self.name}r{i}{s}" for s in SIDES},
                            addrs={"a": f"{net}.1", "b": f"{net}.2"}))
        return out

    def ns(self, side: str) -> str:
        """Namespace of a side: ``"a"`` (target) or ``"b"`` (initiator)."""
        if side not in SIDES:
            raise TestbedError(f"side must be 'a' or 'b', got {side!r}")
        return f"{self.name}-{side}"

    def addrs(self, side: str) -> list[str]:
        """The rail addresses of one side, rail 0 first."""
        self.ns(side)
        return [r.addrs[side] for r in self.rails]

    def exec_argv(self, side: str, argv: Sequence[str]) -> list[str]:
        """`argv` prefixed so that it runs inside the namespace of `side`."""
        return ["ip", "netns", "exec", self.ns(side), *argv]

    @property
    def state_path(self) -> Path:
        return STATE_DIR / f"{self.name}.json"

    def __repr__(self) -> str:
        rates = ",".join(format_rate(r) for r in self.rates)
        return f"Testbed(name={self.name!r}, rails={self.n_rails}, rates=[{rates}], mtu={self.mtu})"

    # ---- loading

    @classmethod
    def load(cls, name: str = DEFAULT_NAME) -> Testbed | None:
        """The testbed recorded under `name`, or None when there is no state file."""
        path = STATE_DIR / f"{name}.json"
        try:
            raw = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TestbedError(f"cannot read {path}: {e}") from e
        try:
            st = json.loads(raw)
            if st.get("version") != STATE_VERSION or st.get("name") != name:
                raise ValueError("unknown version or wrong name")
            spec = st["spec"]
            return cls(name=name, rates=spec["rates"], mtu=spec["mtu"], subnet_base=spec["subnet_base"],
                       gpu_near=spec.get("gpu_near"))
        except (ValueError, KeyError, TypeError, TestbedError) as e:
            raise TestbedError(f"corrupt state file {path} ({e}); remove it with `multirail testbed down --name {name}`") from e

    # ---- lifecycle

    def up(self) -> UpAction:
        """Build the testbed. A no-op on a healthy testbed with the same spec; otherwise any
        previous testbed of this name (another spec, or a damaged or half-built one) is torn
        down and rebuilt. On failure everything created is removed and `TestbedError` raised."""
        require_root()
        with self._lock():
            existing = _read_state(self.state_path)
            leftovers = existing is not None or any(netns_exists(self.ns(s)) for s in SIDES)
            if existing is not None and existing.get("spec") == self.spec() and not self._problems():
                return "unchanged"
            if leftovers:
                self._teardown()
            try:
                self._build()
            except BaseException:
                self._teardown()
                raise
            return "rebuilt" if leftovers else "created"

    def down(self) -> bool:
        """Remove the testbed; True when something was removed. Succeeds when nothing exists."""
        require_root()
        with self._lock():
            return self._teardown()

    def set_link(self, rail: int, up: bool, side: str = "a") -> None:
        """Set one end of a rail administratively down or up (for failover tests).

        Bringing it back up also restores the rail's policy routes, which the kernel flushes
        when a device goes down."""
        require_root()
        r = self._rail(rail)
        _run(["ip", "-n", self.ns(side), "link", "set", "dev", r.devs[side], "up" if up else "down"])
        if up:
            for s in SIDES:
                _run(["ip", "-n", self.ns(s), "route", "replace", r.subnet, "dev", r.devs[s],
                      "src", r.addrs[s], "table", str(r.table)])
        self._wait_operstate([r], up)

    def set_blackhole(self, rail: int, on: bool, side: str = "a") -> None:
        """Silently drop everything `side` sends to the other side's address on this rail (an
        `ip rule ... blackhole`), or stop doing so. Unlike `set_link`, both ends keep carrier:
        this is a path that fails without telling anyone (a dead switch port upstream, a
        misprogrammed route), which only a stall timeout can detect."""
        require_root()
        r = self._rail(rail)
        other = "b" if side == "a" else "a"
        rule = ["rule", "to", f"{r.addrs[other]}/32", "pref", str(RULE_PREF_BASE - 100 + r.index), "blackhole"]
        if on:
            _run(["ip", "-n", self.ns(side), "rule", "del", *rule[1:]], check=False)
            _run(["ip", "-n", self.ns(side), "rule", "add", *rule[1:]])
        else:
            _run(["ip", "-n", self.ns(side), "rule", "del", *rule[1:]], check=False)

    def delete_rail(self, rail: int) -> None:
        """Delete a rail's veth pair and its policy rules: the rail is gone for good (until the
        next `up`, which rebuilds the testbed because it no longer matches its spec)."""
        require_root()
        r = self._rail(rail)
        _run(["ip", "-n", self.ns("a"), "link", "del", "dev", r.devs["a"]])
        for s in SIDES:
            _run(["ip", "-n", self.ns(s), "rule", "del", "pref", str(RULE_PREF_BASE + r.index)], check=False)

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.down()

    # ---- status

    def status(self) -> dict[str, Any]:
        """The recorded testbed, validated against the live system (the `status --json` shape).

        ``up`` is true when the state file and both namespaces exist; ``problems`` lists every
        way the live system differs from the spec (empty on a healthy testbed)."""
        require_root()
        return self._status()

    def _status(self) -> dict[str, Any]:
        namespaces = {s: self.ns(s) for s in SIDES}
        state = _read_state(self.state_path)
        ns_ok = {s: netns_exists(ns) for s, ns in namespaces.items()}
        base: dict[str, Any] = {"name": self.name, "up": False, "namespaces": namespaces,
                                "state_file": str(self.state_path)}
        if state is None:
            stale = [ns for s, ns in namespaces.items() if ns_ok[s]]
            problems = [f"namespace {ns} exists but no testbed state: run `multirail testbed down --name {self.name}`"
                        for ns in stale]
            return {**base, "rails": [], "problems": problems}
        live = {s: _LiveNs.read(ns) if ns_ok[s] else _LiveNs.empty() for s, ns in namespaces.items()}
        problems = [f"namespace {ns} is missing" for s, ns in namespaces.items() if not ns_ok[s]]
        rails = []
        for r in self.rails:
            entry: dict[str, Any] = {"index": r.index, "subnet": r.subnet, "rate_bps": r.rate_bps, "mtu": r.mtu,
                                     "table": r.table, "tbf": r.tbf.as_dict() if r.tbf else None}
            for s in SIDES:
                side, side_problems = live[s].check_rail(r, s, namespaces[s])
                entry[s] = side
                problems.extend(side_problems)
            entry["present"] = entry["a"]["exists"] and entry["b"]["exists"]
            if self.gpu_near is not None:
                entry["gpu"] = 0 if r.index in self.gpu_near else 1
            rails.append(entry)
        out = {**base, "up": all(ns_ok.values()), "rails": rails, "problems": problems}
        if self.gpu_near is not None:
            out["topology"] = {"gpu_near": list(self.gpu_near), "sysfs": {s: str(self.sysfs_root(s)) for s in SIDES}}
            problems.extend(f"topology fixture {self.sysfs_root(s)} is missing" for s in SIDES
                            if not (self.sysfs_root(s) / "bus" / "pci" / "devices").is_dir())
        return out

    def _problems(self) -> list[str]:
        return list(self._status()["problems"])

    # ---- internals

    def _rail(self, rail: int) -> Rail:
        if not 0 <= rail < self.n_rails:
            raise TestbedError(f"no rail {rail}: testbed {self.name} has rails 0..{self.n_rails - 1}")
        return self.rails[rail]

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        # Lock the state directory itself, so that no lock file is left behind.
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _build(self) -> None:
        for s in SIDES:
            _run(["ip", "netns", "add", self.ns(s)])
            _run(["ip", "netns", "exec", self.ns(s), "sysctl", "-q", "-w", *_HOST_SYSCTLS])
        rails = self.rails
        _run(["ip", "-batch", "-"], input="".join(
            f"link add {r.devs['a']} netns {self.ns('a')} type veth peer name {r.devs['b']} netns {self.ns('b')}\n"
            for r in rails))
        for s in SIDES:
            ip_cmds = ["link set dev lo up"]
            tc_cmds = []
            for r in rails:
                dev, addr = r.devs[s], r.addrs[s]
                ip_cmds += [f"link set dev {dev} mtu {r.mtu} up",
                            f"addr add {addr}/24 dev {dev}",
                            f"rule add from {addr} table {r.table} pref {RULE_PREF_BASE + r.index}",
                            f"route add {r.subnet} dev {dev} src {addr} table {r.table}"]
                if r.tbf is not None:
                    tc_cmds.append(f"qdisc replace dev {dev} root {r.tbf.tc_args()}")
            _run(["ip", "-n", self.ns(s), "-batch", "-"], input="\n".join(ip_cmds) + "\n")
            if tc_cmds:
                _run(["tc", "-n", self.ns(s), "-batch", "-"], input="\n".join(tc_cmds) + "\n")
        self._wait_operstate(rails, True)
        if self.gpu_near is not None:
            for s in SIDES:
                write_topology_fixture(self.sysfs_root(s), [r.devs[s] for r in rails], self.gpu_near)
        _write_state(self.state_path, {"version": STATE_VERSION, "name": self.name, "spec": self.spec(),
                                       "created_unix": int(time.time())})

    def _wait_operstate(self, rails: list[Rail], up: bool, timeout_s: float = 3.0) -> None:
        """Wait until the kernel reports every end of `rails` as operationally up (or not up).

        Carrier changes reach the peer's operstate asynchronously (linkwatch), so without this
        a `status` right after `up` or `set_link` could see the previous state."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [_operstate(self.ns(s), r.devs[s]) == "UP" for r in rails for s in SIDES]
            if all(st == up for st in states):
                return
            if time.monotonic() > deadline:
                raise TestbedError(f"rails {[r.index for r in rails]} of {self.name} did not come "
                                   f"{'up' if up else 'down'} within {timeout_s:.0f}s")
            time.sleep(0.02)

    def _teardown(self) -> bool:
        removed = False
        for s in SIDES:
            ns = self.ns(s)
            if not netns_exists(ns):
                continue
            pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
            _kill_pids([p for p in pids if p != os.getpid()])
            _run(["ip", "netns", "del", ns])
            removed = True
        for s in SIDES:
            if self.sysfs_root(s).exists():
                shutil.rmtree(self.sysfs_root(s), ignore_errors=True)
        if self.state_path.exists():
            self.state_path.unlink()
            removed = True
        return removed


# sysctls of each emulated host: ARP only for the NIC's own address, strict reverse-path filter
# (per-rail policy routing makes it pass for correct traffic), no IPv6 on the rails.
_HOST_SYSCTLS = [
    f"net.ipv4.conf.{scope}.{key}={val}"
    for scope in ("all", "default")
    for key, val in (("arp_ignore", 1), ("arp_announce", 2), ("rp_filter", 1))
] + ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]


@dataclasses.dataclass
class _LiveNs:
    """What one namespace looks like right now (one `ip`/`tc` call per table)."""

    links: dict[str, dict[str, Any]]
    qdiscs: dict[str, dict[str, Any]]
    rules: list[dict[str, Any]]
    routes: list[dict[str, Any]]

    @classmethod
    def empty(cls) -> _LiveNs:
        return cls({}, {}, [], [])

    @classmethod
    def read(cls, ns: str) -> _LiveNs:
        links = {l["ifname"]: l for l in _json_cmd(["ip", "-n", ns, "-j", "addr", "show"])}
        qdiscs = {q.get("dev", ""): q for q in _json_cmd(["tc", "-n", ns, "-j", "qdisc", "show"]) if q.get("root")}
        return cls(links, qdiscs, _json_cmd(["ip", "-n", ns, "-j", "rule", "show"]),
                   _json_cmd(["ip", "-n", ns, "-j", "route", "show", "table", "all"]))

    def check_rail(self, r: Rail, side: str, ns: str) -> tuple[dict[str, Any], list[str]]:
        dev, addr = r.devs[side], r.addrs[side]
        link = self.links.get(dev)
        out: dict[str, Any] = {"dev": dev, "addr": addr, "exists": link is not None, "link_up": False,
                               "admin_up": False, "live_mtu": None, "live_rate_bps": None}
        where = f"rail {r.index} side {side} ({dev} in {ns})"
        if link is None:
            return out, [f"{where}: device missing"]
        problems = []
        flags = link.get("flags", [])
        out.update(admin_up="UP" in flags, link_up=link.get("operstate") == "UP", live_mtu=link.get("mtu"))
        if not out["admin_up"]:
            problems.append(f"{where}: link is administratively down")
        elif not out["link_up"]:
            problems.append(f"{where}: no carrier (operstate {link.get('operstate')})")
        if link.get("mtu") != r.mtu:
            problems.append(f"{where}: mtu {link.get('mtu')} != {r.mtu}")
        if not any(a.get("family") == "inet" and a.get("local") == addr and a.get("prefixlen") == 24
                   for a in link.get("addr_info", [])):
            problems.append(f"{where}: address {addr}/24 missing")
        q = self.qdiscs.get(dev, {})
        if q.get("kind") == "tbf":
            out["live_rate_bps"] = int(q.get("options", {}).get("rate", 0)) * 8
        if r.rate_bps is not None and (out["live_rate_bps"] is None
                                       or abs(out["live_rate_bps"] - r.rate_bps) > r.rate_bps // 100):
            problems.append(f"{where}: tbf rate {format_rate(out['live_rate_bps'])} != {format_rate(r.rate_bps)}")
        if r.rate_bps is None and out["live_rate_bps"] is not None:
            problems.append(f"{where}: shaped to {format_rate(out['live_rate_bps'])} but should be unshaped")
        if not any(str(x.get("src")) == addr and str(x.get("table")) == str(r.table) for x in self.rules):
            problems.append(f"{where}: policy rule 'from {addr} table {r.table}' missing")
        if not any(x.get("dst") == r.subnet and x.get("dev") == dev and str(x.get("table")) == str(r.table)
                   for x in self.routes):
            problems.append(f"{where}: route {r.subnet} dev {dev} in table {r.table} missing")
        return out, problems


def _to_rate(r: int | str | None) -> int | None:
    if r is None:
        return None
    if isinstance(r, bool):
        raise TestbedError(f"bad rate {r!r}")
    if isinstance(r, int):
        if r < 1000:
            raise TestbedError(f"bad rate {r}: must be at least 1000 bit/s")
        return r
    if isinstance(r, str):
        return parse_rate_or_none(r)
    raise TestbedError(f"bad rate {r!r}: expected bits/s or a string such as 2gbit")


def _validate_name(name: str, n_rails: int) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise TestbedError(f"bad testbed name {name!r}: use letters, digits, '_' and '-', starting with a letter or digit")
    longest = len(f"{name}r{n_rails - 1}a")
    if longest > IFNAMSIZ:
        max_len = IFNAMSIZ - len(f"r{n_rails - 1}a")
        raise TestbedError(f"testbed name {name!r} too long: interface {name}r{n_rails - 1}a would exceed "
                           f"{IFNAMSIZ} characters; use at most {max_len} characters for {n_rails} rails")
    return name


def _validate_subnet_base(base: str) -> str:
    parts = base.split(".") if isinstance(base, str) else []
    if len(parts) != 2 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts) or int(parts[0]) == 0:
        raise TestbedError(f"bad subnet base {base!r}: expected two octets such as 10.231 (rail i gets <base>.i.0/24)")
    return ".".join(str(int(p)) for p in parts)


def _validate_gpu_near(near: Sequence[int] | None, n_rails: int) -> list[int] | None:
    if near is None:
        return None
    try:
        out = sorted({int(i) for i in near})
    except (TypeError, ValueError):
        raise TestbedError(f"gpu_near must list rail indices, got {near!r}") from None
    if not out or any(not 0 <= i < n_rails for i in out):
        raise TestbedError(f"gpu_near must list rail indices 0..{n_rails - 1}, got {list(near)!r}")
    return out


def write_topology_fixture(root: Path, devs: Sequence[str], near: Sequence[int]) -> None:
    """A sysfs-like tree (what multirail.topology reads) for one emulated host: pretend GPU 0
    (0000:12:00.0) behind a PCIe switch on root bus 10 with the rails in `near` as NICs on the
    same switch (PIX), pretend GPU 1 (0000:22:00.0) likewise on root bus 20 with the others; one
    NUMA node with every CPU of this machine. NIC i is PCI function 0000:<bus>:00.0 whose netdev
    is devs[i] (the veth in the side's namespace). Links are relative, so realpath works."""
    if root.exists():
        shutil.rmtree(root)
    cpus = f"0-{(os.cpu_count() or 1) - 1}"
    devices = root / "devices"
    groups = {0: [i for i in range(len(devs)) if i in near], 1: [i for i in range(len(devs)) if i not in near]}

    def pci(path: Path, vendor: str, device: str, cls: str) -> None:
        path.mkdir(parents=True)
        for k, v in (("vendor", vendor), ("device", device), ("class", cls), ("numa_node", "0"),
                     ("local_cpulist", cpus), ("current_link_width", "16"), ("max_link_width", "16"),
                     ("current_link_speed", "32.0 GT/s PCIe"), ("max_link_speed", "32.0 GT/s PCIe")):
            (path / k).write_text(v + "\n")
        link = root / "bus" / "pci" / "devices" / path.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(path, link.parent))

    for g, rails in groups.items():
        bus = 0x10 + 0x40 * g
        usp = devices / f"pci0000:{bus:02x}" / f"0000:{bus:02x}:00.0"
        pci(usp, "0x1000", "0xc030", "0x060400")
        dsp = usp / f"0000:{bus + 1:02x}:00.0"
        pci(dsp, "0x1000", "0xc030", "0x060400")
        pci(dsp / f"0000:{bus + 2:02x}:00.0", "0x10de", "0x2330", "0x030200")
        for k, i in enumerate(rails):
            port = usp / f"0000:{bus + 1:02x}:{k + 1:02x}.0"
            pci(port, "0x1000", "0xc030", "0x060400")
            nic = port / f"0000:{bus + 3 + k:02x}:00.0"
            pci(nic, "0x8086", "0x1592", "0x020000")
            net = root / "class" / "net" / devs[i]
            net.mkdir(parents=True)
            (net / "speed").write_text("10000\n")
            (net / "device").symlink_to(os.path.relpath(nic, net))
    node = devices / "system" / "node" / "node0"
    node.mkdir(parents=True)
    (node / "cpulist").write_text(cpus + "\n")


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return {}  # present but unreadable: treated as a mismatch, so `up` rebuilds
    return data if isinstance(data, dict) else {}


def _write_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> None:
    """Add ``testbed up|down|status`` to the ``multirail`` command line."""
    p = subparsers.add_parser("testbed", help="two namespaces joined by N rate-limited rails (needs root)",
                              description="Emulate two hosts joined by N rails (veth pairs) in network namespaces.")
    _add_testbed_commands(p)


def _add_testbed_commands(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="testbed_command", metavar="{up,down,status}")
    sub.required = True
    up = sub.add_parser("up", help="build the testbed (no-op if it already matches)")
    _add_name(up)
    up.add_argument("--rails", type=int, default=None, help="number of rails (default 2, or the number of --rates)")
    rates = up.add_mutually_exclusive_group()
    rates.add_argument("--rate", default=None, help="one rate for every rail: 2gbit, 500mbit, 1.5g or none (default)")
    rates.add_argument("--rates", default=None, help="comma-separated rate per rail, e.g. 2gbit,1gbit")
    up.add_argument("--mtu", type=int, default=DEFAULT_MTU, help=f"MTU of every rail (default {DEFAULT_MTU})")
    up.add_argument("--subnet-base", default=DEFAULT_SUBNET_BASE,
                    help=f"first two octets of the rail subnets (default {DEFAULT_SUBNET_BASE}: rail i is <base>.i.0/24)")
    up.add_argument("--gpu-near", default=None, metavar="I,J",
                    help="tag rails I,J as near a pretend GPU 0 (the others near a pretend GPU 1): writes a "
                         "sysfs-like tree per side for MULTIRAIL_SYSFS_ROOT (docs/testbed.md)")
    up.add_argument("--json", action="store_true", help="print the status as JSON")
    up.set_defaults(func=_cmd_up)
    down = sub.add_parser("down", help="remove the testbed (succeeds when none exists)")
    _add_name(down)
    down.set_defaults(func=_cmd_down)
    st = sub.add_parser("status", help="show the testbed, validated against the live system")
    _add_name(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=_cmd_status)


def _add_name(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=DEFAULT_NAME, help=f"testbed name (default {DEFAULT_NAME})")


def _guard(fn: Any) -> Any:
    """Turn testbed errors into a one-line message and an exit code (2 for missing root)."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except TestbedPermissionError as e:
            print(f"multirail testbed: {e}", file=sys.stderr)
            return 2
        except TestbedError as e:
            print(f"multirail testbed: error: {e}", file=sys.stderr)
            return 1

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@_guard
def _cmd_up(args: argparse.Namespace) -> int:
    require_root()
    near = None
    if args.gpu_near is not None:
        try:
            near = [int(x) for x in args.gpu_near.split(",") if x.strip()]
        except ValueError:
            raise TestbedError(f"--gpu-near takes rail indices like 0,1, not {args.gpu_near!r}") from None
    if args.rates is not None:
        tb = Testbed(args.name, rails=args.rails, rates=[r for r in args.rates.split(",")], mtu=args.mtu,
                     subnet_base=args.subnet_base, gpu_near=near)
    else:
        tb = Testbed(args.name, rails=args.rails, rate=args.rate, mtu=args.mtu, subnet_base=args.subnet_base,
                     gpu_near=near)
    action = tb.up()
    st = tb.status()
    if args.json:
        print(json.dumps({**st, "action": action}, indent=2))
    else:
        print({"created": f"testbed {tb.name} created",
               "unchanged": f"testbed {tb.name} already up with this spec: nothing to do",
               "rebuilt": f"testbed {tb.name} rebuilt (it had another spec or was damaged)"}[action])
        print(_format_status(st))
    if any(r is not None and r > CPU_BOUND_RATE_BPS for r in tb.rates):
        print("note: rails above 4gbit are CPU-bound on a small machine; results will not track the rate",
              file=sys.stderr)
    return 0 if not st["problems"] else 1


@_guard
def _cmd_down(args: argparse.Namespace) -> int:
    removed = Testbed(args.name, rails=1).down()
    print(f"testbed {args.name} removed" if removed else f"testbed {args.name}: nothing to remove")
    return 0


@_guard
def _cmd_status(args: argparse.Namespace) -> int:
    require_root()
    tb = Testbed.load(args.name)
    st = (tb or Testbed(_validate_name(args.name, 1), rails=1))._status()
    if tb is None:
        st["rails"] = []
    print(json.dumps(st, indent=2) if args.json else _format_status(st))
    return 0 if st["up"] and not st["problems"] else 1


def _format_status(st: dict[str, Any]) -> str:
    if not st["up"] and not st["rails"]:
        lines = [f"testbed {st['name']}: down"]
    else:
        ns = st["namespaces"]
        lines = [f"testbed {st['name']}: {'up' if st['up'] else 'DAMAGED'}  (a = {ns['a']} target, b = {ns['b']} initiator)",
                 f"{'rail':>4}  {'subnet':<18} {'rate':>9}  {'mtu':>5}  {'a dev/addr':<26} {'b dev/addr':<26} link a/b"]
        for r in st["rails"]:
            a, b = r["a"], r["b"]
            lines.append(f"{r['index']:>4}  {r['subnet']:<18} {format_rate(r['rate_bps']):>9}  {r['mtu']:>5}  "
                         f"{a['dev'] + ' ' + a['addr']:<26} {b['dev'] + ' ' + b['addr']:<26} "
                         f"{_updown(a)}/{_updown(b)}")
        tbfs = {(r["rate_bps"], r["tbf"]["burst_bytes"], r["tbf"]["limit_bytes"]) for r in st["rails"] if r["tbf"]}
        for rate, burst, limit in sorted(tbfs):
            lines.append(f"tbf {format_rate(rate)} on both veth ends: burst {burst} B, limit {limit} B")
    lines += [f"problem: {p}" for p in st["problems"]]
    return "\n".join(lines)


def _updown(side: dict[str, Any]) -> str:
    return "missing" if not side["exists"] else ("up" if side["link_up"] else "down")


def main(argv: list[str] | None = None) -> int:
    """``python -m multirail.testbed up|down|status ...`` (same as ``multirail testbed ...``)."""
    p = argparse.ArgumentParser(prog="multirail testbed", description="Emulate two hosts joined by N rails.")
    _add_testbed_commands(p)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
