"""Read-only facts about this host's network interfaces, RDMA devices and counters.

Model
-----
Everything here is *read*, never changed. Facts come from two kinds of source:

* **The kernel's files** (/sys and /proc). Every such read goes through :class:`SysFS`, which
  prefixes a root directory. With ``root="/"`` it reads the live host; with ``root=DIR`` it
  reads a fixture tree laid out like the real one (``DIR/sys/class/net/...``), so every
  consumer (``multirail doctor``, ``multirail bench``) can be tested offline.
* **Commands** (``ip -j addr show``, ``ip -j rule show``, ``ucx_info -v``, ``ping`` ...). Every
  command goes through a :class:`Probe`. :class:`LiveProbe` runs it with a timeout;
  :class:`RecordedProbe` replays ``DIR/.cmd/<name>.out`` (stdout), ``<name>.rc`` (exit code,
  default 0) and ``<name>.err`` (stderr) where ``<name>`` is :func:`cmd_key` of the argv.
  :func:`make_probe` picks the recorded probe whenever ``root`` is not ``/``.

Sysfs is preferred to commands wherever the kernel exposes the same fact (carrier, MTU, master,
RDMA mapping, counters); only IPv4 addresses come from ``ip -j addr show``.

Reading counters of an interface that lives in another network namespace requires running
inside that namespace (``ip netns exec`` remounts /sys); callers handle that.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

__all__ = [
    "SysFS",
    "CmdResult",
    "Probe",
    "LiveProbe",
    "RecordedProbe",
    "cmd_key",
    "make_probe",
    "Interface",
    "interfaces",
    "interface_for_addr",
    "Counters",
    "read_counters",
    "rdma_devices",
    "ipv4_addresses",
]

# ---------------------------------------------------------------------------------------------
# /sys and /proc


class SysFS:
    """All /sys and /proc reads, prefixed with ``root`` (``/`` for the live host)."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)

    def path(self, abs_path: str) -> Path:
        """Map an absolute kernel path (``/sys/...``) into the root."""
        return self.root / abs_path.lstrip("/")

    def read(self, abs_path: str) -> str | None:
        """File contents stripped, or None when missing or unreadable (EINVAL on sysfs too)."""
        try:
            return self.path(abs_path).read_text(errors="replace").strip()
        except (OSError, ValueError):
            return None

    def read_int(self, abs_path: str) -> int | None:
        text = self.read(abs_path)
        if text is None:
            return None
        try:
            return int(text.split()[0], 0) if text else None
        except ValueError:
            return None

    def exists(self, abs_path: str) -> bool:
        return os.path.lexists(self.path(abs_path))

    def listdir(self, abs_path: str) -> list[str]:
        """Sorted entries of a directory, [] when missing."""
        try:
            return sorted(os.listdir(self.path(abs_path)))
        except OSError:
            return []

    def link_name(self, abs_path: str) -> str | None:
        """Basename a sysfs link points at (``master -> ../bond0`` gives ``bond0``).

        Fixture trees may store the target as a symlink, a directory or a one-line file."""
        p = self.path(abs_path)
        try:
            if p.is_symlink():
                return os.path.basename(os.readlink(p).rstrip("/")) or None
            if p.is_file():
                return p.read_text().strip() or None
            if p.is_dir():
                return p.resolve().name
        except OSError:
            return None
        return None


# ---------------------------------------------------------------------------------------------
# Commands


@dataclass(frozen=True)
class CmdResult:
    """Outcome of one command. ``missing`` means the program is not installed (or, for a
    recorded probe, the output was not recorded); rc is then 127."""

    argv: tuple[str, ...]
    rc: int
    stdout: str
    stderr: str = ""
    missing: bool = False

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.missing

    @property
    def text(self) -> str:
        return " ".join(self.argv)


class Probe(Protocol):
    """Runs a command (argv, no shell) and returns its result; never raises for failures."""

    def run(self, argv: Sequence[str], timeout: float = 5.0) -> CmdResult: ...


class LiveProbe:
    """Runs commands on this host with a timeout (rc 124 on timeout, 127 when missing)."""

    def run(self, argv: Sequence[str], timeout: float = 5.0) -> CmdResult:
        args = tuple(argv)
        try:
            cp = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError:
            return CmdResult(args, 127, "", f"{args[0]}: command not found", missing=True)
        except PermissionError as e:
            return CmdResult(args, 126, "", str(e))
        except subprocess.TimeoutExpired:
            return CmdResult(args, 124, "", f"timed out after {timeout:g} s")
        return CmdResult(args, cp.returncode, cp.stdout, cp.stderr)


