"""Topology from sysfs and the rail plan, on the fixture trees of shared/topology-notes.md §5
(tests/topo_fixtures.py). Each fixture's expected sets are the notes'; the failure modes of other
implementations the notes list are each shown to be wrong on a fixture and avoided here."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import topo_fixtures as F

from multirail.topology import (
    PciDevice,
    Topology,
    TopologyError,
    classify,
    nic_affinity,
    normalize_bus_id,
    parse_cpulist,
)


def load(tmp_path: Path, spec: F.Spec, **kw: object) -> Topology:
    return Topology.load(F.build(tmp_path, spec), **kw)  # type: ignore[arg-type]


def rdma(tiers: list, i: int = 0) -> list[str]:
    return [n.rdma for n in tiers[i].nics]


def pcis(tiers: list, i: int = 0) -> list[str]:
    return [n.pci for n in tiers[i].nics]


def nic(topo: Topology, name: str):
    return next(n for n in topo.nics if name in (n.rdma, n.netdev))


def gpu(topo: Topology, bdf: str):
    return next(g for g in topo.gpus if g.bus_id == bdf)


DGX_GPUS = [f"0000:{n + 3:02x}:00.0" for n in F.DGX_NIC_BUSES]


# ---------------------------------------------------------------------------------------------
# F1 DGX H100/H200/B200


@pytest.mark.parametrize("variant", ["h100", "h200", "b200"])
def test_dgx_each_gpu_gets_its_pxb_nic_then_its_socket(variant: str, tmp_path: Path) -> None:
    topo = load(tmp_path, F.dgx(variant))
    plan = topo.rail_plan()
    assert [g.bus_id for g in topo.gpus] == DGX_GPUS
    for i, bdf in enumerate(DGX_GPUS):
        tiers = plan.for_gpu(bdf)
        assert (tiers[0].cls, rdma(tiers)) == ("PXB", [F.DGX_NAMES[i]])
        same = set(F.DGX_NAMES[:4] if i < 4 else F.DGX_NAMES[4:]) - {F.DGX_NAMES[i]}
        assert (tiers[1].cls, set(rdma(tiers, 1))) == ("NODE", same)
        assert len(tiers) == 2, "storage, DPU, x1 and cross-socket NICs stay out by default"
        assert plan.for_gpu(i) == tiers  # CUDA ordinal = PCI order without a CUDA view
    assert rdma(plan.for_numa(0)) == ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5"]
    assert rdma(plan.for_numa(1)) == ["mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]


def test_dgx_classes_match_nvidia_smi(tmp_path: Path) -> None:
    topo = load(tmp_path, F.dgx())
    g0 = gpu(topo, DGX_GPUS[0]).pci
    assert classify(g0, nic(topo, "mlx5_0").pci) == "PXB"
    assert classify(g0, nic(topo, "mlx5_3").pci) == "NODE"
    assert classify(g0, nic(topo, "mlx5_1").pci) == "NODE"
    assert classify(g0, nic(topo, "mlx5_6").pci) == "SYS"
    assert classify(nic(topo, "mlx5_1").pci, nic(topo, "mlx5_2").pci) == "PIX"
    m = topo.matrix()
    assert m[DGX_GPUS[7]]["ibp220s0"] == "PXB" and m[DGX_GPUS[7]]["ibp24s0"] == "SYS"


def test_dgx_storage_and_sys_only_when_asked(tmp_path: Path) -> None:
    topo = load(tmp_path, F.dgx())
    plan = topo.rail_plan(include=("storage", "sys"))
    tiers = plan.for_gpu(0)
    assert set(rdma(tiers, 1)) == {"mlx5_3", "mlx5_4", "mlx5_5", "mlx5_1", "mlx5_2"}
    assert tiers[-1].cls == "SYS" and set(rdma(tiers, -1)) == {"mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9", "mlx5_10", "mlx5_11"}
    excl = {e.name: e.reason for e in topo.rail_plan().excluded["host"]}
    assert "storage" in excl["ibp41s0f0"] and "no RDMA" in excl["eno1"]
    assert "SYS" in {e.name: e.reason for e in topo.rail_plan().excluded[DGX_GPUS[0]]}["ibp154s0"]


def test_b200_x1_management_function_excluded_though_pix(tmp_path: Path) -> None:
    topo = load(tmp_path, F.dgx("b200"))
    g4 = gpu(topo, DGX_GPUS[4]).pci
    assert classify(g4, nic(topo, "mlx5_16").pci) == "PIX", "a pure distance metric would pick it"
    plan = topo.rail_plan()
    assert rdma(plan.for_gpu(DGX_GPUS[4])) == ["mlx5_6"]
    reasons = {e.name: e.reason for e in plan.excluded["host"]}
    assert "x1" in reasons["ibp158s0f0"] and "DPU" in reasons["ibp41s0f0"]
    assert rdma(topo.rail_plan(include=("narrow",)).for_gpu(DGX_GPUS[4])) == ["mlx5_16"]


def test_names_shuffled_same_pci_sets(tmp_path: Path) -> None:
    a = load(tmp_path / "a", F.dgx("b200")).rail_plan()
    b = load(tmp_path / "b", F.dgx("b200", shuffled=True)).rail_plan()
    for bdf in DGX_GPUS:
        assert [pcis(a.for_gpu(bdf), i) for i in range(2)] == [pcis(b.for_gpu(bdf), i) for i in range(2)]
    assert rdma(b.for_gpu(DGX_GPUS[0])) == ["mlx5_4"]
    # a name-ordered pairing (mlx5_i <-> GPU i, UCCL sorts NICs by name) is wrong on this tree
    by_name = sorted((n for n in load(tmp_path / "c", F.dgx("b200", shuffled=True)).nics if n.rdma),
                     key=lambda n: int(n.rdma.split("_")[1]))
    assert by_name[0].pci.bdf != pcis(b.for_gpu(DGX_GPUS[0]))[0]


# ---------------------------------------------------------------------------------------------
# F2 AWS p5en / p5


P5EN_SPLIT = {"0000:59:00.0": [85, 86], "0000:5a:00.0": [87, 88], "0000:72:00.0": [110, 111],
              "0000:73:00.0": [112, 113], "0000:8b:00.0": [135, 136], "0000:8c:00.0": [137, 138],
              "0000:a4:00.0": [160, 161], "0000:a5:00.0": [162, 163]}


@pytest.mark.parametrize("numa_unknown", [False, True])
def test_p5en_two_gpus_split_their_switchs_four_efas(numa_unknown: bool, tmp_path: Path) -> None:
    topo = load(tmp_path, F.aws_p5en(numa_unknown))
    plan = topo.rail_plan()
    for bdf, efas in P5EN_SPLIT.items():
        tiers = plan.for_gpu(bdf)
        assert (tiers[0].cls, rdma(tiers)) == ("PIX", [f"rdmap{e}s0" for e in efas])
        sibling = set(rdma(tiers, 1))
        assert tiers[1].cls == "PIX" and len(sibling) == 2 and not sibling & set(rdma(tiers))
        assert "shared-switch split" in tiers[0].nics[0].reason
        assert all(n.netdev is None for t in tiers for n in t.nics), "EFA has no netdev; ENA is not a rail"
    shared = topo.rail_plan(share="all").for_gpu("0000:59:00.0")
    assert rdma(shared) == [f"rdmap{e}s0" for e in (85, 86, 87, 88)]
    if not numa_unknown:
        assert set(rdma(plan.for_numa(0))) == {f"rdmap{e}s0" for e in (85, 86, 87, 88, 110, 111, 112, 113)}
        assert set(rdma(plan.for_numa(1))) == {f"rdmap{e}s0" for e in (135, 136, 137, 138, 160, 161, 162, 163)}
    else:  # numa_node = -1 everywhere: not skipped, one node
        assert len(rdma(plan.for_numa(0))) == 16


def test_p5_each_gpu_its_four_efas(tmp_path: Path) -> None:
    plan = load(tmp_path, F.aws_p5()).rail_plan()
    for i, g in enumerate(F.P5_GPUS):
        tiers = plan.for_gpu(f"0000:{g:02x}:00.0")
        assert (tiers[0].cls, rdma(tiers)) == ("PIX", [f"rdmap{g - 4 + k}s0" for k in range(4)])
        assert tiers[0].nics[0].numa_node == (0 if i < 4 else 1)
    for node, gpus in ((0, F.P5_GPUS[:4]), (1, F.P5_GPUS[4:])):
        assert set(rdma(plan.for_numa(node))) == {f"rdmap{g - 4 + k}s0" for g in gpus for k in range(4)}
        assert len(plan.for_numa(node)) == 1, "the other socket's EFAs stay out"


# ---------------------------------------------------------------------------------------------
# F3 GB200, F4 DGX Spark


def test_gb200_socket_sets_no_bf3(tmp_path: Path) -> None:
    topo = load(tmp_path, F.gb200())
    plan = topo.rail_plan()
    for bdf, want in (("0008:01:00.0", ["0000:03:00.0", "0002:03:00.0"]), ("0009:01:00.0", ["0000:03:00.0", "0002:03:00.0"]),
                      ("0018:01:00.0", ["0010:03:00.0", "0012:03:00.0"]), ("0019:01:00.0", ["0010:03:00.0", "0012:03:00.0"])):
        tiers = plan.for_gpu(bdf)
        assert [(t.cls, pcis([t])) for t in tiers] == [("NODE", want)]
    assert rdma(plan.for_numa(0)) == ["mlx5_0", "mlx5_1"] and rdma(plan.for_numa(1)) == ["mlx5_4", "mlx5_5"]
    assert plan.for_numa(2) == [], "a CPU-less (GPU memory) node gets no choice"
    assert any("hint" in w for w in plan.warnings)
    # device-ID majority (pplx-garden) ties 4:4 between CX-7 and BF-3 here; BF-3 is excluded by kind
    ids = Counter(n.pci.device for n in topo.nics if n.rdma)
    assert ids[F.CX7] == ids[F.BF3] == 4
    chosen = {n.pci for tiers in plan.gpus.values() for t in tiers for n in t.nics}
    assert not any(n.pci.bdf in chosen for n in topo.nics if n.pci.device == F.BF3)


def test_gb200_char_and_bdf_only_metrics_cannot_tell_socket(tmp_path: Path) -> None:
    topo = load(tmp_path, F.gb200())
    g0 = gpu(topo, "0008:01:00.0").pci
    near, far = nic(topo, "mlx5_0").pci, nic(topo, "mlx5_4").pci
    root = os.path.realpath(tmp_path / "sys" / "devices")

    def real(d: PciDevice) -> str:
        return os.path.join(root, *d.path)

    def char_metric(a: str, b: str) -> int:  # Mooncake: '/' after the first differing character
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[i:].count("/") + b[i:].count("/")

    def bdf_only(a: PciDevice, b: PciDevice) -> int:  # UCCL: BDF components of the parents
        pa = [c for c in a.path[:-1] if not c.startswith("pci")]
        pb = [c for c in b.path[:-1] if not c.startswith("pci")]
        n = 0
        while n < min(len(pa), len(pb)) and pa[n] == pb[n]:
            n += 1
        return len(pa) + len(pb) - 2 * n

    assert char_metric(real(g0), real(near)) == char_metric(real(g0), real(far))
    assert bdf_only(g0, near) == bdf_only(g0, far)
    assert (classify(g0, near), classify(g0, far)) == ("NODE", "SYS")


@pytest.mark.parametrize("both", [False, True])
def test_dgx_spark_numa_minus_one_twins(both: bool, tmp_path: Path) -> None:
    topo = load(tmp_path, F.dgx_spark(both))
    assert [g.bus_id for g in topo.gpus] == ["000f:01:00.0"], "VGA class 0x0300 is a GPU"
    assert all(n.pci.numa_node == -1 for n in topo.nics)
    plan = topo.rail_plan()
    want = ["rocep1s0f0", "rocep1s0f1", "roceP2p1s0f0", "roceP2p1s0f1"] if both else ["rocep1s0f1", "roceP2p1s0f1"]
    assert sorted(rdma(plan.for_gpu(0))) == sorted(want)
    assert sorted(rdma(plan.for_numa(0))) == sorted(want)
    assert plan.for_gpu(0)[0].nics[0].link_gbps == pytest.approx(126.0, abs=0.1), "x4 Gen5 caps the 200G port"
    assert not plan.warnings


# ---------------------------------------------------------------------------------------------
# F5 Azure ND v5 (flat), AWS p4d (flat root bus)


def test_azure_numa_sets_and_hint(tmp_path: Path) -> None:
    topo = load(tmp_path / "a", F.azure_ndv5())
    plan = topo.rail_plan()
    for i, dom in enumerate(F.AZ_GPU_DOMS):
        tiers = plan.for_gpu(f"{dom:04x}:00:00.0")
        want = [f"mlx5_ib{k}" for k in (range(4) if i < 4 else range(4, 8))]
        assert [(t.cls, rdma([t])) for t in tiers] == [("NODE", want)]
    assert any("hint" in w for w in plan.warnings)
    assert rdma(plan.for_numa(0)) == [f"mlx5_ib{k}" for k in range(4)] and rdma(plan.for_numa(1)) == [f"mlx5_ib{k}" for k in range(4, 8)]
    assert "mlx5_an0" not in {n.rdma for tiers in plan.gpus.values() for t in tiers for n in t.nics}
    hints = tmp_path / "hints.json"
    hints.write_text(json.dumps(F.AZ_HINTS))
    hplan = Topology.load(tmp_path / "a" / "sys", hints=hints).rail_plan()
    for i, dom in enumerate(F.AZ_GPU_DOMS):
        tiers = hplan.for_gpu(f"{dom:04x}:00:00.0")
        assert (tiers[0].cls, rdma(tiers)) == ("HINT", [f"mlx5_ib{i}"])
        assert len(tiers[1].nics) == 3 and f"mlx5_ib{i}" not in rdma(tiers, 1)
    assert not hplan.warnings


def test_azure_numa_minus_one_every_gpu_every_nic_with_warning(tmp_path: Path) -> None:
    plan = load(tmp_path, F.azure_ndv5(numa=False)).rail_plan()
    for dom in F.AZ_GPU_DOMS:
        assert rdma(plan.for_gpu(f"{dom:04x}:00:00.0")) == [f"mlx5_ib{k}" for k in range(8)]
    assert any("not told apart" in w for w in plan.warnings)
    assert rdma(plan.for_numa(0)) == [f"mlx5_ib{k}" for k in range(8)]


def test_p4d_root_bus_component_counts(tmp_path: Path) -> None:
    topo = load(tmp_path, F.aws_p4d())
    plan = topo.rail_plan()
    for bus in ("10", "20", "90", "a0"):
        for dev in ("1c", "1d"):
            tiers = plan.for_gpu(f"0000:{bus}:{dev}.0")
            assert (tiers[0].cls, pcis(tiers)) == ("PHB", [f"0000:{bus}:1b.0"])
            assert tiers[1].cls == "NODE" and len(tiers) == 2
    assert rdma(plan.for_numa(0)) == ["rdmap16s27", "rdmap32s27"] and rdma(plan.for_numa(1)) == ["rdmap144s27", "rdmap160s27"]
    # the UCCL/modelexpress failure: dropping pciDDDD:BB makes every EFA equidistant on a flat tree
    g = gpu(topo, "0000:10:1c.0").pci
    parents = {tuple(c for c in n.pci.path[:-1] if not c.startswith("pci")) for n in topo.nics}
    assert parents == {()} and classify(g, nic(topo, "rdmap16s27").pci) != classify(g, nic(topo, "rdmap32s27").pci)


# ---------------------------------------------------------------------------------------------
# Units: classification by components, bus ids, CUDA view, affinity, bad input


def _dev(*chain: str, numa: int = 0) -> PciDevice:
    return PciDevice(chain[-1], tuple(chain), 0x15B3, 0x1021, 0x020700, numa, (), 16, 16, 32.0, 32.0)


def test_components_not_characters() -> None:
    a = _dev("pci0000:40", "0000:40:01.0", "0000:41:00.0")
    b = _dev("pci0000:40", "0000:40:01.1", "0000:42:00.0")
    common = os.path.commonprefix(["/".join(a.path), "/".join(b.path)])
    assert common.split("/")[-1] == "0000:40:01.", "a character prefix ends inside a component"
    assert classify(a, b) == "PHB"
    c = _dev("pci10000:00", "10000:00:01.0", "10000:01:00.0")
    d = _dev("pci1000:00", "1000:00:01.0", "1000:01:00.0")
    assert classify(c, d) == "NODE" and classify(c, _dev("pci10000:00", "10000:00:01.0", "10000:02:00.0")) == "PIX"


def test_normalize_bus_id() -> None:
    assert normalize_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert normalize_bus_id("0000000F:01:00.0") == "000f:01:00.0"
    assert normalize_bus_id("1b:00.0") == "0000:1b:00.0"
    assert normalize_bus_id("03f8cfdd:00:00.0") == "3f8cfdd:00:00.0"
    with pytest.raises(TopologyError):
        normalize_bus_id("not-a-bdf")
    assert parse_cpulist("0-2,5") == (0, 1, 2, 5) and parse_cpulist("") == ()


def test_a_cpulist_beyond_any_cpu_is_refused() -> None:
    """A CPU list naming CPUs no kernel has (a corrupt tree, a hostile setting) is malformed:
    refused, never expanded (``0-18446744073709551615`` would fill memory), in both parsers."""
    from multirail import affinity

    assert parse_cpulist("0-4000000") == () and parse_cpulist("0-3,4000000") == ()
    assert parse_cpulist("0-18446744073709551615") == ()
    assert parse_cpulist("0,65535") == (0, 65535)
    for bad in ("0-4000000", "0-18446744073709551615"):
        with pytest.raises(ValueError):
            affinity.parse_cpulist(bad)


def test_cuda_view_by_uuid_and_visible_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sysr = F.build(tmp_path, F.dgx())
    # CUDA ordinals reversed against PCI order, as a FASTEST_FIRST ordering may give
    view = [{"ordinal": 7 - i, "uuid": f"GPU-{i:08d}-aaaa", "pci_bus_id": f"0000{b.upper()}"} for i, b in enumerate(DGX_GPUS)]
    (tmp_path / "gpus.json").write_text(json.dumps(view))
    topo = Topology.load(sysr, gpus=tmp_path / "gpus.json")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert topo.gpu_bus_id(0) == DGX_GPUS[7]
    assert topo.gpu_bus_id("GPU-00000002") == DGX_GPUS[2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000005-aaaa,GPU-00000001")
    plan = topo.rail_plan()
    assert rdma(plan.for_gpu(0)) == [F.DGX_NAMES[5]] and rdma(plan.for_gpu(1)) == [F.DGX_NAMES[1]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    assert rdma(plan.for_gpu(0)) == [F.DGX_NAMES[1]]
    with pytest.raises(TopologyError):
        plan.for_gpu(1)
    csv = tmp_path / "gpus.csv"
    csv.write_text("index, uuid, pci.bus_id\n" + "".join(f"{e['ordinal']}, {e['uuid']}, {e['pci_bus_id']}\n" for e in view))
    assert Topology.load(sysr, gpus=csv).gpu_bus_id("GPU-00000003") == DGX_GPUS[3]


def test_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    sysr = F.build(tmp_path, F.dgx_spark())
    with pytest.raises(TopologyError, match="bus/pci/devices"):
        Topology.load(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TopologyError, match="bad JSON"):
        Topology.load(sysr, hints=tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text('["x"]')
    with pytest.raises(TopologyError, match="ordinal"):
        Topology.load(sysr, gpus=tmp_path / "bad.json")
    with pytest.raises(TopologyError, match="unknown include"):
        Topology.load(sysr).rail_plan(include=("everything",))
    with pytest.raises(TopologyError, match="no GPU"):
        Topology.load(sysr).rail_plan().for_gpu("0000:99:00.0")


def test_nic_affinity(tmp_path: Path) -> None:
    sysr = F.build(tmp_path, F.dgx())
    a = nic_affinity("ibp154s0", sysr)
    assert a.numa_node == 1 and a.cpus == parse_cpulist("56-111,168-223")
    assert nic_affinity("mlx5_0", sysr).numa_node == 0
    assert nic_affinity("veth0", sysr) == type(a)((), -1)


def test_plan_json_names_pci_addresses(tmp_path: Path) -> None:
    data = load(tmp_path, F.aws_p5en()).rail_plan().to_json()
    g0 = next(g for g in data["gpus"] if g["pci_bus_id"] == "0000:59:00.0")
    assert [(c["name"], c["pci"]) for c in g0["chosen"]] == [("rdmap85s0", "0000:55:00.0"), ("rdmap86s0", "0000:56:00.0")]
    json.dumps(data)


# ---------------------------------------------------------------------------------------------
# `multirail topology`


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from multirail.cli import main

    rc = main(["topology", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_prints_matrix_choices_and_exclusions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sysr = F.build(tmp_path, F.dgx("b200"))
    rc, out, _ = run_cli(capsys, "--sysfs", str(sysr))
    assert rc == 0
    gpu0 = next(line for line in out.splitlines() if line.startswith("GPU0 "))
    nics = load(tmp_path / "again", F.dgx("b200")).nics
    col = next(i for i, n in enumerate(nics) if n.rdma == "mlx5_0")
    assert gpu0.split()[1 + col] == "PXB" and "0-55,112-167" in gpu0
    assert "tier 1 PXB: ibp24s0" in out and "tier 2 NODE:" in out
    assert "excluded ibp154s0 (0000:9a:00.0): SYS" in out
    assert "ibp158s0f0 (0000:9e:00.0): PCIe x1" in out and "BlueField DPU" in out
    assert "node 1 (CPUs 56-111,168-223):" in out


def test_cli_json_gpus_file_and_hints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sysr = F.build(tmp_path, F.azure_ndv5())
    view = [{"ordinal": i, "uuid": f"GPU-{i}", "pci_bus_id": f"{d:08X}:00:00.0"} for i, d in enumerate(reversed(F.AZ_GPU_DOMS))]
    (tmp_path / "gpus.json").write_text(json.dumps(view))
    (tmp_path / "hints.json").write_text(json.dumps(F.AZ_HINTS))
    rc, out, _ = run_cli(capsys, "--sysfs", str(sysr), "--gpus", str(tmp_path / "gpus.json"), "--hints",
                         str(tmp_path / "hints.json"), "--json")
    assert rc == 0
    data = json.loads(out)
    by_bus = {g["pci_bus_id"]: g for g in data["gpus"]}
    assert by_bus["000c:00:00.0"]["ordinal"] == 0
    assert [(c["name"], c["rdma"], c["pci"]) for c in by_bus["000c:00:00.0"]["chosen"]] == [("ib7", "mlx5_ib7", "0108:00:00.0")]
    assert data["matrix"]["0001:00:00.0"]["ib0"] == "NODE" and data["cuda_view"].startswith("--gpus")
    rc, out, _ = run_cli(capsys, "--sysfs", str(sysr))
    assert "WARNING: no GPU shares a PCIe switch" in out
    rc, _, err = run_cli(capsys, "--sysfs", str(tmp_path / "missing"))
    assert rc == 2 and "bus/pci/devices" in err


def test_hint_problems_are_warnings_not_silence(tmp_path: Path) -> None:
    sysr = F.build(tmp_path, F.azure_ndv5())
    hints = {"0001:00:00.0": ["mlx5_an0"], "0099:00:00.0": ["ib1"], "GPU-nope": ["ib2"], "0002:00:00.0": ["ib1"]}
    topo = Topology.load(sysr, hints=hints)
    assert any("0099:00:00.0" in w and "no such GPU" in w for w in topo.warnings)
    assert any("GPU-nope" in w for w in topo.warnings)
    plan = topo.rail_plan()
    assert any("none of ['mlx5_an0']" in w for w in plan.warnings), "an excluded NIC named by a hint is said"
    assert plan.for_gpu("0001:00:00.0")[0].cls == "NODE"
    assert (plan.for_gpu("0002:00:00.0")[0].cls, rdma(plan.for_gpu("0002:00:00.0"))) == ("HINT", ["mlx5_ib1"])
    assert len(topo.rail_plan().warnings) == len(plan.warnings), "planning twice adds nothing to the facts"


def test_virtio_netdev_maps_to_its_pci_function(tmp_path: Path) -> None:
    spec = F.Spec("vm", [F.Fn(("pci0000:00", "0000:00:03.0"), 0x1AF4, 0x1041, F.ETH_CLS, 0, "0-3")], {0: "0-3"})
    sysr = F.build(tmp_path, spec)
    fn_dir = Path(os.path.realpath(sysr / "bus" / "pci" / "devices" / "0000:00:03.0"))
    (fn_dir / "virtio0" / "net" / "eth0").mkdir(parents=True)
    os.symlink("../../../virtio0", fn_dir / "virtio0" / "net" / "eth0" / "device")
    os.symlink(os.path.relpath(fn_dir / "virtio0" / "net" / "eth0", sysr / "class" / "net"), sysr / "class" / "net" / "eth0")
    topo = Topology.load(sysr)
    assert [(n.netdev, n.pci.bdf) for n in topo.nics] == [("eth0", "0000:00:03.0")]
    assert nic_affinity("eth0", sysr).numa_node == 0
    assert rdma(topo.rail_plan().for_numa(0)) == [None], "a host without RDMA: every PCI netdev is a candidate"


def test_numa_matrix(tmp_path: Path) -> None:
    topo = load(tmp_path, F.dgx())
    m = topo.numa_matrix()
    assert m[0]["ibp24s0"] == "NODE" and m[1]["ibp24s0"] == "SYS" and m[0]["eno1"] == "NODE"


def test_live_cuda_view_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the live /sys, the CUDA view comes from nvidia-smi (here a stand-in script)."""
    from multirail import topology

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=index,uuid,pci.bus_id ] || exit 3\n"
                    "echo '0, GPU-aaaa, 00000000:1B:00.0'\necho '1, GPU-bbbb, 00000000:43:00.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    view, source = topology._cuda_view(None, Path("/sys"))
    assert source == "nvidia-smi"
    assert view == [{"ordinal": 0, "uuid": "GPU-aaaa", "pci_bus_id": "0000:1b:00.0"},
                    {"ordinal": 1, "uuid": "GPU-bbbb", "pci_bus_id": "0000:43:00.0"}]
    assert topology._cuda_view(None, tmp_path)[1] == "pci order", "a fixture root never asks the host's nvidia-smi"


