"""`nixl.logging` on multirail: `get_logger(name)` gives a logger under "multirail.nixl" that
writes INFO and above to stdout, as NIXL's does; NIXL_LOG_LEVEL (TRACE, DEBUG, INFO, WARN,
ERROR, FATAL) sets the level.

Replace `from nixl.logging import get_logger` by `from multirail.nixl.logging import get_logger`.
"""

from __future__ import annotations

import logging as _logging
import os
import sys

ROOT = "multirail.nixl"
FORMAT = "%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s"
_LEVELS = {"TRACE": _logging.DEBUG, "DEBUG": _logging.DEBUG, "INFO": _logging.INFO, "WARN": _logging.WARNING,
           "WARNING": _logging.WARNING, "ERROR": _logging.ERROR, "FATAL": _logging.CRITICAL}
_configured = False


class _Stdout(_logging.StreamHandler):
    """Writes to the current sys.stdout (so output capture that swaps it sees the lines)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def set_log_level_by_env(logger: _logging.Logger) -> None:
    env = os.getenv("NIXL_LOG_LEVEL")
    if not env:
        return
    level = _LEVELS.get(env.upper())
    if level is None:
        logger.warning("Invalid NIXL_LOG_LEVEL value '%s'. Using configuration default.", env)
        return
    logger.setLevel(level)


def setup_logging() -> None:
    """Configure the "multirail.nixl" logger once (stdout, INFO); the root logger is untouched."""
    global _configured
    if _configured:
        return
    logger = _logging.getLogger(ROOT)
    if not logger.handlers:
        h = _Stdout()
        h.setFormatter(_logging.Formatter(FORMAT, "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(h)
        logger.propagate = False
    if logger.level == _logging.NOTSET:
        logger.setLevel(_logging.INFO)
    set_log_level_by_env(logger)
    _configured = True


def get_logger(name: str) -> _logging.Logger:
    """A logger named "multirail.nixl.<name without leading underscores>"."""
    setup_logging()
    name = name.lstrip("_")
    return _logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


__all__ = ["get_logger", "setup_logging", "set_log_level_by_env"]