_KEY_RE = re.compile(r"[^A-Za-z0-9._-]")


def cmd_key(argv: Sequence[str]) -> str:
    """File name under ``.cmd/`` for a recorded command: argv joined by ``_``, every character
    outside ``[A-Za-z0-9._-]`` replaced by ``_`` (``ip -j addr show`` -> ``ip_-j_addr_show``)."""
    return _KEY_RE.sub("_", "_".join(argv))


class RecordedProbe:
    """Replays command outputs recorded in ``<root>/.cmd/`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.dir = Path(root) / ".cmd"

    def run(self, argv: Sequence[str], timeout: float = 5.0) -> CmdResult:
        args = tuple(argv)
        key = cmd_key(args)
        out = self.dir / f"{key}.out"
        if not out.is_file():
            return CmdResult(args, 127, "", f"{args[0]}: not recorded ({out})", missing=True)
        rc_file, err_file = self.dir / f"{key}.rc", self.dir / f"{key}.err"
        rc_text = rc_file.read_text().strip() if rc_file.is_file() else "0"
        rc = int(rc_text) if re.fullmatch(r"-?\d+", rc_text) else 1  # garbage: treat as a failure
        err = err_file.read_text() if err_file.is_file() else ""
        return CmdResult(args, rc, out.read_text(), err)


def make_probe(root: str | os.PathLike[str] = "/") -> Probe:
    """Live commands for the real root, recorded outputs for a fixture tree."""
    return LiveProbe() if Path(root).resolve() == Path("/") else RecordedProbe(root)


# ---------------------------------------------------------------------------------------------
# Interfaces


@dataclass
class Interface:
    name: str
    ipv4: list[tuple[str, int]]  # (address, prefix length)
    mtu: int
    speed_mbps: int | None  # /sys/class/net/<if>/speed, None when unknown or -1
    numa_node: int | None
    oper_up: bool  # operstate == "up" (or "unknown" with carrier, for veth/lo)
    carrier: bool | None
    rdma_dev: str | None  # e.g. "mlx5_0"
    rdma_port: int | None
    master: str | None  # bond/bridge master, from /sys/class/net/<if>/master

    def networks(self) -> list[ipaddress.IPv4Network]:
        return [ipaddress.IPv4Network(f"{a}/{p}", strict=False) for a, p in self.ipv4]


def ipv4_addresses(probe: Probe) -> dict[str, list[tuple[str, int]]]:
    """ifname -> [(address, prefixlen)] from ``ip -j addr show``; {} when ip is unusable."""
    res = probe.run(["ip", "-j", "addr", "show"])
    if not res.ok:
        return {}
    try:
        data = json.loads(res.stdout or "[]")
    except json.JSONDecodeError:
        return {}
    out: dict[str, list[tuple[str, int]]] = {}
    for link in data if isinstance(data, list) else []:
        name = link.get("ifname")
        if not isinstance(name, str):
            continue
        addrs = out.setdefault(name, [])
        for a in link.get("addr_info", []) or []:
            if a.get("family") == "inet" and "local" in a:
                try:
                    addrs.append((str(ipaddress.IPv4Address(a["local"])), int(a.get("prefixlen", 32))))
                except (ValueError, TypeError):
                    continue  # malformed entry: ignore rather than guess
    return out


def rdma_devices(sysfs: SysFS) -> list[str]:
    """Names under /sys/class/infiniband."""
    return sysfs.listdir("/sys/class/infiniband")


def _rdma_for_netdev(sysfs: SysFS, ifname: str) -> tuple[str | None, int | None]:
    """(device, port) behind a netdev, the way ibdev2netdev finds it.

    1. /sys/class/net/<if>/device/infiniband/<dev> (the PCI function's RDMA device), or
       /sys/class/infiniband/<dev>/device/net/<if> (the reverse link);
    2. the port is the one whose GID table names <if> as ndev; else the only port; else
       dev_port + 1."""
    dev: str | None = None
    devs = sysfs.listdir(f"/sys/class/net/{ifname}/device/infiniband")
    if devs:
        dev = devs[0]
    else:
        for d in rdma_devices(sysfs):
            if ifname in sysfs.listdir(f"/sys/class/infiniband/{d}/device/net"):
                dev = d
                break
    if dev is None:
        return None, None
    ports = [p for p in sysfs.listdir(f"/sys/class/infiniband/{dev}/ports") if p.isdigit()]
    for p in ports:
        ndir = f"/sys/class/infiniband/{dev}/ports/{p}/gid_attrs/ndevs"
        if any(sysfs.read(f"{ndir}/{i}") == ifname for i in sysfs.listdir(ndir)):
            return dev, int(p)
    if len(ports) == 1:
        return dev, int(ports[0])
    dev_port = sysfs.read_int(f"/sys/class/net/{ifname}/dev_port")
    return dev, (dev_port + 1 if dev_port is not None else None)


def _interface(sysfs: SysFS, name: str, addrs: list[tuple[str, int]]) -> Interface:
    base = f"/sys/class/net/{name}"
    carrier_v = sysfs.read_int(f"{base}/carrier")  # EINVAL (None) while admin down
    carrier = None if carrier_v is None else carrier_v == 1
    oper = (sysfs.read(f"{base}/operstate") or "").lower()
    speed = sysfs.read_int(f"{base}/speed")
    numa = sysfs.read_int(f"{base}/device/numa_node")
    rdma_dev, rdma_port = _rdma_for_netdev(sysfs, name)
    return Interface(
        name=name,
        ipv4=list(addrs),
        mtu=sysfs.read_int(f"{base}/mtu") or 0,
        speed_mbps=speed if speed is not None and speed > 0 else None,
        numa_node=numa if numa is not None and numa >= 0 else None,
        oper_up=oper == "up" or (oper == "unknown" and carrier is True),
        carrier=carrier,
        rdma_dev=rdma_dev,
        rdma_port=rdma_port,
        master=sysfs.link_name(f"{base}/master"),
    )


def interfaces(root: str = "/", probe: Probe | None = None) -> list[Interface]:
    """Every interface in /sys/class/net (sorted by name), with IPv4 from ``ip -j addr``."""
    sysfs = SysFS(root)
    addrs = ipv4_addresses(probe or make_probe(root))
    return [_interface(sysfs, n, addrs.get(n, [])) for n in sysfs.listdir("/sys/class/net")]


def interface_for_addr(addr: str, root: str = "/", probe: Probe | None = None) -> Interface | None:
    """The interface that holds IPv4 address ``addr``, or None."""
    for itf in interfaces(root, probe):
        if any(a == addr for a, _ in itf.ipv4):
            return itf
    return None


# ---------------------------------------------------------------------------------------------
# Counters


@dataclass
class Counters:
    tx_bytes: int
    rx_bytes: int
    source: str  # "rdma:<dev>/<port>" or "netdev:<if>"


def read_counters(ifname: str, root: str = "/") -> Counters:
    """Byte counters of one interface.

    An interface with an RDMA device reads its port counters (port_xmit_data/port_rcv_data
    count 4-byte words, so they are multiplied by 4): RDMA traffic bypasses the netdev
    statistics. Otherwise /sys/class/net/<if>/statistics/{tx,rx}_bytes.
    Raises OSError with a message naming the files when neither is readable."""
    sysfs = SysFS(root)
    if not sysfs.exists(f"/sys/class/net/{ifname}"):
        raise OSError(f"no interface {ifname!r} in {sysfs.path('/sys/class/net')}")
    dev, port = _rdma_for_netdev(sysfs, ifname)
    tried: list[str] = []
    if dev is not None and port is not None:
        cdir = f"/sys/class/infiniband/{dev}/ports/{port}/counters"
        tx, rx = sysfs.read_int(f"{cdir}/port_xmit_data"), sysfs.read_int(f"{cdir}/port_rcv_data")
        if tx is not None and rx is not None:
            return Counters(tx * 4, rx * 4, f"rdma:{dev}/{port}")
        tried.append(str(sysfs.path(cdir)) + "/port_{xmit,rcv}_data")
    sdir = f"/sys/class/net/{ifname}/statistics"
    tx, rx = sysfs.read_int(f"{sdir}/tx_bytes"), sysfs.read_int(f"{sdir}/rx_bytes")
    if tx is not None and rx is not None:
        return Counters(tx, rx, f"netdev:{ifname}")
    tried.append(str(sysfs.path(sdir)) + "/{tx,rx}_bytes")
    raise OSError(f"counters of {ifname} are not readable (tried {', '.join(tried)})")
