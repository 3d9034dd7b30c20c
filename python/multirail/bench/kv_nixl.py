"""The `bench kv` workload through NIXL's own Python API, in the same run, with the backend
`bench kv --nixl-backend` names: `UCX` (NIXL's own; the default) or `MULTIRAIL` (multirail as a
NIXL backend, `libplugin_MULTIRAIL.so`, loaded from `multirail nixl-plugin dir` as
`NIXL_PLUGIN_DIR`; docs/nixl-plugin.md). Both go through the same code here: only the name given
to `nixl_agent_config(backends=[...])` and the environment differ.

Same plan as kv.py: two pools of the same geometry, page ids from shuffled free lists, per
request one WRITE per layer (`get_xfer_descs` on the layer's Nx3 rows, `initialize_xfer` with a
`bench:kv_layer {"r","l","n"}` notification, `transfer`), requests done when every layer's handle
is DONE (`check_xfer_state`, NIXL's completion loop) and, as in multirail's run, the decode
process answers `bench:kv_done` (NIXL `send_notif`) once it holds every layer's notification;
only then are the pages recycled. Reported like multirail's kv row: per-request p50/p99 (prefill
side, plus the decode's own clock), Gbps, descriptors per second (descriptors over the time in
`get_xfer_descs` + `initialize_xfer` + `transfer`: NIXL needs the descriptor-list conversion,
multirail reads the numpy rows in place).

Processes: a NIXL decode (`target`) registers its pool and prints its metadata and pool
address; the prefill (`initiator`) loads it, prints its own metadata, which the parent relays to
the decode's stdin so that the decode can answer; the decode exits when its stdin closes.
`UCX_TLS=tcp` unless set (on one host UCX would otherwise use shared memory). With a testbed the
decode runs in namespace a and the prefill in b, with `UCX_NET_DEVICES` (UCX) or `MULTIRAIL_RAILS`
(MULTIRAIL) set to each side's rails; otherwise both on loopback. MULTIRAIL takes the run's
engine settings (connections, chunk size, policy, transport, progress, secret) as `MULTIRAIL_*`.

With `--check-consistency` the prefill pool holds `pattern(seed, offset)` (as multirail's own
run), the prefill announces each request's page mapping (`bench:kv_req {"r","src","dst"}`, a
NIXL notification) and the decode verifies every page of every layer once all of the request's
layer notifications have arrived, zeroing them afterwards (`verify_pages`); its `bench:kv_done`
carries the verdict.

Run as `python -m multirail.bench.kv_nixl target|initiator ...` (what `run_nixl_kv` does).
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from multirail.bench import protocol as proto

TARGET_NAME, INIT_NAME = "nixl-kv-decode", "nixl-kv-prefill"
#: The prefill's completion loop sleeps POLL_MIN_S after progress, doubling up to POLL_MAX_S
#: while nothing moves (NIXL has no blocking wait: its users poll `check_xfer_state`).
POLL_MIN_S, POLL_MAX_S = 50e-6, 1e-3
PREP_TEXT = {"prepped": "prepped (prep_xfer_dlist once, make_prepped_xfer per layer)",
             "fresh": "fresh (get_xfer_descs + initialize_xfer)"}


def _api() -> Any:
    from multirail.bench.nixl_latency import nixl_api

    api = nixl_api()
    if api is None:
        print(json.dumps({"error": "NIXL is not importable"}), flush=True)
        sys.exit(1)
    return api


BACKENDS = ("UCX", "MULTIRAIL")


def _agent(api: Any, name: str, backend: str) -> Any:
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=[backend]))
    except Exception as e:  # noqa: BLE001 - NIXL raises its own types; say which backend failed
        hint = (" (is NIXL_PLUGIN_DIR a `multirail nixl-plugin dir` directory? `multirail nixl-plugin check` "
                "says what is wrong)" if backend == "MULTIRAIL" else "")
        print(json.dumps({"error": f"NIXL could not create the {backend} backend: {e}{hint}"}), flush=True)
        sys.exit(1)


def _target(pool_bytes: int, idle_s: float, backend: str, geom: dict[str, Any]) -> int:
    from multirail.bench.kv_decode import _geom_plan

    api = _api()
    agent = _agent(api, TARGET_NAME, backend)
    buf = np.zeros(pool_bytes, np.uint8)
    buf.fill(0)
    check = _geom_plan(geom) if geom else None
    seed = int(geom.get("seed", 0))
    mapping: dict[Any, dict[str, Any]] = {}   # request -> kv_req body (check mode)
    complete: dict[Any, int] = {}             # request -> t_ns, every layer in, mapping not yet
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, pool_bytes, 0, "")], "DRAM"))
    print(json.dumps({"meta": agent.get_agent_metadata().hex(), "addr": int(buf.ctypes.data)}), flush=True)
    peer: str | None = None
    open_: dict[Any, set[int]] = {}
    pending: list[bytes] = []
    last = time.monotonic()
    stdin_open = True
    while stdin_open and time.monotonic() - last < idle_s:
        r, _, _ = select.select([sys.stdin], [], [], 0)
        if r:
            line = sys.stdin.readline()
            if not line:
                stdin_open = False
                break
            try:
                peer = agent.add_remote_agent(bytes.fromhex(json.loads(line)["meta"]))
            except (ValueError, KeyError):
                pass
        for msgs in agent.get_new_notifs().values():
            for msg in msgs:
                t_ns = time.monotonic_ns()
                last = time.monotonic()
                d = proto.decode(msg)
                if d is None:
                    continue
                if d[0] == "kv_req" and check is not None:
                    rid = d[1].get("r")
                    if rid in complete:
                        pending.append(_done(rid, complete.pop(rid), check, buf, seed, d[1]))
                    else:
                        mapping[rid] = d[1]
                    continue
                if d[0] != "kv_layer":
                    continue
                rid, n = d[1].get("r"), int(d[1].get("n", 1))
                seen = open_.setdefault(rid, set())
                seen.add(int(d[1].get("l", 0)))
                if len(seen) == n:
                    del open_[rid]
                    if check is None:
                        pending.append(proto.encode("kv_done", {"r": rid, "t_ns": t_ns, "layers": n, "ok": True}))
                    elif rid in mapping:
                        pending.append(_done(rid, t_ns, check, buf, seed, mapping.pop(rid)))
                    else:
                        complete[rid] = t_ns  # the mapping is still on its way
        if peer is not None and pending:
            for m in pending:
                agent.send_notif(peer, m)
            pending = []
        time.sleep(0.0001)
    return 0


def _done(rid: Any, t_ns: int, plan: Any, buf: np.ndarray, seed: int, req: dict[str, Any]) -> bytes:
    """The decode's answer for a complete request in check mode: every page verified."""
    from multirail.bench.kv_plan import verify_pages

    try:
        bad, first = verify_pages(plan, buf, seed, np.asarray(req["src"], np.int64), np.asarray(req["dst"], np.int64))
        out: dict[str, Any] = {"ok": bad == 0, "bad_pages": bad, "first_bad": first}
    except (KeyError, TypeError, ValueError, IndexError) as e:
        out = {"ok": False, "error": f"cannot verify: {e}"}
    return proto.encode("kv_done", {"r": rid, "t_ns": t_ns, "layers": plan.layers, **out})


