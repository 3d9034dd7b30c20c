"""`multirail doctor`'s GPU-NIC layout checks (multirail/doctor_topology.py) on the topology
fixtures (tests/topo_fixtures.py): each problem is flagged, with evidence and fix, on a tree
that has it, and the healthy DGX H100 tree raises nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import topo_fixtures as F

from multirail import doctor, doctor_topology
from multirail.doctor import Status

TOPO = set(doctor_topology.CHECK_NAMES)


def topo_results(tmp_path: Path, spec: F.Spec, prep=None) -> list[doctor.CheckResult]:
    F.build(tmp_path, spec)
    if prep:
        prep(tmp_path)
    rep = doctor.run_doctor(root=str(tmp_path))
    return [r for r in rep.results if r.name in TOPO]


def flagged(results: list[doctor.CheckResult]) -> dict[tuple[str, str | None], Status]:
    return {(r.name, r.rail): r.status for r in results if r.status is not Status.OK}


def test_healthy_dgx_is_silent(tmp_path: Path) -> None:
    res = topo_results(tmp_path, F.dgx(acs=0x0001))
    assert flagged(res) == {}
    assert {r.name for r in res} == TOPO
    assert sum(r.name == "acs" for r in res) == 8 and sum(r.name == "gpu-nic-distance" for r in res) == 8
    rep = doctor.run_doctor(root=str(tmp_path))
    assert rep.matrix and rep.matrix[1].startswith("GPU0") and "PXB" in rep.matrix[1]
    assert "GPU-NIC matrix" in doctor.format_human(rep, colour=False)


def test_gpu_without_pxb_nic_warns(tmp_path: Path) -> None:
    res = topo_results(tmp_path, F.azure_ndv5())
    warn = [r for r in res if r.name == "gpu-nic-distance" and r.status is Status.WARN]
    assert len(warn) == 8 and "NODE" in warn[0].evidence and "hint file" in warn[0].fix


@pytest.mark.parametrize("spec", [F.gb200, F.dgx_spark])
def test_c2c_gpu_with_a_nic_on_its_socket_is_not_flagged(spec, tmp_path: Path) -> None:
    """GB200 and GB10 GPUs hang off their CPU by NVLink-C2C: every NIC is NODE by design (no PCIe
    switch could pair them) and NCCL runs GPUDirect over that path (P2C); nothing to fix."""
    res = [r for r in topo_results(tmp_path, spec()) if r.name == "gpu-nic-distance"]
    assert res and all(r.status is Status.OK for r in res), [(r.status, r.evidence) for r in res]
    assert "C2C" in res[0].evidence and "NODE" in res[0].evidence


def test_c2c_gpu_whose_nics_are_all_on_the_other_socket_warns(tmp_path: Path) -> None:
    spec = F.gb200()
    spec.fns = [f for f in spec.fns if not (f.ib and f.numa == 0)]  # socket 0 loses its NICs
    res = [r for r in topo_results(tmp_path, spec) if r.name == "gpu-nic-distance"]
    assert sorted(r.status.value for r in res) == ["ok", "ok", "warn", "warn"]
    assert all("SYS" in r.evidence for r in res if r.status is Status.WARN)


def test_nic_below_max_width_warns(tmp_path: Path) -> None:
    res = topo_results(tmp_path, F.dgx(acs=0, narrow_nic=0))
    assert flagged(res) == {("nic-link", "ibp24s0"): Status.WARN}
    r = next(r for r in res if r.status is Status.WARN)
    assert "x8" in r.evidence and "x16" in r.evidence and "lspci" in r.fix


def test_acs_redirect_between_gpu_and_nic_fails(tmp_path: Path) -> None:
    res = topo_results(tmp_path, F.dgx(acs=0x000D))
    fails = [r for r in res if r.name == "acs" and r.status is Status.FAIL]
    assert len(fails) == 8 and flagged(res).keys() == {("acs", r.rail) for r in fails}
    assert "0000:17:00.0" in fails[0].evidence and "ReqRedir+CmpltRedir" in fails[0].evidence
    assert "setpci -s 0000:17:00.0 ECAP_ACS+0x6.w=0000" in fails[0].fix


def test_acs_from_lspci_when_config_space_is_short(tmp_path: Path) -> None:
    def short_config(root: Path) -> None:
        for n in F.DGX_NIC_BUSES:
            (root / "sys" / "bus" / "pci" / "devices" / f"0000:{n - 1:02x}:00.0" / "config").write_bytes(b"\0" * 64)
        cmd = root / ".cmd"
        cmd.mkdir()
        (cmd / "lspci_-vvv_-s_0000_17_00.0.out").write_text(
            "0000:17:00.0 PCI bridge\n\tCapabilities: [220] Access Control Services\n"
            "\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+\n"
            "\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+\n")

    res = topo_results(tmp_path, F.dgx(acs=0), short_config)
    acs = {r.rail: r.status for r in res if r.name == "acs"}
    assert acs[f"GPU0 {F.dgx_gpu_chain(0x18)[-1]}"] is Status.FAIL
    assert sum(s is Status.SKIP for s in acs.values()) == 7, "the others: not readable, said so"


@pytest.mark.parametrize("groups", [True, False])
def test_iommu_translation_warns(groups: bool, tmp_path: Path) -> None:
    prep = None if groups else (lambda root: shutil.rmtree(root / "sys" / "kernel" / "iommu_groups"))
    res = topo_results(tmp_path, F.dgx(acs=0, iommu="on"), prep)
    assert flagged(res) == {("iommu", None): Status.WARN}
    r = next(r for r in res if r.name == "iommu")
    assert ("DMA-FQ" if groups else "intel_iommu=on without iommu=pt") in r.evidence and "iommu=pt" in r.fix


def test_gpudirect_modules_missing_warns_and_dmabuf_counts(tmp_path: Path) -> None:
    spec = F.dgx(acs=0, modules=("nvidia", "mlx5_ib"))
    res = topo_results(tmp_path / "a", spec)
    assert flagged(res) == {("gpudirect-modules", None): Status.WARN}
    assert "modprobe nvidia_peermem" in next(r.fix for r in res if r.name == "gpudirect-modules")
    spec.files["proc/driver/nvidia/version"] = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15\n"
    res = topo_results(tmp_path / "b", spec)
    assert flagged(res) == {} and "dma-buf" in next(r.evidence for r in res if r.name == "gpudirect-modules")


def test_doctor_sysfs_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sysr = F.build(tmp_path / "t", F.dgx(acs=0, narrow_nic=3))
    healthy = Path(__file__).parent / "fixtures" / "doctor" / "healthy"
    doctor.main(["--root", str(healthy), "--sysfs", str(sysr), "--json"])
    rep = json.loads(capsys.readouterr().out)
    link = {r["rail"]: r["status"] for r in rep["results"] if r["name"] == "nic-link"}
    assert link["ibp94s0"] == "warn" and link["ibp24s0"] == "ok" and rep["facts"]["gpu_nic_matrix"]["0000:1b:00.0"]["ibp24s0"] == "PXB"


def test_gpudirect_modules_efa_peermem_counts(tmp_path: Path) -> None:
    """AWS EFA hosts get GPUDirect from the EFA installer's efa_nv_peermem (UCX checks it too,
    openucx/ucx#10966): with it loaded there is nothing to fix."""
    spec = F.aws_p5en()
    spec.files["proc/modules"] = "".join(f"{m} 16384 0 - Live 0x0\n" for m in ("nvidia", "efa", "efa_nv_peermem"))
    res = [r for r in topo_results(tmp_path, spec) if r.name == "gpudirect-modules"]
    assert [r.status for r in res] == [Status.OK] and "efa_nv_peermem" in res[0].evidence
