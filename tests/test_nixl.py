"""Tests of `multirail.nixl`: NIXL's call conventions, the safe descriptor serialisation, and a
NIXL-shaped two-peer script (two processes) whose only change from NIXL is the import line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from multirail import nixl
from multirail.errors import InvalidArgumentError, MetadataError, NotRegisteredError, OutOfBoundsError

from conftest import ENV, REPO, engine_available, engine_python  # noqa: E402


ENGINE_PY = engine_python()
needs_engine = pytest.mark.skipif(not engine_available(), reason="multirail._core (the engine extension) is not built")


def test_config_matches_nixl_signature() -> None:
    c = nixl.nixl_agent_config(True, True, 5555)
    assert (c.enable_pthread, c.enable_listen, c.port, c.backends) == (True, True, 5555, ["UCX"])
    assert c.capture_telemetry is False and c.num_threads == 0
    old = nixl.nixl_agent_config(True, False, 0, ["UCX", "GDS"])  # older NIXL: backends 4th
    assert old.backends == ["UCX", "GDS"] and old.capture_telemetry is False
    assert nixl.DEFAULT_COMM_PORT == 8888


def test_descriptor_serialisation_round_trip_and_rejects_garbage() -> None:
    rows = np.array([[0x7F0000001000, 4096, 0], [0x7F0000002000, 64, 1]], dtype=np.uint64)
    d = nixl.nixl_xfer_dlist("DRAM", rows)
    back = nixl.deserialize_descs(nixl.serialize_descs(d))
    assert back.mem_type == "DRAM" and len(back) == 2 and back[1] == (0x7F0000002000, 64, 1)
    blob = nixl.serialize_descs(d)
    for bad in (b"", blob[:10], b"XXXX" + blob[4:], blob[:-1], blob + b"\0", blob[:4] + b"\x09" + blob[5:]):
        with pytest.raises(MetadataError):
            nixl.deserialize_descs(bad)


def test_import_does_not_need_the_engine() -> None:
    res = subprocess.run([sys.executable, "-c", "import sys; import multirail.nixl; "
                          "sys.exit(1 if 'multirail._core' in sys.modules else 0)"],
                         env=ENV, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr


# A NIXL two-peer script (shape of nixl's examples/python/basic_two_peers.py and the seed
# notebook). Only the import differs from NIXL. numpy + address tuples are used because torch
# is not installed here; with torch, NIXL's tensor forms go through the same code.
SCRIPT = textwrap.dedent('''
    import sys, time
    import numpy as np
    from multirail.nixl import nixl_agent, nixl_agent_config   # was: from nixl._api import ...

    mode, ip, port, port_out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    deadline = time.monotonic() + 30
    def tick():
        if time.monotonic() > deadline:
            print(mode, "timed out"); sys.exit(3)
        time.sleep(0.001)

    config = nixl_agent_config(True, True, port if mode == "target" else 0)
    agent = nixl_agent(mode, config)
    buf = (np.arange(10 * 16, dtype=np.float32) + 1) if mode == "target" else np.zeros(10 * 16, np.float32)
    base, row = buf.ctypes.data, 16 * 4
    reg_descs = agent.register_memory([(base, buf.nbytes, 0, "")], "DRAM")
    if not reg_descs:
        print("Memory registration failed."); sys.exit(1)
    rows = [(base + i * row, row, 0) for i in range(10)]

    if mode == "target":
        with open(port_out, "w") as f:
            f.write(str(agent.get_listen_port()))
        target_descs = agent.get_xfer_descs(rows, "DRAM")
        target_desc_str = agent.get_serialized_descs(target_descs)
        while not agent.check_remote_metadata("initiator"):
            tick()
        agent.send_notif("initiator", target_desc_str)
        while True:
            notifs = agent.get_new_notifs()
            if "initiator" in notifs and b"Done_reading" in notifs["initiator"]:
                break
            tick()
        print("target done")
    else:
        agent.fetch_remote_metadata("target", ip, port)
        agent.send_local_metadata(ip, port)
        notifs = agent.get_new_notifs()
        while len(notifs) == 0:
            tick()
            notifs = agent.get_new_notifs()
        target_descs = agent.deserialize_descs(notifs["target"][0])
        initiator_descs = agent.get_xfer_descs(rows, "DRAM")
        while not agent.check_remote_metadata("target"):
            tick()
        xfer_handle = agent.initialize_xfer("READ", initiator_descs, target_descs, "target", "Done_reading")
        state = agent.transfer(xfer_handle)
        if state == "ERR":
            print("Posting transfer failed."); sys.exit(1)
        while True:
            state = agent.check_xfer_state(xfer_handle)
            if state == "ERR":
                print("Transfer got to Error state."); sys.exit(1)
            elif state == "DONE":
                break
            tick()
        if not np.array_equal(buf, np.arange(10 * 16, dtype=np.float32) + 1):
            print("Data verification failed."); sys.exit(1)
        print("initiator Data verification passed")
        agent.remove_remote_agent("target")
        agent.release_xfer_handle(xfer_handle)
        agent.invalidate_local_metadata(ip, port)
    agent.deregister_memory(reg_descs)
''')


@pytest.mark.skipif(ENGINE_PY is None, reason="multirail._core (the engine extension) is not built")
def test_two_peer_nixl_script(tmp_path: Path) -> None:
    script = tmp_path / "two_peers.py"
    script.write_text(SCRIPT)
    port_file = tmp_path / "port"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = subprocess.Popen([ENGINE_PY, str(script), "target", "127.0.0.1", str(port), str(port_file)],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(300):
            if port_file.exists() and port_file.read_text().strip() or target.poll() is not None:
                break
            subprocess.run(["sleep", "0.05"], timeout=5)
        assert port_file.exists(), target.communicate(timeout=10)[0]
        assert int(port_file.read_text()) == port  # listen_port honoured
        init = subprocess.run([ENGINE_PY, str(script), "initiator", "127.0.0.1", str(port), "-"],
                              env=ENV, capture_output=True, text=True, timeout=60)
        assert init.returncode == 0, init.stdout + init.stderr
        assert "initiator Data verification passed" in init.stdout
        out, _ = target.communicate(timeout=30)
        assert target.returncode == 0 and "target done" in out, out
    finally:
        if target.poll() is None:
            target.kill()  # by PID
            target.wait(timeout=10)


# -- the descriptor fast path: Nx3 uint64 arrays go to the engine as they are ------------------

@needs_engine
def test_initialize_xfer_merges_contiguous_runs_in_the_engine() -> None:
    """No merging in Python any more: the rows go to the engine as given, which merges runs
    contiguous on both sides while pairing them (one piece per run; a gap, a jump on either side
    or a region boundary cuts a run). Telemetry still counts the caller's descriptors."""
    n, bs = 512, 4096
    t = nixl.nixl_agent("merge-target", nixl.nixl_agent_config())
    i = nixl.nixl_agent("merge-init", nixl.nixl_agent_config(capture_telemetry=True))
    try:
        src, dst = np.zeros(n * bs, np.uint8), np.zeros(n * bs, np.uint8)
        t.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        i.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        i.add_remote_agent(t.get_agent_metadata())

        def rows(base: int, order) -> np.ndarray:
            r = np.zeros((len(order), 3), dtype=np.uint64)
            r[:, 0] = base + np.asarray(order, dtype=np.uint64) * bs
            r[:, 1] = bs
            return r

        perm = np.random.default_rng(4).permutation(n)
        blocks = [0, 1, 2, 7, 8, 3]  # runs: 0-2, 7-8, 3
        for lorder, rorder, pieces in ((range(n), range(n), 1), (blocks, blocks, 3), (blocks, range(6), 3),
                                       (perm, perm, 1 + int(np.count_nonzero(np.diff(perm) != 1)))):
            lr, rr = rows(dst.ctypes.data, lorder), rows(src.ctypes.data, rorder)
            h = i.initialize_xfer("READ", i.get_xfer_descs(lr, "DRAM"), i.get_xfer_descs(rr, "DRAM"), "merge-target")
            assert h._handle._h.num_pieces == pieces
            assert h._handle.total_bytes == len(lr) * bs
            _wait_done(i, h)
            assert i.get_xfer_telemetry(h).descCount == len(lr)
            i.release_xfer_handle(h)
    finally:
        i.close()
        t.close()


