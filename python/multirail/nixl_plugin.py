"""`multirail nixl-plugin`: multirail as a NIXL backend (`libplugin_MULTIRAIL.so`).

* `multirail nixl-plugin dir` prints a directory to use as `NIXL_PLUGIN_DIR`: it holds links
  to this package's plugin and to every plugin of the installed NIXL (UCX, POSIX, ...), since
  the variable replaces NIXL's own plugin directory instead of adding to it.
* `multirail nixl-plugin check` loads the plugin into the installed NIXL in a child process,
  runs a self-test through NIXL's Python API (two agents, WRITE, READ, notifications, a local
  transfer) and says what is wrong: no NIXL, an unsupported NIXL version, an ABI mismatch.
* `multirail nixl-plugin path` prints the plugin file itself.

docs/nixl-plugin.md.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

PLUGIN_NAME = "libplugin_MULTIRAIL.so"
# NIXL versions the plugin was built and tested for (crates/multirail-nixl/src/host.rs: SUPPORTED).
SUPPORTED_NIXL = ("1.5",)  # release series: every 1.5.x


def supported_nixl(version: str) -> bool:
    """Whether NIXL `version` is of a release series the plugin supports (as host.rs)."""
    return any(version == s or version.startswith(s + ".") for s in SUPPORTED_NIXL)
# NIXL's Python distributions, in the order they are looked for.
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
# Slots of nixlBackendEngine's vtable (2 header words + 27 virtual methods) in the NIXL
# versions the shim declares (shim/plugin.cpp).
VTABLE_BYTES = 29 * 8


class PluginError(RuntimeError):
    """The plugin cannot be used here; the message says why and what to do."""


def plugin_path() -> Path:
    """The plugin built into this package (by `make build`)."""
    p = Path(__file__).resolve().parent / "_nixl" / PLUGIN_NAME
    if not p.is_file():
        raise PluginError(f"{p} is missing: the NIXL plugin is not built (run `make build` in the multirail checkout)")
    return p


def find_nixl() -> dict[str, Any]:
    """The installed NIXL: {"module", "version", "plugins" (its plugin directory)}."""
    from importlib import metadata

    for mod in _module_order():
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.submodule_search_locations:
            continue
        pkg = Path(list(spec.submodule_search_locations)[0])
        site = pkg.parent
        dist = mod.replace("_", "-")
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = None
        plugins = site / f".{mod}.mesonpy.libs" / "plugins"
        if mod == "nixl" and not plugins.is_dir():
            continue  # the `nixl` meta package: the real one is nixl_cu12/13, looked for above
        return {"module": mod, "version": version, "plugins": plugins if plugins.is_dir() else None}
    raise PluginError("no NIXL is installed in this Python (pip install nixl-cu12==1.5.1; "
                      f"looked for the modules {', '.join(NIXL_MODULES)})")


def _module_order() -> tuple[str, ...]:
    """NIXL_MODULES, with the one NIXL's `nixl` meta package would import first: with both
    nixl-cu12 and nixl-cu13 installed (`pip install nixl` brings both), `import nixl` picks by
    the CUDA major version of the process's stack (torch's build: vLLM with the CUDA 13 torch
    runs nixl_cu13), and NIXL_PLUGIN_DIR must mirror that NIXL's plugins, not the other's."""
    try:
        from nixl_meta_utils import detect_cuda_major  # shipped by the `nixl` meta package
    except ImportError:
        return NIXL_MODULES
    try:
        major = detect_cuda_major()
    except Exception:  # noqa: BLE001 - a broken torch install: keep the fixed order
        return NIXL_MODULES
    first = f"nixl_cu{major}"
    return (first, *(m for m in NIXL_MODULES if m != first)) if first in NIXL_MODULES else NIXL_MODULES


def _default_dir(nixl: dict[str, Any]) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "multirail" / f"nixl-plugins-{nixl['module']}-{nixl['version'] or 'unknown'}"


def _link(link: Path, src: Path) -> None:
    if link.is_symlink():
        if Path(os.readlink(link)) == src:
            return
        link.unlink()
    elif link.exists():
        raise PluginError(f"{link} exists and is not a link: refusing to replace it")
    link.symlink_to(src)


def make_dir(target: str | os.PathLike[str] | None = None) -> Path:
    """Create (or refresh) a directory for NIXL_PLUGIN_DIR; returns it.

    NIXL's own plugins find their libraries through `$ORIGIN/..` and
    `$ORIGIN/../../nixl_cu12.libs`, and `$ORIGIN` is the directory they are loaded from, so a
    flat directory of links would not load them. The directory made therefore mirrors the
    wheel's layout with links: BASE/nixl_cu12.libs, BASE/.nixl_cu12.mesonpy.libs/<its files>,
    and BASE/.nixl_cu12.mesonpy.libs/plugins/ (returned) holding our plugin and NIXL's."""
    plugin = plugin_path()
    nixl = find_nixl()
    own: Path | None = nixl["plugins"]
    base = Path(target) if target else _default_dir(nixl)
    if own is None:
        d = base / "plugins"
        d.mkdir(parents=True, exist_ok=True)
        _link(d / PLUGIN_NAME, plugin)
        return d
    libs, site = own.parent, own.parent.parent
    mirror = base / libs.name
    d = mirror / own.name
    d.mkdir(parents=True, exist_ok=True)
    for f in site.iterdir():  # e.g. nixl_cu12.libs, which NIXL's plugins reach as ../../nixl_cu12.libs
        if f.name.startswith(nixl["module"]) and f.name.endswith(".libs") and f.is_dir():
            _link(base / f.name, f.resolve())
    for f in libs.iterdir():
        if f.name != own.name:
            _link(mirror / f.name, f.resolve())
    want = {f.name: f.resolve() for f in sorted(own.iterdir()) if f.name.endswith(".so") and f.name != PLUGIN_NAME}
    want[PLUGIN_NAME] = plugin
    for f in d.iterdir():
        if f.is_symlink() and f.name not in want:
            f.unlink()
    for name, src in want.items():
        _link(d / name, src)
    return d


