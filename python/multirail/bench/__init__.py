"""`multirail bench`: throughput and latency of READ/WRITE between two agents, with baselines.

Subcommands:
* `bench target --listen HOST:PORT`: registers one buffer and serves it (target.py).
* `bench initiator --connect HOST:PORT`: sweeps block sizes against a target (worker.py).
* `bench local`: starts a target process on this host (or, with `--testbed`, in the
  testbed's first namespace), runs the initiator against it (in-process, or in the second
  namespace), and with `--baseline` also runs iperf3 and mr-pingpong (baseline.py) and prints
  the ratios. `--testbed --chaos rail-flap` instead runs checked transfers while rails flap
  (chaos.py).
* `bench run --etcd-endpoints URL --benchmark-group NAME`: the same command on two hosts; etcd
  picks the target (rank 0) and the initiator (rank 1) and carries the target's address
  (coord.py, docs/bench.md).

`--metrics-port N` (every mode) serves Prometheus metrics of the process's agents (docs/metrics.md).

`--secret` (every mode) sets the shared secret of the handshake, overriding $MULTIRAIL_SECRET;
child processes get it through their environment, not their command line.

`--initiator-seg-type DRAM|VRAM --target-seg-type DRAM|VRAM` (every mode, nixlbench's names):
VRAM buffers are multirail.gpu.DeviceBuffers on `--device-id` of kind `--gpu cuda|standin`, the
target's allocated in the target process; tcp rails stage them through pinned buffers and each
row then carries the D2H / wire / H2D breakdown (staging.py). ucx rails take VRAM only with
GPUDirect RDMA (else the engine's GpuError says what is missing).

The sweep doubles the block size from `--start-block-size` to `--max-block-size`; each
transfer moves `--batch-size` blocks (one descriptor each) through one prepared handle that
is reused for every iteration. Rail byte counters are read around each timed loop (rails.py).
Exit codes: 0 ok, 1 runtime failure (connect, timeout, consistency), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from multirail.bench import protocol as proto
from multirail.bench.chaos import (CHAOS_ONLY, DEFAULT_DOWN_S, DEFAULT_DURATION_S, DEFAULT_SIZES,
                                   DEFAULT_UP_S, MODES)
from multirail.bench.core import (BenchRow, args_config, write_json, RailRow, UsageError, block_sizes,
                                  format_size, format_table, parse_size)
from multirail.bench.mem import add_mem_opts, check_gpu, check_mem_opts, gpu_ipc_setting, uses_vram
from multirail.bench.rails import RailCounters, resolve_rails
from multirail.bench.worker import (BenchFailure, EngineWorker, format_affinity, format_memory, format_transport,
                                    label_rail_transports, run_sweep)
from multirail.errors import AuthenticationError, MultirailError

LATENCY_SIZE = 4096
TRANSPORTS = ("tcp", "ucx", "auto")  # AgentConfig.transport values the bench offers (or one per rail: "ucx,tcp")
DEFAULT_TESTBED = "mrtb"  # multirail.testbed.DEFAULT_NAME (not imported: keeps `bench` light)


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _rails(text: str | None) -> list[str] | None:
    if not text:
        return None
    rails = [r.strip() for r in text.split(",") if r.strip()]
    if not rails:
        raise UsageError("--rails needs at least one interface or address")
    return rails


def _add_engine_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connections", type=int, default=1, help="connections per rail (default 1)")
    p.add_argument("--rails", help="comma-separated local interfaces or IPv4 addresses")
    p.add_argument("--policy", default="weighted", help="weighted | round_robin | pinned:N")
    p.add_argument("--chunk-size", default="1MiB", help="engine chunk size (default 1MiB)")
    p.add_argument("--timeout", type=float, default=10.0, help="per-transfer/connect timeout, s")
    p.add_argument("--stall-timeout", type=float, default=0.5,
                   help="a rail silent this long with work in flight is shut and its chunks reissued "
                        "on the other rails (default 0.5 s, the engine's; a local link that loses carrier is seen in ~0.1 s)")
    p.add_argument("--progress", default="adaptive", choices=["adaptive", "poll", "block"],
                   help="how waiting threads wait: busy-poll up to --spin-us then sleep (adaptive, "
                        "default), busy-poll until done (poll), or sleep at once (block)")
    p.add_argument("--spin-us", type=float, default=200.0, help="busy-poll budget, microseconds (default 200)")
    p.add_argument("--transport", default=os.environ.get("MULTIRAIL_TRANSPORT") or "auto",
                   help="what carries the rails (default: $MULTIRAIL_TRANSPORT, else auto): auto (ucx on rails with an "
                        "RDMA device and an RDMA-capable UCX, tcp elsewhere), tcp (multirail's own connections), ucx (UCX "
                        "one-sided get/put, one UCP context per rail; needs a UCX library: pip install "
                        "'multirail[ucx]', apt-get install libucx0, or MULTIRAIL_UCX_LIB), or one per rail, comma-separated "
                        "in --rails order (ucx,tcp: a link of mixed rails). Every agent of the run, "
                        "target processes included, uses it; the output names each rail's transport and why")
    p.add_argument("--target-name", default=proto.DEFAULT_TARGET_NAME, help="agent name of the target")
    p.add_argument("--total-buffer-size", help="buffer size (default: max block x batch)")
    p.add_argument("--secret", default=None,
                   help="shared secret of the handshake (overrides $MULTIRAIL_SECRET; both sides need the "
                        "same one). A command line is visible to other local users: prefer the variable there")
    p.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve Prometheus metrics of this process's agents on http://METRICS_HOST:N/metrics "
                        "(docs/metrics.md)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address of --metrics-port (default 127.0.0.1)")
    add_mem_opts(p)


def _add_sweep_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", default="READ", type=str.upper, choices=["READ", "WRITE", "MIXED"],
                   help="READ (default) or WRITE; MIXED (READs and WRITEs alternating) only with --chaos")
    p.add_argument("--start-block-size", default="4KiB")
    p.add_argument("--max-block-size", default="64MiB")
    p.add_argument("--batch-size", type=int, default=1, help="descriptors per transfer")
    p.add_argument("--num-iter", type=int, default=100, help="timed iterations per block size")
    p.add_argument("--warmup-iter", type=int, default=10)
    p.add_argument("--check-consistency", action="store_true",
                   help="verify every byte (READ: against the target's pattern; WRITE: target-side)")
    p.add_argument("--json", metavar="FILE", help="write results as JSON ('-' for stdout)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw throughput against block size, rails stacked, capacity line (pip install 'multirail[plot]')")
    p.add_argument("--latency-row", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trace", action="store_true",
                   help="keep every timed transfer's per-rail trace (bytes, chunks, first issue, last "
                        "completion, rate estimates) in the JSON's rows[].traces (docs/planner.md)")


def _add_target_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=900.0, help="exit after this many s (default 900)")
    p.add_argument("--idle-timeout", type=float, default=120.0,
                   help="exit after this many s without a control message (default 120)")
    p.add_argument("--corrupt-offset", type=int, default=None, help=argparse.SUPPRESS)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="measure READ/WRITE throughput and latency",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench_command", metavar="MODE")
    sub.required = True
    t = sub.add_parser("target", help="serve a buffer for an initiator")
    t.add_argument("--listen", required=True, metavar="HOST:PORT")
    _add_engine_opts(t)
    _add_target_opts(t)
    i = sub.add_parser("initiator", help="run the sweep against a target")
    i.add_argument("--connect", required=True, metavar="HOST:PORT")
    _add_engine_opts(i)
    _add_sweep_opts(i)
    l = sub.add_parser("local", help="target process + initiator on this host (or the testbed)")
    _add_engine_opts(l)
    _add_sweep_opts(l)
    _add_target_opts(l)
    l.add_argument("--baseline", action="store_true", help="also run iperf3 and mr-pingpong, print ratios")
    l.add_argument("--baseline-time", type=int, default=3, help="iperf3 -t seconds (default 3)")
    l.add_argument("--latency-iter", type=int, default=1000,
                   help="iterations of the 4KiB latency comparison (default 1000)")
    l.add_argument("--testbed", nargs="?", const=DEFAULT_TESTBED, default=None, metavar="NAME",
                   help=f"run target and initiator in the testbed's two namespaces (default name "
                        f"{DEFAULT_TESTBED}); --rails then takes testbed rail indices, e.g. 0 or 0,1")
    c = l.add_argument_group("chaos (with --testbed, root; docs/bench.md)")
    c.add_argument("--chaos", choices=list(MODES), default=None,
                   help="rail-flap: checked transfers back to back while testbed rails go down and up; reports "
                        "completed / failed / lost transfers and corrupted bytes (exit 1 on corruption or loss)")
    c.add_argument("--chaos-duration", type=float, default=None, metavar="SECONDS",
                   help=f"how long to flap and transfer (default {DEFAULT_DURATION_S:g})")
    c.add_argument("--flap-down-s", type=float, default=None, metavar="SECONDS",
                   help=f"seconds a rail stays down per flap (default {DEFAULT_DOWN_S:g})")
    c.add_argument("--flap-up-s", type=float, default=None, metavar="SECONDS",
                   help=f"seconds between flaps, all rails up (default {DEFAULT_UP_S:g})")
    c.add_argument("--flap-rails", default=None, metavar="I,J",
                   help="testbed rail indices that flap, one at a time in turn (default: every rail but 0)")
    c.add_argument("--chaos-sizes", default=None, metavar="S1,S2",
                   help=f"transfer sizes, cycled (default {DEFAULT_SIZES})")
    c.add_argument("--flap-how", choices=["link", "blackhole"], default=None,
                   help="link (default): the rail's device goes down (carrier lost); blackhole: its "
                        "traffic is silently dropped, carrier intact (only the stall timeout sees it)")
    from multirail.bench.kv import add_parser as _add_kv_parser
    k = _add_kv_parser(sub, _add_engine_opts, _add_target_opts, DEFAULT_TESTBED)
    from multirail.bench.coord import add_parser as _add_run_parser
    r = _add_run_parser(sub, _add_engine_opts, _add_sweep_opts, _add_target_opts)
    for sp in (t, i, l, k, r):
        sp.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    metrics = None
    try:
        if getattr(args, "metrics_port", None) is not None and args.bench_command != "run":  # run: per rank
            from multirail.metrics import serve as _serve_metrics
            metrics = _serve_metrics(args.metrics_port, args.metrics_host)
        if getattr(args, "plot", None):
            from multirail.bench.plot import require_matplotlib
            require_matplotlib()  # before a long run, not after it
            if getattr(args, "chaos", None):
                raise UsageError("--plot draws sweeps and kv runs; a --chaos run has no sweep to draw")
        if args.bench_command == "kv":
            from multirail.bench.kv import cmd_kv
            return cmd_kv(args)
        if args.bench_command == "run":
            from multirail.bench.coord import cmd_run
            return cmd_run(args)
        return {"target": _cmd_target, "initiator": _cmd_initiator, "local": _cmd_local}[args.bench_command](args)
    except UsageError as e:
        print(f"multirail bench: error: {e}", file=sys.stderr)
        return 2
    except BenchFailure as e:
        print(f"multirail bench: error: {e}", file=sys.stderr)
        return 1
    except MultirailError as e:
        hint = (" (both sides need the same shared secret: --secret or MULTIRAIL_SECRET)"
                if isinstance(e, AuthenticationError) else "")
        print(f"multirail bench: error: {type(e).__name__}: {e}{hint}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"multirail bench: error: the engine is not available ({e}); build the extension "
              "first (maturin develop)", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"multirail bench: error: {e}", file=sys.stderr)
        return 1
    finally:
        if metrics is not None:
            metrics.close()


# -- validation ---------------------------------------------------------------------------------

def _policy(text: str) -> str:
    """weighted | round_robin | pinned:N, checked here so a typo is a usage error, not a crash."""
    if text in ("weighted", "round_robin"):
        return text
    kind, sep, idx = text.partition(":")
    if kind == "pinned" and sep and idx.isdigit():
        return text
    raise UsageError(f"invalid --policy {text!r}: expected weighted, round_robin or pinned:N (N = rail index)")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.connections < 1:
        raise UsageError("--connections must be at least 1")
    if args.timeout <= 0 or args.stall_timeout <= 0:
        raise UsageError("--timeout and --stall-timeout must be positive")
    if args.secret is not None and not args.secret:
        raise UsageError("--secret must not be empty")
    transport = _transport(args)
    return dict(connections=args.connections, rails=_rails(args.rails), policy=_policy(args.policy),
                chunk_size=parse_size(args.chunk_size), timeout=args.timeout,
                stall_timeout=args.stall_timeout, secret=args.secret, progress=args.progress,
                spin_us=_spin_us(args), transport=transport, gpu=check_mem_opts(args, transport),
                gpu_ipc=gpu_ipc_setting(args))


def _transport(args: argparse.Namespace) -> str:
    t = str(getattr(args, "transport", "auto")).replace(" ", "")
    if not t or any(k not in TRANSPORTS for k in t.split(",")):
        raise UsageError(f"invalid --transport {t!r}: expected one of {', '.join(TRANSPORTS)}, "
                         "or one per rail, comma-separated (ucx,tcp)")
    return t


def check_transport(args: argparse.Namespace) -> None:
    """Fail fast, in this process, when the chosen transport cannot run here (ucx without a
    loadable UCX): the engine's TransportUnavailableError, before any child process is started
    (whose own error would otherwise arrive as the tail of its stderr)."""
    if "ucx" not in _transport(args).split(","):
        return
    import multirail  # lazy: the tool must import without the extension

    # UCX sessions need a shared secret (--secret or MULTIRAIL_SECRET): without one this probe
    # fails with the engine's message naming it.
    secret = {"auth_secret": args.secret} if getattr(args, "secret", None) else {}
    probe = multirail.Agent(f"mr-bench-transport-probe-{os.getpid()}",
                            {"host": "127.0.0.1", "port": 0, "transport": "ucx", **secret})
    probe.close()


def _spin_us(args: argparse.Namespace) -> float:
    if not 0 <= args.spin_us <= 1e6:
        raise UsageError("--spin-us must be between 0 and 1000000")
    return float(args.spin_us)


def _child_env(args: argparse.Namespace) -> dict[str, str] | None:
    """Environment of a child bench process: --secret travels as MULTIRAIL_SECRET (an
    environment is private to the user, a command line is not). None: inherit ours."""
    return {**os.environ, "MULTIRAIL_SECRET": args.secret} if args.secret else None


def _sweep(args: argparse.Namespace) -> tuple[list[int], int]:
    if args.op == "MIXED":
        raise UsageError("--op MIXED is only for chaos runs (bench local --testbed --chaos rail-flap)")
    sizes = block_sizes(parse_size(args.start_block_size), parse_size(args.max_block_size))
    if args.batch_size < 1 or args.num_iter < 1 or args.warmup_iter < 0:
        raise UsageError("--batch-size and --num-iter must be >= 1, --warmup-iter >= 0")
    need = sizes[-1] * args.batch_size
    if args.total_buffer_size:
        total = parse_size(args.total_buffer_size)
        if total < need:
            raise UsageError(f"--total-buffer-size {format_size(total)} is smaller than max block x batch "
                             f"({format_size(need)})")
        return sizes, total
    return sizes, need


# -- target -------------------------------------------------------------------------------------

def _cmd_target(args: argparse.Namespace) -> int:
    from multirail.bench.target import serve

    host, port = _hostport(args.listen)
    size = parse_size(args.total_buffer_size or "64MiB")
    if args.duration <= 0 or args.idle_timeout <= 0:
        raise UsageError("--duration and --idle-timeout must be positive")
    return serve(host=host, port=port, name=args.target_name, buffer_size=size,
                 duration=args.duration, idle_timeout=args.idle_timeout,
                 corrupt_offset=args.corrupt_offset, seg_type=args.target_seg_type, device=args.device_id,
                 **_engine_kwargs(args))


# -- initiator ----------------------------------------------------------------------------------

def _run_initiator(args: argparse.Namespace, host: str, port: int,
                   capacities_bps: list[float | None] | None = None
                   ) -> tuple[list[BenchRow], list[str], dict[str, Any]]:
    """The sweep against a target; rows, problems and the transport report (worker.transport_report)."""
    sizes, total = _sweep(args)
    eng = _engine_kwargs(args)
    rails = eng["rails"] or [_default_rail(host, port)]
    counters = RailCounters(resolve_rails(rails, capacities_bps), args.op)
    from multirail.bench.progress import make_progress
    progress = make_progress(enabled=args.json != "-")  # terminal: updating line; else a line per 10 s
    worker = EngineWorker(op=args.op, target_host=host, target_port=port, target_name=args.target_name,
                          buffer_size=total, fill_target=args.check_consistency and args.op == "READ",
                          seg_type=args.initiator_seg_type, target_seg_type=args.target_seg_type,
                          device=args.device_id, **eng)
    try:
        rows = run_sweep(worker, args.op, sizes, args.batch_size, args.num_iter, args.warmup_iter,
                         args.check_consistency, counters, progress, keepalive=worker.keepalive,
                         trace=args.trace)
        if args.latency_row and LATENCY_SIZE not in sizes:
            lat_iter = max(args.num_iter, getattr(args, "latency_iter", 1000))
            rows += run_sweep(worker, args.op, [LATENCY_SIZE], 1, lat_iter, args.warmup_iter,
                              False, counters, progress)
            rows[-1].worker = "multirail (latency row)"
        report = worker.transport_report()
    finally:
        progress.clear()
        worker.close()
    label_rail_transports(rows, report)
    return rows, counters.problems, report


def _default_rail(host: str, port: int) -> str:
    from multirail.bench.worker import local_addr_towards

    return local_addr_towards(host, port)


def _cmd_initiator(args: argparse.Namespace) -> int:
    host, port = _hostport(args.connect)
    _sweep(args)  # validate before connecting
    rows, problems, report = _run_initiator(args, host, port)
    return _emit(args, rows, [], problems, report)


# -- local --------------------------------------------------------------------------------------

def _testbed(name: str) -> dict[str, Any]:
    """The testbed's namespaces, rail addresses (a, b) and rates, from `testbed status --json`."""
    cmd = [sys.executable, "-m", "multirail", "testbed", "status", "--json", "--name", name]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise BenchFailure("`multirail testbed status` did not answer within 30 s") from None
    try:
        st = json.loads(res.stdout)
    except ValueError:
        raise BenchFailure(f"testbed {name!r} is not available: "
                           f"{(res.stderr or res.stdout).strip()[-400:] or 'no output'}") from None
    if not isinstance(st, dict) or not st.get("up"):
        problems = "; ".join(str(p) for p in (st.get("problems") or [])) if isinstance(st, dict) else ""
        raise BenchFailure(f"testbed {name!r} is not up{': ' + problems if problems else ''} "
                           f"(create it with `multirail testbed up --name {name} --rails 2 --rate 2gbit`)")
    if res.returncode != 0:
        raise BenchFailure(f"testbed {name!r} does not match its spec: "
                           + "; ".join(str(p) for p in st.get("problems", [])))
    try:
        ns_a, ns_b = st["namespaces"]["a"], st["namespaces"]["b"]
        rails = sorted(st["rails"], key=lambda r: r["index"])
        a = [r["a"]["addr"].split("/")[0] for r in rails]
        b = [r["b"]["addr"].split("/")[0] for r in rails]
        rates = [r.get("rate_bps") for r in rails]
    except (KeyError, TypeError, AttributeError) as e:
        raise BenchFailure(f"unexpected `testbed status --json` output ({e})") from None
    if not a:
        raise BenchFailure(f"testbed {name!r} has no rails")
    sysfs_b = ((st.get("topology") or {}).get("sysfs") or {}).get("b")  # `testbed up --gpu-near`
    return {"ns_a": ns_a, "ns_b": ns_b, "a": a, "b": b, "rates": rates, "sysfs_b": sysfs_b}


