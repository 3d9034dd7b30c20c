"""Tests of `multirail doctor` and multirail.netinfo.

Offline: the committed healthy dual-rail RoCE tree (tests/fixtures/doctor/healthy) must raise no
warn/fail; each broken variant (the healthy tree copied and mutated by one row of VARIANTS)
must raise exactly the intended (check, rail) -> status and nothing else.
Live (root only): two network namespaces joined by one veth pair per rail, with per-rail
policy routing; doctor runs inside one of them, then again after an `ip rule` is deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable

import pytest

from multirail import doctor, netinfo
from multirail.doctor import Status

REPO = Path(__file__).resolve().parents[1]
HEALTHY = REPO / "tests" / "fixtures" / "doctor" / "healthy"
R0, R1 = "ens1f0np0", "ens1f1np1"
NET0, NET1 = f"sys/class/net/{R0}", f"sys/class/net/{R1}"
IB0, IB1 = "sys/class/infiniband/mlx5_0/ports/1", "sys/class/infiniband/mlx5_1/ports/1"
PEER_ARGS = ["--peer", "10.0.0.2,10.0.1.2", "--peer-ucx-version", "1.16.0"]
ALARM = (Status.WARN, Status.FAIL)

Mutation = Callable[[Path], None]


# --- mutation helpers -------------------------------------------------------------------------


def write(rel: str, text: str) -> Mutation:
    def f(t: Path) -> None:
        p = t / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")

    return f


def rm(rel: str) -> Mutation:
    def f(t: Path) -> None:
        p = t / rel
        assert os.path.lexists(p), f"fixture has no {rel}"
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

    return f


def symlink(rel: str, target: str) -> Mutation:
    return lambda t: os.symlink(target, t / rel)


def edit_json(rel: str, fn: Callable[[list], list]) -> Mutation:
    def f(t: Path) -> None:
        p = t / rel
        p.write_text(json.dumps(fn(json.loads(p.read_text()))))

    return f


def drop_rule(src: str) -> Mutation:
    return edit_json(".cmd/ip_-j_rule_show.out", lambda rules: [r for r in rules if r.get("src") != src])


def set_rule_priority(src: str, prio: int) -> Mutation:
    return edit_json(".cmd/ip_-j_rule_show.out",
                     lambda rules: [dict(r, priority=prio) if r.get("src") == src else r for r in rules])


def set_addr(ifname: str, addrs: list[tuple[str, int]]) -> Mutation:
    def fn(links: list) -> list:
        for link in links:
            if link["ifname"] == ifname:
                link["addr_info"] = [{"family": "inet", "local": a, "prefixlen": p} for a, p in addrs]
        return links

    return edit_json(".cmd/ip_-j_addr_show.out", fn)


def add_interface(name: str, addr: str, plen: int) -> list[Mutation]:
    link = {"ifname": name, "addr_info": [{"family": "inet", "local": addr, "prefixlen": plen}]}
    return [write(f"sys/class/net/{name}/operstate", "up"), write(f"sys/class/net/{name}/mtu", "1500"),
            write(f"sys/class/net/{name}/carrier", "1"),
            edit_json(".cmd/ip_-j_addr_show.out", lambda links: links + [link])]


def ping_key(size: int, src: str, peer: str) -> str:
    return f".cmd/ping_-M_do_-s_{size}_-c_1_-W_1_-I_{src}_{peer}"


def lost_ping(size: int, src: str, peer: str) -> list[Mutation]:
    return [write(ping_key(size, src, peer) + ".out", "1 packets transmitted, 0 received, 100% packet loss"),
            write(ping_key(size, src, peer) + ".rc", "1")]


MODULES_NO_PEERMEM = "nvidia 54173696 0 - Live 0x0\nmlx5_ib 483328 0 - Live 0x0\nmlx5_core 2248704 1 mlx5_ib, Live 0x0"

# variant -> (mutations, {(check, rail): status}, extra args)
VARIANTS: dict[str, tuple[list[Mutation], dict[tuple[str, str | None], Status], list[str]]] = {
    "carrier": ([write(f"{NET1}/carrier", "0"), write(f"{NET1}/operstate", "down")],
                {("link", R1): Status.FAIL}, []),
    "admin-down": ([write(f"{NET1}/flags", "0x1002"), write(f"{NET1}/operstate", "down"), rm(f"{NET1}/carrier")],
                   {("link", R1): Status.FAIL}, []),
    "no-ipv4": ([set_addr(R1, [])], {("link", R1): Status.FAIL}, []),
    "mtu-mismatch": ([write(f"{NET1}/mtu", "4200")], {("mtu-consistency", None): Status.FAIL}, []),
    "roce-mtu-1500": ([write(f"{NET0}/mtu", "1500"), write(f"{NET1}/mtu", "1500")],
                      {("roce-mtu", R0): Status.WARN, ("roce-mtu", R1): Status.WARN}, []),
    "bond": ([symlink(f"{NET1}/master", "../bond0"), write("sys/class/net/bond0/bonding/mode", "balance-xor 2"),
              write("sys/class/net/bond0/mtu", "9000")], {("bond", R1): Status.FAIL}, []),
    "same-subnet-p2p": (add_interface("enP2p1s0f0np0", "10.0.0.15", 24), {("same-subnet", R0): Status.FAIL}, []),
    "arp-flux": ([write(f"proc/sys/net/ipv4/conf/{R0}/arp_ignore", "0")], {("arp-flux", R0): Status.WARN}, []),
    "arp-announce-all": ([write("proc/sys/net/ipv4/conf/all/arp_announce", "1"),
                          write(f"proc/sys/net/ipv4/conf/{R1}/arp_announce", "1")], {("arp-flux", R1): Status.WARN}, []),
    "rp-filter-strict-no-rule": ([write(f"proc/sys/net/ipv4/conf/{R1}/rp_filter", "1"), drop_rule("10.0.1.1")],
                                 {("rp-filter", R1): Status.WARN, ("policy-routing", R1): Status.FAIL}, []),
    "rp-filter-strict-with-rule": ([write("proc/sys/net/ipv4/conf/all/rp_filter", "1")], {}, []),
    "no-policy-rule": ([drop_rule("10.0.1.1")], {("policy-routing", R1): Status.FAIL}, []),
    "policy-rule-after-main": ([set_rule_priority("10.0.1.1", 32800)], {("policy-routing", R1): Status.FAIL}, []),
    "policy-table-empty": ([write(".cmd/ip_-j_route_show_table_rail1.out", "[]")],
                           {("policy-routing", R1): Status.FAIL}, []),
    "policy-wrong-egress": ([write(".cmd/ip_-j_route_get_10.0.1.2_from_10.0.1.1.out",
                                   json.dumps([{"dst": "10.0.1.2", "from": "10.0.1.1", "dev": R0}]))],
                            {("policy-routing", R1): Status.FAIL}, []),
    "path-mtu": (lost_ping(8972, "10.0.1.1", "10.0.1.2") + lost_ping(4172, "10.0.1.1", "10.0.1.2")
                 + [write(ping_key(1472, "10.0.1.1", "10.0.1.2") + ".out", "1 packets transmitted, 1 received")],
                 {("path-mtu", R1): Status.FAIL}, []),
    "gid-missing": ([write(f"{IB1}/gids/4", "0000:" * 7 + "0000"), write(f"{IB1}/gids/5", "0000:" * 7 + "0000"),
                     rm(f"{IB1}/gid_attrs/types/4"), rm(f"{IB1}/gid_attrs/types/5")],
                    {("roce-gid", R1): Status.FAIL}, []),
    "gid-v1-only": ([write(f"{IB1}/gid_attrs/types/5", "IB/RoCE v1")], {("roce-gid", R1): Status.FAIL}, []),
    "gid-on-bond": ([write(f"{IB1}/gid_attrs/ndevs/5", "bond0")], {("roce-gid", R1): Status.FAIL}, []),
    "no-rdma-mapping": ([rm(f"{NET1}/device/infiniband"), rm(f"sys/class/infiniband/mlx5_1/device/net/{R1}")],
                        {("rdma-mapping", R1): Status.FAIL}, []),
    "rdma-port-down": ([write(f"{IB0}/state", "1: DOWN")], {("rdma-mapping", R0): Status.FAIL}, []),
    "peermem-missing": ([write("proc/modules", MODULES_NO_PEERMEM), rm("sys/module/nvidia_peermem")],
                        {("gpudirect", None): Status.WARN}, []),
    # No UCX: transport=auto leaves the RDMA rails on tcp, and says why and what to install.
    "ucx-missing": ([rm(".cmd/ucx_info_-v.out")],
                    {("ucx", None): Status.FAIL, ("transport", R0): Status.WARN, ("transport", R1): Status.WARN}, []),
    "ucx-peer-mismatch": ([], {("ucx-peer", None): Status.FAIL}, ["--peer-ucx-version", "1.21.0"]),
    "ucx-peer-patch": ([], {("ucx-peer", None): Status.WARN}, ["--peer-ucx-version", "1.16.1"]),
    "pfc-off": ([write(f".cmd/mlnx_qos_-i_{R0}.out", "PFC configuration:\n\tpriority 0 1 2 3 4 5 6 7\n"
                       "\tenabled 0 0 0 0 0 0 0 0")], {("pfc", R0): Status.WARN}, []),
    "ecn-off": ([write(f"{NET1}/ecn/roce_np/enable/3", "0")], {("ecn", R1): Status.WARN}, []),
    "counters-unreadable": ([rm(f"{IB1}/counters")], {("counters", R1): Status.WARN}, []),
}


def make_variant(tmp_path: Path, mutations: list[Mutation]) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(HEALTHY, tree, symlinks=True)
    for m in mutations:
        m(tree)
    return tree


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = doctor.main(["--json", *args])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def alarms(report: dict) -> dict[tuple[str, str | None], Status]:
    return {(r["name"], r["rail"]): Status(r["status"]) for r in report["results"] if Status(r["status"]) in ALARM}


# --- fixtures: healthy and broken --------------------------------------------------------------


def test_healthy_raises_no_alarm(capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = run_json(capsys, "--root", str(HEALTHY))
    assert rc == 0 and rep["exit_code"] == 0
    assert alarms(rep) == {}
    assert rep["rails"] == [R0, R1], "auto-detection must pick the RDMA-backed NICs, not eno1"
    assert "RDMA device" in rep["selection"]
    names = {r["name"] for r in rep["results"]}
    assert set(doctor.CHECK_NAMES) <= names
    skipped = {r["name"] for r in rep["results"] if r["status"] == "skip"}
    assert skipped == {"path-mtu", "ucx-peer"}, "only peer checks may skip without --peer"


def test_healthy_with_peer_runs_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = run_json(capsys, "--root", str(HEALTHY), *PEER_ARGS)
    assert rc == 0 and alarms(rep) == {}
    assert all(r["status"] == "ok" for r in rep["results"]), [r for r in rep["results"] if r["status"] != "ok"]
    assert rep["peers"] == {R0: "10.0.0.2", R1: "10.0.1.2"}
    egress = [r["evidence"] for r in rep["results"] if r["name"] == "policy-routing"]
    assert f"leaves via {R1}" in egress[1]


def test_gid_index_read_from_table(capsys: pytest.CaptureFixture[str]) -> None:
    _, rep = run_json(capsys, "--root", str(HEALTHY))
    gid = {r["rail"]: r["evidence"] for r in rep["results"] if r["name"] == "roce-gid"}
    assert "GID index 3" in gid[R0]
    assert "GID index 5" in gid[R1], "the RoCE v2 GID of 10.0.1.1 is at index 5 in the fixture, not 3"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_broken_variant_flags_exactly_its_check(variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mutations, expected, extra = VARIANTS[variant]
    tree = make_variant(tmp_path, mutations)
    rc, rep = run_json(capsys, "--root", str(tree), "--rails", f"{R0},{R1}", *PEER_ARGS, *extra)
    assert alarms(rep) == expected
    for r in rep["results"]:
        if (r["name"], r["rail"]) in expected:
            assert r["fix"], f"{r['name']} gives no fix command"
            assert r["evidence"]
    assert rc == (1 if Status.FAIL in expected.values() else 0)


OPEN_MODULE = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder@U16)\n"


@pytest.mark.parametrize("osrelease, status", [("6.8.0-45-generic", Status.OK), ("5.4.0-150-generic", Status.WARN)])
def test_gpudirect_counts_dma_buf(osrelease: str, status: Status, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35, item 7b: no peermem, but the open kernel module on Linux >= 5.12: dma-buf
    GPUDirect, so no warning (and the evidence says dma-buf); on an older kernel it warns."""
    tree = make_variant(tmp_path, [write("proc/modules", MODULES_NO_PEERMEM), rm("sys/module/nvidia_peermem"),
                                   write("proc/driver/nvidia/version", OPEN_MODULE),
                                   write("proc/sys/kernel/osrelease", osrelease + "\n")])
    _, rep = run_json(capsys, "--root", str(tree), "--rails", f"{R0},{R1}")
    (gd,) = [r for r in rep["results"] if r["name"] == "gpudirect"]
    assert Status(gd["status"]) == status, gd
    assert ("dma-buf" in gd["evidence"]) if status == Status.OK else ("older than 5.12" in gd["evidence"]), gd


