"""GPU and NIC topology from sysfs, and the NICs (rails) each memory location should use.

Model
-----
1. **Facts** (:meth:`Topology.load`). Read from a sysfs root (``/sys`` by default; tests point it
   at a generated fixture tree, tests/topo_fixtures.py):

   * PCI devices: ``<root>/bus/pci/devices/<BDF>`` is a link; its realpath below
     ``<root>/devices`` split into components is the device's *PCI path*, e.g.
     ``("pci0000:17", "0000:17:01.0", "0000:18:00.0")``. The ``pciDDDD:BB`` root-bus component
     and the domain are kept. Per device: ``vendor``, ``device``, ``class``, ``numa_node``
     (``-1`` = unknown, kept as -1, never skipped), ``local_cpulist``, ``current/max_link_width``
     and ``current/max_link_speed``.
   * GPUs: vendor 0x10de, class 0x0302xx (3D) or 0x0300xx (VGA: GB10, workstations).
   * NICs: every RDMA device under ``<root>/class/infiniband`` (EFA included: it has no netdev)
     and every netdev under ``<root>/class/net`` whose ``device`` is a PCI function, merged per
     PCI function: a NIC has a netdev name, an RDMA device name, or both. A RoCE port's netdev
     is its GID table's (``ports/1/gid_attrs/ndevs/0``) when there is one: a RoCE LAG's
     ``mlx5_bond_0`` is named by ``bond0``, not by PF 0's enslaved netdev.
   * CUDA view: which CUDA ordinal / UUID is which PCI bus id. From ``gpus=`` (a JSON list of
     ``{"ordinal", "uuid", "pci_bus_id"}`` or the CSV of ``nvidia-smi --query-gpu=index,uuid,
     pci.bus_id --format=csv``), else from ``nvidia-smi`` when reading the live ``/sys``, else
     ordinal = ascending PCI bus id. :meth:`Topology.gpu_bus_id` maps a *process* ordinal
     through ``CUDA_VISIBLE_DEVICES`` (indices, GPU or MIG UUIDs), so one process per GPU (or
     per MIG slice: its parent GPU's NICs) works; MIG UUIDs come from ``nvidia-smi -L`` or a
     ``"mig_uuids"`` list in a ``gpus=`` entry.

2. **Distance class** (:func:`classify`) of a GPU-NIC pair, in nvidia-smi's sense, by comparing
   PCI path *components* (never character prefixes):

   * ``PIX``: below the deepest common component each side has at most one bridge (one switch,
     or two functions of one device);
   * ``PXB``: a common bridge, but more bridges on a side (nested switches: DGX H100's GPU
     behind the ConnectX-7's internal switch);
   * ``PHB``: only the root-bus component ``pciDDDD:BB`` in common (the host bridge);
   * ``NODE``: nothing in common (other root bus or domain), same NUMA node;
   * ``SYS``: nothing in common, other NUMA node.

   With ``numa_node = -1`` on either side, the two devices' ``local_cpulist`` decide (disjoint
   sets: SYS, else NODE); with nothing known the host is taken as one node (DGX Spark).

3. **Rail plan** (:meth:`Topology.rail_plan`, a pure function of the facts) for every GPU and every
   NUMA node with CPUs: ordered :class:`Tier` s of :class:`NicChoice` (nearest class first;
   within a tier, fastest link first, then PCI address), with a reason per choice and per
   :class:`Exclusion`. Candidates and exclusions:

   * Only RDMA NICs when the host has any (a netdev without RDMA, e.g. AWS ENA or a management
     NIC, is excluded); on a host without RDMA, every PCI netdev is a candidate.
   * Excluded unless asked for (``include=``): ``"dpu"`` BlueField DPU functions (0xa2d6,
     0xa2dc, or ``hca_type`` MT41686/MT41692); ``"storage"`` NICs at PHB or farther from every
     GPU while every GPU has a NIC of its own, not excluded otherwise (a down port counts), at
     PXB or better (DGX storage/in-band NICs; a GPU without one keeps every far NIC);
     ``"narrow"`` x1 functions (NVLink management CX-7 on HGX B200) and NICs that carry less
     than a quarter of the fastest candidate (port rate capped by the PCIe link: Azure's
     accelerated-networking VF next to 400G IB VFs); ``"down"`` RDMA ports that are not
     ACTIVE; ``"vf"`` SR-IOV VFs whose PF is a NIC of this host (same port and link);
     ``"sys"`` NICs on another NUMA node while a nearer NIC exists (a GPU or node with
     no nearer NIC keeps its SYS NICs as the last tier).
   * **Shared-switch rule** (``share="split"``, the default): when G GPUs have the same best
     tier (class PIX, PXB or PHB) of N NICs and N >= G, the NICs (by PCI address) are split
     into G contiguous slices, GPU i (by PCI address) taking slice i; the slice is the first
     tier and the siblings' slices form the next tier of the same class, before any farther
     class (p5en: GPU 0000:59 -> rdmap85s0, rdmap86s0, then rdmap87s0, rdmap88s0, then the
     other switch). N < G, ``share="all"``, or a NODE/SYS best tier: every GPU gets the whole
     tier (a flat VM's GPUs cannot be told apart without a hint).
   * **Hints** (``hints=``, a JSON object ``{"<gpu pci bus id>": ["<nic netdev, RDMA name or
     PCI address>", ...]}``): the named NICs become a first tier ``HINT`` for that GPU (the
     rest follow by class). A topology where no GPU has a NIC at PHB or better, with more than
     one GPU, says it needs one (:attr:`Topology.warnings`); Azure ND v5 is such a VM.

4. **Affinity** (:func:`nic_affinity`): the local CPUs and NUMA node of a netdev, for pinning
   a rail's threads (the engine's rails are netdevs).

API (what the engine consumes)::

    topo = Topology.load(root="/sys", gpus=None, hints=None)
    plan = topo.rail_plan(include=(), share="split")
    plan.for_gpu("0000:1b:00.0") or plan.for_gpu(0)  # -> list[Tier]; 0 = CUDA ordinal
    plan.for_numa(0)                                  # -> list[Tier]; [] for an unknown node
    tier.cls, tier.nics[i].netdev / .rdma / .pci / .link_gbps / .cpus / .numa_node / .reason
    tier.nics[i].pcie_link                            # "dddd:bb:dd": functions sharing one PCIe link
    nic_affinity("ibp24s0")                           # -> NicAffinity(cpus, numa_node)

docs/topology.md describes the rules with the fixtures that pin them (tests/test_topology.py).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "CLASSES",
    "TopologyError",
    "PciDevice",
    "Gpu",
    "Nic",
    "NicChoice",
    "Tier",
    "Exclusion",
    "RailPlan",
    "Topology",
    "NicAffinity",
    "classify",
    "nic_affinity",
    "normalize_bus_id",
    "parse_cpulist",
]

CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")
_RANK = {c: i for i, c in enumerate(CLASSES)}
NVIDIA = 0x10DE
MELLANOX = 0x15B3
DPU_DEVICE_IDS = {0xA2D2, 0xA2D6, 0xA2DC, 0xA2DF}  # BlueField-1/2/3 (+ BF-3 LX)
DPU_HCA_TYPES = {"MT41682", "MT41686", "MT41692"}
# GPUs attached to their CPU by NVLink-C2C (shared/topology-notes.md 1.3, 1.6): every NIC is NODE
# or SYS to them by design, and NCCL runs GPUDirect over GPU -> C2C -> CPU -> PCIe (its P2C).
C2C_GPU_IDS = {0x2941: "GB200", 0x2E12: "GB10"}
INCLUDE_KEYS = ("dpu", "storage", "narrow", "down", "sys", "tcp", "vf")
_BDF_RE = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_ROOT_RE = re.compile(r"^pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}$")


class TopologyError(Exception):
    """Bad input: an unreadable or malformed --gpus/--hints file, an unknown GPU or root."""


# ---------------------------------------------------------------------------------------------
# Small parsers


def normalize_bus_id(text: str) -> str:
    """``00000000:1B:00.0`` / ``0000:1b:00.0`` / ``1b:00.0`` -> ``0000:1b:00.0`` (lowercase, at
    least 4 domain digits, leading zeros beyond 4 dropped)."""
    t = text.strip().lower()
    if t.count(":") == 1:
        t = "0000:" + t
    m = _BDF_RE.match(t)
    if not m:
        raise TopologyError(f"not a PCI bus id: {text!r} (expected DDDD:BB:DD.F)")
    dom = m.group(1).lstrip("0").rjust(4, "0")
    return f"{dom}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


# CPU numbers at or above this are no kernel's (x86's largest NR_CPUS is 8192): a list naming
# one is malformed (crates/multirail-nixl/src/topo.rs has the same bound).
MAX_CPUS = 1 << 16


def parse_cpulist(text: str | None) -> tuple[int, ...]:
    """``0-55,112-167`` -> (0, 1, ..., 167); empty, unreadable or naming a CPU of
    ``MAX_CPUS`` or above -> ()."""
    out: list[int] = []
    for part in (text or "").strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                first, last = int(lo), int(hi)
            else:
                first = last = int(part)
        except ValueError:
            return ()
        if last >= MAX_CPUS:
            return ()
        out.extend(range(first, last + 1))
    return tuple(sorted(set(out)))


def format_cpulist(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> ``0-2,5``."""
    cs = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(cs):
        j = i
        while j + 1 < len(cs) and cs[j + 1] == cs[j] + 1:
            j += 1
        runs.append(str(cs[i]) if i == j else f"{cs[i]}-{cs[j]}")
        i = j + 1
    return ",".join(runs)


