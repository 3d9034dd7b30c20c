"""Rails chosen per memory location (issue 34, docs/topology.md "The engine"), over loopback.

Agents with three loopback rails (127.0.0.1-3) and an explicit `affinity` mapping: a host
region's transfer stripes over its NUMA node's tier only, a stand-in GPU region's over its
GPU's tier, a tier whose rails are all down falls back to the next one (rail_stats says so)
and the near rail takes over again once readmitted; each rail's threads run on the CPUs the
mapping gives its NIC. The end-to-end run over namespaces with a topology fixture is
tests/test_affinity_testbed.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from multirail.errors import InvalidArgumentError

MiB = 1 << 20
RAILS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def _why_not() -> str | None:
    try:
        import multirail._core  # noqa: F401
    except ImportError as e:
        return f"the engine extension is not built ({e})"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _node() -> int:
    """The NUMA node this thread runs on (where a freshly touched numpy array lands)."""
    cpu = os.sched_getaffinity(0)
    base = Path("/sys/devices/system/node")
    for d in sorted(base.glob("node[0-9]*")) if base.is_dir() else []:
        try:
            cpus = d.joinpath("cpulist").read_text().strip()
        except OSError:
            continue
        from multirail.affinity import parse_cpulist

        if set(parse_cpulist(cpus)) & cpu:
            return int(d.name[4:])
    return 0


def _pair(agents, icfg: dict, tcfg: dict | None = None):
    t = agents("target", {"rails": RAILS, "affinity": "none", **(tcfg or {})})
    i = agents("initiator", {"rails": RAILS, "timeout": 5.0, "stall_timeout": 1.0, **icfg})
    return t, i


def _connect(t, i) -> None:
    i.fetch_remote_metadata("target", "127.0.0.1", t.port)
    deadline = time.monotonic() + 10
    while not i.check_remote_metadata("target"):
        assert time.monotonic() < deadline, "metadata never arrived"
        time.sleep(0.01)


def _by_local(i) -> dict[str, dict]:
    return {r["local_addr"]: r for r in i.rail_stats("target")}


def _write(i, src, dst_descs, timeout: float = 20.0) -> None:
    h = i.initialize_xfer("WRITE", i.get_xfer_descs(src), dst_descs, "target")
    try:
        i.transfer_sync(h, timeout=timeout)
    finally:
        i.release_xfer_handle(h)


def test_host_region_stripes_over_its_numa_tier_only(agents) -> None:
    node = _node()
    t, i = _pair(agents, {"affinity": {f"numa:{node}": [["127.0.0.2", "127.0.0.3"], ["127.0.0.1"]]}})
    dst = np.zeros(16 * MiB, np.uint8)
    t.register_memory(dst)
    src = np.random.default_rng(3).integers(0, 256, 16 * MiB, dtype=np.uint8)
    i.register_memory(src)
    _connect(t, i)
    _write(i, src, _remote(i, t, dst))
    assert np.array_equal(src, dst)
    r = _by_local(i)
    assert r["127.0.0.1"]["bytes"] == 0, r
    assert r["127.0.0.2"]["bytes"] > 0 and r["127.0.0.3"]["bytes"] > 0, "striped over the whole near tier"
    for a in ("127.0.0.2", "127.0.0.3"):
        assert (r[a]["tier_location"], r[a]["tier"], r[a]["tier_class"]) == (f"numa:{node}", 0, "tier0"), r[a]
        assert r[a]["fallback_bytes"] == 0
    info = i.affinity_info()
    assert info["source"] == "explicit"
    assert info["locations"][f"numa:{node}"][0]["rails"] == ["127.0.0.2", "127.0.0.3"]


def _remote(i, t, dst):
    """Remote descriptors of `dst` registered on `t` (by address, as a peer names them)."""
    from multirail.agent import make_descs

    return make_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")


def test_one_agent_moves_gpu_and_host_regions_over_their_own_rails(agents) -> None:
    from multirail.gpu import DeviceBuffer

    node = _node()
    aff = {"gpu:0": [["127.0.0.3"], ["127.0.0.1"]], f"numa:{node}": [["127.0.0.1"]]}
    t, i = _pair(agents, {"affinity": aff, "gpu": "standin"}, {"gpu": "standin"})
    dst = np.zeros(8 * MiB, np.uint8)
    t.register_memory(dst)
    host = np.random.default_rng(4).integers(0, 256, 8 * MiB, dtype=np.uint8)
    gpu = DeviceBuffer(8 * MiB, device=0, kind="standin")
    gpu.copy_from_host(np.random.default_rng(5).integers(0, 256, 8 * MiB, dtype=np.uint8))
    i.register_memory(host)
    i.register_memory(gpu)
    _connect(t, i)
    _write(i, host, _remote(i, t, dst))
    r = _by_local(i)
    assert (r["127.0.0.1"]["bytes"], r["127.0.0.2"]["bytes"], r["127.0.0.3"]["bytes"]) == (8 * MiB, 0, 0), r
    assert r["127.0.0.1"]["tier_location"] == f"numa:{node}"
    assert np.array_equal(host, dst)
    _write(i, gpu, _remote(i, t, dst))
    assert np.array_equal(gpu.to_host(), dst)
    r = {x["local_addr"]: x for x in i.rail_stats("target")}
    # GPU memory may travel over the agent's tcp link for GPU memory (staged): same rails.
    assert r["127.0.0.3"]["tier_location"] == "gpu:0" and r["127.0.0.3"]["tier"] == 0, r["127.0.0.3"]
    assert r["127.0.0.2"]["bytes"] == 0, r


def test_near_tier_down_falls_back_and_returns_when_readmitted(agents) -> None:
    node = _node()
    # Link rail 0 (local 127.0.0.1) is near and shut for the first 1.5 s of the link.
    t, i = _pair(agents, {"affinity": {f"numa:{node}": [["127.0.0.1"], ["127.0.0.2"]]},
                          "faults": "0:kill@0ms+1500ms"})
    dst = np.zeros(8 * MiB, np.uint8)
    t.register_memory(dst)
    src = np.random.default_rng(6).integers(0, 256, 8 * MiB, dtype=np.uint8)
    i.register_memory(src)
    _connect(t, i)
    i.make_connection("target")
    deadline = time.monotonic() + 5
    while _by_local(i)["127.0.0.1"]["up"]:
        assert time.monotonic() < deadline, "the fault never took rail 0 down"
        time.sleep(0.01)
    _write(i, src, _remote(i, t, dst))
    assert np.array_equal(src, dst)
    r = _by_local(i)
    far = r["127.0.0.2"]
    assert far["bytes"] == 8 * MiB and far["fallback_bytes"] == 8 * MiB, far
    assert far["tier"] == 1 and far["tier_class"] == "tier1" and far["tier_reason"].startswith("fallback"), far
    assert r["127.0.0.3"]["bytes"] == 0
    # Prometheus says the same (docs/metrics.md).
    from prometheus_client import CollectorRegistry, generate_latest

    from multirail.metrics import AgentCollector

    reg = CollectorRegistry()
    reg.register(AgentCollector(lambda: [i]))
    text = generate_latest(reg).decode()
    assert f'location="numa:{node}"' in text and 'class="tier1"' in text, text
    from prometheus_client.parser import text_string_to_metric_families

    fb = [s.value for f in text_string_to_metric_families(text) for s in f.samples
          if s.name == "multirail_rail_fallback_bytes_total"]
    assert sorted(fb) == [0, 0, 8 * MiB], fb
    deadline = time.monotonic() + 15
    while not _by_local(i)["127.0.0.1"]["up"]:
        assert time.monotonic() < deadline, "rail 0 was never readmitted"
        time.sleep(0.05)
    src2 = np.random.default_rng(7).integers(0, 256, 8 * MiB, dtype=np.uint8)
    src[:] = src2
    _write(i, src, _remote(i, t, dst))
    assert np.array_equal(src, dst)
    r = _by_local(i)
    assert r["127.0.0.1"]["bytes"] == 8 * MiB and r["127.0.0.1"]["tier"] == 0, r["127.0.0.1"]
    assert r["127.0.0.2"]["bytes"] == 8 * MiB, "the far rail took nothing once the near one was back"


def test_rail_threads_run_on_their_nics_cpus(agents) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to tell a pinned thread from an unpinned one")
    node = _node()
    t, i = _pair(agents, {"affinity": {f"numa:{node}": [RAILS], "cpus": {"127.0.0.2": str(cpus[0])}}})
    dst = np.zeros(MiB, np.uint8)
    t.register_memory(dst)
    src = np.ones(MiB, np.uint8)
    i.register_memory(src)
    _connect(t, i)
    i.make_connection("target")
    _write(i, src, _remote(i, t, dst))
    ri = next(k for k, r in enumerate(i.rail_stats("target")) if r["local_addr"] == "127.0.0.2")
    allowed: dict[str, set[str]] = {}
    deadline = time.monotonic() + 5
    while True:
        for task in Path("/proc/self/task").iterdir():
            try:
                comm = task.joinpath("comm").read_text().strip()
                status = task.joinpath("status").read_text()
            except OSError:
                continue
            if comm.startswith(("mr-send-", "mr-recv-")):
                line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
                allowed.setdefault(comm, set()).add(line.split(":", 1)[1].strip())
        if f"mr-send-{ri}" in allowed or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert allowed.get(f"mr-send-{ri}") == {str(cpus[0])}, allowed
    assert allowed.get(f"mr-recv-{ri}") == {str(cpus[0])}, allowed
    others = {v for k, vs in allowed.items() if not k.endswith(f"-{ri}") for v in vs}
    assert others and str(cpus[0]) not in others, f"only rail {ri}'s threads are pinned: {allowed}"


def test_bad_affinity_is_refused_clearly(agents) -> None:
    with pytest.raises(InvalidArgumentError, match="location"):
        agents("x1", {"rails": RAILS, "affinity": {"cpu:0": ["127.0.0.1"]}})
    with pytest.raises(InvalidArgumentError, match="not one of this agent's rails"):
        agents("x2", {"rails": RAILS, "affinity": {"gpu:0": ["eth9"]}})
    with pytest.raises(InvalidArgumentError, match="affinity must be"):
        agents("x3", {"rails": RAILS, "affinity": "near"})
    a = agents("x4", {"rails": RAILS, "affinity": "auto"})  # explicit rails: auto tiers nothing
    assert a.affinity_info()["locations"] == {}


def test_bench_gpu_k_runs_on_the_standin_and_reports_the_choice() -> None:
    """`multirail bench local --gpu 0` without GPUs (stand-in device, loopback): the initiator's
    buffer is VRAM on device 0 and the output says which rails GPU 0 got and why."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo / "python"), "MULTIRAIL_GPU": "standin"}
    env.pop("MULTIRAIL_AFFINITY", None)
    cmd = [sys.executable, "-m", "multirail", "bench", "local", "--gpu", "0", "--op", "WRITE", "--start-block-size",
           "1MiB", "--max-block-size", "1MiB", "--num-iter", "2", "--warmup-iter", "1", "--check-consistency",
           "--timeout", "20", "--json", "-"]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert cp.returncode == 0, cp.stderr[-2000:]
    doc = json.loads(cp.stdout[cp.stdout.index("{"):])
    mem = doc["memory"]
    assert doc["rows"][0]["consistency"] == "ok", doc["rows"][0]
    assert "affinity" in doc["transport"], doc["transport"].keys()
    # One loopback rail: nothing to choose, and the output says why.
    assert "rail choice: every rail for gpu:0" in cp.stderr, cp.stderr[-2000:]
    assert (mem["initiator_seg_type"], mem["gpu_kind"], mem["device_id"]) == ("VRAM", "standin", 0), mem
    bad = subprocess.run([*cmd[:6], "x"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0 and "invalid choice: 'x' (a GPU index K" in bad.stderr, bad.stderr[-500:]


def test_topology_tiers_and_cpus_from_a_sysfs_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """affinity "topology"/"auto" read the tree at MULTIRAIL_SYSFS_ROOT (the testbed's pretend
    GPUs, written without root): GPU 0's rails at PIX then the rest at NODE, and each rail's
    CPUs from its NIC's local_cpulist."""
    from multirail import affinity
    from multirail.testbed import write_topology_fixture

    pytest.importorskip("multirail.topology")
    devs = ["tbr0b", "tbr1b", "tbr2b"]
    write_topology_fixture(tmp_path, devs, [0, 1])
    nic1 = (tmp_path / "class" / "net" / "tbr1b" / "device").resolve()
    (nic1 / "local_cpulist").write_text("0-1\n")
    monkeypatch.setenv("MULTIRAIL_SYSFS_ROOT", str(tmp_path))
    rows = [(d, f"10.0.{i}.2", 24, 10000, 9000, 0, "", True) for i, d in enumerate(devs)]
    aff = affinity.resolve("topology", ["10.0.0.2"], rows)
    got = aff.describe(devs)["locations"]
    assert [(t["class"], t["rails"]) for t in got["gpu:0"]] == [("PIX", devs[:2]), ("NODE", devs[2:])], got
    assert [(t["class"], t["rails"]) for t in got["gpu:1"]] == [("PIX", devs[2:]), ("NODE", devs[:2])], got
    assert aff.cpus[1] == [0, 1]
    assert aff.core_args()[0][0] == ("gpu:0", [[0, 1], [2]])
    # "auto" with an explicit rail list, or "none": nothing tiered.
    assert affinity.resolve("auto", ["10.0.0.2"], rows).tiers == {}
    assert affinity.resolve("none", "auto", rows).tiers == {}
    assert affinity.resolve("auto", "auto", rows).tiers.keys() == aff.tiers.keys()


def test_bench_kv_gpu_k_on_the_standin(tmp_path: Path) -> None:
    """`multirail bench kv --gpu 0` without GPUs: the initiator's KV pages are stand-in VRAM on
    device 0, and the output says which rails GPU 0 got."""
    import subprocess
    import sys

    from test_bench_kv import TINY

    model = tmp_path / "tiny.yaml"
    model.write_text(TINY.lstrip("\\\n"))
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo / "python"), "MULTIRAIL_GPU": "standin"}
    env.pop("MULTIRAIL_AFFINITY", None)
    cp = subprocess.run([sys.executable, "-m", "multirail", "bench", "kv", "--model", str(model), "--isl", "100",
                         "--requests", "4", "--rounds", "1", "--check-consistency", "--no-nixl", "--gpu", "0",
                         "--stall-timeout", "3"], capture_output=True, text=True, timeout=120, env=env)
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert "rail choice: every rail for gpu:0" in cp.stdout, cp.stdout[-2000:]
    assert "memory: initiator VRAM" in cp.stdout and "standin 0" in cp.stdout, cp.stdout[-2000:]