def _elf_symbol_size(path: Path, name: str) -> int | None:
    """Size of a dynamic symbol of an ELF64 little-endian shared object (None if absent)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for sh in sections:
        if sh[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[sh[6]]
        off, size, entsize = sh[4], sh[5], sh[9] or 24
        want = name.encode()
        for i in range(size // entsize):
            st_name, _info, _other, _shndx, _value, st_size = struct.unpack_from("<IBBHQQ", data, off + i * entsize)
            s = strtab[4] + st_name
            if data[s:s + len(want) + 1] == want + b"\0":
                return st_size
    return None


def abi_check(nixl: dict[str, Any]) -> str | None:
    """Compare the engine base class vtable of NIXL's own POSIX plugin with the shim's; None
    when they match (or cannot be read), else the mismatch."""
    own = nixl.get("plugins")
    if own is None or not (own / "libplugin_POSIX.so").is_file():
        return None
    size = _elf_symbol_size(own / "libplugin_POSIX.so", "_ZTV17nixlBackendEngine")
    if size is None or size == VTABLE_BYTES:
        return None
    return (f"ABI mismatch: this NIXL's nixlBackendEngine vtable is {size} bytes ({size // 8 - 2} virtual slots), "
            f"the plugin was built for {VTABLE_BYTES} ({VTABLE_BYTES // 8 - 2})")


def host_check(plugin: Path) -> tuple[bool, str]:
    """The plugin's own verdict on the NIXL loaded in this process."""
    lib = ctypes.CDLL(str(plugin))
    out: list[bytes] = []
    SINK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_ubyte), ctypes.c_size_t,
                            ctypes.POINTER(ctypes.c_ubyte), ctypes.c_size_t)

    def sink(_ctx: Any, a: Any, an: int, _b: Any, _bn: int) -> int:
        out.append(ctypes.string_at(a, an))
        return 0

    cb = SINK(sink)
    lib.mr_nixl_host_check.argtypes = [SINK, ctypes.c_void_p]
    rc = lib.mr_nixl_host_check(cb, None)
    return rc == 0, b"".join(out).decode(errors="replace")


