"""Per-rail byte counters read around each timed loop (issue 3, bench side).

A rail is named by an interface or an IPv4 address; addresses are mapped to their interface
with `multirail.netinfo.interface_for_addr`. `netinfo.read_counters` returns RDMA port
counters when an RDMA device backs the interface (port_xmit_data x 4) and the netdev
statistics otherwise. The initiator counts received bytes for READ (data flows towards it)
and transmitted bytes for WRITE. Counters of another network namespace are only visible from
inside it, which is why `bench local --testbed` runs the initiator in the initiator's namespace.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from multirail.bench.core import RailRow


@dataclass
class RailSpec:
    """One rail as the bench sees it: interface, capacity (if known), counter source."""

    label: str
    ifname: str | None
    capacity_gbps: float | None
    problem: str | None = None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def resolve_rails(rails: list[str], capacities_bps: list[float | None] | None = None) -> list[RailSpec]:
    """Map rail names/addresses to interfaces. Problems are recorded, never raised."""
    try:
        from multirail import netinfo
    except ImportError:
        return [RailSpec(r, None, None, "multirail.netinfo is not available") for r in rails]
    specs = []
    for i, rail in enumerate(rails):
        cap_bps = capacities_bps[i] if capacities_bps and i < len(capacities_bps) else None
        iface = None
        try:
            if _is_ip(rail):
                iface = netinfo.interface_for_addr(rail)
            else:
                iface = next((x for x in netinfo.interfaces() if x.name == rail), None)
        except OSError as e:
            specs.append(RailSpec(rail, None, None, f"cannot inspect interfaces: {e}"))
            continue
        if iface is None:
            specs.append(RailSpec(rail, None, None, f"no local interface carries {rail}"))
            continue
        if cap_bps is None and iface.speed_mbps:
            cap_bps = iface.speed_mbps * 1e6
        specs.append(RailSpec(rail, iface.name, cap_bps / 1e9 if cap_bps else None))
    return specs


class RailCounters:
    """Snapshot/delta of the counters of a fixed set of rails."""

    def __init__(self, specs: list[RailSpec], op: str) -> None:
        seen: set[str] = set()
        self.specs = []  # one entry per interface: two rail addresses on `lo` count once
        for s in specs:
            if s.ifname and s.ifname not in seen:
                seen.add(s.ifname)
                self.specs.append(s)
        self.problems = [f"rail {s.label}: {s.problem}" for s in specs if s.problem]
        self.direction = "rx" if op == "READ" else "tx"

    def snapshot(self) -> dict[str, tuple[int, str]]:
        from multirail import netinfo

        out: dict[str, tuple[int, str]] = {}
        for s in self.specs:
            assert s.ifname is not None  # filtered in __init__
            try:
                c = netinfo.read_counters(s.ifname)
            except OSError as e:
                self.problems.append(f"rail {s.label}: {e}")
                continue
            out[s.ifname] = (c.rx_bytes if self.direction == "rx" else c.tx_bytes, c.source)
        return out

    def delta(self, before: dict[str, tuple[int, str]], after: dict[str, tuple[int, str]],
              seconds: float) -> list[RailRow]:
        rows = []
        for s in self.specs:
            if s.ifname not in before or s.ifname not in after:
                continue
            b = max(0, after[s.ifname][0] - before[s.ifname][0])
            rows.append(RailRow(name=s.ifname, bytes=b, gbps=b * 8 / seconds / 1e9 if seconds > 0 else 0.0,
                                source=after[s.ifname][1], capacity_gbps=s.capacity_gbps))
        return rows
