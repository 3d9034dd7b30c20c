"""`multirail doctor`: read-only checks of a multi-rail (multi-NIC) host.

Model
-----
1. **Facts.** Every /sys and /proc read goes through :class:`multirail.netinfo.SysFS`, which
   prefixes ``--root``; every command (``ip -j ...``, ``ucx_info -v``, ``mlnx_qos``, ``ping``)
   goes through a :class:`multirail.netinfo.Probe`. With ``--root DIR`` commands are replayed
   from ``DIR/.cmd/`` (see netinfo), so every check runs against fixture trees offline.
2. **Rails.** ``--rails IF1,IF2`` names them. Otherwise: interfaces with an RDMA device behind
   them that have an IPv4 address; if there are none, RDMA interfaces enslaved to a bond or
   bridge (the bonded host: ``rail-selection`` fails, naming the bond and how to undo it); if
   there are none, non-loopback, non-bridge, non-bond, non-tun interfaces that are up with an
   IPv4 address. The rule used is reported.
3. **Peers.** ``--peer HOST[,HOST...]``: each rail is paired with the peer address in its own
   subnet; else, with as many addresses as rails, by position; else with the first address.
   Without ``--peer`` the peer checks report ``skip``.
4. **Checks.** Each check returns :class:`CheckResult` records (name, status, rail, evidence,
   fix). Statuses: ``ok``, ``warn`` (works, but slower or fragile), ``fail`` (breaks transfers
   or makes rails share a NIC), ``skip`` (not applicable or not readable, with the reason).
   Nothing is ever changed: the ``fix`` field is the command for a human to run.

5. **GPU-NIC layout** (:mod:`multirail.doctor_topology`): the GPU-NIC matrix, and the
   gpu-nic-distance, nic-link, acs, iommu and gpudirect-modules checks, read from ``--sysfs``
   (default ``ROOT/sys``); they run with or without rails.

Exit code: 0 when no check failed, 1 when at least one failed, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import enum
import ipaddress
import json
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

from multirail import doctor_topology
from multirail.netinfo import (
    CmdResult,
    Interface,
    Probe,
    SysFS,
    interfaces,
    make_probe,
    rdma_devices,
)

__all__ = ["Status", "CheckResult", "Report", "DoctorError", "run_doctor", "register", "main"]

JSON_VERSION = 1
MAIN_RULE_PRIORITY = 32766  # the kernel's default `from all lookup main` rule
RESERVED_TABLES = {"main", "local", "default", "254", "255", "253", "0", "unspec"}
ROCE_HEADER_BYTES = 96  # GRH+UDP+BTH+XRC+AtomicETH+ICRC, as iboe_get_mtu() subtracts
IB_MTUS = (4096, 2048, 1024, 512, 256)
PING_FALLBACK_SIZES = (9000, 4200, 1500, 1280)
ADDR_PLACEHOLDER = "<address>/<prefix>"


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass
class CheckResult:
    name: str
    status: Status
    evidence: str
    fix: str = ""
    rail: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "rail": self.rail,
            "evidence": self.evidence,
            "fix": self.fix,
        }


class DoctorError(Exception):
    """A usage error (bad --root, unknown rail, unresolvable peer): exit code 2."""


# ---------------------------------------------------------------------------------------------
# Context: the facts the checks share


@dataclass
class RuleMatch:
    """The `ip rule` that routes traffic from one rail address, and what its table holds."""

    addr: str
    rule: dict[str, Any] | None
    routes: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    @property
    def table(self) -> str | None:
        return None if self.rule is None else str(self.rule.get("table"))


@dataclass
class Context:
    sysfs: SysFS
    probe: Probe
    all_ifs: dict[str, Interface]
    rails: list[Interface]
    selection: str
    peers: dict[str, str]  # rail name -> peer IPv4 address
    peer_ucx_version: str | None = None
    transport: str = "auto"  # what an agent on these rails is asked to run (AgentConfig.transport)
    live: bool = True  # the real host (False: a --root fixture tree)

    @cached_property
    def has_rdma(self) -> bool:
        return bool(rdma_devices(self.sysfs))

    @cached_property
    def ip_rules(self) -> list[dict[str, Any]] | None:
        """`ip -j rule show`, or None when ip is missing or broken."""
        res = self.probe.run(["ip", "-j", "rule", "show"])
        return _json_list(res)

    def table_routes(self, table: str) -> list[dict[str, Any]] | None:
        return _json_list(self.probe.run(["ip", "-j", "route", "show", "table", table]))

    @cached_property
    def ucx_info(self) -> CmdResult:
        return self.probe.run(["ucx_info", "-v"])

    @cached_property
    def ucx_version(self) -> str | None:
        return parse_ucx_version(self.ucx_info.stdout) if self.ucx_info.ok else None

    @cached_property
    def ucx_facts(self) -> tuple[str, str, list[str]]:
        """UCX as an agent would load it: ("loaded", label, transport modules) or ("failed", why,
        []). On a fixture tree, from its recorded `ucx_info -v` (a UCX found there is taken to
        be a system build, which has the ib transports; the libucx wheel has no ucx_info)."""
        if not self.live:
            ver = self.ucx_version
            return ("loaded", f"{ver} (system)", ["ib"]) if ver else ("failed", "no UCX found (`ucx_info -v`)", [])
        from multirail import _core

        return _core.ucx_facts()

    def rule_for(self, addr: str) -> RuleMatch:
        """The first (lowest priority number) non-main rule whose `from` covers addr."""
        rules = self.ip_rules
        if rules is None:
            return RuleMatch(addr, None, error="`ip -j rule show` failed")
        ip = ipaddress.IPv4Address(addr)
        for r in sorted(rules, key=_priority):
            src, table = r.get("src"), str(r.get("table", ""))
            if src in (None, "all") or table in RESERVED_TABLES:
                continue
            try:
                net = ipaddress.IPv4Network(f"{src}/{r.get('srclen', 32)}", strict=False)
            except ValueError:
                continue
            if ip in net:
                routes = self.table_routes(table)
                return RuleMatch(addr, r, routes or [], "" if routes is not None else "no such table")
        return RuleMatch(addr, None)


def _priority(rule: dict[str, Any]) -> int:
    try:
        return int(rule.get("priority", 0))
    except (TypeError, ValueError):
        return 0


def _json_list(res: CmdResult) -> list[dict[str, Any]] | None:
    if not res.ok:
        return None
    try:
        data = json.loads(res.stdout or "[]")
    except json.JSONDecodeError:
        return None
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else None


def parse_ucx_version(text: str) -> str | None:
    """Version from `ucx_info -v` ("# Library version: 1.16.0" or "# UCT version=1.8.0")."""
    m = re.search(r"version\s*[=:]\s*(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


# ---------------------------------------------------------------------------------------------
# Rail selection and peers


def _is_virtual_bridgeish(sysfs: SysFS, itf: Interface) -> str | None:
    """Why an interface is not a rail candidate in the fallback rule, or None."""
    base = f"/sys/class/net/{itf.name}"
    if sysfs.read_int(f"{base}/type") == 772 or itf.name == "lo":
        return "loopback"
    for sub, why in (("bridge", "bridge"), ("bonding", "bond"), ("tun_flags", "tun/tap")):
        if sysfs.exists(f"{base}/{sub}"):
            return why
    return None


def select_rails(sysfs: SysFS, all_ifs: dict[str, Interface], explicit: list[str] | None) -> tuple[list[Interface], str]:
    if explicit:
        missing = [n for n in explicit if n not in all_ifs]
        if missing:
            raise DoctorError(
                f"--rails: no interface named {', '.join(missing)} in {sysfs.path('/sys/class/net')} "
                f"(have: {', '.join(sorted(all_ifs)) or 'none'})"
            )
        return [all_ifs[n] for n in explicit], "explicit (--rails)"
    rdma = [i for i in all_ifs.values() if i.rdma_dev and i.name != "lo"]
    with_ip = [i for i in rdma if i.ipv4]
    if with_ip:
        ignored = [i.name + (f" (enslaved to {i.master})" if i.master else "") for i in rdma if not i.ipv4]
        note = f"; ignored (no IPv4): {', '.join(ignored)}" if ignored else ""
        return with_ip, f"auto: interfaces with an RDMA device and an IPv4 address ({_rdma_pairs(with_ip)}){note}"
    enslaved = [i for i in rdma if i.master]
    if enslaved:
        return enslaved, "auto (no RDMA device has an IPv4 address): RDMA interfaces enslaved to a bond or bridge"
    cands = [i for i in all_ifs.values() if _is_virtual_bridgeish(sysfs, i) is None and i.oper_up and i.ipv4]
    why = "no RDMA device has an IPv4 address" if rdma else "no RDMA devices"
    return cands, f"auto ({why}): non-loopback, non-bridge, non-bond, non-tun interfaces that are up with IPv4"


def _rdma_pairs(ifs: list[Interface]) -> str:
    return ", ".join(f"{i.rdma_dev}->{i.name}" for i in ifs)


def _resolve_ipv4(host: str, timeout: float = 3.0) -> str:
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    result: list[str] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
            result.extend(str(i[4][0]) for i in infos)
        except OSError:
            pass

    t = threading.Thread(target=lookup, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise DoctorError(f"--peer: cannot resolve {host!r} to an IPv4 address")
    return result[0]


def pair_peers(rails: list[Interface], peer_addrs: list[str]) -> dict[str, str]:
    """rail -> peer address: same subnet first, then by position (equal counts), else the first."""
    out: dict[str, str] = {}
    for idx, rail in enumerate(rails):
        nets = rail.networks()
        same = [p for p in peer_addrs if any(ipaddress.IPv4Address(p) in n for n in nets)]
        if same:
            out[rail.name] = same[0]
        elif len(peer_addrs) == len(rails):
            out[rail.name] = peer_addrs[idx]
        elif peer_addrs:
            out[rail.name] = peer_addrs[0]
    return out


# ---------------------------------------------------------------------------------------------
# Checks. Per-rail checks take (ctx, rail) and return one result; global ones take ctx.

RailCheck = Callable[[Context, Interface], CheckResult]
GlobalCheck = Callable[[Context], list[CheckResult]]


def _r(name: str, status: Status, rail: Interface | None, evidence: str, fix: str = "") -> CheckResult:
    return CheckResult(name, status, evidence, fix, rail.name if rail else None)


def _addr_list(rail: Interface) -> str:
    return ", ".join(f"{a}/{p}" for a, p in rail.ipv4) or "no IPv4"


def check_rail_selection(ctx: Context, explicit: bool) -> list[CheckResult]:
    """How the rails were chosen; fail when auto-detection found no usable rail."""
    if not ctx.rails:
        return [_r("rail-selection", Status.FAIL, None, f"{ctx.selection}: none found",
                   "multirail doctor --rails IF1,IF2  # or bring the rail interfaces up with an IPv4 address")]
    enslaved = [] if explicit else [r for r in ctx.rails if r.master and not r.ipv4]
    if not enslaved:
        return [_r("rail-selection", Status.OK, None, f"{ctx.selection}: {', '.join(r.name for r in ctx.rails)}")]
    masters = dict.fromkeys(r.master for r in enslaved if r.master)
    return [_enslaved_rails(ctx, m, [r for r in enslaved if r.master == m]) for m in masters]


def _enslaved_rails(ctx: Context, master: str, nics: list[Interface]) -> CheckResult:
    """The bonded host: RDMA NICs whose only address is on their master."""
    held = [f"{a}/{p}" for a, p in ctx.all_ifs[master].ipv4] if master in ctx.all_ifs else []
    holds = f", holds {', '.join(held)}" if held else ""
    ev = (f"{ctx.selection}: {_rdma_pairs(nics)} are enslaved to {master} ({_master_kind(ctx.sysfs, nics[0])}{holds}): "
          f"{_enslaved_why(master)}. RoCE multi-rail needs each NIC with its own address")
    fix = (_release_fix([n.name for n in nics], held[0] if held else ADDR_PLACEHOLDER, delete=master) +
           f"  # each NIC in its own subnet, the same on the peer; to persist, replace {master} in "
           "/etc/netplan/*.yaml with per-NIC `addresses:`, then netplan apply")
    return _r("rail-selection", Status.FAIL, None, ev, fix)


def check_link(ctx: Context, rail: Interface) -> CheckResult:
    base = f"/sys/class/net/{rail.name}"
    oper = ctx.sysfs.read(f"{base}/operstate") or "?"
    flags = ctx.sysfs.read_int(f"{base}/flags")
    admin_up = bool(flags & 0x1) if flags is not None else rail.oper_up
    carrier = {True: "1", False: "0", None: "unreadable"}[rail.carrier]
    speed = f", speed {rail.speed_mbps} Mb/s" if rail.speed_mbps else ""
    ev = f"{base}: operstate={oper} carrier={carrier}{speed}; IPv4 {_addr_list(rail)}"
    if not admin_up:
        return _r("link", Status.FAIL, rail, ev + " (administratively down)", f"ip link set {rail.name} up")
    if not rail.oper_up or rail.carrier is False:
        return _r("link", Status.FAIL, rail, ev + " (no carrier: cable, peer port or switch port down)",
                  f"ethtool {rail.name}  # check the cable/peer; then: ip link set {rail.name} down && ip link set {rail.name} up")
    if not rail.ipv4:
        return _r("link", Status.FAIL, rail, ev, f"ip addr add {ADDR_PLACEHOLDER} dev {rail.name}")
    return _r("link", Status.OK, rail, ev)


def _needs_rdma(ctx: Context, rail: Interface, name: str) -> CheckResult | None:
    """A skip result when the host has no RDMA at all, or this rail has no RDMA device."""
    if not ctx.has_rdma:
        return _r(name, Status.SKIP, rail, "no RDMA devices (/sys/class/infiniband is empty): TCP-only host")
    if rail.rdma_dev is None or rail.rdma_port is None:
        return _r(name, Status.SKIP, rail, f"{rail.name} has no RDMA device (see rdma-mapping)")
    return None


def check_rdma_mapping(ctx: Context, rail: Interface) -> CheckResult:
    if not ctx.has_rdma:
        return _r("rdma-mapping", Status.SKIP, rail, "no RDMA devices (/sys/class/infiniband is empty): TCP-only host")
    if rail.rdma_dev is None:
        devs = ", ".join(rdma_devices(ctx.sysfs))
        return _r("rdma-mapping", Status.FAIL, rail,
                  f"ibdev2netdev has no entry for {rail.name}: no /sys/class/net/{rail.name}/device/infiniband/* "
                  f"and no /sys/class/infiniband/*/device/net/{rail.name} (RDMA devices here: {devs})",
                  f"modprobe mlx5_ib; rdma link show  # or leave {rail.name} out of --rails if it is not an RDMA rail")
    pdir = f"/sys/class/infiniband/{rail.rdma_dev}/ports/{rail.rdma_port}"
    state = ctx.sysfs.read(f"{pdir}/state") or "unreadable"
    phys = ctx.sysfs.read(f"{pdir}/phys_state") or "unreadable"
    layer = ctx.sysfs.read(f"{pdir}/link_layer") or "unreadable"
    updown = "Up" if rail.oper_up else "Down"
    ev = (f"{rail.rdma_dev} port {rail.rdma_port} ==> {rail.name} ({updown}); "
          f"port state {state}, phys_state {phys}, link_layer {layer}")
    if "ACTIVE" not in state.upper():
        return _r("rdma-mapping", Status.FAIL, rail, ev,
                  f"ip link set {rail.name} up  # then: rdma link show {rail.rdma_dev}/{rail.rdma_port}")
    return _r("rdma-mapping", Status.OK, rail, ev)


def _master_kind(sysfs: SysFS, itf: Interface) -> str:
    """What an enslaved interface's master is: "bond", "bridge" or "master"."""
    if sysfs.exists(f"/sys/class/net/{itf.master}/bonding") or sysfs.exists(f"/sys/class/net/{itf.name}/bonding_slave"):
        return "bond"
    return "bridge" if sysfs.exists(f"/sys/class/net/{itf.master}/bridge") else "master"


