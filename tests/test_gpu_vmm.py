"""Memory that legacy CUDA IPC cannot export (issue 35, defect 8), on the stand-in: CUDA VMM
memory (PyTorch's expandable segments) goes by IPC through its chunks' file descriptors, and
memory nothing can export (the default `cudaMallocAsync` pool) is staged, with its reason and
one warning per peer (docs/gpu.md, "Memory that legacy CUDA IPC cannot export"). The target
runs in another process, its allocator chosen by `MULTIRAIL_STANDIN_ALLOC`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from conftest import engine_available
from gpu_peer import Target
from test_gpu_multi import IPC_KV, PAGE, PAGES, _expected_remote, _run

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

# To each target (name, port, addr): a WRITE from host memory, a READ back, a WRITE again.
PEERS = r"""
import json, sys
import numpy as np
import multirail
n = int(sys.argv[1])
peers = [(sys.argv[k], int(sys.argv[k + 1]), int(sys.argv[k + 2])) for k in range(2, len(sys.argv), 3)]
i = multirail.Agent("initiator", {"gpu": "standin", "timeout": 5.0})
out = {"ok": True, "reasons": {}, "ipc": {}}
for name, port, addr in peers:
    src = (np.arange(n, dtype=np.uint32) * 13 + len(name)).astype(np.uint8)
    back = np.zeros(n, np.uint8)
    i.register_memory(src)
    i.register_memory(back)
    i.fetch_remote_metadata(name, "127.0.0.1", port)
    rd = i.get_xfer_descs([(addr, n, 0)], "VRAM")
    for op, buf in (("WRITE", src), ("READ", back), ("WRITE", src)):
        h = i.initialize_xfer(op, [buf], rd, name)
        i.transfer_sync(h, 30)
        i.release_xfer_handle(h)
    out["ok"] = out["ok"] and bool(np.array_equal(src, back))
    c = i.peer_counters(name)
    out["reasons"][name] = c["ipc_fallback_reason"]
    out["ipc"][name] = c["ipc_transfers"]
