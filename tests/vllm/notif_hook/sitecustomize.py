"""Observation only, for `make vllm-check`'s decode-TP-2 run (tests/vllm/check.py).

The check puts this directory first on PYTHONPATH of its prefill server, with
PD_CHECK_NOTIF_LOG naming a file. Python imports `sitecustomize` at the start of every process,
so this reaches vLLM's engine process too (it runs apart from the API server's process, where a
patch in serve.py would not reach it). When NIXL's Python API module (`nixl_cu13._api`, or
`nixl_cu12._api`) is imported, `nixl_agent.get_new_notifs` is wrapped: every notification it
returns is appended to the file as one JSON line {"agent": sender, "msg": text}, and the result
is returned unchanged. The check counts them per request (one from each decode worker).
Without PD_CHECK_NOTIF_LOG nothing is done.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
from types import ModuleType
from typing import Any

MODULES = ("nixl_cu13._api", "nixl_cu12._api")


def wrap(module: ModuleType, path: str) -> None:
    agent_cls = module.nixl_agent
    inner = agent_cls.get_new_notifs
    lock = threading.Lock()

    def get_new_notifs(self: Any, *a: Any, **kw: Any) -> Any:
        out = inner(self, *a, **kw)
        lines = [json.dumps({"agent": agent, "msg": m.decode(errors="replace") if isinstance(m, bytes) else str(m)})
                 for agent, msgs in out.items() for m in msgs]
        if lines:
            with lock, open(path, "a") as f:
                f.write("\n".join(lines) + "\n")
        return out

    agent_cls.get_new_notifs = get_new_notifs


class Finder(importlib.abc.MetaPathFinder):
    """Finds MODULES with the other finders, then wraps the module once it has run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module
                log = self.path

                def exec_module(module: ModuleType) -> None:
                    run(module)
                    wrap(module, log)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


if os.environ.get("PD_CHECK_NOTIF_LOG"):
    sys.meta_path.insert(0, Finder(os.environ["PD_CHECK_NOTIF_LOG"]))
