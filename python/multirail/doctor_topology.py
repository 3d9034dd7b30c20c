"""`multirail doctor`'s GPU-NIC layout checks (issue 34): the matrix, and each problem flagged
with its evidence and fix. Facts come from :mod:`multirail.topology` (sysfs under ``--sysfs``,
default ``ROOT/sys``), ``ROOT/proc`` and, for ACS when config space is not readable, a recorded
or live ``lspci -vvv -s BDF`` through doctor's probe. Checks (docs/doctor.md):

* ``gpu-nic-distance``: a GPU with no usable NIC at PXB or better (GPUDirect RDMA then crosses
  the root complex, or NCCL-style engines stage through host memory); a C2C GPU (GB200, GB10)
  with a NIC on its own socket (NODE) is fine: that is its design;
* ``nic-link``: a NIC whose PCIe link trained below its maximum width or speed;
* ``acs``: ACS request/completion redirect enabled on a bridge between a GPU and its NIC
  (peer-to-peer goes up to the root complex);
* ``iommu``: DMA translated by the IOMMU (group type DMA/DMA-FQ, or a kernel command line that
  turns translation on without passthrough);
* ``gpudirect-modules``: GPUs and RDMA NICs present, but neither nvidia_peermem (nv_peer_mem,
  or AWS's efa_nv_peermem) nor dma-buf support (the open NVIDIA kernel module on Linux >= 5.12).

With no NVIDIA GPU under the tree only ``nic-link`` runs; a tree without a PCI bus gives nothing.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from multirail.netinfo import Probe, SysFS
from multirail.topology import C2C_GPU_IDS, Topology, TopologyError, bridges_between, format_matrix

ACS_CAP_ID = 0x000D
ACS_REQ_REDIR, ACS_CMPLT_REDIR = 1 << 2, 1 << 3


@dataclass
class TopoFacts:
    sysfs: SysFS  # the doctor's root (for /proc)
    sys_dir: str  # the sysfs tree
    probe: Probe
    topo: Topology | None
    error: str = ""


def load_facts(root: str, sys_dir: str | None, probe: Probe) -> TopoFacts:
    sdir = sys_dir or os.path.join(root, "sys")
    try:
        topo = Topology.load(sdir)
    except TopologyError as e:
        return TopoFacts(SysFS(root), sdir, probe, None, str(e))
    return TopoFacts(SysFS(root), sdir, probe, topo)


Result = tuple[str, str, str, str, str | None]  # name, status, evidence, fix, subject


def check_distance(f: TopoFacts) -> list[Result]:
    assert f.topo is not None
    plan = f.topo.rail_plan()
    out: list[Result] = []
    for g in f.topo.gpus:
        tiers = plan.gpus[g.bus_id]
        best = tiers[0] if tiers else None
        label = f"GPU{g.ordinal} {g.bus_id}"
        if best is not None and best.cls in ("PIX", "PXB", "HINT"):
            out.append(("gpu-nic-distance", "ok", f"{label}: {best.cls} to {', '.join(best.names())}", "", label))
            continue
        c2c = C2C_GPU_IDS.get(g.pci.device or 0)
        if best is not None and c2c and best.cls == "NODE":
            out.append(("gpu-nic-distance", "ok",
                        f"{label} ({c2c}, NVLink-C2C to its CPU): NODE to {', '.join(best.names())}: GPU memory reaches "
                        "these NICs over C2C and the CPU's PCIe root (NCCL's P2C path, GPUDirect allowed); no PCIe switch "
                        "pairs them by design", "", label))
            continue
        near = f"nearest usable NICs {', '.join(best.names())} are {best.cls}" if best else "no usable NIC at all"
        out.append(("gpu-nic-distance", "warn",
                    f"{label}: no NIC at PXB or better ({near}): GPU memory reaches the NIC through the host bridge "
                    "or the socket link (GPUDirect RDMA through the root complex, or staged through host memory)",
                    "put a NIC in a slot under the GPU's PCIe switch; on a VM whose PCI tree is flat, give the "
                    "pairing as a hint file (multirail topology --hints FILE, docs/topology.md)", label))
    return out


def check_nic_link(f: TopoFacts) -> list[Result]:
    assert f.topo is not None
    out: list[Result] = []
    for n in f.topo.nics:
        p = n.pci
        if not (p.cur_width and p.max_width and p.cur_speed and p.max_speed):
            continue  # VMs show width 0 / Unknown: nothing to compare
        ev = f"{n.name} ({p.bdf}): PCIe x{p.cur_width} at {p.cur_speed:g} GT/s, capable of x{p.max_width} at {p.max_speed:g} GT/s"
        if p.cur_width < p.max_width or p.cur_speed < p.max_speed:
            out.append(("nic-link", "warn", ev + f": the link carries {p.cur_gbps or 0:g} of {p.max_gbps or 0:g} Gbit/s",
                        f"lspci -vv -s {p.bdf} | grep -E 'LnkCap|LnkSta'  # reseat the card, check the slot's "
                        "width and the BIOS PCIe speed setting, then reboot", n.name))
        else:
            out.append(("nic-link", "ok", ev, "", n.name))
    return out


def acs_ctrl_from_config(data: bytes) -> int | None:
    """The ACS control register from PCI config space: 0 when the extended space has no ACS
    capability (nothing to redirect), None when it is not there (unprivileged reads return
    64 bytes, conventional PCI has 256)."""
    if len(data) < 0x104:
        return None
    off, seen = 0x100, set()
    while off and off not in seen and off + 8 <= len(data):
        seen.add(off)
        (hdr,) = struct.unpack_from("<I", data, off)
        if hdr == 0xFFFFFFFF:
            return None
        if hdr == 0:
            return 0
        if hdr & 0xFFFF == ACS_CAP_ID:
            (ctrl,) = struct.unpack_from("<H", data, off + 6)
            return int(ctrl)
        off = (hdr >> 20) & 0xFFC
    return 0


def acs_ctrl_from_lspci(text: str) -> int | None:
    m = re.search(r"ACSCtl:([^\n]*)", text)
    if not m:
        return None
    line = m.group(1)
    return (ACS_REQ_REDIR if "ReqRedir+" in line else 0) | (ACS_CMPLT_REDIR if "CmpltRedir+" in line else 0)


def _acs_of(f: TopoFacts, bdf: str) -> tuple[int | None, str]:
    cfg = Path(f.sys_dir) / "bus" / "pci" / "devices" / bdf / "config"
    try:
        ctrl = acs_ctrl_from_config(cfg.read_bytes())
    except OSError:
        ctrl = None
    if ctrl is not None:
        return ctrl, f"{cfg.name} of {bdf}"
    res = f.probe.run(["lspci", "-vvv", "-s", bdf])
    if res.ok:
        got = acs_ctrl_from_lspci(res.stdout)
        if got is not None:
            return got, f"`lspci -vvv -s {bdf}`"
    return None, ""


def check_acs(f: TopoFacts) -> list[Result]:
    assert f.topo is not None
    out: list[Result] = []
    plan = f.topo.rail_plan()
    for g in f.topo.gpus:
        label = f"GPU{g.ordinal} {g.bus_id}"
        near = [n for t in plan.gpus[g.bus_id] for n in t.nics if n.cls in ("PIX", "PXB")]
        bridges = sorted({b for n in near for b in bridges_between(g.pci, _pci(f.topo, n.pci))})
        if not bridges:
            continue
        redirect, unread = [], []
        for b in bridges:
            ctrl, src = _acs_of(f, b)
            if ctrl is None:
                unread.append(b)
            elif ctrl & (ACS_REQ_REDIR | ACS_CMPLT_REDIR):
                redirect.append(f"{b} (ACS control 0x{ctrl:04x} from {src}: "
                                + "+".join(n for bit, n in ((ACS_REQ_REDIR, "ReqRedir"), (ACS_CMPLT_REDIR, "CmpltRedir")) if ctrl & bit) + ")")
        if redirect:
            out.append(("acs", "fail", f"{label} and {', '.join(n.name for n in near)}: ACS redirect on {'; '.join(redirect)}: "
                        "GPUDirect peer-to-peer goes up to the root complex (slow, or IBV_WC_LOC_PROT_ERR with an IOMMU)",
                        "; ".join(f"setpci -s {r.split()[0]} ECAP_ACS+0x6.w=0000" for r in redirect)
                        + "  # and disable ACS in the BIOS so it stays off after a reboot", label))
        elif unread:
            out.append(("acs", "skip", f"{label}: ACS control of {', '.join(unread)} not readable (config space past 64 "
                        "bytes needs root; no lspci output)", "", label))
        else:
            out.append(("acs", "ok", f"{label}: no ACS redirect on {', '.join(bridges)}", "", label))
    return out


def _pci(topo: Topology, bdf: str) -> Any:
    return next(n.pci for n in topo.nics if n.pci.bdf == bdf)


def check_iommu(f: TopoFacts) -> list[Result]:
    groups_dir = Path(f.sys_dir) / "kernel" / "iommu_groups"
    types: dict[str, str] = {}
    for name in sorted(os.listdir(groups_dir)) if groups_dir.is_dir() else []:
        try:
            types[name] = (groups_dir / name / "type").read_text().strip()
        except OSError:
            continue
    cmdline = f.sysfs.read("/proc/cmdline") or ""
    args = cmdline.split()
    fix = ("add iommu=pt to the kernel command line (GRUB_CMDLINE_LINUX; keep intel_iommu=on/amd_iommu=on if "
           "something needs the IOMMU), update-grub and reboot")
    translated = sorted((g for g, t in types.items() if t.startswith("DMA")), key=lambda x: int(x) if x.isdigit() else 0)
    if translated:
        return [("iommu", "warn", f"IOMMU groups {', '.join(translated[:8])}{' ...' if len(translated) > 8 else ''} "
                 f"translate DMA (type {types[translated[0]]} in {groups_dir.name}/<n>/type): every NIC and GPU DMA "
                 "goes through IOTLB lookups (and ACS is forced on)", fix, None)]
    if types:
        return [("iommu", "ok", f"{len(types)} IOMMU groups, all passthrough ({sorted(set(types.values()))})", "", None)]
    bad = None
    if "iommu.passthrough=0" in args:
        bad = "iommu.passthrough=0"
    elif any(a in ("intel_iommu=on", "amd_iommu=on") for a in args) and "iommu=pt" not in args and "iommu.passthrough=1" not in args:
        bad = next(a for a in args if a in ("intel_iommu=on", "amd_iommu=on")) + " without iommu=pt"
    if bad:
        return [("iommu", "warn", f"/proc/cmdline has {bad}: DMA is translated by the IOMMU", fix, None)]
    return [("iommu", "ok", f"no translating IOMMU (no iommu_groups with a DMA type; /proc/cmdline: "
             f"{' '.join(a for a in args if 'iommu' in a) or 'no iommu option'})", "", None)]


def _kernel_at_least(release: str, want: tuple[int, int]) -> bool:
    m = re.match(r"(\d+)\.(\d+)", release)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= want


#: Kernel modules that let an RDMA NIC register GPU memory as peer memory (the last: the AWS EFA
#: installer's). UCX and NCCL also look for /sys/kernel/mm/memory_peers/nv_mem/version.
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem", "efa_nv_peermem")


def gpudirect_support(sysfs) -> tuple[str | None, str]:
    """How this host's kernel lets an RDMA NIC reach GPU memory: ``("peermem", evidence)``,
    ``("dma-buf", evidence)`` or ``(None, why not)`` (issue 35, item 7b). ``sysfs`` reads the
    host (or a fixture tree): ``read(path)`` and ``exists(path)``.

    peermem: one of PEERMEM_MODULES loaded (/proc/modules, /sys/module) or the peer-memory
    client's /sys/kernel/mm/memory_peers/nv_mem{,_nc}/version. dma-buf: the open NVIDIA kernel
    module (/proc/driver/nvidia/version says "Open Kernel Module") on Linux >= 5.12; where the
    CUDA driver can be asked, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED decides per device (the
    agent asks it; docs/gpu.md)."""
    mods = sysfs.read("/proc/modules")
    loaded = {line.split()[0] for line in (mods or "").splitlines() if line.strip()}
    for m in PEERMEM_MODULES:
        if m in loaded or sysfs.exists(f"/sys/module/{m}"):
            return "peermem", f"{m} is loaded"
    for peer in ("nv_mem", "nv_mem_nc"):
        if sysfs.exists(f"/sys/kernel/mm/memory_peers/{peer}/version"):
            return "peermem", f"the {peer} peer-memory client is registered (/sys/kernel/mm/memory_peers/{peer})"
    version = sysfs.read("/proc/driver/nvidia/version") or ""
    release = (sysfs.read("/proc/sys/kernel/osrelease") or "").strip()
    if "Open Kernel Module" in version and _kernel_at_least(release, (5, 12)):
        return "dma-buf", f"the open NVIDIA kernel module on Linux {release}: GPU memory is registered with the NIC through dma-buf"
    if "Open Kernel Module" in version:
        why = f"the open NVIDIA kernel module, but Linux {release or '(unknown release)'} is older than 5.12 (dma-buf RDMA)"
    elif version:
        why = "the NVIDIA driver is the proprietary one (/proc/driver/nvidia/version): no dma-buf"
    else:
        why = "no /proc/driver/nvidia/version"
    return None, f"none of {', '.join(PEERMEM_MODULES)} is loaded and dma-buf is not available ({why})"


def check_gpudirect_modules(f: TopoFacts) -> list[Result]:
    assert f.topo is not None
    if not any(n.rdma for n in f.topo.nics):
        return []
    way, evidence = gpudirect_support(f.sysfs)
    if way == "peermem":
        return [("gpudirect-modules", "ok", f"{evidence}: RDMA NICs can read and write GPU memory", "", None)]
    if way == "dma-buf":
        return [("gpudirect-modules", "ok", evidence, "", None)]
    return [("gpudirect-modules", "warn",
             f"{len(f.topo.gpus)} GPUs and {sum(1 for n in f.topo.nics if n.rdma)} RDMA NICs, but {evidence}: "
             "GPU memory cannot go NIC-direct",
             "modprobe nvidia_peermem  # or install the open NVIDIA kernel module on Linux >= 5.12 for dma-buf", None)]


CHECKS: list[tuple[str, Callable[[TopoFacts], list[Result]]]] = [
    ("gpu-nic-distance", check_distance),
    ("nic-link", check_nic_link),
    ("acs", check_acs),
    ("iommu", check_iommu),
    ("gpudirect-modules", check_gpudirect_modules),
]
CHECK_NAMES = [n for n, _ in CHECKS]


def run(f: TopoFacts) -> list[Result]:
    if f.topo is None:
        return []
    if not f.topo.gpus:
        return check_nic_link(f)
    out: list[Result] = []
    for _name, fn in CHECKS:
        out.extend(fn(f))
    return out


def matrix_lines(f: TopoFacts) -> list[str]:
    if f.topo is None or not f.topo.gpus:
        return []
    return format_matrix(f.topo)