def _select_testbed_rails(tb: dict[str, Any], spec: str | None) -> dict[str, Any]:
    """With --testbed, `--rails 0,1` picks testbed rails by index (addresses differ per side)."""
    if not spec:
        return tb
    idx: list[int] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item.isdigit() or int(item) >= len(tb["a"]):
            raise UsageError(f"with --testbed, --rails takes rail indices 0..{len(tb['a']) - 1} "
                             f"(e.g. 0 or 0,1), not {spec!r}")
        if int(item) in idx:
            raise UsageError(f"--rails lists rail {item} twice")
        idx.append(int(item))
    return {**tb, **{k: [tb[k][i] for i in idx] for k in ("a", "b", "rates")}}


def _engine_argv(args: argparse.Namespace, rails: str | None, total: int) -> list[str]:
    argv = ["--connections", str(args.connections), "--policy", args.policy, "--chunk-size", args.chunk_size,
            "--timeout", str(args.timeout), "--stall-timeout", str(args.stall_timeout),
            "--target-name", args.target_name, "--total-buffer-size", str(total),
            "--progress", args.progress, "--spin-us", str(args.spin_us), "--transport", _transport(args)]
    return argv + mem_argv(args) + (["--rails", rails] if rails else [])


def mem_argv(args: argparse.Namespace) -> list[str]:
    """The memory options for a child bench process (both seg types: each side reads its own)."""
    argv = ["--initiator-seg-type", args.initiator_seg_type, "--target-seg-type", args.target_seg_type,
            "--device-id", str(args.device_id)]
    gpu = check_mem_opts(args, _transport(args))
    argv += ["--gpu", gpu] if gpu else []
    return argv + (["--gpu-ipc", args.gpu_ipc] if getattr(args, "gpu_ipc", None) else [])


