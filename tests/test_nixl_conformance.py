"""Conformance of `multirail.nixl` with NIXL: scripts written for NIXL run unchanged on
multirail but for their import lines, which `rewrite_imports` changes (rules below).

Three sources of scripts:

1. NIXL's own `examples/python` and `test/python` scripts that need no GPU, storage backend
   or torch, taken from a NIXL source tree at test time and never stored in this repository.
   PyPI has no NIXL source distribution (`nixl`, `nixl-cu12` and `nixl-cu13` 1.5.1 are wheels
   only, and the wheels hold no scripts), so CI cannot get them; they run where
   MULTIRAIL_NIXL_SRC names a NIXL checkout (or an unpacked sdist), and the test also tries
   `pip download --no-binary :all: nixl` in case a source distribution appears. Otherwise the
   test is skipped and says why.
2. Our own scripts below, written against NIXL's API from NIXL's documentation, examples and
   tests (the same calls, arguments, return values and exceptions; no NIXL code). They run in
   CI on multirail, after the same import rewrite.
3. The same scripts against NIXL itself when it is importable here (`nixl`, or the `nixl_cu12`
   wheel, mapped to the name `nixl`): they must pass there too, which shows that they ask for
   NIXL's behaviour and not multirail's.

Import rewrite rules (import statements only; nothing else in a script changes):

    from nixl._api import X       -> from multirail.nixl import X
    from nixl import X            -> from multirail.nixl import X
    import nixl                   -> import multirail.nixl as nixl
    import nixl._api as A         -> import multirail.nixl as A
    import nixl._bindings as B    -> import multirail.nixl.bindings as B
    from nixl._bindings import X  -> from multirail.nixl.bindings import X
    import nixl._utils as U       -> import multirail.nixl.utils as U
    from nixl._utils import X     -> from multirail.nixl.utils import X
    import nixl.logging as L      -> import multirail.nixl.logging as L
    from nixl.logging import X    -> from multirail.nixl.logging import X
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path
from typing import Optional

import pytest

from conftest import ENV, REPO, engine_python  # noqa: E402

ENGINE_PY = engine_python()
needs_engine = pytest.mark.skipif(ENGINE_PY is None, reason="multirail._core (the engine extension) is not built")

# ------------------------------------------------------------------------------ the rewrite

_MODULES = {
    "nixl": "multirail.nixl",
    "nixl._api": "multirail.nixl",
    "nixl._bindings": "multirail.nixl.bindings",
    "nixl._utils": "multirail.nixl.utils",
    "nixl.logging": "multirail.nixl.logging",
}
_FROM = re.compile(r"^(\s*)from\s+(nixl(?:\.\w+)?)\s+import\s+(.*)$")
_IMPORT = re.compile(r"^(\s*)import\s+(nixl(?:\.\w+)?)(\s+as\s+\w+)?\s*(#.*)?$")


def rewrite_imports(source: str) -> str:
    """The import-line rewrite above. A line importing a `nixl` module this layer does not
    provide raises ValueError (so a script is never run half-rewritten)."""
    out = []
    for line in source.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        end = line[len(body):]
        m = _FROM.match(body)
        if m:
            if m.group(2) not in _MODULES:
                raise ValueError(f"no multirail equivalent for: {body.strip()}")
            out.append(f"{m.group(1)}from {_MODULES[m.group(2)]} import {m.group(3)}{end}")
            continue
        m = _IMPORT.match(body)
        if m:
            mod, alias = m.group(2), m.group(3)
            if mod not in _MODULES or (alias is None and mod != "nixl"):
                raise ValueError(f"no multirail equivalent for: {body.strip()}")
            alias = alias or " as nixl"
            out.append(f"{m.group(1)}import {_MODULES[mod]}{alias}{end}")
            continue
        out.append(line)
    return "".join(out)


def test_rewrite_rules() -> None:
    src = textwrap.dedent("""\
        import os
        import nixl
        import nixl._bindings as nixl
        import nixl._utils as nixl_utils
        from nixl._api import nixl_agent, nixl_agent_config
        from nixl import nixl_agent
        from nixl._bindings import nixlNotFoundError
        from nixl.logging import get_logger
            from nixl._api import nixl_agent  # indented (inside try:)
        x = "from nixl._api import nothing"  # not an import line: untouched
        """)
    assert rewrite_imports(src) == textwrap.dedent("""\
        import os
        import multirail.nixl as nixl
        import multirail.nixl.bindings as nixl
        import multirail.nixl.utils as nixl_utils
        from multirail.nixl import nixl_agent, nixl_agent_config
        from multirail.nixl import nixl_agent
        from multirail.nixl.bindings import nixlNotFoundError
        from multirail.nixl.logging import get_logger
            from multirail.nixl import nixl_agent  # indented (inside try:)
        x = "from nixl._api import nothing"  # not an import line: untouched
        """)
    for bad in ("from nixl._other import x\n", "import nixl._bindings\n", "import nixl_ep\nimport nixl.foo as f\n"):
        with pytest.raises(ValueError):
            rewrite_imports(bad)


def test_layout_matches_nixl_package() -> None:
    """The names NIXL's package exposes exist under the mapped module names."""
    code = textwrap.dedent("""
        import multirail.nixl as n, multirail.nixl.bindings as b, multirail.nixl.utils as u
        import multirail.nixl.logging as lg, multirail.nixl._api as a, sys
        for name in ("DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
                     "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle"):
            assert getattr(n, name) is getattr(a, name), name
        for name in ("nixlAgent", "nixlAgentConfig", "nixlXferDList", "nixlRegDList", "nixlRemoteDList",
                     "nixlXferTelemetry", "nixl_mem_t", "nixl_status_t", "nixl_xfer_op_t", "nixl_thread_sync_t",
                     "nixl_cost_t", "DRAM_SEG", "VRAM_SEG", "BLK_SEG", "OBJ_SEG", "FILE_SEG", "NIXL_READ",
                     "NIXL_WRITE", "NIXL_SUCCESS", "NIXL_IN_PROG", "NIXL_ERR_NOT_FOUND", "NIXL_INIT_AGENT",
                     "DEFAULT_COMM_PORT", "HAVE_UCX_GPU_DEVICE_API", "NIXL_THREAD_SYNC_NONE",
                     "NIXL_THREAD_SYNC_STRICT", "NIXL_THREAD_SYNC_RW", "NIXL_THREAD_SYNC_DEFAULT",
                     "NIXL_COST_ANALYTICAL_BACKEND",
                     "nixlNotPostedError", "nixlInvalidParamError", "nixlBackendError", "nixlNotFoundError",
                     "nixlMismatchError", "nixlNotAllowedError", "nixlRepostActiveError", "nixlUnknownError",
                     "nixlNotSupportedError", "nixlRemoteDisconnectError", "nixlCancelledError",
                     "nixlNoTelemetryError"):
            assert hasattr(b, name), name
        for name in ("malloc_passthru", "free_passthru", "ba_buf", "verify_transfer"):
            assert callable(getattr(u, name)), name
        assert callable(lg.get_logger)
        assert "multirail._core" not in sys.modules  # importing the API does not need the engine
    """)
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------------- running scripts

