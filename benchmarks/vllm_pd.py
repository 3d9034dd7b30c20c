#!/usr/bin/env python3
"""vLLM prefill/decode through NIXL+MULTIRAIL against NIXL+UCX on the same rails (issue 36, Numbers).

    sudo .venv-vllm/bin/python benchmarks/vllm_pd.py [--runs 3] [--requests 6] [--prompt-tokens 1000]

Per run (fresh testbed `mrtbv<hex>`, 2 x 2 Gbit/s, fresh servers): two P/D pairs at once, one
with `{"backends": ["MULTIRAIL"]}` (only NIXL_PLUGIN_DIR set) and one with `{"backends": ["UCX"]}`
(UCX_TLS=tcp, UCX_NET_DEVICES = the rail devices: the PyPI wheel's UCX has no RDMA here, and
without the devices it would use shared memory between the namespaces), prefill in namespace a
on core 0, decode in namespace b on core 1 (tests/vllm/check.py starts them). A model large
enough that the KV transfer dominates (default 8 layers, hidden 1024, 8 KV heads of 128, float32:
64 KiB of KV per token, ~64 MB per 1,000-token prompt). Then REQUESTS prompts (different text,
~PROMPT_TOKENS each), alternating MULTIRAIL and UCX, one at a time, through the toy proxy
protocol with max_tokens 1; per backend:
  * decode-side time to first token: the decode request's wall time (it pulls the prompt's KV,
    then computes one token), median over the requests;
  * KV transfer throughput from vLLM's own NIXL metrics on the decode server:
    delta(vllm:nixl_bytes_transferred_sum) / delta(vllm:nixl_xfer_time_seconds_sum);
  * the decode side's NIC bytes per rail.
Prints per run and the worst and median over runs of MULTIRAIL/UCX ratios. docs/benchmarks.md
records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "vllm"), str(REPO / "python")]

import check  # noqa: E402
import model as tiny  # noqa: E402
from proxy import Proxy, post_json  # noqa: E402

BACKENDS = ("MULTIRAIL", "UCX")
check.START_TIMEOUT_S = 900.0  # four servers start at once on 2 cores


def one_run(args: argparse.Namespace, prompts: list[str]) -> dict[str, dict[str, float]]:
    run = check.Run(check.parse(["--kv-gib", str(args.kv_gib), "--rate", args.rate]))
    run.shape = shape(args)
    run.model_dir = tiny.make(REPO / ".cache" / "vllm-model" / f"l{args.layers}h{args.hidden}", run.shape)
    run.plugin_dir = check.subprocess.run([sys.executable, "-m", "multirail", "nixl-plugin", "dir"], capture_output=True,
                                          text=True, timeout=60, check=True).stdout.strip()
    try:
        run.tb.up()
        check.enter_netns(run.tb.ns("b"))
        pairs = {}
        for i, b in enumerate(BACKENDS):
            pre = run.start(f"prefill-{b}", "a", 0, 8200 + i, "kv_producer", b, side_port=5600 + i)
            dec = run.start(f"decode-{b}", "b", 1, 8300 + i, "kv_consumer", b, side_port=5610 + i)
            pairs[b] = (pre, dec)
        run.wait_ready([s for p in pairs.values() for s in p])
        out: dict[str, dict[str, float]] = {}
        proxies = {b: Proxy(p.url, d.url).__enter__() for b, (p, d) in pairs.items()}
        try:
            for b, px in proxies.items():  # warm-up: the side-channel handshake, first connections
                post_json(px.url + "/v1/completions", body(prompts[-1]))
            m0 = {b: run.metrics(pairs[b][1].url) for b in BACKENDS}
            n0 = run.nic_bytes()
            ttft: dict[str, list[float]] = {b: [] for b in BACKENDS}
            toks: dict[str, list[int]] = {b: [] for b in BACKENDS}
            nic: dict[str, list[int]] = {b: [0, 0] for b in BACKENDS}
            for k, p in enumerate(prompts[:-1]):
                order = BACKENDS if k % 2 == 0 else BACKENDS[::-1]
                for b in order:
                    px = proxies[b]
                    times: dict[str, float] = {}
                    px.before_decode = lambda times=times: times.__setitem__("t", time.monotonic())
                    before = run.nic_bytes()
                    r = post_json(px.url + "/v1/completions", body(p))
                    ttft[b].append(time.monotonic() - times["t"])
                    toks[b].append(r["usage"]["prompt_tokens"])
                    after = run.nic_bytes()
                    nic[b] = [x + (a - c) for x, a, c in zip(nic[b], after, before)]
            del n0
            for b in BACKENDS:
                m1 = run.metrics(pairs[b][1].url)
                xb, xs = m1["bytes"] - m0[b]["bytes"], m1["xfer_s"] - m0[b]["xfer_s"]
                out[b] = {"ttft_ms": statistics.median(ttft[b]) * 1e3, "ttft_max_ms": max(ttft[b]) * 1e3,
                          "kv_gbit_s": xb * 8 / xs / 1e9 if xs > 0 else float("nan"), "kv_mb": xb / 1e6,
                          "xfers": m1["xfers"] - m0[b]["xfers"], "xfer_s": xs, "failed": m1["failed"],
                          "prompt_tokens": statistics.median(toks[b]),
                          "rail_mb": [x / 1e6 for x in nic[b]]}
        finally:
            for px in proxies.values():
                px.__exit__()
        return out
    finally:
        run.cleanup()


def body(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}


def shape(a: argparse.Namespace) -> tiny.ModelShape:
    return tiny.ModelShape(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                           intermediate=2 * a.hidden, max_positions=2048)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--rate", default="2gbit")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--json", help="write the runs here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (testbed)", file=sys.stderr)
        return 2
    sh = shape(a)
    mdir = tiny.make(REPO / ".cache" / "vllm-model" / f"l{a.layers}h{a.hidden}", sh)
    prompts = tiny.prompts(mdir, [a.prompt_tokens] * (a.requests + 1))
    print(f"model {sh}: {sh.kv_bytes_per_token()} KV bytes/token, ~{a.prompt_tokens * sh.kv_bytes_per_token() / 1e6:.0f} MB "
          f"per prompt; {a.requests} requests per backend per run, {a.runs} runs", flush=True)
    runs = []
    failed = 0
    for i in range(a.runs):
        t0 = time.monotonic()
        try:
            r = one_run(a, prompts)
        except Exception as e:  # noqa: BLE001 - reported and counted; the next run starts afresh
            failed += 1
            print(f"run {i + 1} ({time.monotonic() - t0:.0f}s): FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        runs.append(r)
        m, u = r["MULTIRAIL"], r["UCX"]
        print(f"run {i + 1} ({time.monotonic() - t0:.0f}s): " + "; ".join(
            f"{b}: decode TTFT median {x['ttft_ms']:.0f} ms (max {x['ttft_max_ms']:.0f}), KV {x['kv_gbit_s']:.2f} Gbit/s "
            f"({x['kv_mb']:.0f} MB in {x['xfers']:.0f} xfers, {x['xfer_s']:.2f} s), rails {x['rail_mb'][0]:.0f}/{x['rail_mb'][1]:.0f} MB, "
            f"failed {x['failed']:.0f}" for b, x in r.items())
            + f" | MULTIRAIL/UCX: TTFT {m['ttft_ms'] / u['ttft_ms']:.2f}x, KV throughput {m['kv_gbit_s'] / u['kv_gbit_s']:.2f}x",
            flush=True)
    if failed:
        print(f"{failed} of {a.runs} runs failed (above); the figures below are of the other {len(runs)}")
    if not runs:
        return 1
    tt = [r["MULTIRAIL"]["ttft_ms"] / r["UCX"]["ttft_ms"] for r in runs]
    kv = [r["MULTIRAIL"]["kv_gbit_s"] / r["UCX"]["kv_gbit_s"] for r in runs]
    print(f"TTFT MULTIRAIL/UCX (lower is better): worst {max(tt):.2f}x, median {statistics.median(tt):.2f}x over {len(runs)} runs")
    print(f"KV throughput MULTIRAIL/UCX (target >= 1.8x): worst {min(kv):.2f}x, median {statistics.median(kv):.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
