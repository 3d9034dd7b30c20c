"""The process-wide pinned staging budget (issue 35 defect 6, issue 33 item 5) and the target
side's placement (issue 34 item 3), on the stand-in GPU.

Pools of pinned bounce buffers are pinned when a GPU region is registered, within one cap per
process (`staging_pinned_max`); connections borrow them, wait when none is free, take back one
another holds idle, and give them back without unpinning (crates/multirail/src/staging.rs,
docs/gpu.md "The pinned budget"). A served connection runs on its rail's NIC-local CPUs and
stages through pools on that NIC's node, as the initiator's rail threads do.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import engine_available, pattern

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

if engine_available():
    import multirail
    from multirail import gpu
    from multirail.gpu import DeviceBuffer

MiB = 1 << 20
SI = "standin"
BUF = 64 << 10
POOL = 2 * BUF  # staging_buffers=2 x 64 KiB
CAP = 6 * POOL  # three pools per direction for the whole process
DEV = 9  # a stand-in device of its own: the stand-in counts pinned allocations per device


def _counts() -> tuple[int, int]:
    i = gpu.info(DEV, SI)
    return i["pinned_allocs"], i["pinned_frees"]


def test_many_connections_share_a_small_pinned_budget(agents: Any) -> None:
    """Three initiators of four connections each READ and WRITE at once with one target (two
    agents' worth of connections in one process, ~50 pools under the old per-connection rule):
    the pinned bytes never exceed the cap, nothing is pinned or unpinned after registration,
    connections borrow more often than pools exist (they share), and every byte arrives."""
    small = {"gpu": SI, "staging_buffers": 2, "staging_buffer_size": BUF, "staging_pinned_max": CAP, "timeout": 60.0,
             "stall_timeout": 2.0}  # as the stand-in pair's: a loaded CI host
    t = agents("target", small)
    n = 3 * MiB + 5
    remotes = [DeviceBuffer(n, device=DEV, kind=SI) for _ in range(3)]
    for k, r in enumerate(remotes):
        r.copy_from_host(pattern(n, 10 + k))
        t.register_memory(r)
    inits = [agents(f"i{k}", {**small, "connections": 4}) for k in range(3)]
    locals_ = [DeviceBuffer(2 * n, device=DEV, kind=SI) for _ in range(3)]
    for i, loc in zip(inits, locals_):
        i.register_memory(loc)
        i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    assert gpu.info(DEV, SI)["pinned_max"] == CAP
    warm = _counts()
    assert 0 < gpu.info(DEV, SI)["pinned_bytes"] <= CAP
    on_demand = gpu.info(DEV, SI)["pinned_on_demand"]

    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            info = gpu.info(DEV, SI)
            seen.append(info["pinned_bytes"])
            # The stand-in's own count of live pinned buffers, independent of the budget's.
            seen.append((info["pinned_allocs"] - info["pinned_frees"]) * BUF)
            time.sleep(0.005)

    errors: list[BaseException] = []

    def drive(k: int) -> None:
        i, loc, rem = inits[k], locals_[k], remotes[k]
        # The local buffer's first half READs the remote, its second half is written back.
        lo = multirail.agent.make_descs([(loc.addr, n, DEV)], "VRAM")
        hi = multirail.agent.make_descs([(loc.addr + n, n, DEV)], "VRAM")
        rd = multirail.agent.make_descs([(rem.addr, n, DEV)], "VRAM")
        try:
            for _ in range(2):
                for op, local in (("READ", lo), ("WRITE", lo), ("READ", hi)):
                    h = i.initialize_xfer(op, local, rd, "target")
                    try:
                        i.transfer_sync(h, timeout=60)
                    finally:
                        i.release_xfer_handle(h)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=drive, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    stop.set()
    sampler.join(5)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads), "a transfer hung"
    for k in range(3):
        got = locals_[k].to_host()
        assert np.array_equal(got[:n], pattern(n, 10 + k)) and np.array_equal(got[n:], pattern(n, 10 + k)), k
    assert seen and max(seen) <= CAP, f"pinned {max(seen)} bytes, cap {CAP}"
    assert _counts() == warm, "pinned (cudaMallocHost) or unpinned (cudaFreeHost) on the data path"
    assert gpu.info(DEV, SI)["pinned_on_demand"] == on_demand
    # More borrowings than pools exist: connections shared the budget's pools.
    borrowed = sum(r["staging"]["pools"] for i in inits for r in i.rail_stats("target"))
    borrowed += sum(r["staging"]["pools"] for r in t.served_stats() if r["peer"].startswith("i"))
    assert borrowed > CAP // POOL, borrowed
    # Closed connections give their pools back idle, none freed.
    for i in inits:
        i.close()
    deadline = time.monotonic() + 10
    while gpu.info(DEV, SI)["idle_pool_bytes"] < gpu.info(DEV, SI)["pinned_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _counts()[1] == warm[1], "a closing connection unpinned its pools"


def test_the_cap_is_checked() -> None:
    with pytest.raises(ValueError, match="staging_pinned_max"):
        multirail.Agent("x", {"gpu": SI, "staging_pinned_max": 4 << 20})  # < one 4 MiB pool per direction


def _node() -> int:
    """The NUMA node this thread runs on (0 where the kernel lists none)."""
    cpu = os.sched_getaffinity(0)
    base = Path("/sys/devices/system/node")
    for d in sorted(base.glob("node[0-9]*")) if base.is_dir() else []:
        try:
            from multirail.affinity import parse_cpulist

            if set(parse_cpulist(d.joinpath("cpulist").read_text().strip())) & cpu:
                return int(d.name[4:])
        except OSError:
            continue
    return 0


def test_served_connections_run_on_their_rails_nic_cpus(agents: Any) -> None:
    """Issue 34 item 3, target side: the target's serving thread of a connection on rail
    127.0.0.2 (whose NIC the target's affinity puts on one CPU) runs on that CPU only; the
    serving threads of its other rails are left alone."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to tell a pinned thread from an unpinned one")
    rails = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    node = _node()
    t = agents("target", {"rails": rails, "affinity": {f"numa:{node}": [rails], "cpus": {"127.0.0.2": str(cpus[0])}}})
    i = agents("initiator", {"rails": rails, "affinity": "none", "timeout": 10.0})
    dst = np.zeros(MiB, np.uint8)
    t.register_memory(dst)
    src = np.ones(MiB, np.uint8)
    i.register_memory(src)
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    i.make_connection("target")
    remote = multirail.agent.make_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    h = i.initialize_xfer("WRITE", i.get_xfer_descs(src), remote, "target")
    try:
        i.transfer_sync(h, timeout=20)
    finally:
        i.release_xfer_handle(h)
    assert np.array_equal(dst, src)
    allowed: list[str] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        allowed = []
        for task in Path("/proc/self/task").iterdir():
            try:
                if task.joinpath("comm").read_text().strip() != "mr-serve":
                    continue
                status = task.joinpath("status").read_text()
            except OSError:
                continue
            line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
            allowed.append(line.split(":", 1)[1].strip())
        if str(cpus[0]) in allowed:
            break
        time.sleep(0.05)
    assert str(cpus[0]) in allowed, f"no serving thread runs on rail 127.0.0.2's CPU: {allowed}"
    assert any(a != str(cpus[0]) for a in allowed), f"only that rail's serving threads are pinned: {allowed}"
