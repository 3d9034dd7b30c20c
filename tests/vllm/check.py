#!/usr/bin/env python3
"""`make vllm-check`: vLLM's prefill/decode disaggregation over MULTIRAIL, end to end.

Run as root with the vLLM venv's Python (tests/vllm/install.py makes it):

    .venv-vllm/bin/python tests/vllm/check.py [--backend MULTIRAIL|UCX] [--numbers]

What it does (every step bounded in time; servers killed by PID and the namespaces removed on
any exit):
  * makes a tiny seeded Llama (float32) and a byte-level BPE tokenizer (tests/vllm/model.py);
  * brings up a testbed: namespaces NAME-a (prefill) and NAME-b (decode) joined by 2 rails of
    2 Gbit/s (python/multirail/testbed.py);
  * runs one vLLM alone in NAME-b for the reference outputs, then a prefill vLLM in NAME-a and
    a decode vLLM in NAME-b, both with NixlConnector, kv_buffer_device cpu and
    kv_connector_extra_config {"backends": [BACKEND]}, and for multirail only NIXL_PLUGIN_DIR
    set (from `multirail nixl-plugin dir`; no MULTIRAIL_* variable at all), with a proxy that
    speaks vLLM's toy proxy protocol (tests/vllm/proxy.py);
  * checks: greedy token ids of every prompt through P/D equal the single instance's; the
    decode server's /metrics count every prompt token as external_kv_transfer, none computed
    locally, no failed NIXL transfer; the testbed's NIC counters show the KV bytes on both
    rails; a rail taken down while requests run loses none; every rail down for 2 s while
    decode pulls loses none;
  * then prefill TP 1 (core 0) with decode TP 2 (its two workers on cores 0 and 1), the same
    backend: each decode worker pulls its half of the KV heads from the one prefill worker and
    sends it a NIXL notification when done; prefill frees a request's blocks after both. Checks:
    outputs equal the single instance's, every prompt token came by KV transfer, and prefill
    took exactly one notification per request from each of the two decode workers (counted in
    vLLM's engine process of the prefill server by tests/vllm/notif_hook), none after expiry, no
    expired request. `--decode-tp 1` leaves this part out and the report says "not run".
Exit 0 only when every check passed; the report lists each with its evidence.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO / "python"), str(HERE)]

import model as tiny  # noqa: E402
from multirail.testbed import Testbed  # noqa: E402
from proxy import HTTPError, Proxy, post_json  # noqa: E402

REQUEST_TIMEOUT_S = 60.0
START_TIMEOUT_S = 480.0
CHECK_TIMEOUT_S = 1500.0
#: how long a server gets to exit after SIGTERM, then after SIGKILL (a loaded 2-core host tearing
#: down a 3 GB server took more than 10 s)
STOP_GRACE_S = 30.0
MAX_TOKENS = 24
CLONE_NEWNET = 0x40000000
#: prompt lengths in tokens (short to long; the last ones span many KV blocks)
PROMPT_LENGTHS = [3, 9, 40, 130, 300, 700, 1100, 60]


def log(msg: str) -> None:
    print(f"[vllm-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- processes


@dataclasses.dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    logfile: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> bool:
        """SIGTERM to the server's process group (its id is the server's PID), SIGKILL after
        STOP_GRACE_S; whether it is gone. Never raises: a server that outlives even SIGKILL for
        STOP_GRACE_S (a loaded host tearing down GBs) is logged, and the caller goes on."""
        if self.proc.poll() is not None:
            return True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(STOP_GRACE_S)
                return True
            except subprocess.TimeoutExpired:
                pass
        log(f"{self.name} (pid {self.proc.pid}) still alive {2 * STOP_GRACE_S:.0f}s after SIGTERM and SIGKILL")
        return False


def enter_netns(ns: str) -> None:
    """Move this process (one thread so far) into network namespace `ns`: every socket it opens
    from now on, and every child it starts, is there. The testbed commands use `ip -n`/`ip netns
    exec` with explicit names, so they work from any namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({ns})")
    finally:
        os.close(fd)


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


