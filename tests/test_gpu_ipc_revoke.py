"""CUDA IPC mappings never outlive the exporter's memory, and map the exporter's GPU by UUID
(issue 19, item 4), on the stand-in across two processes (CUDA maps only other processes'
memory; the stand-in maps the peer's memfd-backed "device memory" as CUDA maps a handle).

- Deregistering a region a peer mapped returns only once the peer closed its mapping: its
  counters say so right after, a transfer prepared before fails instead of copying, and a new
  one is refused; the old memory is never written.
- A peer that does not answer (SIGSTOPped) bounds deregistration by the target's `timeout`:
  TransferTimeoutError names it, the region is gone all the same, and once resumed the peer
  finds its watch connection aborted and drops its mappings.
- With different visible-device orders in the two processes, the handle opens on the local GPU
  with the exporter's UUID; no local GPU with it is a fallback reason naming the UUID.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from conftest import engine_available, wait_stopped
from gpu_peer import Initiator, Target

pytestmark = pytest.mark.skipif(not engine_available(), reason="multirail._core is not built (run `make setup`)")

if engine_available():
    import multirail
    from multirail import errors
    from multirail.gpu import DeviceBuffer

MiB = 1 << 20
SI = "standin"


def _sha(a: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(a.tobytes()).hexdigest()


def _xfer(i, op: str, local, remote) -> None:
    h = i.initialize_xfer(op, local, remote, "target")
    try:
        i.transfer(h)
        i.wait(h, 30)
    finally:
        i.release_xfer_handle(h)


def test_deregistration_closes_the_peers_mapping_before_it_returns() -> None:
    n = MiB + 7
    tgt = Target(n)
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
    try:
        local = np.zeros(n, np.uint8)
        i.register_memory(local)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        rd = i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM")
        _xfer(i, "READ", [local], rd)
        before = tgt.ask("digest")
        assert _sha(local) == before
        pc = i.peer_counters("target")
        assert pc["ipc_transfers"] == 1 and pc["ipc_regions_mapped"] == 1 and pc["ipc_regions_revoked"] == 0, pc
        # A WRITE handle prepared (and its mapping planned) while the region was there.
        local[:] = 0xAB
        stale = i.initialize_xfer("WRITE", [local], rd, "target")

        out = json.loads(tgt.ask("dereg"))
        assert out["ok"], out
        # Deregistration returned: the mapping is already closed on this side.
        pc = i.peer_counters("target")
        assert pc["ipc_regions_mapped"] == 0 and pc["ipc_regions_revoked"] == 1, pc

        # The handle prepared before fails instead of copying into the revoked mapping.
        i.transfer(stale)
        with pytest.raises(errors.AccessDeniedError, match="revoked"):
            i.wait(stale, 30)
        i.release_xfer_handle(stale)
        # A new transfer asks again, is refused, is staged, and is refused by the target.
        with pytest.raises(errors.AccessDeniedError):
            _xfer(i, "WRITE", [local], rd)
        pc = i.peer_counters("target")
        assert pc["ipc_regions_mapped"] == 0 and pc["ipc_transfers"] == 1, pc
        assert "refused" in pc["ipc_fallback_reason"], pc
        # The old memory was never written.
        assert tgt.ask("digest") == before
    finally:
        i.close()
        tgt.close()


def test_a_region_dropped_from_the_peers_metadata_is_unmapped_in_place() -> None:
    """Issue 36 item 6: metadata of the peer's same incarnation without a region this agent
    mapped over CUDA IPC (NIXL's unloadMD, a newer blob) updates the peer in place: the mapping
    is closed (no copy was running), a handle prepared on the region fails its next post naming
    it and copies nothing, a new prepare is refused, and the peer is the same one (its counters
    go on; before, a new peer replaced it and the handle failed as PeerLost)."""
    n = MiB + 7
    tgt = Target(n)
    i = multirail.Agent("initiator", {"gpu": SI, "timeout": 5.0})
    try:
        local = np.zeros(n, np.uint8)
        i.register_memory(local)
        i.add_remote_agent(bytes.fromhex(tgt.ask("meta")))
        rd = i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM")
        held = i.initialize_xfer("READ", [local], rd, "target")
        i.transfer(held)
        i.wait(held, 30)
        assert _sha(local) == tgt.ask("digest")
        pc = i.peer_counters("target")
        assert pc["ipc_transfers"] == 1 and pc["ipc_regions_mapped"] == 1, pc

        i.add_remote_agent(bytes.fromhex(tgt.ask("bare_meta")))
        pc = i.peer_counters("target")
        assert pc["ipc_regions_mapped"] == 0 and pc["ipc_transfers"] == 1, pc
        local[:] = 0
        with pytest.raises(errors.InvalidArgumentError, match="was removed"):
            i.transfer(held)
        i.release_xfer_handle(held)
        assert not local.any()
        with pytest.raises(errors.MultirailError):
            _xfer(i, "READ", [local], rd)
        assert not local.any()
    finally:
        i.close()
        tgt.close()


def test_a_peer_that_does_not_confirm_bounds_deregistration() -> None:
    n = MiB
    timeout = 1.5
    t = multirail.Agent("target", {"gpu": SI, "timeout": timeout})
    block = DeviceBuffer(n, kind=SI)
    block.copy_from_host(np.full(n, 7, np.uint8))
    reg = t.register_memory([(block.addr, n, 0)], "VRAM")
    peer = Initiator(t.port, block.addr, n)
    stopped = False
    try:
        assert json.loads(peer.first)["sum"] == 7 * n
        pc = json.loads(peer.ask("counters"))
        assert pc["ipc_transfers"] == 1 and pc["ipc_regions_mapped"] == 1, pc
        os.kill(peer.p.pid, signal.SIGSTOP)
        stopped = True
        wait_stopped(peer.p.pid)
        t0 = time.monotonic()
        with pytest.raises(errors.TransferTimeoutError, match="initiator") as e:
            t.deregister_memory(reg)
        took = time.monotonic() - t0
        assert "deregistered" in str(e.value), e.value
        assert timeout * 0.9 <= took < timeout + 5, took
        # Gone all the same: a second deregistration has nothing to do.
        assert reg.region_ids[0] not in t._regs
        t.deregister_memory(reg)
        os.kill(peer.p.pid, signal.SIGCONT)
        stopped = False
        # Resumed, the peer finds its watch connection aborted and drops the mapping; its
        # next WRITE is refused, and the memory is left alone.
        deadline = time.monotonic() + 10
        while True:
            pc = json.loads(peer.ask("counters"))
            if pc["ipc_regions_mapped"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert pc["ipc_regions_mapped"] == 0 and pc["ipc_regions_revoked"] == 1, pc
        out = json.loads(peer.ask("write"))
        assert not out["ok"] and "AccessDenied" in out["error"], out
        assert (block.to_host() == 7).all()
    finally:
        if stopped:
            os.kill(peer.p.pid, signal.SIGCONT)
        peer.close()
        t.close()
        block.free()


@pytest.mark.parametrize("here,use,expect", [("0,1", None, [1]), ("1", None, [0]), ("0,1", 0, [0])])
def test_ipc_maps_the_exporters_gpu_by_uuid(here: str, use: int | None, expect: list[int]) -> None:
    """The target sees physical GPUs "1,0" and exports from its GPU 0 (physical 1). An
    initiator with host memory that uses no GPU yet opens the handle on its GPU with that UUID,
    whatever its number there; one that already uses another GPU (a vLLM worker's own) opens it
    there, by peer access, and makes no context on the exporter's GPU (docs/gpu.md). Each case
    is a fresh process: visible devices are fixed for a process's life, and which GPUs it uses
    depends on what ran before in it."""
    pc, _, contexts = _read_from_gpu_1_of_2(here, MiB + 3, use)
    assert pc["ipc_transfers"] == 1 and pc["ipc_devices"] == expect, pc
    assert contexts == expect, contexts


def _read_from_gpu_1_of_2(here: str, n: int, use: int | None = None) -> tuple[dict, list, list]:
    """READ `n` bytes, byte-checked, from a target process that sees the stand-in's GPUs as
    "1,0" and exports from its GPU 0, by an initiator process that sees `here` (and first uses
    its GPU `use`); returns the initiator's peer counters, rail stats and GPU contexts."""
    tgt = Target(n, env={"MULTIRAIL_STANDIN_VISIBLE_DEVICES": "1,0"})
    try:
        ini = Initiator(tgt.port, tgt.addr, n, env={"MULTIRAIL_STANDIN_VISIBLE_DEVICES": here}, use_gpu=use)
        try:
            assert json.loads(ini.ask("digest")) == tgt.ask("digest")
            return (json.loads(ini.ask("counters")), json.loads(ini.ask("rails")),
                    json.loads(ini.ask("contexts")))
        finally:
            ini.close()
    finally:
        tgt.close()


def test_no_local_gpu_with_the_exporters_uuid_stages_and_names_it() -> None:
    n = MiB + 5
    pc, rails, _ = _read_from_gpu_1_of_2("0", n)
    assert pc["ipc_transfers"] == 0 and pc["ipc_regions_mapped"] == 0, pc
    # The stand-in's physical GPU 1.
    assert "GPU-6d722d73-7461-6e64-696e-2d2d00000001" in pc["ipc_fallback_reason"], pc
    assert rails[0]["bytes"] == n
