"""Stand a planned fabric up on one machine: one network namespace per node, FRR per router.

Emulation model
---------------
* Every spine, leaf and server is a namespace named ``<prefix>-<node>``.
* Spine-leaf links are veth pairs with the planned /30 addresses (leaf ``up<k>`` to spine k,
  spine ``dn<i>`` to leaf i), MTU = fabric MTU.
* A leaf's rail VLAN is a Linux bridge ``vlan<id>`` carrying the SVI address (the rail's
  gateway); server NICs are veth pairs whose leaf end ``dn<j>`` is a bridge port. Same-rail
  traffic is switched by the leaf; cross-rail traffic is routed leaf -> spine -> leaf.
* Each router runs FRR's zebra, bfdd and bgpd (Debian's ``frr`` package) with the frr.conf
  from :func:`multirail.fabric.plan.render_frr`, its own pid files, zserv socket, BFD control
  socket and vty socket directory under ``<state dir>/routers/<name>/``.
* Servers run no routing daemon. They get exactly the netplan intent
  (:func:`multirail.fabric.plan.server_intent`) as ``ip`` commands, plus strict rp_filter, so
  a missing per-rail rule shows up as dropped cross-rail traffic, as on real hosts.

State lives in ``<state dir>/state.json`` (default ``/run/multirail-fabric/<prefix>``) and is
written *before* anything is created, so ``down`` removes exactly what ``up`` made (the
recorded namespaces, the FRR daemons whose pid files and command lines point into the state
dir, and any process left inside those namespaces) even after a partial ``up``.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from multirail.errors import MultirailError
from multirail.fabric.model import Leaf, Server, Spine, Topology, parse_topology
from multirail.fabric.plan import render_frr, server_intent

FRR_DIR = Path("/usr/lib/frr")
FRR_DAEMONS = ("zebra", "bfdd", "bgpd")
STATE_ROOT = Path("/run/multirail-fabric")
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,40}$")


class FabricError(MultirailError):
    """The emulated fabric cannot be brought up, inspected or torn down; the message says why."""


class NotUpError(FabricError):
    """No state directory exists for the named fabric instance."""


# ----------------------------------------------------------------------------- helpers

def _run(args: list[str], timeout: float = 15.0, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=input)
    except subprocess.TimeoutExpired:
        raise FabricError(f"timed out after {timeout:.0f} s: {' '.join(args)}") from None
    except FileNotFoundError:
        raise FabricError(f"command not found: {args[0]}") from None
    if check and p.returncode != 0:
        raise FabricError(f"`{' '.join(args)}` failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


def _ip_batch(ns: str | None, lines: list[str]) -> None:
    """Run many `ip` commands in one process (in namespace ``ns`` if given)."""
    if not lines:
        return
    args = ["ip"] + (["-n", ns] if ns else []) + ["-batch", "-"]
    _run(args, input="\n".join(lines) + "\n")


def _sysctl(ns: str, settings: dict[str, str | int]) -> None:
    _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *[f"{k}={v}" for k, v in settings.items()]])


def existing_namespaces() -> set[str]:
    p = _run(["ip", "-j", "netns", "list"], check=False)
    try:
        return {e["name"] for e in json.loads(p.stdout or "[]")}
    except (json.JSONDecodeError, KeyError, TypeError):
        return {line.split()[0] for line in p.stdout.splitlines() if line.strip()}


def default_prefix(topo: Topology) -> str:
    return f"mr-{topo.name}"[:40]


def check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix):
        raise FabricError(f"invalid prefix {prefix!r}: letter first, then letters, digits, '-' or '_' (at most 41)")
    return prefix


def preflight(need_frr: bool = True) -> None:
    """Refuse clearly without root, iproute2 or FRR."""
    if os.geteuid() != 0:
        raise FabricError("the fabric emulation needs root (network namespaces); run it with sudo")
    if shutil.which("ip") is None:
        raise FabricError("iproute2 (`ip`) is not installed")
    if need_frr:
        missing = [d for d in FRR_DAEMONS if not (FRR_DIR / d).exists()]
        if missing or shutil.which("vtysh") is None:
            what = ", ".join([str(FRR_DIR / d) for d in missing] + ([] if shutil.which("vtysh") else ["vtysh"]))
            raise FabricError(f"FRR is not installed (missing {what}); install Debian's `frr` package")
        try:
            pwd.getpwnam("frr")
        except KeyError:
            raise FabricError("FRR's `frr` user does not exist; reinstall the `frr` package") from None


# ----------------------------------------------------------------------------- instance

@dataclass
class Instance:
    """One emulated copy of a topology: namespace prefix + state directory."""

    topo: Topology
    prefix: str
    state_dir: Path
    topology_file: str = ""

    @classmethod
    def create(cls, topo: Topology, prefix: str | None, state_dir: str | None, topology_file: str = "") -> Instance:
        pfx = check_prefix(prefix or default_prefix(topo))
        return cls(topo, pfx, Path(state_dir) if state_dir else STATE_ROOT / pfx, topology_file)

    @classmethod
    def load(cls, prefix: str | None, state_dir: str | None, topo: Topology | None = None) -> Instance:
        """Find a running instance by state dir, prefix or topology (its default prefix)."""
        if state_dir is None:
            if prefix is None and topo is None:
                raise FabricError("give the topology file, --prefix or --state-dir")
            state_dir = str(STATE_ROOT / check_prefix(prefix or default_prefix(topo)))  # type: ignore[arg-type]
        st = Path(state_dir) / "state.json"
        try:
            state = json.loads(st.read_text())
            saved = parse_topology(state["topology_text"], state.get("topology_file") or str(st))
            return cls(saved, state["prefix"], Path(state_dir), state.get("topology_file", ""))
        except FileNotFoundError:
            raise NotUpError(f"no fabric is up with state dir {state_dir} (no {st}); run `multirail fabric up` first") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise FabricError(f"{st} is damaged ({exc}); run `multirail fabric down` with the topology to clean up") from None

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    @property
    def namespaces(self) -> list[str]:
        return [self.ns(n.name) for n in (*self.topo.routers, *self.topo.servers)]

    def router_dir(self, name: str) -> Path:
        return self.state_dir / "routers" / name

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def write_state(self, phase: str) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = {"version": 1, "prefix": self.prefix, "phase": phase, "topology_file": self.topology_file,
                 "topology_text": self.topo.source_text, "namespaces": self.namespaces}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    def status(self) -> dict[str, Any]:
        """Namespaces and rail addresses (what `multirail bench` needs), and daemon liveness."""
        present = existing_namespaces()
        servers = [{"name": s.name, "namespace": self.ns(s.name),
                    "rails": [{"rail": n.rail, "nic": n.name, "address": str(n.address), "mtu": n.mtu} for n in s.nics]}
                   for s in self.topo.servers]
        routers = []
        for r in self.topo.routers:
            pids = {d: _live_pid(self.router_dir(r.name), d) for d in FRR_DAEMONS}
            routers.append({"name": r.name, "namespace": self.ns(r.name), "asn": r.asn,
                            "role": "leaf" if isinstance(r, Leaf) else "spine", "daemons": pids,
                            "vty_socket_dir": str(self.router_dir(r.name))})
        phase = "unknown"
        try:
            phase = json.loads(self.state_file.read_text()).get("phase", "unknown")
        except (OSError, json.JSONDecodeError):
            phase = "absent"
        return {"prefix": self.prefix, "state_dir": str(self.state_dir), "phase": phase,
                "namespaces_present": all(n in present for n in self.namespaces),
                "servers": servers, "routers": routers}


def _live_pid(rdir: Path, daemon: str) -> int | None:
    """The pid in ``rdir/<daemon>.pid`` if that process is alive and is our daemon."""
    try:
        pid = int((rdir / f"{daemon}.pid").read_text().strip())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return None
    return pid if str(rdir) in cmd and daemon in cmd else None


def _kill_pids(pids: list[int], grace: float = 3.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _is_zombie(p)]
        time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


# ----------------------------------------------------------------------------- up

def up(inst: Instance, timeout: float = 60.0, log: Any = print) -> float:
    """Create namespaces, links, addresses, policy routing; start FRR; wait for convergence.

    Returns the convergence time in seconds. Refuses if any part of the instance exists. On
    failure, tears down what it created and raises :class:`FabricError`.
    """
    preflight()
    clash = sorted(set(inst.namespaces) & existing_namespaces())
    if inst.state_file.exists() or clash:
        raise FabricError(f"fabric {inst.prefix} is already (partly) up "
                          f"({'state ' + str(inst.state_file) if inst.state_file.exists() else 'namespaces ' + ', '.join(clash)}); "
                          "run `multirail fabric down` first or pick another --prefix")
    _check_frr_can_reach(inst.state_dir / "routers")
    inst.write_state("creating")
    t0 = time.monotonic()
    try:
        _build_network(inst)
        log(f"namespaces and links ready in {time.monotonic() - t0:.1f} s; starting FRR")
        _start_frr(inst)
        t1 = time.monotonic()
        _wait_converged(inst, timeout)
        converged = time.monotonic() - t1
        inst.write_state("up")
        return converged
    except BaseException:
        down(inst, log=lambda *_: None)
        raise


def _build_network(inst: Instance) -> None:
    topo = inst.topo
    for n in inst.namespaces:
        _run(["ip", "netns", "add", n])
    links: list[str] = []
    for li, leaf in enumerate(topo.leaves):
        for si, spine in enumerate(topo.spines):
            links.append(f"link add up{si} netns {inst.ns(leaf.name)} type veth peer name dn{li} netns {inst.ns(spine.name)}")
    for sj, server in enumerate(topo.servers):
        for nic in server.nics:
            leaf = topo.leaf_for_rail(nic.rail)
            links.append(f"link add {nic.name} netns {inst.ns(server.name)} type veth peer name dn{sj} netns {inst.ns(leaf.name)}")
    _ip_batch(None, links)

    for r in topo.routers:
        _configure_router(inst, r)
    for server in topo.servers:
        _configure_server(inst, server)


def _configure_router(inst: Instance, r: Spine | Leaf) -> None:
    topo, mtu = inst.topo, inst.topo.mtu
    cmds = ["link set lo up", f"addr add {r.router_id}/32 dev lo"]
    spine_idx = {s.name: i for i, s in enumerate(topo.spines)}
    leaf_idx = {lf.name: i for i, lf in enumerate(topo.leaves)}
    for lk in topo.links:
        if lk.leaf == r.name:
            dev, addr = f"up{spine_idx[lk.spine]}", lk.leaf_ip
        elif lk.spine == r.name:
            dev, addr = f"dn{leaf_idx[lk.leaf]}", lk.spine_ip
        else:
            continue
        cmds += [f"link set {dev} mtu {mtu}", f"addr add {addr} dev {dev}", f"link set {dev} up"]
    if isinstance(r, Leaf):
        br = f"vlan{r.vlan}"
        cmds += [f"link add {br} type bridge stp_state 0", f"link set {br} mtu {mtu}",
                 f"addr add {r.gateway_interface} dev {br}", f"link set {br} up"]
        for sj, server in enumerate(topo.servers):
            if any(n.rail == r.rail for n in server.nics):
                cmds += [f"link set dn{sj} mtu {mtu}", f"link set dn{sj} master {br}", f"link set dn{sj} up"]
        for net in r.announce:
            cmds.append(f"addr add {net} dev lo" if net.prefixlen == 32 else f"route add blackhole {net}")
    _ip_batch(inst.ns(r.name), cmds)
    _sysctl(inst.ns(r.name), {"net.ipv4.ip_forward": 1, "net.ipv4.conf.all.rp_filter": 0,
                              "net.ipv4.conf.default.rp_filter": 0, "net.ipv6.conf.all.disable_ipv6": 1})


def _configure_server(inst: Instance, server: Server) -> None:
    """The netplan intent, as ip commands; strict rp_filter and no ARP flux, like a tuned host."""
    cmds = ["link set lo up"]
    sysctls: dict[str, str | int] = {"net.ipv4.conf.all.rp_filter": 1, "net.ipv4.conf.default.rp_filter": 1,
                                     "net.ipv6.conf.all.disable_ipv6": 1}
    for ri in server_intent(inst.topo, server):
        cmds += [f"link set {ri.nic} mtu {ri.mtu}", f"addr add {ri.address} dev {ri.nic}", f"link set {ri.nic} up"]
        for rt in ri.routes:
            via = f"via {rt.via} dev {ri.nic}" if rt.via else f"dev {ri.nic} scope link"
            cmds.append(f"route add {rt.to} {via} table {ri.table}")
        cmds.append(f"rule add from {ri.address.ip} table {ri.table} priority {ri.rule_priority}")
        sysctls[f"net.ipv4.conf.{ri.nic}.rp_filter"] = 1
        sysctls[f"net.ipv4.conf.{ri.nic}.arp_ignore"] = 1    # answer ARP only for this NIC's address
        sysctls[f"net.ipv4.conf.{ri.nic}.arp_announce"] = 2  # and announce it only from this NIC
    _ip_batch(inst.ns(server.name), cmds)
    _sysctl(inst.ns(server.name), sysctls)


def _check_frr_can_reach(path: Path) -> None:
    """FRR drops to the `frr` user: every directory above its files must be searchable."""
    frr = pwd.getpwnam("frr")
    for d in path.resolve().parents:
        try:
            st = d.stat()
        except FileNotFoundError:
            continue  # created by us later, mode 0755
        if not (st.st_mode & 0o001 or (st.st_uid == frr.pw_uid and st.st_mode & 0o100)
                or (st.st_gid == frr.pw_gid and st.st_mode & 0o010)):
            raise FabricError(f"FRR runs as user frr, which cannot enter {d} (mode {oct(st.st_mode & 0o777)}); "
                              "use a --state-dir under a world-searchable directory such as /run")


def _start_frr(inst: Instance) -> None:
    frr = pwd.getpwnam("frr")
    for r in inst.topo.routers:
        d = inst.router_dir(r.name)
        d.mkdir(parents=True, exist_ok=True)
        conf = d / "frr.conf"
        conf.write_text(render_frr(inst.topo, r, log_file=str(d / "frr.log")))
        for p in (inst.state_dir, inst.state_dir / "routers"):
            p.chmod(0o755)
        os.chown(d, frr.pw_uid, frr.pw_gid)
        os.chown(conf, frr.pw_uid, frr.pw_gid)
        for daemon in FRR_DAEMONS:
            args = ["ip", "netns", "exec", inst.ns(r.name), str(FRR_DIR / daemon), "-d", "-f", str(conf),
                    "-i", str(d / f"{daemon}.pid"), "-z", str(d / "zserv.api"), "--vty_socket", str(d), "-P", "0"]
            if daemon == "bfdd":
                args += ["--bfdctl", str(d / "bfdd.sock")]
            _run(args, timeout=20)


def vtysh_json(inst: Instance, router: str, command: str, timeout: float = 10.0) -> Any:
    p = _run(["vtysh", "--vty_socket", str(inst.router_dir(router)), "-c", command], timeout=timeout, check=False)
    if p.returncode != 0:
        raise FabricError(f"vtysh on {router} failed: {(p.stderr or p.stdout).strip()}")
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError:
        raise FabricError(f"vtysh on {router} returned no JSON for {command!r}: {p.stdout[:200]!r}") from None


def _wait_converged(inst: Instance, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending: list[str] = []
    while time.monotonic() < deadline:
        checks = check_bgp(inst) + check_ecmp(inst) + (check_bfd(inst) if inst.topo.bfd else [])
        pending = [c.name + ": " + c.evidence for c in checks if not c.ok]
        if not pending:
            return
        time.sleep(0.5)
    raise FabricError(f"fabric did not converge within {timeout:.0f} s:\n  " + "\n  ".join(pending))


# ----------------------------------------------------------------------------- down

def down(inst: Instance, log: Any = print) -> list[str]:
    """Kill our FRR daemons and any process in our namespaces, delete them, remove state."""
    preflight(need_frr=False)
    names = list(inst.namespaces)
    try:
        names += [n for n in json.loads(inst.state_file.read_text()).get("namespaces", []) if n not in names]
    except (OSError, json.JSONDecodeError, AttributeError):
        pass
    done: list[str] = []
    daemons = [pid for r in inst.topo.routers for d in FRR_DAEMONS
               if (pid := _live_pid(inst.router_dir(r.name), d)) is not None]
    if daemons:
        _kill_pids(daemons)
        done.append(f"stopped {len(daemons)} FRR daemons")
    present = existing_namespaces()
    for ns in names:
        if ns not in present:
            continue
        p = _run(["ip", "netns", "pids", ns], check=False)
        leftovers = [int(x) for x in p.stdout.split() if x.isdigit()]
        if leftovers:
            _kill_pids(leftovers)
            done.append(f"killed {len(leftovers)} process(es) left in {ns}")
        _run(["ip", "netns", "del", ns])
        done.append(f"deleted namespace {ns}")
    if inst.state_dir.exists():
        shutil.rmtree(inst.state_dir, ignore_errors=True)
        done.append(f"removed {inst.state_dir}")
    for line in done:
        log(line)
    return done


# ----------------------------------------------------------------------------- verify

@dataclass
class Check:
    name: str
    ok: bool
    evidence: str
    detail: dict[str, Any] = field(default_factory=dict)


def check_bgp(inst: Instance) -> list[Check]:
    out = []
    for r in inst.topo.routers:
        want = {str(n.peer_ip): n.peer_name for n in inst.topo.neighbors(r)}
        try:
            peers = vtysh_json(inst, r.name, "show bgp ipv4 unicast summary json").get("peers", {})
        except FabricError as exc:
            out.append(Check(f"bgp {r.name}", False, str(exc)))
            continue
        states = {ip: peers.get(ip, {}).get("state", "absent") for ip in want}
        ev = ", ".join(f"{want[ip]} {ip} {st}" for ip, st in states.items())
        out.append(Check(f"bgp {r.name}", all(s == "Established" for s in states.values()), ev, {"peers": states}))
    return out


def check_bfd(inst: Instance) -> list[Check]:
    out = []
    for r in inst.topo.routers:
        want = {str(n.peer_ip) for n in inst.topo.neighbors(r)}
        try:
            peers = vtysh_json(inst, r.name, "show bfd peers json")
        except FabricError as exc:
            out.append(Check(f"bfd {r.name}", False, str(exc)))
            continue
        states = {ip: "absent" for ip in want}
        states.update({p.get("peer"): p.get("status", "?") for p in peers if p.get("peer") in want})
        ev = ", ".join(f"{ip} {st}" for ip, st in sorted(states.items()))
        out.append(Check(f"bfd {r.name}", all(s == "up" for s in states.values()), ev, {"peers": states}))
    return out


def check_ecmp(inst: Instance) -> list[Check]:
    """Each leaf reaches every other rail's subnet over one kernel nexthop per spine."""
    out = []
    topo = inst.topo
    for leaf in topo.leaves:
        want_hops = {str(n.peer_ip) for n in topo.neighbors(leaf)}
        for other in topo.leaves:
            if other is leaf:
                continue
            p = _run(["ip", "-n", inst.ns(leaf.name), "-j", "route", "show", str(other.subnet)], check=False)
            hops = _nexthops(p.stdout)
            ok = hops == want_hops
            ev = f"{other.subnet} via {', '.join(sorted(hops)) or 'nothing'} (want {len(want_hops)} paths: {', '.join(sorted(want_hops))})"
            out.append(Check(f"ecmp {leaf.name} -> rail {other.rail}", ok, ev, {"nexthops": sorted(hops)}))
    return out