@needs_engine
def test_get_xfer_descs_keeps_uint64_rows_without_copy() -> None:
    a = nixl.nixl_agent("fastpath", nixl.nixl_agent_config())
    try:
        rows = np.zeros((1024, 3), dtype=np.uint64)
        rows[:, 0] = 0x10000 + np.arange(1024, dtype=np.uint64) * 64
        rows[:, 1] = 64
        d = a.get_xfer_descs(rows, "DRAM")
        assert d.rows is rows  # kept as is: no copy, no conversion
        assert a._engine_descs(d).arr.ctypes.data == rows.ctypes.data  # straight to the engine
        assert len(d) == 1024 and d.getType() == "DRAM" and d[3] == (0x10000 + 3 * 64, 64, 0)
        # Other layouts/dtypes are converted once, to a C-contiguous uint64 array.
        for other in (np.asfortranarray(rows), rows.astype(np.int64), rows[::2]):
            c = a.get_xfer_descs(other, "cpu")
            assert c.rows.dtype == np.uint64 and c.rows.flags.c_contiguous
            assert np.array_equal(c.rows, other) and not np.shares_memory(c.rows, rows)
        # Existing validation: unsupported memory type, bad tuple width, no mem type for tuples.
        with pytest.raises(InvalidArgumentError):
            a.get_xfer_descs(rows, "FILE")
        assert a.get_xfer_descs([(1, 2)], "DRAM") is None
        assert a.get_xfer_descs([(1, 2, 0)]) is None
    finally:
        a.close()