def _link_speed(text: str | None) -> float | None:
    """``32.0 GT/s PCIe`` / ``8 GT/s`` -> 32.0 / 8.0; ``Unknown`` -> None."""
    m = re.match(r"\s*([0-9.]+)\s*GT/s", text or "")
    return float(m.group(1)) if m else None


def pcie_gbps(speed_gts: float | None, width: int | None) -> float | None:
    """Usable Gbit/s of a PCIe link: GT/s x lanes x encoding (8b/10b below 8 GT/s, 128b/130b
    from 8 GT/s; PAM4/FLIT of Gen6 counted as 1.0)."""
    if not speed_gts or not width:
        return None
    enc = 0.8 if speed_gts < 8 else (128 / 130 if speed_gts < 64 else 1.0)
    return round(speed_gts * width * enc, 1)


def _rate_gbps(text: str | None) -> float | None:
    """RDMA port ``rate``: ``400 Gb/sec (4X NDR)`` -> 400.0."""
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text or "")
    return float(m.group(1)) if m else None


def _hexint(text: str | None) -> int | None:
    try:
        return int((text or "").strip(), 16) if text else None
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# Facts


@dataclass(frozen=True)
class PciDevice:
    """One PCI function as sysfs shows it."""

    bdf: str
    path: tuple[str, ...]  # realpath components below <root>/devices, root bus first, bdf last
    vendor: int | None
    device: int | None
    pci_class: int | None
    numa_node: int  # -1: unknown
    cpus: tuple[int, ...]  # local_cpulist
    cur_width: int | None
    max_width: int | None
    cur_speed: float | None  # GT/s
    max_speed: float | None
    physfn: str | None = None  # SR-IOV VF: its PF's bus id (the ``physfn`` link)

    @property
    def pcie_link(self) -> str:
        """``dddd:bb:dd``: the functions of one device share its one PCIe link."""
        return self.bdf.rsplit(".", 1)[0]

    @property
    def domain(self) -> str:
        return self.bdf.split(":")[0]

    @property
    def root_bus(self) -> str | None:
        """The ``pciDDDD:BB`` component, None for a device outside any (a bare VMBus path has one)."""
        return next((c for c in self.path if _ROOT_RE.match(c)), None)

    @property
    def max_gbps(self) -> float | None:
        return pcie_gbps(self.max_speed, self.max_width)

    @property
    def cur_gbps(self) -> float | None:
        return pcie_gbps(self.cur_speed, self.cur_width)

    def pci_chain(self) -> tuple[str, ...]:
        """The components from the root bus down (VMBus / ACPI prefixes dropped)."""
        p = self.path
        for i, c in enumerate(p):
            if _ROOT_RE.match(c):
                return p[i:]
        return p[-1:]


@dataclass(frozen=True)
class Gpu:
    pci: PciDevice
    ordinal: int  # CUDA ordinal as the CUDA view (or PCI order) gives it
    uuid: str | None
    mig_uuids: tuple[str, ...] = ()  # MIG devices on this GPU (nvidia-smi -L), as CUDA_VISIBLE_DEVICES names them

    @property
    def bus_id(self) -> str:
        return self.pci.bdf


@dataclass(frozen=True)
class Nic:
    pci: PciDevice
    netdev: str | None
    rdma: str | None
    hca_type: str | None
    link_layer: str | None
    port_state: str | None  # "ACTIVE", "DOWN", ... of port 1; None when unknown or no RDMA
    rate_gbps: float | None  # RDMA port rate, else netdev speed

    @property
    def name(self) -> str:
        return self.netdev or self.rdma or self.pci.bdf

    @property
    def link_gbps(self) -> float | None:
        """What the NIC can move: its port rate capped by its PCIe link (max width and speed)."""
        vals = [v for v in (self.rate_gbps, self.pci.max_gbps) if v]
        return min(vals) if vals else None

    @property
    def is_dpu(self) -> bool:
        return (self.pci.vendor == MELLANOX and self.pci.device in DPU_DEVICE_IDS) or (self.hca_type or "") in DPU_HCA_TYPES


