"""multirail as a NIXL backend (`libplugin_MULTIRAIL.so`, issue 20), against the real NIXL: the
pinned nixl-cu12 wheel, driven through its own Python API in two processes
(tests/nixl_plugin_peer.py: a target and an initiator, each a `nixl_agent` with the MULTIRAIL
backend loaded from `multirail nixl-plugin dir`).

Skips (with the reason) only where the plugin is not built or NIXL is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ENV, REPO

PEER = str(Path(__file__).resolve().parent / "nixl_plugin_peer.py")
MiB = 1 << 20


def _why_not() -> str | None:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError as e:
        return f"NIXL (nixl-cu12) is not installed: {e}"
    from multirail.nixl_plugin import PluginError, plugin_path

    try:
        plugin_path()
    except PluginError as e:
        return str(e)
    return None


_SKIP = _why_not()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from multirail.nixl_plugin import make_dir

    return make_dir(tmp_path_factory.mktemp("nixl-plugins"))


def _env(plugin_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in ENV.items() if not k.startswith("MULTIRAIL_")}
    env.update({"NIXL_PLUGIN_DIR": str(plugin_dir), "PYTHONPATH": f"{REPO / 'python'}:{REPO / 'tests'}"})
    env.update(extra or {})
    return env


class Pair:
    """A target process; `run` starts an initiator scenario against it."""

    def __init__(self, d: Path, plugin_dir: Path, cfg: dict[str, Any], env: dict[str, str] | None = None,
                 wrap: Any = None) -> None:
        self.d, self.plugin_dir, self.cfg = d, plugin_dir, cfg
        self.wrap = wrap or (lambda side, argv: argv)  # (side "a" target / "b" initiator, argv) -> argv
        self.env = _env(plugin_dir, env)
        self.log = open(d / "target.log", "w")
        argv = self.wrap("a", [sys.executable, PEER, "target", str(d), json.dumps(cfg)])
        self.proc = subprocess.Popen(argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        t = time.monotonic()
        while not (d / "meta.bin").exists():
            if self.proc.poll() is not None or time.monotonic() - t > 60:
                raise AssertionError(f"target did not start: {(d / 'target.log').read_text()[-3000:]}")
            time.sleep(0.02)

    def start(self, scenario: str, cfg: dict[str, Any] | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        argv = self.wrap("b", [sys.executable, PEER, "init", scenario, str(self.d),
                               json.dumps({**self.cfg, **(cfg or {})})])
        return subprocess.Popen(argv, env={**self.env, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def run(self, scenario: str, cfg: dict[str, Any] | None = None, env: dict[str, str] | None = None,
            timeout: float = 120) -> dict[str, Any]:
        return self.result(scenario, self.start(scenario, cfg, env), timeout)

    def result(self, scenario: str, proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        last = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        out = json.loads(last[-1]) if last else {"ok": False, "error": "no result"}
        assert res.returncode == 0 and out["ok"], (
            f"{scenario}: rc={res.returncode} {out}\n--- initiator stderr\n{res.stderr[-4000:]}\n"
            f"--- target\n{(self.d / 'target.log').read_text()[-3000:]}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def pair(tmp_path: Path, plugin_dir: Path, request: pytest.FixtureRequest) -> Iterator[Pair]:
    spec = dict(getattr(request, "param", {}))
    env = spec.pop("env", None)
    p = Pair(tmp_path, plugin_dir, {"size": 16 * MiB, **spec}, env)
    try:
        yield p
    finally:
        p.close()


def test_plugin_dir_holds_ours_and_nixls_plugins(plugin_dir: Path) -> None:
    names = sorted(f.name for f in plugin_dir.iterdir())
    assert {"libplugin_MULTIRAIL.so", "libplugin_UCX.so", "libplugin_POSIX.so"} <= set(names), names
    code = ("from nixl_cu12 import nixl_agent, nixl_agent_config;"
            "print(nixl_agent('x', nixl_agent_config(backends=[])).get_plugin_list())")
    res = subprocess.run([sys.executable, "-c", code], env=_env(plugin_dir), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert all(n in res.stdout for n in ("'MULTIRAIL'", "'UCX'", "'POSIX'")), res.stdout
    # NIXL's own plugins load from there too (they find their libraries relative to the directory)
    code = ("from nixl_cu12 import nixl_agent, nixl_agent_config;"
            "a = nixl_agent('x', nixl_agent_config(backends=['UCX', 'POSIX', 'MULTIRAIL'])); print(sorted(a.backends))")
    res = subprocess.run([sys.executable, "-c", code], env=_env(plugin_dir), capture_output=True, text=True, timeout=60)
    assert "['MULTIRAIL', 'POSIX', 'UCX']" in res.stdout, res.stdout + res.stderr


def test_cli_dir_and_check(tmp_path: Path) -> None:
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path)}
    mr = [sys.executable, "-m", "multirail"]
    d = subprocess.run(mr + ["nixl-plugin", "dir"], env=env, capture_output=True, text=True, timeout=60)
    assert d.returncode == 0, d.stderr
    assert Path(d.stdout.strip()).is_relative_to(tmp_path) and (Path(d.stdout.strip()) / "libplugin_UCX.so").exists()
    c = subprocess.run(mr + ["nixl-plugin", "check"], env=env, capture_output=True, text=True, timeout=180)
    assert c.returncode == 0, c.stdout + c.stderr
    for step in ("load", "create_backend", "READ", "WRITE", "local", "genNotif", "done"):
        assert f"ok   {step}" in c.stdout, c.stdout
    assert c.stdout.strip().endswith("MULTIRAIL NIXL plugin: OK")


def _fake_nixl_tree(tmp_path: Path, version: str) -> Path:
    """The installed nixl-cu12 seen from another site directory whose dist-info says `version`
    (links to the real files, so the same libnixl.so loads from a path beside that dist-info)."""
    import nixl_cu12

    site = Path(nixl_cu12.__file__).resolve().parents[1]
    fake = tmp_path / "site"
    fake.mkdir()
    for name in ("nixl_cu12", ".nixl_cu12.mesonpy.libs", "nixl_cu12.libs"):
        if (site / name).exists():
            (fake / name).symlink_to(site / name)
    (fake / f"nixl_cu12-{version}.dist-info").mkdir()
    return fake


def test_refuses_an_untested_nixl_version(tmp_path: Path, plugin_dir: Path) -> None:
    fake = _fake_nixl_tree(tmp_path, "1.4.0")
    code = """if True:
        from nixl_cu12 import nixl_agent, nixl_agent_config
        a = nixl_agent('x', nixl_agent_config(backends=[]))
        try:
            a.create_backend('MULTIRAIL', {}); print('CREATED')
        except Exception as e:
            print('REFUSED', type(e).__name__)
        print('ALIVE')
    """
    env = _env(plugin_dir, {"PYTHONPATH": str(fake)})
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr  # NIXL goes on without the plugin: no crash
    assert "REFUSED" in res.stdout and "ALIVE" in res.stdout, res.stdout + res.stderr
    assert "MULTIRAIL plugin refused to load" in res.stderr and "1.4.0" in res.stderr and "1.5.x" in res.stderr, res.stderr
    # the override loads it anyway, with a warning
    env["MULTIRAIL_NIXL_ALLOW_UNTESTED"] = "1"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "CREATED" in res.stdout and "loading anyway" in res.stderr, res.stdout + res.stderr


def test_check_names_an_unsupported_version(tmp_path: Path) -> None:
    fake = _fake_nixl_tree(tmp_path, "1.4.0")
    shutil.rmtree(fake / "nixl_cu12-1.4.0.dist-info")
    (fake / "nixl_cu12-1.4.0.dist-info").mkdir()
    (fake / "nixl_cu12-1.4.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: nixl-cu12\nVersion: 1.4.0\n")
    env = {**ENV, "PYTHONPATH": f"{fake}:{REPO / 'python'}", "XDG_CACHE_HOME": str(tmp_path)}
    c = subprocess.run([sys.executable, "-m", "multirail", "nixl-plugin", "check"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert c.returncode == 1 and "unsupported NIXL version 1.4.0" in c.stdout, c.stdout + c.stderr


def test_read_write_notifications_telemetry_local(pair: Pair) -> None:
    out = pair.run("basic")
    assert out["telemetry_bytes"] == 16 * MiB


def _telemetry_events(tmp_path: Path, path: Path) -> list[tuple[str, int]]:
    """(name, value) of every event in NIXL's telemetry file `path`, read with the wheel's own
    `telemetry_reader` (it reads until interrupted: stopped once its output stopped growing for a
    second; the file is complete by then, its writer having exited)."""
    import nixl_cu12

    site = Path(nixl_cu12.__file__).resolve().parents[1]
    src = site / "nixl_cu12.scripts" / "telemetry_reader"
    if not src.exists():
        pytest.skip(f"this NIXL wheel ships no telemetry_reader ({src})")
    reader = tmp_path / "telemetry_reader"
    shutil.copy(src, reader)  # the wheel installs it without the executable bit
    reader.chmod(0o755)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{site / '.nixl_cu12.mesonpy.libs'}:{site / 'nixl_cu12.libs'}"}
    out_path = tmp_path / "telemetry.txt"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([str(reader), str(path)], stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            size, t = -1, time.monotonic()
            while time.monotonic() - t < 30:
                time.sleep(1.0)
                now = out_path.stat().st_size
                if now == size and now > 0:
                    break
                size = now
        finally:
            proc.kill()
            proc.wait(timeout=10)
    text = out_path.read_text(errors="replace")
    names = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Event name:")]
    values = [int(ln.split(":", 1)[1]) for ln in text.splitlines() if ln.startswith("Value:")]
    assert names and len(names) == len(values), text[-2000:]
    return list(zip(names, values))


def test_nixl_captured_telemetry_counts_multirail_transfers(tmp_path: Path, pair: Pair) -> None:
    """NIXL's own telemetry (NIXL_TELEMETRY_ENABLE, written to NIXL_TELEMETRY_DIR) counts the
    transfers MULTIRAIL moved. NIXL 1.5.1 exports agent events only: it never collects a
    backend's own events (ai-dynamo/nixl #1364, in every release since 1.0.0), so the plugin
    adds none (docs/nixl-plugin.md)."""
    tel = tmp_path / "telemetry"
    tel.mkdir()
    pair.run("basic", {"linger": 1.0}, env={"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_DIR": str(tel),
                                             "NIXL_TELEMETRY_RUN_INTERVAL": "100"})
    events = _telemetry_events(tmp_path, tel / "init")
    total = lambda name: sum(v for n, v in events if n == name)  # noqa: E731
    size = 16 * MiB
    # basic: a READ of SIZE posted twice, a WRITE of SIZE, a local READ of SIZE
    assert total("agent_rx_bytes") >= 2 * size and total("agent_tx_bytes") >= size, events
    assert total("agent_memory_registered") >= 2 * size, events
    assert any(n == "agent_xfer_time" and v > 0 for n, v in events), events
    assert not [n for n, _ in events if n.startswith("agent_err")], events


def test_small_transfer_completes_when_its_caller_stops_polling(pair: Pair) -> None:
    # small transfers are read by checkXfer itself; one whose caller stops polling after the
    # post is still completed (by the receiver) and its notification delivered
    pair.run("unpolled")


def test_prepped_lists_with_indices_and_strided(pair: Pair) -> None:
    out = pair.run("prepped")
    assert out["strided"] == "ok", out


@pytest.mark.parametrize("gap_us", [0, 500])
def test_4k_read_latency_loop_back_to_back_and_paced(pair: Pair, gap_us: int) -> None:
    # benchmarks/nixl_backends.py's `lat` scenario: reposts of one prepped 4 KiB READ, byte-checked
    # at the end; paced, each READ starts gap_us after the previous one started, so the whole
    # loop lasts at least iters x gap (the pacing is what keeps a rate shaper out of the number)
    t = time.monotonic()
    out = pair.run("lat", {"iters": 200, "gap_us": gap_us})
    assert out["p50_us"] > 0 and out["p99_us"] >= out["p50_us"], out
    assert time.monotonic() - t >= 300 * gap_us / 1e6, out


@pytest.mark.parametrize("order", ["seq", "perm"])
def test_prepped_lists_posted_by_handoff_in_any_order(pair: Pair, order: str) -> None:
    # 4,096 x 16 KiB READ descriptors through prepped lists, made and posted twice (fresh lists
    # and handles each round), byte-checked each round: "seq" indices NIXL merges into 4
    # descriptors of 16 MiB, a random permutation it cannot merge (the plugin gets all 4,096).
    # Both are large transfers, posted by handoff (postXfer only queues them and wakes the
    # rails' threads).
    out = pair.run("prep", {"count": 4096, "desc": 16384, "order": order, "reps": 2})
    assert len(out["rounds"]["post_s"]) == 2, out


def test_metadata_partial_invalidate_and_listener(tmp_path: Path, plugin_dir: Path) -> None:
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    p = Pair(tmp_path, plugin_dir, {"size": 4 * MiB, "listen_port": ports[0]})
    try:
        # NIXL's listener thread (both sides) carries the metadata for fetch_remote_metadata
        out = p.run("metadata", {"listen_port": ports[1], "target_port": ports[0]})
    finally:
        p.close()
    assert out["b_before_full"].startswith("nixl") and out["after_invalidate"].startswith("nixl"), out


def test_metadata_through_nixls_etcd(tmp_path: Path, plugin_dir: Path) -> None:
    """NIXL's own etcd metadata path (NIXL_ETCD_ENDPOINTS): the target publishes its full and
    partial metadata with send_local_metadata / send_partial_agent_metadata(label=...), the
    initiator gets them only with fetch_remote_metadata; a real etcd on loopback."""
    import uuid

    from etcd_server import ETCD_MISSING, EtcdServer

    if ETCD_MISSING:
        pytest.skip(ETCD_MISSING)
    srv = EtcdServer(tmp_path / "etcd")
    try:
        env = {"NIXL_ETCD_ENDPOINTS": srv.http, "NIXL_ETCD_NAMESPACE": f"/mrtest-{uuid.uuid4().hex[:8]}/"}
        p = Pair(tmp_path, plugin_dir, {"size": 4 * MiB, "etcd": True}, env)
        try:
            out = p.run("etcd")
        finally:
            p.close()
    finally:
        srv.stop()
    assert out["etcd"] == "ok" and out["b_before_full"].startswith("nixl"), out


def test_malformed_metadata_is_an_error_not_a_crash(pair: Pair) -> None:
    out = pair.run("malformed")
    assert len(out["errors"]) == 5, out


@pytest.mark.parametrize("pair", [{"backends": ["UCX", "MULTIRAIL"]}], indirect=True)
def test_one_agent_with_ucx_and_multirail(pair: Pair) -> None:
    pair.run("ucx_and_multirail")


# Transfers slowed down on the initiator (every completion reported 20 ms late, 64 KiB chunks),
# so that they are surely in flight when the test acts.
SLOW = {"params": {"faults": "0:slow=20ms@0", "chunk_size": "65536"}}


@pytest.mark.parametrize("pair", [{"size": 64 * MiB}], indirect=True)
@pytest.mark.parametrize("scenario", ["release", "delete"])
def test_release_or_delete_mid_transfer_leaves_memory_alone(scenario: str, pair: Pair) -> None:
    out = pair.run(scenario, SLOW)
    assert out["untouched"]


@pytest.mark.parametrize("pair", [{"size": 64 * MiB}], indirect=True)
def test_peer_killed_mid_transfer_is_an_error_in_time(pair: Pair) -> None:
    out = pair.run("kill", {**SLOW, "params": {**SLOW["params"], "stall_timeout": "0.5", "timeout": "5"}})
    assert out["state"].startswith("ERR") and out["seconds"] < 10, out
    assert pair.proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.parametrize("pair", [{"env": {"MULTIRAIL_RAILS": "127.0.0.1", "MULTIRAIL_CONNECTIONS": "2"}}],
                         indirect=True)
def test_settings_from_env_and_params(pair: Pair) -> None:
    pair.run("env", {"keep": True, "expect": {"rails": "127.0.0.1", "connections": "2", "chunk_size": "1048576"}})
    # an explicit backend parameter wins over the environment
    pair.run("env", {"params": {"connections": "3"}, "expect": {"connections": "3", "rails": "127.0.0.1"}})


def test_bad_settings_fail_create_backend_cleanly(plugin_dir: Path) -> None:
    code = """if True:
        from nixl_cu12 import nixl_agent, nixl_agent_config
        a = nixl_agent('x', nixl_agent_config(backends=[]))
        for params in ({}, {'chunk_size': '12'}, {'no_such_key': '1'}):
            try:
                a.create_backend('MULTIRAIL', params); print('CREATED', params)
            except Exception as e:
                print('REFUSED', type(e).__name__)
        print('ALIVE')
    """
    res = subprocess.run([sys.executable, "-c", code], env=_env(plugin_dir, {"MULTIRAIL_CONNECTIONS": "0"}),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.count("REFUSED") == 3 and "ALIVE" in res.stdout, res.stdout + res.stderr
    assert "connections: must be a whole number" in res.stderr and "chunk_size" in res.stderr, res.stderr
    assert "unknown MULTIRAIL backend parameter" in res.stderr


def _non_loopback_ipv4() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the address a route would use
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def test_an_agent_open_to_the_network_without_a_secret_says_so(plugin_dir: Path) -> None:
    """Issue 33: an agent listening on a non-loopback address without a secret logs that anyone on
    the network can read and write its exported memory; the plugin's agents said nothing."""
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address on this host")
    code = """if True:
        import sys
        from nixl_cu12 import nixl_agent, nixl_agent_config
        a = nixl_agent('open', nixl_agent_config(backends=[]))
        a.create_backend('MULTIRAIL', {'rails': sys.argv[1]})
        b = nixl_agent('closed', nixl_agent_config(backends=[]))
        b.create_backend('MULTIRAIL', {'rails': sys.argv[1], 'auth_secret': 's3cret'})
        c = nixl_agent('local', nixl_agent_config(backends=[]))
        c.create_backend('MULTIRAIL', {'rails': '127.0.0.1'})
        print('ALIVE')
    """
    res = subprocess.run([sys.executable, "-c", code, ip], env=_env(plugin_dir), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "ALIVE" in res.stdout, res.stdout + res.stderr
    warned = [ln for ln in res.stderr.splitlines() if "without auth_secret" in ln]
    assert len(warned) == 1 and '"open"' in warned[0] and ip in warned[0] and "read and write" in warned[0], res.stderr


@pytest.mark.parametrize("pair", [{"vram": True, "params": {"gpu": "standin"}}], indirect=True)
def test_vram_through_the_gpu_paths_on_the_standin(pair: Pair) -> None:
    pair.run("basic")


def _cuda_unusable() -> str:
    """Why CUDA memory cannot be used here ('' when it can)."""
    code = "import multirail.gpu as g; g.info(0, 'cuda')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return "" if p.returncode == 0 else (p.stderr.strip().splitlines() or ["no usable GPU"])[-1]


@pytest.mark.gpu
def test_vram_through_the_gpu_paths_on_cuda(tmp_path: Path, plugin_dir: Path) -> None:
    """The same NIXL scenario with CUDA memory on both sides (two processes on one host: CUDA IPC
    under the plugin, the gather kernel for its pieces); `make test-gpu` runs it on a GPU machine."""
    why = _cuda_unusable()
    if why:
        pytest.skip(f"needs a CUDA GPU: {why}")
    p = Pair(tmp_path, plugin_dir, {"size": 16 * MiB, "vram": True, "params": {"gpu": "cuda"}})
    try:
        p.run("basic")
    finally:
        p.close()


def _nic_bytes(tb: Any) -> list[int]:
    """rx+tx bytes of each rail's device in namespace b (the initiator's)."""
    out = []
    for r in tb.rails:
        dev = r.devs["b"]
        cp = subprocess.run(tb.exec_argv("b", ["cat", f"/sys/class/net/{dev}/statistics/rx_bytes",
                                               f"/sys/class/net/{dev}/statistics/tx_bytes"]),
                            capture_output=True, text=True, timeout=10, check=True)
        out.append(sum(int(x) for x in cp.stdout.split()))
    return out


@pytest.fixture
def testbed_pair(tmp_path: Path, plugin_dir: Path) -> Iterator[tuple[Any, Pair]]:
    """Target in namespace a, initiator in namespace b of a fresh 2 x 1 Gbit/s testbed, each
    with MULTIRAIL_RAILS set to its side's rail addresses."""
    import uuid

    from conftest import netns_unavailable

    why = netns_unavailable()
    if why:
        pytest.skip(why)
    from multirail.testbed import Testbed

    tb = Testbed(f"nx{uuid.uuid4().hex[:6]}", rails=2, rate="1gbit")
    with tb:
        rails = {side: ",".join(tb.addrs(side)) for side in ("a", "b")}

        def wrap(side: str, argv: list[str]) -> list[str]:
            return tb.exec_argv(side, ["env", f"MULTIRAIL_RAILS={rails[side]}", *argv])

        p = Pair(tmp_path, plugin_dir, {"size": 128 * MiB, "params": {"stall_timeout": "1"}}, wrap=wrap)
        try:
            yield tb, p
        finally:
            p.close()


def test_testbed_rails_stripe_through_nixl(testbed_pair: tuple[Any, Pair]) -> None:
    tb, pair = testbed_pair
    before = _nic_bytes(tb)
    out = pair.run("stripe")
    moved = [b - a for a, b in zip(before, _nic_bytes(tb))]
    total = sum(moved)
    assert total >= 2 * 128 * MiB, moved
    assert min(moved) / total >= 0.3, f"one rail idle: {moved} ({out})"


def test_testbed_rail_down_mid_transfer_still_done(testbed_pair: tuple[Any, Pair]) -> None:
    tb, pair = testbed_pair
    proc = pair.start("raildown")
    t = time.monotonic()
    while not (pair.d / "posted").exists():
        assert proc.poll() is None and time.monotonic() - t < 60, "the initiator never posted"
        time.sleep(0.01)
    time.sleep(0.3)
    tb.set_link(1, False, side="a")
    out = pair.result("raildown", proc)
    assert out["read_s"] > 0.3, out  # it was in flight when the rail went down


def test_vram_of_gpu0_leaves_over_its_near_rails_only(tmp_path: Path, plugin_dir: Path) -> None:
    """Issue 34 in the plugin: on a 3-rail testbed whose tree (`--gpu-near 0,1`) puts rails 0 and
    1 on the stand-in GPU 0's switch and rail 2 on GPU 1's, the initiator (rails=auto, the
    default affinity, MULTIRAIL_SYSFS_ROOT at that tree) moves GPU 0's memory (VRAM on devId 0:
    the engine's location gpu:0) over rails 0 and 1 only, striped over both (NIC counters).
    With MULTIRAIL_AFFINITY=none the same transfers use rail 2 too (what the plugin did before)."""
    import uuid

    from conftest import netns_unavailable

    why = netns_unavailable()
    if why:
        pytest.skip(why)
    from multirail.testbed import Testbed

    tb = Testbed(f"nt{uuid.uuid4().hex[:6]}", rails=3, gpu_near=[0, 1])
    size = 8 * MiB
    with tb:
        target_rails = ",".join(tb.addrs("a"))
        sysfs = str(tb.sysfs_root("b"))

        def wrap(side: str, argv: list[str]) -> list[str]:
            env = f"MULTIRAIL_RAILS={target_rails}" if side == "a" else f"MULTIRAIL_SYSFS_ROOT={sysfs}"
            return tb.exec_argv(side, ["env", env, *argv])

        moved = {}
        for affinity in ("auto", "none"):  # each against a fresh target (basic WRITEs into it)
            (tmp_path / affinity).mkdir()
            p = Pair(tmp_path / affinity, plugin_dir, {"size": size, "vram": True, "params": {"gpu": "standin", "gpu_ipc": "0"}},
                     wrap=wrap)
            try:
                before = _nic_bytes(tb)
                p.run("basic", env={"MULTIRAIL_AFFINITY": affinity})
                moved[affinity] = [b - a for a, b in zip(before, _nic_bytes(tb))]
            finally:
                p.close()
    print(f"NIC bytes per rail (rx+tx, initiator): {moved}")
    near, far = moved["auto"][:2], moved["auto"][2]
    # basic: two READs and one WRITE of `size` from GPU 0 (plus handshakes and notifications)
    assert sum(near) >= 3 * size and min(near) > size // 8, moved
    assert far < 256 << 10, f"the far rail carried GPU 0's bytes: {moved}"
    assert moved["none"][2] > size // 4, f"affinity=none should stripe over every rail: {moved}"
