"""`multirail fabric`: plan a rail-optimized fabric and emulate it in network namespaces.

Subcommands::

    multirail fabric validate TOPOLOGY.yaml            # parse + validate only
    multirail fabric plan TOPOLOGY.yaml --out DIR      # netplan, FRR and NX-OS configs
    multirail fabric up TOPOLOGY.yaml [--prefix P]     # namespaces + FRR, wait for convergence
    multirail fabric verify [TOPOLOGY.yaml] [--json]   # BGP/BFD/ECMP/policy/reach/MTU checks
    multirail fabric status [TOPOLOGY.yaml] [--json]   # namespaces and rail addresses
    multirail fabric down [TOPOLOGY.yaml] [--prefix P] # remove everything `up` created

Modules: :mod:`.model` (YAML -> validated dataclasses), :mod:`.plan` (pure renderers),
:mod:`.emulate` (namespaces + FRR). Nothing here imports the engine (``multirail._core``).
Exit codes: 0 ok, 1 a check failed or the fabric could not be built, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from multirail.fabric.emulate import Instance

from multirail.fabric.model import Topology, TopologyError, load_topology

EXIT_OK, EXIT_FAIL, EXIT_INPUT = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("fabric", help="plan and emulate a rail-optimized fabric",
                              description="Plan a rail-optimized eBGP fabric (netplan, FRR, NX-OS) "
                                          "and emulate it in network namespaces with FRR.")
    sub = p.add_subparsers(dest="fabric_command", metavar="SUBCOMMAND")
    sub.required = True

    v = sub.add_parser("validate", help="validate a topology file")
    v.add_argument("topology")
    v.set_defaults(func=_cmd_validate)

    pl = sub.add_parser("plan", help="render per-server netplan, per-router FRR and NX-OS configs")
    pl.add_argument("topology")
    pl.add_argument("--out", required=True, help="output directory (created)")
    pl.add_argument("--no-netplan-check", action="store_true", help="skip `netplan generate --root-dir`")
    pl.set_defaults(func=_cmd_plan)

    def instance_args(sp: argparse.ArgumentParser, topology_required: bool) -> None:
        sp.add_argument("topology", nargs=None if topology_required else "?",
                        help="topology file" + ("" if topology_required else " (or give --prefix / --state-dir)"))
        sp.add_argument("--prefix", help="namespace name prefix (default: mr-<topology name>)")
        sp.add_argument("--state-dir", help="state directory (default: /run/multirail-fabric/<prefix>)")

    u = sub.add_parser("up", help="emulate the fabric in namespaces with FRR and wait for convergence")
    instance_args(u, True)
    u.add_argument("--timeout", type=float, default=60.0, help="convergence timeout in seconds (default 60)")
    u.set_defaults(func=_cmd_up)

    d = sub.add_parser("down", help="tear the emulated fabric down (also after a partial up)")
    instance_args(d, False)
    d.set_defaults(func=_cmd_down)

    ve = sub.add_parser("verify", help="check BGP, BFD, ECMP, policy routing, reachability, MTU")
    instance_args(ve, False)
    ve.add_argument("--json", action="store_true", help="print the result as JSON")
    ve.set_defaults(func=_cmd_verify)

    st = sub.add_parser("status", help="namespaces, rail addresses and daemons of the emulated fabric")
    instance_args(st, False)
    st.add_argument("--json", action="store_true", help="print the result as JSON")
    st.set_defaults(func=_cmd_status)


def _err(msg: str) -> None:
    print(f"multirail fabric: {msg}", file=sys.stderr)


def _load(path: str) -> Topology:
    return load_topology(path)


def _cmd_validate(args: argparse.Namespace) -> int:
    try:
        topo = _load(args.topology)
    except TopologyError as exc:
        _err(str(exc))
        return EXIT_INPUT
    print(f"{args.topology}: ok: fabric {topo.name}: {len(topo.spines)} spines, {len(topo.leaves)} leaves (rails), "
          f"{len(topo.servers)} servers, {len(topo.links)} links")
    return EXIT_OK


def _cmd_plan(args: argparse.Namespace) -> int:
    from multirail.fabric.plan import write_plan

    try:
        topo = _load(args.topology)
    except TopologyError as exc:
        _err(str(exc))
        return EXIT_INPUT
    out = Path(args.out)
    try:
        res = write_plan(topo, out, validate_netplan=not args.no_netplan_check)
    except OSError as exc:
        _err(f"cannot write to {out}: {exc.strerror or exc}")
        return EXIT_FAIL
    for f in res.files:
        print(f"wrote {f}")
    for n in res.notes:
        print(f"note: {n}")
    if res.problems:
        _err("generated netplan failed validation:\n  " + "\n  ".join(res.problems))
        return EXIT_FAIL
    print(f"plan for {topo.name}: {len(res.files)} files in {out}")
    return EXIT_OK


def _instance(args: argparse.Namespace, fresh: bool) -> Instance:
    from multirail.fabric import emulate

    topo = _load(args.topology) if args.topology else None
    if fresh:
        assert topo is not None
        return emulate.Instance.create(topo, args.prefix, args.state_dir, str(Path(args.topology).resolve()))
    try:
        return emulate.Instance.load(args.prefix, args.state_dir, topo)
    except emulate.NotUpError:
        if topo is None:
            raise
        return emulate.Instance.create(topo, args.prefix, args.state_dir)


Command = Callable[[argparse.Namespace], int]


def _guard(fn: Command) -> Command:
    """Map expected errors onto a message and an exit code (never a traceback)."""
    def wrapped(args: argparse.Namespace) -> int:
        from multirail.fabric.emulate import FabricError

        try:
            return fn(args)
        except TopologyError as exc:
            _err(str(exc))
            return EXIT_INPUT
        except FabricError as exc:
            _err(str(exc))
            return EXIT_FAIL
    wrapped.__doc__ = fn.__doc__
    return wrapped


@_guard
def _cmd_up(args: argparse.Namespace) -> int:
    from multirail.fabric import emulate

    inst = _instance(args, fresh=True)
    emulate.preflight()
    print(f"bringing up fabric {inst.topo.name} as {inst.prefix} (state in {inst.state_dir})")
    secs = emulate.up(inst, timeout=args.timeout)
    print(f"converged in {secs:.1f} s: all BGP sessions Established, ECMP installed")
    for s in inst.status()["servers"]:
        print(f"  {s['namespace']}: " + ", ".join(f"rail {r['rail']} {r['nic']} {r['address']}" for r in s["rails"]))
    return EXIT_OK


@_guard
def _cmd_down(args: argparse.Namespace) -> int:
    from multirail.fabric import emulate

    try:
        inst = _instance(args, fresh=False)
    except emulate.NotUpError:
        print("nothing to remove: no state for that fabric (give the topology file to also look for its namespaces)")
        return EXIT_OK
    done = emulate.down(inst)
    if not done:
        print(f"nothing to remove for {inst.prefix}: no namespaces, daemons or state left")
    return EXIT_OK


@_guard
def _cmd_verify(args: argparse.Namespace) -> int:
    from multirail.fabric import emulate

    inst = _instance(args, fresh=False)
    checks = emulate.verify(inst)
    if args.json:
        print(json.dumps(emulate.checks_json(checks), indent=1))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<{width}}  {c.evidence}")
        failed = sum(not c.ok for c in checks)
        print(f"{len(checks) - failed}/{len(checks)} checks passed" + (f", {failed} FAILED" if failed else ""))
    return EXIT_OK if all(c.ok for c in checks) else EXIT_FAIL


@_guard
def _cmd_status(args: argparse.Namespace) -> int:
    inst = _instance(args, fresh=False)
    st = inst.status()
    if args.json:
        print(json.dumps(st, indent=1))
        return EXIT_OK
    print(f"fabric {inst.topo.name} as {st['prefix']}: phase {st['phase']}, namespaces "
          f"{'present' if st['namespaces_present'] else 'MISSING'} (state {st['state_dir']})")
    for s in st["servers"]:
        print(f"  server {s['namespace']}: " + ", ".join(f"rail {r['rail']} {r['nic']} {r['address']}" for r in s["rails"]))
    for r in st["routers"]:
        alive = ", ".join(f"{d} {pid or 'DOWN'}" for d, pid in r["daemons"].items())
        print(f"  {r['role']} {r['namespace']} AS {r['asn']}: {alive}")
    return EXIT_OK


__all__ = ["register", "Topology", "TopologyError", "load_topology"]
