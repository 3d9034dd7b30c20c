"""`multirail bench run`: the same command on two hosts, coordinated through etcd (nixlbench-style).

    multirail bench run --etcd-endpoints http://ETCD:2379 --benchmark-group G [sweep options]

Each process claims a rank with a create-if-absent transaction under its own etcd lease:
the first to create ``/multirail/bench/G/rank/0`` is rank 0, the *target*; the next creates
``.../rank/1`` and is rank 1, the *initiator*; a third finds both taken and exits 1.

* rank 0 starts a `bench target` process (target.py, as `bench local` does) on ``--listen``
  (default: its address towards etcd, or the first ``--rails`` address; port 0), publishes
  ``.../G/target`` = ``{"host", "port", "agent", "buffer_size"}``, waits up to
  ``--coord-timeout`` for rank 1, then serves until the initiator stops it (`bench:stop`).
  If rank 1's key vanishes first (the initiator died), the target is stopped and rank 0 exits 1.
* rank 1 waits up to ``--coord-timeout`` for ``.../G/target`` and runs the usual sweep against
  that address (`_run_initiator`: EngineWorker + run_sweep); it prints the table / JSON.

Waiting is an etcd watch, never a sleep loop. Every key lives under its rank's lease: a rank
that exits revokes it (nothing is left), a killed rank's keys expire within the lease TTL
(10 s). A rank whose peer never comes exits 1 with a message naming what it waited for.
``--metrics-port N``: rank 1 serves its agent's metrics, rank 0 its target process's.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
import threading
import uuid
from typing import Any, Callable

from multirail.bench.core import UsageError
from multirail.bench.worker import BenchFailure

KEY_ROOT = "/multirail/bench"
COORD_TTL = 10.0
#: how long rank 0 gives its target to exit by itself once rank 1 has left
STOP_GRACE_S = 10.0


def add_parser(sub: Any, engine_opts: Callable[[argparse.ArgumentParser], None],
               sweep_opts: Callable[[argparse.ArgumentParser], None],
               target_opts: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    r = sub.add_parser("run", help="the same command on both hosts: etcd picks the target (rank 0) and the "
                                   "initiator (rank 1), and carries the target's address (nixlbench-style)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_opts(r)
    sweep_opts(r)
    target_opts(r)
    g = r.add_argument_group("coordination through etcd")
    g.add_argument("--etcd-endpoints", required=True, metavar="URL[,URL]",
                   help="etcd client URLs, e.g. http://10.0.0.5:2379 (etcd >= 3.4)")
    g.add_argument("--benchmark-group", default="default", metavar="NAME",
                   help="ranks with the same group name pair up (default 'default')")
    g.add_argument("--coord-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long a rank waits for the other one (default 60)")
    g.add_argument("--listen", default=None, metavar="HOST[:PORT]",
                   help="rank 0's side-channel address (default: the local address towards etcd, or the "
                        "first --rails address; port 0)")
    g.add_argument("--coord-ttl", type=float, default=COORD_TTL, help=argparse.SUPPRESS)
    return r


def _say(msg: str) -> None:
    print(f"multirail bench run: {msg}", file=sys.stderr, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    from multirail import bench as B
    from multirail.errors import InvalidArgumentError, MetadataStoreError
    from multirail.metadata import EtcdClient, acquire_lease, parse_endpoints, release_lease

    B._sweep(args)  # usage errors before anything is started
    B._engine_kwargs(args)
    if not args.coord_timeout > 0 or not args.coord_ttl >= 1:
        raise UsageError("--coord-timeout must be positive")
    if args.duration <= 0 or args.idle_timeout <= 0:
        raise UsageError("--duration and --idle-timeout must be positive")
    group = args.benchmark_group
    if not group or "/" in group or len(group) > 200:
        raise UsageError(f"--benchmark-group must be 1..200 characters without '/', not {group!r}")
    try:
        addr = parse_endpoints(args.etcd_endpoints)
    except InvalidArgumentError as e:
        raise UsageError(f"--etcd-endpoints: {e}") from None
    timeout = min(5.0, args.coord_timeout)
    root = f"{KEY_ROOT}/{group}".encode()
    try:
        lease = acquire_lease(addr, args.coord_ttl, timeout, shared=False)
    except MetadataStoreError as e:
        raise BenchFailure(f"cannot reach etcd at {args.etcd_endpoints}: {e}") from None
    client = EtcdClient(addr, timeout)
    try:
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "run": uuid.uuid4().hex}).encode()
        rank = next((r for r in (0, 1) if lease.create(root + b"/rank/%d" % r, me)), None)
        if rank is None:
            holders = [json.loads(v).get("host", "?") for _, v, _ in client.get_prefix(root + b"/rank/")]
            raise BenchFailure(f"benchmark group {group!r} already has ranks 0 and 1 (on {', '.join(holders)}): use "
                               f"another --benchmark-group, or wait up to {args.coord_ttl:g} s for the keys of a "
                               "killed run to expire")
        _say(f"rank {rank} of benchmark group {group!r} ({'target' if rank == 0 else 'initiator'}), "
             f"etcd at {args.etcd_endpoints}")
        return _rank0(args, lease, client, root) if rank == 0 else _rank1(args, client, root)
    except MetadataStoreError as e:
        raise BenchFailure(f"etcd at {args.etcd_endpoints}: {e}") from None
    finally:
        client.close()
        release_lease(lease)  # revoked: this rank's keys are gone


def _listen(args: argparse.Namespace) -> tuple[str, int]:
    from multirail import bench as B
    from multirail.bench.worker import local_addr_towards

    if args.listen:
        text = args.listen.strip()
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else "0"
        elif text.count(":") == 1:
            host, port = text.split(":")
        else:  # a host name, an IPv4 address, or a bare IPv6 address
            host, port = text, "0"
        if not host or not port.isdigit() or int(port) > 65535:
            raise UsageError(f"--listen expects HOST or HOST:PORT, not {args.listen!r}")
        return host, int(port)
    for rail in B._rails(args.rails) or []:
        try:
            ipaddress.ip_address(rail)
            return rail, 0
        except ValueError:
            break
    from multirail.metadata import parse_endpoints

    host, port = parse_endpoints(args.etcd_endpoints).endpoints[0]
    return local_addr_towards(host, port), 0


def _rank0(args: argparse.Namespace, lease: Any, client: Any, root: bytes) -> int:
    from multirail import bench as B
    from multirail.bench.target import launch, stop
    from multirail.errors import TransferTimeoutError
    from multirail.metadata import Watch, wait_for_key

    _, total = B._sweep(args)
    host, port = _listen(args)
    # The target's own limits start now, before rank 1 may have come: give it the wait on top.
    cmd = [sys.executable, "-m", "multirail", "bench", "target", "--listen", f"{host}:{port}",
           "--duration", str(args.duration + args.coord_timeout),
           "--idle-timeout", str(args.idle_timeout + args.coord_timeout)]
    cmd += B._engine_argv(args, args.rails, total)
    if args.metrics_port is not None:
        cmd += ["--metrics-port", str(args.metrics_port), "--metrics-host", args.metrics_host]
    try:
        proc, ready, errf = launch(cmd, env=B._child_env(args))
    except RuntimeError as e:
        raise BenchFailure(str(e)) from None
    try:
        target = {"host": ready["host"], "port": int(ready["port"]), "agent": ready["agent"],
                  "buffer_size": int(ready["buffer_size"])}
        lease.put(root + b"/target", json.dumps(target).encode(), must=True)
        _say(f"target {target['agent']!r} serving at {target['host']}:{target['port']}; waiting up to "
             f"{args.coord_timeout:g} s for rank 1")
        try:
            _, mod = wait_for_key(client, root + b"/rank/1", args.coord_timeout)
        except TransferTimeoutError:
            raise BenchFailure(f"no initiator (rank 1) joined benchmark group {args.benchmark_group!r} within "
                               f"{args.coord_timeout:g} s: run the same command on the other host (or raise "
                               "--coord-timeout)") from None
        _say("rank 1 joined; serving until it stops the target")
        done, gone = threading.Event(), threading.Event()

        def waiter() -> None:
            proc.wait()
            done.set()

        def on_event(kind: str, key: bytes, value: bytes, m: int) -> None:
            if kind == "DELETE":
                gone.set()
                done.set()

        threading.Thread(target=waiter, name="bench-target-wait", daemon=True).start()
        w = Watch(client, root + b"/rank/1", start_revision=mod + 1, on_event=on_event, name="bench-rank1-watch")
        try:
            done.wait(args.duration + args.coord_timeout + 30)
        finally:
            w.stop()
        if proc.poll() is None and gone.is_set():
            try:  # rank 1 may have stopped the target just before it left
                proc.wait(timeout=STOP_GRACE_S)
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: handled below
                pass
        if proc.poll() is None:
            raise BenchFailure("rank 1 (initiator) left the group without stopping the target" if gone.is_set()
                               else f"the target did not finish within {args.duration:g} s")
        reason = _exit_reason(proc)
        if proc.returncode != 0:
            errf.seek(0)
            raise BenchFailure(f"the target exited with code {proc.returncode} ({reason or 'no reason given'}): "
                               f"{errf.read().strip()[-800:]}")
        _say("done: the initiator stopped the target")
        return 0
    finally:
        stop(proc)
        errf.close()


def _exit_reason(proc: Any) -> str | None:
    try:
        out = proc.stdout.read() if proc.stdout else ""
    except (OSError, ValueError):
        return None
    for line in reversed(out.splitlines()):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("event") == "exit":
            return str(d.get("reason"))
    return None


def _rank1(args: argparse.Namespace, client: Any, root: bytes) -> int:
    from multirail import bench as B
    from multirail.errors import TransferTimeoutError
    from multirail.metadata import wait_for_key

    try:
        value, _ = wait_for_key(client, root + b"/target", args.coord_timeout)
    except TransferTimeoutError:
        raise BenchFailure(f"the target (rank 0) of benchmark group {args.benchmark_group!r} did not publish its "
                           f"address within {args.coord_timeout:g} s") from None
    try:
        t = json.loads(value)
        host, port, args.target_name = str(t["host"]), int(t["port"]), str(t["agent"])
    except (ValueError, KeyError, TypeError) as e:
        raise BenchFailure(f"unusable target record in etcd ({e}): {value[:200]!r}") from None
    _say(f"target {args.target_name!r} at {host}:{port}")
    metrics = None
    if args.metrics_port is not None:
        from multirail.metrics import serve

        metrics = serve(args.metrics_port, args.metrics_host)
    try:
        rows, problems, report = B._run_initiator(args, host, port)
    finally:
        if metrics is not None:
            metrics.close()
    return B._emit(args, rows, [], problems, report)