def test_gpudirect_counts_the_peer_memory_client(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35, item 7b: the peer-memory client's sysfs entry counts as peermem (UCX checks it)."""
    tree = make_variant(tmp_path, [write("proc/modules", MODULES_NO_PEERMEM), rm("sys/module/nvidia_peermem"),
                                   write("sys/kernel/mm/memory_peers/nv_mem/version", "1.3-0\n")])
    _, rep = run_json(capsys, "--root", str(tree), "--rails", f"{R0},{R1}")
    (gd,) = [r for r in rep["results"] if r["name"] == "gpudirect"]
    assert gd["status"] == "ok" and "nv_mem" in gd["evidence"], gd


def test_every_check_has_a_broken_variant() -> None:
    flagged = {name for _, exp, _ in VARIANTS.values() for name, _ in exp}
    # rail-selection fails only without rails; tested separately below.
    assert set(doctor.CHECK_NAMES) - {"rail-selection"} <= flagged


def test_two_rails_in_one_subnet_warn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_variant(tmp_path, [set_addr(R1, [("10.0.0.3", 24)])])
    _, rep = run_json(capsys, "--root", str(tree))
    same = [r for r in rep["results"] if r["name"] == "same-subnet"]
    assert [r["status"] for r in same] == ["warn"] and R1 in same[0]["evidence"]


def test_arp_flux_fails_when_subnet_shared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_variant(tmp_path, add_interface("enP2p1s0f0np0", "10.0.0.15", 24)
                        + [write(f"proc/sys/net/ipv4/conf/{R0}/arp_ignore", "0")])
    _, rep = run_json(capsys, "--root", str(tree))
    assert alarms(rep)[("arp-flux", R0)] is Status.FAIL


def test_fallback_selection_without_rdma(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_variant(tmp_path, [rm("sys/class/infiniband"), rm(f"{NET0}/device/infiniband"),
                                   rm(f"{NET1}/device/infiniband")])
    rc, rep = run_json(capsys, "--root", str(tree))
    assert rep["rails"] == ["eno1", R0, R1]
    assert "no RDMA devices" in rep["selection"]
    by = {(r["name"], r["rail"]): r["status"] for r in rep["results"]}
    assert by[("rdma-mapping", R0)] == by[("roce-gid", R1)] == by[("pfc", R0)] == "skip"
    # eno1 has MTU 1500 while the rails have 9000: a real finding of the fallback choice.
    assert by[("mtu-consistency", None)] == "fail" and rc == 1


# The field notes' first setup: both RoCE ports enslaved to bond0 (balance-xor), the address on the bond.
BONDED: list[Mutation] = add_interface("bond0", "192.168.100.10", 24) + [
    write("sys/class/net/bond0/bonding/mode", "balance-xor 2"), write("sys/class/net/bond0/bonding/slaves", f"{R0} {R1}"),
    symlink(f"{NET0}/master", "../bond0"), symlink(f"{NET1}/master", "../bond0"),
    write(f"{NET0}/bonding_slave/state", "active"), write(f"{NET1}/bonding_slave/state", "active"),
    set_addr(R0, []), set_addr(R1, []),
]


@pytest.mark.parametrize("mgmt", [True, False], ids=["with-mgmt-nic", "rdma-nics-only"])
def test_bonded_host_without_rails_names_the_bond(mgmt: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_variant(tmp_path, BONDED + ([] if mgmt else [set_addr("eno1", [])]))
    rc, rep = run_json(capsys, "--root", str(tree))
    assert rep["rails"] == [R0, R1], "the enslaved RDMA NICs are the rails, not eno1 and not none"
    sel = [r for r in rep["results"] if r["name"] == "rail-selection"]
    assert [r["status"] for r in sel] == ["fail"]
    ev, fix = sel[0]["evidence"], sel[0]["fix"]
    for fact in ("bond0", "192.168.100.10/24", f"mlx5_0->{R0}", f"mlx5_1->{R1}", "RDMA verbs cannot use", "own address"):
        assert fact in ev, (fact, ev)
    for cmd in (f"ip link set {R0} nomaster", f"ip link set {R1} nomaster", "ip link delete bond0",
                f"ip addr add 192.168.100.10/24 dev {R0}", f"ip addr add <address>/<prefix> dev {R1}", "netplan"):
        assert cmd in fix, (cmd, fix)
    assert "--rails" not in fix
    # Plain doctor reports what `--rails` naming the NICs reports, plus the host-level finding.
    _, named = run_json(capsys, "--root", str(tree), "--rails", f"{R0},{R1}")
    assert alarms(named)[("bond", R0)] is alarms(named)[("bond", R1)] is Status.FAIL
    assert alarms(rep) == {**alarms(named), ("rail-selection", None): Status.FAIL}
    assert rc == 1 and rep["exit_code"] == 1


def test_enslaved_rdma_nic_named_when_another_rail_has_an_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_variant(tmp_path, BONDED + [set_addr(R0, [("10.0.0.1", 24)])])
    _, rep = run_json(capsys, "--root", str(tree))
    assert rep["rails"] == [R0] and f"ignored (no IPv4): {R1} (enslaved to bond0)" in rep["selection"]


def test_no_rails_fails_rail_selection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_variant(tmp_path, [rm("sys/class/infiniband")] + [set_addr(n, []) for n in ("eno1", R0, R1)])
    rc, rep = run_json(capsys, "--root", str(tree))
    assert rc == 1 and [r["status"] for r in rep["results"]] == ["fail"]
    assert rep["results"][0]["name"] == "rail-selection"


# --- CLI behaviour --------------------------------------------------------------------------------


def test_human_output_no_colour_off_tty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_variant(tmp_path, VARIANTS["no-policy-rule"][0])
    rc = doctor.main(["--root", str(tree)])
    out = capsys.readouterr().out
    assert rc == 1 and "\033[" not in out
    assert "FAIL  policy-routing" in out and "fix: ip route add 10.0.1.0/24 dev ens1f1np1" in out
    assert out.rstrip().endswith("-> exit 1")


@pytest.mark.parametrize("args, message", [
    (["--root", "/nonexistent-dir"], "no sys/class/net"),
    (["--rails", "ens1f0np0,nope0"], "no interface named nope0"),
    (["--rails", ","], "empty list"),
    (["--peer-ucx-version", "latest"], "expected a version"),
    (["--peer", "not a host!"], "cannot resolve"),
])
def test_usage_errors_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    root = [] if args[0] == "--root" else ["--root", str(HEALTHY)]
    rc = doctor.main(root + args)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_cli_subprocess_json() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    cp = subprocess.run([sys.executable, "-m", "multirail.doctor", "--json", "--root", str(HEALTHY)],
                        capture_output=True, text=True, timeout=60, env=env, check=False)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["summary"]["fail"] == 0


def test_register_adds_subparser() -> None:
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    doctor.register(sub)
    args = p.parse_args(["doctor", "--root", str(HEALTHY), "--json"])
    assert args.func is not None and args.root == str(HEALTHY) and args.json


# --- units ------------------------------------------------------------------------------------------


def test_roce_active_mtu() -> None:
    assert doctor.roce_active_mtu(9000) == 4096
    assert doctor.roce_active_mtu(4192) == 4096
    assert doctor.roce_active_mtu(4191) == 2048
    assert doctor.roce_active_mtu(1500) == 1024  # the seed's "active_mtu: 1024" at MTU 1500


def test_parse_ucx_version() -> None:
    assert doctor.parse_ucx_version("# Library version: 1.16.0\n# Library path: x") == "1.16.0"
    assert doctor.parse_ucx_version("# UCT version=1.8.0 revision c30b7da") == "1.8.0"
    assert doctor.parse_ucx_version("garbage") is None


def test_pair_peers() -> None:
    rails = [netinfo.Interface(n, [(a, 24)], 9000, None, None, True, True, None, None, None)
             for n, a in (("a0", "10.1.0.1"), ("a1", "10.1.1.1"))]
    assert doctor.pair_peers(rails, ["10.1.1.2", "10.1.0.2"]) == {"a0": "10.1.0.2", "a1": "10.1.1.2"}
    assert doctor.pair_peers(rails, ["10.9.0.2"]) == {"a0": "10.9.0.2", "a1": "10.9.0.2"}


# --- netinfo --------------------------------------------------------------------------------------


def test_netinfo_interfaces_from_fixture() -> None:
    ifs = {i.name: i for i in netinfo.interfaces(str(HEALTHY))}
    assert set(ifs) == {"lo", "eno1", R0, R1}
    r1 = ifs[R1]
    assert (r1.rdma_dev, r1.rdma_port, r1.mtu, r1.speed_mbps, r1.numa_node) == ("mlx5_1", 1, 9000, 100000, 0)
    assert r1.ipv4 == [("10.0.1.1", 24)] and r1.oper_up and r1.carrier and r1.master is None
    assert ifs["eno1"].rdma_dev is None and ifs["lo"].oper_up
    assert netinfo.interface_for_addr("10.0.0.1", str(HEALTHY)).name == R0  # type: ignore[union-attr]
    assert netinfo.interface_for_addr("10.9.9.9", str(HEALTHY)) is None


def test_netinfo_counters(tmp_path: Path) -> None:
    c = netinfo.read_counters(R0, str(HEALTHY))
    assert (c.tx_bytes, c.rx_bytes, c.source) == (30_000_000 * 4, 40_000_000 * 4, "rdma:mlx5_0/1")
    e = netinfo.read_counters("eno1", str(HEALTHY))
    assert (e.tx_bytes, e.source) == (5_000_000, "netdev:eno1")
    tree = make_variant(tmp_path, [rm(f"{IB1}/counters"), rm(f"{NET1}/statistics")])
    with pytest.raises(OSError, match="counters of ens1f1np1 are not readable"):
        netinfo.read_counters(R1, str(tree))
    with pytest.raises(OSError, match="no interface"):
        netinfo.read_counters("nope0", str(HEALTHY))


def test_probes(tmp_path: Path) -> None:
    assert netinfo.cmd_key(["ip", "-j", "route", "get", "1.2.3.4", "from", "5.6.7.8"]) == \
        "ip_-j_route_get_1.2.3.4_from_5.6.7.8"
    rec = netinfo.RecordedProbe(HEALTHY)
    assert rec.run(["ucx_info", "-v"]).ok
    miss = rec.run(["ucx_info", "-d"])
    assert miss.missing and miss.rc == 127
    live = netinfo.LiveProbe()
    assert live.run(["definitely-not-a-command-xyz"]).missing
    slow = live.run([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.3)
    assert slow.rc == 124 and not slow.ok
    assert isinstance(netinfo.make_probe(str(HEALTHY)), netinfo.RecordedProbe)
    assert isinstance(netinfo.make_probe("/"), netinfo.LiveProbe)


# --- live: namespaces with per-rail policy routing (root) ------------------------------------------

NEEDS_NETNS = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to create network namespaces",
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, timeout=10, capture_output=True)


@pytest.fixture
def netns_pair():
    """Namespaces A and B joined by veth a0-b0 (10.77.0.0/24) and a1-b1 (10.77.1.0/24);
    A has per-rail tables 100/101 with `from <addr>` rules and ARP flux settings."""
    tag = f"{os.getpid() % 10000}{uuid.uuid4().hex[:4]}"
    a, b = f"mrdA{tag}", f"mrdB{tag}"
    created: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            created.append(ns)
        for i in (0, 1):
            _ip("-n", a, "link", "add", f"a{i}", "mtu", "9000", "type", "veth", "peer", "name", f"b{i}",
                "mtu", "9000", "netns", b)
            _ip("-n", a, "addr", "add", f"10.77.{i}.1/24", "dev", f"a{i}")
            _ip("-n", b, "addr", "add", f"10.77.{i}.2/24", "dev", f"b{i}")
            _ip("-n", a, "link", "set", f"a{i}", "up")
            _ip("-n", b, "link", "set", f"b{i}", "up")
            _ip("-n", a, "route", "add", f"10.77.{i}.0/24", "dev", f"a{i}", "table", str(100 + i))
            _ip("-n", a, "rule", "add", "from", f"10.77.{i}.1", "table", str(100 + i), "priority", str(1000 + i))
            for key, val in (("arp_ignore", "1"), ("arp_announce", "2")):
                subprocess.run(["ip", "netns", "exec", a, "sysctl", "-q", "-w", f"net.ipv4.conf.a{i}.{key}={val}"],
                               check=True, timeout=10, capture_output=True)
        yield a
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], timeout=10, capture_output=True, check=False)


def _doctor_in(ns: str) -> tuple[int, dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    cp = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "multirail.doctor", "--json",
                         "--rails", "a0,a1", "--peer", "10.77.0.2,10.77.1.2"],
                        capture_output=True, text=True, timeout=60, env=env, check=False)
    assert cp.returncode in (0, 1), cp.stderr
    return cp.returncode, json.loads(cp.stdout)