# The self-test, run in a child process with NIXL_PLUGIN_DIR set (a crash there is reported,
# not suffered). Prints one JSON line per step.
SELF_TEST = r'''
import ctypes, json, sys, time, importlib
mod, plugin = sys.argv[1], sys.argv[2]
def say(step, ok, detail=""):
    print(json.dumps({"step": step, "ok": ok, "detail": detail}), flush=True)
    if not ok:
        sys.exit(1)
api = importlib.import_module(mod + "._api")
import numpy as np
sys.path.insert(0, "")
from multirail.nixl_plugin import host_check
cfg = api.nixl_agent_config(backends=[])
a = api.nixl_agent("mr-check-a", cfg)
plugins = a.get_plugin_list()
ok, what = host_check(plugin)
if not ok:
    say("load", False, what)
if "MULTIRAIL" not in plugins:
    say("load", False, "NIXL did not find libplugin_MULTIRAIL.so in NIXL_PLUGIN_DIR (plugins: %s)" % plugins)
try:
    a.get_plugin_params("MULTIRAIL")
except Exception as e:
    say("load", False, "NIXL could not load the plugin (%s); see NIXL's log" % e)
say("load", True, "NIXL lists %s; %s" % (", ".join(plugins), what))
try:
    a.create_backend("MULTIRAIL", {})
    b = api.nixl_agent("mr-check-b", cfg)
    b.create_backend("MULTIRAIL", {})
except Exception as e:
    say("create_backend", False, "%s (an ABI mismatch or bad MULTIRAIL_* settings; see the log above)" % e)
say("create_backend", True, json.dumps(a.get_backend_params("MULTIRAIL")))
n = 1 << 20
src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8); dst = np.zeros(n, np.uint8)
loc = np.zeros(n, np.uint8)
reg = lambda ag, x: ag.register_memory([(x.ctypes.data, x.nbytes, 0, "")], "DRAM")
xd = lambda ag, x: ag.get_xfer_descs([(x.ctypes.data, x.nbytes, 0)], "DRAM")
ra, rb, rl = reg(a, src), reg(b, dst), reg(b, loc)
b.add_remote_agent(a.get_agent_metadata()); a.add_remote_agent(b.get_agent_metadata())
def run(h, what):
    s = b.transfer(h); t = time.monotonic()
    while s not in ("DONE", "ERR") and time.monotonic() - t < 20:
        s = b.check_xfer_state(h); time.sleep(0.0005)
    if s != "DONE":
        say(what, False, "state %s" % s)
for op in ("READ", "WRITE"):
    if op == "WRITE":
        dst[:] = 255 - src
    h = b.initialize_xfer(op, xd(b, dst), xd(a, src), "mr-check-a", b"check-" + op.encode())
    run(h, op)
    if op == "READ" and not np.array_equal(dst, src):
        say(op, False, "bytes differ after DONE: the engine ABI does not match this NIXL")
    if op == "WRITE" and not np.array_equal(src, dst):
        say(op, False, "bytes differ after DONE: the engine ABI does not match this NIXL")
    b.release_xfer_handle(h)
    t = time.monotonic(); got = {}
    while time.monotonic() - t < 10 and not got:
        got = a.get_new_notifs(); time.sleep(0.005)
    if got.get("mr-check-b") != [b"check-" + op.encode()]:
        say(op, False, "notification not delivered: %r" % got)
    say(op, True, "1 MiB byte-exact, notification delivered")
h = b.initialize_xfer("READ", xd(b, loc), xd(b, dst), "mr-check-b")
run(h, "local"); b.release_xfer_handle(h)
say("local", np.array_equal(loc, dst), "transfer within one agent")
b.send_notif("mr-check-a", b"ping"); t = time.monotonic(); got = {}
while time.monotonic() - t < 10 and not got:
    got = a.get_new_notifs(); time.sleep(0.005)
say("genNotif", got.get("mr-check-b") == [b"ping"], repr(got))
b.remove_remote_agent("mr-check-a")
for ag, r in ((a, ra), (b, rb), (b, rl)):
    ag.deregister_memory(r)
say("done", True)
'''


