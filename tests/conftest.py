"""Shared fixtures. Engine tests need the built extension; tools tests do not."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "python") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "python"))


def engine_available() -> bool:
    try:
        import multirail._core  # noqa: F401
    except ImportError:
        return False
    return True


is_root = os.geteuid() == 0
needs_root = pytest.mark.skipif(not is_root, reason="needs root (network namespaces)")