def _free_port() -> int:
    """A port that is free now, for a process that must be told its port (NIXL's listener).
    Drawn at random below Linux's ephemeral range (32768-60999), so the kernel does not hand it
    to some outgoing connection in the meantime; a clash with another process that does the
    same is caught by `_check`'s retry."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=None)
def _real_nixl() -> Optional[str]:
    """How to import NIXL itself here: "nixl", "nixl_cu12" (mapped to `nixl` by a shim), or None."""
    py = ENGINE_PY or sys.executable
    for mod in ("nixl._api", "nixl_cu12._api"):
        if subprocess.run([py, "-c", f"import {mod}"], capture_output=True, timeout=120).returncode == 0:
            return mod.split(".")[0]
    return None


_SHIM = """\
import sys, nixl_cu12, nixl_cu12._api, nixl_cu12._bindings, nixl_cu12._utils, nixl_cu12.logging
for _m in ("_api", "_bindings", "_utils", "logging"):
    sys.modules["nixl." + _m] = getattr(nixl_cu12, _m)
from nixl_cu12 import *  # noqa: F401,F403
from nixl_cu12 import _api, _bindings, _utils, logging  # noqa: F401
"""


def _prepare(src: str, workdir: Path, name: str, target: str) -> tuple[Path, dict]:
    """Write `src` for `target` ("multirail" or "nixl") into workdir; return (path, env)."""
    env = dict(ENV)
    env.pop("NIXL_ETCD_ENDPOINTS", None)
    if target == "multirail":
        text = rewrite_imports(src)
    else:
        text = src
        if _real_nixl() == "nixl_cu12":
            shim = workdir / "_nixl_shim" / "nixl"
            shim.mkdir(parents=True, exist_ok=True)
            (shim / "__init__.py").write_text(_SHIM)
            env["PYTHONPATH"] = str(shim.parent) + os.pathsep + env.get("PYTHONPATH", "")
        env["NIXL_LOG_LEVEL"] = "WARN"
    path = workdir / name
    path.write_text(text)
    return path, env


def _run(path: Path, env: dict, args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([ENGINE_PY or sys.executable, str(path), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _run_pair(path: Path, env: dict, cwd: Path, extra: list[str] = ()) -> tuple[subprocess.CompletedProcess, str]:
    """A two-process script: target (listening on a free port) first, then the initiator."""
    port = _free_port()
    target = subprocess.Popen([ENGINE_PY or sys.executable, str(path), "--mode", "target", "--ip", "127.0.0.1",
                               "--port", str(port), *extra], env=env, cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        _wait_listening(port, target)
        init = subprocess.run([ENGINE_PY or sys.executable, str(path), "--mode", "initiator", "--ip", "127.0.0.1",
                               "--port", str(port), *extra], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=120)
        if init.returncode != 0 and target.poll() is None:
            target.kill()  # by PID: the initiator failed, the target would wait for it forever
        out, _ = target.communicate(timeout=60)
    finally:
        if target.poll() is None:
            target.kill()  # by PID
            target.wait(timeout=10)
    return init, f"--- target (rc {target.returncode})\n{out}"


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    rc = proc.poll()
    raise AssertionError(f"target did not listen on {port} (rc {rc}): {proc.stdout.read() if rc is not None else ''}")


# -------------------------------------------------------------- 1. NIXL's own scripts

_NIXL_SCRIPTS = {
    # path in NIXL's tree: (how to run it, what it must print)
    "examples/python/partial_md_example.py": ("partial", "Test Complete."),
    "examples/python/partial_md_example.py --etcd": ("partial-etcd", "Test Complete."),
    "test/python/desc_perf.py": ("plain", "Time per desc add"),
    "test/python/prep_xfer_perf.py list": ("plain", "make_prepped_xfer"),
    "test/python/prep_xfer_perf.py array": ("plain", "make_prepped_xfer"),
    "test/python/test_nixl_bindings.py": ("pytest", ""),
    # torch on the CPU (run when torch is importable):
    "examples/python/basic_two_peers.py": ("pair-torch", "Data verification passed"),
    "examples/python/expanded_two_peers.py": ("pair-torch", "Initiator final data verification passed"),
    "test/python/test_nixl_api.py": ("pytest-torch", ""),
}
# Not run anywhere (they need what multirail does not offer): nixl_gds_example.py (GDS),
# query_mem_example.py and remote_storage_example/ (storage backends POSIX/GDS/OBJ),
# telemetry_reader.py (reads NIXL's own telemetry ring-buffer files).


@functools.lru_cache(maxsize=None)
def _nixl_source() -> tuple[Optional[Path], str]:
    """A NIXL source tree with examples/python and test/python, or (None, why not)."""
    env_src = os.environ.get("MULTIRAIL_NIXL_SRC")
    if env_src:
        root = Path(env_src)
        if (root / "examples" / "python").is_dir() or (root / "test" / "python").is_dir():
            return root, ""
        return None, f"MULTIRAIL_NIXL_SRC={env_src} has no examples/python or test/python"
    import tempfile

    dest = Path(tempfile.mkdtemp(prefix="nixl-sdist-"))
    why = "PyPI has no NIXL source distribution"
    for req in ("nixl", "nixl-cu12"):
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                "--no-build-isolation", "--timeout", "20", "--retries", "1", "-q", "-d", str(dest), req],
                               capture_output=True, text=True, timeout=120)
        except (subprocess.TimeoutExpired, OSError) as e:
            return None, f"pip download of the NIXL sdist failed: {e}"
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [""])[-1]
            why = f"PyPI has no NIXL source distribution ({req}: {last})"
            continue
        for f in dest.iterdir():
            if f.suffixes[-2:] == [".tar", ".gz"]:
                with tarfile.open(f) as t:
                    t.extractall(dest / "x", filter="data")
            elif f.suffix == ".zip":
                with zipfile.ZipFile(f) as z:
                    z.extractall(dest / "x")
        for root in (dest / "x").glob("*"):
            if (root / "examples" / "python").is_dir() or (root / "test" / "python").is_dir():
                return root, ""
        why = f"the NIXL sdist ({req}) holds no examples/python or test/python"
    import shutil

    shutil.rmtree(dest, ignore_errors=True)
    return None, why + "; set MULTIRAIL_NIXL_SRC to a NIXL checkout to run NIXL's own scripts"


def _torch_ok() -> bool:
    py = ENGINE_PY or sys.executable
    return subprocess.run([py, "-c", "import torch"], capture_output=True, timeout=120).returncode == 0


@needs_engine
@pytest.mark.parametrize("case", list(_NIXL_SCRIPTS))
def test_nixl_own_script(case: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    root, why = _nixl_source()
    if root is None:
        pytest.skip(why)
    rel, *args = case.split()
    how, expect = _NIXL_SCRIPTS[case]
    if how.endswith("torch") and not _torch_ok():
        pytest.skip(f"{rel} needs torch (CPU tensors), which is not installed")
    src = root / rel
    if not src.exists():
        pytest.skip(f"{rel} is not in this NIXL tree")
    path, env = _prepare(src.read_text(), tmp_path, src.name, "multirail")
    if how.startswith("pytest"):
        conf = src.parent / "conftest.py"
        if conf.exists():
            (tmp_path / "conftest.py").write_text(rewrite_imports(conf.read_text()))
        res = subprocess.run([ENGINE_PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-4000:] + res.stderr[-2000:]
        return
    if how.startswith("pair"):
        init, tout = _run_pair(path, env, tmp_path)
        assert init.returncode == 0 and expect in init.stdout, init.stdout[-4000:] + init.stderr[-2000:] + tout
        assert "Test Complete." in tout, tout
        return
    if how == "partial":  # socket mode; the script deletes NIXL_ETCD_ENDPOINTS, so it must be set
        env["NIXL_ETCD_ENDPOINTS"] = "unused"
        args = ["--init-port", str(_free_port()), "--target-port", str(_free_port())]
    elif how == "partial-etcd":  # etcd mode, against a real etcd
        import uuid

        import multirail

        if "metadata" not in getattr(multirail.AgentConfig, "__dataclass_fields__", {}):
            pytest.skip("multirail has no etcd metadata store (AgentConfig.metadata)")
        env["NIXL_ETCD_ENDPOINTS"] = request.getfixturevalue("etcd").http
        env["NIXL_ETCD_NAMESPACE"] = f"/nixl-{uuid.uuid4().hex[:8]}/agents/"
    res = _run(path, env, args, tmp_path)
    assert res.returncode == 0 and expect in res.stdout, res.stdout[-4000:] + res.stderr[-2000:]


# ----------------------------------------------------- 2./3. our scripts, NIXL's API surface

HEADER = '''\
import ctypes, os, pickle, sys, time
import numpy as np
'''

HELPERS = '''
def wait_until(pred, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            print("TIMEOUT waiting for", what)
            sys.exit(3)
        time.sleep(0.001)


def wait_done(agent, handle):
    return wait_until(lambda: agent.check_xfer_state(handle) == "DONE", "transfer DONE")


def raises(exc, f, *a, **kw):
    try:
        f(*a, **kw)
    except exc:
        return True
    raise AssertionError(f"{getattr(f, '__name__', f)} did not raise {exc.__name__}")


def fill(addr, nrows, row, base):
    for i in range(nrows):
        ctypes.memset(addr + i * row, base + i, row)


def row_byte(addr, i, row):
    data = ctypes.string_at(addr + i * row, row)
    assert data == data[:1] * row, "row is not uniform"
    return data[0]
'''

SCRIPTS: dict[str, str] = {}

# Two processes, NIXL's two-peer pattern (basic + expanded): side-channel metadata exchange,
# serialized descriptors in a notification, prepped READs with index maps, WRITEs from tuple and
# Nx3 numpy lists, reposting with a new notification, teardown.
SCRIPTS["two_peers"] = HEADER + '''
import argparse
import nixl._utils as nixl_utils
from nixl._api import nixl_agent, nixl_agent_config
from nixl.logging import get_logger
''' + HELPERS + '''
logger = get_logger(__name__)
p = argparse.ArgumentParser()
p.add_argument("--mode", required=True)
p.add_argument("--ip", required=True)
p.add_argument("--port", type=int, required=True)
args = p.parse_args()

ROWS, ROW = 16, 128
agent = nixl_agent(args.mode, nixl_agent_config(True, True, args.port if args.mode == "target" else 0,
                                                   backends=["UCX"]))
addr = nixl_utils.malloc_passthru(ROWS * ROW)
ctypes.memset(addr, 0, ROWS * ROW)
reg = agent.register_memory([(addr, ROWS * ROW, 0, "")], "DRAM")
assert reg is not None and reg.descCount() == 1
rows = [(addr + i * ROW, ROW, 0) for i in range(ROWS)]

if args.mode == "target":
    fill(addr, ROWS, ROW, 1)  # row i holds byte i + 1
    descs = agent.get_xfer_descs(rows, "DRAM")
    wait_until(lambda: agent.check_remote_metadata("initiator"), "initiator metadata")
    agent.send_notif("initiator", pickle.dumps((agent.get_serialized_descs(descs), addr, ROW)))
    reads = {f"Read {s}".encode() for s in range(4)} | {f"Read {s} again".encode() for s in range(4)}
    writes = 0
    def progress():
        global writes
        for msg in agent.get_new_notifs().get("initiator", []):
            if msg in reads:
                reads.remove(msg)
            elif msg.startswith(b"Write"):
                writes += 1
        return not reads and writes == 2
    wait_until(progress, "8 READ and 2 WRITE notifications")
    for i in range(ROWS):
        assert row_byte(addr, i, ROW) == (0 if i >= 12 else i + 1), (i, row_byte(addr, i, ROW))
    logger.info("target data verification passed")
else:
    agent.fetch_remote_metadata("target", args.ip, args.port)
    agent.send_local_metadata(args.ip, args.port)
    notifs = wait_until(lambda: agent.get_new_notifs(), "target's descriptors")
    blob, raddr, rrow = pickle.loads(notifs["target"][0])
    target_descs = agent.deserialize_descs(blob)
    assert target_descs.descCount() == ROWS and target_descs[3] == (raddr + 3 * rrow, rrow, 0)
    wait_until(lambda: agent.check_remote_metadata("target"), "target metadata")
    assert agent.check_remote_metadata("target", target_descs)
    local = agent.get_xfer_descs(rows, "DRAM")
    local_side = agent.prep_xfer_dlist("", local)
    remote_side = agent.prep_xfer_dlist("target", target_descs)
    reads = []
    for s in range(4):
        idx = [s, s + 4, s + 8]
        reads.append(agent.make_prepped_xfer("READ", local_side, idx, remote_side, idx[::-1], f"Read {s}".encode()))
    for h in reads:
        assert agent.transfer(h) in ("DONE", "PROC")
    for h in reads:
        wait_done(agent, h)
    for s in range(4):  # local row s+k*4 holds remote row s+(2-k)*4
        for k in range(3):
            assert row_byte(addr, s + 4 * k, ROW) == s + 4 * (2 - k) + 1
    # WRITEs of local rows 12..15 (zeros) to the target's rows 12..15: tuples, then Nx3 numpy.
    w0 = agent.initialize_xfer("WRITE", agent.get_xfer_descs(rows[12:14], "DRAM"),
                               agent.get_xfer_descs([(raddr + r * rrow, rrow, 0) for r in (12, 13)], "DRAM"),
                               "target", b"Write 12,13")
    loc = np.array(rows[14:16], dtype=np.uint64)
    rem = np.array([(raddr + r * rrow, rrow, 0) for r in (14, 15)], dtype=np.uint64)
    w1 = agent.initialize_xfer("WRITE", agent.get_xfer_descs(loc, "DRAM"), agent.get_xfer_descs(rem, "cpu"),
                               "target", "Write 14,15")
    for h in (w0, w1):
        agent.transfer(h)
    for h in (w0, w1):
        wait_done(agent, h)
    ctypes.memset(addr, 0, 12 * ROW)
    for s in range(4):  # repost with a new notification, no new preparation
        assert agent.transfer(reads[s], f"Read {s} again".encode()) in ("DONE", "PROC")
    for h in reads:
        wait_done(agent, h)
    for s in range(4):
        for k in range(3):
            assert row_byte(addr, s + 4 * k, ROW) == s + 4 * (2 - k) + 1
    logger.info("initiator data verification passed")
    agent.remove_remote_agent("target")
    for h in reads + [w0, w1]:
        agent.release_xfer_handle(h)
    agent.release_dlist_handle(local_side)
    agent.release_dlist_handle(remote_side)
    agent.invalidate_local_metadata(args.ip, args.port)
agent.deregister_memory(reg)
nixl_utils.free_passthru(addr)
print("PASS two_peers", args.mode)
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown (NIXL's own tests do the same)
'''

# One process, NIXL's partial-metadata pattern: partial metadata over the side channel (the
# second set is refused with nixlNotFoundError until it is sent), and through
# get_partial_agent_metadata/add_remote_agent (merged per label-less load).
SCRIPTS["partial_metadata"] = HEADER + '''
import nixl._utils as nixl_utils
from nixl._api import nixl_agent, nixl_agent_config
from nixl._bindings import nixlNotFoundError
''' + HELPERS + '''
init_port, target_port = int(sys.argv[1]), int(sys.argv[2])
SIZE = 256
target = nixl_agent("target", nixl_agent_config(True, True, target_port))
init = nixl_agent("initiator", nixl_agent_config(True, True, init_port))
third = nixl_agent("third", nixl_agent_config(True, False, 0))
addrs = [nixl_utils.malloc_passthru(SIZE) for _ in range(30)]
for i, a in enumerate(addrs):
    ctypes.memset(a, i, SIZE)
t1 = target.get_reg_descs([(a, SIZE, 0, "t1") for a in addrs[:10]], "DRAM")
t2 = target.get_reg_descs([(a, SIZE, 0, "t2") for a in addrs[10:20]], "DRAM")
assert t1[0] == (addrs[0], SIZE, 0, b"t1")
x1, x2 = t1.trim(), t2.trim()
assert x1.descCount() == 10 and x1[0] == (addrs[0], SIZE, 0)
assert target.register_memory(t1) is not None and target.register_memory(t2) is not None
ireg = init.get_reg_descs([(a, SIZE, 0, "") for a in addrs[20:]], "DRAM")
assert init.register_memory(ireg) is not None
ix = ireg.trim()

target.send_partial_agent_metadata(t1, True, ["UCX"], "127.0.0.1", init_port)
wait_until(lambda: init.check_remote_metadata("target", x1), "partial metadata (set 1)")
assert not init.check_remote_metadata("target", x2)
h1 = init.initialize_xfer("READ", ix, x1, "target", b"UUID1")
assert init.transfer(h1) != "ERR"
wait_done(init, h1)
wait_until(lambda: target.check_remote_xfer_done("initiator", b"UUID1"), "UUID1 notification")
for i in range(10):
    nixl_utils.verify_transfer(addrs[20 + i], addrs[i], SIZE)
raises(nixlNotFoundError, init.initialize_xfer, "READ", ix, x2, "target", b"UUID2")

target.send_partial_agent_metadata(t2, True, ["UCX"], "127.0.0.1", init_port)
def second():
    try:
        return init.initialize_xfer("READ", ix, x2, "target", b"UUID2")
    except nixlNotFoundError:
        return None
h2 = wait_until(second, "partial metadata (set 2)")
assert init.check_remote_metadata("target", x1) and init.check_remote_metadata("target", x2)
assert init.transfer(h2) != "ERR"
wait_done(init, h2)
wait_until(lambda: target.check_remote_xfer_done("initiator", b"UUID2", tag_is_prefix=False), "UUID2")
for i in range(10):
    nixl_utils.verify_transfer(addrs[20 + i], addrs[10 + i], SIZE)

# Partial metadata as bytes: loads merge.
assert third.add_remote_agent(target.get_partial_agent_metadata(t1, True, ["UCX"])) == b"target"
assert third.check_remote_metadata("target", x1) and not third.check_remote_metadata("target", x2)
third.add_remote_agent(target.get_partial_agent_metadata(t2, True, ["UCX"]))
assert third.check_remote_metadata("target", x1) and third.check_remote_metadata("target", x2)

for h in (h1, h2):
    init.release_xfer_handle(h)
init.remove_remote_agent("target")
target.deregister_memory(t1)
target.deregister_memory(t2)
init.deregister_memory(ireg)
for a in addrs:
    nixl_utils.free_passthru(a)
print("PASS partial_metadata")
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown (NIXL's own tests do the same)
'''

# The low-level bindings (nixl._bindings): descriptor lists and nixlAgent, as NIXL's
# test_nixl_bindings uses them, with telemetry enabled through the environment.
SCRIPTS["bindings"] = HEADER + '''
import tempfile
os.environ["NIXL_TELEMETRY_ENABLE"] = "y"
os.environ["NIXL_TELEMETRY_DIR"] = tempfile.mkdtemp(prefix="telemetry-")
import nixl._bindings as nixl
import nixl._utils as nixl_utils
''' + HELPERS + '''
# descriptor lists
descs = [(1000, 105, 0), (2000, 30, 0), (1010, 20, 0)]
xl = nixl.nixlXferDList(nixl.DRAM_SEG, descs)
assert xl.descCount() == 3 and not xl.isEmpty() and xl.getType() == nixl.DRAM_SEG
assert xl[0] == descs[0] and xl[2] == descs[2]
assert pickle.loads(pickle.dumps(xl)) == xl
assert xl.index((2000, 30, 0)) == 1
raises(nixl.nixlNotFoundError, xl.index, (1, 2, 3))
xl[1] = (3000, 40, 1)
assert xl[1] == (3000, 40, 1)
xl.remDesc(1)
assert xl.descCount() == 2 and xl[1] == (1010, 20, 0)
xl.addDesc((4000, 8, 0))
xl.append((5000, 8, 0))
assert xl.descCount() == 4 and xl[3] == (5000, 8, 0)
assert xl != nixl.nixlXferDList(nixl.DRAM_SEG, descs) and not (xl == 5)
xl.clear()
assert xl.isEmpty() and xl.descCount() == 0
xl.addDesc((2000, 100, 0))
assert xl.descCount() == 1
assert nixl.nixlXferDList(nixl.VRAM_SEG).getType() == nixl.VRAM_SEG
assert nixl.nixlXferDList(nixl.DRAM_SEG, 4).descCount() == 4
arr = np.array(descs, dtype=np.uint64)
assert nixl.nixlXferDList(nixl.DRAM_SEG, arr) == nixl.nixlXferDList(nixl.DRAM_SEG, descs)
assert nixl.nixlXferDList(nixl.DRAM_SEG, arr.astype(np.int64))[2] == descs[2]
raises(ValueError, nixl.nixlXferDList, nixl.DRAM_SEG, [(1, 2)])
raises(TypeError, nixl.nixlXferDList, nixl.DRAM_SEG, [[1, 2, 3]])
raises(ValueError, nixl.nixlXferDList, nixl.DRAM_SEG, np.zeros((2, 3)))
raises(ValueError, nixl.nixlXferDList, nixl.DRAM_SEG, np.zeros((2, 2), dtype=np.uint64))
raises(ValueError, nixl.nixlXferDList, nixl.DRAM_SEG, np.asfortranarray(np.zeros((2, 3), dtype=np.uint64)))
rl = nixl.nixlRegDList(nixl.DRAM_SEG, [(1000, 105, 0, "meta"), (2000, 30, 0, b"")])
assert rl[0] == (1000, 105, 0, b"meta") and rl[1] == (2000, 30, 0, b"")
assert rl.index((2000, 30, 0, "")) == 1
assert pickle.loads(pickle.dumps(rl)) == rl
tr = rl.trim()
assert isinstance(tr, nixl.nixlXferDList) and tr[0] == (1000, 105, 0) and tr.descCount() == 2
assert nixl.nixlRegDList(nixl.FILE_SEG, np.array([[0, 0, 7]], dtype=np.uint64))[0] == (0, 0, 7, b"")
raises(ValueError, nixl.nixlRegDList, nixl.DRAM_SEG, [(1, 2, 3)])
rem = nixl.nixlRemoteDList(nixl.DRAM_SEG, [(1, 2, 3, "peer")])
assert rem[0] == (1, 2, 3, "peer") and rem.descCount() == 1
assert nixl.NIXL_SUCCESS == 0 and nixl.NIXL_IN_PROG == 1 and nixl.NIXL_INIT_AGENT == ""
assert nixl.DEFAULT_COMM_PORT == 8888 and nixl.nixl_mem_t(0) == nixl.DRAM_SEG
assert nixl.DRAM_SEG.name == "DRAM_SEG" and int(nixl.FILE_SEG) == 4

# the agent
cfg = nixl.nixlAgentConfig()
cfg.useProgThread = False
a1, a2 = nixl.nixlAgent("Agent1", cfg), nixl.nixlAgent("Agent2", cfg)
assert "UCX" in a1.getAvailPlugins()
params, mems = a1.getPluginParams("UCX")
assert isinstance(params, dict) and "DRAM_SEG" in mems
raises(nixl.nixlNotFoundError, a1.getPluginParams, "NO_SUCH_PLUGIN")
u1, u2 = a1.createBackend("UCX", {}), a2.createBackend("UCX", {})
raises(nixl.nixlInvalidParamError, a1.createBackend, "UCX", {})
params, mems = a1.getBackendParams(u1)
assert isinstance(params, dict) and "DRAM_SEG" in mems
size = 256
addr1, addr2 = nixl_utils.malloc_passthru(size), nixl_utils.malloc_passthru(size)
assert addr1 % 4096 == 0
nixl_utils.ba_buf(addr1, size)
ctypes.memset(addr2, 0, size)
r1, r2 = nixl.nixlRegDList(nixl.DRAM_SEG), nixl.nixlRegDList(nixl.DRAM_SEG)
r1.addDesc((addr1, size, 0, "dead"))
r2.addDesc((addr2, size, 0, "dead"))
assert a1.registerMem(r1, [u1]) == nixl.NIXL_SUCCESS
assert a2.registerMem(r2, [u2]) == nixl.NIXL_SUCCESS
assert a1.loadRemoteMD(a2.getLocalMD()).decode() == "Agent2"
assert a2.loadRemoteMD(a1.getLocalMD()) == b"Agent1"
raises(nixl.nixlMismatchError, a1.loadRemoteMD, b"not metadata")
raises(nixl.nixlInvalidParamError, a1.loadRemoteMD, a1.getLocalMD())
assert a1.checkRemoteMD("Agent2", nixl.nixlXferDList(nixl.DRAM_SEG)) == nixl.NIXL_SUCCESS
assert a1.checkRemoteMD("nobody", nixl.nixlXferDList(nixl.DRAM_SEG)) != nixl.NIXL_SUCCESS
src, dst = nixl.nixlXferDList(nixl.DRAM_SEG), nixl.nixlXferDList(nixl.DRAM_SEG)
src.addDesc((addr1 + 8, 8, 0))
dst.addDesc((addr2 + 8, 8, 0))
noti = "n\\0tification"
h = a1.createXferReq(nixl.NIXL_WRITE, src, dst, "Agent2", noti)
assert h != 0
raises(nixl.nixlNotPostedError, a1.getXferStatus, h)
status = a1.postXferReq(h)
assert status in (nixl.NIXL_SUCCESS, nixl.NIXL_IN_PROG)
notifs = {}
def progress():
    global status, notifs
    if status != nixl.NIXL_SUCCESS:
        status = a1.getXferStatus(h)
        assert status in (nixl.NIXL_SUCCESS, nixl.NIXL_IN_PROG)
    if not notifs:
        notifs = a2.getNotifs(notifs)
    return status == nixl.NIXL_SUCCESS and notifs
wait_until(progress, "WRITE done and notified")
nixl_utils.verify_transfer(addr1 + 8, addr2 + 8, 8)
assert notifs["Agent1"] == [noti.encode()]
telem = a1.getXferTelemetry(h)
assert telem.descCount == 1 and telem.totalBytes == 8 and telem.startTime > 0
assert telem.postDuration > 0 and telem.xferDuration >= telem.postDuration
# prepared lists: local (both overloads) and remote, then a request by indices
lp = a1.prepXferDlist(nixl.NIXL_INIT_AGENT, src, [u1])
lp2 = a1.prepXferDlist(src, [u1])
rp = a1.prepXferDlist("Agent2", dst, [u1])
raises(nixl.nixlNotFoundError, a1.prepXferDlist, "nobody", dst, [u1])
h2 = a1.makeXferReq(nixl.NIXL_READ, lp, [0], rp, [0], "", [u1])
raises(nixl.nixlInvalidParamError, a1.makeXferReq, nixl.NIXL_READ, lp, [1], rp, [0])
status = a1.postXferReq(h2, "read back")
got = []
def read_done():  # the target progresses too (UCX over TCP emulates one-sided operations)
    got.extend(a2.getNotifs({}).get("Agent1", []))
    return a1.getXferStatus(h2) == nixl.NIXL_SUCCESS
wait_until(read_done, "READ done")
assert a1.genNotif("Agent2", "standalone") == nixl.NIXL_SUCCESS
wait_until(lambda: (got.extend(a2.getNotifs({}).get("Agent1", [])), b"read back" in got and b"standalone" in got)[1],
           "both notifications")
for hh in (h, h2):
    assert a1.releaseXferReq(hh) == nixl.NIXL_SUCCESS
for dl in (lp, lp2, rp):
    assert a1.releasedDlistH(dl) == nixl.NIXL_SUCCESS
assert a1.deregisterMem(r1, [u1]) == nixl.NIXL_SUCCESS
assert a2.deregisterMem(r2, [u2]) == nixl.NIXL_SUCCESS
raises(nixl.nixlNotFoundError, a1.deregisterMem, r1, [u1])
assert a1.invalidateRemoteMD("Agent2") == nixl.NIXL_SUCCESS
nixl_utils.free_passthru(addr1)
nixl_utils.free_passthru(addr2)
print("PASS bindings")
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown (NIXL's own tests do the same)
'''

# nixl_agent behaviour that NIXL's test_nixl_api checks without torch, plus error classes.
SCRIPTS["api"] = HEADER + '''
import uuid
os.environ.pop("NIXL_TELEMETRY_ENABLE", None)
import nixl._bindings as bindings
import nixl._utils as utils
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
from nixl import DEFAULT_COMM_PORT, nixl_xfer_handle, nixl_prepped_dlist_handle
''' + HELPERS + '''
assert DEFAULT_COMM_PORT == 8888
c = nixl_agent_config()
assert (c.backends, c.enable_pthread, c.enable_listen, c.port, c.capture_telemetry, c.num_threads, c.sync_mode) == \\
    (["UCX"], True, False, 8888, False, 0, None)
raises(ValueError, nixl_agent, "")
raises(TypeError, nixl_agent_config, sync_mode=1)

# sync mode reaches the bindings' agent config (the constructor is looked up at call time)
real = bindings.nixlAgent
for sync_mode in [None] + list(nixl_thread_sync_t):
    for listen in (True, False):
        seen = {}
        def spy(name, cfg):
            seen["sync"] = cfg.syncMode
            return real(name, cfg)
        bindings.nixlAgent = spy
        try:
            nixl_agent(str(uuid.uuid4()), nixl_agent_config(sync_mode=sync_mode, enable_listen_thread=listen, listen_port=0))
        finally:
            bindings.nixlAgent = real
        want = sync_mode.value if sync_mode is not None else (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value if listen else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value)
        assert seen["sync"] == want, (sync_mode, listen, seen)

empty = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[]))
assert empty.backends == {}
one = nixl_agent(str(uuid.uuid4()), nixl_conf=nixl_agent_config(backends=["UCX"]))
assert "UCX" in one.get_plugin_list() and list(one.backends) == ["UCX"]
assert one.get_backend_mem_types("UCX") and isinstance(one.get_backend_params("UCX"), dict)
x1, x2 = bindings.nixlXferDList(bindings.DRAM_SEG), bindings.nixlXferDList(bindings.DRAM_SEG)
raises(KeyError, empty.make_prepped_xfer, "RD", 0, [], 0, [])
raises(KeyError, empty.initialize_xfer, "WR", x1, x2, "nobody")
for f in (one.get_plugin_mem_types, one.get_plugin_params, one.get_backend_mem_types, one.get_backend_params):
    assert len(f("UVX")) == 0
raises(bindings.nixlNotFoundError, one.create_backend, "UVX")
raises(bindings.nixlInvalidParamError, one.create_backend, "UCX")

# get_xfer_descs / get_reg_descs input rules
assert empty.get_xfer_descs([(1, 2, 3, 4)]) is None
assert empty.get_xfer_descs([(1, 2, 3)], mem_type=None) is None
raises(KeyError, empty.get_xfer_descs, [(1, 2, 3)], mem_type="V-RAM")
assert empty.get_xfer_descs(bindings.nixlRegDList(bindings.DRAM_SEG)) is None
assert empty.get_reg_descs([(1, 2, 3)]) is None
assert empty.get_reg_descs([(1, 2, 3, 4)], mem_type=None) is None
raises(KeyError, empty.get_reg_descs, [(1, 2, 3, 4)], mem_type="V-RAM")
assert empty.get_reg_descs(bindings.nixlXferDList(bindings.DRAM_SEG)) is None
xd = empty.get_xfer_descs([(1, 2, 3)], "DRAM")
assert isinstance(xd, bindings.nixlXferDList) and empty.get_xfer_descs(xd) is xd
assert empty.get_xfer_descs([(1, 2, 3)], "cpu").getType() == bindings.DRAM_SEG
assert empty.get_xfer_descs(np.array([[1, 2, 3]], dtype=np.uint64), "VRAM").getType() == bindings.VRAM_SEG
assert empty.get_xfer_descs(np.array([[1, 2, 3]], dtype=np.uint64)) is None
assert empty.get_reg_descs(np.array([[1, 2, 3]], dtype=np.uint64), "DRAM")[0] == (1, 2, 3, b"")
back = empty.deserialize_descs(empty.get_serialized_descs(xd))
assert back == xd and back.getType() == bindings.DRAM_SEG

# metadata, notifications, check_remote_xfer_done
a1 = nixl_agent(str(uuid.uuid4()), nixl_conf=nixl_agent_config(backends=["UCX"]))
a2 = nixl_agent(str(uuid.uuid4()), nixl_conf=nixl_agent_config(backends=["UCX"]))
addr = utils.malloc_passthru(1024)
regd = a1.get_reg_descs([(addr, 1024, 0, "test")], "DRAM")
assert a1.register_memory(regd) is regd
assert a2.add_remote_agent(a1.get_agent_metadata()) == a1.name.encode()
assert a1.add_remote_agent(a2.get_agent_metadata()) == a2.name.encode()
assert a2.check_remote_metadata(a1.name) and not a2.check_remote_metadata("nobody")
assert a1.check_remote_metadata(a1.name)  # loopback: once memory is registered
assert not empty.check_remote_metadata(empty.name)
raises(bindings.nixlNotFoundError, empty.register_memory, [(addr, 1024, 0, "")], "DRAM")  # no backend
a1.send_notif(a2.name, b"whatever")
wait_until(lambda: a2.check_remote_xfer_done(a1.name, b""), "any notification")
a1.send_notif(a2.name, "tag-123 full message")
wait_until(lambda: a2.check_remote_xfer_done(a1.name, b"123", tag_is_prefix=False), "substring tag")
a1.send_notif(a2.name, b"prefix-abc")
assert not a2.check_remote_xfer_done(a1.name, b"abc") or True
wait_until(lambda: a2.check_remote_xfer_done(a1.name, b"prefix-"), "prefix tag")
a1.send_notif(a2.name, b"kept")
wait_until(lambda: a2.update_notifs().get(a1.name), "update_notifs")
assert a2.notifs[a1.name] == [b"kept"]
assert a2.get_new_notifs() == {}
raises(bindings.nixlNotFoundError, a1.send_notif, "nobody", b"x")
raises(bindings.nixlNotFoundError, a1.make_connection, "nobody")
a2.make_connection(a1.name)
raises(bindings.nixlInvalidParamError, a1.send_local_metadata)
raises(bindings.nixlInvalidParamError, a1.fetch_remote_metadata, "nobody")
raises(bindings.nixlInvalidParamError, a1.invalidate_local_metadata)
assert isinstance(a1.get_partial_agent_metadata(regd, True, ["UCX"]), bytes)
raises(ValueError, a1.query_memory, [(0, 0, 0, "f")], "POSIX", "FILE")

# transfers: errors and telemetry without capture
buf2 = utils.malloc_passthru(1024)
a2.register_memory([(buf2, 1024, 0, "")], "DRAM")
a1.add_remote_agent(a2.get_agent_metadata())
src = a1.get_xfer_descs([(addr, 512, 0), (addr + 512, 512, 0)], "DRAM")
dst = a1.get_xfer_descs([(buf2, 512, 0), (buf2 + 512, 512, 0)], "DRAM")
raises(bindings.nixlNotFoundError, a1.initialize_xfer, "WRITE", src, dst, "nobody")
raises(bindings.nixlNotFoundError, a1.initialize_xfer, "WRITE", src,
       a1.get_xfer_descs([(buf2 + 4096, 512, 0), (buf2, 512, 0)], "DRAM"), a2.name)
raises(bindings.nixlNotFoundError, a1.initialize_xfer, "WRITE",
       a1.get_xfer_descs([(addr + 8192, 512, 0), (addr, 512, 0)], "DRAM"), dst, a2.name)
raises(bindings.nixlInvalidParamError, a1.initialize_xfer, "WRITE", src, a1.get_xfer_descs([(buf2, 512, 0)], "DRAM"), a2.name)
raises(bindings.nixlNotFoundError, a1.prep_xfer_dlist, "nobody", dst)
h = a1.initialize_xfer("WRITE", src, dst, a2.name, b"telem_msg")
assert isinstance(h, nixl_xfer_handle) and "released=False" in repr(h)
raises(bindings.nixlNotPostedError, a1.check_xfer_state, h)
assert a1.transfer(h) in ("DONE", "PROC")
wait_done(a1, h)
wait_until(lambda: a2.check_remote_xfer_done(a1.name, b"telem_msg"), "telem_msg")
raises(bindings.nixlNoTelemetryError, a1.get_xfer_telemetry, h)
duration, margin, method = a1.estimate_xfer_cost(h)
assert method in ("ANALYTICAL_BACKEND", "UNKNOWN")
assert a1.query_xfer_backend(h) == "UCX"
a1.release_xfer_handle(h)
h.release()  # again: no effect
assert "released=True" in repr(h)
lp = a1.prep_xfer_dlist("NIXL_INIT_AGENT", src)
assert isinstance(lp, nixl_prepped_dlist_handle)
a1.release_dlist_handle(lp)
a1.remove_remote_agent(a2.name)
a1.remove_remote_agent(a2.name)  # unknown now: no exception
raises(bindings.nixlNotFoundError, a1.initialize_xfer, "WRITE", src, dst, a2.name)
raises(bindings.nixlNotFoundError, a1.deregister_memory, a1.get_reg_descs([(addr + 1, 10, 0, "")], "DRAM"))
raises(bindings.nixlNotFoundError, a1.register_memory, [(addr, 1024, 0, "")], "FILE")
a1.deregister_memory(regd)
utils.free_passthru(addr)
utils.free_passthru(buf2)

# telemetry: the environment decides over the config
def telemetry(env, capture):
    if env is None:
        os.environ.pop("NIXL_TELEMETRY_ENABLE", None)
    else:
        os.environ["NIXL_TELEMETRY_ENABLE"] = env
    t1 = nixl_agent(str(uuid.uuid4()), nixl_conf=nixl_agent_config(capture_telemetry=capture))
    t2 = nixl_agent(str(uuid.uuid4()), nixl_conf=nixl_agent_config())
    m1, m2 = utils.malloc_passthru(128), utils.malloc_passthru(128)
    t1.register_memory(t1.get_reg_descs([(m1, 128, 0, "")], mem_type="DRAM"))
    t2.register_memory(t2.get_reg_descs([(m2, 128, 0, "")], mem_type="DRAM"))
    t1.add_remote_agent(t2.get_agent_metadata())
    hh = t1.initialize_xfer("WRITE", t1.get_xfer_descs([(m1, 64, 0), (m1 + 64, 64, 0)], mem_type="DRAM"),
                            t1.get_xfer_descs([(m2, 64, 0), (m2 + 64, 64, 0)], mem_type="DRAM"), t2.name, b"t")
    t1.transfer(hh)
    wait_done(t1, hh)
    try:
        tel = t1.get_xfer_telemetry(hh)
    except bindings.nixlNoTelemetryError:
        tel = None
    t1.release_xfer_handle(hh)
    utils.free_passthru(m1)
    utils.free_passthru(m2)
    return tel
assert telemetry("no", True) is None
assert telemetry(None, False) is None
for env, capture in ((None, True), ("y", False)):
    tel = telemetry(env, capture)
    assert tel is not None and tel.descCount == 2 and tel.totalBytes == 128 and tel.startTime > 0
    assert tel.postDuration > 0 and tel.xferDuration >= tel.postDuration
os.environ.pop("NIXL_TELEMETRY_ENABLE", None)
print("PASS api")
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown (NIXL's own tests do the same)
'''

# Descriptor-heavy paths (NIXL's desc_perf / prep_xfer_perf) and loopback transfers to the
# agent's own name, with the data checked.
SCRIPTS["loopback_and_lists"] = HEADER + '''
import nixl._utils as nixl_utils
from nixl._api import nixl_agent, nixl_agent_config
''' + HELPERS + '''
agent = nixl_agent("agent", nixl_agent_config(backends=["UCX"]))
n, length = 256, 1024
base = nixl_utils.malloc_passthru(2 * n * length)
many = agent.get_xfer_descs([(base, 256, 0)] * 100000, "DRAM")
assert many.descCount() == 100000 and many[99999] == (base, 256, 0)
arr = np.zeros((n, 3), dtype=np.uint64)
arr[:, 0] = base + np.arange(n, dtype=np.uint64) * length
arr[:, 1] = length
xfer = agent.get_xfer_descs(arr, "DRAM")
reg = agent.get_reg_descs(arr, "DRAM")
assert xfer.descCount() == reg.descCount() == n and reg.trim() == xfer
lst = agent.get_reg_descs([(base + i * length, length, 0, b"") for i in range(n)], "DRAM")
assert lst.trim() == xfer
upper = agent.get_reg_descs([(base + n * length, n * length, 0, "")], "DRAM")
assert agent.register_memory(reg) is not None and agent.register_memory(upper) is not None
for i in range(n):
    ctypes.memset(base + i * length, i % 251 + 1, length)
ctypes.memset(base + n * length, 0, n * length)
dst = agent.get_xfer_descs(arr + np.array([n * length, 0, 0], dtype=np.uint64), "DRAM")
local = agent.prep_xfer_dlist("", xfer, "DRAM")
self_side = agent.prep_xfer_dlist("agent", dst, "DRAM")
idx = np.arange(n)
h = agent.make_prepped_xfer("WRITE", local, idx, self_side, idx[::-1].copy(), b"UUID2")
assert agent.transfer(h) in ("DONE", "PROC")
wait_done(agent, h)
for i in range(n):
    nixl_utils.verify_transfer(base + i * length, base + (2 * n - 1 - i) * length, length)
ctypes.memset(base + n * length, 0, n * length)
h2 = agent.initialize_xfer("WRITE", xfer, dst, "agent")
agent.transfer(h2)
wait_done(agent, h2)
nixl_utils.verify_transfer(base, base + n * length, n * length)
for hh in (h, h2):
    agent.release_xfer_handle(hh)
agent.release_dlist_handle(local)
agent.release_dlist_handle(self_side)
agent.deregister_memory(reg)
agent.deregister_memory(upper)
nixl_utils.free_passthru(base)
print("PASS loopback_and_lists")
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown (NIXL's own tests do the same)
'''


def _script_args(name: str) -> list[str]:
    return [str(_free_port()), str(_free_port())] if name == "partial_metadata" else []


def _check(name: str, target: str, tmp_path: Path) -> None:
    path, env = _prepare(SCRIPTS[name], tmp_path, f"{name}.py", target)
    if name == "two_peers":
        init, tout = _run_pair(path, env, tmp_path)
        assert init.returncode == 0 and "PASS two_peers initiator" in init.stdout, init.stdout + init.stderr + tout
        assert "PASS two_peers target" in tout, tout
        return
    for _ in range(3):
        res = _run(path, env, _script_args(name), tmp_path)
        # The ports were free when drawn; another process may have taken one since (only the
        # scripts that are given ports can hit this): draw new ones.
        if "Address already in use" not in res.stdout + res.stderr or not _script_args(name):
            break
    assert res.returncode == 0 and f"PASS {name}" in res.stdout, res.stdout[-6000:] + res.stderr[-4000:]


@needs_engine
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_on_multirail(name: str, tmp_path: Path) -> None:
    _check(name, "multirail", tmp_path)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_on_nixl_itself(name: str, tmp_path: Path) -> None:
    """The same scripts, unmodified, on NIXL (when installed): they state NIXL's behaviour."""
    if _real_nixl() is None:
        pytest.skip("NIXL is not installed here (.venv/bin/pip install --no-deps nixl-cu12==1.5.1 to run this)")
    _check(name, "nixl", tmp_path)