def _enslaved_why(master: str) -> str:
    return f"RDMA verbs cannot use an enslaved port; its GIDs and address move to {master}"


def _release_fix(nics: list[str], first_addr: str = ADDR_PLACEHOLDER, delete: str | None = None) -> str:
    """Take NICs out of their master (then delete it, if given) and give each its own address."""
    cmds = [f"ip link set {n} nomaster" for n in nics] + ([f"ip link delete {delete}"] if delete else [])
    cmds += [f"ip link set {n} up && ip addr add {first_addr if i == 0 else ADDR_PLACEHOLDER} dev {n}"
             for i, n in enumerate(nics)]
    return " && ".join(cmds)


def check_bond(ctx: Context, rail: Interface) -> CheckResult:
    base = f"/sys/class/net/{rail.name}"
    if rail.master is None:
        return _r("bond", Status.OK, rail, f"{base}/master absent: not enslaved")
    ev = f"{base}/master -> {rail.master} ({_master_kind(ctx.sysfs, rail)}): {_enslaved_why(rail.master)}"
    return _r("bond", Status.FAIL, rail, ev, _release_fix([rail.name]))


def check_mtu_consistency(ctx: Context) -> list[CheckResult]:
    mtus = {r.name: r.mtu for r in ctx.rails}
    ev = "MTU " + ", ".join(f"{n}={m}" for n, m in mtus.items()) + " (from /sys/class/net/<if>/mtu)"
    if len(set(mtus.values())) <= 1:
        return [_r("mtu-consistency", Status.OK, None, ev)]
    top = max(mtus.values())
    fix = "; ".join(f"ip link set {n} mtu {top}" for n, m in mtus.items() if m != top)
    return [_r("mtu-consistency", Status.FAIL, None, ev + ": rails differ",
               fix + "  # and the same MTU on the peer's rails and the switch ports")]


