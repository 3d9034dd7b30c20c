"""`make gpu-check` (benchmarks/gpu_check.py) on a machine without a GPU: it says so at the top of
its report and fails (exit 2) rather than pretend, after recording the host sections (RDMA tools,
UCX transports) with their commands and exit statuses. On a machine with a GPU this test skips:
there the whole check is `make gpu-check` itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
