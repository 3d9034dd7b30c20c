"""`multirail bench` with GPU memory (issue 10 item 6), on the stand-in GPU (host memory posing
as a GPU; MULTIRAIL_STANDIN_RATE paces its copies so the stages are measurable):
`--initiator-seg-type/--target-seg-type DRAM|VRAM` in every combination that stages, READ and
WRITE, with --check-consistency passing and a deliberately corrupted run still caught; the
per-stage breakdown (D2H / wire / H2D of each side) in JSON and text; the seg types, GPU and each
rail's gpu_path in the result; ucx + VRAM staged over the same rails; bad seg types refused. Fast (~20 s).

With an engine that has CUDA IPC between same-host agents (AgentConfig.gpu_ipc), a transfer to
the peer's VRAM is a device copy rather than staged: the staging runs pass `--gpu-ipc off`, and
one run checks what the bench reports with IPC on."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from conftest import ENV, engine_python  # noqa: E402

# UCX sessions need a shared secret (issue 33): every bench run here gets one, both sides.
ENV = {**ENV, "MULTIRAIL_SECRET": "bench-gpu-tests"}

RUNNER = ("import argparse, sys; from multirail import bench; p = argparse.ArgumentParser(prog='multirail'); "
          "s = p.add_subparsers(); bench.register(s); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
ENGINE_PY = engine_python()
needs_engine = pytest.mark.skipif(ENGINE_PY is None, reason="multirail._core (the engine extension) is not built")
GPU_ENV = {**ENV, "MULTIRAIL_STANDIN_RATE": "2e9"}
GPU_ENV.pop("MULTIRAIL_TRANSPORT", None)  # these runs are about tcp staging


def _has_gpu_ipc() -> bool:
    if ENGINE_PY is None:
        return False
    cp = subprocess.run([ENGINE_PY, "-c", "import multirail; print('gpu_ipc' in multirail.AgentConfig.__dataclass_fields__)"],
                        env=ENV, capture_output=True, text=True, timeout=60)
    return cp.stdout.strip() == "True"


HAS_IPC = _has_gpu_ipc()
STAGED = ["--gpu-ipc", "off"] if HAS_IPC else []  # same host: stage over the rails, not CUDA IPC
BASE = ["--start-block-size", "256KiB", "--max-block-size", "512KiB", "--num-iter", "4", "--warmup-iter", "1",
        "--timeout", "20", "--gpu", "standin"]
SWEEP = BASE + STAGED
STAGES = ("d2h", "wire", "h2d")


def bench(*args: str, py: str | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([py or sys.executable, "-c", RUNNER, "bench", *args], env=GPU_ENV,
                          capture_output=True, text=True, timeout=timeout)


def target_state(proc: subprocess.Popen[str], errf: Any) -> str:
    """For a failure message: whether the `bench target` process still runs, and its stderr."""
    errf.flush()
    errf.seek(0)
    return f"target: exit code {proc.poll()} (None: running); its stderr: {errf.read()[-3000:]!r}"


def used_stages(op: str, side: str, seg: str) -> set[str]:
    """The stages a side must run: its memory is VRAM and it sends (D2H + wire) or receives
    (wire + H2D); DRAM stages nothing."""
    if seg == "DRAM":
        return set()
    sends = (op == "READ") == (side == "target")
    return {"d2h", "wire"} if sends else {"wire", "h2d"}


# -- the sweep: every staged combination, READ and WRITE --------------------------------------------

@needs_engine
@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("iseg,tseg", [("DRAM", "VRAM"), ("VRAM", "VRAM"), ("VRAM", "DRAM")])
def test_sweep_vram_consistent_with_breakdown(op: str, iseg: str, tseg: str) -> None:
    cp = bench("local", "--op", op, "--initiator-seg-type", iseg, "--target-seg-type", tseg, *SWEEP,
               "--check-consistency", "--json", "-", py=ENGINE_PY)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    mem = doc["memory"]
    assert (mem["initiator_seg_type"], mem["target_seg_type"], mem["gpu_kind"]) == (iseg, tseg, "standin"), mem
    for side, seg in (("initiator", iseg), ("target", tseg)):
        g = mem[f"{side}_gpu"]
        if seg == "VRAM":
            assert g["kind"] == "standin" and g["device"] == 0 and "stand-in" in g["name"], mem
        else:
            assert g is None, mem
    rails = doc["transport"]["rails"]
    assert rails and all(r["gpu_path"] == "staged" and r["gpu_path_reason"] for r in rails), rails
    assert [r["block_size"] for r in doc["rows"]] == [256 << 10, 512 << 10]
    for row in doc["rows"]:
        assert row["consistency"] == "ok", row
        st = row["staging"]
        assert st and st["target"] is not None and st["target_note"] is None, st
        assert st["wall_s"] == pytest.approx(row["seconds"])
        best = None
        for side, seg in (("initiator", iseg), ("target", tseg)):
            sd, want = st[side], used_stages(op, side, seg)
            for s in STAGES:
                x = sd[s]
                # % busy is busy_s over the loop's wall time: at most 100 % with one connection, give
                # or take the end of the last operation, which the target's thread notes after the
                # initiator already has the bytes (late by a scheduling delay on a loaded host)
                assert x["busy_pct"] >= 0.0 and x["busy_s"] <= 1.05 * row["seconds"] + 0.01, (side, s, x)
                if s in want:
                    assert x["ops"] > 0 and x["bytes"] == row["total_bytes"], (side, s, x, row["total_bytes"])
                    assert x["busy_s"] > 0 and x["us_per_op"] > 0, (side, s, x)
                    assert x["us_per_op"] == pytest.approx(x["busy_s"] / x["ops"] * 1e6)
                    assert x["busy_pct"] == pytest.approx(100 * x["busy_s"] / row["seconds"])
                    if best is None or x["busy_pct"] > best[0]:
                        best = (x["busy_pct"], f"{side} {'wire' if s == 'wire' else s.upper()}")
                else:
                    assert x["ops"] == 0 and x["bytes"] == 0 and x["us_per_op"] is None, (side, s, x)
            assert sd["chunks"] == (row["iterations"] if want else 0), (side, sd)  # one 256/512KiB chunk each
            # the pinned pool: made once per connection and direction (4 x 1 MiB), DRAM sides none
            assert (sd["pool_bytes"], sd["pools"]) == ((4 << 20, 1) if want else (0, 0)), (side, sd)
        assert best is not None and st["bottleneck"] == best[1], st
        assert st["bottleneck_busy_pct"] == pytest.approx(best[0])
    text = cp.stderr  # the table goes to stderr with --json -
    assert f"memory: initiator {iseg}, target {tseg}" in text, text
    assert "gpu path: default=staged" in text and '"stand-in 0 (host memory)"' in text, text
    assert text.count("bottleneck: ") == 2 and text.count("staging initiator") == 2, text
    assert "pool 4MiB in 1 pool(s)" in text, text


@needs_engine
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_corruption_in_vram_is_caught(op: str) -> None:
    """The target flips byte 300000 of its VRAM (after the pattern fill for READ, before
    verifying for WRITE): the check reads VRAM through copies, so it must still see it."""
    cp = bench("local", "--op", op, "--initiator-seg-type", "VRAM", "--target-seg-type", "VRAM",
               "--start-block-size", "64KiB", "--max-block-size", "128KiB", "--batch-size", "4",
               "--num-iter", "3", "--warmup-iter", "1", "--gpu", "standin", "--check-consistency",
               "--corrupt-offset", "300000", "--json", "-", *STAGED, py=ENGINE_PY)
    assert cp.returncode == 1, cp.stderr
    assert "consistency check FAILED" in cp.stderr and "300000" in cp.stderr, cp.stderr
    rows = json.loads(cp.stdout)["rows"]
    assert rows[0]["consistency"] == "ok"  # 64KiB x 4 ends before byte 300000
    assert rows[1]["consistency"].startswith("FAILED") and "300000" in rows[1]["consistency"], rows[1]


@needs_engine
def test_initiator_against_target_process_and_seg_type_mismatch() -> None:
    """initiator/target modes: the target allocates its VRAM itself (its ready line says so), the
    initiator reads the target's stages through bench:stats; an initiator that expects DRAM is
    told what the target serves, and leaves it serving."""
    assert ENGINE_PY is not None
    from multirail.bench.target import launch, stop

    cmd = [ENGINE_PY, "-c", RUNNER, "bench", "target", "--listen", "127.0.0.1:0", "--target-seg-type", "VRAM",
           "--gpu", "standin", "--total-buffer-size", "1MiB", "--idle-timeout", "30", "--duration", "60", *STAGED]
    proc, ready, errf = launch(cmd, env=GPU_ENV)
    try:
        assert ready["seg_type"] == "VRAM" and ready["gpu"]["kind"] == "standin", ready
        at = f"127.0.0.1:{ready['port']}"
        bad = bench("initiator", "--connect", at, "--gpu", "standin", "--start-block-size", "1MiB",
                    "--max-block-size", "1MiB", "--num-iter", "2", *STAGED, py=ENGINE_PY)
        assert bad.returncode == 1, bad.stderr
        assert "the target serves VRAM but --target-seg-type is DRAM" in bad.stderr, bad.stderr
        ok = bench("initiator", "--connect", at, "--target-seg-type", "VRAM", "--gpu", "standin", "--op", "WRITE",
                   "--start-block-size", "1MiB", "--max-block-size", "1MiB", "--num-iter", "3",
                   "--check-consistency", "--json", "-", *STAGED, py=ENGINE_PY)
        assert ok.returncode == 0, f"{ok.stderr}\n{target_state(proc, errf)}"
        (row,) = json.loads(ok.stdout)["rows"]
        assert row["consistency"] == "ok"
        st = row["staging"]
        assert st["initiator"]["wire"]["ops"] == 0 and st["target"]["h2d"]["ops"] > 0, st
        assert st["bottleneck"].startswith("target "), st
        assert proc.wait(timeout=20) == 0  # the second initiator stopped it
    finally:
        stop(proc)
        errf.close()


@needs_engine
def test_target_stages_unreachable_shows_the_initiators_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target that does not answer bench:stats (here: asked under a name it does not know, as an
    older bench target would ignore it): the rows keep the initiator's stages and say why the
    target's are missing; the target is asked once, not per row."""
    pytest.importorskip("multirail._core")
    from multirail.bench import protocol as proto
    from multirail.bench import worker as W
    from multirail.bench.core import Progress
    from multirail.bench.target import launch, stop

    monkeypatch.setenv("MULTIRAIL_STANDIN_RATE", "2e9")
    # The target runs with GPU_ENV's secret; this in-process initiator must hold the same one.
    monkeypatch.setenv("MULTIRAIL_SECRET", GPU_ENV["MULTIRAIL_SECRET"])
    cmd = [ENGINE_PY or sys.executable, "-c", RUNNER, "bench", "target", "--listen", "127.0.0.1:0",
           "--gpu", "standin", "--total-buffer-size", "1MiB", "--idle-timeout", "30", "--duration", "60", *STAGED]
    proc, ready, errf = launch(cmd, env=GPU_ENV)
    monkeypatch.setattr(proto, "STATS", "stats-unknown-to-the-target")
    monkeypatch.setattr(W, "STATS_TIMEOUT_S", 0.5)
    try:
        w = W.EngineWorker(op="READ", target_host="127.0.0.1", target_port=int(ready["port"]),
                           target_name="mr-bench-target", buffer_size=1 << 20, connections=1, rails=None,
                           policy="weighted", chunk_size=1 << 20, timeout=10.0, fill_target=True, gpu="standin",
                           seg_type="VRAM", **({"gpu_ipc": False} if HAS_IPC else {}))
        try:
            rows = W.run_sweep(w, "READ", [256 << 10, 512 << 10], 1, 3, 1, True, None, Progress(False))
        finally:
            w.close()
        assert proc.wait(timeout=20) == 0
    finally:
        stop(proc)
        errf.close()
    assert w._stats_seq == 1  # asked once
    for row in rows:
        st = row.staging
        assert row.consistency == "ok" and st is not None
        assert st["target"] is None and "did not answer bench:stats within 0.5 s" in st["target_note"], st
        assert st["initiator"]["h2d"]["bytes"] == row.total_bytes and st["bottleneck"].startswith("initiator "), st


