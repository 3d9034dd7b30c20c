#!/usr/bin/env python3
"""`make gpu-check`: everything that needs a GPU, in one command, into one report (issue 19).

Run on a GPU machine the moment one is lent: ``.venv/bin/python benchmarks/gpu_check.py
[--report gpu-check-report.md] [--quick]``. Sections, each recorded with its command, exit
status, time and output (the last ``--tail`` lines; the whole output goes to ``--logs``):

1. ``nvidia-smi -L`` (when present) and a CUDA probe through the engine (``multirail.gpu.info``:
   the device, its runtime): **no usable GPU ends the check with a failure** (exit 2), after the
   host sections below, and says so at the top of the report, rather than pretend;
2. ``make test-gpu``: the CUDA device-layer tests and the ``gpu``-marked Python tests;
3. ``benchmarks/gpu_staging.py --gpu cuda --ipc``: VRAM vs DRAM, IPC vs the device's D2D copy,
   over loopback, and over a 2-rail testbed (2 rails vs 1; needs root);
4. ``multirail bench kv`` with VRAM on both sides (staged, then by CUDA IPC, then by CUDA IPC with
   one copy call per page: the gather kernel's baseline);
5. host facts that need no GPU: ``ibv_devices``/``ibv_devinfo`` (when present) and the UCX
   transports this machine offers (``ucx_info -d`` of the system UCX when present, and of the
   ``libucx`` wheel the engine falls back to, crates/multirail-ucx/src/load.rs);
6. the machine's real GPU-NIC topology (issue 34): ``multirail topology`` (the matrix in
   nvidia-smi's notation and the rails chosen per GPU and NUMA node, with reasons; its JSON goes
   to the logs) and ``nvidia-smi topo -m`` beside it when present, to compare the classes. On a
   machine without GPUs it records what it found (NICs, the per-NUMA choice).

Exit status: 0 when every section passed, 1 when any failed, 2 when there is no usable GPU.
A missing optional tool (``ibv_devices``, a system ``ucx_info``) is recorded, not a failure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The Python that runs every section: the checkout's .venv, or MULTIRAIL_CHECK_PYTHON (the GPU
# machine's own python3, from benchmarks/gpu_check_offline.sh)
VPY = Path(os.environ.get("MULTIRAIL_CHECK_PYTHON") or REPO / ".venv" / "bin" / "python")


@dataclass
class Section:
    title: str
    cmd: list[str] | None
    rc: int | None = None
    secs: float = 0.0
    output: str = ""
    note: str = ""
    # "pass", "fail", "skip" (not run: no GPU, not root) or "absent" (optional tool missing)
    verdict: str = "skip"
    required: bool = True
    log: Path | None = None


@dataclass
class Check:
    a: argparse.Namespace
    sections: list[Section] = field(default_factory=list)
    gpu: str = ""  # why there is no usable GPU; empty when there is one

    def run(self, title: str, cmd: list[str], timeout: float, required: bool = True, env: dict | None = None) -> Section:
        timeout = min(timeout, self.a.max_section_s) if self.a.max_section_s else timeout
        s = Section(title, cmd, required=required)
        envnote = ("with " + " ".join(f"{k}={v}" for k, v in env.items())) if env else ""
        self.sections.append(s)
        print(f"== {title}: {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", timeout=timeout, env={**os.environ, **(env or {})})
            s.rc, s.output = p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            s.rc, s.output, s.note = 124, out, f"timed out after {timeout:.0f} s"
        except OSError as e:
            s.rc, s.output, s.note = 127, str(e), "could not start"
        s.secs = time.monotonic() - t0
        s.note = "; ".join(x for x in (envnote, s.note) if x)
        s.verdict = "pass" if s.rc == 0 else "fail"
        self.a.logs.mkdir(parents=True, exist_ok=True)
        s.log = self.a.logs / f"{len(self.sections):02d}-{''.join(c if c.isalnum() else '-' for c in title.lower())}.log"
        s.log.write_text(s.output)
        print(f"   {s.verdict} (exit {s.rc}, {s.secs:.1f} s)", flush=True)
        return s

    def skip(self, title: str, cmd: list[str] | None, why: str, verdict: str = "skip", required: bool = True) -> None:
        self.sections.append(Section(title, cmd, note=why, verdict=verdict, required=required))
        print(f"== {title}: {verdict}: {why}", flush=True)


def probe_gpu(c: Check) -> None:
    """nvidia-smi (when present) and CUDA through the engine; sets `c.gpu` to the reason when
    there is no usable GPU."""
    if shutil.which("nvidia-smi"):
        c.run("nvidia-smi -L", ["nvidia-smi", "-L"], 60, required=False)
    else:
        c.skip("nvidia-smi -L", ["nvidia-smi", "-L"], "nvidia-smi is not installed", verdict="absent", required=False)
    code = ("import json, multirail.gpu as g\n"
            "i = g.info(0, 'cuda')\n"
            "b = g.DeviceBuffer(1 << 20, kind='cuda'); b.free()\n"
            "print(json.dumps(i))\n")
    s = c.run("CUDA probe (multirail.gpu.info, a 1 MiB cudaMalloc)", [str(VPY), "-c", code], 120)
    if s.rc != 0:
        last = [ln for ln in s.output.strip().splitlines() if ln.strip()]
        c.gpu = last[-1] if last else f"the probe exited {s.rc}"


def topology_sections(c: Check) -> None:
    """The real topology through multirail.topology (docs/topology.md), and nvidia-smi's view."""
    c.a.logs.mkdir(parents=True, exist_ok=True)
    c.run("GPU-NIC topology (multirail topology)", [str(VPY), "-m", "multirail", "topology"], 120)
    s = c.run("GPU-NIC topology as JSON (multirail topology --json)", [str(VPY), "-m", "multirail", "topology", "--json"],
              120, required=False)
    if s.rc == 0:
        (c.a.logs / "topology.json").write_text(s.output)
    if shutil.which("nvidia-smi"):
        c.run("nvidia-smi topo -m", ["nvidia-smi", "topo", "-m"], 60, required=False)
    else:
        c.skip("nvidia-smi topo -m", ["nvidia-smi", "topo", "-m"], "nvidia-smi is not installed", verdict="absent",
               required=False)