def _nexthops(route_json: str) -> set[str]:
    try:
        routes = json.loads(route_json or "[]")
    except json.JSONDecodeError:
        return set()
    hops: set[str] = set()
    for rt in routes:
        if "gateway" in rt:
            hops.add(rt["gateway"])
        for nh in rt.get("nexthops", []) or []:
            if "gateway" in nh:
                hops.add(nh["gateway"])
    return hops


def check_policy(inst: Instance) -> list[Check]:
    """Each server NIC has its `from <addr> lookup <table>` rule and a route in that table."""
    out = []
    for server in inst.topo.servers:
        ns = inst.ns(server.name)
        rules = json.loads(_run(["ip", "-n", ns, "-j", "rule", "show"]).stdout or "[]")
        for ri in server_intent(inst.topo, server):
            addr = str(ri.address.ip)
            have = [r for r in rules if r.get("src") == addr and str(r.get("table")) == str(ri.table)]
            table = json.loads(_run(["ip", "-n", ns, "-j", "route", "show", "table", str(ri.table)], check=False).stdout or "[]")
            routes = [f"{r.get('dst')} dev {r.get('dev')}" for r in table]
            problems = []
            if not have:
                problems.append(f"no rule `from {addr} lookup {ri.table}`: traffic sourced from {addr} uses the main table")
            if not any(r.get("dev") == ri.nic for r in table):
                problems.append(f"table {ri.table} has no route via {ri.nic}")
            ev = "; ".join(problems) or f"rule from {addr} lookup {ri.table}; table {ri.table}: {', '.join(routes)}"
            out.append(Check(f"policy {server.name} {ri.nic} (rail {ri.rail})", not problems, ev))
    return out


