"""`multirail bench kv`: KV cache from prefill to decode, page by page, layer by layer.

The workload (docs/bench-kv.md has the whole story):

* A model config (kvmodels.py) gives the KV bytes of one token in one layer on one TP rank;
  a *page* is `--page-tokens` tokens of one layer (K and V together, FlashInfer-style
  `[page][K|V][token][head][dim]`), so `page_bytes = page_tokens x bytes_per_token_layer`.
  A request of `--isl` tokens fills `ceil(isl / page_tokens)` pages in every layer (the last one
  partly; whole pages move, as engines move them).
* Both sides keep a paged pool of `pool_pages` pages per layer (default 2 x concurrency x the
  pages of one request). `--layout layer` (vLLM-style, one KV tensor per layer): layer l's pages
  are one region of the pool, page p of layer l at `(l x pool_pages + p) x page_bytes`.
  `--layout block`: one block holds every layer of a page, layer-major inside,
  page p of layer l at `(p x layers + l) x page_bytes`. Either way one pool is registered per
  side.
* Page ids come from a free list that starts shuffled and gets pages back in completion order,
  as a block manager leaves them: the prefill side picks its pages from its pool, the decode
  side's ids are picked (from its own shuffled free list) by the prefill process on the decode's
  behalf (a real decode would send its block ids; the bench has no reason to pay that round trip).
* Per request, layer by layer: one WRITE per layer with one descriptor per page (local row:
  the prefill page, remote row: the decode page, both `page_bytes` long), carrying a notification
  `bench:kv_layer {"r": request, "l": layer, "n": layers}`; the engine merges rows that happen to
  be contiguous on both sides, which shuffled ids make rare. All layers are posted back to back
  (prefill is modelled as infinitely fast: what remains is the transfer).
* A request is done when decode holds the last layer's notification. Measured two ways:
  `lat_*`: from the start of layer 0's prepare to the moment every layer's WRITE is DONE at the
  prefill side. The engine sends a WRITE's notification only after all its data is acknowledged
  and turns the handle DONE only once the decode agent has acknowledged the notification, so
  this is the moment the prefill side *knows* decode holds every layer's notification.
  `decode_lat_*`: the same start to the moment the decode process's `get_new_notifs` returned
  the last of them (its own clock; on one host, local and testbed, the clocks are the same one;
  across hosts an offset is estimated from `bench:kv_clock` round trips, error = half the best
  round trip, reported). The decode then answers `bench:kv_done` and only then are the request's
  pages returned to the free lists and the slot takes its next request.
* The ceiling, in the same run: the same bytes per request as one contiguous WRITE with one
  notification (`ratio_to_contiguous` = kv Gbps / contiguous Gbps), and, when NIXL is
  importable, the kv workload through NIXL's API (kv_nixl.py).
* Descriptor rate: page descriptors / time spent in `initialize_xfer` + `transfer` calls
  (`--prep fresh`, default: handles are prepared per request and layer, since page ids change with
  every request), or in `transfer` calls only (`--prep reuse`: each concurrency slot keeps its
  pages, handles prepared once per slot and layer and reposted with a new notification, as
  engines with prepped descriptor lists do).

Memory: `--initiator-seg-type` (the prefill pool) and `--target-seg-type` (the decode pool),
DRAM or VRAM (mem.BenchMem on `--device-id`, `--gpu cuda|standin`); with VRAM each row carries
the D2H / wire / H2D staging breakdown of its timed phase (staging.py; the decode side's stages
through `bench:stats`) and the NIXL run is skipped.

Modes, like the rest of bench: `bench kv` (local: a decode process on 127.0.0.1),
`bench kv --testbed [NAME]` (decode in namespace a, prefill in b), and two hosts:
`bench kv --listen HOST:PORT` (decode) with `bench kv --connect HOST:PORT` (prefill), both given
the same model options.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from multirail.bench import staging
from multirail.bench.core import RailRow, args_config, json_clean, write_json, UsageError, format_rails
from multirail.bench.mem import BenchMem, uses_vram
from multirail.bench.staging import format_breakdown
from multirail.bench.worker import BenchFailure

from multirail.bench.kv_plan import (  # noqa: F401  (moved there; names kept here)
    KV_BEGIN,
    KV_READY,
    KV_CLOCK,
    KV_REQ,
    KV_LAYER,
    KV_DONE,
    LAYOUTS,
    PREP_MODES,
    DEFAULT_SEED,
    KvPlan,
    make_plan,
    PagePool,
    page_patterns,
    fill_pattern,
    verify_pages,
    verify_range,
)
from multirail.bench.kv_decode import (  # noqa: F401  (moved there; names kept here)
    serve,
    _DecodeLoop,
    _Geom,
    _geom_plan,
)
from multirail.bench.kv_prefill import (  # noqa: F401  (moved there; names kept here)
    KvRow,
    kv_row,
    _Mailbox,
    _Phase,
    KvInitiator,
    run_prefill,
)

# -- prefill side ----------------------------------------------------------------------------------

# -- CLI ---------------------------------------------------------------------------------------------

def add_parser(sub: Any, add_engine_opts: Callable[[argparse.ArgumentParser], None],
               add_target_opts: Callable[[argparse.ArgumentParser], None], default_testbed: str) -> argparse.ArgumentParser:
    k = sub.add_parser("kv", help="KV-cache transfer, prefill -> decode: shuffled pages, one WRITE per layer",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = k.add_argument_group("workload")
    w.add_argument("--model", required=True, metavar="NAME|FILE.yaml",
                   help="bundled: llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, deepseek-r1 (MLA); or a YAML file")
    w.add_argument("--isl", type=int, required=True, metavar="TOKENS", help="input sequence length per request")
    w.add_argument("--page-tokens", type=int, default=16, help="tokens per page (default 16)")
    w.add_argument("--tp", type=int, default=1, help="tensor parallelism: the bench moves one rank's share (default 1)")
    w.add_argument("--requests", type=int, default=20,
                   help="timed requests per workload (default 20: at 10, random 10-request halves of one "
                        "loopback run gave a ratio below 0.85 in 3.5%% of splits; docs/bench-kv.md)")
    w.add_argument("--warmup-requests", type=int, default=1, help="untimed requests per workload first (default 1)")
    w.add_argument("--rounds", type=int, default=None,
                   help="split each workload's timed requests into this many segments, alternating contiguous "
                        "and kv (c k, k c, ...), so both see the same seconds of a noisy host (default: "
                        "requests / concurrency, a segment per request at concurrency 1; 1 with VRAM: all "
                        "contiguous requests, then all kv; DRAM only above 1)")
    w.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default 1)")
    w.add_argument("--layout", default="layer", choices=list(LAYOUTS),
                   help="layer: one pool region per layer (vLLM); block: all layers of a page in one block")
    w.add_argument("--pool-pages", type=int, default=None,
                   help="pages per layer in each pool (default 2 x concurrency x pages per request)")
    w.add_argument("--prep", default="fresh", choices=list(PREP_MODES),
                   help="fresh: initialize_xfer per request and layer (default); reuse: each slot keeps its pages, "
                        "handles prepared once per slot and layer and reposted")
    w.add_argument("--check-consistency", action="store_true",
                   help="the decode side verifies every page of every request (timings then include it)")
    w.add_argument("--nixl-backend", action="append", choices=("UCX", "MULTIRAIL"), metavar="UCX|MULTIRAIL",
                   help="also run the workload through NIXL's own agent with this backend (repeatable; MULTIRAIL: "
                        "multirail's NIXL plugin from `multirail nixl-plugin dir`). Named explicitly, a failed "
                        "NIXL run fails the command. Default: UCX when NIXL is installed, skipped with a note "
                        "otherwise")
    w.add_argument("--no-nixl", action="store_true", help="skip the NIXL run even when NIXL is installed")
    w.add_argument("--json", metavar="FILE", help="write results as JSON ('-' for stdout)")
    w.add_argument("--plot", metavar="FILE.png", help="draw the latency CDF and per-rail throughput (matplotlib)")
    w.add_argument("--seed", type=int, default=DEFAULT_SEED, help=argparse.SUPPRESS)
    w.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # run by `bench kv --testbed`
    w.add_argument("--corrupt-mapping", action="store_true", help=argparse.SUPPRESS)
    m = k.add_argument_group("where")
    m.add_argument("--listen", metavar="HOST:PORT", help="be the decode side (two hosts)")
    m.add_argument("--connect", metavar="HOST:PORT", help="be the prefill side against a `bench kv --listen`")
    m.add_argument("--testbed", nargs="?", const=default_testbed, default=None, metavar="NAME",
                   help=f"decode in the testbed's namespace a, prefill in b (default name {default_testbed}); "
                        "--rails then takes rail indices")
    add_engine_opts(k)
    add_target_opts(k)
    return k


def plan_from_args(args: argparse.Namespace) -> KvPlan:
    if args.warmup_requests < 0:
        raise UsageError("--warmup-requests must be >= 0")
    if args.rounds is None:
        # A slow stretch of a shared host (seconds in which every copy costs more) must not land
        # on one side of the ratio: alternate the workloads as finely as the concurrency allows.
        # VRAM runs keep one segment each (their staging breakdown is per workload phase).
        vram = "VRAM" in (args.initiator_seg_type, args.target_seg_type)
        args.rounds = 1 if vram else max(1, args.requests // max(1, args.concurrency))
    if args.rounds < 1:
        raise UsageError("--rounds must be >= 1")
    if args.rounds > 1 and "VRAM" in (args.initiator_seg_type, args.target_seg_type):
        raise UsageError("--rounds > 1 needs DRAM on both sides: the staging breakdown of a VRAM run is "
                         "measured per workload phase")
    if args.total_buffer_size:
        raise UsageError("--total-buffer-size does not apply to bench kv: the pools follow from the model, "
                         "--isl, --concurrency and --pool-pages")
    if sum(x is not None and x is not False for x in (args.listen, args.connect, args.testbed)) > 1:
        raise UsageError("--listen, --connect and --testbed exclude each other")
    if args.nixl_backend and args.no_nixl:
        raise UsageError("--no-nixl and --nixl-backend exclude each other")
    if args.nixl_backend and (args.listen or args.connect):
        raise UsageError("--nixl-backend runs both NIXL sides itself (on loopback or --testbed): it does not "
                         "combine with --listen/--connect")
    if args.child and not (args.connect and args.json and args.json != "-"):
        raise UsageError("--child is internal (bench kv --testbed): it needs --connect and --json FILE")
    return make_plan(args.model, args.isl, args.page_tokens, args.tp, args.layout, args.requests,
                     args.concurrency, args.pool_pages)


def cmd_kv(args: argparse.Namespace) -> int:
    from multirail.bench import _engine_kwargs, _hostport

    plan = plan_from_args(args)
    eng = _engine_kwargs(args)
    if args.plot:
        from multirail.bench.plot import require_matplotlib
        require_matplotlib()
    if args.duration <= 0 or args.idle_timeout <= 0:
        raise UsageError("--duration and --idle-timeout must be positive")
    if args.listen:
        host, port = _hostport(args.listen)
        return serve(host=host, port=port, name=args.target_name, pool_bytes=plan.pool_bytes,
                     duration=args.duration, idle_timeout=args.idle_timeout, seg_type=args.target_seg_type,
                     device=args.device_id, **eng)
    out = sys.stderr if args.json == "-" else sys.stdout
    if not args.child:
        for line in plan.describe():
            print(line, file=out, flush=True)
    if args.connect:
        host, port = _hostport(args.connect)
        # --child: started by `bench kv --testbed` on this host, so both sides read one clock
        doc = run_prefill(args, plan, host, port, None, same_clock=args.child)
        if not args.child and doc["clock"]["err_us"] is not None:
            doc["problems"].append(f"decode_lat_* uses an estimated clock offset (error <= "
                                   f"{doc['clock']['err_us']:.0f} us)")
        return _emit(args, plan, doc)
    from multirail.bench import check_transport
    check_transport(args)  # before the decode process starts: the engine's own message, at once
    from multirail.bench.mem import check_gpu
    check_gpu(args)
    if args.testbed:
        doc = _run_testbed(args, plan)
    else:
        doc = _run_local(args, plan)
    _nixl(args, plan, doc)
    return _emit(args, plan, doc)


def _kv_argv(args: argparse.Namespace, plan: KvPlan) -> list[str]:
    argv = ["--model", plan.model.source if plan.model.source else args.model, "--isl", str(plan.isl),
            "--page-tokens", str(plan.page_tokens), "--tp", str(plan.tp), "--requests", str(plan.requests),
            "--warmup-requests", str(args.warmup_requests), "--concurrency", str(plan.concurrency),
            "--layout", plan.layout, "--pool-pages", str(plan.pool_pages), "--prep", args.prep,
            "--seed", str(args.seed), "--rounds", str(args.rounds)]
    argv += ["--check-consistency"] if args.check_consistency else []
    argv += ["--corrupt-mapping"] if args.corrupt_mapping else []
    return argv


def _engine_argv(args: argparse.Namespace, rails: str | None) -> list[str]:
    argv = ["--connections", str(args.connections), "--policy", args.policy, "--chunk-size", args.chunk_size,
            "--timeout", str(args.timeout), "--stall-timeout", str(args.stall_timeout),
            "--target-name", args.target_name, "--progress", args.progress, "--spin-us", str(args.spin_us),
            "--transport", eng_transport(args)]
    from multirail.bench import mem_argv
    return argv + mem_argv(args) + (["--rails", rails] if rails else [])


def eng_transport(args: argparse.Namespace) -> str:
    from multirail.bench import _transport
    return _transport(args)


def _start_decode(args: argparse.Namespace, plan: KvPlan, prefix: list[str], listen: str,
                  rails: str | None) -> tuple[subprocess.Popen[str], dict[str, Any], Any]:
    from multirail.bench import _child_env
    from multirail.bench.target import launch

    cmd = prefix + [sys.executable, "-m", "multirail", "bench", "kv", "--listen", listen,
                    "--duration", str(args.duration), "--idle-timeout", str(args.idle_timeout)]
    cmd += _kv_argv(args, plan) + _engine_argv(args, rails)
    try:
        return launch(cmd, ready_timeout=60.0 + plan.pool_bytes / 2e8, env=_child_env(args))
    except RuntimeError as e:
        raise BenchFailure(str(e).replace("bench target", "bench kv --listen")) from None


def _run_local(args: argparse.Namespace, plan: KvPlan) -> dict[str, Any]:
    from multirail.bench.target import stop

    proc, ready, errf = _start_decode(args, plan, [], "127.0.0.1:0", args.rails)
    try:
        doc = run_prefill(args, plan, "127.0.0.1", int(ready["port"]), None, same_clock=True)
    finally:
        stop(proc)
        errf.close()
    doc["transport"]["target_transport"] = ready.get("transport")
    return doc


def _run_testbed(args: argparse.Namespace, plan: KvPlan) -> dict[str, Any]:
    from multirail.bench import _child_env, _select_testbed_rails, _testbed
    from multirail.bench.target import stop

    tb = _select_testbed_rails(_testbed(args.testbed), args.rails)
    prefix_a, prefix_b = ["ip", "netns", "exec", tb["ns_a"]], ["ip", "netns", "exec", tb["ns_b"]]
    host = tb["a"][0]
    proc, ready, errf = _start_decode(args, plan, prefix_a, f"{host}:0", ",".join(tb["a"]))
    try:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "kv.json")
            cmd = prefix_b + [sys.executable, "-m", "multirail", "bench", "kv", "--connect",
                              f"{host}:{ready['port']}", "--json", out, "--child", "--no-nixl"]
            cmd += _kv_argv(args, plan) + _engine_argv(args, ",".join(tb["b"]))
            limit = args.duration
            try:  # its stderr is ours: progress shows live, and so do its errors
                res = subprocess.run(cmd, stdout=subprocess.DEVNULL, text=True, timeout=limit, env=_child_env(args))
            except subprocess.TimeoutExpired:
                raise BenchFailure(f"prefill side in the testbed did not finish within {limit:.0f} s") from None
            if not os.path.exists(out):
                raise BenchFailure(f"prefill side in namespace {tb['ns_b']} failed (exit {res.returncode}; "
                                   "its message is above)")
            with open(out) as f:
                data = json.load(f)
    finally:
        stop(proc)
        errf.close()
    rows = [_row_from_json(r) for r in data["rows"]]
    caps = [float(r) / 1e9 if r else None for r in tb["rates"]]
    for row in rows:
        row.set_capacity(caps)
    report = data.get("transport") or {"transport": eng_transport(args), "rails": []}
    report["target_transport"] = ready.get("transport")
    if data.get("memory") and "memory" not in report:
        report["memory"] = data["memory"]
    return {"rows": rows, "problems": list(data.get("problems", [])), "clock": data.get("clock", {}),
            "transport": report, "testbed": {"name": args.testbed, "ns_a": tb["ns_a"], "ns_b": tb["ns_b"], "a": tb["a"], "b": tb["b"],
                        "rates_bps": tb["rates"]}}


def _row_from_json(d: dict[str, Any]) -> KvRow:
    d = dict(d)
    d["rails"] = [RailRow(**x) for x in d.get("rails", [])]
    d["engine_rails"] = [RailRow(**x) for x in d.get("engine_rails", [])]
    return KvRow(**d)


def _nixl(args: argparse.Namespace, plan: KvPlan, doc: dict[str, Any]) -> None:
    """The NIXL rows. Implicit (no --nixl-backend): UCX, skipped with a note when it cannot run.
    Named: every backend named runs, and one that cannot is an error (BenchFailure)."""
    named = list(dict.fromkeys(args.nixl_backend or []))
    if args.no_nixl:
        return

    def skip(why: str) -> None:
        if named:
            raise BenchFailure(f"NIXL kv run ({', '.join(named)}): {why}")
        doc["problems"].append(f"NIXL kv run skipped: {why}")

    if uses_vram(args):
        return skip("the bench runs NIXL on DRAM only")
    from multirail.bench.kv_nixl import run_nixl_kv
    from multirail.bench.nixl_latency import nixl_available

    if not nixl_available():
        return skip("NIXL is not installed (pip install nixl-cu12)")
    tb = doc.get("testbed")
    from multirail.bench import _engine_kwargs

    engine = _engine_kwargs(args)
    for backend in named or ["UCX"]:
        try:
            row = run_nixl_kv(plan, args.warmup_requests, args.seed, tb, timeout_s=args.duration, backend=backend,
                              check=args.check_consistency, engine=engine, corrupt=args.corrupt_mapping)
        except BenchFailure as e:
            if named:
                raise
            doc["problems"].append(f"NIXL kv run skipped: {e}")
            return
        if tb:
            row.set_capacity([float(r) / 1e9 if r else None for r in tb["rates_bps"]])
        doc["rows"].append(row)


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"


def format_kv_table(rows: list[KvRow]) -> str:
    head = (f"{'workload':<24} {'reqs':>5} {'Gbps':>7} {'p50 ms':>9} {'p99 ms':>9} {'dec p50':>9} "
            f"{'desc/s':>8} {'%cap':>6}  check")
    lines = [head, "-" * len(head)]
    for r in rows:
        dec = f"{r.decode_lat_p50_us / 1e3:9.2f}" if r.decode_lat_p50_us is not None else f"{'-':>9}"
        cap = f"{r.pct_of_capacity:5.1f}%" if r.pct_of_capacity is not None else f"{'-':>6}"
        lines.append(f"{r.worker:<24} {r.requests:>5} {r.gbps:7.3f} {r.lat_p50_us / 1e3:9.2f} "
                     f"{r.lat_p99_us / 1e3:9.2f} {dec} {_fmt_rate(r.descs_per_s):>8} {cap}  {r.consistency}")
        lines.extend(format_rails(r))  # type: ignore[arg-type]
        lines.extend(format_breakdown(r.staging))
    return "\n".join(lines)


#: Resamples of the requests for the ratio's interval (`ratio_interval`), and its coverage.
INTERVAL_RESAMPLES = 2000
INTERVAL_COVERAGE = 0.90


def ratio_interval(ratio: float, kv_us: list[float], contig_us: list[float]) -> tuple[float, float] | None:
    """How far `ratio` (kv Gbps / contiguous Gbps) could move on this host's noise alone: a
    percentile bootstrap over the run's own requests. Each workload's request latencies are
    resampled with replacement (seeded: the same run prints the same interval), and the spread of
    mean(contiguous) / mean(kv) around its value on the real samples scales `ratio`. None with
    fewer than 5 requests per workload. On a shared host a single request can take twice as long
    as its neighbours (docs/benchmarks.md, issue 22 session 15); with 10 requests per workload, one
    such request moves the ratio by ~10%, and the interval says so."""
    if len(kv_us) < 5 or len(contig_us) < 5 or min(kv_us) <= 0 or min(contig_us) <= 0:
        return None
    rng = np.random.default_rng(0x5eed)
    k = np.asarray(kv_us, dtype=np.float64)
    c = np.asarray(contig_us, dtype=np.float64)
    base = c.mean() / k.mean()
    km = k[rng.integers(0, len(k), (INTERVAL_RESAMPLES, len(k)))].mean(axis=1)
    cm = c[rng.integers(0, len(c), (INTERVAL_RESAMPLES, len(c)))].mean(axis=1)
    tail = 100 * (1 - INTERVAL_COVERAGE) / 2
    lo, hi = np.percentile(cm / km, [tail, 100 - tail])
    return float(ratio * lo / base), float(ratio * hi / base)


def rail_event_notes(rows: list[KvRow]) -> list[str]:
    """A note per row whose timed requests saw the engine's failure handling run (stalls, rails
    down, readmissions, reissued chunks): a slow run without one was not failover."""
    notes = []
    for r in rows:
        ev = {k: v for k, v in (r.rail_events or {}).items() if v}
        if ev:
            notes.append(f"{r.worker}: the engine's failure handling ran during the timed requests ("
                         + ", ".join(f"{k} {v}" for k, v in ev.items()) + "; rail_stats)")
    return notes


def summary(rows: list[KvRow]) -> dict[str, Any]:
    kv = next((r for r in rows if r.worker == "multirail kv"), None)
    contig = next((r for r in rows if r.worker == "multirail contiguous"), None)
    nixl = next((r for r in rows if r.worker.startswith("nixl-ucx")), None)
    nixl_mr = next((r for r in rows if r.worker == "nixl-multirail kv"), None)
    out: dict[str, Any] = {"ratio_to_contiguous": None, "ratio_to_nixl": None, "nixl_multirail_to_native": None}
    if kv and contig and contig.gbps > 0:
        out["ratio_to_contiguous"] = kv.gbps / contig.gbps
        out["contiguous_text"] = (f"kv / contiguous = {100 * kv.gbps / contig.gbps:.1f}% ({kv.gbps:.3f} vs "
                                  f"{contig.gbps:.3f} Gbps; p50 {kv.lat_p50_us / 1e3:.2f} vs "
                                  f"{contig.lat_p50_us / 1e3:.2f} ms)")
        if kv.rounds > 1:
            out["contiguous_text"] += f"; measured in {kv.rounds} interleaved rounds"
        iv = ratio_interval(out["ratio_to_contiguous"], kv.latencies_us, contig.latencies_us)
        out["ratio_to_contiguous_interval"] = list(iv) if iv else None
        if iv:
            out["contiguous_text"] += (f"; {100 * INTERVAL_COVERAGE:.0f}% interval from the requests' spread "
                                       f"{100 * iv[0]:.1f}-{100 * iv[1]:.1f}%")
        if "not checked" not in (kv.consistency, contig.consistency):
            # Gbps is over each phase's wall time, and with --check-consistency that includes the
            # decode side's byte check after every request: the ratio then compares checks too.
            out["contiguous_text"] += ("; byte-checked run: the Gbps include the decode side's checks between "
                                       "requests, compare the p50s")
    if kv and nixl and nixl.gbps > 0:
        out["ratio_to_nixl"] = kv.gbps / nixl.gbps
        out["nixl_text"] = (f"kv multirail / {nixl.worker} = {kv.gbps / nixl.gbps:.2f}x Gbps ({kv.gbps:.3f} vs "
                            f"{nixl.gbps:.3f}); p50 {kv.lat_p50_us / 1e3:.2f} vs {nixl.lat_p50_us / 1e3:.2f} ms; "
                            f"desc/s {_fmt_rate(kv.descs_per_s)} vs {_fmt_rate(nixl.descs_per_s)}")
    if kv and nixl_mr and kv.gbps > 0:
        out["nixl_multirail_to_native"] = nixl_mr.gbps / kv.gbps
        out["nixl_mr_text"] = (f"NIXL+MULTIRAIL kv / multirail kv = {nixl_mr.gbps / kv.gbps:.2f}x Gbps "
                               f"({nixl_mr.gbps:.3f} vs {kv.gbps:.3f}); p50 {nixl_mr.lat_p50_us / 1e3:.2f} vs "
                               f"{kv.lat_p50_us / 1e3:.2f} ms")
        if nixl and nixl is not nixl_mr and nixl.gbps > 0:
            out["nixl_mr_text"] += f"; NIXL+MULTIRAIL / {nixl.worker} = {nixl_mr.gbps / nixl.gbps:.2f}x Gbps"
    if kv:
        out.update(lat_p50_us=kv.lat_p50_us, lat_p99_us=kv.lat_p99_us, gbps=kv.gbps, descs_per_s=kv.descs_per_s,
                   pct_of_capacity=kv.pct_of_capacity, capacity_gbps=kv.capacity_gbps)
        if kv.descs_per_s:
            out["descs_text"] = (f"descriptors ({kv.prep}): {_fmt_rate(kv.descs_per_s)}/s prepare+post "
                                 f"({kv.descs} page descriptors in {kv.transfers} WRITEs; prepare "
                                 f"{_fmt_rate(kv.prep_descs_per_s)}/s, post {_fmt_rate(kv.post_descs_per_s)}/s, "
                                 f"forming the rows {_fmt_rate(kv.build_descs_per_s)}/s)")
        if kv.pct_of_capacity is not None:
            out["capacity_text"] = (f"kv {kv.gbps:.3f} Gbps = {kv.pct_of_capacity:.1f}% of the rails' capacity "
                                    f"({kv.capacity_gbps:.2f} Gbps)")
    return out


def _emit(args: argparse.Namespace, plan: KvPlan, doc: dict[str, Any]) -> int:
    rows: list[KvRow] = doc["rows"]
    if args.child:  # the parent prints, draws and decides
        with open(args.json, "w") as f:
            json.dump(json_clean({"rows": [r.to_json() for r in rows], "problems": doc.get("problems", []),
                              "clock": doc.get("clock", {}), "transport": doc.get("transport")}), f)
        return 0
    text_out = sys.stderr if args.json == "-" else sys.stdout
    print(format_kv_table(rows), file=text_out)
    from multirail.bench.worker import format_affinity, format_memory, format_transport
    transport = dict(doc.get("transport") or {"transport": eng_transport(args), "rails": []})
    memory = transport.pop("memory", None)
    print(format_transport(transport) + " (multirail rows)", file=text_out)
    aff = format_affinity(transport, getattr(args, "gpu_index", None))
    if aff:
        print(aff, file=text_out)
    print(format_memory(memory, transport), file=text_out)
    summ = summary(rows)
    for key in ("contiguous_text", "capacity_text", "descs_text", "nixl_text", "nixl_mr_text"):
        if key in summ:
            print(summ[key], file=text_out)
    problems = list(doc.get("problems", []))
    for note in sorted({r.staging["target_note"] for r in rows if r.staging and r.staging.get("target_note")}):
        problems.append(f"decode-side staging not measured ({note}): the breakdown shows the prefill side's stages only")
    problems += rail_event_notes(rows)
    for p in problems:
        print(f"note: {p}", file=sys.stderr)
    failed = [r for r in rows if r.consistency.startswith("FAILED")]
    checked = [r for r in rows if r.consistency != "not checked"]
    consistency = ("FAILED" if failed else "ok") if checked else "not checked"
    full = {"kv": plan.to_json(), "model": plan.model.to_json(), "rows": [r.to_json() for r in rows],
            **{k: v for k, v in summ.items() if not k.endswith("_text")}, "consistency": consistency,
            "clock": doc.get("clock", {}), "problems": problems, "transport": transport, "memory": memory,
            "config": args_config(args)}
    if "testbed" in doc:
        full["testbed"] = doc["testbed"]
    full = json_clean(full)
    if args.json:
        write_json(full, args.json)
    if args.plot:
        from multirail.bench.plot import plot_kv
        plot_kv(full, args.plot)
        print(f"plot: {args.plot}", file=text_out)
    if failed:
        print(f"multirail bench kv: consistency check FAILED: {failed[0].consistency}", file=sys.stderr)
        return 1
    return 0