def test_scripts_only_use_nixl_imports() -> None:
    """Our scripts import NIXL only through the names the rewrite maps (nothing multirail)."""
    for name, src in SCRIPTS.items():
        assert "multirail" not in src, name
        rewritten = rewrite_imports(src)
        assert not re.search(r"^\s*(from|import)\s+nixl\b", rewritten, re.M), name


# -------------------------------------------------------------------- etcd (central store) mode

class _MemStore:
    """An in-memory stand-in for the etcd store: put/get/delete_prefix, shared by the agents."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.kv[key] = bytes(value)

    def get(self, key: str) -> Optional[bytes]:
        return self.kv.get(key)

    def delete_prefix(self, prefix: str) -> None:
        for k in [k for k in self.kv if k.startswith(prefix)]:
            del self.kv[k]


@needs_engine
def test_etcd_mode_mapping_on_a_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL's etcd calls (no address; labels; partial metadata; invalidation) on a store with
    NIXL's key layout NIXL_ETCD_NAMESPACE/<agent>/<label> (default namespace /nixl/agents,
    default label "metadata"). The store here is in memory: this checks the NIXL-side mapping;
    test_etcd_mode_with_etcd runs it against etcd."""
    import time

    from multirail.nixl import bindings, nixl_agent, nixl_agent_config, utils

    store = _MemStore()
    monkeypatch.setattr(bindings, "STORE_FACTORY", lambda endpoints, ns: store)
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", "http://127.0.0.1:2379")
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", "/test/ns")
    t, i = nixl_agent("etcd-target", nixl_agent_config()), nixl_agent("etcd-init", nixl_agent_config())
    addrs = [utils.malloc_passthru(256) for _ in range(3)]
    try:
        for a in addrs[:2]:
            utils.ba_buf(a, 256)
        r1 = t.get_reg_descs([(addrs[0], 256, 0, "")], "DRAM")
        r2 = t.get_reg_descs([(addrs[1], 256, 0, "")], "DRAM")
        t.register_memory(r1)
        t.register_memory(r2)
        i.register_memory([(addrs[2], 256, 0, "")], "DRAM")

        def wait(pred, what):
            deadline = time.monotonic() + 10
            while not pred():
                assert time.monotonic() < deadline, what
                time.sleep(0.005)

        # partial metadata under a label (a label is required without an address)
        with pytest.raises(bindings.nixlInvalidParamError):
            t.send_partial_agent_metadata(r1, True, ["UCX"])
        t.send_partial_agent_metadata(r1, True, ["UCX"], label="part1")
        assert "/test/ns/etcd-target/part1" in store.kv
        i.fetch_remote_metadata("etcd-target", label="part1")
        x1, x2 = r1.trim(), r2.trim()
        wait(lambda: i.check_remote_metadata("etcd-target", x1), "label part1 loaded")
        assert not i.check_remote_metadata("etcd-target", x2)
        # full metadata under the default label; a fetch before the send waits for it
        i.remove_remote_agent("etcd-target")
        i.fetch_remote_metadata("etcd-target")
        time.sleep(0.05)
        assert not i.check_remote_metadata("etcd-target")
        t.send_local_metadata()
        assert "/test/ns/etcd-target/metadata" in store.kv
        wait(lambda: i.check_remote_metadata("etcd-target", x2), "full metadata loaded")
        h = i.initialize_xfer("READ", i.get_xfer_descs([(addrs[2], 256, 0)], "DRAM"), x2, "etcd-target", b"etcd")
        i.transfer(h)
        wait(lambda: i.check_xfer_state(h) == "DONE", "READ done")
        utils.verify_transfer(addrs[1], addrs[2], 256)
        i.release_xfer_handle(h)
        # invalidation removes every key of the agent
        t.invalidate_local_metadata()
        assert not [k for k in store.kv if k.startswith("/test/ns/etcd-target/")]
        # an address still means the side channel
        with pytest.raises(bindings.nixlRemoteDisconnectError):
            i.fetch_remote_metadata("etcd-target", "127.0.0.1", _free_port())
    finally:
        i.close()
        t.close()
        for a in addrs:
            utils.free_passthru(a)


