#!/usr/bin/env python3
"""`make gpu-check`: everything that needs a GPU, in one command, into one report (issue 19).

Run on a GPU machine the moment one is lent: ``.venv/bin/python benchmarks/gpu_check.py
[--report gpu-check-report.md] [--quick]``. Sections, each recorded with its command, exit
status, time and output (the last ``--tail`` lines; the whole output goes to ``--logs``):

1. ``nvidia-smi -L`` (when present) and a CUDA probe through the engine (``multirail.gpu.info``:
   the device, its runtime, and which image of the gather kernel it loaded: ``SASS sm_90
   (fatbin)``, ``PTX JIT ...``, docs/gpu.md "Kernel images"): **no usable GPU ends the check
   with a failure** (exit 2), after the host sections below, and says so at the top of the
   report, rather than pretend;
2. ``make test-gpu``: the CUDA device-layer tests and the ``gpu``-marked Python tests;
3. ``benchmarks/gpu_staging.py --gpu cuda --ipc``: VRAM vs DRAM, IPC vs the device's D2D copy,
   over loopback, and over a 2-rail testbed (2 rails vs 1; needs root);
4. ``multirail bench kv`` with VRAM on both sides (staged, then by CUDA IPC, then by CUDA IPC with
   one copy call per page: the gather kernel's baseline);
5. the checks of a serving node (``benchmarks/gpu_multi_check.py``, issue 35): two-GPU CUDA IPC
   both ways with KV pages (bytes, path, no context on the other GPU per ``nvidia-smi
   --query-compute-apps``), graph capture in a loop while staged and IPC transfers run,
   expandable-segment tensors by IPC (both need torch), the CUDA 12 and 13 runtimes (the nvidia
   wheels found); a section whose need the machine lacks (two GPUs, torch, a runtime, an RDMA
   NIC) is recorded as "not run" with the reason;
6. host facts that need no GPU: ``ibv_devices``/``ibv_devinfo`` (when present) and the UCX
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
sys.path.insert(0, str(REPO / "benchmarks"))


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
            "print(json.dumps(i))\n"
            "print('gather kernel image on cuda:0:', i.get('gather_kernel', 'not reported'))\n")
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


MULTI = "benchmarks/gpu_multi_check.py"
# The CUDA runtimes of the nvidia wheels (crates/multirail-gpu/src/cuda.rs WHEEL_PATHS).
RUNTIMES = (("CUDA 12", "nvidia/cuda_runtime/lib/libcudart.so.12"), ("CUDA 13", "nvidia/cu13/lib/libcudart.so.13"))


def gpu_uuids() -> list[str]:
    """The GPUs `nvidia-smi -L` lists (empty without nvidia-smi)."""
    if not shutil.which("nvidia-smi"):
        return []
    from gpu_multi_check import parse_smi_list

    p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return parse_smi_list(p.stdout) if p.returncode == 0 else []


def rdma_devices() -> list[str]:
    d = Path("/sys/class/infiniband")
    return sorted(x.name for x in d.iterdir()) if d.is_dir() else []


def has_torch_cuda() -> bool:
    p = subprocess.run([str(VPY), "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                       capture_output=True, timeout=120)
    return p.returncode == 0


def runtime_libs() -> list[tuple[str, Path | None]]:
    """(name, the wheel's libcudart or None) for CUDA 12 and 13, in the Python's site-packages."""
    sites = subprocess.run([str(VPY), "-c", "import site; print('\\n'.join(site.getsitepackages()))"],
                           capture_output=True, text=True, timeout=60).stdout.split()
    out = []
    for name, rel in RUNTIMES:
        found = next((Path(s) / rel for s in sites if (Path(s) / rel).exists()), None)
        out.append((name, found))
    return out


def multi_gpu_sections(c: Check, gpus: int, rdma: list[str], torch: bool, runtimes: list[tuple[str, Path | None]]) -> None:
    """The checks of a serving node (issue 35): each runs where the machine has what it needs,
    else is recorded as not run, with the reason."""
    mc = [str(VPY), MULTI]
    if gpus >= 2:
        for tdev, ldev in ((1, 0), (0, 1)):
            c.run(f"two-GPU CUDA IPC, KV pages, memory of GPU {tdev} to and from GPU {ldev} ({MULTI} ipc2)",
                  [*mc, "ipc2", "--target-dev", str(tdev), "--local-dev", str(ldev)], 600)
    else:
        c.skip(f"two-GPU CUDA IPC, KV pages, both ways ({MULTI} ipc2)", [*mc, "ipc2"],
               f"not run: needs two GPUs (this machine has {gpus})")
    secs = "10" if c.a.quick else "60"
    for title, cmd in ((f"graph capture in a loop while staged and IPC transfers run ({MULTI} capture)",
                        [*mc, "capture", "--seconds", secs]),
                       (f"expandable-segment tensors by IPC ({MULTI} expandable)", [*mc, "expandable"])):
        if torch:
            c.run(title, cmd, 900)
        else:
            c.skip(title, cmd, "not run: needs torch with CUDA in this Python (pip install torch)")
    probe = ("import json, multirail.gpu as g\n"
             "b = g.DeviceBuffer(1 << 20, kind='cuda'); b.free()\n"
             "print(json.dumps(g.info(0, 'cuda')))\n")
    for name, lib in runtimes:
        title = f"{name} runtime: probe and IPC (MULTIRAIL_CUDART)"
        if lib is None:
            c.skip(title, None, f"not run: no {name} runtime wheel in this Python "
                                f"(pip install nvidia-cuda-runtime-cu{name.split()[1]})")
            continue
        c.run(title, [str(VPY), "-c", probe], 300, env={"MULTIRAIL_CUDART": str(lib)})
        if gpus >= 2:
            c.run(f"{name} runtime: two-GPU CUDA IPC ({MULTI} ipc2)", [*mc, "ipc2"], 600, env={"MULTIRAIL_CUDART": str(lib)})
    if rdma:
        c.run("GPUDirect RDMA: what the engine declares (multirail doctor)", [str(VPY), "-m", "multirail", "doctor"], 300,
              required=False)
    else:
        c.skip("GPUDirect RDMA (VRAM over ucx rails)", None, "not run: needs an RDMA NIC (/sys/class/infiniband is empty)")


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
        multi_gpu_sections(c, max(1, len(gpu_uuids())), rdma_devices(), has_torch_cuda(), runtime_libs())
    host_sections(c)
    topology_sections(c)
    return report(c)


if __name__ == "__main__":
    sys.exit(main())