#: the decode server's counters the checks read: key -> Prometheus sample name and labels
METRICS = {
    "external": r'vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\}',
    "local": r'vllm:prompt_tokens_by_source_total\{[^}]*source="local_compute"[^}]*\}',
    "failed": r"vllm:nixl_num_failed_transfers_total(?:\{[^}]*\})?",
    "xfers": r"vllm:nixl_xfer_time_seconds_count(?:\{[^}]*\})?",
    "xfer_s": r"vllm:nixl_xfer_time_seconds_sum(?:\{[^}]*\})?",
    "bytes": r"vllm:nixl_bytes_transferred_sum(?:\{[^}]*\})?",
    "prompt_tokens": r"vllm:prompt_tokens_total(?:\{[^}]*\})?",
    "notif_after_expiry": r"vllm:nixl_num_notifications_after_expiry_total(?:\{[^}]*\})?",
    "expired": r"vllm:nixl_num_kv_expired_reqs_total(?:\{[^}]*\})?",
}


def parse_metrics(text: str) -> dict[str, float]:
    """Each METRICS sample summed over its label sets; NaN when the server does not export it."""
    out: dict[str, float] = {}
    for key, pat in METRICS.items():
        vals = [float(m.group(1)) for m in re.finditer(r"^" + pat + r"\s+([0-9.eE+-]+)$", text, re.M)]
        out[key] = sum(vals) if vals else float("nan")
    return out


def notification_tally(lines: list[str], handed: list[dict[str, Any]], consumers: int) -> tuple[bool, str]:
    """Whether prefill took exactly `consumers` notifications for each request the proxy handed
    to decode, each from a different decode worker (NIXL agent), each saying `consumers`
    readers, and none for any other request. `lines`: the JSON lines tests/vllm/notif_hook wrote
    ({"agent", "msg"}; vLLM's message is "<remote_request_id>:<expected readers>", heartbeats
    "HB:..." are not counted); `handed`: the kv_transfer_params of each request (the proxy's)."""
    by_req: dict[str, list[tuple[str, str]]] = {}
    for line in lines:
        n = json.loads(line)
        if n["msg"].startswith("HB:"):
            continue
        req, _, expect = n["msg"].rpartition(":")
        by_req.setdefault(req, []).append((n["agent"], expect))
    want = [str(h.get("remote_request_id")) for h in handed]
    bad = []
    for req in want:
        got = by_req.get(req, [])
        agents = {a for a, _ in got}
        if len(got) != consumers or len(agents) != consumers or any(e != str(consumers) for _, e in got):
            bad.append(f"{req}: {len(got)} notification(s) from {len(agents)} worker(s) {sorted(e for _, e in got)}")
    stray = sorted(set(by_req) - set(want))
    agents_all = {a for got in by_req.values() for a, _ in got}
    detail = (f"{len(want) - len(bad)}/{len(want)} requests notified exactly once by each of {consumers} decode "
              f"workers ({len(agents_all)} agents, {sum(len(g) for g in by_req.values())} notifications)")
    if stray:
        bad.append(f"notifications for {len(stray)} request(s) never handed to decode: {stray[:3]}")
    return not bad, detail + ("; " + "; ".join(bad[:4]) if bad else "")


