"""Tests of `multirail.nixl`: NIXL's call conventions, the safe descriptor serialisation, and a
NIXL-shaped two-peer script (two processes) whose only change from NIXL is the import line."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from multirail import nixl
import multirail.nixl.bindings  # noqa: F401  (nixl.bindings below)
from multirail.errors import MetadataError, NotRegisteredError, OutOfBoundsError

from conftest import ENV, engine_available, engine_python  # noqa: E402


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
            x = i.agent._xfer(h._handle)  # the engine request behind the NIXL handle
            assert x.h._h.num_pieces == pieces
            assert x.total == len(lr) * bs
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
        assert d.descCount() == len(d) == 1024 and d[3] == (0x10000 + 3 * 64, 64, 0)
        assert d.getType() == nixl.bindings.DRAM_SEG and d.mem_type == "DRAM"
        # Straight to the engine: the array the engine is handed is the caller's.
        seen = []
        real = a.agent.engine.initialize_xfer
        a.agent.engine.initialize_xfer = lambda op, l, r, *args: (seen.append((l, r)), real(op, l, r, *args))[1]
        t = nixl.nixl_agent("fastpath-t", nixl.nixl_agent_config())
        try:
            buf = np.zeros(1024 * 64 + 0x10000, np.uint8)
            rows[:, 0] = buf.ctypes.data + np.arange(1024, dtype=np.uint64) * 64
            a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            t.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            a.add_remote_agent(t.get_agent_metadata())
            a.release_xfer_handle(a.initialize_xfer("READ", d, d, "fastpath-t"))
            assert seen and seen[0][0].arr.ctypes.data == rows.ctypes.data == seen[0][1].arr.ctypes.data
        finally:
            t.close()
        # Other layouts/dtypes are converted once, to a C-contiguous uint64 array.
        for other in (np.asfortranarray(rows), rows.astype(np.int64), rows[::2]):
            c = a.get_xfer_descs(other, "cpu")
            assert c.rows.dtype == np.uint64 and c.rows.flags.c_contiguous
            assert np.array_equal(c.rows, other) and not np.shares_memory(c.rows, rows)
        # NIXL's validation: unknown memory type (KeyError), bad tuple width, no mem type for
        # tuples; FILE lists can be built but not registered (no storage backend).
        with pytest.raises(KeyError):
            a.get_xfer_descs(rows, "V-RAM")
        with pytest.raises(nixl.bindings.nixlNotFoundError):
            a.register_memory([(0x1000, 64, 0, "f")], "FILE")
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
        with pytest.raises(KeyError):  # as NIXL: the op is looked up in nixl_ops
            i.initialize_xfer("COPY", i.get_xfer_descs(good_l, "DRAM"), i.get_xfer_descs(good_r, "DRAM"), "err-target")
        with pytest.raises(TypeError):
            i.initialize_xfer("READ", good_l, good_r, "err-target")  # raw arrays, not descriptor lists
        h = i.initialize_xfer("READ", i.get_xfer_descs(good_l, "DRAM"), i.get_xfer_descs(good_r, "DRAM"), "err-target")
        i.release_xfer_handle(h)
    finally:
        i.close()
        t.close()


# -- the package layout: utils, logging, bindings details ------------------------------------

def test_utils_are_real_libc_helpers() -> None:
    import ctypes

    from multirail.nixl import utils

    a, b = utils.malloc_passthru(100), utils.malloc_passthru(100)
    try:
        assert a % 4096 == 0 and b % 4096 == 0 and a != b
        utils.ba_buf(a, 100)
        assert ctypes.string_at(a, 100) == b"\xba" * 100
        ctypes.memmove(b, a, 100)
        utils.verify_transfer(a, b, 100)
        ctypes.memset(b + 57, 0, 1)
        with pytest.raises(AssertionError, match="byte 57"):
            utils.verify_transfer(a, b, 100)
    finally:
        utils.free_passthru(a)
        utils.free_passthru(b)


def test_logging_writes_nixl_style_lines_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    from multirail.nixl.logging import get_logger

    log = get_logger("__main__")
    assert log.name == "multirail.nixl.main__" and get_logger("multirail.nixl._api").name == "multirail.nixl._api"
    log.info("hello %s", "there")
    out = capsys.readouterr().out
    assert " NIXL INFO " in out and "hello there" in out


def test_descriptor_lists_copy_on_write_and_serialise_metadata() -> None:
    from multirail.nixl import bindings as b

    rows = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint64)
    d = b.nixlXferDList(b.DRAM_SEG, rows)
    assert d.rows is rows  # borrowed
    d[0] = (7, 8, 9)  # NIXL copies on construction; here the first change copies
    assert rows[0].tolist() == [1, 2, 3] and d[0] == (7, 8, 9)
    d.addDesc((10, 11, 12))
    assert d.descCount() == 3 and rows.shape == (2, 3)
    r = b.nixlRegDList(b.FILE_SEG, [(1, 2, 3, "a"), (4, 5, 6, b"\x00b")])
    back = nixl.deserialize_descs(nixl.serialize_descs(r))
    assert isinstance(back, b.nixlRegDList) and back == r and back[1] == (4, 5, 6, b"\x00b")
    blob = nixl.serialize_descs(r)
    for bad in (blob[:-1], blob + b"x", blob[:28]):
        with pytest.raises(MetadataError):
            nixl.deserialize_descs(bad)


def test_engine_errors_are_nixl_and_multirail_exceptions() -> None:
    from multirail.errors import MultirailError
    from multirail.nixl import bindings as b

    e = b._nixl_error(OutOfBoundsError("remote descriptor 3 (0x1000, 8 bytes) is outside every region"))
    assert isinstance(e, b.nixlNotFoundError) and isinstance(e, OutOfBoundsError) and isinstance(e, MultirailError)
    assert str(e).startswith("NIXL_ERR_NOT_FOUND: remote descriptor 3")
    from multirail.errors import PeerLostError

    assert isinstance(b._nixl_error(PeerLostError("gone")), b.nixlRemoteDisconnectError)


@needs_engine
def test_partial_metadata_over_the_side_channel_with_a_secret() -> None:
    """The Python side-channel client (MetaPut/MetaGet) proves the shared secret as the engine
    does; a wrong secret is refused with nixlNotAllowedError."""
    from multirail.nixl import bindings as b, utils

    good = nixl.nixl_agent_config(True, True, 0, auth_secret="s3cret")
    t = nixl.nixl_agent("sec-target", good)
    i = nixl.nixl_agent("sec-init", nixl.nixl_agent_config(True, True, 0, auth_secret="s3cret"))
    bad = nixl.nixl_agent("sec-bad", nixl.nixl_agent_config(True, True, 0, auth_secret="other"))
    a = utils.malloc_passthru(64)
    try:
        reg = t.register_memory([(a, 64, 0, "")], "DRAM")
        t.send_partial_agent_metadata(reg, True, ["UCX"], "127.0.0.1", i.get_listen_port())
        assert i.check_remote_metadata("sec-target", reg.trim())
        with pytest.raises(b.nixlNotAllowedError):
            bad.send_partial_agent_metadata(bad.get_reg_descs([], "DRAM"), True, [], "127.0.0.1", i.get_listen_port())
        with pytest.raises(b.nixlNotAllowedError):
            bad.fetch_remote_metadata("sec-target", "127.0.0.1", t.get_listen_port())
        i.fetch_remote_metadata("sec-target", "127.0.0.1", t.get_listen_port())
        assert i.check_remote_metadata("sec-target", reg.trim())
    finally:
        for ag in (t, i, bad):
            ag.close()
        utils.free_passthru(a)


@needs_engine
def test_strided_descriptors_and_loopback_notifications() -> None:
    from multirail.nixl import utils

    a = nixl.nixl_agent("strided", nixl.nixl_agent_config())
    base = utils.malloc_passthru(8192)
    try:
        a.register_memory([(base, 8192, 0, "")], "DRAM")
        utils.ba_buf(base, 4096)
        # (address, len, device, stride, count): 4 blocks of 256 bytes, 1024 apart, READ from
        # the agent itself (loopback) into 4 adjacent blocks
        local = a.prep_xfer_dlist("", np.array([[base + 4096, 256, 0, 256, 4]], dtype=np.uint64), "DRAM")
        remote = a.prep_xfer_dlist("strided", np.array([[base, 256, 0, 1024, 4]], dtype=np.uint64), "DRAM")
        h = a.make_prepped_xfer("READ", local, [0, 1, 2, 3], remote, [0, 1, 2, 3], b"self-notif")
        _wait_done(a, h)
        utils.verify_transfer(base, base + 4096, 256)
        utils.verify_transfer(base + 3072, base + 4096 + 768, 256)
        import time

        deadline = time.monotonic() + 10
        while not a.check_remote_xfer_done("strided", b"self-notif"):
            assert time.monotonic() < deadline
        a.send_notif("strided", b"to myself")
        assert a.get_new_notifs() == {"strided": [b"to myself"]}
        a.release_xfer_handle(h)
    finally:
        a.close()
        utils.free_passthru(base)


@needs_engine
def test_polled_multi_piece_writes_complete() -> None:
    """NIXL's pattern (post, then poll check_xfer_state) for WRITEs of several unmerged pieces
    and several WRITEs at once: every one completes (the engine's caller-thread progress used to
    leave responses it had read ahead unprocessed, so some of these stalled).""" 
    import time

    from multirail.nixl import utils

    t, i = nixl.nixl_agent("mw-t"), nixl.nixl_agent("mw-i")
    a, b = utils.malloc_passthru(1 << 16), utils.malloc_passthru(1 << 16)
    try:
        t.register_memory([(a, 1 << 16, 0, "")], "DRAM")
        i.register_memory([(b, 1 << 16, 0, "")], "DRAM")
        i.add_remote_agent(t.get_agent_metadata())
        for it in range(40):
            utils.ba_buf(b, 4096)
            hs = [i.initialize_xfer("WRITE", i.get_xfer_descs([(b + k * 1024 + j * 512, 256, 0) for j in range(2)], "DRAM"),
                                    i.get_xfer_descs([(a + 8192 + k * 1024 + j * 256, 256, 0) for j in range(2)], "DRAM"),
                                    "mw-t") for k in range(4)]
            for h in hs:
                assert i.transfer(h) in ("DONE", "PROC")
            deadline = time.monotonic() + 10
            for h in hs:
                while i.check_xfer_state(h) != "DONE":
                    assert time.monotonic() < deadline, f"WRITE {it} did not complete"
                i.release_xfer_handle(h)
        utils.verify_transfer(b + 3 * 1024 + 512, a + 8192 + 3 * 1024 + 256, 256)
    finally:
        i.close()
        t.close()
        utils.free_passthru(a)
        utils.free_passthru(b)


@needs_engine
def test_vram_moves_through_the_nixl_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NIXL script's GPU memory ("VRAM" lists; here the stand-in device, as CUDA memory would
    be on a GPU machine): registered, READ and WRITE byte-exact, notifications after the data;
    host memory that is not GPU memory is refused as VRAM with the cause."""
    monkeypatch.setenv("MULTIRAIL_GPU", "standin")
    from multirail.gpu import DeviceBuffer

    n = 3 * (1 << 20) + 7
    t = nixl.nixl_agent("vram-target", nixl.nixl_agent_config())
    i = nixl.nixl_agent("vram-init", nixl.nixl_agent_config())
    try:
        assert "VRAM_SEG" in i.get_plugin_mem_types("UCX")
        src, dst = DeviceBuffer(n, kind="standin"), DeviceBuffer(n, kind="standin")
        data = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        src.copy_from_host(data)
        t.register_memory([(src.addr, n, 0, "")], "VRAM")
        i.register_memory([(dst.addr, n, 0, "")], "VRAM")
        i.add_remote_agent(t.get_agent_metadata())
        ld, rd = i.get_xfer_descs([(dst.addr, n, 0)], "VRAM"), i.get_xfer_descs([(src.addr, n, 0)], "VRAM")
        h = i.initialize_xfer("READ", ld, rd, "vram-target", b"read")
        _wait_done(i, h)
        assert np.array_equal(dst.to_host(), data)
        i.release_xfer_handle(h)
        dst.copy_from_host(data[::-1].copy())
        h = i.initialize_xfer("WRITE", ld, rd, "vram-target", b"written")
        _wait_done(i, h)
        assert np.array_equal(src.to_host(), data[::-1])
        i.release_xfer_handle(h)
        host = np.zeros(4096, np.uint8)
        with pytest.raises(nixl.bindings.nixlBackendError, match="not GPU memory"):
            i.register_memory([(host.ctypes.data, 4096, 0, "")], "VRAM")
    finally:
        i.close()
        t.close()
