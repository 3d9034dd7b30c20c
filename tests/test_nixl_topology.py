"""The NIXL plugin's topology reader (crates/multirail-nixl/src/topo.rs) against
python/multirail/topology.py (issue 34): on every fixture tree of tests/topo_fixtures.py (and
the testbed's --gpu-near tree), the plugin chooses the same tiers, in the same order, with the
same classes, per GPU and per NUMA node, and the same CUDA ordinals. The plugin's plan comes
from `mr_nixl_topology_json` (exported by libplugin_MULTIRAIL.so for this test), called through
ctypes; topology.py's from `Topology.load(root, gpus).rail_plan()`.

Skips only where the plugin is not built.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import topo_fixtures as F


def _lib() -> Any:
    try:
        from multirail.nixl_plugin import PluginError, plugin_path

        path = plugin_path()
    except (ImportError, PluginError) as e:  # the plugin is not built here
        pytest.skip(str(e))
    lib = ctypes.CDLL(str(path))
    fn = lib.mr_nixl_topology_json
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t] * 3 + [ctypes.c_void_p, ctypes.c_size_t]
    return fn


def plugin_plan(root: Path, gpus: Path | None = None, hints: Path | None = None) -> dict[str, Any]:
    fn = _lib()
    r, g, h = str(root).encode(), str(gpus or "").encode(), str(hints or "").encode()
    cap = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(cap)
        n = fn(r, len(r), g, len(g), h, len(h), buf, cap)
        assert n >= 0, "mr_nixl_topology_json panicked"
        if n <= cap:
            return json.loads(buf.raw[:n])
        cap = n


def tiers_of(tiers: list[Any]) -> list[tuple[str, list[tuple[str, str | None, str | None]]]]:
    return [(t.cls, [(n.pci, n.netdev, n.rdma) for n in t.nics]) for t in tiers]


def python_plan(root: Path, gpus: Path | None = None, hints: Path | None = None) -> dict[str, Any]:
    from multirail.topology import Topology

    topo = Topology.load(root, gpus=str(gpus) if gpus else None, hints=str(hints) if hints else None)
    plan = topo.rail_plan()
    return {"gpus": {b: tiers_of(t) for b, t in plan.gpus.items()},
            "numa": {str(n): tiers_of(t) for n, t in plan.numa.items()},
            "ordinals": {str(g.ordinal): g.bus_id for g in topo.gpus}}


def rust_plan(root: Path, gpus: Path | None = None, hints: Path | None = None) -> dict[str, Any]:
    got = plugin_plan(root, gpus, hints)
    assert "error" not in got, got

    def conv(tiers: list[dict[str, Any]]) -> list[tuple[str, list[tuple[str, str | None, str | None]]]]:
        return [(t["class"], [(n["pci"], n["netdev"], n["rdma"]) for n in t["nics"]]) for t in tiers]

    return {"gpus": {b: conv(t) for b, t in got["gpus"].items()},
            "numa": {n: conv(t) for n, t in got["numa"].items()},
            "ordinals": got["ordinals"]}


def _vfs() -> F.Spec:
    spec = F.dgx()
    pf = F.dgx_nic_chain(0x18)
    for k in range(1, 5):
        spec.fns.append(F.Fn(pf[:-1] + (f"0000:18:00.{k}",), 0x15B3, F.CX7_VF, F.IB_CLS, 0, F.DGX_CPUS[0],
                             ib=f"mlx5_{11 + k}", netdev=f"ibp24s0v{k}", width=0, max_width=0, speed="Unknown",
                             physfn="0000:18:00.0"))
    return spec


def _dpu_under_gpu_switch() -> F.Spec:
    spec = F.gb200()
    spec.fns.append(F.Fn(("pci0008:00", "0008:00:00.0", "0008:02:00.0"), 0x15B3, F.BF3, F.ETH_CLS, 0, "0-71",
                         ib="mlx5_9", netdev="roceP8p2s0", hca_type="MT41692", link_layer="Ethernet"))
    return spec


def _two_switches_one_nic() -> F.Spec:
    def sw(root: int, dev: int) -> tuple[str, ...]:
        return (f"pci0000:{root:02x}", f"0000:{root:02x}:01.0", f"0000:{root + 1:02x}:00.0",
                f"0000:{root + 2:02x}:{dev:02x}.0")

    fns = [F.Fn(sw(0x10, 0) + ("0000:13:00.0",), 0x10DE, F.H100, F.GPU_CLS, 0, "0-31"),
           F.Fn(sw(0x10, 1) + ("0000:14:00.0",), 0x10DE, F.H100, F.GPU_CLS, 0, "0-31"),
           F.Fn(sw(0x10, 2) + ("0000:15:00.0",), 0x15B3, F.CX7, F.IB_CLS, 0, "0-31", ib="mlx5_0", netdev="ibp21s0"),
           F.Fn(sw(0x30, 0) + ("0000:33:00.0",), 0x10DE, F.H100, F.GPU_CLS, 0, "0-31"),
           F.Fn(sw(0x30, 1) + ("0000:34:00.0",), 0x10DE, F.H100, F.GPU_CLS, 0, "0-31"),
           F.Fn(("pci0000:50", "0000:50:01.0", "0000:51:00.0"), 0x15B3, F.CX7, F.IB_CLS, 0, "0-31", ib="mlx5_1",
                netdev="ibp81s0")]
    return F.Spec("two-switches-one-nic", fns, {0: "0-31"})


def _no_gpu_virtio() -> F.Spec:
    return F.Spec("vm", [F.Fn(("pci0000:00", "0000:00:03.0"), 0x1AF4, 0x1041, F.ETH_CLS, 0, "0-3", netdev="eth0"),
                         F.Fn(("pci0000:00", "0000:00:04.0"), 0x1AF4, 0x1041, F.ETH_CLS, 0, "0-3", netdev="eth1")],
                  {0: "0-3"})


FIXTURES: dict[str, Callable[[], F.Spec]] = {
    "dgx-h100": lambda: F.dgx("h100"),
    "dgx-b200": lambda: F.dgx("b200"),
    "dgx-b200-shuffled": lambda: F.dgx("b200", shuffled=True),
    "aws-p5en": F.aws_p5en,
    "aws-p5en-numa-1": lambda: F.aws_p5en(numa_unknown=True),
    "aws-p5": F.aws_p5,
    "gb200": F.gb200,
    "dgx-spark": F.dgx_spark,
    "dgx-spark-2cables": lambda: F.dgx_spark(both_cables=True),
    "azure-ndv5": F.azure_ndv5,
    "azure-ndv5-numa-1": lambda: F.azure_ndv5(numa=False),
    "aws-p4d": F.aws_p4d,
    "dgx-sriov-vfs": _vfs,
    "gb200-dpu-under-gpu-switch": _dpu_under_gpu_switch,
    "two-switches-one-nic": _two_switches_one_nic,
    "no-gpu-vm": _no_gpu_virtio,
    "gb200-all-numa-1": lambda: F.with_fn(F.gb200(), numa=-1),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_plugin_reader_chooses_what_topology_py_chooses(name: str, tmp_path: Path) -> None:
    root = F.build(tmp_path, FIXTURES[name]())
    want, got = python_plan(root), rust_plan(root)
    assert got == want


def test_roce_lag_and_testbed_tree(tmp_path: Path) -> None:
    """The RoCE LAG's bond (GID table's netdev) and the testbed's --gpu-near tree."""
    from multirail.testbed import write_topology_fixture

    fns = [F.Fn(("pci0000:00", "0000:00:01.0", f"0000:01:00.{f}"), 0x15B3, 0x101D, F.ETH_CLS, 0, "0-7",
                ib="mlx5_bond_0" if f == 0 else None, netdev=f"enp1s0f{f}np{f}", link_layer="Ethernet",
                rate="200 Gb/sec (4X HDR)") for f in (0, 1)]
    sysr = F.build(tmp_path / "lag", F.Spec("roce-lag", fns, {0: "0-7"}))
    bond = sysr / "devices" / "virtual" / "net" / "bond0"
    (bond / "bonding").mkdir(parents=True)
    os.symlink("../../devices/virtual/net/bond0", sysr / "class" / "net" / "bond0")
    gid = Path(os.path.realpath(sysr / "class" / "infiniband" / "mlx5_bond_0")) / "ports" / "1" / "gid_attrs" / "ndevs"
    gid.mkdir(parents=True)
    (gid / "0").write_text("bond0\n")
    got = rust_plan(sysr)
    assert got == python_plan(sysr)
    assert [n[1:] for n in got["numa"]["0"][0][1]] == [("bond0", "mlx5_bond_0")]

    tb = tmp_path / "tb"
    write_topology_fixture(tb, ["tbr0b", "tbr1b", "tbr2b"], [0, 1])
    got = rust_plan(tb)
    assert got == python_plan(tb)
    gpu0 = got["gpus"][got["ordinals"]["0"]]
    assert [(c, [n[1] for n in nics]) for c, nics in gpu0] == [("PIX", ["tbr0b", "tbr1b"]), ("NODE", ["tbr2b"])]