def check(verbose: bool = False) -> tuple[bool, list[str]]:
    """Load the plugin into the installed NIXL and self-test it; (ok, report lines)."""
    lines: list[str] = []
    try:
        plugin = plugin_path()
        nixl = find_nixl()
    except PluginError as e:
        return False, [f"FAIL: {e}"]
    lines.append(f"plugin: {plugin}")
    lines.append(f"NIXL: {nixl['module']} {nixl['version'] or '(version unknown)'}, plugins in {nixl['plugins']}")
    if not supported_nixl(nixl["version"]) and os.environ.get("MULTIRAIL_NIXL_ALLOW_UNTESTED") != "1":
        lines.append(f"FAIL: unsupported NIXL version {nixl['version']}: the plugin was built and tested for "
                     f"{', '.join(s + '.x' for s in SUPPORTED_NIXL)} and refuses to load into another "
                     "(MULTIRAIL_NIXL_ALLOW_UNTESTED=1 loads it anyway)")
        return False, lines
    abi = abi_check(nixl)
    if abi:
        lines.append(f"FAIL: {abi}")
        return False, lines
    d = make_dir()
    lines.append(f"NIXL_PLUGIN_DIR={d}")
    env = {**os.environ, "NIXL_PLUGIN_DIR": str(d)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    try:
        res = subprocess.run([sys.executable, "-c", SELF_TEST, nixl["module"], str(plugin)], env=env,
                             capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        lines.append("FAIL: the self-test did not finish within 120 s")
        return False, lines
    ok = False
    for ln in res.stdout.splitlines():
        try:
            r = json.loads(ln)
        except ValueError:
            continue
        lines.append(f"{'ok  ' if r['ok'] else 'FAIL'} {r['step']}" + (f": {r['detail']}" if r["detail"] else ""))
        ok = r["ok"] and r["step"] == "done"
    if res.returncode != 0 and not ok:
        if res.returncode < 0:
            lines.append(f"FAIL: the self-test process died with signal {-res.returncode} (an ABI mismatch crashes "
                         "this way)")
        if verbose or res.returncode < 0 or not any(x.startswith("FAIL") for x in lines):
            lines.extend("  | " + x for x in res.stderr.splitlines()[-30:])
        ok = False
    return ok, lines


def _cmd(args: argparse.Namespace) -> int:
    try:
        if args.action == "path":
            print(plugin_path())
            return 0
        if args.action == "dir":
            print(make_dir(args.target))
            return 0
    except PluginError as e:
        print(f"multirail nixl-plugin: {e}", file=sys.stderr)
        return 1
    ok, lines = check(verbose=args.verbose)
    print("\n".join(lines))
    print("MULTIRAIL NIXL plugin: " + ("OK" if ok else "NOT USABLE"))
    return 0 if ok else 1


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "nixl-plugin",
        help="multirail as a NIXL backend: the NIXL_PLUGIN_DIR directory, and a self-test in the installed NIXL",
        description="`dir`: print a directory for NIXL_PLUGIN_DIR holding libplugin_MULTIRAIL.so and links to the "
        "installed NIXL's own plugins. `check`: load the plugin into the installed NIXL and self-test it "
        "(exit 0 when usable). `path`: print the plugin file. docs/nixl-plugin.md.",
    )
    p.add_argument("action", choices=("dir", "check", "path"))
    p.add_argument("--target", metavar="DIR", help="for `dir`: where to make the directory "
                   "(default: $XDG_CACHE_HOME/multirail/nixl-plugins-<nixl>-<version>)")
    p.add_argument("-v", "--verbose", action="store_true", help="for `check`: show the self-test's log")
    p.set_defaults(func=_cmd)
    return p
