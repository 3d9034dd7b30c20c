#!/usr/bin/env python3
"""`make kernels` / `make kernels-check`: the gather kernel's fatbin (docs/gpu.md, "Kernel images").

The PTX of `mr_gather_copy` lives in crates/multirail-gpu/src/gather.rs (`PTX`); this script
takes it from there, assembles it to SASS for sm_80, sm_90, sm_100 and sm_120 with ptxas, and
packs the four cubins and the PTX (the JIT fallback for every other GPU) into one fatbin,
crates/multirail-gpu/kernels/gather.fatbin, which the crate embeds (`include_bytes!`): a normal
build needs no CUDA toolkit.

Tools, from pinned PyPI wheels (downloaded with pip into a cache, unpacked into a temporary
directory; nothing is installed):
- ptxas of CUDA 12.9 (`nvidia-cuda-nvcc-cu12`): a cubin from a 12.x toolkit loads on every
  driver of CUDA 12.0 and later (minor-version compatibility) and on 13.x drivers; a cubin from
  a 13.x ptxas needs a 13.x driver (580+), so it would not load on the CUDA 12 nodes;
- fatbinary of CUDA 13.0 (`nvidia-cuda-nvcc`): the cu12 wheel ships ptxas alone. It only packs
  the images (container version 1, uncompressed), it compiles nothing.

Both tools are deterministic (the same input gives the same bytes), so `--check` rebuilds into
a temporary file and compares byte for byte. Without network, point MULTIRAIL_KERNEL_WHEELS at a
directory holding the two wheels.

Usage: build.py [--check] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src" / "gather.rs"
OUT = HERE / "gather.fatbin"
ARCHS = (80, 90, 100, 120)
# The PTX's own target (`.target sm_70` in gather.rs).
PTX_SM = 70
PTXAS_WHEEL = ("nvidia-cuda-nvcc-cu12", "12.9.86", "nvidia/cuda_nvcc/bin/ptxas")
FATBINARY_WHEEL = ("nvidia-cuda-nvcc", "13.0.88", "nvidia/cu13/bin/fatbinary")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multirail-kernels"


def ptx_text() -> str:
    m = re.search(r'pub const PTX: &str = r#"(.*?)"#;', SRC.read_text(), re.S)
    if not m:
        sys.exit(f"no `pub const PTX: &str = r#\"...\"#;` in {SRC}")
    return m.group(1)


def wheel(name: str, version: str) -> Path:
    """The wheel of `name==version`: from MULTIRAIL_KERNEL_WHEELS, else pip's download into the cache."""
    stem = name.replace("-", "_") + "-" + version + "-"
    dirs = [Path(os.environ["MULTIRAIL_KERNEL_WHEELS"])] if os.environ.get("MULTIRAIL_KERNEL_WHEELS") else []
    dirs.append(CACHE)
    for d in dirs:
        found = sorted(d.glob(stem + "*.whl")) if d.is_dir() else []
        if found:
            return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "-d", str(CACHE), f"{name}=={version}"]
    r = subprocess.run(cmd, timeout=600)
    found = sorted(CACHE.glob(stem + "*.whl"))
    if r.returncode != 0 or not found:
        sys.exit(f"cannot get the {name}=={version} wheel (`{' '.join(cmd)}` exited {r.returncode}); "
                 "set MULTIRAIL_KERNEL_WHEELS to a directory holding it")
    return found[0]


def tool(spec: tuple[str, str, str], tmp: Path) -> Path:
    name, version, member = spec
    with zipfile.ZipFile(wheel(name, version)) as z:
        z.extract(member, tmp)
    p = tmp / member
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def build(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="mr-kernels-") as t:
        tmp = Path(t)
        ptxas, fatbinary = tool(PTXAS_WHEEL, tmp / "a"), tool(FATBINARY_WHEEL, tmp / "b")
        ptx = tmp / "gather.ptx"
        ptx.write_text(ptx_text())
        images = []
        for sm in ARCHS:
            cubin = tmp / f"gather.sm_{sm}.cubin"
            subprocess.run([str(ptxas), f"-arch=sm_{sm}", "-O3", str(ptx), "-o", str(cubin)], check=True, timeout=300)
            images.append(f"--image3=kind=elf,sm={sm},file={cubin}")
        images.append(f"--image3=kind=ptx,sm={PTX_SM},file={ptx}")
        subprocess.run([str(fatbinary), "-64", "--compress-mode=none", f"--create={out}", *images], check=True, timeout=300)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="rebuild into a temporary file and compare with the checked-in one")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    if not a.check:
        build(a.out)
        print(f"wrote {a.out} ({a.out.stat().st_size} bytes): SASS sm_{', sm_'.join(map(str, ARCHS))} + PTX")
        return 0
    with tempfile.TemporaryDirectory(prefix="mr-kernels-check-") as t:
        fresh = Path(t) / "gather.fatbin"
        build(fresh)
        if fresh.read_bytes() != a.out.read_bytes():
            print(f"{a.out} is not what `make kernels` makes from {SRC.name}'s PTX: run `make kernels` and commit it",
                  file=sys.stderr)
            return 1
    print(f"{a.out} matches `make kernels` byte for byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
