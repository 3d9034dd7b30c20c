"""Tests of `multirail testbed` (python/multirail/testbed.py).

The first group needs nothing (rate parsing, naming, validation). The rest builds real
testbeds in network namespaces and needs root plus a kernel that allows `ip netns add`; those
skip with a reason otherwise. Every testbed gets a unique name ("t" + 4 hex) and is torn down
by a fixture even when the test fails. The iperf3 test needs iperf3 and runs 1 s per rail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from multirail import testbed as tbm
from multirail.testbed import Testbed, TestbedError, TbfParams, format_rate, parse_rate

REPO = Path(__file__).resolve().parents[1]
PY_PATH = str(REPO / "python")
TIMEOUT = 30


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    kw.setdefault("timeout", TIMEOUT)
    return subprocess.run(argv, capture_output=True, text=True, **kw)


def _cli(*args: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": PY_PATH, "PYTHONDONTWRITEBYTECODE": "1"}
    return _run([*(prefix or []), sys.executable, "-m", "multirail.testbed", *args], env=env, cwd="/")


def _unique_name() -> str:
    return "t" + uuid.uuid4().hex[:4]


# --------------------------------------------------------------------------- no root needed


@pytest.mark.parametrize("text,bps", [
    ("2gbit", 2_000_000_000), ("500mbit", 500_000_000), ("1.5gbit", 1_500_000_000), ("2g", 2_000_000_000),
    ("2G", 2_000_000_000), ("750kbit", 750_000), ("1000000", 1_000_000), ("0.5g", 500_000_000),
])
def test_parse_rate_accepts(text: str, bps: int) -> None:
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["2gbps", "2gb", "fast", "", "0", "-1gbit", "1e9", "200gbit"])
def test_parse_rate_refuses_with_message(text: str) -> None:
    with pytest.raises(TestbedError, match="bad rate"):
        parse_rate(text)


def test_rate_words_and_format() -> None:
    assert tbm.parse_rate_or_none("none") is None and tbm.parse_rate_or_none("2gbit") == 2 * 10**9
    assert [format_rate(x) for x in (None, 2 * 10**9, 1_500_000_000, 500 * 10**6)] == \
        ["unshaped", "2gbit", "1.5gbit", "500mbit"]


def test_tbf_burst_is_max_of_256k_and_1ms() -> None:
    assert TbfParams.for_rate(1 * 10**9).burst_bytes == 256 * 1024          # 1 ms = 125 kB < 256 KiB
    assert TbfParams.for_rate(4 * 10**9).burst_bytes == 500_000             # 1 ms at 4 Gbit/s
    p = TbfParams.for_rate(2 * 10**9)
    assert p.limit_bytes > p.burst_bytes and "rate 2000000000bit burst 262144" in p.tc_args()


def test_names_devices_and_addresses() -> None:
    tb = Testbed("mrtb", rates=["2gbit", "1gbit", "none"])
    assert (tb.ns("a"), tb.ns("b")) == ("mrtb-a", "mrtb-b")
    assert [r.devs for r in tb.rails][2] == {"a": "mrtbr2a", "b": "mrtbr2b"}
    assert tb.addrs("a") == ["10.231.0.1", "10.231.1.1", "10.231.2.1"]
    assert tb.addrs("b")[1] == "10.231.1.2" and tb.rails[1].subnet == "10.231.1.0/24"
    assert tb.rates == [2 * 10**9, 10**9, None] and [r.table for r in tb.rails] == [100, 101, 102]
    assert tb.exec_argv("b", ["iperf3", "-c", "x"]) == ["ip", "netns", "exec", "mrtb-b", "iperf3", "-c", "x"]
    assert Testbed("x", rails=1, subnet_base="10.99").rails[0].addrs["a"] == "10.99.0.1"


@pytest.mark.parametrize("kwargs,msg", [
    ({"name": "averyverylongname"}, "too long"),
    ({"name": "bad name"}, "bad testbed name"),
    ({"rails": 0}, "rails must be"),
    ({"rails": 3, "rates": ["1g", "1g"]}, "3 rails but 2 rates"),
    ({"rate": "1g", "rates": ["1g"]}, "either rate"),
    ({"mtu": 100}, "mtu"),
    ({"subnet_base": "10.300"}, "subnet base"),
])
def test_constructor_refuses_bad_input(kwargs: dict[str, Any], msg: str) -> None:
    with pytest.raises(TestbedError, match=msg):
        Testbed(**kwargs)
    with pytest.raises(TestbedError, match="side"):
        Testbed().ns("c")


# --------------------------------------------------------------------------- root needed


def _netns_capable() -> str | None:
    """None when we can create namespaces, else the reason we cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) not installed"
    probe = "mrprobe" + uuid.uuid4().hex[:6]
    cp = _run(["ip", "netns", "add", probe])
    _run(["ip", "netns", "del", probe])
    return None if cp.returncode == 0 else f"cannot create network namespaces: {cp.stderr.strip()}"