def test_storage_rule_counts_only_usable_nics(tmp_path: Path) -> None:
    """A DPU (or a management NIC) under a GPU switch must not turn the host's real NICs into
    'storage': only NICs that survive the other exclusions pair with a GPU."""
    spec = F.gb200()
    # a BF-3 function on GPU 0008's root port (PIX to it), as a DPU next to a GPU would be
    spec.fns.append(F.Fn(("pci0008:00", "0008:00:00.0", "0008:02:00.0"), 0x15B3, F.BF3, F.ETH_CLS, 0, "0-71",
                         ib="mlx5_9", netdev="roceP8p2s0", hca_type="MT41692", link_layer="Ethernet"))
    plan = load(tmp_path, spec).rail_plan()
    assert rdma(plan.for_gpu("0008:01:00.0")) == ["mlx5_0", "mlx5_1"]
    assert rdma(plan.for_numa(1)) == ["mlx5_4", "mlx5_5"]


def test_cli_include_and_share(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sysr = F.build(tmp_path, F.aws_p5en())
    rc, out, _ = run_cli(capsys, "--sysfs", str(sysr), "--share", "all", "--json")
    g0 = next(g for g in json.loads(out)["gpus"] if g["pci_bus_id"] == "0000:59:00.0")
    assert rc == 0 and [c["rdma"] for c in g0["chosen"]] == [f"rdmap{e}s0" for e in (85, 86, 87, 88)]
    rc, out, _ = run_cli(capsys, "--sysfs", str(sysr), "--include", "tcp,sys", "--json")
    g0 = next(g for g in json.loads(out)["gpus"] if g["pci_bus_id"] == "0000:59:00.0")
    assert any(n["netdev"] == "enp71s0" for t in g0["tiers"] for n in t["nics"]) and g0["tiers"][-1]["class"] == "SYS"
    rc, _, err = run_cli(capsys, "--sysfs", str(sysr), "--include", "everything")
    assert rc == 2 and "unknown include" in err


def test_spark_twins_grouped_by_pcie_link(tmp_path: Path) -> None:
    plan = load(tmp_path, F.dgx_spark(both_cables=True)).rail_plan()
    links = {n.rdma: n.pcie_link for n in plan.for_gpu(0)[0].nics}
    assert links == {"rocep1s0f0": "0000:01:00", "rocep1s0f1": "0000:01:00",
                     "roceP2p1s0f0": "0002:01:00", "roceP2p1s0f1": "0002:01:00"}


def test_mig_uuids_in_cuda_visible_devices_map_to_their_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process on a MIG slice sees CUDA_VISIBLE_DEVICES=MIG-<uuid> (or the pre-R470 form
    MIG-GPU-<gpu uuid>/<gi>/<ci>): its NICs are the parent GPU's."""
    sysr = F.build(tmp_path, F.dgx())
    mig = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"
    view = [{"ordinal": i, "uuid": f"GPU-{i:08d}-aaaa", "pci_bus_id": b, **({"mig_uuids": [mig]} if i == 3 else {})}
            for i, b in enumerate(DGX_GPUS)]
    plan = Topology.load(sysr, gpus=view).rail_plan()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    assert rdma(plan.for_gpu(0)) == [F.DGX_NAMES[3]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-GPU-00000005-aaaa/1/0")
    assert rdma(plan.for_gpu(0)) == [F.DGX_NAMES[5]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0000dead-0000-0000-0000-000000000000")
    with pytest.raises(TopologyError, match="nvidia-smi -L"):
        plan.for_gpu(0)


def test_live_cuda_view_reads_mig_uuids_from_nvidia_smi_l(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from multirail import topology

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nif [ \"$1\" = -L ]; then\n"
                    "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)'\n"
                    "echo '  MIG 3g.40gb     Device  0: (UUID: MIG-1111)'\n"
                    "echo '  MIG 3g.40gb     Device  1: (UUID: MIG-2222)'\n"
                    "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)'\nexit 0\nfi\n"
                    "echo '0, GPU-aaaa, 00000000:1B:00.0'\necho '1, GPU-bbbb, 00000000:43:00.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    view, _ = topology._cuda_view(None, Path("/sys"))
    assert [e.get("mig_uuids", []) for e in view] == [["MIG-1111", "MIG-2222"], []]


def test_storage_rule_keeps_the_nic_of_gpus_without_a_near_one(tmp_path: Path) -> None:
    """Four GPUs on two switches, one NIC on the first switch and one on a root port of its own
    (same socket). The second NIC is not storage: GPUs 2 and 3 have nothing nearer, and dropping
    it would put all four GPUs on one NIC. (On a DGX every GPU has its PXB NIC, so the storage
    pair stays out: test_dgx_storage_and_sys_only_when_asked.)"""
    def sw(root: int, dev: int) -> tuple[str, ...]:
        return (f"pci0000:{root:02x}", f"0000:{root:02x}:01.0", f"0000:{root + 1:02x}:00.0", f"0000:{root + 2:02x}:{dev:02x}.0")

    fns = [F.Fn(sw(0x10, 0) + ("0000:13:00.0",), 0x10DE, F.H100, F.GPU_CLS, 0, "0-31"),
           F.Fn(sw(0x10, 1) + ("0000:14:00.0",), 0x10DE, F.H100, F.GPU_CLS, 0, "0-31"),
           F.Fn(sw(0x10, 2) + ("0000:15:00.0",), 0x15B3, F.CX7, F.IB_CLS, 0, "0-31", ib="mlx5_0", netdev="ibp21s0"),
           F.Fn(sw(0x30, 0) + ("0000:33:00.0",), 0x10DE, F.H100, F.GPU_CLS, 0, "0-31"),
           F.Fn(sw(0x30, 1) + ("0000:34:00.0",), 0x10DE, F.H100, F.GPU_CLS, 0, "0-31"),
           F.Fn(("pci0000:50", "0000:50:01.0", "0000:51:00.0"), 0x15B3, F.CX7, F.IB_CLS, 0, "0-31", ib="mlx5_1",
                netdev="ibp81s0")]
    plan = load(tmp_path, F.Spec("two-switches-one-nic", fns, {0: "0-31"})).rail_plan()
    for bdf in ("0000:33:00.0", "0000:34:00.0"):
        assert [(t.cls, sorted(rdma([t]))) for t in plan.for_gpu(bdf)] == [("NODE", ["mlx5_0", "mlx5_1"])]
    assert [(t.cls, rdma([t])) for t in plan.for_gpu("0000:13:00.0")] == [("PIX", ["mlx5_0"]), ("NODE", ["mlx5_1"])]
    assert not plan.excluded["host"]


def test_sriov_vfs_of_a_host_pf_are_not_extra_rails(tmp_path: Path) -> None:
    """Four VFs of GPU 0's ConnectX-7 (enabled for containers): they share the PF's port and
    PCIe link, so striping over PF + VFs is one NIC counted five times. A VF whose PF is a NIC
    of this host is excluded (include 'vf'); a VF without its PF (Azure's IB VFs) stays a NIC
    (test_azure_numa_sets_and_hint)."""
    spec = F.dgx()
    pf = F.dgx_nic_chain(0x18)
    for k in range(1, 5):
        spec.fns.append(F.Fn(pf[:-1] + (f"0000:18:00.{k}",), 0x15B3, F.CX7_VF, F.IB_CLS, 0, F.DGX_CPUS[0],
                             ib=f"mlx5_{11 + k}", netdev=f"ibp24s0v{k}", width=0, max_width=0, speed="Unknown",
                             physfn="0000:18:00.0"))
    topo = load(tmp_path, spec)
    assert classify(gpu(topo, DGX_GPUS[0]).pci, nic(topo, "mlx5_12").pci) == "PXB"
    plan = topo.rail_plan()
    assert rdma(plan.for_gpu(0)) == ["mlx5_0"]
    assert "mlx5_12" not in {n.rdma for t in plan.for_numa(0) for n in t.nics}
    assert "SR-IOV VF of 0000:18:00.0" in {e.name: e.reason for e in plan.excluded["host"]}["ibp24s0v1"]
    assert sorted(rdma(topo.rail_plan(include=("vf",)).for_gpu(0))) == ["mlx5_0", "mlx5_12", "mlx5_13", "mlx5_14", "mlx5_15"]


def test_roce_lag_nic_is_named_by_its_bond(tmp_path: Path) -> None:
    """RoCE LAG: mlx5_bond_0 sits on PF 0, whose own netdev is a bond slave without an address;
    the RDMA port's netdev (ports/1/gid_attrs/ndevs/0, what ibdev2netdev reads) is bond0."""
    fns = [F.Fn(("pci0000:00", "0000:00:01.0", f"0000:01:00.{f}"), 0x15B3, 0x101D, F.ETH_CLS, 0, "0-7",
                ib="mlx5_bond_0" if f == 0 else None, netdev=f"enp1s0f{f}np{f}", link_layer="Ethernet",
                rate="200 Gb/sec (4X HDR)") for f in (0, 1)]
    sysr = F.build(tmp_path, F.Spec("roce-lag", fns, {0: "0-7"}))
    bond = sysr / "devices" / "virtual" / "net" / "bond0"
    (bond / "bonding").mkdir(parents=True)
    os.symlink("../../devices/virtual/net/bond0", sysr / "class" / "net" / "bond0")
    gid = Path(os.path.realpath(sysr / "class" / "infiniband" / "mlx5_bond_0")) / "ports" / "1" / "gid_attrs" / "ndevs"
    gid.mkdir(parents=True)
    (gid / "0").write_text("bond0\n")
    slave = Path(os.path.realpath(sysr / "class" / "net" / "enp1s0f0np0"))
    os.symlink(os.path.relpath(slave, bond), bond / "lower_enp1s0f0np0")
    assert nic_affinity("bond0", sysr) == type(nic_affinity("x", sysr))(tuple(range(8)), 0), "a bond is where its slaves are"
    topo = Topology.load(sysr)
    assert nic(topo, "mlx5_bond_0").netdev == "bond0"
    assert [(n.netdev, n.rdma) for n in topo.rail_plan().for_numa(0)[0].nics] == [("bond0", "mlx5_bond_0")]
