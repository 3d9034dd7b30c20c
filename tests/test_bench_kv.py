"""Tests of `multirail bench kv` (issue 13): model size math, page shuffling and descriptor
formation, consistency checking (a wrong mapping is caught), CLI errors (exit 2, no traceback),
small end-to-end runs on loopback (local and two-process "two-host" mode), NIXL when installed,
plots when matplotlib is installed, and a testbed run when network namespaces are available.
No timing assertions: this runs on a loaded 2-core machine."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from multirail.bench.core import UsageError, pattern
from multirail.bench.kv import PagePool, make_plan, page_patterns, verify_pages, verify_range
from multirail.bench.kvmodels import load_model, parse_model
from multirail.bench.progress import PlainLines, Silent, make_progress

from conftest import ENV, engine_python, netns_unavailable  # noqa: E402

ENGINE_PY = engine_python()
needs_engine = pytest.mark.skipif(ENGINE_PY is None, reason="multirail._core (the engine extension) is not built")

TINY = """\
name: tiny
attention: gqa
layers: 4
kv_heads: 2
head_dim: 64
dtype: bf16
"""


def kv(*args: str, timeout: float = 120, py: str | None = None,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # A generous stall timeout: a loaded 2-core machine (a build next door) can starve a rail for 0.5 s.
    stall = [] if "--listen" in args else ["--stall-timeout", "3"]
    return subprocess.run([py or ENGINE_PY or sys.executable, "-m", "multirail", "bench", "kv", *args, *stall],
                          env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tiny(tmp_path: Path) -> str:
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY)
    return str(p)


# -- model size math ----------------------------------------------------------------------------------

@pytest.mark.parametrize("model,tp,per_token_layer", [
    ("llama-3.1-8b", 1, 2 * 8 * 128 * 2),      # 4096
    ("llama-3.1-8b", 8, 2 * 1 * 128 * 2),      # 512: one KV head per rank
    ("llama-3.1-70b", 1, 4096),
    ("llama-3.1-70b", 8, 512),
    ("llama-3.1-70b", 16, 512),                # heads replicated: still one per rank
    ("deepseek-r1", 1, (512 + 64) * 2),        # 1152: MLA latent, not split by TP
    ("deepseek-r1", 8, 1152),
    ("llama-3.1-405b", 8, 512),
])
def test_bytes_per_token_layer(model: str, tp: int, per_token_layer: int) -> None:
    assert load_model(model).bytes_per_token_layer(tp) == per_token_layer


def test_bundled_shapes_and_aliases() -> None:
    m8, m70, ds = load_model("llama-3.1-8b"), load_model("Llama-3.1-70B"), load_model("deepseek-ai/DeepSeek-R1")
    assert (m8.layers, m8.kv_heads, m8.head_dim, m8.dtype_bytes) == (32, 8, 128, 2)
    assert (m70.layers, m70.kv_heads, m70.head_dim) == (80, 8, 128)
    assert (ds.attention, ds.layers, ds.kv_lora_rank, ds.qk_rope_head_dim) == ("mla", 61, 512, 64)
    assert load_model("meta-llama/Llama-3.1-70B").name == "Llama-3.1-70B"


def test_request_geometry() -> None:
    p = make_plan("llama-3.1-70b", isl=4096, page_tokens=16, tp=1)
    assert p.page_bytes == 16 * 4096 == 65536
    assert p.pages == 256 and p.descs_per_request == 256 * 80
    assert p.request_bytes == 80 * 4096 * 4096  # layers x tokens x bytes per token per layer
    assert p.pool_pages == 2 * 256
    p8 = make_plan("llama-3.1-70b", isl=4097, page_tokens=16, tp=8)
    assert p8.pages == 257 and p8.page_bytes == 16 * 512  # the last page is partly filled, moved whole
    ds = make_plan("deepseek-r1", isl=1000, page_tokens=64, tp=8, concurrency=3)
    assert ds.page_bytes == 64 * 1152 and ds.pages == 16 and ds.pool_pages == 2 * 3 * 16


@pytest.mark.parametrize("kwargs,needle", [
    (dict(model="no-such-model", isl=16), "unknown model"),
    (dict(model="llama-3.1-70b", isl=0), "--isl"),
    (dict(model="llama-3.1-70b", isl=16, tp=3), "does not divide"),
    (dict(model="llama-3.1-70b", isl=16, tp=12), "not a multiple"),
    (dict(model="llama-3.1-70b", isl=16, tp=0), "--tp"),
    (dict(model="llama-3.1-70b", isl=16, page_tokens=0), "--page-tokens"),
    (dict(model="llama-3.1-70b", isl=160, pool_pages=5), "--pool-pages"),
    (dict(model="llama-3.1-70b", isl=16, layout="ragged"), "--layout"),
])
def test_plan_errors(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        make_plan(**kwargs)


@pytest.mark.parametrize("text,needle", [
    ("name: [unclosed", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping"),
    ("attention: gqa\nlayers: 4\nkv_heads: 2\n", "'head_dim' must be a positive integer"),
    ("attention: gqa\nlayers: 0\nkv_heads: 2\nhead_dim: 64\n", "'layers'"),
    ("attention: sliding\nlayers: 4\n", "'attention' must be one of"),
    ("attention: mla\nlayers: 4\nkv_lora_rank: 512\nqk_rope_head_dim: 64\ndtype: fp4\n", "unknown dtype"),
])
def test_bad_model_files(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "m.yaml"
    p.write_text(text)
    with pytest.raises(UsageError, match=needle):
        load_model(str(p))


def test_custom_model_file(tiny: str) -> None:
    m = load_model(tiny)
    assert m.name == "tiny" and m.bytes_per_token_layer(1) == 2 * 2 * 64 * 2
    assert m.bytes_per_token_layer(2) == 2 * 1 * 64 * 2
    mla = parse_model({"attention": "mla", "layers": 3, "kv_lora_rank": 8, "qk_rope_head_dim": 8,
                       "dtype": "fp8"}, "x.yaml")
    assert mla.bytes_per_token_layer(4) == 16


# -- pages, descriptors, consistency ----------------------------------------------------------------

def test_page_pool_is_shuffled_and_recycles() -> None:
    pool = PagePool(64, np.random.default_rng(1))
    a = pool.alloc(32)
    assert len(set(a.tolist())) == 32 and a.tolist() != sorted(a.tolist())  # shuffled, distinct
    b = pool.alloc(32)
    assert not set(a.tolist()) & set(b.tolist())
    with pytest.raises(Exception, match="exhausted"):
        pool.alloc(1)
    pool.release(a)
    assert sorted(pool.alloc(32).tolist()) == sorted(a.tolist())


@pytest.mark.parametrize("layout", ["layer", "block"])
def test_offsets_and_rows(layout: str, tiny: str) -> None:
    p = make_plan(tiny, isl=64, page_tokens=16, layout=layout, pool_pages=10)
    pb = p.page_bytes
    assert pb == 16 * 512
    ids = np.array([7, 2, 9, 0])
    rows = p.rows(1000, ids, dev=3)
    assert rows.shape == (p.layers, 4, 3) and rows.dtype == np.uint64
    for layer in range(p.layers):
        for i, page in enumerate(ids):
            want = (layer * 10 + page) * pb if layout == "layer" else (page * p.layers + layer) * pb
            assert int(rows[layer, i, 0]) == 1000 + want
    assert (rows[:, :, 1] == pb).all() and (rows[:, :, 2] == 3).all()
    # every (layer, page) of the pool has its own place, inside the pool
    every = p.offsets(np.arange(p.layers, dtype=np.uint64)[:, None], np.arange(10)[None, :]).ravel()
    assert len(set(every.tolist())) == p.layers * 10 and int(every.max()) + pb == p.pool_bytes


def test_page_patterns_match_core_pattern() -> None:
    offs = np.array([0, 8192, 40960, 123 * 8], dtype=np.uint64)
    got = page_patterns(77, offs, 4096)
    for i, o in enumerate(offs):
        assert np.array_equal(got[i], pattern(77, int(o), 4096))
    odd = page_patterns(77, np.array([3, 100]), 20)  # not word aligned: the slow path
    assert np.array_equal(odd[0], pattern(77, 3, 20)) and np.array_equal(odd[1], pattern(77, 100, 20))


def _copy_like_the_engine(src_buf: np.ndarray, dst_buf: np.ndarray, lrows: np.ndarray, rrows: np.ndarray) -> None:
    s0, d0 = src_buf.ctypes.data, dst_buf.ctypes.data
    for (la, n, _), (ra, _, _) in zip(lrows.reshape(-1, 3), rrows.reshape(-1, 3)):
        dst_buf[int(ra) - d0:int(ra) - d0 + int(n)] = src_buf[int(la) - s0:int(la) - s0 + int(n)]


@pytest.mark.parametrize("layout", ["layer", "block"])
def test_pages_land_where_they_should_and_a_wrong_mapping_is_caught(layout: str, tiny: str) -> None:
    p = make_plan(tiny, isl=80, page_tokens=16, layout=layout)
    rng = np.random.default_rng(3)
    sp, dp = PagePool(p.pool_pages, rng), PagePool(p.pool_pages, rng)
    src_buf = np.empty(p.pool_bytes, np.uint8)
    for off in range(0, p.pool_bytes, 1 << 16):
        src_buf[off:off + (1 << 16)] = pattern(5, off, min(1 << 16, p.pool_bytes - off))
    dst_buf = np.zeros(p.pool_bytes, np.uint8)
    src, dst = sp.alloc(p.pages), dp.alloc(p.pages)
    lrows, rrows = p.rows(src_buf.ctypes.data, src), p.rows(dst_buf.ctypes.data, dst)
    _copy_like_the_engine(src_buf, dst_buf, lrows, rrows)
    assert verify_pages(p, dst_buf, 5, src, dst) == (0, None)
    assert not dst_buf.any()  # verified pages are zeroed: stale data cannot pass a later check
    # the same request with two decode pages of layer 2 swapped in the descriptors
    rrows[2, [0, 1]] = rrows[2, [1, 0]]
    _copy_like_the_engine(src_buf, dst_buf, lrows, rrows)
    bad, first = verify_pages(p, dst_buf, 5, src, dst)
    assert bad == 2 and first is not None
    # a page that never arrived
    _copy_like_the_engine(src_buf, dst_buf, lrows[:, 1:], p.rows(dst_buf.ctypes.data, dst)[:, 1:])
    assert verify_pages(p, dst_buf, 5, src, dst)[0] == p.layers


def test_verify_range() -> None:
    buf = np.zeros(1 << 16, np.uint8)
    buf[4096:4096 + 8192] = pattern(9, 100, 8192)
    assert verify_range(buf, 9, 100, 4096, 8192) == (0, None)
    buf[4096:4096 + 8192] = pattern(9, 100, 8192)
    buf[5000] ^= 1
    assert verify_range(buf, 9, 100, 4096, 8192) == (1, 5000)


# -- progress ----------------------------------------------------------------------------------------

def test_progress_kinds() -> None:
    assert isinstance(make_progress(enabled=False), Silent)
    s = io.StringIO()
    prog = make_progress(enabled=True, total=3, desc="x", stream=s)
    assert isinstance(prog, PlainLines)  # not a terminal
    prog.advance(1, "a")
    prog.update("b")
    prog.clear()
    assert s.getvalue() == ""  # nothing for a run shorter than the interval
    fast = PlainLines(s, total=2, desc="kv", interval_s=0.0)
    fast.advance(1, "contiguous")
    assert "kv 1/2 contiguous" in s.getvalue()


def test_plot_without_matplotlib_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from multirail.bench import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError, match=r"pip install 'multirail\[plot\]'"):
        plot.require_matplotlib()


# -- CLI ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--model", "gpt-17", "--isl", "128"], "unknown model 'gpt-17'"),
    (["--model", "llama-3.1-70b", "--isl", "0"], "--isl must be at least 1"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--tp", "3"], "does not divide"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--requests", "0"], "--requests"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--initiator-seg-type", "HBM"], "invalid choice: 'HBM'"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--total-buffer-size", "1GiB"], "does not apply"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--listen", "127.0.0.1:0", "--connect", "127.0.0.1:1"],
     "exclude each other"),
    (["--model", "/nonexistent/m.yaml", "--isl", "128"], "does not exist"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--rounds", "0"], "--rounds must be >= 1"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--rounds", "2", "--target-seg-type", "VRAM"],
     "--rounds > 1 needs DRAM"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--nixl-backend", "GDS"], "invalid choice: 'GDS'"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--nixl-backend", "UCX", "--no-nixl"], "exclude each other"),
    (["--model", "llama-3.1-70b", "--isl", "128", "--nixl-backend", "MULTIRAIL", "--connect", "127.0.0.1:1"],
     "does not combine with --listen/--connect"),
])
def test_cli_usage_errors(args: list[str], needle: str) -> None:
    res = kv(*args, py=sys.executable)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("extra,rounds", [
    ([], 20),                                           # DRAM, concurrency 1: a segment per request (20 by default)
    (["--requests", "12", "--concurrency", "4"], 3),    # segments of `concurrency` requests
    (["--requests", "3", "--concurrency", "8"], 1),
    (["--target-seg-type", "VRAM"], 1),                 # staging is measured per workload phase
    (["--initiator-seg-type", "VRAM"], 1),
    (["--rounds", "4"], 4),
])
def test_rounds_default_alternates_the_workloads_as_finely_as_the_concurrency_allows(
        extra: list[str], rounds: int) -> None:
    from multirail.bench.kv import plan_from_args
    from multirail.cli import build_parser

    args = build_parser().parse_args(["bench", "kv", "--model", "llama-3.1-8b", "--isl", "64", *extra])
    plan_from_args(args)
    assert args.rounds == rounds


def _row(workload: str, lat_ms: list[float]) -> Any:
    from multirail.bench.kv import KvRow

    secs = sum(lat_ms) / 1e3
    n, size = len(lat_ms), 1 << 30
    return KvRow(worker=f"multirail {workload}", workload=workload, requests=n, concurrency=1, request_bytes=size,
                 total_bytes=n * size, seconds=secs, gbps=n * size * 8 / secs / 1e9, gb_per_s=n * size / secs / 1e9,
                 lat_avg_us=1e3 * secs / n, lat_p50_us=1e3 * sorted(lat_ms)[n // 2], lat_p99_us=1e3 * max(lat_ms),
                 lat_min_us=1e3 * min(lat_ms), lat_max_us=1e3 * max(lat_ms), latencies_us=[1e3 * x for x in lat_ms],
                 rounds=n)


def test_the_ratio_comes_with_the_interval_its_requests_spread_allows() -> None:
    from multirail.bench.kv import ratio_interval, summary

    # Steady requests: the ratio is what it is.
    s = summary([_row("contiguous", [300.0] * 10), _row("kv", [330.0] * 10)])
    assert s["ratio_to_contiguous"] == pytest.approx(300 / 330)
    assert s["ratio_to_contiguous_interval"] == pytest.approx([300 / 330] * 2)
    assert "90% interval from the requests' spread 90.9-90.9%" in s["contiguous_text"]
    # One kv request twice as long as the rest (a slow stretch of a shared host): the ratio
    # drops ~9%, and the interval reaches back above where the other nine put it.
    kv = [300.0] * 9 + [600.0]
    s = summary([_row("contiguous", [300.0] * 10), _row("kv", kv)])
    lo, hi = s["ratio_to_contiguous_interval"]
    assert lo < s["ratio_to_contiguous"] < hi
    assert s["ratio_to_contiguous"] == pytest.approx(3000 / 3300) and hi == pytest.approx(1.0)
    assert lo < 0.85
    # Seeded: the same requests give the same interval.
    assert ratio_interval(0.9, kv, [300.0] * 10) == ratio_interval(0.9, kv, [300.0] * 10)
    # Too few requests to say: no interval, and the text does not claim one.
    s = summary([_row("contiguous", [300.0] * 4), _row("kv", [330.0] * 4)])
    assert s["ratio_to_contiguous_interval"] is None and "interval" not in s["contiguous_text"]


def test_a_run_whose_rails_failed_over_says_so() -> None:
    from multirail.bench.kv import rail_event_notes

    quiet, stalled = _row("contiguous", [300.0] * 10), _row("kv", [300.0] * 10)
    quiet.rail_events = {"stalls": 0, "times_down": 0, "readmissions": 0, "reissued": 0}
    stalled.rail_events = {"stalls": 1, "times_down": 1, "readmissions": 1, "reissued": 3}
    assert rail_event_notes([quiet, stalled]) == [
        "multirail kv: the engine's failure handling ran during the timed requests (stalls 1, times_down 1, "
        "readmissions 1, reissued 3; rail_stats)"]
    assert rail_event_notes([quiet, _row("kv", [300.0] * 10)]) == []


def test_cli_bad_yaml(tmp_path: Path) -> None:
    p = tmp_path / "broken.yaml"
    p.write_text("layers: [80\n")
    res = kv("--model", str(p), "--isl", "128", py=sys.executable)
    assert res.returncode == 2 and "not valid YAML" in res.stderr and "Traceback" not in res.stderr


# -- end to end (engine) ----------------------------------------------------------------------------

def _doc(res: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert res.stdout.lstrip().startswith("{"), f"stdout is not pure JSON: {res.stdout[:300]!r} {res.stderr[-800:]}"
    return dict(json.loads(res.stdout))


@needs_engine
def test_local_kv_run_json(tiny: str) -> None:
    res = kv("--model", tiny, "--isl", "100", "--requests", "4", "--check-consistency", "--no-nixl", "--json", "-")
    assert res.returncode == 0, res.stderr[-1500:]
    doc = _doc(res)
    assert doc["consistency"] == "ok"
    assert doc["kv"]["pages_per_layer"] == 7 and doc["kv"]["descs_per_request"] == 28
    rows = {r["worker"]: r for r in doc["rows"]}
    k, c = rows["multirail kv"], rows["multirail contiguous"]
    for r in (k, c):
        assert r["requests"] == 4 and r["consistency"] == "ok"
        assert r["gbps"] > 0 and 0 < r["lat_p50_us"] <= r["lat_p99_us"]
        assert r["decode_lat_p50_us"] is not None and len(r["latencies_us"]) == 4
        assert r["total_bytes"] == 4 * doc["kv"]["request_bytes"]
    assert k["transfers"] == 4 * 4 and k["descs"] == 4 * 28 and k["descs_per_s"] > 0
    assert k["prep_descs_per_s"] > 0 and k["post_descs_per_s"] > 0
    assert c["transfers"] == 4
    assert doc["ratio_to_contiguous"] == pytest.approx(k["gbps"] / c["gbps"])
    # The engine's failure handling is tallied over the timed requests: none on a healthy loopback.
    for r in (k, c):
        assert r["rail_events"] == {"stalls": 0, "times_down": 0, "readmissions": 0, "reissued": 0}, r["rail_events"]
    assert "failure handling" not in res.stderr
    assert doc["descs_per_s"] == k["descs_per_s"] and doc["lat_p50_us"] == k["lat_p50_us"]
    assert doc["clock"]["same_clock"] is True
    assert "kv / contiguous" in res.stderr  # the table went to stderr


@needs_engine
@pytest.mark.parametrize("extra", [["--layout", "block"], ["--prep", "reuse"], ["--concurrency", "2"],
                                   ["--tp", "2", "--page-tokens", "8"]])
def test_local_kv_variants_check(tiny: str, extra: list[str]) -> None:
    res = kv("--model", tiny, "--isl", "64", "--requests", "3", "--check-consistency", "--no-nixl",
             "--json", "-", *extra)
    assert res.returncode == 0, res.stderr[-1500:]
    doc = _doc(res)
    assert doc["consistency"] == "ok"
    k = next(r for r in doc["rows"] if r["worker"] == "multirail kv")
    assert k["requests"] == 3 and k["consistency"] == "ok"
    if "--prep" in extra:
        assert k["prep"] == "reuse" and k["prep_s"] == 0 and k["post_descs_per_s"] > 0


@needs_engine
def test_local_kv_rounds_interleave_the_workloads(tiny: str) -> None:
    # 5 timed requests per workload in 3 rounds (2 + 2 + 1, alternating which workload goes
    # first): every request counted once, byte-checked, and the rail counters summed over the
    # rounds
    res = kv("--model", tiny, "--isl", "100", "--requests", "5", "--rounds", "3", "--check-consistency",
             "--no-nixl", "--json", "-")
    assert res.returncode == 0, res.stderr[-1500:]
    doc = _doc(res)
    assert doc["consistency"] == "ok"
    rows = {r["worker"]: r for r in doc["rows"]}
    k, c = rows["multirail kv"], rows["multirail contiguous"]
    for r in (k, c):
        assert r["requests"] == 5 and r["rounds"] == 3 and len(r["latencies_us"]) == 5
        assert r["total_bytes"] == 5 * doc["kv"]["request_bytes"] and r["consistency"] == "ok"
        assert r["engine_rails"] and sum(x["bytes"] for x in r["engine_rails"]) >= r["total_bytes"]
    assert k["transfers"] == 5 * 4 and k["descs"] == 5 * 28 and c["transfers"] == 5
    assert doc["ratio_to_contiguous"] == pytest.approx(k["gbps"] / c["gbps"])
    assert "measured in 3 interleaved rounds" in res.stderr


@needs_engine
def test_wrong_mapping_fails_the_check(tiny: str) -> None:
    res = kv("--model", tiny, "--isl", "64", "--requests", "2", "--check-consistency", "--no-nixl",
             "--corrupt-mapping", "--json", "-")
    assert res.returncode == 1, res.stderr[-1500:]
    doc = _doc(res)
    assert doc["consistency"] == "FAILED"
    k = next(r for r in doc["rows"] if r["worker"] == "multirail kv")
    assert k["consistency"].startswith("FAILED") and "2 page(s)" in k["consistency"]
    assert "consistency check FAILED" in res.stderr and "Traceback" not in res.stderr


@needs_engine
def test_two_host_mode_on_loopback(tiny: str) -> None:
    """`--listen` and `--connect` as two processes (the two-host mode); the clock offset is
    estimated, not assumed."""
    from multirail.bench.target import launch, stop

    assert ENGINE_PY is not None
    common = ["--model", tiny, "--isl", "64", "--requests", "2"]
    proc, ready, errf = launch([ENGINE_PY, "-m", "multirail", "bench", "kv", "--listen", "127.0.0.1:0",
                                "--idle-timeout", "60", *common], env=ENV)
    try:
        res = kv("--connect", f"127.0.0.1:{ready['port']}", *common, "--check-consistency", "--json", "-")
    finally:
        stop(proc)
        errf.close()
    assert res.returncode == 0, res.stderr[-1500:]
    doc = _doc(res)
    assert doc["consistency"] == "ok" and doc["clock"]["same_clock"] is False
    assert doc["clock"]["err_us"] is not None
    assert [r["worker"] for r in doc["rows"]] == ["multirail contiguous", "multirail kv"]


@needs_engine
def test_connect_to_a_too_small_pool_says_so(tiny: str) -> None:
    from multirail.bench.target import launch, stop

    assert ENGINE_PY is not None
    proc, ready, errf = launch([ENGINE_PY, "-m", "multirail", "bench", "kv", "--listen", "127.0.0.1:0",
                                "--idle-timeout", "60", "--model", tiny, "--isl", "16"], env=ENV)
    try:
        res = kv("--connect", f"127.0.0.1:{ready['port']}", "--model", tiny, "--isl", "4096", "--requests", "1")
    finally:
        stop(proc)
        errf.close()
    assert res.returncode == 1 and "pool is" in res.stderr and "--listen" in res.stderr
    assert "Traceback" not in res.stderr


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@needs_engine
@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib is not installed (pip install 'multirail[plot]')")
def test_plots(tiny: str, tmp_path: Path) -> None:
    png = tmp_path / "kv.png"
    res = kv("--model", tiny, "--isl", "64", "--requests", "3", "--no-nixl", "--plot", str(png))
    assert res.returncode == 0, res.stderr[-1500:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = tmp_path / "sweep.png"
    res = subprocess.run([ENGINE_PY or sys.executable, "-m", "multirail", "bench", "local", "--start-block-size", "4KiB",
                          "--max-block-size", "64KiB", "--num-iter", "5", "--warmup-iter", "1", "--plot", str(sweep),
                          "--json", "-"], env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-1500:]
    assert sweep.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(json.loads(res.stdout)) >= {"rows", "baselines", "ratios", "problems", "config"}


def _nixl() -> bool:
    from multirail.bench.nixl_latency import nixl_available

    return ENGINE_PY is not None and nixl_available(ENGINE_PY)


@pytest.mark.skipif(not _nixl(), reason="NIXL is not installed (pip install nixl-cu12); CI does not install it")
def test_nixl_kv_row(tiny: str) -> None:
    res = kv("--model", tiny, "--isl", "64", "--requests", "3", "--json", "-", timeout=240)
    assert res.returncode == 0, res.stderr[-1500:]
    doc = _doc(res)
    nixl = next(r for r in doc["rows"] if r["worker"].startswith("nixl"))
    assert nixl["requests"] == 3 and nixl["gbps"] > 0 and nixl["descs"] == 3 * 16
    assert doc["ratio_to_nixl"] is not None


def _why_no_nixl_plugin() -> str | None:
    if not _nixl():
        return "NIXL is not installed (pip install nixl-cu12)"
    from multirail.nixl_plugin import PluginError, plugin_path

    try:
        plugin_path()
    except PluginError as e:
        return str(e)
    return None


needs_nixl_plugin = pytest.mark.skipif(_why_no_nixl_plugin() is not None, reason=_why_no_nixl_plugin() or "")


@pytest.fixture
def plugin_env(tmp_path: Path) -> dict[str, str]:
    """NIXL_PLUGIN_DIR: a `multirail nixl-plugin dir` directory of this test's own (the default one
    in ~/.cache is shared with other checkouts)."""
    from multirail.nixl_plugin import make_dir

    return {"NIXL_PLUGIN_DIR": str(make_dir(tmp_path / "plugins"))}


@needs_nixl_plugin
def test_nixl_kv_backends_byte_checked(tiny: str, plugin_env: dict[str, str]) -> None:
    """`--nixl-backend MULTIRAIL --nixl-backend UCX`: the kv workload through NIXL's own agent with
    each backend (MULTIRAIL from a `multirail nixl-plugin dir` directory), every page of every
    request verified by the decode side."""
    res = kv("--model", tiny, "--isl", "64", "--requests", "3", "--concurrency", "2", "--check-consistency",
             "--nixl-backend", "MULTIRAIL", "--nixl-backend", "UCX", "--json", "-", timeout=300, env=plugin_env)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = _doc(res)
    assert doc["consistency"] == "ok", doc["rows"]
    rows = {r["worker"]: r for r in doc["rows"]}
    assert {"multirail kv", "nixl-multirail kv", "nixl-ucx(tcp) kv"} <= set(rows)
    for w in ("nixl-multirail kv", "nixl-ucx(tcp) kv"):
        r = rows[w]
        assert r["consistency"] == "ok" and r["requests"] == 3 and r["descs"] == 3 * 16 and r["gbps"] > 0
        assert r["rails"] and r["rails"][0]["name"] == "lo" and r["rails"][0]["bytes"] >= 3 * 16 * 2048
    assert doc["nixl_multirail_to_native"] and doc["ratio_to_nixl"]
    assert "NIXL+MULTIRAIL kv / multirail kv" in res.stderr


@needs_nixl_plugin
def test_nixl_kv_check_catches_a_wrong_mapping(tiny: str, plugin_env: dict[str, str]) -> None:
    """The NIXL run's byte check is real: a request announced with the wrong decode pages fails."""
    res = kv("--model", tiny, "--isl", "64", "--requests", "2", "--check-consistency", "--corrupt-mapping",
             "--nixl-backend", "MULTIRAIL", "--json", "-", timeout=300, env=plugin_env)
    assert res.returncode == 1, res.stderr[-1500:]
    doc = _doc(res)
    r = next(r for r in doc["rows"] if r["worker"] == "nixl-multirail kv")
    assert r["consistency"].startswith("FAILED") and "bad pages" in r["consistency"]
    assert "Traceback" not in res.stderr