@pytest.mark.parametrize("form", ["json", "csv"])
def test_cuda_view_from_a_gpus_file(form: str, tmp_path: Path) -> None:
    """A --gpus file reorders the CUDA ordinals (and may leave a GPU out): both readers agree."""
    root = F.build(tmp_path, F.dgx())
    buses = [f"0000:{n + 3:02x}:00.0" for n in F.DGX_NIC_BUSES]
    view = [{"ordinal": i, "uuid": f"GPU-{i:08x}-0000-0000-0000-000000000000", "pci_bus_id": b.upper()}
            for i, b in enumerate(reversed(buses[1:]))]
    f = tmp_path / f"gpus.{form}"
    if form == "json":
        f.write_text(json.dumps(view))
    else:
        f.write_text("index, uuid, pci.bus_id\n" + "".join(f"{e['ordinal']}, {e['uuid']}, 0000{e['pci_bus_id']}\n"
                                                          for e in view))
    got = rust_plan(root, f)
    assert got == python_plan(root, f)
    assert got["ordinals"]["0"] == buses[-1] and buses[0] not in got["gpus"]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"ordinal": 0}]')
    assert "pci_bus_id" in plugin_plan(root, bad)["error"]
    assert "bus/pci/devices" in plugin_plan(tmp_path / "nothing")["error"]