def _dev_info(dev_dir: Path, sys_root: Path) -> PciDevice:
    real = Path(os.path.realpath(dev_dir))
    try:
        rel = real.relative_to(Path(os.path.realpath(sys_root / "devices")))
        path = tuple(rel.parts)
    except ValueError:
        path = (real.name,)

    def rd(name: str) -> str | None:
        try:
            return (real / name).read_text(errors="replace").strip()
        except (OSError, ValueError):
            return None

    def rint(name: str) -> int | None:
        try:
            return int(rd(name) or "", 0)
        except ValueError:
            return None

    numa = rint("numa_node")
    pf = Path(os.path.realpath(real / "physfn")) if os.path.lexists(real / "physfn") else None
    return PciDevice(
        bdf=normalize_bus_id(real.name),
        path=path,
        vendor=_hexint(rd("vendor")),
        device=_hexint(rd("device")),
        pci_class=_hexint(rd("class")),
        numa_node=numa if numa is not None and numa >= 0 else -1,
        cpus=parse_cpulist(rd("local_cpulist")),
        cur_width=rint("current_link_width") or None,
        max_width=rint("max_link_width") or None,
        cur_speed=_link_speed(rd("current_link_speed")),
        max_speed=_link_speed(rd("max_link_speed")),
        physfn=normalize_bus_id(pf.name) if pf is not None and _BDF_RE.match(pf.name) else None,
    )


def _read(p: Path) -> str | None:
    try:
        return p.read_text(errors="replace").strip()
    except (OSError, ValueError):
        return None


def _pci_dir_of(link: Path) -> Path | None:
    """The PCI function directory a ``class/*/X/device`` link points at, if it is one; a virtio
    NIC's link points at ``.../<BDF>/virtio<N>``, whose parent is the function."""
    try:
        real = Path(os.path.realpath(link))
    except OSError:
        return None
    if not real.is_dir():
        return None
    if _BDF_RE.match(real.name):
        return real
    return real.parent if re.fullmatch(r"virtio\d+", real.name) and _BDF_RE.match(real.parent.name) else None


@dataclass(frozen=True)
class NicAffinity:
    """Where a NIC is: its local CPUs (() unknown) and NUMA node (-1 unknown)."""

    cpus: tuple[int, ...]
    numa_node: int


def nic_affinity(netdev: str, root: str | os.PathLike[str] = "/sys") -> NicAffinity:
    """Local CPUs and NUMA node of a netdev (or an RDMA device name), from sysfs; a bond is
    where its first lower PCI netdev (``lower_*``) is. A virtual interface (veth, a namespace's
    view) gives ``NicAffinity((), -1)``."""
    r = Path(root)
    links = [r / "class" / cls / netdev / "device" for cls in ("net", "infiniband")]
    lower = r / "class" / "net" / netdev
    if lower.is_dir():  # a bond (RoCE LAG's bond0): where its first lower PCI netdev is
        links += [lower / x / "device" for x in sorted(os.listdir(lower)) if x.startswith("lower_")]
    for link in links:
        dev = _pci_dir_of(link)
        if dev is not None:
            numa = _read(dev / "numa_node")
            try:
                node = int(numa or "-1")
            except ValueError:
                node = -1
            return NicAffinity(parse_cpulist(_read(dev / "local_cpulist")), node if node >= 0 else -1)
    return NicAffinity((), -1)


# ---------------------------------------------------------------------------------------------
# Distance