@needs_nixl_plugin
def test_nixl_kv_named_backend_that_cannot_load_fails(tiny: str, tmp_path: Path) -> None:
    """A backend named with --nixl-backend that NIXL cannot create is an error, not a skipped row."""
    empty = tmp_path / "no-plugins"
    empty.mkdir()
    res = kv("--model", tiny, "--isl", "64", "--requests", "1", "--nixl-backend", "MULTIRAIL", "--json", "-",
             timeout=300, env={"NIXL_PLUGIN_DIR": str(empty)})
    assert res.returncode != 0 and "MULTIRAIL" in res.stderr and "Traceback" not in res.stderr, res.stderr[-1500:]


# -- testbed (root, network namespaces) ---------------------------------------------------------------

def _why_no_testbed() -> str | None:
    if ENGINE_PY is None:
        return "the engine extension is not built"
    return netns_unavailable()


@pytest.fixture
def testbed() -> Iterator[Any]:
    from multirail.testbed import Testbed

    tb = Testbed(f"kv{uuid.uuid4().hex[:6]}", rails=2, rate="1gbit")
    with tb:
        yield tb


@pytest.mark.root
@pytest.mark.skipif(_why_no_testbed() is not None, reason=_why_no_testbed() or "")
def test_testbed_kv_stripes_and_checks(testbed: Any) -> None:
    res = kv("--testbed", testbed.name, "--model", "llama-3.1-8b", "--isl", "256", "--requests", "3",
             "--rounds", "2", "--check-consistency", "--no-nixl", "--json", "-", timeout=240)
    assert res.returncode == 0, res.stderr[-1500:]
    doc = _doc(res)
    assert doc["consistency"] == "ok" and doc["testbed"]["name"] == testbed.name
    k = next(r for r in doc["rows"] if r["worker"] == "multirail kv")
    assert [r["name"] for r in k["rails"]] == [r.devs["b"] for r in testbed.rails]
    assert all(r["bytes"] > 0 for r in k["rails"])  # both rails carried pages
    assert k["capacity_gbps"] == pytest.approx(2.0) and k["pct_of_capacity"] is not None
    # --rounds reached the prefill process in namespace b: 3 requests in 2 interleaved rounds
    assert k["rounds"] == 2 and k["requests"] == 3


