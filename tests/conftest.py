"""Shared fixtures. Engine tests need the built extension; tools tests do not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "python") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "python"))



def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until every thread of `pid` is stopped (kill() only queues SIGSTOP)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")

def engine_available() -> bool:
    try:
        import multirail._core  # noqa: F401
    except ImportError:
        return False
    return True


is_root = os.geteuid() == 0
needs_root = pytest.mark.skipif(not is_root, reason="needs root (network namespaces)")


REPO = Path(ROOT)
ENV = {**os.environ, "PYTHONPATH": str(REPO / "python")}


def engine_python() -> str | None:
    """The interpreter that can import the engine (for subprocess tests), or None."""
    for py in (str(REPO / ".venv" / "bin" / "python"), sys.executable):
        if Path(py).exists() and subprocess.run([py, "-c", "import multirail._core"], env=ENV,
                                                capture_output=True, timeout=30).returncode == 0:
            return py
    return None


def netns_unavailable() -> str | None:
    """Why network-namespace tests cannot run here (not root, or `ip netns add` fails), or None.
    Probes with a uniquely named namespace that it removes again."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, ip link, tc)"
    probe = f"mrprobe{os.getpid() % 100000}{os.urandom(2).hex()}"
    try:
        cp = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns` is not available: {e}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None if cp.returncode == 0 else f"cannot create network namespaces: {cp.stderr.strip()}"


@pytest.fixture
def agents():
    """A factory of engine agents (`make(name, cfg)`), all closed at teardown."""
    import multirail

    made: list = []

    def make(name: str, cfg: dict | None = None):
        a = multirail.Agent(name, cfg or {})
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def pattern(n: int, seed: int):
    """`n` reproducible random bytes (a uint8 numpy array)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def standin_pair():
    """A target and an initiator agent on the stand-in GPU device, closed at teardown."""
    import multirail

    t = multirail.Agent("target", {"gpu": "standin"})
    i = multirail.Agent("initiator", {"gpu": "standin", "timeout": 5.0, "stall_timeout": 2.0})
    yield t, i
    i.close()
    t.close()
