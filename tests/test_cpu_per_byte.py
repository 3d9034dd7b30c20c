"""benchmarks/cpu_per_byte.py (issue 22 item 5): its CPU accounting reads every thread of a
process from /proc, and one short run on loopback measures both multirail processes and both
iperf3 processes over a window and reports per-GB numbers and ratios (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import engine_available

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "cpu_per_byte.py"


def _module():
    spec = importlib.util.spec_from_file_location("cpu_per_byte", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_seconds_counts_every_thread_of_the_process():
    mod = _module()
    before = mod.cpu_seconds(os.getpid())
    stop = time.monotonic() + 30

    def burn() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.3 and time.monotonic() < stop:
            pass

    th = threading.Thread(target=burn)
    th.start()
    th.join(60)
    # The thread has exited: its CPU still counts in the process's total (0.3 s burnt, clock
    # ticks of 1/CLK_TCK s).
    assert mod.cpu_seconds(os.getpid()) - before >= 0.2
    with pytest.raises(OSError):
        mod.cpu_seconds(2**22 + 7)  # above any pid_max: no such process


def test_build_must_name_a_python_tree(tmp_path: Path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--build", f"x={tmp_path}"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "LABEL=DIR" in p.stderr, p.stderr


@pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")
@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 is not installed")
def test_one_short_run_measures_both_sides_of_both_workers(tmp_path: Path):
    out = tmp_path / "cpb.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--runs", "1", "--ops", "WRITE", "--progress", "block",
                        "--size", "4MiB", "--seconds", "0.5", "--warmup", "1", "--iperf3-skip", "0.2",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    (rows,) = doc["runs"]
    by = {r["worker"]: r for r in rows}
    assert set(by) == {"iperf3", "multirail-block"}
    mr, ip = by["multirail-block"], by["iperf3"]
    assert mr["bytes"] >= 4 << 20 and mr["bytes"] % (4 << 20) == 0  # whole transfers only
    assert mr["initiator_cpu_s"] > 0 and mr["target_cpu_s"] > 0
    assert ip["bytes"] > 0 and ip["client_cpu_s"] + ip["server_cpu_s"] > 0
    for r in (mr, ip):
        assert r["cpu_per_gb"] == pytest.approx(r["send_cpu_per_gb"] + r["recv_cpu_per_gb"])
    s = doc["summary"]["WRITE/multirail-block"]
    assert s["ratio_worst"] == pytest.approx(mr["cpu_per_gb"] / ip["cpu_per_gb"])
    assert "WRITE multirail-block" in p.stdout


@pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")
@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 is not installed")
def test_the_socket_floor_measures_both_of_its_processes_both_ways(tmp_path: Path):
    """--floor: a plain socket pair with the engine's buffer runs in every run, for each op in
    the op's direction; multirail's ratio to it is reported."""
    out = tmp_path / "cpb.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--runs", "1", "--ops", "READ,WRITE", "--progress", "block",
                        "--size", "4MiB", "--chunk-size", "1MiB", "--seconds", "0.5", "--warmup", "1",
                        "--iperf3-skip", "0.2", "--floor", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    (rows,) = doc["runs"]
    for op in ("READ", "WRITE"):
        by = {r["worker"]: r for r in rows if r["op"] == op}
        assert set(by) == {"iperf3", "floor", "multirail-block"}
        fl = by["floor"]
        assert fl["bytes"] >= 4 << 20 and fl["bytes"] % (4 << 20) == 0
        assert fl["send_cpu_s"] > 0 and fl["recv_cpu_s"] > 0
        assert fl["cpu_per_gb"] == pytest.approx(fl["send_cpu_per_gb"] + fl["recv_cpu_per_gb"])
        s = doc["summary"][f"{op}/multirail-block"]
        assert s["floor_ratio_worst"] == pytest.approx(by["multirail-block"]["cpu_per_gb"] / fl["cpu_per_gb"])
    assert "x floor" in p.stdout


def _perf_counts_syscalls() -> bool:
    """perf can count syscall tracepoints of other processes here (root, tracefs)."""
    if shutil.which("perf") is None or os.geteuid() != 0:
        return False
    p = subprocess.run(["perf", "stat", "-e", "syscalls:sys_enter_futex", "--", "true"], capture_output=True, text=True,
                       timeout=60)
    return p.returncode == 0


@pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")
@pytest.mark.skipif(not _perf_counts_syscalls(), reason="perf cannot count syscall tracepoints (needs root and perf)")
def test_cpu_wakeups_counts_both_processes_of_a_read():
    """benchmarks/cpu_wakeups.py attaches perf to the initiator and the target of a short READ
    loop and reports, per side, context switches and syscalls per GB: both sides move data, so
    both make receive or write calls (no timing is asserted)."""
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_wakeups.py"), "--op", "READ", "--seconds", "0.5",
                        "--size", "8MiB"], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("multirail READ adaptive:"), p.stdout
    sides = {ln.split()[0]: ln for ln in lines[1:]}
    assert set(sides) == {"initiator", "target"}, p.stdout
    for side, ln in sides.items():
        nums = dict(zip(ln.split()[1::2], ln.split()[2::2]))
        assert float(nums["recv/GB"]) + float(nums["writev/GB"]) > 0, f"{side}: {ln}"