@needs_engine
def test_kv_vram_to_vram_with_breakdown() -> None:
    cp = bench("kv", "--model", "llama-3.1-8b", "--isl", "32", "--requests", "2", "--warmup-requests", "1",
               "--initiator-seg-type", "VRAM", "--target-seg-type", "VRAM", "--gpu", "standin",
               "--check-consistency", "--no-nixl", "--json", "-", *STAGED, py=ENGINE_PY)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    assert doc["consistency"] == "ok"
    assert doc["memory"]["initiator_seg_type"] == "VRAM" and doc["memory"]["target_seg_type"] == "VRAM"
    assert all(r["gpu_path"] == "staged" for r in doc["transport"]["rails"])
    for row in doc["rows"]:
        st = row["staging"]
        assert st["initiator"]["d2h"]["bytes"] == row["total_bytes"], (row["worker"], st)
        assert st["target"]["h2d"]["bytes"] == row["total_bytes"], (row["worker"], st)
        assert st["initiator"]["h2d"]["ops"] == 0 and st["target"]["d2h"]["ops"] == 0
        assert st["bottleneck"] in ("initiator D2H", "initiator wire", "target wire", "target H2D"), st
    assert "bottleneck: " in cp.stderr and "memory: initiator VRAM, target VRAM" in cp.stderr