def roce_active_mtu(netdev_mtu: int) -> int:
    """The RoCE path MTU the kernel derives from a netdev MTU (iboe_get_mtu)."""
    for m in IB_MTUS:
        if netdev_mtu - ROCE_HEADER_BYTES >= m:
            return m
    return IB_MTUS[-1]


def check_roce_mtu(ctx: Context, rail: Interface) -> CheckResult:
    skip = _needs_rdma(ctx, rail, "roce-mtu")
    if skip:
        return skip
    if rail.mtu <= 0:
        return _r("roce-mtu", Status.SKIP, rail, f"/sys/class/net/{rail.name}/mtu unreadable")
    active = roce_active_mtu(rail.mtu)
    ev = f"netdev MTU {rail.mtu} gives RoCE active_mtu {active}"
    if active == 4096:
        return _r("roce-mtu", Status.OK, rail, ev)
    return _r("roce-mtu", Status.WARN, rail,
              ev + f": every RDMA message is cut into {active}-byte packets (needs netdev MTU >= {4096 + ROCE_HEADER_BYTES} for 4096)",
              f"ip link set {rail.name} mtu 9000  # also on the peer and the switch ports")


def _gid_table(ctx: Context, dev: str, port: int) -> list[tuple[int, str, str, str]]:
    """[(index, gid, type, ndev)] of the non-empty entries of one port's GID table."""
    pdir = f"/sys/class/infiniband/{dev}/ports/{port}"
    out = []
    for idx in sorted((int(i) for i in ctx.sysfs.listdir(f"{pdir}/gids") if i.isdigit())):
        gid = ctx.sysfs.read(f"{pdir}/gids/{idx}") or ""
        if not gid or set(gid) <= {"0", ":"}:
            continue
        out.append((idx, gid, ctx.sysfs.read(f"{pdir}/gid_attrs/types/{idx}") or "?",
                    ctx.sysfs.read(f"{pdir}/gid_attrs/ndevs/{idx}") or "?"))
    return out