def _initiator(plan_json: str, meta_hex: str, remote_addr: int) -> int:
    from multirail.bench.kv_plan import fill_pattern

    api = _api()
    p = json.loads(plan_json)
    layers, pages, page_bytes, pool_pages = p["layers"], p["pages"], p["page_bytes"], p["pool_pages"]
    layout, requests, conc, warm, seed = p["layout"], p["requests"], p["concurrency"], p["warmup"], p["seed"]
    check = bool(p.get("check"))
    pool_bytes = pool_pages * layers * page_bytes
    agent = _agent(api, INIT_NAME, p.get("backend", "UCX"))
    buf = np.empty(pool_bytes, np.uint8)
    if check:
        fill_pattern(buf, seed)
    else:
        buf.fill(0x5A)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, pool_bytes, 0, "")], "DRAM"))
    peer = agent.add_remote_agent(bytes.fromhex(meta_hex))
    print(json.dumps({"meta": agent.get_agent_metadata().hex()}), flush=True)

    rng = np.random.default_rng(seed)
    free_src = list(rng.permutation(pool_pages))
    free_dst = list(rng.permutation(pool_pages))

    def offsets(layer_col: np.ndarray, ids: np.ndarray) -> np.ndarray:
        ids = ids.astype(np.uint64)
        if layout == "layer":
            return (layer_col * np.uint64(pool_pages) + ids) * np.uint64(page_bytes)
        return (ids * np.uint64(layers) + layer_col) * np.uint64(page_bytes)

    lay_col = np.arange(layers, dtype=np.uint64)[:, None]

    def rows(base: int, ids: np.ndarray) -> np.ndarray:
        out = np.empty((layers, len(ids), 3), dtype=np.uint64)
        out[:, :, 0] = offsets(lay_col, ids[None, :]) + np.uint64(base)
        out[:, :, 1] = page_bytes
        out[:, :, 2] = 0
        return out

    # The first handle may fail until the backend has connected.
    deadline = time.monotonic() + 30
    while True:
        try:
            probe = agent.initialize_xfer("WRITE", agent.get_xfer_descs(np.array([[buf.ctypes.data, 8, 0]], np.uint64), "DRAM"),
                                          agent.get_xfer_descs(np.array([[remote_addr, 8, 0]], np.uint64), "DRAM"), peer)
            st = agent.transfer(probe)
            while st == "PROC":
                st = agent.check_xfer_state(probe)
            agent.release_xfer_handle(probe)
            if st == "DONE":
                break
        except Exception:  # noqa: BLE001 - UCX not connected yet
            pass
        if time.monotonic() > deadline:
            print(json.dumps({"error": f"NIXL ({p.get('backend', 'UCX')}) could not connect to the decode side "
                                        "within 30 s"}), flush=True)
            return 1
        time.sleep(0.01)

    # NIXL's prepped-list form (what vLLM's NixlConnector does): each side's whole pool
    # prepared once as page descriptors (descriptor i = the page at offset i x page_bytes), and
    # each layer's WRITE made from page indices (`make_prepped_xfer`): no descriptor list is
    # built per request, and the backend gets the layer's pages as one request.
    # MULTIRAIL_KV_NIXL_PREP=fresh: the per-layer `get_xfer_descs` + `initialize_xfer` form.
    prepped = os.environ.get("MULTIRAIL_KV_NIXL_PREP", "prepped") != "fresh"
    lp = rp = None
    if prepped:
        n_pages = pool_bytes // page_bytes

        def pool_rows(base: int) -> np.ndarray:
            r = np.empty((n_pages, 3), np.uint64)
            r[:, 0] = np.arange(n_pages, dtype=np.uint64) * np.uint64(page_bytes) + np.uint64(base)
            r[:, 1] = page_bytes
            r[:, 2] = 0
            return r

        lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", pool_rows(buf.ctypes.data), "DRAM")
        rp = agent.prep_xfer_dlist(peer, pool_rows(remote_addr), "DRAM")
    page = np.uint64(page_bytes)

    def layer_xfer(lay: int, src: np.ndarray, dst: np.ndarray, lr: Any, rr: Any, notif: bytes) -> Any:
        if prepped:
            li = (offsets(lay_col[lay], src) // page).astype(np.int32)
            ri = (offsets(lay_col[lay], dst) // page).astype(np.int32)
            return agent.make_prepped_xfer("WRITE", lp, li, rp, ri, notif)
        return agent.initialize_xfer("WRITE", agent.get_xfer_descs(lr[lay], "DRAM"),
                                     agent.get_xfer_descs(rr[lay], "DRAM"), peer, notif)

    done_msgs: dict[Any, int] = {}
    bad: list[str] = []
    corrupted: list[int] = []
    stats = {"prep_s": 0.0, "post_s": 0.0, "build_s": 0.0, "descs": 0, "transfers": 0}
    lat: list[int] = []
    dec: list[int] = []
    rid_next = [0]

    def run(count: int, timed: bool) -> int:
        slots: list[dict[str, Any] | None] = [None] * conc
        left = count
        t_end = 0
        nap = POLL_MIN_S
        while left > 0 or any(s is not None for s in slots):
            busy = False
            for i in range(conc):
                s = slots[i]
                if s is None and left > 0:
                    left -= 1
                    rid_next[0] += 1
                    rid = rid_next[0]
                    tb = time.perf_counter()
                    src = np.array([free_src.pop(0) for _ in range(pages)], np.int64)
                    dst = np.array([free_dst.pop(0) for _ in range(pages)], np.int64)
                    lr, rr = (None, None) if prepped else (rows(buf.ctypes.data, src), rows(remote_addr, dst))
                    notifs = [proto.encode("kv_layer", {"r": rid, "l": lay, "n": layers}) for lay in range(layers)]
                    build = time.perf_counter() - tb
                    if check:
                        said = dst
                        if p.get("corrupt") and timed and not corrupted:  # bench kv --corrupt-mapping (tests)
                            corrupted.append(rid)
                            said = np.roll(dst, 1) if len(dst) > 1 else (dst + 1) % pool_pages
                        agent.send_notif(peer, proto.encode("kv_req", {"r": rid, "src": src.tolist(),
                                                                       "dst": said.tolist()}))
                    t0 = time.monotonic_ns()
                    hs, prep, post = [], 0.0, 0.0
                    for lay in range(layers):
                        a = time.perf_counter()
                        h = layer_xfer(lay, src, dst, lr, rr, notifs[lay])
                        b = time.perf_counter()
                        if agent.transfer(h) == "ERR":
                            raise RuntimeError(f"NIXL WRITE failed to post (request {rid}, layer {lay})")
                        prep += b - a
                        post += time.perf_counter() - b
                        hs.append(h)
                    if timed:
                        stats["prep_s"] += prep
                        stats["post_s"] += post
                        stats["build_s"] += build
                        stats["descs"] += layers * pages
                        stats["transfers"] += layers
                    slots[i] = {"rid": rid, "t0": t0, "hs": hs, "src": src, "dst": dst, "t_done": None}
                    busy = True
                    continue
                if s is None:
                    continue
                if s["t_done"] is None:
                    while s["hs"]:
                        st = agent.check_xfer_state(s["hs"][0])
                        if st == "PROC":
                            break
                        if st == "ERR":
                            raise RuntimeError(f"NIXL WRITE failed (request {s['rid']})")
                        agent.release_xfer_handle(s["hs"].pop(0))
                        busy = True
                    if not s["hs"]:
                        s["t_done"] = time.monotonic_ns()
                if s["t_done"] is not None and s["rid"] in done_msgs:
                    if timed:
                        lat.append(s["t_done"] - s["t0"])
                        dec.append(done_msgs.pop(s["rid"]) - s["t0"])
                        t_end = max(t_end, s["t_done"])
                    free_src.extend(int(x) for x in s["src"])
                    free_dst.extend(int(x) for x in s["dst"])
                    slots[i] = None
                    busy = True
            for msgs in agent.get_new_notifs().values():
                for m in msgs:
                    d = proto.decode(m)
                    if d and d[0] == "kv_done":
                        done_msgs[d[1].get("r")] = int(d[1].get("t_ns", 0))
                        if not d[1].get("ok", True):
                            bad.append(f"request {d[1].get('r')}: " + (d[1].get("error") or
                                       f"{d[1].get('bad_pages')} bad pages, first bad byte at decode offset "
                                       f"{d[1].get('first_bad')}"))
            if busy:
                nap = POLL_MIN_S
            else:
                # Nothing moved: poll again later, backing off to POLL_MAX_S (a completion is
                # seen at most that late; a request takes ~1 s at these rates). Polling every
                # 50 us for a whole transfer took CPU the host's data plane needed.
                time.sleep(nap)
                nap = min(nap * 2, POLL_MAX_S)
        return t_end

    def tx_bytes() -> dict[str, int]:
        out = {}
        for dev in p.get("devs", []):
            try:
                with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
                    out[dev] = int(f.read())
            except (OSError, ValueError):
                pass
        return out

    if warm:
        run(warm, False)
    cpu0, t_start = time.process_time(), time.monotonic_ns()
    before = tx_bytes()
    t_end = run(requests, True)
    after = tx_bytes()
    wall = max(t_end - t_start, 1) / 1e9
    rails = [{"name": d, "bytes": after[d] - before[d]} for d in p.get("devs", []) if d in before and d in after]
    print(json.dumps({"lat_ns": lat, "decode_ns": dec, "wall_s": wall, **stats, "rails": rails, "bad": bad,
                      "checked": check, "nixl_prep": "prepped" if prepped else "fresh",
                      "cpu_pct": 100.0 * (time.process_time() - cpu0) / wall,
                      "ucx_tls": os.environ.get("UCX_TLS", "")}), flush=True)
    return 0


def _devs_for(ns: str, addrs: list[str]) -> list[str]:
    """Interfaces carrying `addrs` inside namespace `ns`."""
    res = subprocess.run(["ip", "-n", ns, "-j", "addr"], capture_output=True, text=True, timeout=10)
    by_addr = {a.get("local"): link["ifname"] for link in json.loads(res.stdout or "[]")
               for a in link.get("addr_info", [])}
    return [by_addr[a] for a in addrs if a in by_addr]  # rail order, as the rates are


def nixl_env(backend: str, engine: dict[str, Any] | None = None) -> dict[str, str]:
    """Environment for a NIXL process using `backend`: for MULTIRAIL, NIXL_PLUGIN_DIR (a
    `multirail nixl-plugin dir` directory, unless set) and the run's engine settings as
    `MULTIRAIL_*` (rails are per side: see run_nixl_kv)."""
    env = dict(os.environ)
    env.setdefault("UCX_TLS", "tcp")
    env.setdefault("UCX_LOG_LEVEL", "error")
    if backend != "MULTIRAIL":
        return env
    from multirail.bench.worker import BenchFailure
    from multirail.nixl_plugin import PluginError, make_dir

    if "NIXL_PLUGIN_DIR" not in env:
        try:
            env["NIXL_PLUGIN_DIR"] = str(make_dir())
        except PluginError as e:
            raise BenchFailure(f"the MULTIRAIL NIXL plugin is not usable: {e}") from e
    e = engine or {}
    for key, var in (("connections", "CONNECTIONS"), ("chunk_size", "CHUNK_SIZE"), ("policy", "POLICY"),
                     ("transport", "TRANSPORT"), ("progress", "PROGRESS"), ("spin_us", "SPIN_US"),
                     ("timeout", "TIMEOUT"), ("stall_timeout", "STALL_TIMEOUT"), ("secret", "SECRET")):
        v = e.get(key)
        if v is not None and f"MULTIRAIL_{var}" not in os.environ:
            env[f"MULTIRAIL_{var}"] = str(int(v) if key == "spin_us" else v)
    return env


def run_nixl_kv(plan: Any, warmup: int, seed: int, testbed: dict[str, Any] | None,
                timeout_s: float = 900.0, backend: str = "UCX", check: bool = False,
                engine: dict[str, Any] | None = None, corrupt: bool = False) -> Any:
    """Run the NIXL decode and prefill processes on `plan` with NIXL backend `backend`
    (UCX or MULTIRAIL); return a KvRow. `check`: verify every page (module docstring).
    `engine`: multirail engine settings for MULTIRAIL (bench's _engine_kwargs)."""
    from multirail.bench.kv import kv_row
    from multirail.bench.worker import BenchFailure

    if backend not in BACKENDS:
        raise BenchFailure(f"unknown NIXL backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    env = nixl_env(backend, engine)
    env_a, env_b = dict(env), dict(env)
    prefix_a: list[str] = []
    prefix_b: list[str] = []
    devs_b = ["lo"]
    if testbed:
        prefix_a = ["ip", "netns", "exec", testbed["ns_a"]]
        prefix_b = ["ip", "netns", "exec", testbed["ns_b"]]
        devs_a, devs_b = _devs_for(testbed["ns_a"], testbed["a"]), _devs_for(testbed["ns_b"], testbed["b"])
        if backend == "UCX" and devs_a and devs_b and "UCX_NET_DEVICES" not in os.environ:
            env_a["UCX_NET_DEVICES"], env_b["UCX_NET_DEVICES"] = ",".join(devs_a), ",".join(devs_b)
        if backend == "MULTIRAIL" and "MULTIRAIL_RAILS" not in os.environ:
            env_a["MULTIRAIL_RAILS"], env_b["MULTIRAIL_RAILS"] = ",".join(testbed["a"]), ",".join(testbed["b"])
    cmd = [sys.executable, "-m", "multirail.bench.kv_nixl"]
    geom = {"layout": plan.layout, "layers": plan.layers, "pool_pages": plan.pool_pages,
            "page_bytes": plan.page_bytes, "seed": seed} if check else {}
    errs = [tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")]
    target = subprocess.Popen(prefix_a + [*cmd, "target", str(plan.pool_bytes), str(timeout_s), backend,
                                          json.dumps(geom)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs[0], text=True, env=env_a)
    init = None
    try:
        first = ChildLines(target, errs[0]).json(60 + plan.pool_bytes / 2e8)
        if "error" in first:
            raise BenchFailure(f"NIXL decode ({backend}): {first['error']}")
        pj = json.dumps({"layers": plan.layers, "pages": plan.pages, "page_bytes": plan.page_bytes,
                         "pool_pages": plan.pool_pages, "layout": plan.layout, "requests": plan.requests,
                         "concurrency": plan.concurrency, "warmup": warmup, "seed": seed, "devs": devs_b,
                         "backend": backend, "check": check, "corrupt": corrupt})
        init = subprocess.Popen(prefix_b + [*cmd, "initiator", pj, first["meta"], str(first["addr"])],
                                stdout=subprocess.PIPE, stderr=errs[1], text=True, env=env_b)
        lines = ChildLines(init, errs[1])
        meta = lines.json(60 + plan.pool_bytes / 2e8)
        if "error" in meta:
            raise BenchFailure(f"NIXL prefill ({backend}): {meta['error']}")
        assert target.stdin is not None
        target.stdin.write(json.dumps({"meta": meta["meta"]}) + "\n")
        target.stdin.flush()
        d = lines.json(timeout_s)
        if "error" in d:
            raise BenchFailure(f"NIXL prefill ({backend}): {d['error']}")
        init.wait(30)
    finally:
        from multirail.bench.target import stop

        for p in (init, target):
            if p is not None:
                stop(p, grace=10)
        for f in errs:
            f.close()
    name = f"nixl-ucx({env['UCX_TLS']}) kv" if backend == "UCX" else "nixl-multirail kv"
    row = kv_row(name, "kv", plan, d["lat_ns"], d["wall_s"], d["decode_ns"],
                 transfers=d["transfers"], descs=d["descs"], prep=PREP_TEXT[d.get("nixl_prep", "fresh")],
                 prep_s=d["prep_s"], post_s=d["post_s"], build_s=d["build_s"])
    row.cpu_pct = d.get("cpu_pct")
    from multirail.bench.core import RailRow
    row.rails = [RailRow(name=r["name"], bytes=int(r["bytes"]), gbps=int(r["bytes"]) * 8 / d["wall_s"] / 1e9,
                         source=f"netdev:{r['name']}") for r in d.get("rails", [])]
    if not d.get("checked"):
        row.consistency = "not checked"
    elif d.get("bad"):
        row.consistency = f"FAILED: {d['bad'][0]}" + (f" (and {len(d['bad']) - 1} more)" if len(d["bad"]) > 1 else "")
    else:
        row.consistency = "ok"
    return row


class ChildLines:
    """Stdout lines of a child, read by a thread (NIXL logs to stdout too, in bursts; a buffered
    reader may already hold a line when the pipe has nothing left). `errf`: the file the child's
    stderr goes to, or None when it is `proc.stderr` (a pipe)."""

    def __init__(self, proc: subprocess.Popen[str], errf: Any = None) -> None:
        self.proc, self.errf = proc, errf
        self.q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.q.put(line)
        self.q.put(None)

    def json(self, timeout_s: float) -> dict[str, Any]:
        """The next line that is a JSON object."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": f"no result within {timeout_s:.0f} s"}
            try:
                line = self.q.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                if self.errf is not None:
                    self.errf.seek(0)
                    err = self.errf.read().strip()[-500:]
                else:
                    self.proc.wait(10)
                    err = self.proc.stderr.read().strip()[-500:] if self.proc.stderr else ""
                return {"error": f"exited ({self.proc.poll()}) without a result" + (f": {err}" if err else "")}
            if line.startswith("{"):
                try:
                    return dict(json.loads(line))
                except ValueError:
                    continue


def main(argv: list[str]) -> int:
    if argv[:1] == ["target"] and len(argv) == 5:
        return _target(int(argv[1]), float(argv[2]), argv[3], json.loads(argv[4]))
    if argv[:1] == ["initiator"] and len(argv) == 4:
        return _initiator(argv[1], argv[2], int(argv[3]))
    print("usage: python -m multirail.bench.kv_nixl target POOL_BYTES IDLE_S UCX|MULTIRAIL GEOM_JSON | "
          "initiator PLAN_JSON META_HEX REMOTE_ADDR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
