"""`multirail` command line: one subcommand per tool module.

Each tool module (bench, doctor, topology, testbed, fabric) exposes `register(subparsers)`, which adds
its parser and sets `func` (called with the parsed args, returning an exit code). Tool modules
import the engine (`multirail._core`) lazily so that doctor/testbed/fabric work even where the
extension is not built.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

TOOLS = ("bench", "doctor", "topology", "testbed", "fabric", "nixl_plugin")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="multirail", description="multi-rail transfer engine and tools")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in TOOLS:
        mod = importlib.import_module(f"multirail.{name}")
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed: not an error worth a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