def host_sections(c: Check) -> None:
    for tool, args in (("ibv_devices", []), ("ibv_devinfo", ["-v"] if c.a.verbose_ibv else [])):
        if shutil.which(tool):
            c.run(tool, [tool, *args], 60)
        else:
            c.skip(tool, [tool, *args], f"{tool} is not installed (rdma-core's ibverbs-utils): no RDMA tools here",
                   verdict="absent", required=False)
    if shutil.which("ucx_info"):
        c.run("UCX transports (system ucx_info -d)", ["ucx_info", "-d"], 120)
    else:
        c.skip("UCX transports (system ucx_info -d)", ["ucx_info", "-d"], "no system UCX (ucx_info not on PATH)",
               verdict="absent", required=False)
    wheel = wheel_ucx_info()
    if wheel:
        # The wheel's tools find its libraries in its lib/ (as the engine loads them).
        lib = str(wheel.parent.parent / "lib")
        env = {"LD_LIBRARY_PATH": os.pathsep.join(x for x in (lib, os.environ.get("LD_LIBRARY_PATH", "")) if x)}
        c.run("UCX transports (libucx wheel ucx_info -d)", [str(wheel), "-d"], 120, env=env)
        c.run("UCX version (libucx wheel ucx_info -v)", [str(wheel), "-v"], 60, env=env)
    else:
        c.skip("UCX transports (libucx wheel ucx_info -d)", None, "the libucx wheel is not installed in .venv (make setup)")


