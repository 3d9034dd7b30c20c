"""A peer for tests/test_affinity_testbed.py, run inside a testbed namespace.

    affinity_peer.py target RAILS                   # prints {"port", "addr"}; serves until stdin closes
    affinity_peer.py initiator RAILS HOST PORT ADDR # a stand-in GPU region on device 0, then commands

RAILS: comma-separated local addresses. The initiator reads one command per stdin line and
answers one JSON line each:
    write         -> WRITE its 8 MiB GPU region to the target's; {"tx": {dev: bytes sent during
                     it}, "rails": rail_stats("target")}
    up I          -> waits (<= 20 s) until link rail I is up again; {"up": true}
    info          -> {"affinity": affinity_info()}
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import multirail
from multirail.agent import make_descs
from multirail.gpu import DeviceBuffer

N = 8 << 20


def _say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def _tx(devs: list[str]) -> dict[str, int]:
    return {d: int(Path(f"/sys/class/net/{d}/statistics/tx_bytes").read_text()) for d in devs}


def target(rails: list[str]) -> None:
    a = multirail.Agent("target", {"rails": rails, "host": rails[0], "affinity": "none", "timeout": 5.0})
    buf = np.zeros(N, np.uint8)
    a.register_memory(buf)
    _say({"port": a.port, "addr": buf.ctypes.data})
    sys.stdin.read()  # until the test closes our stdin
    a.close()


def initiator(rails: list[str], host: str, port: int, addr: int) -> None:
    a = multirail.Agent("initiator", {"rails": rails, "host": rails[0], "affinity": "topology", "gpu": "standin",
                                      "timeout": 5.0, "stall_timeout": 1.0})
    gpu = DeviceBuffer(N, device=0, kind="standin")
    gpu.copy_from_host(np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8))
    a.register_memory(gpu)
    a.fetch_remote_metadata("target", host, port)
    deadline = time.monotonic() + 10
    while not a.check_remote_metadata("target"):
        if time.monotonic() > deadline:
            raise SystemExit("no metadata from the target")
        time.sleep(0.01)
    devs = [d.name for d in Path("/sys/class/net").iterdir() if d.name != "lo"]
    remote = make_descs([(addr, N, 0)], "DRAM")
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "write":
            before = _tx(devs)
            h = a.initialize_xfer("WRITE", a.get_xfer_descs(gpu), remote, "target")
            try:
                a.transfer_sync(h, timeout=30)
            finally:
                a.release_xfer_handle(h)
            after = _tx(devs)
            _say({"tx": {d: after[d] - before[d] for d in devs}, "rails": a.rail_stats("target")})
        elif cmd[0] == "up":
            ri = int(cmd[1])
            deadline = time.monotonic() + 20
            while not a.rail_stats("target")[ri]["up"]:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            _say({"up": a.rail_stats("target")[ri]["up"]})
        elif cmd[0] == "info":
            _say({"affinity": a.affinity_info()})
    a.close()


if __name__ == "__main__":
    role, rails = sys.argv[1], sys.argv[2].split(",")
    if role == "target":
        target(rails)
    else:
        initiator(rails, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
