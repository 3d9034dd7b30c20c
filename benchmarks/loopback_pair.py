"""Two agents of this process joined over loopback, for the single-process benchmarks
(page_floor.py, slow_requests.py)."""
from __future__ import annotations

import time
from typing import Any


def join(i: Any, t: Any, target: str, timeout: float = 30.0) -> None:
    """Have initiator `i` fetch the metadata of target `t` (agent `target`, on loopback) and wait
    until it holds it; call it once the target's memory is registered (the metadata lists it).
    Raises SystemExit when it does not arrive within `timeout` seconds."""
    i.fetch_remote_metadata(target, "127.0.0.1", t.port)
    deadline = time.monotonic() + timeout
    while not i.check_remote_metadata(target):
        if time.monotonic() > deadline:
            raise SystemExit(f"the metadata of {target} never arrived")
        time.sleep(0.01)
