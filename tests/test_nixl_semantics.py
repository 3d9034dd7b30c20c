"""What a NIXL deployment relies on (issue 36), through the real NIXL (the pinned nixl-cu12
wheel, two processes, tests/nixl_plugin_peer.py): defaults that work across hosts with only
NIXL_PLUGIN_DIR set, and the semantics of NIXL's return codes, notifications and calls that
frameworks such as vLLM's NixlConnector rely on (docs/nixl-plugin.md, "What a deployment
must set" and "NIXL's return codes here").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from test_nixl_plugin import PEER, _SKIP, MiB, Pair, _env, pair, plugin_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture
def two_hosts(tmp_path: Path, plugin_dir: Path) -> Iterator[tuple[Any, Pair]]:  # noqa: F811
    """Target in namespace a, initiator in namespace b of a fresh one-rail testbed, with no
    MULTIRAIL_* setting at all but MULTIRAIL_HOST=0.0.0.0 on the target ("listen everywhere",
    as a user would write it): only NIXL_PLUGIN_DIR."""
    from conftest import netns_unavailable

    why = netns_unavailable()
    if why:
        pytest.skip(why)
    from multirail.testbed import Testbed

    tb = Testbed(f"nd{uuid.uuid4().hex[:6]}", rails=1, rate="1gbit")
    with tb:
        def wrap(side: str, argv: list[str]) -> list[str]:
            extra = ["MULTIRAIL_HOST=0.0.0.0"] if side == "a" else []
            return tb.exec_argv(side, ["env", *extra, *argv])

        p = Pair(tmp_path, plugin_dir, {"size": 16 * MiB}, wrap=wrap)
        try:
            yield tb, p
        finally:
            p.close()


def test_two_hosts_with_only_the_plugin_dir_set(two_hosts: tuple[Any, Pair]) -> None:
    """Item 1: two NIXL agents on two hosts exchange metadata; READ, WRITE, a notification on
    a transfer and genNotif both ways work with no MULTIRAIL_* setting (before: each advertised
    127.0.0.1, or 0.0.0.0 that the peer dialled as 127.0.0.1, and the first call to the peer
    failed with NIXL_ERR_REMOTE_DISCONNECT)."""
    _tb, pair = two_hosts
    pair.run("basic")


def test_an_address_no_peer_can_dial_is_refused_naming_the_setting(plugin_dir: Path) -> None:  # noqa: F811
    code = """if True:
        from nixl_cu12 import nixl_agent, nixl_agent_config
        a = nixl_agent('x', nixl_agent_config(backends=[]))
        try:
            a.create_backend('MULTIRAIL', {'rails': '0.0.0.0'}); print('CREATED')
        except Exception as e:
            print('REFUSED', type(e).__name__)
        a.create_backend('MULTIRAIL', {}); print('DEFAULTS', a.get_backend_params('MULTIRAIL'))
    """
    res = subprocess.run([sys.executable, "-c", code], env=_env(plugin_dir), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "REFUSED" in res.stdout, res.stdout + res.stderr
    assert "MULTIRAIL_RAILS" in res.stderr and "0.0.0.0" in res.stderr, res.stderr
    assert "'rails': 'auto'" in res.stdout and "'transport': 'auto'" in res.stdout, res.stdout


@pytest.mark.parametrize("pair", [{"size": 16 * MiB}], indirect=True)
def test_a_blip_is_not_a_disconnect(pair: Pair) -> None:
    """Item 2: the initiator's only rail is killed for 1 s (fault injection, docs/transports.md)
    while a READ is in flight. While the peer's incarnation is alive the transfer waits for the
    probe to readmit the rail (up to `timeout`) and completes late; a new transfer to the same
    agent then works without add_remote_agent (before: the rail's loss failed the READ as
    NIXL_ERR_REMOTE_DISCONNECT, NIXL invalidated the agent, and initialize_xfer raised NOT_FOUND)."""
    params = {"faults": "0:slow=20ms@0,0:kill@300ms+1s", "chunk_size": "65536", "stall_timeout": "0.5",
              "timeout": "10"}
    out = pair.run("blip", {"params": params})
    assert out["state"] == "DONE" and out["seconds"] > 1.0, out


@pytest.mark.parametrize("pair", [{"size": 1 * MiB, "params": {"faults": "0:lose_answer@0"}}], indirect=True)
def test_a_notification_whose_answer_is_lost_is_delivered_once(pair: Pair) -> None:
    """Item 3: the target loses its answer to a transfer's notification (fault injection:
    queued, connection closed unanswered), the initiator resends it, and the target's
    application gets it once (before: twice; vLLM counts notifications per request to free KV
    blocks, so a copy freed blocks another reader still used)."""
    out = pair.run("notif_once")
    assert out["notifs"].count("once") == 1, out["notifs"]
    assert out["notifs"].count("after") == 1, out["notifs"]


@pytest.mark.parametrize("dists", [["nixl-0.9.0", "nixl_cu12-1.5.1"], ["nixl_cu13-1.5.2"]])
def test_the_version_gate_reads_nixls_own_distribution(tmp_path: Path, plugin_dir: Path,  # noqa: F811
                                                      dists: list[str]) -> None:
    """Item 7: the plugin loads when the NIXL package beside libnixl.so is a supported 1.5.x,
    whatever else is installed: the `nixl` meta package (before: its version was taken, the
    lexically first dist-info) and nixl-cu13 1.5.x (which vLLM's CUDA 13 torch imports)."""
    from test_nixl_plugin import _fake_nixl_tree

    fake = _fake_nixl_tree(tmp_path, "0")
    (fake / "nixl_cu12-0.dist-info").rmdir()
    for d in dists:
        (fake / f"{d}.dist-info").mkdir()
    code = """if True:
        from nixl_cu12 import nixl_agent, nixl_agent_config
        a = nixl_agent('x', nixl_agent_config(backends=[]))
        a.create_backend('MULTIRAIL', {}); print('CREATED')
    """
    res = subprocess.run([sys.executable, "-c", code], env=_env(plugin_dir, {"PYTHONPATH": str(fake)}),
                         capture_output=True, text=True, timeout=60)
    assert "CREATED" in res.stdout and "refused" not in res.stderr, res.stdout + res.stderr


def test_deregistration_with_a_live_handle_is_immediate_and_the_handle_fails(pair: Pair) -> None:
    """Item 5: deregister_memory of a region a prepared handle still uses returns at once
    (before: 2 s under NIXL's lock, then failed and left the region registered and exported),
    and reposting the handle is an error, the memory untouched (before: DONE, written)."""
    out = pair.run("dereg")
    assert out["dereg_s"] < 1.0 and out["repost"].startswith("ERR"), out


@pytest.mark.parametrize("pair", [{"size": 1 * MiB, "params": {"timeout": "2"}},
                                  {"size": 1 * MiB, "vram": True, "params": {"timeout": "2", "gpu": "standin"}}],
                         indirect=True, ids=["dram", "vram"])
def test_a_blackholed_peer_never_blocks_the_caller(pair: Pair) -> None:
    """Item 4: the target process is stopped (SIGSTOP: its kernel accepts connections, nothing
    answers), so dialing it hangs until `timeout` (2 s here). prepXfer, postXfer and genNotif
    return at once (10 ms in the issue; 50 ms allowed for a loaded CI host) and checkXfer says
    ERR within `timeout` of the post (before: prepXfer dialed the peer on the caller's thread,
    one rail after another, and returned NIXL_ERR_BACKEND after `timeout`; genNotif waited as
    long; vLLM calls them on its engine step loop). With VRAM descriptors (the stand-in
    device) too: prepXfer of GPU memory needs the link's capabilities, and dialed for them on
    the caller's thread until 2026-11-28; they are now settled at the first post, in the
    background."""
    pid = json.loads((pair.d / "addrs.json").read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        out = pair.run("blackhole", {"keep": True}, timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    print("blackholed peer:", out)
    assert "prep_error" not in out and "post_error" not in out and "notif_error" not in out, out
    assert out["prep_ms"] < 50 and out["post_ms"] < 50 and out["notif_ms"] < 50, out
    assert out["state"].startswith("ERR") and out["err_s"] < 2 + 1.5, out
    assert "RemoteDisconnect" not in out["state"], out  # the peer lives: NIXL_ERR_BACKEND


@pytest.mark.parametrize("pair", [{"size": 1 * MiB, "params": {"timeout": "1"}}], indirect=True)
def test_concurrency_as_vllm_drives_nixl(pair: Pair, tmp_path: Path) -> None:
    """Item 9: a handshake thread adds remote agents, reads from them, sends them
    notifications, has them notify the initiator and removes them, while the main thread posts,
    checks and reads notifications, in NIXL's default thread mode (no locking) with the GIL
    released in NIXL's calls; the main thread also posts to and notifies a peer that does not
    answer (its process stopped: an unreachable prefill host). Bounded in time; no crash, no
    deadlock; every transfer DONE or a clear ERR (the stopped peer's: ERR after `timeout`, 1 s
    here), the side agents' notifications each delivered once, and no call to the stopped peer
    holds the main thread (before: prep and every post dialed it, `timeout` each)."""
    sd = tmp_path / "stopped"
    sd.mkdir()
    log = open(sd / "log", "w")
    cfg = json.dumps({"size": 1 * MiB, "name": "stopped", "params": {"timeout": "1"}})
    proc = subprocess.Popen([sys.executable, PEER, "target", str(sd), cfg], env=pair.env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        t = time.monotonic()
        while not (sd / "meta.bin").exists():
            assert proc.poll() is None and time.monotonic() - t < 60, (sd / "log").read_text()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGSTOP)
        t = time.monotonic()
        out = pair.run("concurrent", {"seconds": 3, "stopped_dir": str(sd)}, timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()
    print("concurrency:", out)
    assert all(v < 50 for v in out["slowest_ms"].values()), out
    assert out["stopped_errs"] >= 1 and all(e.startswith("ERR") for e in out["stopped_ends"]), out
    assert out["main_states"].get("DONE", 0) > 0 and set(out["main_states"]) == {"DONE"}, out
    assert out["rounds"] >= 1 and out["side_states"] == ["DONE"] and not out["errors"], out
    assert time.monotonic() - t < 20, out


@pytest.mark.parametrize("pair", [{"size": 4 * MiB, "regions": 12}], indirect=True)
def test_regions_loaded_one_by_one_update_the_live_peer(pair: Pair) -> None:
    """Item 6: the target's 12 more regions are loaded one metadata blob at a time (as a
    framework loads one per layer), each read at once, while a READ prepared before them is in
    flight and reposted (its rail slowed: each completion 20 ms late). Every transfer completes,
    none reports NIXL_ERR_REMOTE_DISCONNECT (before: each load after the peer's first use built
    a new peer with new connections, and the ninth closed the first one: the READ prepared on
    it failed with NIXL_ERR_REMOTE_DISCONNECT, and NIXL dropped a healthy peer)."""
    params = {"faults": "0:slow=20ms@0", "chunk_size": "65536"}
    out = pair.run("regions_live", {"params": params})
    print("regions loaded one by one:", out)
    assert len(out["big_states"]) == 12 and set(out["big_states"]) <= {"PROC", "DONE"}, out


@pytest.mark.parametrize("pair", [{"size": 1 * MiB}], indirect=True)
def test_a_full_inbox_does_not_fail_a_transfer_whose_data_landed(pair: Pair) -> None:
    """Item 7: the target's application does not take its notifications until its inbox is
    full (64 READs, each with a 1 MiB notification). A READ with a notification then
    completes (before: it failed, NIXL_ERR_BACKEND, after its data had landed), its
    notification is held by the initiator and delivered, once, when the application takes
    notifications again."""
    out = pair.run("inbox_full", timeout=180)
    assert out["state"] == "DONE" and out["bytes_ok"], out
    assert out["notifs"].count("after-full") == 1, out["notifs"]


@pytest.mark.parametrize("pair", [{"size": 1 * MiB}], indirect=True)
def test_notifications_arrive_in_the_order_sent_behind_a_refused_one(pair: Pair) -> None:
    """Item 3 (order): NIXL delivers one agent's notifications in the order they were sent.
    The target's application does not take its notifications until its inbox has room for
    small ones only: a 1 MiB genNotif is refused, and the 24 genNotifs and WRITE notifications
    after it (each WRITE DONE before the next call) arrive after it, in the order sent, once
    the application takes notifications again (before: genNotifs went out pipelined on their
    own connection, the refused one was dropped with a warning and the rest queued)."""
    out = pair.run("notif_order", timeout=120)
    assert out["got"] == out["sent"], out["got"]


@pytest.mark.parametrize("pair", [{"size": 4 * MiB}], indirect=True)
def test_releasing_a_handle_never_reports_an_error_after_freeing_it(pair: Pair) -> None:
    """Item 7: releaseReqH of a transfer in flight hits an internal error (fault point
    MULTIRAIL_NIXL_FAULT=panic:release, after the transfer was aborted): the handle is freed and
    release_xfer_handle succeeds (before: the error reached NIXL, which raised
    NIXL_ERR_REPOST_ACTIVE and kept the freed handle to release it again), and the agent goes
    on working and closes cleanly."""
    params = {"faults": "0:slow=20ms@0", "chunk_size": "65536"}
    out = pair.run("release_in_flight", {"params": params}, env={"MULTIRAIL_NIXL_FAULT": "panic:release"})
    assert out["posted"] == "PROC" and out["release"] == "ok", out
    assert out["after"] == "DONE" and out["after_bytes_ok"], out


def test_a_source_built_nixl_is_known_by_its_librarys_version(tmp_path: Path, plugin_dir: Path) -> None:  # noqa: F811
    """Item 7: a NIXL with no package beside libnixl.so (built from source and installed with
    meson, as in Dynamo's containers) loads the plugin when the version its build compiled
    into libnixl_common.so is supported, saying so in one log line (before: refused unless
    MULTIRAIL_NIXL_ALLOW_UNTESTED=1)."""
    from test_nixl_plugin import _fake_nixl_tree

    fake = _fake_nixl_tree(tmp_path, "0")
    (fake / "nixl_cu12-0.dist-info").rmdir()
    code = """if True:
        from nixl_cu12 import nixl_agent, nixl_agent_config
        a = nixl_agent('x', nixl_agent_config(backends=[]))
        a.create_backend('MULTIRAIL', {}); print('CREATED')
    """
    res = subprocess.run([sys.executable, "-c", code], env=_env(plugin_dir, {"PYTHONPATH": str(fake)}),
                         capture_output=True, text=True, timeout=60)
    assert "CREATED" in res.stdout and "refused" not in res.stderr, res.stdout + res.stderr
    assert "built from source" in res.stderr and "libnixl_common.so" in res.stderr, res.stderr