def wheel_ucx_info() -> Path | None:
    """The libucx wheel's ucx_info, as the engine finds the wheel (its package directory)."""
    try:
        p = subprocess.run([str(VPY), "-c", "import libucx, os; print(os.path.dirname(libucx.__file__))"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    d = Path(p.stdout.strip()) if p.returncode == 0 else None
    exe = d / "bin" / "ucx_info" if d else None
    return exe if exe and exe.exists() else None


def gpu_sections(c: Check) -> None:
    a = c.a
    if a.rust_tests:
        # A GPU machine without a Rust toolchain: the multirail-gpu test binaries built elsewhere
        # (benchmarks/gpu_check_offline.sh), then the gpu-marked Python tests, as `make test-gpu`.
        sites = subprocess.run([str(VPY), "-c", "import site; print(':'.join(site.getsitepackages()))"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
        exes = sorted(x for x in a.rust_tests.iterdir() if x.is_file() and os.access(x, os.X_OK))
        if not exes:
            c.skip("CUDA device-layer tests (prebuilt)", None, f"no test executables in {a.rust_tests}")
        for exe in exes:
            c.run(f"CUDA device-layer tests ({exe.name} --ignored)", [str(exe), "--ignored", "--test-threads", "1"],
                  900, env={"MULTIRAIL_CUDA_WHEEL_DIRS": os.environ.get("MULTIRAIL_CUDA_WHEEL_DIRS", sites)})
        c.run("gpu-marked Python tests (pytest -m gpu)", [str(VPY), "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests"],
              900)
    else:
        c.run("CUDA tests (make test-gpu)", ["make", "test-gpu"], 1800)
    rounds = ["--rounds", "1", "--iters", "3"] if a.quick else ["--rounds", str(a.rounds)]
    gs = [str(VPY), "benchmarks/gpu_staging.py", "--gpu", "cuda", "--ipc", "--size", a.size, *rounds]
    c.run("VRAM vs DRAM, IPC vs D2D over loopback (benchmarks/gpu_staging.py --rails none)",
          [*gs, "--rails", "none", "--json", str(a.logs / "gpu_staging_loopback.json")], 1800)
    if os.geteuid() == 0:
        c.run("VRAM vs DRAM over 2 testbed rails, 2 rails vs 1 (benchmarks/gpu_staging.py --rails 2x2g)",
              [*gs, "--rails", "2x2g", "--json", str(a.logs / "gpu_staging_2rails.json")], 2400)
    else:
        c.skip("VRAM vs DRAM over 2 testbed rails, 2 rails vs 1 (benchmarks/gpu_staging.py --rails 2x2g)",
               [*gs, "--rails", "2x2g"], "needs root (the testbed's network namespaces): run `sudo make gpu-check`")
    kv = [str(VPY), "-m", "multirail", "bench", "kv", "--model", "llama-3.1-8b", "--isl", "4096",
          "--requests", "4" if a.quick else "10", "--initiator-seg-type", "VRAM", "--target-seg-type", "VRAM",
          "--gpu", "cuda", "--check-consistency", "--timeout", "60"]
    c.run("bench kv, VRAM both sides, staged (--gpu-ipc off)", [*kv, "--gpu-ipc", "off"], 1800)
    # 8 KiB pages (TP 8): where a request per page cost most; vectored requests gather them
    # into the pinned buffers a buffer's worth per kernel launch (docs/gpu.md).
    c.run("bench kv, VRAM both sides, staged, 8 KiB pages (--gpu-ipc off --tp 8)", [*kv, "--gpu-ipc", "off", "--tp", "8"], 1800)
    c.run("bench kv, VRAM both sides, CUDA IPC (--gpu-ipc on)", [*kv, "--gpu-ipc", "on"], 1800)
    # The IPC copies' baseline in the same run: one cudaMemcpyAsync per page (docs/gpu.md, "How the
    # copies are queued"); the row above used the default (the gather kernel for small pages).
    c.run("bench kv, VRAM both sides, CUDA IPC, one copy call per page (MULTIRAIL_CUDA_COPY=loop)",
          [*kv, "--gpu-ipc", "on"], 1800, env={"MULTIRAIL_CUDA_COPY": "loop"})


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def report(c: Check) -> int:
    failed = [s for s in c.sections if s.verdict == "fail" and s.required]
    status = 2 if c.gpu else (1 if failed else 0)
    verdict = ("FAIL: NO GPU" if c.gpu else "FAIL" if failed else "PASS")
    lines = [
        "# make gpu-check report",
        "",
        f"- result: **{verdict}** (exit {status})",
        f"- when: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- host: {platform.node()} ({platform.platform()}), commit {git_rev()}, uid {os.geteuid()}",
    ]
    if c.gpu:
        lines += ["", f"**No GPU: {c.gpu}**", "",
                  "The sections that need a GPU were not run: this report says nothing about CUDA. "
                  "Run `make gpu-check` on a machine with a GPU."]
    if failed:
        lines += ["", "Failed: " + ", ".join(s.title for s in failed)]
    lines += ["", "| section | result | exit | time |", "|---|---|---|---|"]
    for s in c.sections:
        lines.append(f"| {s.title} | {s.verdict} | {'' if s.rc is None else s.rc} | {s.secs:.1f} s |")
    for s in c.sections:
        lines += ["", f"## {s.title}", ""]
        lines.append(f"- command: `{' '.join(s.cmd) if s.cmd else '(none)'}`")
        lines.append(f"- result: {s.verdict}" + (f", exit status {s.rc}" if s.rc is not None else "")
                     + (f", {s.secs:.1f} s" if s.rc is not None else ""))
        if s.note:
            lines.append(f"- note: {s.note}")
        if s.log:
            lines.append(f"- full output: `{s.log}`")
        if s.rc is not None:
            out = s.output.rstrip().splitlines()
            if len(out) > c.a.tail:
                lines += ["", f"(last {c.a.tail} of {len(out)} lines)"]
                out = out[-c.a.tail:]
            lines += ["", "```", *[ln.replace("```", "'''") for ln in out], "```"]
    c.a.report.write_text("\n".join(lines) + "\n")
    print(f"\n{verdict}: report in {c.a.report}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", type=Path, default=REPO / "gpu-check-report.md")
    p.add_argument("--logs", type=Path, default=None, help="directory for whole outputs (default: next to the report)")
    p.add_argument("--size", default="64MiB", help="transfer size of the gpu_staging cases")
    p.add_argument("--rounds", type=int, default=5, help="gpu_staging rounds (the brief: at least 5 fresh runs)")
    p.add_argument("--quick", action="store_true", help="one short round of each benchmark (a smoke run)")
    p.add_argument("--tail", type=int, default=200, help="output lines per section in the report")
    p.add_argument("--verbose-ibv", action="store_true", help="ibv_devinfo -v")
    p.add_argument("--rust-tests", type=Path, default=None, metavar="DIR",
                   help="run the prebuilt multirail-gpu test executables in DIR instead of `make test-gpu` "
                        "(a GPU machine without cargo: benchmarks/gpu_check_offline.sh)")
    p.add_argument("--max-section-s", type=float, default=0.0,
                   help="cap every section's time limit at this many seconds (0: the sections' own limits)")
    a = p.parse_args(argv)
    a.report = a.report.resolve()
    a.logs = (a.logs or a.report.with_name(a.report.stem + "-logs")).resolve()
    c = Check(a)
    probe_gpu(c)
    if c.gpu:
        print(f"NO GPU: {c.gpu}", flush=True)
        for title in ("CUDA tests (make test-gpu)", "GPU benchmarks (benchmarks/gpu_staging.py)", "bench kv with VRAM"):
            c.skip(title, None, "no usable GPU")
    else:
        gpu_sections(c)
    host_sections(c)
    topology_sections(c)
    return report(c)


if __name__ == "__main__":
    sys.exit(main())