def _common_len(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def classify(a: PciDevice, b: PciDevice) -> str:
    """nvidia-smi's class of the path between two PCI functions (see the module docstring)."""
    pa, pb = a.pci_chain(), b.pci_chain()
    n = _common_len(pa[:-1], pb[:-1])  # a device is never its own ancestor
    if n >= 2:  # a common bridge below the root bus
        below_a, below_b = len(pa) - 1 - n, len(pb) - 1 - n
        return "PIX" if below_a <= 1 and below_b <= 1 else "PXB"
    if n == 1 and _ROOT_RE.match(pa[0]):
        return "PHB"
    return "NODE" if same_node(a, b) else "SYS"


def same_node(a: PciDevice, b: PciDevice) -> bool:
    if a.numa_node >= 0 and b.numa_node >= 0:
        return a.numa_node == b.numa_node
    if a.cpus and b.cpus:
        return bool(set(a.cpus) & set(b.cpus))
    return True


def bridges_between(a: PciDevice, b: PciDevice) -> list[str]:
    """The bridge functions a peer-to-peer packet between a and b crosses (their lowest common
    bridge and every bridge below it on both sides); [] when only the root bus is common."""
    pa, pb = a.pci_chain(), b.pci_chain()
    n = _common_len(pa[:-1], pb[:-1])
    if n < 2:
        return []
    out = [pa[n - 1]] + list(pa[n:-1]) + list(pb[n:-1])
    return [c for c in out if _BDF_RE.match(c)]


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class NicChoice:
    """One chosen NIC for one memory location."""

    netdev: str | None
    rdma: str | None
    pci: str
    link_gbps: float | None
    cpus: tuple[int, ...]
    numa_node: int
    cls: str
    reason: str
    pcie_link: str = ""  # the PCIe link this function shares with its siblings (dddd:bb:dd)

    @property
    def name(self) -> str:
        return self.netdev or self.rdma or self.pci

    @property
    def local_cpus(self) -> str:
        return format_cpulist(self.cpus)

    def to_json(self) -> dict[str, Any]:
        return {"netdev": self.netdev, "rdma": self.rdma, "pci": self.pci, "link_gbps": self.link_gbps,
                "local_cpus": self.local_cpus, "numa_node": self.numa_node, "class": self.cls, "reason": self.reason,
                "pcie_link": self.pcie_link}


@dataclass(frozen=True)
class Tier:
    """NICs of one class (``HINT`` for a hint file's pairing) for one location, best first."""

    cls: str
    nics: tuple[NicChoice, ...]
    reason: str

    def names(self) -> list[str]:
        return [n.name for n in self.nics]

    def to_json(self) -> dict[str, Any]:
        return {"class": self.cls, "reason": self.reason, "nics": [n.to_json() for n in self.nics]}


@dataclass(frozen=True)
class Exclusion:
    name: str
    pci: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pci": self.pci, "reason": self.reason}


@dataclass
class RailPlan:
    """Tiers per GPU (by PCI bus id) and per NUMA node; see the module docstring."""

    gpus: dict[str, list[Tier]]
    numa: dict[int, list[Tier]]
    excluded: dict[str, list[Exclusion]]  # location key ("0000:1b:00.0", "numa0", "host") -> exclusions
    warnings: list[str]
    ordinals: dict[int, str]  # CUDA ordinal (unmasked) -> bus id
    topology: "Topology | None" = None

    def for_gpu(self, gpu: str | int) -> list[Tier]:
        """Tiers for a GPU given by PCI bus id or by CUDA ordinal of *this process* (through
        ``CUDA_VISIBLE_DEVICES`` when set). Raises TopologyError for an unknown GPU."""
        bus = self.topology.gpu_bus_id(gpu) if self.topology is not None else self._bus(gpu)
        if bus not in self.gpus:
            raise TopologyError(f"no GPU {gpu!r} in this topology (GPUs: {', '.join(self.gpus) or 'none'})")
        return self.gpus[bus]

    def _bus(self, gpu: str | int) -> str:
        if isinstance(gpu, int):
            if gpu not in self.ordinals:
                raise TopologyError(f"no GPU with ordinal {gpu}")
            return self.ordinals[gpu]
        return normalize_bus_id(gpu)

    def for_numa(self, node: int) -> list[Tier]:
        """Tiers for host memory on a NUMA node; [] for a node the plan does not know (no CPUs,
        e.g. GB200's GPU-memory nodes): then no choice is made and every rail is used."""
        return self.numa.get(node, [])

    def to_json(self) -> dict[str, Any]:
        inv = {b: o for o, b in self.ordinals.items()}
        return {
            "gpus": [{"pci_bus_id": b, "ordinal": inv.get(b), "tiers": [t.to_json() for t in tiers],
                      "chosen": [{"name": n.name, "netdev": n.netdev, "rdma": n.rdma, "pci": n.pci}
                                 for n in (tiers[0].nics if tiers else ())],
                      "excluded": [e.to_json() for e in self.excluded.get(b, [])]}
                     for b, tiers in self.gpus.items()],
            "numa": [{"node": k, "tiers": [t.to_json() for t in tiers],
                      "excluded": [e.to_json() for e in self.excluded.get(f"numa{k}", [])]}
                     for k, tiers in self.numa.items()],
            "excluded": [e.to_json() for e in self.excluded.get("host", [])],
            "warnings": list(self.warnings),
        }


@dataclass
class Topology:
    """The facts (see the module docstring). Build with :meth:`load`."""

    root: str
    gpus: list[Gpu]
    nics: list[Nic]
    nodes: dict[int, tuple[int, ...]]  # NUMA node -> cpus (nodes with CPUs only)
    hints: dict[str, list[str]] = field(default_factory=dict)  # gpu bus id -> nic names/bdfs
    warnings: list[str] = field(default_factory=list)
    cuda_source: str = "pci order"

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, root: str | os.PathLike[str] = "/sys", gpus: str | os.PathLike[str] | list[dict[str, Any]] | None = None,
             hints: str | os.PathLike[str] | dict[str, list[str]] | None = None) -> "Topology":
        r = Path(root)
        if not (r / "bus" / "pci" / "devices").is_dir():
            raise TopologyError(f"{root}: no bus/pci/devices under it (expected a sysfs tree like /sys)")
        devs: dict[str, PciDevice] = {}
        for name in sorted(os.listdir(r / "bus" / "pci" / "devices")):
            try:
                d = _dev_info(r / "bus" / "pci" / "devices" / name, r)
            except TopologyError:
                continue
            devs[d.bdf] = d
        gpu_devs = sorted((d for d in devs.values() if _is_gpu(d)), key=lambda d: _bdf_key(d.bdf))
        nics = _load_nics(r, devs)
        nodes = _load_nodes(r)
        warnings: list[str] = []
        cuda, source = _cuda_view(gpus, r)
        topo = cls(str(root), [], nics, nodes, warnings=warnings, cuda_source=source)
        topo.gpus = _assign_ordinals(gpu_devs, cuda, warnings)
        if hints is not None:
            topo.hints = _load_hints(hints)
            topo._check_hints()
        topo._check_flat()
        return topo

    def _check_hints(self) -> None:
        known = {g.bus_id for g in self.gpus}
        for key in self.hints:
            try:
                bus = self.gpu_bus_id(key, visible="")
            except TopologyError as e:
                self.warnings.append(f"hint for {key!r} ignored: {e}")
                continue
            if bus not in known:
                self.warnings.append(f"hint for {key!r} ignored: no such GPU in this topology")

    def _check_flat(self) -> None:
        rdma = [n for n in self.nics if n.rdma] or self.nics
        if len(self.gpus) < 2 or not rdma:
            return
        paired = any(_RANK[classify(g.pci, n.pci)] <= _RANK["PHB"] for g in self.gpus for n in rdma)
        if not paired and not self.hints:
            unknown = all(g.pci.numa_node < 0 for g in self.gpus)
            self.warnings.append(
                "no GPU shares a PCIe switch or root bus with any NIC (a flat or virtual PCI tree): GPUs are "
                + ("not told apart at all (numa_node is -1): every GPU gets every NIC"
                   if unknown else "told apart by NUMA node only")
                + "; pass a hint file (--hints FILE, {\"<gpu bus id>\": [\"<nic>\", ...]}) to pair them")

    # -- CUDA ordinals -----------------------------------------------------------------------

    def gpu_bus_id(self, gpu: str | int, visible: str | None = None) -> str:
        """PCI bus id of a GPU named by bus id, UUID, or CUDA ordinal of this process (mapped
        through ``visible``, default ``$CUDA_VISIBLE_DEVICES``)."""
        if isinstance(gpu, int):
            vis = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
            if vis is not None and vis.strip():
                entries = [e.strip() for e in vis.split(",") if e.strip()]
                if gpu < 0 or gpu >= len(entries):
                    raise TopologyError(f"CUDA ordinal {gpu} not in CUDA_VISIBLE_DEVICES={vis}")
                e = entries[gpu]
                return self.gpu_bus_id(int(e) if e.isdigit() else e, visible="")
            for g in self.gpus:
                if g.ordinal == gpu:
                    return g.bus_id
            raise TopologyError(f"no GPU with ordinal {gpu} ({len(self.gpus)} GPUs)")
        text = gpu.strip()
        up = text.upper()
        if up.startswith("MIG-GPU-"):  # pre-R470 MIG name: MIG-GPU-<gpu uuid>/<gi>/<ci>
            text, up = text[4:].split("/", 1)[0], up[4:].split("/", 1)[0]
        if up.startswith("MIG-"):
            match = [g for g in self.gpus if any(m.lower().startswith(text.lower()) for m in g.mig_uuids)]
            if len(match) != 1:
                raise TopologyError(f"MIG UUID {text!r} matches {len(match)} GPUs (CUDA view: {self.cuda_source}; "
                                    "MIG devices come from `nvidia-smi -L` on the live host, or from each --gpus "
                                    "entry's \"mig_uuids\" list)")
            return match[0].bus_id
        if up.startswith("GPU-"):
            match = [g for g in self.gpus if g.uuid and g.uuid.lower().startswith(text.lower())]
            if len(match) != 1:
                raise TopologyError(f"UUID {text!r} matches {len(match)} GPUs (CUDA view: {self.cuda_source})")
            return match[0].bus_id
        return normalize_bus_id(text)

    # -- matrix ------------------------------------------------------------------------------

    def matrix(self) -> dict[str, dict[str, str]]:
        """{gpu bus id: {nic name: class}}."""
        return {g.bus_id: {n.name: classify(g.pci, n.pci) for n in self.nics} for g in self.gpus}

    def numa_matrix(self) -> dict[int, dict[str, str]]:
        """{NUMA node (with CPUs): {nic name: NODE or SYS}}."""
        return {node: {n.name: self.numa_class(node, n) for n in self.nics} for node in sorted(self.nodes)}

    def numa_class(self, node: int, nic: Nic) -> str:
        """NODE when the NIC is on the node (or its node is unknown on a one-node host), else SYS."""
        if nic.pci.numa_node >= 0:
            return "NODE" if nic.pci.numa_node == node else "SYS"
        cpus = self.nodes.get(node, ())
        if nic.pci.cpus and cpus:
            return "NODE" if set(nic.pci.cpus) & set(cpus) else "SYS"
        return "NODE" if len(self.nodes) <= 1 else "SYS"

    # -- the plan ----------------------------------------------------------------------------

    def rail_plan(self, include: Iterable[str] = (), share: str = "split") -> RailPlan:
        """The tiers per GPU and NUMA node (pure: same facts, same plan). ``include`` names
        excluded kinds to allow: dpu, storage, narrow, down, sys, tcp, vf. ``share``: "split" or
        "all" (the shared-switch rule)."""
        inc = set(include)
        bad = inc - set(INCLUDE_KEYS)
        if bad:
            raise TopologyError(f"unknown include {sorted(bad)} (known: {', '.join(INCLUDE_KEYS)})")
        if share not in ("split", "all"):
            raise TopologyError(f"share={share!r}: expected 'split' or 'all'")
        cands, host_excl = self._candidates(inc)
        excluded: dict[str, list[Exclusion]] = {"host": host_excl}
        gpu_tiers: dict[str, list[Tier]] = {}
        for g in self.gpus:
            classes = {n.pci.bdf: classify(g.pci, n.pci) for n in cands}
            gpu_tiers[g.bus_id], excluded[g.bus_id] = _tiers(cands, classes, inc, f"GPU {g.bus_id}")
        if share == "split":
            _split_shared(self.gpus, gpu_tiers)
        warnings = list(self.warnings)
        for g in self.gpus:
            hinted = self._hint_tier(g, cands, warnings)
            if hinted is not None:
                keep = {n.pci for n in hinted.nics}
                rest = [Tier(t.cls, tuple(n for n in t.nics if n.pci not in keep), t.reason) for t in gpu_tiers[g.bus_id]]
                gpu_tiers[g.bus_id] = [hinted] + [t for t in rest if t.nics]
        numa_tiers: dict[int, list[Tier]] = {}
        for node in sorted(self.nodes):
            classes = {n.pci.bdf: self.numa_class(node, n) for n in cands}
            numa_tiers[node], excluded[f"numa{node}"] = _tiers(cands, classes, inc, f"NUMA node {node}")
        return RailPlan(gpu_tiers, numa_tiers, excluded, warnings,
                        {g.ordinal: g.bus_id for g in self.gpus}, self)

    def _candidates(self, inc: set[str]) -> tuple[list[Nic], list[Exclusion]]:
        """The NICs any location may use, and why each other one is out. In passes: the NIC's
        kind, then its speed against the fastest left, then (among those left) storage."""
        out: list[Exclusion] = []
        keep = [n for n in self.nics if not self._kind_excluded(n, inc, out)]
        widest = max((n.link_gbps or 0 for n in keep), default=0)
        fast: list[Nic] = []
        for n in keep:
            bw = n.link_gbps
            if bw and widest and bw < widest / 4 and "narrow" not in inc:
                out.append(Exclusion(n.name, n.pci.bdf, f"{bw:g} Gbit/s (port rate or PCIe link), under a quarter of "
                                     f"the fastest NIC's {widest:g}: not a data rail (include 'narrow')"))
            else:
                fast.append(n)
        paired = {n.pci.bdf for n in fast for g in self.gpus if _RANK[classify(g.pci, n.pci)] <= _RANK["PXB"]}
        # A GPU with no NIC of its own at PXB or better (a down port still counts as its own)
        # needs the far NICs: then none of them is storage.
        own = fast + [n for n in self.nics if n not in keep and not self._kind_excluded(n, inc | {"down"}, [])]
        lonely = [g for g in self.gpus if not any(_RANK[classify(g.pci, n.pci)] <= _RANK["PXB"] for n in own)]
        if not paired or "storage" in inc or lonely:
            return fast, out
        final: list[Nic] = []
        for n in fast:
            if n.pci.bdf in paired:
                final.append(n)
            else:
                out.append(Exclusion(n.name, n.pci.bdf, f"at PHB or farther from every GPU while {len(paired)} NICs are "
                                     "at PXB or better to one: a storage or in-band NIC (include 'storage')"))
        return final, out

    def _kind_excluded(self, n: Nic, inc: set[str], out: list[Exclusion]) -> bool:
        why = None
        if not n.rdma and "tcp" not in inc and any(m.rdma for m in self.nics):
            why = "no RDMA device while the host has RDMA NICs (a management or ENA-style NIC; include 'tcp' to use it)"
        elif n.is_dpu and "dpu" not in inc:
            why = f"BlueField DPU function ({n.hca_type or hex(n.pci.device or 0)}): storage/in-band, not GPU data (include 'dpu')"
        elif n.pci.physfn and "vf" not in inc and any(m.pci.bdf == n.pci.physfn for m in self.nics):
            why = (f"SR-IOV VF of {n.pci.physfn}, a NIC of this host: it shares that PF's port and PCIe link "
                   "(include 'vf')")
        elif n.pci.max_width == 1 and "narrow" not in inc:
            why = "PCIe x1: a management function (e.g. NVLink-management CX-7), not a data NIC (include 'narrow')"
        elif n.port_state is not None and n.port_state != "ACTIVE" and "down" not in inc:
            why = f"RDMA port state {n.port_state} (no cable or link down; include 'down')"
        if why:
            out.append(Exclusion(n.name, n.pci.bdf, why))
        return why is not None

    def _hint_tier(self, g: Gpu, cands: list[Nic], warnings: list[str]) -> Tier | None:
        names = None
        for k, v in self.hints.items():
            try:
                if self.gpu_bus_id(k, visible="") == g.bus_id:
                    names = v
            except TopologyError:
                continue  # said once by _check_hints
        if not names:
            return None
        chosen: list[NicChoice] = []
        for want in names:
            for n in cands:
                if want in (n.netdev, n.rdma) or _same_bdf(want, n.pci.bdf):
                    chosen.append(_choice(n, classify(g.pci, n.pci), "named for this GPU by the hint file"))
        if not chosen:
            warnings.append(f"hint for GPU {g.bus_id}: none of {names} is a usable NIC (unknown or excluded): "
                            "the GPU's tiers come from the PCI tree")
            return None
        return Tier("HINT", tuple(chosen), "the hint file pairs them")


