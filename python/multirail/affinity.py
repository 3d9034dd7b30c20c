"""Which rails carry which memory, and where each rail's threads run (issue 34).

`AgentConfig.affinity` becomes, per memory location ("gpu:K": CUDA ordinal K as this process
sees it; "numa:N": host memory on NUMA node N), ordered tiers of the agent's rails: a transfer
stripes over the first tier of its local memory's location that has a rail up, and falls back to
the next tier only when every rail of the nearer ones is down (docs/topology.md, "The engine").

* ``"auto"`` (default): with ``rails="auto"``, from the machine's topology
  (:mod:`multirail.topology`): per GPU and per NUMA node, the NICs' tiers by PCIe distance class
  (PIX, PXB, PHB, NODE, SYS), fastest first. The sysfs root is ``$MULTIRAIL_SYSFS_ROOT``
  (default /sys), the hint file ``$MULTIRAIL_TOPOLOGY_HINTS``, the CUDA view
  ``$MULTIRAIL_TOPOLOGY_GPUS`` (what ``multirail topology --sysfs/--hints/--gpus`` take).
  With an explicit rail list every transfer uses those rails (give a mapping to tier them).
* ``"topology"``: as ``"auto"``, for any rail list (the listed rails, tiered by the topology;
  what ``multirail bench --gpu K`` and the testbed use).
* ``"none"``: every transfer over every rail, threads where the OS puts them (the behaviour
  before issue 34).
* a dict: ``{"gpu:0": [["eth0", "eth1"], ["eth2"]], "numa:0": ["eth2"], "cpus": {"eth0":
  "0-15"}}``: per location a list of tiers (each a list of rail names, addresses or indices, or
  ``{"class": "PIX", "rails": [...]}``), or one tier as a flat list; ``"cpus"`` (optional) the
  CPU list per rail its threads run on (else read from sysfs). Applies to any rail list.

A location with no tiers (memory elsewhere, an unknown node) uses every rail.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from multirail.errors import InvalidArgumentError
from multirail.topology import MAX_CPUS


@dataclass
class TierInfo:
    """One tier of one location: the rails (agent rail indices), their class and why."""

    cls: str
    rails: list[int]
    reason: str = ""


@dataclass
class Affinity:
    """The resolved setting: tiers per location, CPU lists per rail, and where it came from."""

    tiers: dict[str, list[TierInfo]] = field(default_factory=dict)
    cpus: list[list[int]] = field(default_factory=list)
    source: str = "none"
    notes: list[str] = field(default_factory=list)

    def core_args(self) -> tuple[list[tuple[str, list[list[int]]]], list[list[int]]]:
        """What `_core.Agent.set_topology` takes."""
        return [(loc, [t.rails for t in ts]) for loc, ts in self.tiers.items()], self.cpus

    def describe(self, names: list[str]) -> dict[str, Any]:
        """For `Agent.affinity_info()`, bench output and docs: per location its tiers by name."""
        return {
            "source": self.source,
            "notes": list(self.notes),
            "locations": {
                loc: [{"tier": i, "class": t.cls, "rails": [names[r] for r in t.rails], "reason": t.reason}
                      for i, t in enumerate(ts)]
                for loc, ts in self.tiers.items()
            },
        }

    def tier_class(self, loc: str | None, tier: int | None) -> tuple[str | None, str | None]:
        """(class, reason) of tier `tier` of `loc`."""
        if loc is None or tier is None:
            return None, None
        ts = self.tiers.get(loc) or []
        if 0 <= tier < len(ts):
            return ts[tier].cls, ts[tier].reason
        return None, None


def parse_loc(key: Any) -> str:
    """"gpu:K" / "numa:N", checked."""
    if isinstance(key, str):
        kind, _, n = key.strip().partition(":")
        if kind in ("gpu", "numa") and n.strip().isdigit():
            return f"{kind}:{int(n)}"
    raise InvalidArgumentError(f"affinity: location {key!r} is not 'gpu:K' or 'numa:N'")


def _rail_index(item: Any, names: list[str], addrs: list[str]) -> int:
    if isinstance(item, int) and not isinstance(item, bool):
        if 0 <= item < len(names):
            return item
    elif isinstance(item, str):
        for i, (n, a) in enumerate(zip(names, addrs)):
            if item in (n, a):
                return i
    raise InvalidArgumentError(f"affinity names rail {item!r}, which is not one of this agent's rails {names}")


def parse_cpulist(text: str) -> list[int]:
    """A kernel CPU list ("0-3,8,10-11") as CPU numbers."""
    out: list[int] = []
    for part in (p.strip() for p in text.strip().split(",")):
        if not part:
            continue
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if hi < lo:
            raise ValueError(f"range {part!r} runs backwards")
        if hi >= MAX_CPUS:
            raise ValueError(f"CPU {hi} is beyond any kernel's (at most {MAX_CPUS - 1})")
        out.extend(range(lo, hi + 1))
    return out


def _cpulist(text: Any) -> list[int]:
    if isinstance(text, (list, tuple)):
        return [int(c) for c in text]
    try:
        return parse_cpulist(str(text))
    except ValueError as e:
        raise InvalidArgumentError(f"affinity cpus: {text!r} is not a CPU list ({e})") from None


def _explicit(spec: dict, names: list[str], addrs: list[str]) -> Affinity:
    out = Affinity(source="explicit")
    for key, val in spec.items():
        if key == "cpus":
            continue
        loc = parse_loc(key)
        if not isinstance(val, (list, tuple)):
            raise InvalidArgumentError(f"affinity {loc}: expected a list of tiers, not {type(val).__name__}")
        flat = all(isinstance(v, (str, int)) for v in val)
        tiers: list[TierInfo] = []
        for i, t in enumerate([list(val)] if flat else val):
            if isinstance(t, dict):
                rails, cls = t.get("rails", []), str(t.get("class", f"tier{i}"))
            else:
                rails, cls = t, f"tier{i}"
            if isinstance(rails, (str, int)):
                rails = [rails]
            idx = list(dict.fromkeys(_rail_index(r, names, addrs) for r in rails))
            if idx:
                tiers.append(TierInfo(cls, idx, "explicit"))
        if tiers:
            out.tiers[loc] = tiers
    cpus = spec.get("cpus") or {}
    if not isinstance(cpus, dict):
        raise InvalidArgumentError("affinity cpus: expected {rail: cpu list}")
    per = {_rail_index(k, names, addrs): _cpulist(v) for k, v in cpus.items()}
    out.cpus = [per.get(i, []) for i in range(len(names))]
    if not per:
        out.cpus = _sysfs_cpus(names, os.environ.get("MULTIRAIL_SYSFS_ROOT") or "/sys")
    return out


def _sysfs_cpus(names: list[str], root: str) -> list[list[int]]:
    """Each rail's NIC-local CPUs from sysfs (<root>/class/{net,infiniband}/NAME/device/
    local_cpulist; [] when unknown: a veth, an address-only rail)."""
    out = []
    for n in names:
        cpus: list[int] = []
        for cls in ("net", "infiniband"):
            try:
                with open(os.path.join(root, "class", cls, n, "device", "local_cpulist")) as f:
                    cpus = parse_cpulist(f.read())
                break
            except (OSError, ValueError):
                continue
        out.append(cpus)
    return out


def _auto(names: list[str], rdma: list[str]) -> Affinity:
    root = os.environ.get("MULTIRAIL_SYSFS_ROOT") or "/sys"
    out = Affinity(source=f"topology of {root}")
    try:
        from multirail import topology
    except ImportError as e:
        out.source, out.notes = "none", [f"no topology module ({e})"]
        return out
    try:
        topo = topology.Topology.load(root, gpus=os.environ.get("MULTIRAIL_TOPOLOGY_GPUS") or None,
                                      hints=os.environ.get("MULTIRAIL_TOPOLOGY_HINTS") or None)
        plan = topo.rail_plan()
    except Exception as e:  # noqa: BLE001 - a topology that cannot be read never fails the agent
        warnings.warn(f"multirail: affinity='auto': topology of {root} unreadable ({e}); every rail serves all memory",
                      RuntimeWarning, stacklevel=3)
        out.source, out.notes = "none", [f"topology unreadable: {e}"]
        return out
    out.notes = list(getattr(plan, "warnings", []) or [])

    def tiers_of(ts: list[Any]) -> list[TierInfo]:
        got = []
        for t in ts:
            idx = []
            for n in t.nics:
                for i, (name, dev) in enumerate(zip(names, rdma)):
                    if n.netdev and n.netdev == name or (n.rdma and dev and n.rdma == dev):
                        idx.append(i)
            idx = list(dict.fromkeys(idx))
            if idx:
                got.append(TierInfo(t.cls, idx, t.reason))
        return got

    for k in sorted(getattr(plan, "ordinals", {}) or {}):
        try:
            ts = tiers_of(plan.for_gpu(k))
        except Exception:  # noqa: BLE001 - an ordinal this process cannot see
            continue
        if ts:
            out.tiers[f"gpu:{k}"] = ts
    for node in sorted(getattr(plan, "numa", {}) or {}):
        ts = tiers_of(plan.for_numa(node))
        if ts:
            out.tiers[f"numa:{node}"] = ts
    out.cpus = _sysfs_cpus(names, root)
    if not out.tiers:
        out.notes.append("no rail of this agent is in the topology's plan: every rail serves all memory")
    return out


def resolve(spec: Any, rails_spec: Any, rows: list[tuple]) -> Affinity:
    """The `affinity` setting for the resolved rail rows (name, addr, ..., rdma, bind)."""
    names = [r[0] for r in rows]
    addrs = [r[1] for r in rows]
    rdma = [r[6] for r in rows]
    if spec is None or spec == "none":
        return Affinity()
    if isinstance(spec, dict):
        if not rows:
            raise InvalidArgumentError("affinity maps rails, but the agent has one default rail (set rails)")
        return _explicit(spec, names, addrs)
    if spec == "auto" or spec == "topology":
        if (spec == "auto" and rails_spec != "auto") or len(rows) < 2:
            return Affinity(notes=[f"affinity {spec!r} applies to "
                                   + ("rails='auto' with several rails" if spec == "auto" else "several rails")])
        return _auto(names, rdma)
    raise InvalidArgumentError(f"affinity must be 'auto', 'topology', 'none' or a dict of location -> tiers, not {spec!r}")