@needs_engine
def test_kv_corrupt_mapping_caught_in_vram() -> None:
    cp = bench("kv", "--model", "llama-3.1-8b", "--isl", "32", "--requests", "2", "--warmup-requests", "0",
               "--target-seg-type", "VRAM", "--gpu", "standin", "--check-consistency", "--corrupt-mapping",
               "--no-nixl", *STAGED, py=ENGINE_PY)
    assert cp.returncode == 1, cp.stderr
    assert "consistency check FAILED" in cp.stderr and "page(s) wrong" in cp.stderr, cp.stderr


@needs_engine
@pytest.mark.skipif(not HAS_IPC, reason="this engine has no CUDA IPC between agents (AgentConfig.gpu_ipc)")
def test_same_host_ipc_is_reported() -> None:
    """IPC on (the engine's default): what reaches the target's VRAM by device copy is counted as
    such, not as staging; or, when the engine falls back, it says why and the stages show it."""
    cp = bench("local", "--op", "READ", "--target-seg-type", "VRAM", *BASE, "--check-consistency",
               "--json", "-", py=ENGINE_PY)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    ipc = doc["memory"]["ipc"]
    assert ipc is not None, doc["memory"]
    for row in doc["rows"]:
        assert row["consistency"] == "ok", row
        st = row["staging"]
        if ipc["transfers"]:
            got = st["ipc"]
            assert (got["transfers"], got["bytes"]) == (row["iterations"], row["total_bytes"]), st
            # One contiguous piece per transfer: one copy, queued by one call, and how it went.
            assert got["copies"] == got["copy_calls"] == row["iterations"], st
            assert got["copy_path"].startswith(("one copy call per copy", "cudaMemcpyBatchAsync", "gather-copy kernel")), st
            assert all(st[side][s]["ops"] == 0 for side in ("initiator", "target") for s in STAGES), st
            assert st["bottleneck"] is None, st
        else:
            assert ipc["fallback_reason"], ipc
            assert st["target"]["d2h"]["bytes"] == row["total_bytes"], st
    if ipc["transfers"]:
        assert "CUDA IPC " in cp.stderr and "bottleneck: none" in cp.stderr, cp.stderr
    else:
        assert "CUDA IPC not used: " in cp.stderr, cp.stderr