def _same_bdf(text: str, bdf: str) -> bool:
    try:
        return normalize_bus_id(text) == bdf
    except TopologyError:
        return False


def _gbps(v: float | None) -> str:
    return f"{v:g} Gbit/s" if v else "? Gbit/s"


def _choice(n: Nic, cls: str, reason: str) -> NicChoice:
    return NicChoice(n.netdev, n.rdma, n.pci.bdf, n.link_gbps, n.pci.cpus, n.pci.numa_node, cls, reason,
                     n.pci.pcie_link)


_CLASS_WHY = {
    "PIX": "at most one PCIe bridge between them (same switch)",
    "PXB": "several PCIe bridges, no host bridge (nested switches)",
    "PHB": "through the PCIe host bridge (same root bus)",
    "NODE": "across host bridges within one NUMA node",
    "SYS": "across the socket link (other NUMA node)",
}


def _tiers(cands: list[Nic], classes: dict[str, str], inc: set[str], where: str) -> tuple[list[Tier], list[Exclusion]]:
    by: dict[str, list[Nic]] = {}
    for n in cands:
        by.setdefault(classes[n.pci.bdf], []).append(n)
    excl: list[Exclusion] = []
    nearer = sum(len(v) for c, v in by.items() if c != "SYS")
    if "SYS" in by and nearer and "sys" not in inc:
        for n in by.pop("SYS"):
            excl.append(Exclusion(n.name, n.pci.bdf, f"SYS to {where} while {nearer} nearer NICs exist (include 'sys')"))
    tiers = []
    for c in CLASSES:
        if c not in by:
            continue
        nics = sorted(by[c], key=lambda n: (-(n.link_gbps or 0), _bdf_key(n.pci.bdf)))
        tiers.append(Tier(c, tuple(_choice(n, c, f"{c}: {_CLASS_WHY[c]}; {_gbps(n.link_gbps)}") for n in nics),
                          f"{c} to {where}"))
    return tiers, excl


