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
from multirail.errors import MetadataError

from conftest import ENV, REPO, engine_python  # noqa: E402


ENGINE_PY = engine_python()


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