def _gid_ipv4(gid: str) -> str | None:
    try:
        mapped = ipaddress.IPv6Address(gid).ipv4_mapped
    except ValueError:
        return None
    return str(mapped) if mapped else None


def check_roce_gid(ctx: Context, rail: Interface) -> CheckResult:
    skip = _needs_rdma(ctx, rail, "roce-gid")
    if skip:
        return skip
    if not rail.ipv4:
        return _r("roce-gid", Status.SKIP, rail, f"{rail.name} has no IPv4 address (see link)")
    assert rail.rdma_dev is not None and rail.rdma_port is not None  # _needs_rdma checked
    dev, port = rail.rdma_dev, rail.rdma_port
    table = _gid_table(ctx, dev, port)
    where = f"/sys/class/infiniband/{dev}/ports/{port}/gids"
    found, problems = [], []
    for addr, _plen in rail.ipv4:
        mine = [(i, t, n) for i, g, t, n in table if _gid_ipv4(g) == addr]
        v2 = [(i, n) for i, t, n in mine if "v2" in t.lower()]
        good = [i for i, n in v2 if n == rail.name]
        if good:
            found.append(f"{addr} at GID index {good[0]} (RoCE v2, ndev {rail.name})")
        elif v2:
            problems.append(f"the RoCE v2 GID of {addr} (index {v2[0][0]}) belongs to {v2[0][1]}, not {rail.name}")
        elif mine:
            problems.append(f"{addr} has only RoCE v1 GIDs (index {', '.join(str(i) for i, _, _ in mine)})")
        else:
            problems.append(f"no GID for {addr}")
    if problems:
        entries = "; ".join(f"{i}={g} {t} {n}" for i, g, t, n in table) or "empty"
        return _r("roce-gid", Status.FAIL, rail, f"{where}: " + "; ".join(problems) + f" (table: {entries})",
                  f"ip addr show dev {rail.name}; show_gids {dev}  # the kernel adds RoCE v1+v2 GIDs for each address "
                  f"on the netdev; re-add a missing one with: ip addr add <address>/<prefix> dev {rail.name}")
    idx = found[0].split("GID index ")[1].split()[0]
    return _r("roce-gid", Status.OK, rail, f"{where}: " + "; ".join(found) +
              f" (read from the GID table, not assumed: ib_write_bw -x {idx}, UCX_IB_GID_INDEX={idx})")


def check_same_subnet(ctx: Context) -> list[CheckResult]:
    results: list[CheckResult] = []
    rail_names = {r.name for r in ctx.rails}
    seen: set[frozenset[str]] = set()
    for rail in ctx.rails:
        for net in rail.networks():
            for other in ctx.all_ifs.values():
                if other.name == rail.name or other.name == "lo":
                    continue
                hits = [f"{a}/{p}" for a, p in other.ipv4 if ipaddress.IPv4Address(a) in net]
                pair = frozenset((rail.name, other.name))
                if not hits or pair in seen:
                    continue
                seen.add(pair)
                if other.name in rail_names:
                    results.append(_r("same-subnet", Status.WARN, rail,
                                      f"rails {rail.name} and {other.name} share {net} ({other.name}: {', '.join(hits)}): "
                                      "either NIC may answer ARP or carry the other's traffic",
                                      "give each rail its own subnet; else keep arp_ignore=1, arp_announce=2 and per-rail policy routing"))
                else:
                    results.append(_r("same-subnet", Status.FAIL, rail,
                                      f"non-rail interface {other.name} has {', '.join(hits)} inside rail {rail.name}'s {net}: "
                                      "UCX and the kernel may pick it instead of the rail",
                                      "; ".join(f"ip addr del {h} dev {other.name}" for h in hits) +
                                      (f"  # or restrict UCX: export UCX_NET_DEVICES={rail.rdma_dev}:{rail.rdma_port}"
                                       if rail.rdma_dev else "")))
    if not results:
        nets = ", ".join(f"{r.name}={n}" for r in ctx.rails for n in r.networks()) or "none"
        results.append(_r("same-subnet", Status.OK, None, f"each rail subnet holds one interface ({nets})"))
    return results


def _conf(ctx: Context, ifname: str, key: str) -> tuple[int | None, str]:
    """Effective value of an ipv4 conf knob for which the kernel uses max(all, <if>)."""
    a = ctx.sysfs.read_int(f"/proc/sys/net/ipv4/conf/all/{key}")
    i = ctx.sysfs.read_int(f"/proc/sys/net/ipv4/conf/{ifname}/{key}")
    vals = [v for v in (a, i) if v is not None]
    return (max(vals) if vals else None), f"{key}: all={a} {ifname}={i}"


def _shares_subnet(ctx: Context, rail: Interface) -> bool:
    nets = rail.networks()
    return any(ipaddress.IPv4Address(a) in n for o in ctx.all_ifs.values() if o.name not in (rail.name, "lo")
               for a, _ in o.ipv4 for n in nets)