def _split_shared(gpus: list[Gpu], tiers: dict[str, list[Tier]]) -> None:
    groups: dict[tuple[str, tuple[str, ...]], list[Gpu]] = {}
    for g in gpus:
        t = tiers[g.bus_id]
        if t and t[0].cls in ("PIX", "PXB", "PHB") and len(t[0].nics) > 1:
            groups.setdefault((t[0].cls, tuple(sorted(n.pci for n in t[0].nics))), []).append(g)
    for (cls, bdfs), members in groups.items():
        gcount, ncount = len(members), len(bdfs)
        if gcount < 2 or ncount < gcount:
            continue
        ordered = sorted(bdfs, key=_bdf_key)
        per = ncount // gcount
        for i, g in enumerate(sorted(members, key=lambda x: _bdf_key(x.bus_id))):
            first = tiers[g.bus_id][0]
            lo = i * per
            hi = ncount if i == gcount - 1 else lo + per
            mine = set(ordered[lo:hi])
            why = (f"shared-switch split: {gcount} GPUs share these {ncount} NICs; GPU {i + 1} of {gcount} "
                   f"(by PCI address) takes NICs {lo + 1}-{hi} (by PCI address)")
            own = tuple(replace(n, reason=f"{n.reason}; {why}") for n in first.nics if n.pci in mine)
            sib = tuple(replace(n, reason=f"{n.reason}; the other GPUs' share, used after this GPU's own")
                        for n in first.nics if n.pci not in mine)
            tiers[g.bus_id] = [Tier(cls, own, f"{first.reason}, this GPU's share"),
                               Tier(cls, sib, f"{first.reason}, shared with the other GPUs")] + tiers[g.bus_id][1:]


# ---------------------------------------------------------------------------------------------
# Loading helpers


def _bdf_key(bdf: str) -> tuple[int, int, int, int]:
    m = _BDF_RE.match(bdf)
    if not m:
        return (0, 0, 0, 0)
    return (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4)))


def _is_gpu(d: PciDevice) -> bool:
    return d.vendor == NVIDIA and d.pci_class is not None and (d.pci_class >> 8) in (0x0302, 0x0300)


def _load_nics(r: Path, devs: dict[str, PciDevice]) -> list[Nic]:
    found: dict[str, dict[str, Any]] = {}
    ib = r / "class" / "infiniband"
    for name in sorted(os.listdir(ib)) if ib.is_dir() else []:
        dev = _pci_dir_of(ib / name / "device")
        if dev is None:
            continue
        bdf = normalize_bus_id(dev.name)
        port = ib / name / "ports" / "1"
        e = found.setdefault(bdf, {})
        if "rdma" not in e:
            state = _read(port / "state")
            e.update(rdma=name, hca_type=_read(ib / name / "hca_type"), link_layer=_read(port / "link_layer"),
                     port_state=state.split(":")[-1].strip().upper() if state else None,
                     rate=_rate_gbps(_read(port / "rate")))
            # RoCE: the port's own netdev (a LAG's bond0, not PF 0's enslaved netdev), as ibdev2netdev reads it
            ndev = _read(port / "gid_attrs" / "ndevs" / "0")
            if ndev and (net_dir := r / "class" / "net" / ndev).exists() and not (net_dir / "master").exists():
                e["netdev"] = ndev
    net = r / "class" / "net"
    for name in sorted(os.listdir(net)) if net.is_dir() else []:
        dev = _pci_dir_of(net / name / "device")
        if dev is None:
            continue
        bdf = normalize_bus_id(dev.name)
        e = found.setdefault(bdf, {})
        if "netdev" not in e:
            e["netdev"] = name
            speed = _read(net / name / "speed")
            try:
                e.setdefault("speed", int(speed or "") / 1000 if int(speed or "0") > 0 else None)
            except ValueError:
                pass
    nics = []
    for bdf, e in found.items():
        pci = devs.get(bdf)
        if pci is None:
            pci = _dev_info(r / "bus" / "pci" / "devices" / bdf, r) if (r / "bus" / "pci" / "devices" / bdf).exists() else None
        if pci is None or _is_gpu(pci):
            continue
        nics.append(Nic(pci, e.get("netdev"), e.get("rdma"), e.get("hca_type"), e.get("link_layer"),
                        e.get("port_state"), e.get("rate") or e.get("speed")))
    return sorted(nics, key=lambda n: _bdf_key(n.pci.bdf))