class Run:
    """One check run: the testbed, the servers, the cleanup."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tb = Testbed(f"mrtbv{uuid.uuid4().hex[:4]}", rails=2, rate=args.rate)
        self.workdir = Path(tempfile.mkdtemp(prefix="vllm-check-"))
        self.servers: list[Server] = []
        self.results: list[tuple[str, bool, str]] = []
        self.skipped: list[tuple[str, str]] = []
        self.plugin_dir = ""

    # ---- bookkeeping

    def record(self, name: str, ok: bool, detail: str) -> bool:
        self.results.append((name, ok, detail))
        log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        return ok

    def not_run(self, name: str, reason: str) -> None:
        """A check that did not run: reported as "not run: <reason>", never as passed."""
        self.skipped.append((name, reason))
        log(f"NOT RUN {name}: {reason}")

    def cleanup(self) -> None:
        """Every server stopped and the testbed removed, whatever fails on the way."""
        for s in self.servers:
            try:
                s.stop()
            except Exception as e:  # noqa: BLE001 - the next servers and the testbed must still go
                log(f"stopping {s.name}: {type(e).__name__}: {e}")
        self.servers.clear()
        with contextlib.suppress(Exception):
            self.tb.down()
        if self.args.keep_logs:
            log(f"logs kept in {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- servers

    def env(self, side: str, cpu: int | str, backend: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MULTIRAIL_", "UCX_", "NIXL_", "VLLM_"))}
        env.update(
            VLLM_TARGET_DEVICE="cpu", VLLM_HOST_IP=self.tb.addrs(side)[0], VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.args.kv_gib), VLLM_CPU_OMP_THREADS_BIND=str(cpu),
            VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        )
        if backend == "MULTIRAIL":
            env["NIXL_PLUGIN_DIR"] = self.plugin_dir  # the only multirail setting
            for kv in self.args.multirail_env:  # diagnostics only: the check proper sets none
                k, _, v = kv.partition("=")
                env[k] = v.replace("{side}", side).replace("{addrs}", ",".join(self.tb.addrs(side)))
        else:
            # NIXL's UCX with the PyPI wheel: tcp over the rail devices (it would use shared memory
            # between the namespaces otherwise, which is not the rails)
            env["UCX_TLS"] = "tcp"
            env["UCX_NET_DEVICES"] = ",".join(r.devs[side] for r in self.tb.rails)
        return env

    def start(self, name: str, side: str, cpu: int | str, port: int, kv_role: str | None,
              backend: str, side_port: int = 5600, extra: list[str] | None = None,
              extra_env: dict[str, str] | None = None) -> Server:
        argv = [sys.executable, str(HERE / "serve.py"), "--model", str(self.model_dir),
                "--host", "0.0.0.0", "--port", str(port), "--enforce-eager", "--dtype", "float32",
                "--max-model-len", "2048", "--seed", "0", "--served-model-name", "tiny",
                "--disable-uvicorn-access-log",
                # every request must pull its KV: a prefix-cache hit on decode would transfer nothing
                "--no-enable-prefix-caching", *(extra or [])]
        env = self.env(side, cpu, backend)
        env.update(extra_env or {})
        if kv_role is not None:
            cfg = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu",
                   "kv_connector_extra_config": {"backends": [backend]}}
            argv += ["--kv-transfer-config", json.dumps(cfg)]
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.tb.addrs(side)[0]
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
        logfile = self.workdir / f"{name}.log"
        with open(logfile, "wb") as out:
            proc = subprocess.Popen(self.tb.exec_argv(side, argv), stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        addr = "127.0.0.1" if side == "b" else self.tb.addrs("a")[0]
        s = Server(name, proc, f"http://{addr}:{port}", logfile)
        self.servers.append(s)
        return s

    def wait_ready(self, servers: list[Server]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in servers:
            while True:
                if not s.alive():
                    raise RuntimeError(f"{s.name} exited with {s.proc.returncode}:\n{s.tail()}")
                try:
                    http_get(s.url + "/health", timeout=5)
                    break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{s.name} not ready after {START_TIMEOUT_S:.0f}s:\n{s.tail()}")
                time.sleep(1)
        log("ready: " + ", ".join(f"{s.name} ({s.url})" for s in servers))

    def stop(self, servers: list[Server]) -> None:
        for s in servers:
            s.stop()
            self.servers.remove(s)

    # ---- requests

    def complete(self, url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        t0 = time.monotonic()
        out = post_json(url + "/v1/completions", body, timeout=REQUEST_TIMEOUT_S)
        ch = out["choices"][0]
        return {"tokens": ch.get("token_ids"), "text": ch["text"],
                "prompt_tokens": out["usage"]["prompt_tokens"], "s": time.monotonic() - t0, "end": time.monotonic()}

    def batch(self, url: str, prompts: list[str], concurrency: int) -> list[dict[str, Any] | str]:
        """Every prompt through `url`; each result is the completion or the error's text."""
        def one(p: str) -> dict[str, Any] | str:
            try:
                return self.complete(url, p)
            except (HTTPError, OSError, KeyError, ValueError) as e:
                return f"{type(e).__name__}: {e}"
        with cf.ThreadPoolExecutor(concurrency) as ex:
            return list(ex.map(one, prompts))

    # ---- measurements

    def metrics(self, url: str) -> dict[str, float]:
        return parse_metrics(http_get(url + "/metrics"))

    def nic_bytes(self) -> list[int]:
        """rx bytes of each rail's device on the decode side (b): decode READs, so KV arrives there."""
        out = subprocess.run(["ip", "-n", self.tb.ns("b"), "-s", "-j", "link", "show"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        by_dev = {d["ifname"]: d["stats64"]["rx"]["bytes"] for d in json.loads(out)}
        return [by_dev[r.devs["b"]] for r in self.tb.rails]

    # ---- the checks

    def compare(self, name: str, ref: list[dict[str, Any] | str], got: list[dict[str, Any] | str]) -> bool:
        bad = []
        for i, (r, g) in enumerate(zip(ref, got)):
            if isinstance(g, str):
                bad.append(f"prompt {i}: {g[:300]}")
            elif isinstance(r, dict) and (g["tokens"], g["text"]) != (r["tokens"], r["text"]):
                bad.append(f"prompt {i} ({r['prompt_tokens']} tokens): {g['tokens']} != {r['tokens']}")
        n = len(got)
        return self.record(name, not bad, f"{n - len(bad)}/{n} requests equal the single instance token for token"
                           + ("; " + "; ".join(bad[:4]) if bad else ""))

    def reference(self, prompts: list[str]) -> list[dict[str, Any] | str]:
        single = self.start("single", "b", cpu=1, port=8100, kv_role=None, backend=self.args.backend)
        self.wait_ready([single])
        ref = self.batch(single.url, prompts, 1)
        self.stop([single])
        errs = [r for r in ref if isinstance(r, str)]
        if errs:
            raise RuntimeError(f"the single instance failed: {errs[0]}")
        log("reference: " + ", ".join(f"{r['prompt_tokens']}t" for r in ref if isinstance(r, dict)))
        return ref

    def kv_and_nic(self, ref: list[dict[str, Any] | str], out: list[dict[str, Any] | str],
                   m0: dict[str, float], m1: dict[str, float], n0: list[int], n1: list[int]) -> None:
        prompt_tokens = sum(r["prompt_tokens"] for r in out if isinstance(r, dict))
        ext, local = m1["external"] - m0["external"], m1["local"] - m0["local"]
        failed = m1["failed"] - m0["failed"] if m1["failed"] == m1["failed"] else 0.0
        self.record("decode /metrics: every prompt token came by KV transfer",
                     ext == prompt_tokens and local == 0,
                     f"external_kv_transfer {ext:.0f}, local_compute {local:.0f}, prompt tokens {prompt_tokens}")
        self.record("decode /metrics: no failed NIXL transfer", m1["failed"] == 0 or failed == 0,
                     f"vllm:nixl_num_failed_transfers_total {m1['failed']:.0f}")
        kv = prompt_tokens * self.shape.kv_bytes_per_token()
        rails = [b - a for a, b in zip(n0, n1)]
        need = 0.25 * kv
        self.record("NIC counters: the KV bytes on both rails",
                    all(r >= need for r in rails),
                    f"decode-side rx per rail {', '.join(f'{r / 1e6:.2f} MB' for r in rails)}; "
                    f"KV of the prompts {kv / 1e6:.2f} MB (each rail must carry >= 25%); "
                    f"NIXL bytes (vLLM metric) {(m1['bytes'] - m0['bytes']) / 1e6:.2f} MB")

    def rail_down_during(self, url: str, prompts: list[str], ref: list[dict[str, Any] | str]) -> None:
        box: dict[str, Any] = {}
        work = prompts * 2
        t = threading.Thread(target=lambda: box.update(out=self.batch(url, work, 4)), daemon=True)
        t.start()
        time.sleep(1.0)
        self.tb.set_link(1, False, side="a")
        down = time.monotonic()
        log("rail 1 down")
        time.sleep(4.0)
        self.tb.set_link(1, True, side="a")
        up = time.monotonic()
        log("rail 1 up")
        t.join(REQUEST_TIMEOUT_S * len(work))
        out = box.get("out", ["no answer"] * len(work))
        during = sum(1 for r in out if isinstance(r, dict) and down < r["end"] < up)
        ok = self.compare("rail 1 down for 4 s while requests run: none lost", ref * 2, out)
        # evidence that the fault met transfers: requests that finished (KV pulled) while the rail was down
        self.record("rail 1 down: requests completed during the fault", during > 0 or not ok,
                    f"{during} of {len(work)} requests finished while rail 1 was down")

    def blackout_while_pulling(self, url: str, px: Proxy, prompts: list[str], ref: list[dict[str, Any] | str]) -> None:
        fired = threading.Event()

        def blackout() -> None:
            if fired.is_set():
                return
            fired.set()
            for r in self.tb.rails:
                self.tb.set_link(r.index, False, side="a")
            log("every rail down (after prefill, before decode pulls)")

            def restore() -> None:
                time.sleep(2.0)
                for r in self.tb.rails:
                    self.tb.set_link(r.index, True, side="a")
                log("every rail up")
            threading.Thread(target=restore, daemon=True).start()

        i = max(range(len(ref)), key=lambda k: ref[k]["prompt_tokens"] if isinstance(ref[k], dict) else 0)
        px.before_decode = blackout
        try:
            got = self.batch(url, [prompts[i]], 1)
        finally:
            px.before_decode = None
        time.sleep(2.5)
        after = self.batch(url, prompts[:2], 1)
        ok1 = self.compare("every rail down for 2 s while decode pulls: the request completes", [ref[i]], got)
        ok2 = self.compare("after the 2 s outage: new requests work", ref[:2], after)
        if not ok1 and ok2:
            log("(the outage failed the request in flight, the next ones worked: issue 36 item 2)")

    def pd(self, prompts: list[str], ref: list[dict[str, Any] | str]) -> None:
        b = self.args.backend
        pre = self.start("prefill", "a", cpu=0, port=8200, kv_role="kv_producer", backend=b, side_port=5600)
        dec = self.start("decode", "b", cpu=1, port=8300, kv_role="kv_consumer", backend=b, side_port=5601)
        self.wait_ready([pre, dec])
        with Proxy(pre.url, dec.url) as px:
            m0, n0 = self.metrics(dec.url), self.nic_bytes()
            seq = self.batch(px.url, prompts, 1)
            conc = self.batch(px.url, prompts, 4)
            m1, n1 = self.metrics(dec.url), self.nic_bytes()
            self.compare(f"P/D over {b}, one request at a time", ref, seq)
            self.compare(f"P/D over {b}, 4 concurrent requests", ref, conc)
            self.kv_and_nic(ref, seq + conc, m0, m1, n0, n1)
            if not self.args.quick:
                self.rail_down_during(px.url, prompts, ref)
                self.blackout_while_pulling(px.url, px, prompts, ref)
                m2 = self.metrics(dec.url)
                log(f"decode metrics at the end: {m2}")
        self.stop([pre, dec])

    def pd_decode_tp2(self, prompts: list[str], ref: list[dict[str, Any] | str]) -> None:
        """Prefill TP 1 on core 0, decode TP 2 with its workers on cores 0 and 1 (the CPU build's
        TP: gloo and shared memory between the two worker processes)."""
        b = self.args.backend
        tag = f"decode TP 2, prefill TP 1, over {b}"
        notif_log = self.workdir / "prefill-notifications.jsonl"
        # tests/vllm/notif_hook/sitecustomize.py records each notification prefill's engine takes
        hook = os.pathsep.join(x for x in (str(HERE / "notif_hook"), os.environ.get("PYTHONPATH", "")) if x)
        pre = self.start("prefill-tp1", "a", cpu=0, port=8210, kv_role="kv_producer", backend=b, side_port=5620,
                         extra_env={"PD_CHECK_NOTIF_LOG": str(notif_log), "PYTHONPATH": hook})
        dec = self.start("decode-tp2", "b", cpu="0|1", port=8310, kv_role="kv_consumer", backend=b, side_port=5630,
                         extra=["--tensor-parallel-size", "2"])
        self.wait_ready([pre, dec])
        with Proxy(pre.url, dec.url) as px:
            m0 = self.metrics(dec.url)
            seq = self.batch(px.url, prompts, 1)
            conc = self.batch(px.url, prompts, 4)
            m1 = self.metrics(dec.url)
            self.compare(f"P/D {tag}, one request at a time", ref, seq)
            self.compare(f"P/D {tag}, 4 concurrent requests", ref, conc)
            tokens = sum(r["prompt_tokens"] for r in seq + conc if isinstance(r, dict))
            ext, local = m1["external"] - m0["external"], m1["local"] - m0["local"]
            self.record(f"{tag}: decode /metrics, every prompt token came by KV transfer",
                        ext == tokens and local == 0 and m1["failed"] == 0,
                        f"external_kv_transfer {ext:.0f}, local_compute {local:.0f}, prompt tokens {tokens}; "
                        f"failed NIXL transfers {m1['failed']:.0f}")
            # decode answers once its workers have read; their notifications reach prefill's next steps
            deadline, ok, detail = time.monotonic() + 60.0, False, "no notification log"
            while True:
                lines = notif_log.read_text().splitlines() if notif_log.exists() else []
                ok, detail = notification_tally(lines, px.handed, consumers=2)
                if ok or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            self.record(f"{tag}: prefill took one NIXL notification per request from each decode worker", ok, detail)
            p2 = self.metrics(pre.url)
            self.record(f"{tag}: prefill /metrics, no notification after expiry, no expired request",
                        p2["notif_after_expiry"] == 0 and p2["expired"] == 0,  # NaN (not exported) fails
                        f"vllm:nixl_num_notifications_after_expiry {p2['notif_after_expiry']:.0f}, "
                        f"vllm:nixl_num_kv_expired_reqs {p2['expired']:.0f}")
        self.stop([pre, dec])

    def main(self) -> int:
        a = self.args
        self.shape = tiny.ModelShape(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                                     intermediate=2 * a.hidden)
        t0 = time.monotonic()
        self.model_dir = tiny.make(REPO / ".cache" / "vllm-model" / f"l{a.layers}h{a.hidden}", self.shape)
        log(f"model {self.model_dir} ({self.shape}, {self.shape.kv_bytes_per_token()} KV bytes/token)")
        self.plugin_dir = subprocess.run([sys.executable, "-m", "multirail", "nixl-plugin", "dir"], capture_output=True,
                                         text=True, timeout=60, check=True).stdout.strip()
        log(f"NIXL_PLUGIN_DIR={self.plugin_dir}" + (f"; diagnostics env {a.multirail_env}" if a.multirail_env else ""))
        self.tb.up()
        log(f"testbed {self.tb}: prefill in {self.tb.ns('a')} {self.tb.addrs('a')}, decode in {self.tb.ns('b')} {self.tb.addrs('b')}")
        enter_netns(self.tb.ns("b"))
        prompts = tiny.prompts(self.model_dir, PROMPT_LENGTHS)
        ref = self.reference(prompts)
        self.pd(prompts, ref)
        if a.decode_tp == 2:
            self.pd_decode_tp2(prompts, ref)
        else:
            self.not_run("decode TP 2 with prefill TP 1", f"--decode-tp {a.decode_tp}")
        log(f"done in {time.monotonic() - t0:.0f}s")
        return 0 if all(ok for _, ok, _ in self.results) else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="vLLM P/D over MULTIRAIL on the testbed (make vllm-check)")
    ap.add_argument("--backend", default="MULTIRAIL", choices=["MULTIRAIL", "UCX"])
    ap.add_argument("--rate", default="2gbit", help="each rail's rate (default 2gbit)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per server")
    ap.add_argument("--decode-tp", type=int, default=2, choices=[1, 2],
                    help="2 (default): also run decode TP 2 with prefill TP 1; 1: leave that out (reported as not run)")
    ap.add_argument("--quick", action="store_true", help="outputs, metrics and NIC counters only (no rail faults)")
    ap.add_argument("--multirail-env", action="append", default=[], metavar="K=V",
                    help="diagnostics only: extra variables for the multirail servers ({addrs}: the side's rail "
                         "addresses); the check proper sets none, as a deployment would")
    ap.add_argument("--keep-logs", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if os.geteuid() != 0:
        print("vllm-check: needs root (network namespaces for the testbed)", file=sys.stderr)
        return 2
    run = Run(args)

    def on_alarm(_sig: int, _frame: Any) -> None:
        raise TimeoutError(f"the whole check ran past {CHECK_TIMEOUT_S:.0f}s")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.alarm(int(CHECK_TIMEOUT_S))
    rc = 1
    try:
        rc = run.main()
    except Exception as e:  # noqa: BLE001 - reported, then the cleanup runs
        run.record("the check ran to its end", False, f"{type(e).__name__}: {e}")
        for s in run.servers:
            log(f"--- {s.name} log tail ---\n{s.tail(40)}")
    finally:
        signal.alarm(0)
        run.cleanup()
    print("\n== vllm-check report ==")
    for name, ok, detail in run.results:
        print(f"{'PASS' if ok else 'FAIL'}  {name}\n      {detail}")
    for name, reason in run.skipped:
        print(f"NOT RUN  {name}\n      not run: {reason}")
    ok = rc == 0 and all(ok for _, ok, _ in run.results)
    print(f"== {'PASSED' if ok else 'FAILED'} ({sum(o for _, o, _ in run.results)}/{len(run.results)} checks"
          + (f"; {len(run.skipped)} not run" if run.skipped else "") + ")")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