@NEEDS_NETNS
def test_live_namespaces_policy_routing(netns_pair: str) -> None:
    rc, rep = _doctor_in(netns_pair)
    by = {(r["name"], r["rail"]): r for r in rep["results"]}
    for rail in ("a0", "a1"):
        assert by[("link", rail)]["status"] == "ok", by[("link", rail)]
        assert by[("policy-routing", rail)]["status"] == "ok", by[("policy-routing", rail)]
        assert f"leaves via {rail}" in by[("policy-routing", rail)]["evidence"]
        assert by[("rdma-mapping", rail)]["status"] == "skip"  # veth: no RDMA
        path = by[("path-mtu", rail)]
        assert path["status"] == ("ok" if shutil.which("ping") else "skip"), path
    assert rc == 0, [r for r in rep["results"] if r["status"] == "fail"]

    _ip("-n", netns_pair, "rule", "del", "from", "10.77.1.1", "table", "101")
    rc, rep = _doctor_in(netns_pair)
    by = {(r["name"], r["rail"]): r for r in rep["results"]}
    assert by[("policy-routing", "a1")]["status"] == "fail"
    assert "no rule selects a table for traffic from 10.77.1.1" in by[("policy-routing", "a1")]["evidence"]
    assert by[("policy-routing", "a0")]["status"] == "ok"
    assert rc == 1