def _load_nodes(r: Path) -> dict[int, tuple[int, ...]]:
    nodes: dict[int, tuple[int, ...]] = {}
    base = r / "devices" / "system" / "node"
    for name in sorted(os.listdir(base)) if base.is_dir() else []:
        m = re.fullmatch(r"node(\d+)", name)
        if m:
            cpus = parse_cpulist(_read(base / name / "cpulist"))
            if cpus:
                nodes[int(m.group(1))] = cpus
    return nodes


def _cuda_view(gpus: Any, r: Path) -> tuple[list[dict[str, Any]] | None, str]:
    if gpus is None:
        if os.path.realpath(r) == "/sys" and shutil.which("nvidia-smi"):
            try:
                res = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.SubprocessError):
                return None, "pci order (nvidia-smi failed)"
            if res.returncode == 0:
                return _with_mig(_parse_gpu_csv(res.stdout)), "nvidia-smi"
        return None, "pci order"
    if isinstance(gpus, list):
        return _check_gpu_entries(gpus, "gpus"), "gpus list"
    try:
        text = Path(gpus).read_text()
    except OSError as e:
        raise TopologyError(f"--gpus {gpus}: {e.strerror or e}") from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TopologyError(f"--gpus {gpus}: bad JSON: {e}") from None
        if not isinstance(data, list):
            raise TopologyError(f"--gpus {gpus}: expected a JSON list of {{ordinal, uuid, pci_bus_id}}")
        return _check_gpu_entries(data, str(gpus)), f"--gpus {gpus}"
    return _parse_gpu_csv(text, str(gpus)), f"--gpus {gpus}"