def check_arp_flux(ctx: Context, rail: Interface) -> CheckResult:
    ign, ev1 = _conf(ctx, rail.name, "arp_ignore")
    ann, ev2 = _conf(ctx, rail.name, "arp_announce")
    ev = f"/proc/sys/net/ipv4/conf: {ev1}, {ev2} (effective: max)"
    if ign is None or ann is None:
        return _r("arp-flux", Status.SKIP, rail, ev + ": not readable")
    if ign in (1, 2) and ann == 2:
        return _r("arp-flux", Status.OK, rail, ev)
    shared = _shares_subnet(ctx, rail)
    if len(ctx.rails) < 2 and not shared:
        return _r("arp-flux", Status.SKIP, rail, ev + ": one rail and no other interface in its subnet")
    why = ("; another interface shares this subnet, so ARP flux sends its traffic to the wrong NIC" if shared
           else "; the host may answer ARP for this rail's address on another NIC")
    return _r("arp-flux", Status.FAIL if shared else Status.WARN, rail, ev + why,
              f"sysctl -w net.ipv4.conf.{rail.name}.arp_ignore=1 net.ipv4.conf.{rail.name}.arp_announce=2  "
              "# persist in /etc/sysctl.d/")


def check_rp_filter(ctx: Context, rail: Interface) -> CheckResult:
    val, ev = _conf(ctx, rail.name, "rp_filter")
    ev = f"/proc/sys/net/ipv4/conf: {ev} (effective: max)"
    if val is None:
        return _r("rp-filter", Status.SKIP, rail, ev + ": not readable")
    if val in (0, 2):
        return _r("rp-filter", Status.OK, rail, ev + (" (loose)" if val == 2 else " (off)"))
    if len(ctx.rails) < 2:
        return _r("rp-filter", Status.OK, rail, ev + " (strict; one rail, so no asymmetric paths)")
    match = ctx.rule_for(rail.ipv4[0][0]) if rail.ipv4 else None
    if match is not None and match.rule is not None:
        return _r("rp-filter", Status.OK, rail, ev + f" (strict, with per-rail policy routing: table {match.table})")
    return _r("rp-filter", Status.WARN, rail,
              ev + " (strict): packets whose reverse route leaves on another rail are dropped (TcpExtIPReversePathFilter)",
              f"sysctl -w net.ipv4.conf.{rail.name}.rp_filter=2 net.ipv4.conf.all.rp_filter=2  # or add per-rail policy routing")


def _policy_fix(rail: Interface, idx: int) -> str:
    table = 100 + idx
    cmds = []
    for a, p in rail.ipv4:
        net = ipaddress.IPv4Network(f"{a}/{p}", strict=False)
        cmds += [f"ip route add {net} dev {rail.name} scope link table {table}",
                 f"ip rule add from {a} table {table} priority {1000 + idx}"]
    return "; ".join(cmds) + "  # persist with netplan routing-policy (from/table) and routes (table)"


def check_policy_routing(ctx: Context, rail: Interface) -> CheckResult:
    name = "policy-routing"
    if len(ctx.rails) < 2:
        return _r(name, Status.SKIP, rail, "one rail: no per-rail policy routing needed")
    if not rail.ipv4:
        return _r(name, Status.SKIP, rail, f"{rail.name} has no IPv4 address (see link)")
    if ctx.ip_rules is None:
        return _r(name, Status.SKIP, rail, "`ip -j rule show` is not available (iproute2 missing?)")
    idx = ctx.rails.index(rail)
    evidence: list[str] = []
    for addr, _ in rail.ipv4:
        m = ctx.rule_for(addr)
        if m.rule is None:
            return _r(name, Status.FAIL, rail, f"`ip rule`: no rule selects a table for traffic from {addr}",
                      _policy_fix(rail, idx))
        prio = _priority(m.rule)
        rule_txt = f"rule {prio}: from {m.rule.get('src')}/{m.rule.get('srclen', 32)} lookup {m.table}"
        if prio >= MAIN_RULE_PRIORITY:
            return _r(name, Status.FAIL, rail, f"{rule_txt} comes after `lookup main` ({MAIN_RULE_PRIORITY}): never used",
                      f"ip rule del priority {prio}; " + _policy_fix(rail, idx))
        devs = sorted({str(r.get("dev")) for r in m.routes if r.get("dev")})
        if rail.name not in devs:
            return _r(name, Status.FAIL, rail,
                      f"{rule_txt}, but table {m.table} routes via {', '.join(devs) or 'nothing'} ({m.error or 'no route'} via {rail.name})",
                      f"ip route add {ipaddress.IPv4Network(f'{addr}/{rail.ipv4[0][1]}', strict=False)} dev {rail.name} table {m.table}")
        evidence.append(f"{rule_txt} (table routes via {', '.join(devs)})")
        peer = ctx.peers.get(rail.name)
        if peer is None:
            evidence.append("egress not tested (no --peer)")
            continue
        res = ctx.probe.run(["ip", "-j", "route", "get", peer, "from", addr])
        got = _json_list(res)
        if not got:
            return _r(name, Status.FAIL, rail,
                      f"`{res.text}` failed: {(res.stderr or res.stdout).strip() or f'exit {res.rc}'}",
                      f"ip route add {peer} dev {rail.name} table {m.table}  # or a default via the rail's gateway")
        dev = got[0].get("dev")
        if dev != rail.name:
            return _r(name, Status.FAIL, rail,
                      f"`{res.text}` leaves via {dev}, not {rail.name}: this rail's traffic would use another NIC",
                      f"ip route add {peer} dev {rail.name} table {m.table}  # or: ip route add default via <rail gateway> dev {rail.name} table {m.table}")
        evidence.append(f"`ip route get {peer} from {addr}` leaves via {dev}")
    return _r(name, Status.OK, rail, "; ".join(evidence))


def _ping(ctx: Context, src: str, peer: str, payload: int) -> CmdResult:
    return ctx.probe.run(["ping", "-M", "do", "-s", str(payload), "-c", "1", "-W", "1", "-I", src, peer], timeout=4.0)