@pytest.mark.root
@pytest.mark.skipif((_why_no_testbed() or _why_no_nixl_plugin()) is not None,
                    reason=_why_no_testbed() or _why_no_nixl_plugin() or "")
def test_testbed_nixl_multirail_kv_stripes(testbed: Any, plugin_env: dict[str, str]) -> None:
    """`bench kv --testbed --nixl-backend MULTIRAIL`: NIXL's agent with the MULTIRAIL backend over
    both rails (MULTIRAIL_RAILS from the testbed), byte-checked, each rail's NIC counter moving."""
    res = kv("--testbed", testbed.name, "--model", "llama-3.1-8b", "--isl", "256", "--requests", "3",
             "--check-consistency", "--nixl-backend", "MULTIRAIL", "--json", "-", timeout=300, env=plugin_env)
    assert res.returncode == 0, res.stderr[-1500:]
    doc = _doc(res)
    r = next(r for r in doc["rows"] if r["worker"] == "nixl-multirail kv")
    assert r["consistency"] == "ok" and r["requests"] == 3
    assert [x["name"] for x in r["rails"]] == [x.devs["b"] for x in testbed.rails]
    total = sum(x["bytes"] for x in r["rails"])
    assert all(x["bytes"] > 0.2 * total for x in r["rails"]), r["rails"]  # striped over both
