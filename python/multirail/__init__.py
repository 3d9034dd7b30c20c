"""multirail: stripe one logical READ/WRITE over every rail (NIC) two hosts share.

The engine (`Agent`, `XferState`, ...) lives in the compiled extension `multirail._core` and is
imported on first use, so the tools (`doctor`, `testbed`, `fabric`) work without it.
"""

from __future__ import annotations

from multirail.errors import *  # noqa: F401,F403
from multirail.errors import __all__ as _errors_all

_ENGINE = ("Agent", "AgentConfig", "XferState", "XferHandle", "PreppedDescs", "DescList", "__version__")


def __getattr__(name: str):
    if name in _ENGINE:
        from multirail import agent

        return getattr(agent, name)
    if name == "gpu":  # multirail.gpu.DeviceBuffer, without importing the engine up front
        import importlib

        return importlib.import_module("multirail.gpu")
    raise AttributeError(f"module 'multirail' has no attribute {name!r}")


__all__ = list(_ENGINE) + list(_errors_all)