def _wait_done(agent: "nixl.nixl_agent", h: "nixl.nixl_xfer_handle") -> None:
    import time

    state, deadline = agent.transfer(h), time.monotonic() + 30
    while state != "DONE":
        assert state != "ERR" and time.monotonic() < deadline, state
        state = agent.check_xfer_state(h)


@needs_engine
def test_initialize_xfer_read_from_uint64_rows_round_trips() -> None:
    n, bs = 256, 4096
    t = nixl.nixl_agent("rt-target", nixl.nixl_agent_config())
    i = nixl.nixl_agent("rt-init", nixl.nixl_agent_config(capture_telemetry=True))
    try:
        src = np.random.default_rng(7).integers(0, 256, n * bs, dtype=np.uint8)
        half = n * bs // 2
        # Two adjacent target regions: runs of rows cross from one into the other (the engine
        # cuts its merged pairs there).
        t.register_memory([(src.ctypes.data, half, 0, ""), (src.ctypes.data + half, half, 0, "")], "DRAM")
        i.add_remote_agent(t.get_agent_metadata())

        def rows(base: int, order: np.ndarray) -> np.ndarray:
            r = np.zeros((len(order), 3), dtype=np.uint64)
            r[:, 0] = base + order.astype(np.uint64) * bs
            r[:, 1] = bs
            return r

        ident = np.arange(n)
        perm = np.random.default_rng(3).permutation(n)
        runs = np.concatenate([np.arange(128, 256), np.arange(0, 64), np.arange(64, 128)[::-1]])
        for lorder, rorder in ((ident, ident), (perm, ident), (ident, perm), (runs, perm), (perm, runs)):
            dst = np.zeros(n * bs, np.uint8)
            reg = i.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
            lr, rr = rows(dst.ctypes.data, lorder), rows(src.ctypes.data, rorder)
            ld, rd = i.get_xfer_descs(lr, "DRAM"), i.get_xfer_descs(rr, "DRAM")
            assert np.shares_memory(ld.rows, lr) and np.shares_memory(rd.rows, rr)
            h = i.initialize_xfer("READ", ld, rd, "rt-target", b"done")
            _wait_done(i, h)
            tel = i.get_xfer_telemetry(h)
            assert (tel.totalBytes, tel.descCount) == (n * bs, n)
            # local block lorder[k] now holds remote block rorder[k]
            expect = np.empty_like(dst)
            expect.reshape(n, bs)[lorder] = src.reshape(n, bs)[rorder]
            assert np.array_equal(dst, expect)
            i.release_xfer_handle(h)
            i.deregister_memory(reg)
            assert np.array_equal(lr, rows(dst.ctypes.data, lorder))  # the caller's rows untouched
    finally:
        i.close()
        t.close()


@needs_engine
def test_initialize_xfer_errors_name_the_callers_rows() -> None:
    n, bs = 64, 4096
    t = nixl.nixl_agent("err-target", nixl.nixl_agent_config())
    i = nixl.nixl_agent("err-init", nixl.nixl_agent_config())
    try:
        src, dst = np.zeros(n * bs, np.uint8), np.zeros(n * bs, np.uint8)
        t.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        i.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        i.add_remote_agent(t.get_agent_metadata())

        def rows(base: int, first: int) -> np.ndarray:
            r = np.zeros((n, 3), dtype=np.uint64)
            r[:, 0] = base + (first + np.arange(n, dtype=np.uint64)) * bs
            r[:, 1] = bs
            return r

        good_l, good_r = rows(dst.ctypes.data, 0), rows(src.ctypes.data, 0)
        # Contiguous rows whose last one runs one block past the remote region: the error names
        # row 63 as given (not the merged row 0).
        with pytest.raises(OutOfBoundsError, match=r"remote descriptor 63 "):
            i.initialize_xfer("READ", i.get_xfer_descs(good_l, "DRAM"),
                              i.get_xfer_descs(rows(src.ctypes.data, 1), "DRAM"), "err-target")
        with pytest.raises(NotRegisteredError, match=r"local descriptor 63 "):
            i.initialize_xfer("READ", i.get_xfer_descs(rows(dst.ctypes.data, 1), "DRAM"),
                              i.get_xfer_descs(good_r, "DRAM"), "err-target")
        with pytest.raises(InvalidArgumentError):
            i.initialize_xfer("COPY", i.get_xfer_descs(good_l, "DRAM"), i.get_xfer_descs(good_r, "DRAM"), "err-target")
        with pytest.raises(InvalidArgumentError):
            i.initialize_xfer("READ", good_l, good_r, "err-target")  # raw arrays, not descriptor lists
        h = i.initialize_xfer("READ", i.get_xfer_descs(good_l, "DRAM"), i.get_xfer_descs(good_r, "DRAM"), "err-target")
        i.release_xfer_handle(h)
    finally:
        i.close()
        t.close()
