"""PEP 517 build backend of multirail: maturin's, plus the NIXL backend plugin (issue 36 item 8).

maturin builds one Rust crate, the Python extension (crates/multirail-py). The NIXL plugin,
`libplugin_MULTIRAIL.so`, is another crate of the workspace (crates/multirail-nixl), so without
this a wheel built by `pip install .`, `pip wheel .`, a git URL or an sdist had no plugin; only
`make build` made it. Here, before maturin packs a wheel:

* `cargo build --release -p multirail-nixl` (the same command as `make build`: it reuses the
  checkout's target directory, or `CARGO_TARGET_DIR`), and the cdylib is copied to
  python/multirail/_nixl/libplugin_MULTIRAIL.so, which pyproject.toml's `include` puts in the
  wheel, where `multirail nixl-plugin dir|path` finds it;
* an sdist gets the plugin's crate and this backend, and its workspace lists the plugin crate
  again (maturin writes an sdist whose workspace holds only the extension's dependencies).

`MULTIRAIL_NIXL_PLUGIN=0` builds a wheel without the plugin (no C++ compiler needed; NIXL then
cannot load multirail). The plugin needs g++ (`make deps`); a build that cannot make it fails
with the reason and that switch.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Mapping

import maturin
from maturin import (  # noqa: F401 (the hooks not wrapped here are maturin's own)
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

ROOT = Path(__file__).resolve().parent.parent
CRATE = "crates/multirail-nixl"
PLUGIN = ROOT / "python" / "multirail" / "_nixl" / "libplugin_MULTIRAIL.so"
SWITCH = "MULTIRAIL_NIXL_PLUGIN"


def _log(msg: str) -> None:
    print(f"multirail build: {msg}", file=sys.stderr, flush=True)


def _target_dir() -> Path:
    t = os.environ.get("CARGO_TARGET_DIR")
    if not t:
        return ROOT / "target"
    p = Path(t)
    return p if p.is_absolute() else ROOT / p


def build_plugin() -> Path | None:
    """Build the NIXL plugin and place it in the package; None when switched off or not Linux."""
    if os.environ.get(SWITCH, "1") == "0":
        _log(f"{SWITCH}=0: the wheel has no NIXL plugin")
        return None
    if not sys.platform.startswith("linux"):
        _log(f"no NIXL plugin on {sys.platform} (NIXL runs on Linux)")
        return None
    cargo = os.environ.get("CARGO", "cargo")
    cmd = [cargo, "build", "--release", "-p", "multirail-nixl"]
    _log(" ".join(cmd))
    try:
        res = subprocess.run(cmd, cwd=ROOT)
    except OSError as e:
        raise RuntimeError(f"cannot run {cargo}: {e}") from e
    if res.returncode != 0:
        raise RuntimeError(
            f"building the NIXL plugin ({' '.join(cmd)}) failed with status {res.returncode}: it needs g++ "
            f"(`make deps`); set {SWITCH}=0 to build multirail without it")
    built = _target_dir() / "release" / "libmultirail_nixl.so"
    if not built.is_file():
        raise RuntimeError(f"cargo built the NIXL plugin but {built} is missing (CARGO_TARGET_DIR?)")
    PLUGIN.parent.mkdir(parents=True, exist_ok=True)
    tmp = PLUGIN.with_name(PLUGIN.name + ".tmp")
    shutil.copyfile(built, tmp)
    tmp.chmod(0o755)
    tmp.replace(PLUGIN)
    _log(f"NIXL plugin: {PLUGIN.relative_to(ROOT)}")
    return PLUGIN


def build_wheel(wheel_directory: str, config_settings: Mapping[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    build_plugin()
    return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory: str, config_settings: Mapping[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    build_plugin()
    return maturin.build_editable(wheel_directory, config_settings, metadata_directory)


def _sdist_files() -> list[Path]:
    """The plugin crate's sources and this backend, relative to the checkout."""
    out = [Path(__file__).resolve().relative_to(ROOT)]
    for p in sorted((ROOT / CRATE).rglob("*")):
        if p.is_file() and "target" not in p.relative_to(ROOT / CRATE).parts:
            out.append(p.relative_to(ROOT))
    return out


def with_workspace_member(cargo_toml: str, member: str) -> str:
    """`cargo_toml` with `member` in its workspace's `members` list (one line, as maturin writes
    it and as the checkout has it)."""
    lines = cargo_toml.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.replace(" ", "").startswith("members=["):
            if f'"{member}"' in line:
                return cargo_toml
            head, _, rest = line.partition("[")
            lines[i] = f'{head}["{member}", {rest}' if rest.strip() != "]" else f'{head}["{member}"]\n'
            return "".join(lines)
    raise RuntimeError("the sdist's Cargo.toml has no one-line workspace `members` list to add the NIXL plugin to")


def build_sdist(sdist_directory: str, config_settings: Mapping[str, Any] | None = None) -> str:
    name = maturin.build_sdist(sdist_directory, config_settings)
    path = Path(sdist_directory) / name
    with tarfile.open(path, "r:gz") as t:
        members = [(m, t.extractfile(m).read() if m.isfile() else None) for m in t.getmembers()]  # type: ignore[union-attr]
    top = members[0][0].name.split("/")[0]
    have = {m.name for m, _ in members}
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(tmp, "w:gz", format=tarfile.PAX_FORMAT) as out:
        for m, data in members:
            if m.name == f"{top}/Cargo.toml" and data is not None:
                data = with_workspace_member(data.decode(), CRATE).encode()
                m.size = len(data)
            out.addfile(m, io.BytesIO(data) if data is not None else None)
        for rel in _sdist_files():
            arc = f"{top}/{rel.as_posix()}"
            if arc not in have:
                out.add(ROOT / rel, arcname=arc, recursive=False)
    tmp.replace(path)
    return name