def _peer_addresses(inst: Instance, server: Any) -> list[tuple[Any, Any]]:
    """(peer server, peer NIC) for every NIC of every other server."""
    return [(s, n) for s in inst.topo.servers if s is not server for n in s.nics]


def check_source_routes(inst: Instance) -> list[Check]:
    out = []
    for server in inst.topo.servers:
        for nic in server.nics:
            for peer, pnic in _peer_addresses(inst, server):
                p = _run(["ip", "-n", inst.ns(server.name), "-j", "route", "get", str(pnic.address),
                          "from", str(nic.address)], check=False)
                try:
                    dev = json.loads(p.stdout)[0].get("dev", "?")
                except (json.JSONDecodeError, IndexError, AttributeError):
                    dev = f"error: {(p.stderr or p.stdout).strip()}"
                ok = dev == nic.name
                ev = f"to {pnic.address} from {nic.address} leaves on {dev}" + ("" if ok else f", expected {nic.name} (rail {nic.rail})")
                out.append(Check(f"source-route {server.name} {nic.address} -> {peer.name} {pnic.address}", ok, ev))
    return out


def _rp_filter_drops(ns: str) -> int:
    p = _run(["ip", "netns", "exec", ns, "cat", "/proc/net/netstat"], check=False)
    lines = p.stdout.splitlines()
    for head, vals in zip(lines[::2], lines[1::2]):
        if head.startswith("TcpExt:"):
            d = dict(zip(head.split()[1:], vals.split()[1:]))
            return int(d.get("IPReversePathFilter", 0))
    return 0


