"""The multirail wheel ships the NIXL backend plugin (issue 20): `maturin build --release` into a
temporary directory holds multirail/_nixl/libplugin_MULTIRAIL.so, byte for byte the one
`make build` made, installed where `multirail nixl-plugin path` finds it, loadable, and within
the glibc / libstdc++ symbol versions the wheel's manylinux tag promises.

Skips only when maturin is not installed. The build reuses `make build`'s artifacts (same
interpreter and environment as its `maturin develop`, so nothing is recompiled: seconds, not
minutes; a build with another interpreter would rebuild the extension, and the next
`make build` again).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

PLUGIN = "multirail/_nixl/libplugin_MULTIRAIL.so"

# Highest symbol versions each manylinux policy allows on x86_64 (auditwheel 6.8's policy
# table): a plugin that needs more would not load on every system the tag names.
POLICY = {
    "manylinux_2_17": {"GLIBC": (2, 17), "GLIBCXX": (3, 4, 19), "CXXABI": (1, 3, 7)},
    "manylinux_2_28": {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11)},
    "manylinux_2_34": {"GLIBC": (2, 34), "GLIBCXX": (3, 4, 29), "CXXABI": (1, 3, 13)},
}


def _maturin() -> str | None:
    local = Path(sys.executable).parent / "maturin"
    return str(local) if local.exists() else shutil.which("maturin")


MATURIN = _maturin()
pytestmark = [pytest.mark.skipif(MATURIN is None, reason="maturin is not installed (`make setup` installs it)"),
              pytest.mark.slow]


def _needed_versions(so: Path) -> dict[str, tuple[int, ...]]:
    """The highest GLIBC / GLIBCXX / CXXABI version `so` needs (from `objdump -T`)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump is not installed (binutils, which g++ from `make deps` brings)")
    out = subprocess.run([objdump, "-T", str(so)], capture_output=True, text=True, timeout=60, check=True).stdout
    best: dict[str, tuple[int, ...]] = {}
    for lib, ver in re.findall(r"\((GLIBCXX|CXXABI|GLIBC)_([0-9.]+)\)", out):
        v = tuple(int(x) for x in ver.split("."))
        best[lib] = max(best.get(lib, v), v)
    return best


def test_wheel_ships_the_nixl_plugin(tmp_path: Path) -> None:
    built = REPO / "python" / PLUGIN
    assert built.is_file(), f"{built} is missing: run `make build` first (it builds the plugin the wheel ships)"
    venv = Path(sys.executable).parent
    env = {**os.environ, "VIRTUAL_ENV": str(venv.parent), "PATH": f"{venv}:{os.environ.get('PATH', '')}"}
    out = tmp_path / "dist"
    res = subprocess.run([MATURIN, "build", "--release", "-i", sys.executable, "-o", str(out)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    wheels = list(out.glob("multirail-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as z:
        assert PLUGIN in z.namelist(), sorted(n for n in z.namelist() if n.endswith(".so"))
        assert z.read(PLUGIN) == built.read_bytes(), "the wheel's plugin is not the one `make build` made"
        z.extractall(tmp_path / "site")

    # installed from the wheel, `multirail nixl-plugin path` finds it, and it loads
    site = tmp_path / "site"
    code = "from multirail.nixl_plugin import plugin_path; print(plugin_path())"
    p = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(site)}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and Path(p.stdout.strip()) == (site / PLUGIN).resolve(), p.stdout + p.stderr
    lib = ctypes.CDLL(str(site / PLUGIN))
    assert lib.nixl_plugin_init and lib.nixl_plugin_fini and lib.mr_nixl_version

    # its symbol versions fit the wheel's platform tag (docs/nixl-plugin.md, "Build compatibility")
    tag = re.search(r"(manylinux_\d+_\d+)_x86_64", wheels[0].name)
    if tag is None or tag.group(1) not in POLICY:
        pytest.skip(f"no symbol-version table here for the wheel's tag ({wheels[0].name})")
    need = _needed_versions(site / PLUGIN)
    allowed = POLICY[tag.group(1)]
    over = {k: v for k, v in need.items() if v > allowed[k]}
    assert not over, f"the plugin needs {over}, beyond {tag.group(1)} ({allowed})"
