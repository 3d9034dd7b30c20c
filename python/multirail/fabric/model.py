"""Topology model of a rail-optimized fabric: parse a YAML description, validate it, and
expose it as frozen dataclasses.

The model
---------
* **Spines** are eBGP routers that connect every leaf (typically sharing one ASN).
* **Leaves are rails.** Leaf *i* serves rail *i*: one VLAN, one subnet, and an SVI (the
  rail's gateway) in that subnet. Each leaf has its own ASN and connects to every spine over
  a numbered point-to-point link (eBGP with BFD; ECMP over the spines).
* **Servers** are hosts with one NIC per rail. NIC *i* sits in rail *i*'s subnet and gets a
  routing table of its own plus an ``ip rule from <nic address> table <rail table>`` so that
  traffic sourced from a rail leaves on that rail (per-rail source routing).

Validation collects every problem it finds (overlapping subnets, duplicate ASNs, a NIC on
two rails, an MTU larger than the fabric's, unknown keys, bad addresses ...) and raises one
:class:`TopologyError` listing them all, each prefixed by the YAML path it concerns.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

from multirail.errors import InvalidArgumentError

IPv4Address = ipaddress.IPv4Address
IPv4Network = ipaddress.IPv4Network
IPv4Interface = ipaddress.IPv4Interface

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,30}$")
_IFNAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,14}$")  # Linux IFNAMSIZ - 1 = 15


class TopologyError(InvalidArgumentError):
    """The topology file is unreadable or describes an invalid fabric.

    ``problems`` lists every problem found, each starting with the YAML path it concerns.
    """

    def __init__(self, problems: list[str], source: str = "topology") -> None:
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


@dataclass(frozen=True)
class Qos:
    """RoCEv2 lossless class: traffic marked DSCP ``roce_dscp`` or on ``roce_udp_ports`` goes
    to qos-group/CoS ``pfc_cos``, which is PFC-protected and ECN-marked."""

    roce_dscp: int = 26
    roce_udp_ports: tuple[int, ...] = (4791,)
    pfc_cos: int = 3
    ecn: bool = True


@dataclass(frozen=True)
class Spine:
    name: str
    asn: int
    router_id: IPv4Address


@dataclass(frozen=True)
class Leaf:
    """A leaf switch, which is also a rail."""

    name: str
    rail: int
    asn: int
    router_id: IPv4Address
    vlan: int
    subnet: IPv4Network
    gateway: IPv4Address
    table: int
    announce: tuple[IPv4Network, ...] = ()

    @property
    def gateway_interface(self) -> IPv4Interface:
        return IPv4Interface(f"{self.gateway}/{self.subnet.prefixlen}")


@dataclass(frozen=True)
class Link:
    """A numbered point-to-point link between a spine and a leaf."""

    spine: str
    leaf: str
    spine_ip: IPv4Interface
    leaf_ip: IPv4Interface
    spine_port: str
    leaf_port: str


@dataclass(frozen=True)
class Nic:
    name: str
    rail: int
    address: IPv4Address
    mtu: int
    leaf_port: str


@dataclass(frozen=True)
class Server:
    name: str
    nics: tuple[Nic, ...]


@dataclass(frozen=True)
class Neighbor:
    """One eBGP session as seen from a router."""

    local_ip: IPv4Interface
    peer_ip: IPv4Address
    peer_asn: int
    peer_name: str
    local_port: str


@dataclass(frozen=True)
class Topology:
    name: str
    mtu: int
    server_mtu: int
    bfd: bool
    server_routes: tuple[IPv4Network, ...]
    qos: Qos
    spines: tuple[Spine, ...]
    leaves: tuple[Leaf, ...]
    links: tuple[Link, ...]
    servers: tuple[Server, ...]
    source_text: str = field(default="", compare=False, repr=False)

    @property
    def routers(self) -> tuple[Spine | Leaf, ...]:
        return (*self.spines, *self.leaves)

    def leaf_for_rail(self, rail: int) -> Leaf:
        for leaf in self.leaves:
            if leaf.rail == rail:
                return leaf
        raise KeyError(f"no leaf serves rail {rail}")

    def router(self, name: str) -> Spine | Leaf:
        for r in self.routers:
            if r.name == name:
                return r
        raise KeyError(f"no router named {name!r}")

    def neighbors(self, router: Spine | Leaf) -> list[Neighbor]:
        """The eBGP sessions of ``router``, in link order."""
        out: list[Neighbor] = []
        for link in self.links:
            if link.spine == router.name:
                peer = self.router(link.leaf)
                out.append(Neighbor(link.spine_ip, link.leaf_ip.ip, peer.asn, peer.name, link.spine_port))
            elif link.leaf == router.name:
                peer = self.router(link.spine)
                out.append(Neighbor(link.leaf_ip, link.spine_ip.ip, peer.asn, peer.name, link.leaf_port))
        return out

    def servers_on(self, leaf: Leaf) -> list[tuple[Server, Nic]]:
        return [(s, n) for s in self.servers for n in s.nics if n.rail == leaf.rail]


# ----------------------------------------------------------------------------- parsing

T = TypeVar("T")


class _Reader:
    """Reads typed fields out of YAML mappings, recording problems instead of raising."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def mapping(self, value: Any, path: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return {}
        for key in value:
            if key not in allowed:
                self.problems.append(f"{path}.{key}: unknown key (allowed: {', '.join(sorted(allowed))})")
        return value

    def seq(self, value: Any, path: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return []
        return value

    def get(self, d: dict[str, Any], key: str, path: str, conv: Callable[[Any], T],
            default: T | None = None, required: bool = True) -> T | None:
        if key not in d or d[key] is None:
            if required and default is None:
                self.problems.append(f"{path}.{key}: missing")
            return default
        try:
            return conv(d[key])
        except (ValueError, TypeError) as exc:
            self.problems.append(f"{path}.{key}: {exc}")
            return None


def _int_in(lo: int, hi: int, what: str) -> Callable[[Any], int]:
    def conv(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{what} must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise ValueError(f"{what} {v} out of range {lo}..{hi}")
        return v
    return conv


def _name(v: Any) -> str:
    if not isinstance(v, str) or not _NAME_RE.match(v):
        raise ValueError(f"{v!r} is not a valid name (letter first, then letters, digits, '-' or '_', at most 31)")
    return v


def _ifname(v: Any) -> str:
    if not isinstance(v, str) or not _IFNAME_RE.match(v):
        raise ValueError(f"{v!r} is not a valid Linux interface name (at most 15 characters)")
    return v


def _port(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{v!r} is not a port name")
    return v.strip()


def _addr(v: Any) -> IPv4Address:
    try:
        return IPv4Address(str(v))
    except ipaddress.AddressValueError:
        raise ValueError(f"{v!r} is not an IPv4 address") from None


def _net(v: Any) -> IPv4Network:
    try:
        return IPv4Network(str(v), strict=True)
    except (ipaddress.AddressValueError, ipaddress.NetmaskValueError, ValueError):
        raise ValueError(f"{v!r} is not an IPv4 network in CIDR form (host bits must be zero)") from None


def _iface(v: Any) -> IPv4Interface:
    s = str(v)
    if "/" not in s:
        raise ValueError(f"{v!r} needs a prefix length, e.g. 10.4.0.1/30")
    try:
        return IPv4Interface(s)
    except (ipaddress.AddressValueError, ipaddress.NetmaskValueError, ValueError):
        raise ValueError(f"{v!r} is not an IPv4 address with prefix length") from None


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


_ASN = _int_in(1, 4294967294, "ASN")
_MTU = _int_in(1280, 9216, "fabric MTU")
_HOST_MTU = _int_in(1280, 65535, "MTU")


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; raise :class:`TopologyError` on any problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TopologyError([f"cannot read: {exc.strerror or exc}"], str(p)) from None
    return parse_topology(text, str(p))


def parse_topology(text: str, source: str = "topology") -> Topology:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TopologyError([f"not valid YAML: {exc}"], source) from None
    r = _Reader()
    top = r.mapping(doc, "<top>", {"name", "fabric", "spines", "leaves", "links", "servers"})
    if not top:
        raise TopologyError(r.problems or ["empty topology"], source)
    name = r.get(top, "name", "<top>", _name) or "fabric"

    fab = r.mapping(top.get("fabric") or {}, "fabric",
                    {"mtu", "server_mtu", "bfd", "p2p_pool", "server_routes", "qos"})
    mtu = r.get(fab, "mtu", "fabric", _MTU, 9216) or 9216
    server_mtu = r.get(fab, "server_mtu", "fabric", _HOST_MTU, 9000) or 9000
    if server_mtu > mtu:
        r.problems.append(f"fabric.server_mtu: {server_mtu} is larger than the fabric MTU {mtu}")
    bfd = r.get(fab, "bfd", "fabric", _bool, True)
    pool = r.get(fab, "p2p_pool", "fabric", _net, IPv4Network("10.4.0.0/24"))
    routes = tuple(x for x in (r.get({"v": v}, "v", f"fabric.server_routes[{i}]", _net)
                               for i, v in enumerate(r.seq(fab.get("server_routes"), "fabric.server_routes")))
                   if x is not None) or (IPv4Network("0.0.0.0/0"),)
    qos = _parse_qos(r, fab.get("qos") or {})

    spines = _parse_spines(r, top.get("spines"))
    leaves = _parse_leaves(r, top.get("leaves"))
    links = _parse_links(r, top.get("links"), spines, leaves, pool)
    servers = _parse_servers(r, top.get("servers"), leaves, server_mtu, mtu)

    _check_cross(r, spines, leaves, links, servers)
    if r.problems:
        raise TopologyError(r.problems, source)
    return Topology(name=name, mtu=mtu, server_mtu=server_mtu, bfd=bool(bfd), server_routes=routes,
                    qos=qos, spines=tuple(spines), leaves=tuple(leaves), links=tuple(links),
                    servers=tuple(servers), source_text=text)


def _parse_qos(r: _Reader, raw: Any) -> Qos:
    q = r.mapping(raw, "fabric.qos", {"roce_dscp", "roce_udp_ports", "pfc_cos", "ecn"})
    ports = tuple(p for p in (r.get({"v": v}, "v", f"fabric.qos.roce_udp_ports[{i}]", _int_in(1, 65535, "UDP port"))
                              for i, v in enumerate(r.seq(q.get("roce_udp_ports"), "fabric.qos.roce_udp_ports")))
                  if p is not None) or (4791,)
    return Qos(roce_dscp=r.get(q, "roce_dscp", "fabric.qos", _int_in(0, 63, "DSCP"), 26) or 26,
               roce_udp_ports=ports,
               pfc_cos=r.get(q, "pfc_cos", "fabric.qos", _int_in(0, 7, "CoS"), 3) or 0,
               ecn=bool(r.get(q, "ecn", "fabric.qos", _bool, True)))


def _parse_spines(r: _Reader, raw: Any) -> list[Spine]:
    out: list[Spine] = []
    items = r.seq(raw, "spines")
    if not items:
        r.problems.append("spines: at least one spine is required")
    for i, item in enumerate(items):
        path = f"spines[{i}]"
        d = r.mapping(item, path, {"name", "asn", "router_id"})
        name, asn, rid = r.get(d, "name", path, _name), r.get(d, "asn", path, _ASN), r.get(d, "router_id", path, _addr)
        if name is not None and asn is not None and rid is not None:
            out.append(Spine(name, asn, rid))
    return out


def _parse_leaves(r: _Reader, raw: Any) -> list[Leaf]:
    out: list[Leaf] = []
    items = r.seq(raw, "leaves")
    if not items:
        r.problems.append("leaves: at least one leaf (rail) is required")
    for i, item in enumerate(items):
        path = f"leaves[{i}]"
        d = r.mapping(item, path, {"name", "rail", "asn", "router_id", "vlan", "subnet", "gateway", "table", "announce"})
        name = r.get(d, "name", path, _name)
        rail = r.get(d, "rail", path, _int_in(0, 255, "rail"))
        asn = r.get(d, "asn", path, _ASN)
        rid = r.get(d, "router_id", path, _addr)
        vlan = r.get(d, "vlan", path, _int_in(2, 4094, "VLAN"))
        subnet = r.get(d, "subnet", path, _net)
        table = r.get(d, "table", path, _int_in(1, 252, "routing table"), (rail or 0) + 100)
        gateway = r.get(d, "gateway", path, _addr, None, required=False)
        if subnet is not None and gateway is None:
            if subnet.num_addresses < 4:
                r.problems.append(f"{path}.subnet: {subnet} is too small for servers and a gateway")
                continue
            gateway = subnet.broadcast_address - 1
        announce = tuple(x for x in (r.get({"v": v}, "v", f"{path}.announce[{j}]", _net)
                                     for j, v in enumerate(r.seq(d.get("announce"), f"{path}.announce"))) if x is not None)
        if None in (name, rail, asn, rid, vlan, subnet, gateway, table):
            continue
        assert subnet is not None and gateway is not None  # for the type checker; checked above
        if gateway not in subnet or gateway in (subnet.network_address, subnet.broadcast_address):
            r.problems.append(f"{path}.gateway: {gateway} is not a usable host address of {subnet}")
        out.append(Leaf(name, rail, asn, rid, vlan, subnet, gateway, table, announce))  # type: ignore[arg-type]
    return out


def _parse_links(r: _Reader, raw: Any, spines: list[Spine], leaves: list[Leaf], pool: IPv4Network | None) -> list[Link]:
    """Explicit links must cover every spine-leaf pair; without `links`, /30s come from the pool."""
    spine_names = [s.name for s in spines]
    leaf_names = [lf.name for lf in leaves]
    if raw is None:
        if pool is None:
            return []
        subnets = pool.subnets(new_prefix=30) if pool.prefixlen <= 30 else iter(())
        out: list[Link] = []
        for li, leaf in enumerate(leaves):
            for si, spine in enumerate(spines):
                net = next(subnets, None)
                if net is None:
                    r.problems.append(f"fabric.p2p_pool: {pool} is too small for {len(spines) * len(leaves)} /30 links")
                    return out
                hosts = list(net.hosts())
                out.append(Link(spine.name, leaf.name, IPv4Interface(f"{hosts[0]}/30"), IPv4Interface(f"{hosts[1]}/30"),
                                f"Ethernet1/{li + 1}", f"Ethernet1/{49 + si}"))
        return out
    out = []
    seen: dict[tuple[str, str], str] = {}
    for i, item in enumerate(r.seq(raw, "links")):
        path = f"links[{i}]"
        d = r.mapping(item, path, {"spine", "leaf", "spine_ip", "leaf_ip", "spine_port", "leaf_port"})
        sname, lname = r.get(d, "spine", path, _name), r.get(d, "leaf", path, _name)
        sip, lip = r.get(d, "spine_ip", path, _iface), r.get(d, "leaf_ip", path, _iface)
        if sname is not None and sname not in spine_names:
            r.problems.append(f"{path}.spine: no spine named {sname!r}")
        if lname is not None and lname not in leaf_names:
            r.problems.append(f"{path}.leaf: no leaf named {lname!r}")
        if None in (sname, lname, sip, lip) or sname not in spine_names or lname not in leaf_names:
            continue
        assert sname is not None and lname is not None and sip is not None and lip is not None
        if (sname, lname) in seen:
            r.problems.append(f"{path}: second link between {sname} and {lname} (first is {seen[sname, lname]})")
            continue
        seen[sname, lname] = path
        if sip.network != lip.network or sip.ip == lip.ip:
            r.problems.append(f"{path}: spine_ip {sip} and leaf_ip {lip} must be two different addresses of one subnet")
            continue
        sport = r.get(d, "spine_port", path, _port, f"Ethernet1/{leaf_names.index(lname) + 1}")
        lport = r.get(d, "leaf_port", path, _port, f"Ethernet1/{49 + spine_names.index(sname)}")
        out.append(Link(sname, lname, sip, lip, sport or "", lport or ""))
    for lname in leaf_names:
        for sname in spine_names:
            if (sname, lname) not in seen:
                r.problems.append(f"links: leaf {lname} has no link to spine {sname} (every leaf must reach every spine)")
    return out


def _parse_servers(r: _Reader, raw: Any, leaves: list[Leaf], server_mtu: int, fabric_mtu: int) -> list[Server]:
    rails = {lf.rail: lf for lf in leaves}
    out: list[Server] = []
    items = r.seq(raw, "servers")
    if not items:
        r.problems.append("servers: at least one server is required")
    for i, item in enumerate(items):
        path = f"servers[{i}]"
        d = r.mapping(item, path, {"name", "nics"})
        sname = r.get(d, "name", path, _name)
        nics: list[Nic] = []
        nic_rail: dict[str, tuple[int, str]] = {}
        rail_nic: dict[int, str] = {}
        for j, nitem in enumerate(r.seq(d.get("nics"), f"{path}.nics")):
            npath = f"{path}.nics[{j}]"
            nd = r.mapping(nitem, npath, {"name", "rail", "address", "mtu", "leaf_port"})
            nname = r.get(nd, "name", npath, _ifname)
            rail = r.get(nd, "rail", npath, _int_in(0, 255, "rail"))
            addr = r.get(nd, "address", npath, _addr)
            mtu = r.get(nd, "mtu", npath, _HOST_MTU, server_mtu) or server_mtu
            if None in (nname, rail, addr):
                continue
            assert nname is not None and rail is not None and addr is not None
            if nname in nic_rail and nic_rail[nname][0] != rail:
                r.problems.append(f"{npath}: NIC {nname} of {sname} is on two rails "
                                  f"({nic_rail[nname][0]} at {nic_rail[nname][1]} and {rail}); a NIC belongs to exactly one rail")
                continue
            if nname in nic_rail:
                r.problems.append(f"{npath}: NIC {nname} of {sname} is listed twice")
                continue
            nic_rail[nname] = (rail, npath)
            if rail in rail_nic:
                r.problems.append(f"{npath}: {sname} has two NICs on rail {rail} ({rail_nic[rail]} and {nname}); "
                                  "a rail-optimized server has one NIC per rail")
                continue
            rail_nic[rail] = nname
            if mtu > fabric_mtu:
                r.problems.append(f"{npath}.mtu: {mtu} is larger than the fabric MTU {fabric_mtu}")
            leaf = rails.get(rail)
            if leaf is None:
                r.problems.append(f"{npath}.rail: no leaf serves rail {rail}")
                continue
            if addr not in leaf.subnet or addr in (leaf.subnet.network_address, leaf.subnet.broadcast_address):
                r.problems.append(f"{npath}.address: {addr} is not a host address of rail {rail}'s subnet {leaf.subnet}")
            elif addr == leaf.gateway:
                r.problems.append(f"{npath}.address: {addr} is rail {rail}'s gateway")
            port = r.get(nd, "leaf_port", npath, _port, f"Ethernet1/{len(out) + 1}")
            nics.append(Nic(nname, rail, addr, mtu, port or ""))
        if sname is not None:
            if not nics and not any(p.startswith(path) for p in r.problems):
                r.problems.append(f"{path}.nics: a server needs at least one NIC")
            out.append(Server(sname, tuple(nics)))
    return out


def _check_cross(r: _Reader, spines: list[Spine], leaves: list[Leaf], links: list[Link], servers: list[Server]) -> None:
    """Uniqueness and overlap checks across the whole fabric."""
    names: dict[str, str] = {}
    named: list[tuple[str, list[Spine] | list[Leaf] | list[Server]]] = [
        ("spine", spines), ("leaf", leaves), ("server", servers)]
    for kind, objs in named:
        for o in objs:
            if o.name in names:
                r.problems.append(f"name {o.name!r} is used by a {names[o.name]} and a {kind}")
            names[o.name] = kind

    spine_asns = {s.asn for s in spines}
    leaf_asn: dict[int, str] = {}
    for lf in leaves:
        if lf.asn in leaf_asn:
            r.problems.append(f"duplicate ASN {lf.asn}: leaves {leaf_asn[lf.asn]} and {lf.name} "
                              "(each leaf needs its own ASN in an eBGP fabric)")
        elif lf.asn in spine_asns:
            r.problems.append(f"duplicate ASN {lf.asn}: leaf {lf.name} uses a spine's ASN")
        leaf_asn.setdefault(lf.asn, lf.name)

    for attr, what in (("rail", "rail"), ("vlan", "VLAN"), ("table", "routing table")):
        seen: dict[int, str] = {}
        for lf in leaves:
            v = getattr(lf, attr)
            if v in seen:
                r.problems.append(f"duplicate {what} {v}: leaves {seen[v]} and {lf.name}")
            seen[v] = lf.name

    rids: dict[IPv4Address, str] = {}
    routers: list[Spine | Leaf] = [*spines, *leaves]
    for rt in routers:
        if rt.router_id in rids:
            r.problems.append(f"duplicate router_id {rt.router_id}: {rids[rt.router_id]} and {rt.name}")
        rids[rt.router_id] = rt.name

    nets: list[tuple[IPv4Network, str]] = [(lf.subnet, f"rail {lf.rail} subnet ({lf.name})") for lf in leaves]
    nets += [(lk.spine_ip.network, f"link {lk.spine}-{lk.leaf}") for lk in links]
    nets += [(IPv4Network(f"{rt.router_id}/32"), f"router_id of {rt.name}") for rt in routers]
    nets += [(n, f"announce of {lf.name}") for lf in leaves for n in lf.announce]
    for a in range(len(nets)):
        for b in range(a + 1, len(nets)):
            if nets[a][0].overlaps(nets[b][0]):
                r.problems.append(f"overlapping subnets: {nets[a][1]} {nets[a][0]} and {nets[b][1]} {nets[b][0]}")

    addrs: dict[IPv4Address, str] = {}
    for s in servers:
        for n in s.nics:
            if n.address in addrs:
                r.problems.append(f"duplicate address {n.address}: {addrs[n.address]} and {s.name}/{n.name}")
            addrs[n.address] = f"{s.name}/{n.name}"