def _with_mig(view: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds each GPU's MIG device UUIDs from ``nvidia-smi -L`` (nothing when it fails)."""
    try:
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return view
    if res.returncode != 0:
        return view
    migs = parse_nvidia_smi_l(res.stdout)
    return [{**e, "mig_uuids": migs[e["uuid"]]} if migs.get(e.get("uuid") or "") else e for e in view]


def parse_nvidia_smi_l(text: str) -> dict[str, list[str]]:
    """``nvidia-smi -L``: ``GPU 0: ... (UUID: GPU-...)`` lines, each followed by its
    ``  MIG 3g.40gb Device 0: (UUID: MIG-...)`` lines -> {gpu uuid: [mig uuids]}."""
    out: dict[str, list[str]] = {}
    gpu = None
    for line in text.splitlines():
        m = re.search(r"\(UUID:\s*((?:GPU|MIG)-[^)\s]+)\)", line)
        if not m:
            continue
        if m.group(1).startswith("GPU-"):
            gpu = m.group(1)
            out.setdefault(gpu, [])
        elif gpu is not None:
            out[gpu].append(m.group(1))
    return out


def _parse_gpu_csv(text: str, what: str = "nvidia-smi") -> list[dict[str, Any]]:
    rows = [r for r in csv.reader(io.StringIO(text)) if r and any(c.strip() for c in r)]
    if rows and not rows[0][0].strip().isdigit():
        rows = rows[1:]  # header (index, uuid, pci.bus_id)
    out = []
    for row in rows:
        if len(row) < 3:
            raise TopologyError(f"{what}: expected 'index, uuid, pci.bus_id' per line, got {row}")
        out.append({"ordinal": row[0].strip(), "uuid": row[1].strip(), "pci_bus_id": row[2].strip()})
    return _check_gpu_entries(out, what)


def _check_gpu_entries(data: list[Any], what: str) -> list[dict[str, Any]]:
    out = []
    for e in data:
        if not isinstance(e, dict) or "pci_bus_id" not in e or "ordinal" not in e:
            raise TopologyError(f"{what}: each entry needs ordinal and pci_bus_id (and uuid), got {e!r}")
        try:
            ordinal = int(e["ordinal"])
        except (TypeError, ValueError):
            raise TopologyError(f"{what}: ordinal {e['ordinal']!r} is not an integer") from None
        migs = e.get("mig_uuids", [])
        if not isinstance(migs, list) or not all(isinstance(m, str) for m in migs):
            raise TopologyError(f"{what}: mig_uuids of {e['pci_bus_id']} must be a list of MIG UUID strings")
        entry = {"ordinal": ordinal, "uuid": e.get("uuid"), "pci_bus_id": normalize_bus_id(str(e["pci_bus_id"]))}
        out.append({**entry, "mig_uuids": list(migs)} if migs else entry)
    return out


def _assign_ordinals(devs: list[PciDevice], cuda: list[dict[str, Any]] | None, warnings: list[str]) -> list[Gpu]:
    if cuda is None:
        return [Gpu(d, i, None) for i, d in enumerate(devs)]
    by_bus = {e["pci_bus_id"]: e for e in cuda}
    out = []
    for d in devs:
        e = by_bus.get(d.bdf)
        if e is None:
            warnings.append(f"GPU {d.bdf} is in sysfs but not in the CUDA view: left out")
            continue
        out.append(Gpu(d, e["ordinal"], e.get("uuid"), tuple(e.get("mig_uuids", ()))))
    missing = set(by_bus) - {d.bdf for d in devs}
    for b in sorted(missing):
        warnings.append(f"the CUDA view names GPU {b}, which sysfs does not show")
    return sorted(out, key=lambda g: g.ordinal)


def _load_hints(hints: Any) -> dict[str, list[str]]:
    if isinstance(hints, dict):
        data: Any = hints
        what = "hints"
    else:
        what = f"--hints {hints}"
        try:
            data = json.loads(Path(hints).read_text())
        except OSError as e:
            raise TopologyError(f"{what}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise TopologyError(f"{what}: bad JSON: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in data.values()):
        raise TopologyError(f"{what}: expected a JSON object {{\"<gpu pci bus id>\": [\"<nic name or pci address>\", ...]}}")
    return {str(k): list(v) for k, v in data.items()}


# ---------------------------------------------------------------------------------------------
# `multirail topology`


def format_matrix(topo: Topology) -> list[str]:
    """nvidia-smi's GPU x NIC table, NICs numbered NIC0.. with a legend."""
    m = topo.matrix()
    heads = [f"NIC{i}" for i in range(len(topo.nics))]
    width = max([4] + [len(h) for h in heads]) + 1
    lines = ["      " + "".join(h.ljust(width) for h in heads) + "CPU Affinity    NUMA Affinity"]
    for g in topo.gpus:
        row = "".join(m[g.bus_id][n.name].ljust(width) for n in topo.nics)
        numa = str(g.pci.numa_node) if g.pci.numa_node >= 0 else "N/A"
        lines.append(f"GPU{g.ordinal:<3}" + row + f"{format_cpulist(g.pci.cpus) or 'N/A':<16}{numa}")
    lines.append("")
    lines.append("Legend: PIX = at most one PCIe bridge; PXB = several bridges, no host bridge; PHB = through a "
                 "PCIe host bridge; NODE = across host bridges within a NUMA node; SYS = across the socket link")
    lines.append("")
    for i, n in enumerate(topo.nics):
        bits = [f"NIC{i}: {n.netdev or '-'} / {n.rdma or '-'}", n.pci.bdf, f"numa {n.pci.numa_node}",
                _gbps(n.link_gbps),
                f"PCIe x{n.pci.cur_width or '?'}/x{n.pci.max_width or '?'} {n.pci.cur_speed or '?'}/{n.pci.max_speed or '?'} GT/s"]
        lines.append("  " + "  ".join(bits))
    for g in topo.gpus:
        lines.append(f"  GPU{g.ordinal}: {g.bus_id}  {hex(g.pci.device or 0)}  {g.uuid or ''}".rstrip())
    return lines


def _fmt_choice(n: NicChoice) -> str:
    return f"{n.name} ({n.rdma or '-'}, {n.pci}, {_gbps(n.link_gbps)}, numa {n.numa_node})"


def format_plan(topo: Topology, plan: RailPlan) -> list[str]:
    lines: list[str] = []

    def tiers_out(tiers: list[Tier], excl: list[Exclusion]) -> None:
        if not tiers:
            lines.append("    (no NIC: every rail is used)")
        for k, t in enumerate(tiers, 1):
            lines.append(f"    tier {k} {t.cls}: {', '.join(n.name for n in t.nics)}  [{t.reason}]")
            for n in t.nics:
                lines.append(f"      {_fmt_choice(n)}: {n.reason}")
        for e in excl:
            lines.append(f"    excluded {e.name} ({e.pci}): {e.reason}")

    lines.append(f"Rails per GPU (CUDA view: {topo.cuda_source}):")
    for g in topo.gpus:
        lines.append(f"  GPU{g.ordinal} {g.bus_id} (numa {g.pci.numa_node}):")
        tiers_out(plan.gpus[g.bus_id], plan.excluded.get(g.bus_id, []))
    lines.append("Rails per NUMA node (host memory):")
    for node, tiers in plan.numa.items():
        lines.append(f"  node {node} (CPUs {format_cpulist(topo.nodes[node])}):")
        tiers_out(tiers, plan.excluded.get(f"numa{node}", []))
    host = plan.excluded.get("host", [])
    if host:
        lines.append("Excluded for every location:")
        lines.extend(f"  {e.name} ({e.pci}): {e.reason}" for e in host)
    for w in plan.warnings:
        lines.append(f"WARNING: {w}")
    return lines


def topology_json(topo: Topology, plan: RailPlan) -> dict[str, Any]:
    nics = [{"name": n.name, "netdev": n.netdev, "rdma": n.rdma, "pci": n.pci.bdf, "numa_node": n.pci.numa_node,
             "local_cpus": format_cpulist(n.pci.cpus), "link_gbps": n.link_gbps, "port_state": n.port_state,
             "pcie": {"width": n.pci.cur_width, "max_width": n.pci.max_width, "speed": n.pci.cur_speed,
                      "max_speed": n.pci.max_speed}} for n in topo.nics]
    return {"tool": "multirail topology", "version": 1, "root": topo.root, "cuda_view": topo.cuda_source,
            "nics": nics, "matrix": topo.matrix(), "numa_matrix": {str(k): v for k, v in topo.numa_matrix().items()},
            **plan.to_json()}


def _cmd(args: Any) -> int:
    import sys

    include = [x.strip() for x in (args.include or "").split(",") if x.strip()]
    try:
        topo = Topology.load(args.sysfs, gpus=args.gpus, hints=args.hints)
        plan = topo.rail_plan(include=include, share=args.share)
    except TopologyError as e:
        print(f"multirail topology: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(topology_json(topo, plan), indent=2))
        return 0
    head = format_matrix(topo)
    if not topo.gpus:
        print(f"no NVIDIA GPU under {args.sysfs} ({len(topo.nics)} PCI NICs): rails are chosen per NUMA node only")
        head = [ln for ln in head[3:] if ln.startswith("  NIC")]
    print("\n".join(head + [""] + format_plan(topo, plan)))
    return 0


def register(subparsers: Any) -> Any:
    p = subparsers.add_parser(
        "topology", help="GPU-NIC matrix and the rails chosen per GPU and NUMA node (docs/topology.md)",
        description="Reads the PCI tree from sysfs, prints the GPU-NIC matrix in nvidia-smi's notation and, for "
        "each GPU and NUMA node, the tiers of NICs chosen with the reason for each choice and exclusion.")
    p.add_argument("--sysfs", default="/sys", metavar="ROOT", help="sysfs tree to read (default /sys)")
    p.add_argument("--gpus", metavar="FILE", help="CUDA view where no CUDA runtime is present: JSON list of "
                   "{ordinal, uuid, pci_bus_id} or `nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv` output")
    p.add_argument("--hints", metavar="FILE", help='JSON {"<gpu pci bus id>": ["<nic name or pci address>", ...]} '
                   "pairing GPUs and NICs where the PCI tree cannot (flat VMs)")
    p.add_argument("--include", metavar="KIND[,KIND...]", help=f"excluded kinds to allow: {', '.join(INCLUDE_KEYS)}")
    p.add_argument("--share", choices=("split", "all"), default="split",
                   help="GPUs sharing a switch's NICs: split them (default) or all use all")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd)
    return p