def check_pings(inst: Instance, jumbo: bool) -> list[Check]:
    """Ping every peer address from every rail address (in parallel). With ``jumbo``, send a
    don't-fragment packet filling the NIC MTU (MTU end to end)."""
    jobs = []
    for server in inst.topo.servers:
        for nic in server.nics:
            for peer, pnic in _peer_addresses(inst, server):
                size = min(nic.mtu, pnic.mtu) - 28 if jumbo else 56
                args = ["ip", "netns", "exec", inst.ns(server.name), "ping", "-n", "-q", "-c", "1", "-W", "2",
                        "-I", str(nic.address), "-s", str(size)] + (["-M", "do"] if jumbo else [])
                args.append(str(pnic.address))
                proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                jobs.append((server, nic, peer, pnic, size, proc))
    out = []
    for server, nic, peer, pnic, size, proc in jobs:
        try:
            text, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        kind = "same-rail" if nic.rail == pnic.rail else "cross-rail"
        label = "mtu" if jumbo else "reach"
        ok = proc.returncode == 0
        ev = f"{size + 28}-byte {'DF ' if jumbo else ''}ping {nic.address} -> {pnic.address} {'ok' if ok else 'FAILED'}"
        if not ok:
            last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            ev += f" ({last[0].strip()}); rp_filter drops in {peer.name}: {_rp_filter_drops(inst.ns(peer.name))}, " \
                  f"in {server.name}: {_rp_filter_drops(inst.ns(server.name))}"
        out.append(Check(f"{label} {kind} {server.name} {nic.address} -> {peer.name} {pnic.address}", ok, ev))
    return out