def check_path_mtu(ctx: Context, rail: Interface) -> CheckResult:
    name = "path-mtu"
    peer = ctx.peers.get(rail.name)
    if peer is None:
        return _r(name, Status.SKIP, rail, "no --peer given")
    if not rail.ipv4:
        return _r(name, Status.SKIP, rail, f"{rail.name} has no IPv4 address (see link)")
    if rail.mtu <= 28:
        return _r(name, Status.SKIP, rail, f"MTU of {rail.name} unreadable")
    src = rail.ipv4[0][0]
    full = _ping(ctx, src, peer, rail.mtu - 28)
    if full.missing:
        return _r(name, Status.SKIP, rail, f"ping unavailable ({full.stderr.strip()})", "apt-get install iputils-ping")
    if full.ok:
        return _r(name, Status.OK, rail, f"`{full.text}`: a {rail.mtu}-byte don't-fragment packet reached {peer}")
    working = None
    for size in (s for s in PING_FALLBACK_SIZES if s < rail.mtu):
        if _ping(ctx, src, peer, size - 28).ok:
            working = size
            break
    if working is None and not _ping(ctx, src, peer, 56).ok:
        return _r(name, Status.FAIL, rail, f"`{full.text}` failed and a 84-byte ping from {src} fails too: "
                  f"{peer} is unreachable from this rail", f"ping -I {src} {peer}; ip route get {peer} from {src}")
    seen = f"{working} bytes pass" if working else "only small packets pass"
    return _r(name, Status.FAIL, rail, f"`{full.text}` failed ({(full.stdout + full.stderr).strip()[-160:]}); {seen}: "
              f"the path to {peer} does not carry MTU {rail.mtu}",
              f"set MTU {rail.mtu} on the peer's rail and every switch port on the path (or: ip link set {rail.name} mtu <path MTU>)")


def check_gpudirect(ctx: Context) -> list[CheckResult]:
    mods = ctx.sysfs.read("/proc/modules")
    loaded = {line.split()[0] for line in (mods or "").splitlines() if line.strip()}

    def has(m: str) -> bool:
        return m in loaded or ctx.sysfs.exists(f"/sys/module/{m}")

    if not has("nvidia"):
        return [_r("gpudirect", Status.SKIP, None, "no NVIDIA driver loaded (/proc/modules, /sys/module/nvidia): no GPU memory to check")]
    from .doctor_topology import gpudirect_support
    way, evidence = gpudirect_support(ctx.sysfs)
    if way is not None:
        return [_r("gpudirect", Status.OK, None, f"{evidence}: the NIC can read and write GPU memory (GPUDirect RDMA, {way})")]
    return [_r("gpudirect", Status.WARN, None,
               f"nvidia is loaded but {evidence}: "
               "GPU memory cannot go NIC-direct: multirail stages it through pinned host buffers (pipelined, "
               "docs/gpu.md); engines that stage naively reach 3.5-4.9 Gbps on 100G rails",
               "modprobe nvidia_peermem  # or the open NVIDIA kernel module on Linux >= 5.12 (dma-buf); fails on "
               "unified-memory platforms (DGX Spark): there, use pinned host memory")]


def check_ucx(ctx: Context) -> list[CheckResult]:
    res = ctx.ucx_info
    ver = ctx.ucx_version
    if ver:
        return [_r("ucx", Status.OK, None, f"`ucx_info -v`: UCX {ver}")]
    why = "ucx_info is not installed" if res.missing else f"`ucx_info -v` gave no version (exit {res.rc})"
    rdma_rails = [r.name for r in ctx.rails if r.rdma_dev]
    if not rdma_rails:
        return [_r("ucx", Status.SKIP, None, f"{why}; no RDMA rails, so UCX is not needed")]
    return [_r("ucx", Status.FAIL, None, f"{why}: the RDMA transport (UCX) cannot load, transfers over "
               f"{', '.join(rdma_rails)} fall back to TCP",
               "apt-get install ucx-utils libucx0  # or build UCX and put its bin/ on PATH and lib/ on LD_LIBRARY_PATH")]


def _asked_per_rail(spec: str, n: int) -> list[str]:
    kinds = [t.strip() for t in str(spec).split(",")]
    if len(kinds) == 1:
        return kinds * n
    if len(kinds) != n:
        raise DoctorError(f"--transport lists {len(kinds)} transports for {n} rails")
    return kinds


def check_transport(ctx: Context) -> list[CheckResult]:
    """What each rail would run under --transport (default auto) and why: the agent's own rule
    (`_core.choose_transport`, crates/multirail/src/transport/select.rs). Warns where an RDMA NIC
    would run tcp for want of an RDMA-capable UCX, and where ucx asked for by name would run
    over UCX's tcp transport, which checks no memory bounds (docs/SECURITY.md)."""
    try:
        from multirail import _core
    except ImportError as e:
        return [_r("transport", Status.SKIP, None, f"the engine is not built ({e}): `make setup`")]
    asked = _asked_per_rail(ctx.transport, len(ctx.rails))
    needs = any(a == "ucx" or (a == "auto" and r.rdma_dev) for a, r in zip(asked, ctx.rails))
    facts = ctx.ucx_facts if needs else None
    out = []
    for rail, a in zip(ctx.rails, asked):
        try:
            kind, why, bare = _core.choose_transport(a, rail.rdma_dev or "", facts)
        except ValueError as e:
            raise DoctorError(f"--transport: {e}") from e
        ev = f"transport={a}: {kind} ({why})"
        if bare:
            out.append(_r("transport", Status.WARN, rail, ev + ": UCX's tcp transport checks no memory bounds, a "
                          "peer holding this agent's rkeys can reach outside its exported regions (docs/SECURITY.md)",
                          "transport='auto' or 'tcp' on this rail, or an RDMA-capable UCX "
                          "(apt-get install libucx0, or MULTIRAIL_UCX_LIB=/path/to/libucp.so.0)"))
        elif a == "auto" and rail.rdma_dev and kind == "tcp":
            out.append(_r("transport", Status.WARN, rail, ev,
                          "apt-get install libucx0  # or DOCA/MLNX_OFED UCX; or MULTIRAIL_UCX_LIB=/path/to/libucp.so.0"))
        else:
            out.append(_r("transport", Status.OK, rail, ev))
    return out


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def check_ucx_peer(ctx: Context) -> list[CheckResult]:
    mine, theirs = ctx.ucx_version, ctx.peer_ucx_version
    if theirs is None:
        return [_r("ucx-peer", Status.SKIP, None, "peer UCX version unknown: pass --peer-ucx-version (run `ucx_info -v` on the peer)")]
    if mine is None:
        return [_r("ucx-peer", Status.SKIP, None, f"peer has UCX {theirs}, local UCX version unknown (see ucx)")]
    ev = f"local UCX {mine}, peer UCX {theirs}"
    if _vtuple(mine) == _vtuple(theirs):
        return [_r("ucx-peer", Status.OK, None, ev)]
    fix = f"build the same UCX release on both hosts (git tag v{max(mine, theirs, key=_vtuple)})"
    if _vtuple(mine)[:2] != _vtuple(theirs)[:2]:
        return [_r("ucx-peer", Status.FAIL, None, ev + ": different releases do not connect (NIXL_ERR_NOT_FOUND)", fix)]
    return [_r("ucx-peer", Status.WARN, None, ev + ": patch levels differ", fix)]