@needs_engine
def test_vram_on_cuda_without_a_gpu_fails_fast() -> None:
    """--gpu cuda where CUDA cannot open device 0: the engine's GpuError at once, in this process
    (not as the tail of a target that never became ready). Where a GPU is present, it runs."""
    cp = bench("local", "--gpu", "cuda", "--target-seg-type", "VRAM", "--start-block-size", "1MiB",
               "--max-block-size", "1MiB", "--num-iter", "2", "--warmup-iter", "1", "--check-consistency",
               *STAGED, py=ENGINE_PY)
    if cp.returncode == 0:
        assert "memory: initiator DRAM, target VRAM; target GPU: cuda 0" in cp.stdout, cp.stdout
        return
    assert cp.returncode == 1, cp.stderr
    assert "multirail bench: error: GpuError" in cp.stderr and "did not become ready" not in cp.stderr, cp.stderr
    assert "Traceback" not in cp.stderr


# -- refusals (no engine needed: checked before anything starts) -----------------------------------

@needs_engine
def test_ucx_with_vram_stages_over_the_same_rails() -> None:
    """ucx rails take VRAM directly only with GPUDirect RDMA (not here): the engine stages it
    over the same rails through a tcp link, and the result says so per rail."""
    import multirail

    try:
        multirail.Agent("ucx-probe", {"transport": "ucx", "auth_secret": "probe"}).close()
    except multirail.errors.TransportUnavailableError as e:
        pytest.skip(f"UCX cannot be loaded here: {e}")
    cp = bench("local", "--transport", "ucx", "--initiator-seg-type", "VRAM", "--target-seg-type", "VRAM", *SWEEP,
               "--check-consistency", "--json", "-", timeout=120)
    assert cp.returncode == 0, cp.stderr[-1500:]
    doc = json.loads(cp.stdout[cp.stdout.index("{"):])
    assert all(r["consistency"] == "ok" for r in doc["rows"]), doc["rows"]
    rails = doc["transport"]["rails"]
    assert rails and all(r["gpu_path"] == "staged" and "cannot take GPU memory directly" in r["gpu_path_reason"]
                         for r in rails), rails


