"""Synthetic sysfs trees of real GPU servers (shared/topology-notes.md §5), built from small specs.

`build(root, spec)` writes ``root/sys/...`` (and ``root/proc/...`` for doctor) with relative
links, so ``realpath`` resolves inside the temporary directory exactly as on a host:

    root/sys/devices/<prefix...>/pciDDDD:BB/<bridge BDF>.../<BDF>/{vendor,device,class,numa_node,...}
    root/sys/bus/pci/devices/<BDF> -> ../../../devices/.../<BDF>        (bridges too)
    root/sys/class/infiniband/<ib> -> ../../devices/.../<BDF>/infiniband/<ib>   (device -> ../../)
    root/sys/class/net/<if>        -> ../../devices/.../<BDF>/net/<if>          (device -> ../../)
    root/sys/devices/system/node/node<N>/cpulist

Each fixture function returns a :class:`Spec`; the expected answers live in tests/test_topology.py.
Bus numbers, names and device IDs are the notes' (DGX H100 user guide table, AWS hwloc dumps,
the NVSentinel GB200 test, ServeTheHome's DGX Spark listing, Azure's ndv5-topo.xml); the bridge
BDFs the notes mark as inferred are inferred here too.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

H100, H200, B200, GB200, GB10, A100 = 0x2330, 0x2335, 0x2901, 0x2941, 0x2E12, 0x20B0
CX7, CX7_VF, BF3 = 0x1021, 0x101E, 0xA2DC


@dataclass(frozen=True)
class Fn:
    """One PCI function: its chain from the root bus down (bridges, then the device)."""

    chain: tuple[str, ...]
    vendor: int
    device: int
    cls: int
    numa: int = -1
    cpus: str = ""
    width: int = 16
    max_width: int | None = None
    speed: str = "32.0 GT/s PCIe"
    max_speed: str | None = None
    prefix: tuple[str, ...] = ()
    ib: str | None = None
    netdev: str | None = None
    link_layer: str = "InfiniBand"
    rate: str | None = "400 Gb/sec (4X NDR)"
    state: str = "4: ACTIVE"
    hca_type: str | None = None
    config: bytes | None = None  # PCI config space (doctor's ACS check)
    physfn: str | None = None  # SR-IOV VF: its PF's BDF (a sibling under the same bridge)


@dataclass
class Spec:
    name: str
    fns: list[Fn]
    nodes: dict[int, str]  # NUMA node -> cpulist ("" = CPU-less)
    files: dict[str, str] = field(default_factory=dict)  # extra files under root (proc/cmdline ...)
    bridges: dict[str, bytes] = field(default_factory=dict)  # bridge BDF -> config space
    bridge_width: dict[str, tuple[int, int]] = field(default_factory=dict)  # bridge BDF -> (cur, max)


def build(root: Path, spec: Spec) -> Path:
    """Write the tree under root; return root/sys."""
    sysr = root / "sys"
    (sysr / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
    for sub in ("net", "infiniband"):
        (sysr / "class" / sub).mkdir(parents=True, exist_ok=True)
    for f in spec.fns:
        _write_fn(sysr, f, spec)
    nodes = sysr / "devices" / "system" / "node"
    nodes.mkdir(parents=True, exist_ok=True)
    for n, cpus in spec.nodes.items():
        (nodes / f"node{n}").mkdir(exist_ok=True)
        (nodes / f"node{n}" / "cpulist").write_text(cpus + "\n")
    (nodes / "online").write_text(",".join(str(n) for n in sorted(spec.nodes)) + "\n")
    for rel, text in spec.files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return sysr


def _attrs(d: Path, vendor: int, device: int, cls: int, numa: int, cpus: str, width: int, max_width: int,
           speed: str, max_speed: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, val in (("vendor", f"0x{vendor:04x}"), ("device", f"0x{device:04x}"), ("class", f"0x{cls:06x}"),
                      ("numa_node", str(numa)), ("local_cpulist", cpus), ("current_link_width", str(width)),
                      ("max_link_width", str(max_width)), ("current_link_speed", speed),
                      ("max_link_speed", max_speed)):
        (d / name).write_text(val + "\n")


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if not os.path.lexists(link):
        os.symlink(os.path.relpath(target, link.parent), link)


def _write_fn(sysr: Path, f: Fn, spec: Spec) -> None:
    base = sysr / "devices"
    for c in f.prefix:
        base = base / c
    d = base / f.chain[0]
    d.mkdir(parents=True, exist_ok=True)
    for i, comp in enumerate(f.chain[1:], start=1):
        d = d / comp
        last = i == len(f.chain) - 1
        if last:
            _attrs(d, f.vendor, f.device, f.cls, f.numa, f.cpus, f.width, f.max_width or f.width, f.speed,
                   f.max_speed or f.speed)
            if f.config is not None:
                (d / "config").write_bytes(f.config)
            if f.physfn:
                _link(d / "physfn", d.parent / f.physfn)
        elif not (d / "class").exists():
            cur, mx = spec.bridge_width.get(comp, (16, 16))
            _attrs(d, 0x1000, 0xC030, 0x060400, f.numa, f.cpus, cur, mx, f.max_speed or f.speed, f.max_speed or f.speed)
            # config space as root reads it: 4 KiB, ACS only where the spec puts it
            (d / "config").write_bytes(spec.bridges.get(comp, NO_EXT_CAPS))
        _link(sysr / "bus" / "pci" / "devices" / comp, d)
    if f.ib:
        ibd = d / "infiniband" / f.ib
        port = ibd / "ports" / "1"
        port.mkdir(parents=True, exist_ok=True)
        (port / "state").write_text(f.state + "\n")
        (port / "link_layer").write_text(f.link_layer + "\n")
        if f.rate:
            (port / "rate").write_text(f.rate + "\n")
        if f.hca_type:
            (ibd / "hca_type").write_text(f.hca_type + "\n")
        _link(ibd / "device", d)
        _link(sysr / "class" / "infiniband" / f.ib, ibd)
    if f.netdev:
        nd = d / "net" / f.netdev
        nd.mkdir(parents=True, exist_ok=True)
        (nd / "operstate").write_text("up\n")
        _link(nd / "device", d)
        _link(sysr / "class" / "net" / f.netdev, nd)


NO_EXT_CAPS = bytes(4096)


def acs_config(ctrl: int) -> bytes:
    """4 KiB of config space with one extended capability: ACS (ID 0x000d) at 0x100, its control
    register (offset 6) = ctrl (bit 2 ReqRedir, bit 3 CmpltRedir, bit 4 UpstreamFwd)."""
    cfg = bytearray(4096)
    cfg[0:4] = struct.pack("<HH", 0x1000, 0xC030)
    cfg[0x100:0x104] = struct.pack("<I", 0x000D | (1 << 16))  # next = 0
    cfg[0x104:0x106] = struct.pack("<H", 0x007F)  # capabilities: all
    cfg[0x106:0x108] = struct.pack("<H", ctrl)
    return bytes(cfg)


def _b(dom: int, bus: int, dev: int = 0, fn: int = 0) -> str:
    return f"{dom:04x}:{bus:02x}:{dev:02x}.{fn}"


def _root(dom: int, bus: int) -> str:
    return f"pci{dom:04x}:{bus:02x}"


GPU_CLS, IB_CLS, ETH_CLS = 0x030200, 0x020700, 0x020000


# ---------------------------------------------------------------------------------------------
# F1 DGX H100 / H200 / B200


DGX_NIC_BUSES = (0x18, 0x40, 0x4F, 0x5E, 0x9A, 0xC0, 0xCE, 0xDC)
DGX_NAMES = ("mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11")
DGX_SHUFFLED = ("mlx5_4", "mlx5_7", "mlx5_8", "mlx5_9", "mlx5_10", "mlx5_13", "mlx5_14", "mlx5_15")
DGX_CPUS = {0: "0-55,112-167", 1: "56-111,168-223"}


def dgx_gpu_chain(n: int) -> tuple[str, ...]:
    r = n - 3
    return (_root(0, r), _b(0, r, 1), _b(0, n - 2), _b(0, n - 1, 1), _b(0, n + 1), _b(0, n + 2), _b(0, n + 3))


def dgx_nic_chain(n: int) -> tuple[str, ...]:
    r = n - 3
    return (_root(0, r), _b(0, r, 1), _b(0, n - 2), _b(0, n - 1), _b(0, n))


def dgx(variant: str = "h100", shuffled: bool = False, acs: int | None = None, iommu: str = "pt",
        modules: tuple[str, ...] = ("nvidia", "nvidia_peermem", "mlx5_ib"), narrow_nic: int | None = None) -> Spec:
    """DGX H100 (variant h200: GPU id 0x2335; b200: 0x2901, BF-3 storage, two x1 CX-7 management
    functions PIX to GPUs 4 and 5). acs: ACS control on each CX-7 switch's downstream port toward
    its NIC; narrow_nic: index of a compute NIC trained at x8 instead of x16."""
    gpu_id = {"h100": H100, "h200": H200, "b200": B200}[variant]
    names = DGX_SHUFFLED if shuffled else DGX_NAMES
    fns: list[Fn] = []
    bridges: dict[str, bytes] = {}
    for i, n in enumerate(DGX_NIC_BUSES):
        node = 0 if i < 4 else 1
        cpus = DGX_CPUS[node]
        fns.append(Fn(dgx_gpu_chain(n), 0x10DE, gpu_id, GPU_CLS, node, cpus))
        fns.append(Fn(dgx_nic_chain(n), 0x15B3, CX7, IB_CLS, node, cpus, ib=names[i], netdev=f"ibp{n}s0",
                      hca_type="MT4129", width=8 if narrow_nic == i else 16, max_width=16))
        if acs is not None:
            bridges[_b(0, n - 1)] = acs_config(acs)
    storage_dev, storage_hca = (BF3, "MT41692") if variant == "b200" else (CX7, "MT4129")
    st_names = {0: ("mlx5_1", "mlx5_2"), 1: ("mlx5_7", "mlx5_8")}
    if shuffled:
        st_names = {0: ("mlx5_0", "mlx5_1"), 1: ("mlx5_11", "mlx5_12")}
    for node, bus in ((0, 0x29), (1, 0xAA)):
        r = bus - 1
        cpus = DGX_CPUS[node]
        a, b = st_names[node]
        fns.append(Fn((_root(0, r), _b(0, r, 1), _b(0, bus, 0, 0)), 0x15B3, storage_dev, IB_CLS, node, cpus, ib=a,
                      netdev=f"ibp{bus}s0f0", hca_type=storage_hca))
        fns.append(Fn((_root(0, r), _b(0, r, 1), _b(0, bus, 0, 1)), 0x15B3, storage_dev, ETH_CLS, node, cpus, ib=b,
                      netdev=f"enp{bus}s0f1np1", hca_type=storage_hca, link_layer="Ethernet"))
    for k in range(4):  # NVSwitch functions: NVIDIA, not GPUs
        fns.append(Fn((_root(0, 0), _b(0, 0, 1 + k), _b(0, 5 + k)), 0x10DE, 0x22A3, 0x068000, 0, DGX_CPUS[0]))
    fns.append(Fn((_root(0, 0), _b(0, 0, 0x1C), _b(0, 0x0A)), 0x8086, 0x1533, ETH_CLS, 0, DGX_CPUS[0],
                  netdev="eno1", width=1, speed="2.5 GT/s PCIe"))
    if variant == "b200":  # NVLink-management CX-7, x1, on the GPU 4 and GPU 5 switches (p6-b200)
        for j, n in enumerate((0x9A, 0xC0)):
            chain = dgx_gpu_chain(n)[:4] + (_b(0, n + 1), _b(0, n + 2, 1), _b(0, n + 4))
            fns.append(Fn(chain, 0x15B3, CX7, 0x020700, 1, DGX_CPUS[1], width=1, ib=f"mlx5_{16 + j}",
                          netdev=f"ibp{n + 4}s0f0", hca_type="MT4129", speed="32.0 GT/s PCIe"))
    cmdline = {"pt": "BOOT_IMAGE=/vmlinuz ro intel_iommu=on iommu=pt\n", "on": "BOOT_IMAGE=/vmlinuz ro intel_iommu=on\n",
               "off": "BOOT_IMAGE=/vmlinuz ro\n"}[iommu]
    files = {"proc/cmdline": cmdline,
             "proc/modules": "".join(f"{m} 16384 0 - Live 0x0000000000000000\n" for m in modules),
             "proc/sys/kernel/osrelease": "6.8.0-60-generic\n"}
    if iommu in ("pt", "on"):
        files["sys/kernel/iommu_groups/12/type"] = "identity\n" if iommu == "pt" else "DMA-FQ\n"
        for n in DGX_NIC_BUSES:
            files[f"sys/kernel/iommu_groups/{n}/type"] = "identity\n" if iommu == "pt" else "DMA-FQ\n"
    return Spec(f"dgx-{variant}{'-shuffled' if shuffled else ''}", fns, dict(DGX_CPUS), files, bridges)


# ---------------------------------------------------------------------------------------------
# F2 AWS p5en / p5


P5EN_SWITCHES = ((0x44, 0, (0x59, 0x5A), (0x55, 0x56, 0x57, 0x58)),
                 (0x5D, 0, (0x72, 0x73), (0x6E, 0x6F, 0x70, 0x71)),
                 (0x76, 1, (0x8B, 0x8C), (0x87, 0x88, 0x89, 0x8A)),
                 (0x8F, 1, (0xA4, 0xA5), (0xA0, 0xA1, 0xA2, 0xA3)))
P5EN_CPUS = {0: "0-47,96-143", 1: "48-95,144-191"}


def aws_p5en(numa_unknown: bool = False) -> Spec:
    fns: list[Fn] = []
    for r, node, gpus, efas in P5EN_SWITCHES:
        numa = -1 if numa_unknown else node
        cpus = "0-191" if numa_unknown else P5EN_CPUS[node]
        up = (_root(0, r), _b(0, r), _b(0, r + 1))
        for k, e in enumerate(efas):
            fns.append(Fn(up + (_b(0, r + 2, 1, k), _b(0, e)), 0x1D0F, 0xEFA2, ETH_CLS, numa, cpus, width=8,
                          ib=f"rdmap{e}s0", link_layer="Unspecified", rate="200 Gb/sec (2X NDR)"))
        for k, g in enumerate(gpus):
            fns.append(Fn(up + (_b(0, r + 2, 2, k), _b(0, g)), 0x10DE, H200, GPU_CLS, numa, cpus))
        for k in range(4):  # ENA: a netdev, no RDMA
            fns.append(Fn(up + (_b(0, r + 2, 3, k), _b(0, r + 3 + k)), 0x1D0F, 0xEC20, ETH_CLS, numa, cpus, width=8,
                          netdev=f"enp{r + 3 + k}s0"))
        for k in range(2):  # NVMe
            fns.append(Fn(up + (_b(0, r + 2, 4, k), _b(0, r + 7 + k)), 0x1D0F, 0xCD01, 0x010802, numa, cpus, width=4))
    nodes = {0: "0-191"} if numa_unknown else dict(P5EN_CPUS)
    return Spec("aws-p5en" + ("-numa-1" if numa_unknown else ""), fns, nodes)


P5_GPUS = (0x53, 0x64, 0x75, 0x86, 0x97, 0xA8, 0xB9, 0xCA)


def aws_p5() -> Spec:
    fns: list[Fn] = []
    for i, g in enumerate(P5_GPUS):
        node = 0 if i < 4 else 1
        cpus = P5EN_CPUS[node]
        r = g - 7
        up = (_root(0, r), _b(0, r), _b(0, r + 1))
        for k in range(4):
            e = g - 4 + k
            fns.append(Fn(up + (_b(0, r + 2, 1 + k), _b(0, e)), 0x1D0F, 0xEFA1, ETH_CLS, node, cpus, width=8,
                          speed="16.0 GT/s PCIe", ib=f"rdmap{e}s0", link_layer="Unspecified", rate="100 Gb/sec (4X EDR)"))
        fns.append(Fn(up + (_b(0, r + 2, 5), _b(0, g)), 0x10DE, H100, GPU_CLS, node, cpus))
    return Spec("aws-p5", fns, dict(P5EN_CPUS))


# ---------------------------------------------------------------------------------------------
# F3 GB200 tray, F4 DGX Spark


def gb200() -> Spec:
    cpus = {0: "0-71", 1: "72-143"}
    fns: list[Fn] = []
    for dom in (0x0008, 0x0009, 0x0018, 0x0019):
        node = 0 if dom < 0x10 else 1
        fns.append(Fn((_root(dom, 0), _b(dom, 0), _b(dom, 1)), 0x10DE, GB200, GPU_CLS, node, cpus[node]))
    for dom, ib, nd in ((0x0000, "mlx5_0", "ibp3s0"), (0x0002, "mlx5_1", "ibP2p3s0"),
                        (0x0010, "mlx5_4", "ibP16p3s0"), (0x0012, "mlx5_5", "ibP18p3s0")):
        node = 0 if dom < 0x10 else 1
        fns.append(Fn((_root(dom, 0), _b(dom, 0), _b(dom, 1), _b(dom, 2), _b(dom, 3)), 0x15B3, CX7, IB_CLS, node,
                      cpus[node], ib=ib, netdev=nd, hca_type="MT4129"))
    for dom, ibs in ((0x0006, ("mlx5_2", "mlx5_3")), (0x0016, ("mlx5_6", "mlx5_7"))):
        node = 0 if dom < 0x10 else 1
        for f, ib in enumerate(ibs):
            fns.append(Fn((_root(dom, 0), _b(dom, 0), _b(dom, 1), _b(dom, 2), _b(dom, 3, 0, f)), 0x15B3, BF3, ETH_CLS,
                          node, cpus[node], ib=ib, netdev=f"roceP{dom}p3s0f{f}", hca_type="MT41692", link_layer="Ethernet"))
    nodes = {0: "0-71", 1: "72-143", 2: "", 10: "", 18: "", 26: ""}
    return Spec("gb200-tray", fns, nodes)


def dgx_spark(both_cables: bool = False) -> Spec:
    fns = [Fn((_root(0xF, 0), _b(0xF, 0), _b(0xF, 1)), 0x10DE, GB10, 0x030000, -1, "0-19", speed="2.5 GT/s PCIe")]
    for dom, ibp, ndp in ((0, "rocep1s0", "enp1s0"), (2, "roceP2p1s0", "enP2p1s0")):
        for f in (0, 1):
            up = both_cables or f == 1
            fns.append(Fn((_root(dom, 0), _b(dom, 0), _b(dom, 1, 0, f)), 0x15B3, CX7, ETH_CLS, -1, "0-19", width=4,
                          ib=f"{ibp}f{f}", netdev=f"{ndp}f{f}np{f}", link_layer="Ethernet", rate="200 Gb/sec (2X NDR)",
                          state="4: ACTIVE" if up else "1: DOWN", hca_type="MT4129"))
    fns.append(Fn((_root(7, 0), _b(7, 0), _b(7, 1)), 0x10EC, 0x8127, ETH_CLS, -1, "0-19", width=1, netdev="enP7s7"))
    fns.append(Fn((_root(9, 0), _b(9, 0), _b(9, 1)), 0x14C3, 0x7925, 0x028000, -1, "0-19", width=1, netdev="wlP9p1s0"))
    return Spec("dgx-spark" + ("-2cables" if both_cables else ""), fns, {0: "0-19"})


# ---------------------------------------------------------------------------------------------
# F5 Azure ND H100 v5 (flat Hyper-V), AWS p4d (flat root bus)


AZ_GPU_DOMS = (0x0001, 0x0002, 0x0003, 0x0008, 0x0009, 0x000A, 0x000B, 0x000C)
AZ_NIC_DOMS = tuple(range(0x0101, 0x0109))


def azure_ndv5(numa: bool = True) -> Spec:
    vmbus = ("LNXSYSTM:00", "LNXSYBUS:00", "ACPI0004:00", "VMBUS:00")
    cpus = {0: "0-47", 1: "48-95"}
    fns: list[Fn] = []

    def where(i: int) -> tuple[int, str]:
        node = 0 if i < 4 else 1
        return (node, cpus[node]) if numa else (-1, "0-95")

    for i, dom in enumerate(AZ_GPU_DOMS):
        node, c = where(i)
        guid = f"{dom:08x}-0000-0000-0000-000000000000"
        fns.append(Fn((_root(dom, 0), _b(dom, 0)), 0x10DE, H100, GPU_CLS, node, c, prefix=vmbus + (guid,)))
    for i, dom in enumerate(AZ_NIC_DOMS):
        node, c = where(i)
        guid = f"{dom:08x}-0000-0000-0000-000000000001"
        fns.append(Fn((_root(dom, 0), _b(dom, 0)), 0x15B3, CX7_VF, IB_CLS, node, c, prefix=vmbus + (guid,),
                      ib=f"mlx5_ib{i}", netdev=f"ib{i}", width=0, max_width=0, speed="Unknown"))
    # accelerated-networking Ethernet VF: the VM's own address, not a GPU rail
    fns.append(Fn((_root(0x7870, 0), _b(0x7870, 2)), 0x15B3, 0x101A, ETH_CLS, 0 if numa else -1, "0-95" if not numa else cpus[0],
                  prefix=vmbus + ("00007870-0000-0000-0000-000000000002",), ib="mlx5_an0", netdev="enP30832s1",
                  link_layer="Ethernet", rate="40 Gb/sec (4X QDR)", width=0, max_width=0, speed="Unknown"))
    nodes = dict(cpus) if numa else {0: "0-95"}
    return Spec("azure-ndv5" + ("" if numa else "-numa-1"), fns, nodes)


AZ_HINTS = {f"{g:04x}:00:00.0": [f"mlx5_ib{i}"] for i, g in enumerate(AZ_GPU_DOMS)}


def aws_p4d() -> Spec:
    cpus = {0: "0-23,48-71", 1: "24-47,72-95"}
    fns: list[Fn] = []
    for bus, node in ((0x10, 0), (0x20, 0), (0x90, 1), (0xA0, 1)):
        for dev in (0x1C, 0x1D):
            fns.append(Fn((_root(0, bus), _b(0, bus, dev)), 0x10DE, A100, GPU_CLS, node, cpus[node], speed="16.0 GT/s PCIe"))
        fns.append(Fn((_root(0, bus), _b(0, bus, 0x1B)), 0x1D0F, 0xEFA0, ETH_CLS, node, cpus[node], width=8,
                      speed="16.0 GT/s PCIe", ib=f"rdmap{bus}s27", link_layer="Unspecified", rate="100 Gb/sec (4X EDR)"))
    return Spec("aws-p4d", fns, cpus)


def with_fn(spec: Spec, **changes: object) -> Spec:
    """A copy of the spec with every function changed (e.g. numa=-1)."""
    return replace(spec, fns=[replace(f, **changes) for f in spec.fns])  # type: ignore[arg-type]
