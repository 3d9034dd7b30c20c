"""`make gpu-check` (benchmarks/gpu_check.py) on a machine without a GPU: it says so at the top of
its report and fails (exit 2) rather than pretend, after recording the host sections (RDMA tools,
UCX transports) with their commands and exit statuses. On a machine with a GPU this test skips:
there the whole check is `make gpu-check` itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import engine_available

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")


def _has_gpu() -> bool:
    p = subprocess.run([sys.executable, "-c", "import multirail.gpu as g; g.info(0, 'cuda')"], capture_output=True, timeout=120)
    return p.returncode == 0


def test_gpu_check_says_no_gpu_and_fails_here(tmp_path: Path) -> None:
    if _has_gpu():
        pytest.skip("this machine has a GPU: run `make gpu-check` for the real check")
    report = tmp_path / "report.md"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--report", str(report), "--quick"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "NO GPU" in p.stdout, p.stdout
    text = report.read_text()
    head = text.split("\n## ")[0]
    assert "FAIL: NO GPU" in head and "**No GPU:" in head and "no usable GPU" in head, head
    # The GPU sections are recorded as not run, never as passed.
    for title in ("CUDA probe", "CUDA tests (make test-gpu)", "bench kv with VRAM"):
        assert f"## {title}" in text, title
    assert "| CUDA tests (make test-gpu) | skip |" in text, text
    assert "| CUDA probe (multirail.gpu.info, a 1 MiB cudaMalloc) | fail |" in text, text
    assert "| GPU benchmarks (benchmarks/gpu_staging.py) | skip |" in text and "| bench kv with VRAM | skip |" in text, text
    # Host sections: each with its command and outcome; the wheel's UCX lists its transports.
    assert "## ibv_devices" in text and "- command: `ibv_devices`" in text
    ucx = text.split("## UCX transports (libucx wheel ucx_info -d)")[1].split("\n## ")[0]
    assert "- result: pass, exit status 0" in ucx and "Transport: tcp" in ucx, ucx
    assert "- command: `" in ucx and "ucx_info -d`" in ucx, ucx
    assert (tmp_path / "report-logs").is_dir()
    # The machine's real topology, recorded with what it found (no GPU here: NICs and NUMA plan).
    topo = text.split("## GPU-NIC topology (multirail topology)")[1].split("\n## ")[0]
    assert "- result: pass, exit status 0" in topo and "Rails per NUMA node" in topo, topo
    assert (tmp_path / "report-logs" / "topology.json").is_file()


def test_offline_gpu_check_runs_on_the_given_python_and_packs_its_output(tmp_path: Path) -> None:
    """benchmarks/gpu_check_offline.sh (a GPU box without network or Rust): it runs gpu_check.py
    on the Python it is given (here this one, which has no GPU: exit 2, said in the report),
    records the machine's facts, and leaves the report and one tarball of the logs in OUTDIR."""
    if _has_gpu():
        pytest.skip("this machine has a GPU: the offline check would run the GPU sections")
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check_offline.sh"), str(out), "--quick"],
                       capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ,
                                                                                   "PYTHON": sys.executable})
    assert p.returncode == 2, p.stdout + p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["gpu-check-report.md", "logs.tgz", "machine-facts.txt"]
    facts = (out / "machine-facts.txt").read_text()
    assert f"## python: {sys.executable}" in facts and "## RDMA" in facts and "ip: " in facts, facts
    head = (out / "gpu-check-report.md").read_text().split("\n## ")[0]
    assert "FAIL: NO GPU" in head, head
    listing = subprocess.run(["tar", "tzf", str(out / "logs.tgz")], capture_output=True, text=True, timeout=60).stdout
    assert "logs/" in listing and ".log" in listing, listing


def _bench_module(name: str) -> Any:
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module(name)


def test_serving_node_sections_run_where_they_can_and_say_why_not_elsewhere(tmp_path: Path) -> None:
    """The issue-35 sections of gpu_check: on one GPU without torch, RDMA or a CUDA 12 wheel each
    is recorded "not run" with its reason; on two GPUs with all of them, each runs, IPC both ways
    and every runtime with MULTIRAIL_CUDART pointing at it."""
    import argparse

    gc = _bench_module("gpu_check")
    ran: list[tuple[str, list[str], dict | None]] = []

    def fake_run(title: str, cmd: list[str], timeout: float, required: bool = True, env: dict | None = None) -> None:
        ran.append((title, cmd, env))

    c = gc.Check(argparse.Namespace(quick=True, max_section_s=0, logs=tmp_path))
    c.run = fake_run  # type: ignore[method-assign]
    gc.multi_gpu_sections(c, 1, [], False, [("CUDA 12", None), ("CUDA 13", Path("/w/libcudart.so.13"))])
    notes = [s.note for s in c.sections]
    assert c.sections and all(s.verdict == "skip" and s.note.startswith("not run: ") for s in c.sections), notes
    for why in ("needs two GPUs (this machine has 1)", "needs torch", "no CUDA 12 runtime", "needs an RDMA NIC"):
        assert any(why in n for n in notes), (why, notes)
    assert [(r[0].split(":")[0], r[2]) for r in ran] == [("CUDA 13 runtime", {"MULTIRAIL_CUDART": "/w/libcudart.so.13"})]

    ran.clear()
    c2 = gc.Check(argparse.Namespace(quick=True, max_section_s=0, logs=tmp_path))
    c2.run = fake_run  # type: ignore[method-assign]
    gc.multi_gpu_sections(c2, 2, ["mlx5_0"], True, [("CUDA 12", Path("/w/12.so")), ("CUDA 13", Path("/w/13.so"))])
    assert c2.sections == [], [s.title for s in c2.sections]
    cmds = [" ".join(r[1]) for r in ran]
    assert any("ipc2 --target-dev 1 --local-dev 0" in x for x in cmds) and any("ipc2 --target-dev 0 --local-dev 1" in x for x in cmds)
    assert any(" capture " in x + " " for x in cmds) and any(x.endswith(" expandable") for x in cmds)
    assert sum(1 for r in ran if r[2] == {"MULTIRAIL_CUDART": "/w/12.so"}) == 2  # probe and two-GPU IPC
    assert any("doctor" in x for x in cmds)


def test_gpu_multi_check_parses_nvidia_smi() -> None:
    m = _bench_module("gpu_multi_check")
    smi = "GPU 0: NVIDIA H200 (UUID: GPU-aaa)\nGPU 1: NVIDIA H200 (UUID: GPU-bbb)\n"
    assert m.parse_smi_list(smi) == ["GPU-aaa", "GPU-bbb"]
    apps = "123, GPU-aaa\n123, GPU-bbb\n456, GPU-bbb\nNo running processes found\n"
    assert m.foreign_contexts(apps, 123, {"GPU-aaa"}) == ["GPU-bbb"]
    assert m.foreign_contexts(apps, 456, {"GPU-bbb"}) == []


def test_the_two_gpu_ipc_check_holds_on_the_standin() -> None:
    """`gpu_multi_check.py ipc2` on two stand-in GPUs: the bytes both ways, by IPC, and no
    context on the target's GPU (what it checks with nvidia-smi on hardware)."""
    import json

    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_multi_check.py"), "ipc2", "--gpu", "standin", "--pages", "32"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and out["ok"], (out, p.stderr)
    assert out["ipc_transfers"] == 2 and out["contexts"] == [0] and out["write_bytes_ok"] and out["read_bytes_ok"], out