def test_malformed_recordings_give_findings_not_tracebacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_variant(tmp_path, [write(".cmd/ip_-j_rule_show.out", "not json"),
                                   write(".cmd/ucx_info_-v.rc", "garbage"),
                                   write(f"{NET0}/mtu", "abc")])
    rc, rep = run_json(capsys, "--root", str(tree), "--rails", f"{R0},{R1}")
    by = {(r["name"], r["rail"]): r["status"] for r in rep["results"]}
    assert by[("policy-routing", R0)] == "skip"  # `ip -j rule show` unusable
    assert by[("ucx", None)] == "fail" and by[("roce-mtu", R0)] == "skip"
    assert by[("mtu-consistency", None)] == "fail" and rc == 1


# --- transport: what each rail would run (issue 21) -------------------------------------------


def test_transport_check_names_each_rails_choice(capsys: pytest.CaptureFixture[str]) -> None:
    """Healthy RoCE rails with a UCX found: auto picks ucx, saying why; tcp asked per rail stands."""
    _, rep = run_json(capsys, "--root", str(HEALTHY), "--transport", "auto,tcp")
    tr = {r["rail"]: r for r in rep["results"] if r["name"] == "transport"}
    assert tr[R0]["status"] == "ok" and "ucx (auto: RDMA device mlx5_0, UCX has ib)" in tr[R0]["evidence"], tr
    assert tr[R1]["status"] == "ok" and "tcp (explicit)" in tr[R1]["evidence"], tr


def test_transport_check_warns_for_ucx_without_rdma(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ucx asked for by name where the UCX found has no RDMA transport (none found here): UCX
    over tcp, which checks no memory bounds: a warning with the fix, on each rail."""
    tree = make_variant(tmp_path, [rm(".cmd/ucx_info_-v.out")])
    _, rep = run_json(capsys, "--root", str(tree), "--transport", "ucx")
    tr = [r for r in rep["results"] if r["name"] == "transport"]
    assert [r["status"] for r in tr] == ["warn", "warn"], tr
    assert all("no memory bounds" in r["evidence"] and "SECURITY.md" in r["evidence"] for r in tr), tr
    assert all("'auto' or 'tcp'" in r["fix"] for r in tr), tr


def test_transport_check_refuses_a_bad_list(capsys: pytest.CaptureFixture[str]) -> None:
    rc = doctor.main(["--root", str(HEALTHY), "--transport", "ucx,tcp,tcp"])
    assert rc == 2 and "3 transports for 2 rails" in capsys.readouterr().err