def test_hint_file_pairs_gpus_and_nics(tmp_path: Path) -> None:
    """Azure ND v5's flat tree with its hint file (GPU -> its NIC): a first tier HINT, the rest
    by class; keys by bus id (any case, 8 domain digits) or UUID, NICs by RDMA name, netdev or
    PCI address, a key for no GPU and a NIC that is no candidate ignored, as topology.py does."""
    root = F.build(tmp_path, F.azure_ndv5())
    hints = dict(F.AZ_HINTS)
    hints["00000002:00:00.0".upper()] = ["ib1", "0105:00:00.0"]  # netdev and PCI address, 8-digit domain
    hints.pop("0002:00:00.0")
    hints["GPU-00000003"] = ["mlx5_an0"]  # the accelerated-networking VF: excluded (narrow), so no hint tier
    hints["0dead:00:00.0"] = ["mlx5_ib0"]  # no such GPU
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([{"ordinal": i, "uuid": f"GPU-{d:08x}-0000", "pci_bus_id": f"{d:04x}:00:00.0"}
                                for i, d in enumerate(F.AZ_GPU_DOMS)]))
    f = tmp_path / "hints.json"
    f.write_text(json.dumps(hints))
    got = rust_plan(root, gpus, f)
    assert got == python_plan(root, gpus, f)
    g1 = got["gpus"]["0001:00:00.0"]
    assert [(c, [n[2] for n in nics]) for c, nics in g1[:1]] == [("HINT", ["mlx5_ib0"])] and g1[1][0] == "NODE"
    assert [n[2] for n in got["gpus"]["0002:00:00.0"][0][1]] == ["mlx5_ib1", "mlx5_ib4"]
    assert got["gpus"]["0003:00:00.0"][0][0] == "NODE"
    f.write_text('{"0001:00:00.0": "mlx5_ib0"}')
    assert "expected a JSON object" in plugin_plan(root, None, f)["error"]