def _pfc_from_mlnx_qos(text: str) -> list[int] | None:
    m = re.search(r"PFC configuration:.*?enabled\s+((?:[01]\s*){8})", text, re.S)
    return [p for p, v in enumerate(m.group(1).split()) if v == "1"] if m else None


def _pfc_from_dcb(text: str) -> list[int] | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    prio = data.get("prio_pfc") if isinstance(data, dict) else None
    if not isinstance(prio, dict):
        return None
    return sorted(int(k) for k, v in prio.items() if v in (True, "on", 1))


def check_pfc(ctx: Context, rail: Interface) -> CheckResult:
    skip = _needs_rdma(ctx, rail, "pfc")
    if skip:
        return skip
    sources: list[tuple[list[str], Callable[[str], list[int] | None]]] = [
        (["mlnx_qos", "-i", rail.name], _pfc_from_mlnx_qos),
        (["dcb", "-j", "pfc", "show", "dev", rail.name], _pfc_from_dcb),
    ]
    for argv, parse in sources:
        res = ctx.probe.run(argv)
        prios = parse(res.stdout) if res.ok else None
        if prios is None:
            continue
        if prios:
            return _r("pfc", Status.OK, rail, f"`{res.text}`: PFC enabled on priority {', '.join(map(str, prios))}")
        return _r("pfc", Status.WARN, rail, f"`{res.text}`: PFC off on every priority: RoCE runs lossy "
                  "(drops cost retransmits unless ECN/DCQCN keeps queues short)",
                  f"mlnx_qos -i {rail.name} --pfc 0,0,0,1,0,0,0,0  # priority 3; the switch must match")
    return _r("pfc", Status.SKIP, rail, "PFC state not readable (neither `mlnx_qos -i` nor `dcb pfc show` answered)")


def check_ecn(ctx: Context, rail: Interface) -> CheckResult:
    skip = _needs_rdma(ctx, rail, "ecn")
    if skip:
        return skip
    base = f"/sys/class/net/{rail.name}/ecn"
    on: dict[str, list[int]] = {}
    for role in ("roce_np", "roce_rp"):
        d = f"{base}/{role}/enable"
        vals = {int(p): ctx.sysfs.read_int(f"{d}/{p}") for p in ctx.sysfs.listdir(d) if p.isdigit()}
        if not vals:
            return _r("ecn", Status.SKIP, rail, f"ECN state not readable ({d} absent: not an mlx5 netdev?)")
        on[role] = sorted(p for p, v in vals.items() if v == 1)
    ev = f"{base}: roce_np enabled on {on['roce_np'] or 'none'}, roce_rp on {on['roce_rp'] or 'none'}"
    if on["roce_np"] and on["roce_rp"]:
        return _r("ecn", Status.OK, rail, ev)
    return _r("ecn", Status.WARN, rail, ev + ": DCQCN congestion control is off",
              f"echo 1 > {base}/roce_np/enable/3; echo 1 > {base}/roce_rp/enable/3")


def check_counters(ctx: Context, rail: Interface) -> CheckResult:
    if rail.rdma_dev and rail.rdma_port:
        cdir = f"/sys/class/infiniband/{rail.rdma_dev}/ports/{rail.rdma_port}/counters"
        tx = ctx.sysfs.read_int(f"{cdir}/port_xmit_data")
        rx = ctx.sysfs.read_int(f"{cdir}/port_rcv_data")
        if tx is None or rx is None:
            return _r("counters", Status.WARN, rail,
                      f"{cdir}/port_xmit_data, port_rcv_data not readable: RDMA traffic on this rail cannot be verified "
                      "(netdev statistics do not count it)",
                      f"ls -l {cdir}  # run where the host's /sys is mounted")
        return _r("counters", Status.OK, rail, f"{cdir}: port_xmit_data={tx}, port_rcv_data={rx} (x4 bytes)")
    sdir = f"/sys/class/net/{rail.name}/statistics"
    tx, rx = ctx.sysfs.read_int(f"{sdir}/tx_bytes"), ctx.sysfs.read_int(f"{sdir}/rx_bytes")
    if tx is None or rx is None:
        return _r("counters", Status.WARN, rail, f"{sdir}/tx_bytes, rx_bytes not readable",
                  f"ls -l {sdir}  # run where the host's /sys is mounted")
    return _r("counters", Status.OK, rail, f"{sdir}: tx_bytes={tx}, rx_bytes={rx}")


def _per_rail(fn: RailCheck) -> GlobalCheck:
    return lambda ctx: [fn(ctx, r) for r in ctx.rails]


CHECKS: list[tuple[str, GlobalCheck]] = [
    ("link", _per_rail(check_link)),
    ("rdma-mapping", _per_rail(check_rdma_mapping)),
    ("bond", _per_rail(check_bond)),
    ("mtu-consistency", check_mtu_consistency),
    ("roce-mtu", _per_rail(check_roce_mtu)),
    ("path-mtu", _per_rail(check_path_mtu)),
    ("roce-gid", _per_rail(check_roce_gid)),
    ("same-subnet", check_same_subnet),
    ("arp-flux", _per_rail(check_arp_flux)),
    ("rp-filter", _per_rail(check_rp_filter)),
    ("policy-routing", _per_rail(check_policy_routing)),
    ("gpudirect", check_gpudirect),
    ("ucx", check_ucx),
    ("ucx-peer", check_ucx_peer),
    ("transport", check_transport),
    ("pfc", _per_rail(check_pfc)),
    ("ecn", _per_rail(check_ecn)),
    ("counters", _per_rail(check_counters)),
]
CHECK_NAMES = ["rail-selection"] + [n for n, _ in CHECKS]


# ---------------------------------------------------------------------------------------------
# Running and reporting