_NO_NETNS = _netns_capable()
needs_netns = pytest.mark.skipif(_NO_NETNS is not None, reason=_NO_NETNS or "")


@pytest.fixture
def name() -> Iterator[str]:
    """A unique testbed name; the testbed is removed afterwards whatever happened."""
    n = _unique_name()
    yield n
    Testbed(n, rails=1).down()
    assert not any(Path("/run/netns", f"{n}-{s}").exists() for s in "ab")


def _links(ns: str) -> dict[str, dict[str, Any]]:
    return {l["ifname"]: l for l in json.loads(_run(["ip", "-n", ns, "-j", "addr", "show"]).stdout)}


def _tbf_rate_bps(ns: str, dev: str) -> int | None:
    for q in json.loads(_run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev]).stdout):
        if q.get("kind") == "tbf" and q.get("root"):
            return int(q["options"]["rate"]) * 8
    return None


@needs_netns
def test_up_status_down_round_trip(name: str) -> None:
    tb = Testbed(name, rails=2, rate="2gbit")
    assert tb.up() == "created"
    # Check the live system directly, not only through status().
    for side, host in (("a", 1), ("b", 2)):
        ns = f"{name}-{side}"
        assert Path("/run/netns", ns).exists()
        links = _links(ns)
        assert links["lo"]["operstate"] in ("UNKNOWN", "UP")
        rules = _run(["ip", "-n", ns, "rule", "show"]).stdout
        for i in range(2):
            dev = f"{name}r{i}{side}"
            assert links[dev]["mtu"] == 9000 and links[dev]["operstate"] == "UP"
            assert any(a["local"] == f"10.231.{i}.{host}" and a["prefixlen"] == 24 for a in links[dev]["addr_info"])
            assert _tbf_rate_bps(ns, dev) == 2 * 10**9
            assert f"from 10.231.{i}.{host} lookup {100 + i}" in rules
            assert f"10.231.{i}.0/24 dev {dev}" in _run(["ip", "-n", ns, "route", "show", "table", str(100 + i)]).stdout
        sysctl = _run(["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.conf.all.arp_ignore",
                       "net.ipv4.conf.all.arp_announce", "net.ipv4.conf.all.rp_filter"]).stdout.split()
        assert sysctl == ["1", "2", "1"]
    # Traffic sourced from rail 1 is routed out of rail 1 by the policy rule.
    route = _run(["ip", "-n", f"{name}-b", "route", "get", "10.231.1.1", "from", "10.231.1.2"]).stdout
    assert f"dev {name}r1b" in route and "table 101" in route
    ping = _run(tb.exec_argv("b", ["ping", "-c", "1", "-W", "2", "-I", "10.231.1.2", "10.231.1.1"]))
    assert ping.returncode == 0, ping.stdout + ping.stderr

    st = tb.status()
    assert st["up"] is True and st["problems"] == [] and st["namespaces"] == {"a": f"{name}-a", "b": f"{name}-b"}
    r0 = st["rails"][0]
    assert (r0["index"], r0["subnet"], r0["rate_bps"], r0["mtu"]) == (0, "10.231.0.0/24", 2 * 10**9, 9000)
    assert r0["a"]["dev"] == f"{name}r0a" and r0["a"]["addr"] == "10.231.0.1" and r0["a"]["link_up"] is True
    assert r0["b"]["dev"] == f"{name}r0b" and r0["b"]["addr"] == "10.231.0.2" and r0["b"]["link_up"] is True
    assert r0["tbf"]["burst_bytes"] == 256 * 1024

    cli = _cli("status", "--name", name, "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["rails"] == st["rails"]
    assert Testbed.load(name).spec() == tb.spec()  # type: ignore[union-attr]

    assert tb.down() is True
    assert not Path("/run/netns", f"{name}-a").exists() and not Path("/run/netns", f"{name}-b").exists()
    assert not tb.state_path.exists() and Testbed.load(name) is None
    assert tb.down() is False
    cli = _cli("down", "--name", name)
    assert cli.returncode == 0 and "nothing to remove" in cli.stdout
    cli = _cli("status", "--name", name, "--json")
    assert cli.returncode == 1 and json.loads(cli.stdout)["up"] is False


@needs_netns
def test_up_is_idempotent_and_rebuilds_on_new_spec(name: str) -> None:
    first = _cli("up", "--name", name, "--rails", "2", "--rate", "2gbit", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["action"] == "created"
    handle = json.loads(_run(["tc", "-n", f"{name}-a", "-j", "qdisc", "show", "dev", f"{name}r0a"]).stdout)[0]["handle"]
    again = _cli("up", "--name", name, "--rails", "2", "--rate", "2gbit")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    # Nothing was touched: the qdisc is the same instance.
    assert json.loads(_run(["tc", "-n", f"{name}-a", "-j", "qdisc", "show", "dev", f"{name}r0a"]).stdout)[0]["handle"] == handle

    # Heterogeneous rates: a different spec rebuilds, and status reports each rail's rate.
    het = _cli("up", "--name", name, "--rates", "2gbit,1gbit,500mbit", "--json")
    assert het.returncode == 0, het.stderr
    st = json.loads(het.stdout)
    assert st["action"] == "rebuilt" and st["problems"] == []
    assert [r["rate_bps"] for r in st["rails"]] == [2 * 10**9, 10**9, 500 * 10**6]
    assert [_tbf_rate_bps(f"{name}-b", f"{name}r{i}b") for i in range(3)] == [2 * 10**9, 10**9, 500 * 10**6]
    assert "500mbit" in _cli("status", "--name", name).stdout


@needs_netns
def test_stale_and_half_built_testbeds_are_cleaned(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stale namespace of the same name (e.g. from a killed run): status flags it, down removes it.
    _run(["ip", "netns", "add", f"{name}-a"], check=True)
    _run(["ip", "-n", f"{name}-a", "link", "add", f"{name}r0a", "type", "veth", "peer", "name", f"{name}r0b"], check=True)
    st = Testbed(name).status()
    assert st["up"] is False and "exists but no testbed state" in st["problems"][0]
    assert Testbed(name).down() is True and not Path("/run/netns", f"{name}-a").exists()

    # up over a stale namespace rebuilds it cleanly.
    _run(["ip", "netns", "add", f"{name}-b"], check=True)
    assert Testbed(name, rails=1).up() == "rebuilt"
    assert Testbed(name, rails=1).status()["problems"] == []
    Testbed(name).down()

    # A build that fails mid-way (here: at the qdisc step) leaves nothing behind.
    real_run = tbm._run

    def failing_run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        if argv[0] == "tc" and "-batch" in argv:
            raise TestbedError("injected failure")
        return real_run(argv, **kw)

    monkeypatch.setattr(tbm, "_run", failing_run)
    with pytest.raises(TestbedError, match="injected"):
        Testbed(name, rails=2, rate="1gbit").up()
    monkeypatch.undo()
    assert not any(Path("/run/netns", f"{name}-{s}").exists() for s in "ab")
    assert Testbed.load(name) is None


@needs_netns
def test_set_link_and_delete_rail(name: str) -> None:
    tb = Testbed(name, rails=2, rate="1gbit")
    tb.up()

    def ping(rail: int, expect: bool = True) -> bool:
        """Whether rail `rail` carries a ping. Where it should (`expect`), up to 10 probes
        0.2 s apart within 5 s, so one lost to a loaded host fails nothing; where it should
        not, one probe with 1 s to answer."""
        opts = ["-c", "1", "-i", "0.2", "-w", "5"] if expect else ["-c", "1", "-W", "1"]
        cp = _run(tb.exec_argv("b", ["ping", *opts, "-I", f"10.231.{rail}.2", f"10.231.{rail}.1"]))
        return cp.returncode == 0

    tb.set_link(1, False)  # side a down: side b loses carrier
    st = tb.status()
    assert [st["rails"][1][s]["link_up"] for s in "ab"] == [False, False]
    assert st["rails"][1]["a"]["admin_up"] is False and st["rails"][0]["a"]["link_up"] is True
    assert st["problems"] and not ping(1, expect=False) and ping(0)
    tb.set_link(1, True)
    assert tb.status()["problems"] == [] and ping(1)  # policy routes were restored

    tb.delete_rail(0)
    st = tb.status()
    assert st["rails"][0]["present"] is False and st["rails"][1]["present"] is True
    for s in "ab":
        assert f"{name}r0{s}" not in _links(f"{name}-{s}")
        assert "lookup 100" not in _run(["ip", "-n", f"{name}-{s}", "rule", "show"]).stdout
    assert not ping(0, expect=False) and ping(1)
    assert tb.up() == "rebuilt" and ping(0)
    with pytest.raises(TestbedError, match="no rail 5"):
        tb.set_link(5, False)


@needs_netns
def test_context_manager_always_tears_down(name: str) -> None:
    with pytest.raises(RuntimeError):
        with Testbed(name, rails=1) as tb:
            assert tb.status()["up"] is True
            raise RuntimeError("boom")
    assert not Path("/run/netns", f"{name}-a").exists() and Testbed.load(name) is None


def _iperf3_rate(tb: Testbed, rail: int, seconds: int = 1) -> float:
    """Receiver-side goodput (bit/s) of one bounded iperf3 run over `rail`."""
    a, b = tb.rails[rail].addrs["a"], tb.rails[rail].addrs["b"]
    server = subprocess.Popen(tb.exec_argv("a", ["iperf3", "-s", "-1", "-B", a, "-p", "5201"]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):  # wait until the server listens
            if _run(tb.exec_argv("a", ["ss", "-Htln", "sport = :5201"])).stdout.strip():
                break
            time.sleep(0.05)
        cp = _run(tb.exec_argv("b", ["iperf3", "-c", a, "-B", b, "-p", "5201", "-t", str(seconds), "-J"]))
        assert cp.returncode == 0, cp.stdout[-500:] + cp.stderr
        return float(json.loads(cp.stdout)["end"]["sum_received"]["bits_per_second"])
    finally:
        server.kill()
        server.wait(timeout=10)


@needs_netns
@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed")
def test_each_rail_delivers_its_rate(name: str) -> None:
    """Each rail carries its own rate within 5%, never more.

    The CPUs are shared with other jobs, so a 1 s run that falls short (CPU starvation can only
    slow a run down) is retried up to twice; a run above 105% fails at once (shaping broken)."""
    tb = Testbed(name, rates=["2gbit", "1gbit"])
    tb.up()
    for rail, rate in enumerate(tb.rates):
        assert rate is not None
        runs = []
        for _ in range(3):
            runs.append(_iperf3_rate(tb, rail))
            assert runs[-1] <= 1.05 * rate, f"rail {rail}: {runs[-1] / 1e9:.3f} Gbit/s exceeds {rate / 1e9} Gbit/s"
            if runs[-1] >= 0.95 * rate:
                break
        assert runs[-1] >= 0.95 * rate, f"rail {rail}: {[round(r / 1e9, 3) for r in runs]} Gbit/s vs {rate / 1e9} Gbit/s"


def _unprivileged_prefix() -> list[str] | None:
    """A command prefix that runs the CLI without root.

    A user namespace comes first: the child sees euid 65534 and holds no capability outside it,
    yet keeps root's file access, so a checkout under a private directory (mktemp -d is 0700)
    still imports; dropping to user nobody would fail there for another reason than the one
    asserted."""
    if os.geteuid() != 0:
        return []  # we are already unprivileged
    try:
        ok = subprocess.run(["unshare", "--user", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if ok:
        return ["unshare", "--user"]
    if shutil.which("setpriv"):
        return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--"]
    return None


@pytest.mark.skipif(_unprivileged_prefix() is None, reason="neither setpriv nor runuser available to drop root")
@pytest.mark.parametrize("cmd", [["up", "--rails", "2", "--rate", "1gbit"], ["down"], ["status", "--json"]])
def test_refuses_without_root(cmd: list[str]) -> None:
    cp = _cli(*cmd[:1], "--name", _unique_name(), *cmd[1:], prefix=_unprivileged_prefix())
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert "needs root" in cp.stderr and "Traceback" not in cp.stderr


@needs_netns
def test_cli_bad_input_is_a_clear_error(name: str) -> None:
    for args in (["--rate", "2gbps"], ["--rails", "2", "--rates", "1g,1g,1g"], ["--rates", "1g,fast"]):
        cp = _cli("up", "--name", name, *args)
        assert cp.returncode == 1 and "error:" in cp.stderr and "Traceback" not in cp.stderr, cp.stderr
    cp = _cli("up", "--name", "much-too-long-name")
    assert cp.returncode == 1 and "too long" in cp.stderr
    assert not Path("/run/netns", f"{name}-a").exists()


@needs_netns
@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed")
def test_compare_rails_script(name: str, tmp_path: Path) -> None:
    """A 1 s run of benchmarks/compare_rails.py: every baseline row measured, on the right rails.

    The throughput floors are loose (the CPUs are shared; test_each_rail_delivers_its_rate checks
    the rates precisely); the point is that each method ran and used the rails it should."""
    out = tmp_path / "cmp.json"
    extra = [] if shutil.which("mptcpize") else ["--skip-mptcp"]
    cp = _run([sys.executable, str(REPO / "benchmarks" / "compare_rails.py"), "--name", name, "--rails", "2",
               "--rate", "1gbit", "--time", "1", "--skip-multirail", "--json", str(out), *extra],
              env={**os.environ, "PYTHONPATH": PY_PATH}, timeout=90)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "| iperf3 all rails (1 stream/rail) |" in cp.stdout and "skipped (--skip-multirail)" in cp.stdout
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    for i in range(2):
        assert rows[f"iperf3 rail {i} alone"]["pct_nominal"] > 80
        assert rows[f"iperf3 rail {i} alone"]["rail_share"][i] > 99
    both = rows["iperf3 all rails (1 stream/rail)"]
    assert both["pct_nominal"] > 80 and all(35 < s < 65 for s in both["rail_share"])
    if not extra:  # MPTCP really used both rails: the server-side announcement worked
        mptcp = rows["MPTCP (1 subflow/rail)"]
        assert mptcp["pct_nominal"] > 60 and all(s > 25 for s in mptcp["rail_share"]), mptcp
    assert Testbed.load(name) is None  # the script removed the testbed it created