def check_mtus(inst: Instance) -> list[Check]:
    out = []
    for server in inst.topo.servers:
        links = json.loads(_run(["ip", "-n", inst.ns(server.name), "-j", "link", "show"]).stdout or "[]")
        mtus = {ln.get("ifname"): ln.get("mtu") for ln in links}
        bad = [f"{n.name} {mtus.get(n.name)} (want {n.mtu})" for n in server.nics if mtus.get(n.name) != n.mtu]
        out.append(Check(f"mtu {server.name} interfaces", not bad,
                         "; ".join(bad) or ", ".join(f"{n.name} {n.mtu}" for n in server.nics)))
    return out


def verify(inst: Instance) -> list[Check]:
    """All checks: BGP, BFD, ECMP, policy rules, source routes, reachability, MTU."""
    preflight()
    if not all(n in existing_namespaces() for n in inst.namespaces):
        raise FabricError(f"fabric {inst.prefix} is not up (namespaces missing); run `multirail fabric up`")
    checks = check_bgp(inst)
    if inst.topo.bfd:
        checks += check_bfd(inst)
    checks += check_ecmp(inst) + check_policy(inst) + check_source_routes(inst)
    checks += check_pings(inst, jumbo=False) + check_mtus(inst) + check_pings(inst, jumbo=True)
    return checks


def checks_json(checks: list[Check]) -> dict[str, Any]:
    return {"ok": all(c.ok for c in checks), "failed": sum(not c.ok for c in checks),
            "checks": [asdict(c) for c in checks]}


__all__ = ["FabricError", "NotUpError", "Instance", "Check", "up", "down", "verify", "checks_json", "preflight",
           "default_prefix"]
