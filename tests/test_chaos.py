"""Chaos mode (`bench local --testbed --chaos rail-flap`), resource sampling, and `--secret`.

* argument errors and pure pieces: no engine, no root;
* `--secret`: real `bench local` / `bench target` + `bench initiator` runs (needs the engine);
* chaos runs on uniquely named testbeds, always removed (needs root, `ip netns` and the engine;
  skipped with the reason otherwise). Every process is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from multirail import bench as bench_mod
from multirail.bench.chaos import ChaosOptions, default_flap_rails, options_from_args, verdict
from multirail.bench.core import UsageError
from multirail.bench.procstat import Limits, ProcSampler, Sample, growth, read_proc
from multirail.bench.worker import BenchFailure

from conftest import ENV, engine_python, netns_unavailable  # noqa: E402

ENGINE_PY = engine_python()
needs_engine = pytest.mark.skipif(ENGINE_PY is None, reason="multirail._core (the engine extension) is not built")


def _ns_unavailable() -> str | None:
    if ENGINE_PY is None:
        return "multirail._core (the engine extension) is not built"
    return netns_unavailable()


NS_SKIP = _ns_unavailable()
needs_ns = pytest.mark.skipif(NS_SKIP is not None, reason=NS_SKIP or "")


def mr(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ENGINE_PY or sys.executable, "-m", "multirail", *args], env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="multirail")
    bench_mod.register(p.add_subparsers())
    return p.parse_args(["bench", *argv])


# -- argument errors (no engine, no root) -------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--chaos", "rail-flap"], "--chaos needs --testbed"),
    (["--chaos", "flood", "--testbed", "x"], "invalid choice"),
    (["--chaos-duration", "5"], "--chaos-duration: only with --chaos"),
    (["--flap-rails", "1", "--flap-up-s", "1"], "--flap-up-s, --flap-rails: only with --chaos"),
    (["--op", "MIXED"], "--op MIXED is only for chaos runs"),
    (["--flap-how", "blackhole"], "--flap-how: only with --chaos"),
    (["--secret", ""], "--secret must not be empty"),
])
def test_usage_errors(args: list[str], needle: str) -> None:
    res = mr("bench", "local", *args)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr


def test_chaos_option_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UsageError, match="needs root"):
        options_from_args(parse("local", "--testbed", "tb", "--chaos", "rail-flap"))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for argv, needle in [(["--chaos-duration", "1"], "no room for one flap"),
                         (["--flap-rails", "1,x"], "rail indices"),
                         (["--flap-rails", "1,1"], "twice"),
                         (["--chaos-sizes", "4XB"], "invalid size"),
                         (["--baseline"], "--baseline"),
                         (["--rails", "0"], "--flap-rails")]:
        with pytest.raises(UsageError, match=needle):
            options_from_args(parse("local", "--testbed", "tb", "--chaos", "rail-flap", *argv))
    o = options_from_args(parse("local", "--testbed", "tb", "--chaos", "rail-flap", "--op", "mixed",
                                "--chaos-sizes", "4KiB,2MiB", "--flap-rails", "2,1", "--secret", "k"))
    assert (o.op, o.sizes, o.flap_rails, o.secret) == ("MIXED", [4096, 2 << 20], [2, 1], "k")
    assert o.buffer_size() == 4 << 20 and o.config()["secret"] == "(set)"
    assert default_flap_rails(1) == [0] and default_flap_rails(2) == [1] and default_flap_rails(4) == [1, 2, 3]


def test_verdict_flags_corruption_loss_and_failures_with_a_rail_up() -> None:
    clean = {"bytes_corrupted": 0, "corrupt_transfers": 0, "corrupt_details": [], "lost": 0, "lost_after_s": 16.0,
             "failed_with_rail_up": 0, "failures": [], "unverified": 0, "unverified_details": [], "flap_error": [],
             "flaps": 3, "completed": 10, "final_transfers": [], "readmit_after_last_flap_s": 0.1}
    assert verdict(clean) == []
    assert "bytes corrupted" in verdict({**clean, "bytes_corrupted": 5, "corrupt_transfers": 1,
                                         "corrupt_details": ["x"]})[0]
    assert "lost" in verdict({**clean, "lost": 1})[0]
    assert "while a rail was up" in verdict({**clean, "failed_with_rail_up": 2, "failures": ["E: x"]})[0]
    assert "no flap" in verdict({**clean, "flaps": 0})[0]


# -- resource sampling --------------------------------------------------------------------------

def test_read_proc_and_sampler() -> None:
    got = read_proc(os.getpid())
    assert got is not None
    _comm, rss, fds, threads = got
    assert rss > 0 and fds >= 3 and threads >= 1
    assert read_proc(2**22 + 7) is None  # above pid_max: no such process
    s = ProcSampler(0.01)
    s.watch("me", os.getpid())
    s.watch("gone", 2**22 + 7)
    s.sample_once()
    s.sample_once()
    doc = s.to_json()
    assert doc["processes"]["me"]["n"] == 2 and len(doc["processes"]["me"]["samples"]) == 2
    assert doc["processes"]["gone"]["n"] == 0 and doc["processes"]["gone"]["first"] is None


def _series(rss: list[int], fds: list[int], threads: list[int] | None = None) -> list[Sample]:
    threads = threads or [10] * len(rss)
    return [Sample(float(i), r, f, t) for i, (r, f, t) in enumerate(zip(rss, fds, threads))]


def test_growth_flags_leaks_and_tolerates_noise() -> None:
    n = 60
    steady = _series([100_000 + (i % 3) * 500 for i in range(n)], [18 + i % 2 for i in range(n)])
    g = growth(steady, warmup_s=5, window_s=10, limits=Limits())
    assert g["problems"] == [] and g["fds"]["growth"] == 0
    leak = _series([100_000 + i * 1000 for i in range(n)], [18] * n)  # ~1 MiB a sample
    assert any("RSS grew" in p for p in growth(leak, 5, 10, Limits())["problems"])
    assert growth(leak, 5, 10, Limits())["rss_trend_kib_per_min"] == pytest.approx(60_000)
    fd_leak = _series([100_000] * n, [18 + i // 10 for i in range(n)])
    assert any(p.startswith("fds") for p in growth(fd_leak, 5, 10, Limits())["problems"])
    # two-valued (a rail down half the time), with a swing larger than the slack: no problem
    flap = _series([100_000] * n, [17 + 4 * (i % 2) for i in range(n)], [12 + 3 * (i % 2) for i in range(n)])
    assert growth(flap, 5, 10, Limits())["problems"] == []
    th_leak = _series([100_000] * n, [18] * n, [10 + i // 10 for i in range(n)])
    assert any(p.startswith("threads") for p in growth(th_leak, 5, 10, Limits())["problems"])
    assert "too few samples" in growth(steady[:4], 5, 10, Limits())["problems"][0]


# -- the secret stays off command lines ---------------------------------------------------------

def test_secret_reaches_children_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from multirail.bench import drill, target

    seen: list[tuple[list[str], dict[str, str] | None]] = []

    def fake_launch(cmd: list[str], ready_timeout: float = 30.0, env: dict[str, str] | None = None) -> Any:
        seen.append((list(cmd), env))
        raise RuntimeError("not started (test)")

    monkeypatch.setattr(target, "launch", fake_launch)
    monkeypatch.setenv("MULTIRAIL_SECRET", "inherited")
    args = parse("local", "--secret", "from-flag")
    with pytest.raises(BenchFailure):
        bench_mod._start_target(args, [], "127.0.0.1:0", None, 4096)

    class FakeTb:
        name = "fake"

        def addrs(self, side: str) -> list[str]:
            return ["10.0.0.1"]

        def exec_argv(self, side: str, argv: list[str]) -> list[str]:
            return argv

    with pytest.raises(RuntimeError):
        with drill.target_process(FakeTb(), 4096, env={**os.environ, "MULTIRAIL_SECRET": "from-flag"}):
            pass
    assert len(seen) == 2
    for cmd, env in seen:
        assert "from-flag" not in " ".join(cmd) and "--secret" not in cmd
        assert env is not None and env["MULTIRAIL_SECRET"] == "from-flag"
    seen.clear()
    with pytest.raises(BenchFailure):
        bench_mod._start_target(parse("local"), [], "127.0.0.1:0", None, 4096)
    assert seen[0][1] is None  # no --secret: the child inherits MULTIRAIL_SECRET as it is


# -- --secret against the engine ----------------------------------------------------------------

@needs_engine
def test_local_with_secret_overrides_the_environment(tmp_path: Path) -> None:
    # the inherited MULTIRAIL_SECRET differs: only if --secret reaches the target process too
    # (through its environment) do both sides agree
    env = {**ENV, "MULTIRAIL_SECRET": "not-this-one"}
    res = mr("bench", "local", "--secret", "s3cr3t-flag", "--start-block-size", "64KiB", "--max-block-size", "64KiB",
             "--num-iter", "4", "--warmup-iter", "1", "--check-consistency", "--json", str(tmp_path / "r.json"),
             env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    doc = (tmp_path / "r.json").read_text()
    assert json.loads(doc)["rows"][0]["consistency"] == "ok"
    assert "s3cr3t-flag" not in doc and "s3cr3t-flag" not in res.stdout + res.stderr


@needs_engine
def test_mismatched_secret_is_a_clean_auth_error() -> None:
    from multirail.bench.target import launch, stop

    env = {k: v for k, v in ENV.items() if k != "MULTIRAIL_SECRET"}
    proc, ready, errf = launch([ENGINE_PY or sys.executable, "-m", "multirail", "bench", "target", "--listen",
                                "127.0.0.1:0", "--total-buffer-size", "1MiB", "--idle-timeout", "60",
                                "--duration", "60", "--secret", "secret-A"], env=env)
    try:
        connect = ["bench", "initiator", "--connect", f"127.0.0.1:{ready['port']}", "--timeout", "3",
                   "--start-block-size", "64KiB", "--max-block-size", "64KiB", "--num-iter", "2", "--warmup-iter", "0"]
        for extra, run_env in [(["--secret", "secret-B"], env),
                               (["--secret", "secret-B"], {**env, "MULTIRAIL_SECRET": "secret-A"}),  # flag wins
                               ([], env)]:  # no secret at all
            res = mr(*connect, *extra, env=run_env, timeout=30)
            assert res.returncode == 1, (extra, res.stdout, res.stderr)
            assert "AuthenticationError" in res.stderr and "--secret or MULTIRAIL_SECRET" in res.stderr, res.stderr
            assert "Traceback" not in res.stderr
        ok = mr(*connect, env={**env, "MULTIRAIL_SECRET": "secret-A"}, timeout=30)  # the variable alone
        assert ok.returncode == 0, ok.stderr
    finally:
        stop(proc, grace=5.0)  # the successful initiator sent bench:stop
        errf.close()


# -- chaos runs on a testbed (root) -------------------------------------------------------------

def _tb_name(prefix: str) -> str:
    return f"{prefix}{os.getpid() % 10000}{secrets.token_hex(2)}"


@pytest.fixture(scope="module")
def testbed2() -> Iterator[Any]:
    from multirail.testbed import Testbed

    tb = Testbed(_tb_name("cx"), rails=2, rate="1gbit")
    try:
        tb.up()
        yield tb
    finally:
        tb.down()


def chaos(tb: Any, tmp_path: Path, *args: str, env: dict[str, str] | None = None,
          timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "chaos.json"
    res = mr("bench", "local", "--testbed", tb.name, "--chaos", "rail-flap", "--json", str(out), *args,
             env=env, timeout=timeout)
    assert "Traceback" not in res.stderr, res.stderr
    assert out.exists(), f"no JSON (exit {res.returncode}): {res.stderr[-2000:]}"
    doc: dict[str, Any] = json.loads(out.read_text())
    return res, doc


SCHEMA: dict[str, type | tuple[type, ...]] = {
    "chaos": str, "testbed": str, "op": str, "n_rails": int, "flaps": int, "transfers": int, "completed": int,
    "failed": int, "failed_no_rail_up": int, "failed_with_rail_up": int, "lost": int, "bytes_moved": int,
    "bytes_corrupted": int, "corrupt_transfers": int, "unverified": int, "per_rail": list, "by_op": dict,
    "by_size": dict, "flap_log": list, "sizes": list, "flap_rails": list, "down_s": float, "up_s": float,
    "duration_s": float, "final_transfers": list, "failures": list, "events": list, "resources": dict,
    "problems": list, "ok": bool, "config": dict,
}


def check_schema(doc: dict[str, Any]) -> None:
    for key, typ in SCHEMA.items():
        assert key in doc, f"missing {key}"
        assert isinstance(doc[key], typ), f"{key}: {type(doc[key]).__name__}"
    for r in doc["per_rail"]:
        assert {"rail", "flaps", "undetected", "detect_median_s", "detect_max_s", "readmit_median_s",
                "readmit_max_s"} <= set(r)
    for name in ("target", "initiator"):
        proc = doc["resources"]["processes"][name]
        assert proc["comm"].startswith("python") and proc["n"] >= 2, proc
        assert proc["last"]["rss_kib"] > 0 and proc["last"]["fds"] > 0 and proc["last"]["threads"] > 0


@needs_ns
def test_chaos_rail_flap_read(testbed2: Any, tmp_path: Path) -> None:
    env = {**ENV, "MULTIRAIL_SECRET": "inherited-but-overridden"}
    res, doc = chaos(testbed2, tmp_path, "--op", "READ", "--chaos-duration", "14", "--flap-down-s", "2",
                     "--flap-up-s", "2", "--chaos-sizes", "4KiB,1MiB,16MiB", "--secret", "chaos-secret", env=env)
    check_schema(doc)
    assert res.returncode == 0 and doc["ok"], (doc["problems"], res.stderr[-1500:])
    assert doc["bytes_corrupted"] == 0 and doc["corrupt_transfers"] == 0 and doc["lost"] == 0
    assert doc["completed"] > 0 and doc["flaps"] >= 3 and doc["failed_with_rail_up"] == 0
    assert doc["flap_rails"] == [1] and doc["sizes"] == [4096, 1 << 20, 16 << 20]
    assert set(doc["by_size"]) == {"4096", str(1 << 20), str(16 << 20)}
    assert all(t["completed"] > 0 for t in doc["by_size"].values())
    assert doc["per_rail"][0]["flaps"] == doc["flaps"]
    assert all(f["ok"] and f["corrupt"] is None for f in doc["final_transfers"])
    assert "chaos-secret" not in json.dumps(doc)
    for needle in ("flaps done", "transfers", "bytes moved", "bytes corrupted", "rail 1:", "result            OK"):
        assert needle in res.stdout, res.stdout


@needs_ns
def test_chaos_blackhole_read(testbed2: Any, tmp_path: Path) -> None:
    """Carrier stays up: only the stall timeout sees the dead rail; the rule is gone afterwards."""
    res, doc = chaos(testbed2, tmp_path, "--op", "READ", "--chaos-duration", "9", "--flap-how", "blackhole",
                     "--chaos-sizes", "1MiB,16MiB")
    assert doc["how"] == "blackhole" and doc["flaps"] >= 2, doc["flap_log"]
    assert res.returncode == 0 and doc["ok"], doc["problems"]
    assert doc["bytes_corrupted"] == 0 and doc["lost"] == 0 and doc["failed_with_rail_up"] == 0
    r = doc["per_rail"][0]
    assert r["undetected"] == 0 and r["detect_max_s"] < doc["down_s"], r  # detected by the stall timeout
    rules = subprocess.run(["ip", "-n", testbed2.ns("a"), "rule", "list"], capture_output=True, text=True).stdout
    assert "blackhole" not in rules, rules


@needs_ns
def test_chaos_bad_flap_rail_is_a_usage_error(testbed2: Any) -> None:
    res = mr("bench", "local", "--testbed", testbed2.name, "--chaos", "rail-flap", "--flap-rails", "5")
    assert res.returncode == 2 and "--flap-rails [5] not on testbed" in res.stderr and "Traceback" not in res.stderr


@needs_ns
def test_chaos_rail_flap_write(testbed2: Any, tmp_path: Path) -> None:
    res, doc = chaos(testbed2, tmp_path, "--op", "WRITE", "--chaos-duration", "14", "--flap-down-s", "2",
                     "--flap-up-s", "2")
    check_schema(doc)
    assert doc["by_op"]["WRITE"]["completed"] > 0 and doc["flaps"] >= 3
    assert doc["bytes_corrupted"] == 0 and doc["corrupt_transfers"] == 0, doc["corrupt_details"]
    assert doc["lost"] == 0 and doc["failed_with_rail_up"] == 0 and doc["unverified"] == 0
    assert res.returncode == 0 and doc["ok"], doc["problems"]


@needs_ns
def test_chaos_single_rail_failures_are_counted_separately(tmp_path: Path) -> None:
    """With one rail, transfers while it is down must fail (not hang, not corrupt) and are
    counted as failed while no rail was up: the run still passes."""
    from multirail.testbed import Testbed

    tb = Testbed(_tb_name("c1"), rails=1, rate="1gbit")
    try:
        tb.up()
        res, doc = chaos(tb, tmp_path, "--op", "READ", "--chaos-duration", "9", "--flap-down-s", "2",
                         "--flap-up-s", "2", "--chaos-sizes", "1MiB")
    finally:
        tb.down()
    assert doc["flap_rails"] == [0] and doc["flaps"] >= 2
    assert doc["failed"] > 0 and doc["failed_no_rail_up"] == doc["failed"], doc["failure_details"][:3]
    assert all(f["error_type"] == "PeerLostError" for f in doc["failure_details"])
    assert doc["lost"] == 0 and doc["bytes_corrupted"] == 0 and doc["completed"] > 0
    assert res.returncode == 0 and doc["ok"], doc["problems"]
    assert "while no rail was up" in res.stdout


# -- the soak script ----------------------------------------------------------------------------

SOAK = str(Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py")


@pytest.mark.parametrize("args,needle", [(["--minutes", "0"], "must be positive"),
                                         (["--sizes", "4XB"], "invalid size"),
                                         (["--flap-rails", "a"], "rail indices")])
def test_soak_usage_errors(args: list[str], needle: str) -> None:
    res = subprocess.run([ENGINE_PY or sys.executable, SOAK, *args], env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr


@needs_ns
def test_soak_smoke(tmp_path: Path) -> None:
    """15 s of the soak (its own testbed, removed at the end): the growth check runs on both
    processes and the JSON has the samples."""
    out = tmp_path / "soak.json"
    res = subprocess.run([ENGINE_PY or sys.executable, SOAK, "--minutes", "0.25", "--op", "READ", "--sample-s", "0.5",
                          "--json", str(out)], env=ENV, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr
    doc = json.loads(out.read_text())
    assert res.returncode == 0 and doc["ok"], (doc["problems"], res.stdout[-2000:])
    assert doc["chaos"]["bytes_corrupted"] == 0 and doc["chaos"]["lost"] == 0 and doc["chaos"]["flaps"] >= 2
    for name in ("target", "initiator"):
        g = doc["growth"][name]
        assert g["problems"] == [] and g["early_n"] >= 3 and g["late_n"] >= 3, g
        assert {"rss_kib", "fds", "threads"} <= set(g)
        assert len(doc["chaos"]["resources"]["processes"][name]["samples"]) >= 10
    assert not any(doc["testbed"] in ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                                  text=True).stdout.split())
    assert "soak: OK" in res.stdout