@dataclass
class Report:
    root: str
    rails: list[str]
    selection: str
    peers: dict[str, str]
    results: list[CheckResult]
    facts: dict[str, Any]
    matrix: list[str] = field(default_factory=list)  # GPU-NIC matrix lines (human output only)

    @property
    def exit_code(self) -> int:
        return 1 if any(r.status is Status.FAIL for r in self.results) else 0

    def counts(self) -> dict[str, int]:
        return {s.value: sum(r.status is s for r in self.results) for s in Status}

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": "multirail doctor",
            "version": JSON_VERSION,
            "root": self.root,
            "rails": self.rails,
            "selection": self.selection,
            "peers": self.peers,
            "facts": self.facts,
            "results": [r.to_json() for r in self.results],
            "summary": self.counts(),
            "exit_code": self.exit_code,
        }


def run_doctor(root: str = "/", rails: list[str] | None = None, peers: list[str] | None = None,
               peer_ucx_version: str | None = None, probe: Probe | None = None,
               transport: str | None = None, sysfs: str | None = None) -> Report:
    """Run every check. Raises DoctorError for usage errors."""
    if not os.path.isdir(os.path.join(root, "sys", "class", "net")):
        raise DoctorError(f"--root {root}: no sys/class/net under it (expected a tree laid out like /)")
    if peer_ucx_version is not None and parse_ucx_version(f"version={peer_ucx_version}") != peer_ucx_version:
        raise DoctorError(f"--peer-ucx-version {peer_ucx_version!r}: expected a version like 1.16.0")
    sysfs_dir = sysfs
    sysfs = SysFS(root)
    probe = probe or make_probe(root)
    all_ifs = {i.name: i for i in interfaces(root, probe)}
    rail_ifs, selection = select_rails(sysfs, all_ifs, rails)
    peer_addrs = [_resolve_ipv4(p) for p in (peers or [])]
    ctx = Context(sysfs, probe, all_ifs, rail_ifs, selection, pair_peers(rail_ifs, peer_addrs), peer_ucx_version,
                  transport or os.environ.get("MULTIRAIL_TRANSPORT") or "auto",
                  live=Path(root).resolve() == Path("/"))
    results = check_rail_selection(ctx, explicit=bool(rails))
    if rail_ifs:
        for _name, fn in CHECKS:
            results.extend(fn(ctx))
    topo = doctor_topology.load_facts(root, sysfs_dir, probe)  # GPU-NIC layout (issue 34)
    results.extend(CheckResult(n, Status(st), ev, fix, subj) for n, st, ev, fix, subj in doctor_topology.run(topo))
    facts = {"ucx_version": ctx.ucx_version, "rdma_devices": rdma_devices(sysfs),
             "gpu_nic_matrix": topo.topo.matrix() if topo.topo else None,
             "interfaces": {r.name: {"ipv4": [f"{a}/{p}" for a, p in r.ipv4], "mtu": r.mtu,
                                     "rdma": f"{r.rdma_dev}/{r.rdma_port}" if r.rdma_dev else None}
                            for r in rail_ifs}}
    return Report(str(root), [r.name for r in rail_ifs], selection, ctx.peers, results, facts,
                  doctor_topology.matrix_lines(topo))


_COLOURS = {Status.OK: "32", Status.WARN: "33", Status.FAIL: "31", Status.SKIP: "90"}


def format_human(report: Report, colour: bool) -> str:
    lines = [f"rails: {', '.join(report.rails) or 'none'}  [{report.selection}]"]
    if report.matrix:
        lines += ["GPU-NIC matrix (multirail topology prints the rails chosen per GPU):"] + report.matrix
    if report.peers:
        lines.append("peers: " + ", ".join(f"{r}->{p}" for r, p in report.peers.items()))
    width = max(len(r.name) for r in report.results)
    rwidth = max((len(r.rail or "") for r in report.results), default=0)
    for r in report.results:
        tag = f"{r.status.value.upper():<4}"
        if colour:
            tag = f"\033[{_COLOURS[r.status]}m{tag}\033[0m"
        lines.append(f"{tag}  {r.name:<{width}}  {(r.rail or '-'):<{rwidth}}  {r.evidence}")
        if r.fix and r.status in (Status.WARN, Status.FAIL):
            lines.append(f"      {'':<{width}}  {'':<{rwidth}}  fix: {r.fix}")
    c = report.counts()
    lines.append(f"{c['ok']} ok, {c['warn']} warn, {c['fail']} fail, {c['skip']} skip -> exit {report.exit_code}")
    return "\n".join(lines)


def _split_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise DoctorError("empty list (expected NAME[,NAME...])")
    return items


def _cmd(args: argparse.Namespace) -> int:
    try:
        report = run_doctor(
            root=args.root,
            rails=_split_list(args.rails),
            peers=_split_list(args.peer),
            peer_ucx_version=args.peer_ucx_version,
            transport=args.transport,
            sysfs=args.sysfs,
        )
    except DoctorError as e:
        print(f"multirail doctor: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        print(format_human(report, colour))
    return report.exit_code


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor",
        help="read-only checks of the rails (link, MTU, RDMA/GID, bond, subnets, ARP, routing, UCX, PFC/ECN)",
        description="Read-only checks of this host's rails. Each check prints ok/warn/fail/skip, the evidence "
        "and the command that fixes it. Exit code: 0 no fail, 1 at least one fail, 2 usage error.",
    )
    _add_arguments(p)
    p.set_defaults(func=_cmd)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", metavar="HOST[,HOST...]",
                   help="peer address(es): enables path-MTU pings and the `ip route get` egress test; "
                   "one address per rail is paired by subnet")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    p.add_argument("--root", default="/", metavar="DIR",
                   help="read /sys and /proc under DIR and recorded command outputs from DIR/.cmd (fixtures)")
    p.add_argument("--sysfs", metavar="DIR", help="sysfs tree for the GPU-NIC layout checks (default: ROOT/sys)")
    p.add_argument("--rails", metavar="IF1,IF2", help="rail interfaces (default: auto-detect, reported)")
    p.add_argument("--peer-ucx-version", metavar="X.Y.Z", help="the peer's UCX version (`ucx_info -v` there)")
    p.add_argument("--transport", metavar="KIND[,KIND...]",
                   help="what an agent on these rails is asked to run: auto (default, or $MULTIRAIL_TRANSPORT), tcp, "
                   "ucx, or one per rail; the transport check says what each rail would run and why")


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (`python -m multirail.doctor`)."""
    p = argparse.ArgumentParser(prog="multirail doctor")
    _add_arguments(p)
    return _cmd(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