i.close()
print(json.dumps(out), flush=True)
"""


def test_vmm_memory_of_another_gpu_moves_by_ipc_both_ways() -> None:
    """The target's memory is an expandable segment of 4 VMM chunks on GPU 1, which legacy IPC
    cannot export: the initiator's KV pages on GPU 0 go by IPC both ways (WRITE, READ back),
    byte-exact, with no fallback and no warning; the chunks are mapped for GPU 0, which reaches
    GPU 1 peer to peer (the gather kernel on GPU 0 touches them: no sticky fault). Without VMM
    export the transfers are staged (`ipc_transfers` 0, the reason names cudaIpcGetMemHandle)."""
    env = {"MULTIRAIL_STANDIN_DEVICES": "2"}
    tgt = Target(PAGE * PAGES, device=1, env={**env, "MULTIRAIL_STANDIN_ALLOC": f"vmm:{PAGE * PAGES // 4}"})
    try:
        got = _run(IPC_KV, [tgt.port, tgt.addr, 0, PAGE, PAGES], env)
        assert got["ok"] and got["round_trip"], got
        assert tgt.ask("digest") == hashlib.sha256(_expected_remote()).hexdigest()
    finally:
        tgt.close()
    c = got["counters"]
    assert c["ipc_fallback_reason"] == "" and c["ipc_transfers"] == 2, got
    assert c["ipc_devices"] == [0] and c["ipc_regions_mapped"] == 1, got
    assert "CUDA IPC is not used" not in got["stderr"], got["stderr"]
    assert got["sticky"] == [] and got["peers"] == [[0, 1]], got


def test_a_fallback_is_staged_with_its_reason_and_warned_once_per_peer() -> None:
    """Three targets IPC cannot serve: `pool`, whose memory is a stream-ordered pool's (neither
    legacy IPC nor VMM export takes it), and `hidden0`/`hidden1`, whose GPU this process does
    not see (per-process visibility, as `CUDA_VISIBLE_DEVICES`; the same reason for both).
    Every transfer is staged, byte-exact, `ipc_fallback_reason` says why per peer, and stderr
    has one warning per peer: not one per transfer (three each), nor one per reason for the
    whole process (which would leave `hidden1` unsaid)."""
    n = 256 << 10
    two = {"MULTIRAIL_STANDIN_DEVICES": "2"}
    tgts = [Target(n, env={**two, "MULTIRAIL_STANDIN_ALLOC": "pool"}, name="pool")]
    tgts += [Target(n, env={**two, "MULTIRAIL_STANDIN_VISIBLE_DEVICES": "1"}, name=f"hidden{k}") for k in range(2)]
    names = ["pool", "hidden0", "hidden1"]
    try:
        args = [x for name, t in zip(names, tgts) for x in (name, t.port, t.addr)]
        cp = subprocess.run([sys.executable, "-c", PEERS, str(n), *map(str, args)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, **two, "MULTIRAIL_STANDIN_VISIBLE_DEVICES": "0"})
        assert cp.returncode == 0, cp.stderr
        got = json.loads(cp.stdout.strip().splitlines()[-1])
    finally:
        for t in tgts:
            t.close()
    assert got["ok"], got
    assert got["ipc"] == dict.fromkeys(names, 0), got
    assert "stream-ordered pool" in got["reasons"]["pool"] and "cudaIpcGetMemHandle" in got["reasons"]["pool"], got
    assert got["reasons"]["hidden0"] == got["reasons"]["hidden1"] and "CUDA_VISIBLE_DEVICES" in got["reasons"]["hidden0"], got
    lines = [ln for ln in cp.stderr.splitlines() if "CUDA IPC is not used" in ln]
    assert len(lines) == 3, cp.stderr
    assert all(sum(f'"{name}"' in ln for ln in lines) == 1 for name in names), lines
    assert all("WARNING" in ln for ln in lines), lines


def test_deregistering_vmm_memory_closes_the_peers_mapping_before_it_returns() -> None:
    """The lifetime rule holds for VMM mappings too: once the target's deregistration returns,
    the initiator has unmapped every chunk (`ipc_regions_revoked`), and a later WRITE is refused
    and lands nowhere."""
    import numpy as np

    import multirail
    from multirail import errors

    n = 4 * 65536
    tgt = Target(n, env={"MULTIRAIL_STANDIN_ALLOC": "vmm:65536"})
    i = multirail.Agent("initiator", {"gpu": "standin", "timeout": 5.0})
    try:
        local = np.zeros(n, np.uint8)
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        rd = i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM")
        h = i.initialize_xfer("READ", [local], rd, "target")
        i.transfer_sync(h, 30)
        i.release_xfer_handle(h)
        before = tgt.ask("digest")
        assert hashlib.sha256(local.tobytes()).hexdigest() == before
        pc = i.peer_counters("target")
        assert pc["ipc_transfers"] == 1 and pc["ipc_regions_mapped"] == 1 and pc["ipc_fallback_reason"] == "", pc
        out = json.loads(tgt.ask("dereg"))
        assert out["ok"], out
        pc = i.peer_counters("target")
        assert pc["ipc_regions_mapped"] == 0 and pc["ipc_regions_revoked"] == 1, pc
        local[:] = 0xAB
        h = i.initialize_xfer("WRITE", [local], rd, "target")
        with pytest.raises(errors.AccessDeniedError):
            i.transfer_sync(h, 30)
        i.release_xfer_handle(h)
        assert tgt.ask("digest") == before
    finally:
        i.close()
        tgt.close()
# A WRITE whose VMM fetch fails on the way (the initiator looks in another socket directory),
# then the same WRITE again with the right directory.
RETRY = r"""
import json, os, sys, tempfile
import numpy as np
import multirail
n, port, addr = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
i = multirail.Agent("initiator", {"gpu": "standin", "timeout": 5.0})
src = (np.arange(n, dtype=np.uint32) * 7).astype(np.uint8)
i.register_memory(src)
i.fetch_remote_metadata("target", "127.0.0.1", port)
rd = i.get_xfer_descs([(addr, n, 0)], "VRAM")
out = {"ipc": [], "reasons": []}
with tempfile.TemporaryDirectory() as empty:
    for d in (empty, None):
        if d:
            os.environ["MULTIRAIL_IPC_DIR"] = d
        else:
            os.environ.pop("MULTIRAIL_IPC_DIR", None)
        h = i.initialize_xfer("WRITE", [src], rd, "target")
        i.transfer_sync(h, 30)
        i.release_xfer_handle(h)
        c = i.peer_counters("target")
        out["ipc"].append(c["ipc_transfers"])
        out["reasons"].append(c["ipc_fallback_reason"])
i.close()
print(json.dumps(out), flush=True)
"""


def test_a_vmm_fetch_that_fails_on_the_way_is_tried_again_by_the_next_transfer() -> None:
    """The first WRITE's fd fetch fails on the way (no socket where the initiator looks: an I/O
    error, not the target's refusal): that transfer is staged with the reason, and the next
    WRITE fetches again and goes by IPC. (A transient failure used to be remembered for the
    region, which was then staged for good.)"""
    n = 256 << 10
    env = {k: v for k, v in os.environ.items() if k != "MULTIRAIL_IPC_DIR"}
    tgt = Target(n, env={"MULTIRAIL_STANDIN_ALLOC": f"vmm:{n // 4}"})
    try:
        cp = subprocess.run([sys.executable, "-c", RETRY, str(n), str(tgt.port), str(tgt.addr)], capture_output=True,
                            text=True, timeout=120, env=env)
        assert cp.returncode == 0, cp.stderr
        got = json.loads(cp.stdout.strip().splitlines()[-1])
    finally:
        tgt.close()
    assert got["ipc"] == [0, 1], got
    assert "tried again next transfer" in got["reasons"][0], got