ETCD_SCRIPT = HEADER + '''
import nixl._utils as nixl_utils
from nixl._api import nixl_agent, nixl_agent_config
from nixl._bindings import nixlInvalidParamError, nixlNotFoundError
''' + HELPERS + '''
assert os.environ["NIXL_ETCD_ENDPOINTS"]
SIZE = 256
target = nixl_agent("etcd-target", nixl_agent_config(True, False, 0))
init = nixl_agent("etcd-init", nixl_agent_config(True, False, 0))
third = nixl_agent("etcd-third", nixl_agent_config(True, False, 0))
addrs = [nixl_utils.malloc_passthru(SIZE) for _ in range(12)]
for i, a in enumerate(addrs):
    ctypes.memset(a, i + 1, SIZE)
t1 = target.get_reg_descs([(a, SIZE, 0, "") for a in addrs[:4]], "DRAM")
t2 = target.get_reg_descs([(a, SIZE, 0, "") for a in addrs[4:8]], "DRAM")
target.register_memory(t1)
target.register_memory(t2)
ireg = init.register_memory([(a, SIZE, 0, "") for a in addrs[8:]], "DRAM")
x1, x2, ix = t1.trim(), t2.trim(), ireg.trim()

# partial metadata under labels: a label is required without an address
raises(nixlInvalidParamError, target.send_partial_agent_metadata, t1, True, ["UCX"])
target.send_partial_agent_metadata(t1, True, ["UCX"], label="label_1")
init.fetch_remote_metadata("etcd-target", label="label_1")
wait_until(lambda: init.check_remote_metadata("etcd-target", x1), "label_1 metadata")
h1 = init.initialize_xfer("READ", ix, x1, "etcd-target", b"ETCD1")
init.transfer(h1)
wait_done(init, h1)
wait_until(lambda: target.check_remote_xfer_done("etcd-init", b"ETCD1"), "ETCD1 notification")
for i in range(4):
    nixl_utils.verify_transfer(addrs[8 + i], addrs[i], SIZE)
raises(nixlNotFoundError, init.initialize_xfer, "READ", ix, x2, "etcd-target")
target.send_partial_agent_metadata(t2, True, ["UCX"], label="label_2")
init.fetch_remote_metadata("etcd-target", label="label_2")
def second():
    try:
        return init.initialize_xfer("READ", ix, x2, "etcd-target", b"ETCD2")
    except nixlNotFoundError:
        return None
h2 = wait_until(second, "label_2 metadata")
init.transfer(h2)
wait_done(init, h2)
for i in range(4):
    nixl_utils.verify_transfer(addrs[8 + i], addrs[4 + i], SIZE)

# full metadata by name (default label)
target.send_local_metadata()
third.fetch_remote_metadata("etcd-target")
wait_until(lambda: third.check_remote_metadata("etcd-target", x1) and third.check_remote_metadata("etcd-target", x2),
           "full metadata")

# invalidation: agents that loaded it from etcd drop it
for h in (h1, h2):
    init.release_xfer_handle(h)
time.sleep(1.0)  # NIXL sets up its etcd watch for a peer just after loading it, asynchronously
target.invalidate_local_metadata()
wait_until(lambda: not third.check_remote_metadata("etcd-target"), "third drops the invalidated agent")
wait_until(lambda: not init.check_remote_metadata("etcd-target"), "init drops the invalidated agent")
print("PASS etcd")
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown (NIXL's own tests do the same)
'''


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory):
    try:
        from etcd_server import ETCD_MISSING, EtcdServer
    except ImportError:
        pytest.skip("tests/etcd_server.py (the etcd test server) is not in this tree")
    if ETCD_MISSING:
        pytest.skip(ETCD_MISSING)
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data", name="nixlconf")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("target", ["multirail", "nixl"])
def test_etcd_mode_script(target: str, etcd, tmp_path: Path) -> None:
    """NIXL's etcd mode (NIXL_ETCD_ENDPOINTS / NIXL_ETCD_NAMESPACE): send_local_metadata() and
    fetch_remote_metadata(name) without an address, labelled partial metadata, invalidation
    seen by the agents that loaded it; against a real etcd, on multirail and on NIXL."""
    import uuid

    if target == "multirail":
        if ENGINE_PY is None:
            pytest.skip("multirail._core (the engine extension) is not built")
        import multirail

        if "metadata" not in getattr(multirail.AgentConfig, "__dataclass_fields__", {}):
            pytest.skip("multirail has no etcd metadata store (AgentConfig.metadata)")
    elif _real_nixl() is None:
        pytest.skip("NIXL is not installed here (.venv/bin/pip install --no-deps nixl-cu12==1.5.1 to run this)")
    path, env = _prepare(ETCD_SCRIPT, tmp_path, "etcd_mode.py", target)
    env["NIXL_ETCD_ENDPOINTS"] = etcd.http
    env["NIXL_ETCD_NAMESPACE"] = f"/nixl-{uuid.uuid4().hex[:8]}/agents/"
    res = _run(path, env, [], tmp_path)
    assert res.returncode == 0 and "PASS etcd" in res.stdout, res.stdout[-6000:] + res.stderr[-4000:]


def test_repo_holds_no_nixl_code() -> None:
    """NIXL's scripts are fetched at test time, never stored here."""
    for p in (REPO / "tests").rglob("*.py"):
        text = p.read_text(errors="replace")
        assert "NVIDIA " + "CORPORATION" not in text, p