def _start_target(args: argparse.Namespace, prefix: list[str], listen: str, rails: str | None,
                  total: int) -> tuple[subprocess.Popen[str], dict[str, Any], Any]:
    from multirail.bench.target import launch

    cmd = prefix + [sys.executable, "-m", "multirail", "bench", "target", "--listen", listen,
                    "--duration", str(args.duration), "--idle-timeout", str(args.idle_timeout)]
    cmd += _engine_argv(args, rails, total)
    if args.corrupt_offset is not None:
        cmd += ["--corrupt-offset", str(args.corrupt_offset)]
    try:
        return launch(cmd, env=_child_env(args))
    except RuntimeError as e:
        raise BenchFailure(str(e)) from None


def _kill(proc: subprocess.Popen[str]) -> None:
    from multirail.bench.target import stop

    stop(proc)


def _cmd_local(args: argparse.Namespace) -> int:
    if args.chaos:
        return _cmd_chaos(args)
    given = [f"--{k.replace('_', '-')}" for k in CHAOS_ONLY if getattr(args, k) is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: only with --chaos rail-flap")
    sizes, total = _sweep(args)
    _engine_kwargs(args)
    if args.duration <= 0 or args.idle_timeout <= 0 or args.baseline_time < 1:
        raise UsageError("--duration, --idle-timeout and --baseline-time must be positive")
    check_transport(args)
    check_gpu(args)
    if args.testbed:
        tb = _select_testbed_rails(_testbed(args.testbed), args.rails)
        prefix_a, prefix_b = ["ip", "netns", "exec", tb["ns_a"]], ["ip", "netns", "exec", tb["ns_b"]]
        if tb.get("sysfs_b"):
            # The testbed's pretend GPUs: the initiator's topology (affinity) reads its tree.
            prefix_b += ["env", f"MULTIRAIL_SYSFS_ROOT={tb['sysfs_b']}"]
        host, t_rails, i_rails = tb["a"][0], ",".join(tb["a"]), ",".join(tb["b"])
    else:
        tb = None
        prefix_a, prefix_b = [], []
        host, t_rails, i_rails = "127.0.0.1", args.rails, args.rails
    args.latency_row = args.baseline
    proc, ready, errf = _start_target(args, prefix_a, f"{host}:0", t_rails, total)
    try:
        port = int(ready["port"])
        if tb:
            rows, problems, report = _initiator_subprocess(args, prefix_b, host, port, i_rails, total, tb["rates"])
        else:
            rows, problems, report = _run_initiator(args, host, port)
    finally:
        _kill(proc)
        errf.close()
    report["target_transport"] = ready.get("transport")
    baselines: list[BenchRow] = []
    if args.baseline:
        baselines, more = _baselines(args, host, prefix_a, prefix_b)
        problems += more
    return _emit(args, rows, baselines, problems, report)


def _cmd_chaos(args: argparse.Namespace) -> int:
    from multirail.bench.chaos import cmd_chaos, options_from_args

    opts = options_from_args(args)
    _engine_kwargs(args)
    if uses_vram(args):
        raise UsageError("--chaos runs move DRAM only: drop --initiator-seg-type/--target-seg-type VRAM")
    check_transport(args)
    _testbed(args.testbed)  # up and matching its spec, else a clear error
    return cmd_chaos(opts, args.json)


def _initiator_subprocess(args: argparse.Namespace, prefix: list[str], host: str, port: int, rails: str,
                          total: int, rates: list[float | None]
                          ) -> tuple[list[BenchRow], list[str], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        cmd = prefix + [sys.executable, "-m", "multirail", "bench", "initiator", "--connect", f"{host}:{port}",
                        "--op", args.op, "--start-block-size", args.start_block_size,
                        "--max-block-size", args.max_block_size, "--batch-size", str(args.batch_size),
                        "--num-iter", str(args.num_iter), "--warmup-iter", str(args.warmup_iter),
                        "--json", out] + _engine_argv(args, rails, total)
        cmd += ["--check-consistency"] if args.check_consistency else []
        cmd += ["--latency-row"] if args.latency_row else []
        cmd += ["--trace"] if args.trace else []
        limit = args.duration
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=_child_env(args))
        except subprocess.TimeoutExpired:
            raise BenchFailure(f"initiator in the testbed did not finish within {limit:.0f} s") from None
        if not os.path.exists(out):
            raise BenchFailure(f"initiator failed: {res.stderr.strip()[-800:]}")
        with open(out) as f:
            data = json.load(f)
    rows = [_row_from_json(r) for r in data["rows"]]
    for r in rows:  # capacities are known here, not inside the namespace
        for i, rail in enumerate(r.rails):
            if i < len(rates) and rates[i]:
                rail.capacity_gbps = float(rates[i]) / 1e9  # type: ignore[arg-type]
    report = data.get("transport") or {"transport": _transport(args), "rails": []}
    if data.get("memory"):
        report["memory"] = data["memory"]
    return rows, list(data.get("problems", [])), report


def _row_from_json(d: dict[str, Any]) -> BenchRow:
    d = dict(d)
    d["rails"] = [RailRow(**x) for x in d.get("rails", [])]
    d["engine_rails"] = [RailRow(**x) for x in d.get("engine_rails", [])]
    return BenchRow(**{k: v for k, v in d.items() if k in BenchRow.__dataclass_fields__})


def _baselines(args: argparse.Namespace, host: str, prefix_a: list[str],
               prefix_b: list[str]) -> tuple[list[BenchRow], list[str]]:
    from multirail.bench.baseline import run_iperf3, run_pingpong

    rows, problems = [], []
    try:
        rows.append(run_iperf3(host, args.connections, args.baseline_time, args.op, prefix_a, prefix_b))
    except BenchFailure as e:
        problems.append(f"iperf3 baseline skipped: {e}")
    for poll in (False, True):  # like with like: blocking and busy-polling raw TCP
        try:
            rows.append(run_pingpong(LATENCY_SIZE, args.latency_iter, min(args.latency_iter, 200), host,
                                     prefix_a, prefix_b, poll=poll))
        except BenchFailure as e:
            problems.append(f"mr-pingpong{' --poll' if poll else ''} baseline skipped: {e}")
    if args.testbed:
        problems.append("NIXL latency baseline: only on loopback (bench local without --testbed)")
    else:
        from multirail.bench.nixl_latency import nixl_available, run_nixl_latency
        if nixl_available():
            try:
                rows.append(run_nixl_latency(LATENCY_SIZE, args.latency_iter, min(args.latency_iter, 200)))
            except BenchFailure as e:
                problems.append(f"NIXL latency baseline skipped: {e}")
        else:
            problems.append("NIXL latency baseline skipped: NIXL is not installed (pip install nixl-cu12)")
    return rows, problems


def ratios(rows: list[BenchRow], baselines: list[BenchRow], progress: str = "adaptive") -> dict[str, Any]:
    """Throughput of the largest block vs iperf3; 4KiB latency vs the raw TCP ping-pong that waits
    the same way (blocking for --progress block, busy-polling otherwise) and vs NIXL."""
    out: dict[str, Any] = {}
    sweep = [r for r in rows if r.worker == "multirail"]
    iperf = next((b for b in baselines if b.worker.startswith("iperf3")), None)
    polling = progress != "block"
    want = "mr-pingpong-poll" if polling else "mr-pingpong"
    ping = next((b for b in baselines if b.worker == want), None)
    nixl = next((b for b in baselines if b.worker.startswith("nixl")), None)
    if sweep and iperf and iperf.gbps > 0:
        big = max(sweep, key=lambda r: r.block_size)
        out["throughput_pct_of_iperf3"] = 100.0 * big.gbps / iperf.gbps
        out["throughput_text"] = (f"multirail {big.op} {format_size(big.block_size)} = "
                                  f"{out['throughput_pct_of_iperf3']:.1f}% of {iperf.worker} "
                                  f"({big.gbps:.2f} vs {iperf.gbps:.2f} Gbps)")
    small = next((r for r in rows if r.block_size == LATENCY_SIZE and r.batch_size == 1), None)
    if small and ping and ping.lat_p50_us > 0:
        out["p50_x_pingpong"] = small.lat_p50_us / ping.lat_p50_us
        out["p99_x_pingpong"] = small.lat_p99_us / ping.lat_p99_us
        out["pingpong_worker"] = ping.worker
        out["latency_text"] = (f"4KiB {small.op} ({progress}) p50 = {out['p50_x_pingpong']:.2f}x "
                               f"{'polling' if polling else 'blocking'} raw TCP ping-pong "
                               f"({small.lat_p50_us:.1f} vs {ping.lat_p50_us:.1f} us); p99 = "
                               f"{out['p99_x_pingpong']:.2f}x ({small.lat_p99_us:.1f} vs {ping.lat_p99_us:.1f} us)")
    if small and nixl and nixl.lat_p50_us > 0:
        out["p50_x_nixl"] = small.lat_p50_us / nixl.lat_p50_us
        out["p99_x_nixl"] = small.lat_p99_us / nixl.lat_p99_us
        out["nixl_text"] = (f"4KiB {small.op} ({progress}) vs {nixl.worker}: p50 {out['p50_x_nixl']:.2f}x "
                            f"({small.lat_p50_us:.1f} vs {nixl.lat_p50_us:.1f} us), p99 {out['p99_x_nixl']:.2f}x "
                            f"({small.lat_p99_us:.1f} vs {nixl.lat_p99_us:.1f} us)")
    if small and small.cpu_pct is not None:
        out["waiter_cpu_pct"] = small.cpu_pct
        out["cpu_text"] = (f"progress {progress}: the waiting thread used {small.cpu_pct:.0f}% of a core "
                           f"during the 4KiB loop" + (f" (NIXL's: {nixl.cpu_pct:.0f}%)" if nixl and nixl.cpu_pct
                                                      is not None else ""))
    return out


def _emit(args: argparse.Namespace, rows: list[BenchRow], baselines: list[BenchRow], problems: list[str],
          transport: dict[str, Any] | None = None) -> int:
    rat = ratios(rows, baselines, getattr(args, "progress", "adaptive"))
    text_out = sys.stderr if args.json == "-" else sys.stdout
    transport = dict(transport or {"transport": getattr(args, "transport", "tcp"), "rails": []})
    memory = transport.pop("memory", None)
    print(format_table(rows), file=text_out)
    print(format_transport(transport), file=text_out)
    aff = format_affinity(transport, getattr(args, "gpu_index", None))
    if aff:
        print(aff, file=text_out)
    print(format_memory(memory, transport), file=text_out)
    notes = {r.staging["target_note"] for r in rows if r.staging and r.staging.get("target_note")}
    for note in sorted(notes):
        problems = problems + [f"target staging not measured ({note}): the breakdown shows the initiator's stages only"]
    print(f"progress: {getattr(args, 'progress', 'adaptive')} (spin {getattr(args, 'spin_us', 200.0):g} us)",
          file=text_out)
    for b in baselines:
        if not b.worker.startswith("iperf3"):
            cpu = f", waiting thread {b.cpu_pct:.0f}% CPU" if b.cpu_pct is not None else ""
            print(f"baseline {b.worker} {format_size(b.block_size)}: avg {b.lat_avg_us:.1f} us, "
                  f"p50 {b.lat_p50_us:.1f} us, p99 {b.lat_p99_us:.1f} us{cpu}", file=text_out)
        else:
            print(f"baseline {b.worker}: {b.gbps:.2f} Gbps ({b.gb_per_s:.3f} GB/s)", file=text_out)
    for key in ("throughput_text", "latency_text", "nixl_text", "cpu_text"):
        if key in rat:
            print(rat[key], file=text_out)
    for p in problems:
        print(f"note: {p}", file=sys.stderr)
    failed = [r for r in rows if r.consistency.startswith("FAILED")]
    if getattr(args, "plot", None):
        from multirail.bench.plot import plot_sweep
        plot_sweep(rows, baselines, args.plot, title=f"multirail bench {args.bench_command} {args.op}")
        print(f"plot: {args.plot}", file=text_out)
    if args.json:
        write_json({"rows": [r.to_json() for r in rows], "baselines": [b.to_json() for b in baselines],
                    "ratios": rat, "problems": problems, "transport": transport, "memory": memory,
                    "config": args_config(args)},
                   args.json)
    if failed:
        print(f"multirail bench: consistency check FAILED for {len(failed)} block size(s): "
              f"{failed[0].consistency}", file=sys.stderr)
        return 1
    return 0
