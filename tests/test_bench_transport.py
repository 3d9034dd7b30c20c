"""`multirail bench --transport auto|tcp|ucx|ucx,tcp` (issues 9, 21): the option reaches every agent of a run,
the result names the transport of every rail, a bad value is refused, and a ucx run where UCX
cannot load stops with the engine's TransportUnavailableError message. Fast (< 30 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ENV, engine_python  # noqa: E402

# UCX sessions need a shared secret (issue 33): every bench run here gets one, both sides.
ENV = {**ENV, "MULTIRAIL_SECRET": "bench-transport-tests"}

RUNNER = ("import argparse, sys; from multirail import bench; p = argparse.ArgumentParser(prog='multirail'); "
          "s = p.add_subparsers(); bench.register(s); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
ENGINE_PY = engine_python()
needs_engine = pytest.mark.skipif(ENGINE_PY is None, reason="multirail._core (the engine extension) is not built")
SMALL = ["--op", "READ", "--start-block-size", "1MiB", "--max-block-size", "1MiB", "--num-iter", "5",
         "--warmup-iter", "1", "--check-consistency", "--timeout", "10"]


def bench(*args: str, py: str | None = None, env: dict[str, str] | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([py or sys.executable, "-c", RUNNER, "bench", *args], env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)


def _ucx_unavailable(py: str) -> str | None:
    """Why a ucx agent cannot start with `py` (the engine's message), or None. In a child
    process: UCX is loaded at most once per process and stays loaded."""
    code = ("import multirail, sys\n"
            "try:\n    a = multirail.Agent('ucx-probe', {'transport': 'ucx', 'auth_secret': 'probe'})\n"
            "except multirail.errors.TransportUnavailableError as e:\n    print(e); sys.exit(3)\n"
            "a.close()\n")
    cp = subprocess.run([py, "-c", code], env=ENV, capture_output=True, text=True, timeout=30)
    if cp.returncode == 0:
        return None
    return f"UCX cannot be loaded here: {(cp.stdout or cp.stderr).strip()[-300:]}"


def test_transport_bogus_is_refused() -> None:
    cp = bench("local", "--transport", "bogus", *SMALL)
    assert cp.returncode == 2, cp.stderr
    assert "invalid --transport 'bogus'" in cp.stderr, cp.stderr
    assert "tcp" in cp.stderr and "ucx" in cp.stderr, cp.stderr  # names the valid values


@needs_engine
def test_bench_local_ucx_names_the_transport() -> None:
    assert ENGINE_PY is not None
    why = _ucx_unavailable(ENGINE_PY)
    if why:
        pytest.skip(why)
    cp = bench("local", "--transport", "ucx", *SMALL, "--json", "-", py=ENGINE_PY)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    assert doc["config"]["transport"] == "ucx"
    tr = doc["transport"]
    assert tr["transport"] == "ucx" and tr["engine"] == "ucx", tr
    assert tr["ucx_version"], tr
    assert tr["rails"] and all(r["transport"].startswith("ucx/") for r in tr["rails"]), tr
    assert tr["target_transport"] and tr["target_transport"].startswith("ucx"), tr  # the target process too
    (row,) = doc["rows"]
    assert row["consistency"] == "ok", row
    assert row["engine_rails"] and all(e["transport"].startswith("ucx/") for e in row["engine_rails"]), row
    assert "transport: ucx" in cp.stderr  # the human line (stderr with --json -)


@needs_engine
def test_bench_local_default_is_auto_which_is_tcp_here() -> None:
    env = {k: v for k, v in ENV.items() if k != "MULTIRAIL_TRANSPORT"}
    cp = bench("local", *SMALL, "--json", "-", py=ENGINE_PY, env=env)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    assert doc["transport"]["transport"] == "auto" and doc["transport"]["engine"] == "auto", doc["transport"]
    assert all(r["transport"] == "tcp" and r["transport_reason"] == "auto: no RDMA device"
               for r in doc["transport"]["rails"]), doc["transport"]
    assert doc["transport"]["target_transport"] == "auto [tcp]"
    assert "=tcp (auto: no RDMA device)" in cp.stderr, cp.stderr


@needs_engine
def test_bench_local_mixed_rails_name_each_transport() -> None:
    """--transport ucx,tcp over two loopback rails: one link, rail 0 over UCX, rail 1 over tcp;
    the output says what each runs and why, and the bytes check out."""
    assert ENGINE_PY is not None
    why = _ucx_unavailable(ENGINE_PY)
    if why:
        pytest.skip(why)
    cp = bench("local", "--rails", "127.0.0.1,127.0.0.1", "--transport", "ucx,tcp", *SMALL[:-2], "--json", "-",
               py=ENGINE_PY)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    tr = doc["transport"]
    assert [r["transport"] for r in tr["rails"]] == ["ucx/tcp", "tcp"], tr
    assert tr["rails"][1]["transport_reason"] == "explicit", tr
    assert tr["target_transport"].startswith("auto [ucx, tcp]"), tr
    (row,) = doc["rows"]
    assert row["consistency"] == "ok", row


@needs_engine
def test_ucx_where_ucx_cannot_load_exits_with_the_engines_message() -> None:
    env = {**ENV, "MULTIRAIL_UCX_LIB": "/nonexistent/libucp.so.0"}  # explicit path: nothing else is tried
    cp = bench("local", "--transport", "ucx", *SMALL, py=ENGINE_PY, env=env)
    assert cp.returncode == 1, (cp.stdout, cp.stderr)
    assert "TransportUnavailableError" in cp.stderr, cp.stderr
    assert "/nonexistent/libucp.so.0" in cp.stderr, cp.stderr
    assert "Traceback" not in cp.stderr, cp.stderr