@pytest.mark.parametrize("opt", ["--initiator-seg-type", "--target-seg-type"])
@pytest.mark.parametrize("mode", [["local"], ["kv", "--model", "llama-3.1-8b", "--isl", "32"]])
def test_bad_seg_type_is_refused(opt: str, mode: list[str]) -> None:
    cp = bench(*mode, opt, "HBM", timeout=60)
    assert cp.returncode == 2, cp.stderr
    assert f"argument {opt}: invalid choice: 'HBM'" in cp.stderr and "'DRAM', 'VRAM'" in cp.stderr, cp.stderr


def test_bad_gpu_kind_is_refused() -> None:
    cp = bench("local", "--gpu", "rocm", "--target-seg-type", "VRAM", timeout=60)
    assert cp.returncode == 2 and "argument --gpu: invalid choice: 'rocm'" in cp.stderr, cp.stderr
    env = {**GPU_ENV, "MULTIRAIL_GPU": "rocm"}
    cp = subprocess.run([sys.executable, "-c", RUNNER, "bench", "local", "--target-seg-type", "VRAM"], env=env,
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "MULTIRAIL_GPU='rocm'" in cp.stderr, cp.stderr


# -- the breakdown itself (pure) -------------------------------------------------------------------

def _tot(d2h: tuple[int, float], wire: tuple[int, float], h2d: tuple[int, float], pools: int = 1) -> dict:
    from multirail.bench import staging

    t = staging.empty()
    for s, (ops, busy) in zip(staging.STAGES, (d2h, wire, h2d)):
        t[s] = {"ops": ops, "bytes": ops * 262144, "busy_s": busy}
    t.update(chunks=sum(x[0] for x in (d2h, wire, h2d)), pool_bytes=pools << 20, pools=pools)
    return t


def test_breakdown_deltas_bottleneck_and_unreachable_target() -> None:
    from multirail.bench import staging

    assert staging.total([{"staging": _tot((1, 0.5), (2, 0.25), (0, 0.0))}, {"name": "no staging"},
                          {"staging": _tot((3, 0.5), (0, 0.0), (0, 0.0))}])["d2h"] == \
        {"ops": 4, "bytes": 4 * 262144, "busy_s": 1.0}
    before = _tot((10, 1.0), (10, 0.1), (0, 0.0))
    after = _tot((30, 1.5), (30, 0.2), (0, 0.0))
    tb, ta = _tot((0, 0.0), (5, 0.1), (5, 0.1)), _tot((0, 0.0), (25, 0.2), (25, 0.9))
    b = staging.breakdown(1.0, (before, after), (tb, ta))
    assert b["initiator"]["d2h"] == {"ops": 20, "bytes": 20 * 262144, "busy_s": 0.5, "us_per_op": 25000.0,
                                     "busy_pct": 50.0}
    assert b["initiator"]["h2d"]["us_per_op"] is None and b["initiator"]["h2d"]["busy_pct"] == 0.0
    assert b["bottleneck"] == "target H2D" and b["bottleneck_busy_pct"] == pytest.approx(80.0)
    lines = staging.format_breakdown(b)
    assert lines[0].split() == ["staging", "initiator", "D2H", "25000.0", "us/op", "50%,", "wire", "5000.0",
                                "us/op", "10%,", "H2D", "-;", "pool", "1MiB", "in", "1", "pool(s)"]
    assert lines[-1].strip() == "bottleneck: target H2D (80% busy)"
    # the target's numbers not reachable: the initiator's stages only, and why
    only = staging.breakdown(1.0, (before, after), None, "the target did not answer bench:stats within 5 s")
    assert only["target"] is None and only["bottleneck"] == "initiator D2H"
    assert "not measured: the target did not answer" in "\n".join(staging.format_breakdown(only))
    # nothing staged in the loop: no bottleneck
    none = staging.breakdown(1.0, (before, before), None)
    assert none["bottleneck"] is None and "bottleneck: none" in staging.format_breakdown(none)[-1]
    assert staging.format_breakdown(None) == []


# -- over emulated rails (network namespaces, tc-shaped veths) --------------------------------------

def _why_no_testbed() -> str | None:
    from conftest import netns_unavailable

    return netns_unavailable()


@needs_engine
@pytest.mark.root
@pytest.mark.skipif(_why_no_testbed() is not None, reason=_why_no_testbed() or "")
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_testbed_vram_to_vram_stripes_over_both_rails(op: str) -> None:
    """VRAM -> VRAM between two processes in two namespaces over 2 shaped rails, staged on both
    sides: byte-exact, and the NICs' own counters show both rails carrying the data."""
    import uuid

    from multirail.testbed import Testbed

    with Testbed(f"gb{uuid.uuid4().hex[:6]}", rails=2, rate="1gbit") as tb:
        cp = bench("local", "--testbed", tb.name, "--op", op, "--initiator-seg-type", "VRAM", "--target-seg-type", "VRAM",
                   "--start-block-size", "8MiB", "--max-block-size", "8MiB", "--num-iter", "3", "--warmup-iter", "1",
                   "--gpu", "standin", *STAGED, "--check-consistency", "--json", "-", timeout=240)
    assert cp.returncode == 0, cp.stderr[-1500:]
    doc = json.loads(cp.stdout[cp.stdout.index("{"):])
    row = doc["rows"][0]
    assert row["consistency"] == "ok", row
    carried = [r["bytes"] for r in row["rails"]]
    assert len(carried) == 2 and min(carried) > 0.3 * sum(carried), row["rails"]
    st = row["staging"]
    moved = 8 * (1 << 20) * 3
    (send, recv) = ("target", "initiator") if op == "READ" else ("initiator", "target")
    assert st[send]["d2h"]["bytes"] >= moved and st[recv]["h2d"]["bytes"] >= moved, st
    assert [r["gpu_path"] for r in doc["transport"]["rails"]] == ["staged", "staged"], doc["transport"]
