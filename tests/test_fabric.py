"""Tests of `multirail fabric` (python/multirail/fabric/).

Fast group (no root): topology validation (each listed error: overlapping subnets, duplicate
ASNs, a NIC on two rails, an MTU larger than the fabric's, and a few more), the renderers on
the two-rail lab (netplan tables and rules, FRR BGP/BFD/ECMP, NX-OS QoS), our own netplan
check, `netplan generate --root-dir` (skips where netplan is missing), and clear refusals.

Root group: brings the two-rail lab up in namespaces with FRR under a unique prefix, verifies
it, runs `multirail bench` over it (skips if the engine is not built), deletes one server's
policy rule and expects `fabric verify` (and `doctor`, where present) to fail, and tears down
in fixture teardown even when a test fails. Skips without root, `ip netns` or FRR.
"""

from __future__ import annotations

import argparse
import ipaddress
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
import yaml

from multirail import fabric as fabric_cli
from multirail.fabric import emulate
from multirail.fabric.model import TopologyError, load_topology, parse_topology
from multirail.fabric.plan import check_netplan, netplan_generate, render_frr, render_netplan, render_nxos, write_plan

REPO = Path(__file__).resolve().parents[1]
LAB = REPO / "examples" / "fabric" / "two-rail-lab.yaml"
PY_PATH = str(REPO / "python")
ENV = {**os.environ, "PYTHONPATH": PY_PATH + os.pathsep + os.environ.get("PYTHONPATH", "")}


def lab_doc() -> dict[str, Any]:
    return yaml.safe_load(LAB.read_text())


def problems_of(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(TopologyError) as ei:
        parse_topology(yaml.safe_dump(doc), "test.yaml")
    return ei.value.problems


def run_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="multirail")
    fabric_cli.register(p.add_subparsers())
    args = p.parse_args(argv)
    return args.func(args)


# ----------------------------------------------------------------------------- model

def test_lab_parses_like_the_seed() -> None:
    t = load_topology(LAB)
    assert [s.asn for s in t.spines] == [65000, 65000]
    assert [(lf.name, lf.rail, lf.asn, lf.vlan, str(lf.subnet), str(lf.gateway), lf.table) for lf in t.leaves] == [
        ("leaf1", 0, 65001, 100, "10.0.0.0/24", "10.0.0.254", 100),
        ("leaf2", 1, 65002, 101, "10.0.1.0/24", "10.0.1.254", 101)]
    leaf1 = t.router("leaf1")
    assert {(str(n.peer_ip), n.peer_asn) for n in t.neighbors(leaf1)} == {("10.4.0.6", 65000), ("10.4.0.2", 65000)}
    assert {str(n.peer_ip) for n in t.neighbors(t.router("spine1"))} == {"10.4.0.5", "10.4.0.14"}
    assert [(n.name, n.rail, str(n.address), n.mtu) for n in t.servers[1].nics] == [
        ("ens6d1", 0, "10.0.0.2", 9000), ("ens6", 1, "10.0.1.2", 9000)]


def _overlap(d: dict[str, Any]) -> None:
    d["leaves"][1]["subnet"] = "10.0.0.0/23"
    d["leaves"][1]["gateway"] = "10.0.1.254"


def _dup_asn(d: dict[str, Any]) -> None:
    d["leaves"][1]["asn"] = 65001


def _leaf_spine_asn(d: dict[str, Any]) -> None:
    d["leaves"][0]["asn"] = 65000


def _nic_two_rails(d: dict[str, Any]) -> None:
    d["servers"][0]["nics"].append({"name": "ens6", "rail": 0, "address": "10.0.0.11"})


def _nic_mtu(d: dict[str, Any]) -> None:
    d["servers"][0]["nics"][0]["mtu"] = 9500


def _server_mtu(d: dict[str, Any]) -> None:
    d["fabric"]["server_mtu"] = 9300


def _link_overlap(d: dict[str, Any]) -> None:
    d["links"][1]["spine_ip"], d["links"][1]["leaf_ip"] = "10.4.0.6/29", "10.4.0.5/29"


def _two_nics_one_rail(d: dict[str, Any]) -> None:
    d["servers"][0]["nics"][1].update(rail=0, address="10.0.0.9")


@pytest.mark.parametrize("mutate, expect", [
    (_overlap, "overlapping subnets: rail 0 subnet (leaf1) 10.0.0.0/24 and rail 1 subnet (leaf2) 10.0.0.0/23"),
    (_link_overlap, "overlapping subnets: link spine1-leaf1 10.4.0.4/30 and link spine2-leaf1 10.4.0.0/29"),
    (_dup_asn, "duplicate ASN 65001: leaves leaf1 and leaf2"),
    (_leaf_spine_asn, "duplicate ASN 65000: leaf leaf1 uses a spine's ASN"),
    (_nic_two_rails, "NIC ens6 of gpuserver1 is on two rails (1 at servers[0].nics[1] and 0)"),
    (_two_nics_one_rail, "gpuserver1 has two NICs on rail 0 (ens6d1 and ens6)"),
    (_nic_mtu, "servers[0].nics[0].mtu: 9500 is larger than the fabric MTU 9216"),
    (_server_mtu, "fabric.server_mtu: 9300 is larger than the fabric MTU 9216"),
], ids=["overlap-rails", "overlap-links", "dup-asn", "leaf-uses-spine-asn", "nic-two-rails",
        "two-nics-one-rail", "nic-mtu", "server-mtu"])
def test_validation_errors(mutate: Any, expect: str) -> None:
    d = lab_doc()
    mutate(d)
    probs = problems_of(d)
    assert any(expect in p for p in probs), probs


@pytest.mark.parametrize("mutate, expect", [
    (lambda d: d["leaves"][0].update(colour="red"), "leaves[0].colour: unknown key"),
    (lambda d: d["servers"][1]["nics"][0].update(address="10.0.2.2"), "is not a host address of rail 0's subnet"),
    (lambda d: d["servers"][1]["nics"][0].update(address="10.0.0.999"), "'10.0.0.999' is not an IPv4 address"),
    (lambda d: d["links"].pop(), "links: leaf leaf2 has no link to spine spine2"),
    (lambda d: d["links"][0].update(spine="spine9"), "links[0].spine: no spine named 'spine9'"),
    (lambda d: d["spines"][0].update(asn="x"), "spines[0].asn: ASN must be an integer"),
    (lambda d: d["servers"][0]["nics"][0].update(name="a-very-long-ifname"), "not a valid Linux interface name"),
    (lambda d: d["servers"][0]["nics"][0].update(rail=7), "no leaf serves rail 7"),
    (lambda d: d["servers"][1]["nics"][1].update(address="10.0.1.1"), "duplicate address 10.0.1.1"),
])
def test_more_validation_errors(mutate: Any, expect: str) -> None:
    d = lab_doc()
    mutate(d)
    probs = problems_of(d)
    assert any(expect in p for p in probs), probs


def test_all_problems_reported_at_once() -> None:
    d = lab_doc()
    _dup_asn(d)
    _nic_mtu(d)
    probs = problems_of(d)
    assert any("duplicate ASN" in p for p in probs) and any("larger than the fabric MTU" in p for p in probs)


def test_not_yaml_and_missing_file() -> None:
    with pytest.raises(TopologyError, match="not valid YAML"):
        parse_topology("spines: [unclosed", "x.yaml")
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology("/nonexistent/topo.yaml")


def test_links_allocated_from_pool_when_omitted() -> None:
    d = lab_doc()
    del d["links"]
    t = parse_topology(yaml.safe_dump(d))
    assert len(t.links) == 4
    nets = [lk.spine_ip.network for lk in t.links]
    assert len(set(nets)) == 4 and all(n.prefixlen == 30 and n.subnet_of(ipaddress.IPv4Network("10.4.0.0/24")) for n in nets)
    assert all(lk.spine_ip.ip != lk.leaf_ip.ip for lk in t.links)


# ----------------------------------------------------------------------------- renderers

def test_netplan_has_per_rail_tables_and_rules() -> None:
    t = load_topology(LAB)
    doc = yaml.safe_load(render_netplan(t, t.servers[0]))
    eths = doc["network"]["ethernets"]
    assert set(eths) == {"ens6d1", "ens6"}
    for nic, addr, table, gw, net in (("ens6d1", "10.0.0.1", 100, "10.0.0.254", "10.0.0.0/24"),
                                      ("ens6", "10.0.1.1", 101, "10.0.1.254", "10.0.1.0/24")):
        e = eths[nic]
        assert e["addresses"] == [f"{addr}/24"] and e["mtu"] == 9000
        assert [(r["from"], r["table"]) for r in e["routing-policy"]] == [(addr, table)]
        assert {"to": "0.0.0.0/0", "via": gw, "table": table} in e["routes"]
        assert {"to": net, "scope": "link", "table": table} in e["routes"]
    assert check_netplan(render_netplan(t, t.servers[0])) == []


def test_check_netplan_catches_rule_without_table() -> None:
    t = load_topology(LAB)
    doc = yaml.safe_load(render_netplan(t, t.servers[0]))
    del doc["network"]["ethernets"]["ens6"]["routing-policy"][0]["table"]
    doc["network"]["ethernets"]["ens6d1"]["routing-policy"][0]["table"] = 150
    probs = check_netplan(yaml.safe_dump(doc))
    assert any("ens6.routing-policy[0]: rule from 10.0.1.1 has no table" in p for p in probs), probs
    assert any("table 150 has no routes" in p for p in probs), probs


def test_frr_config() -> None:
    t = load_topology(LAB)
    leaf1 = render_frr(t, t.router("leaf1"))
    for line in ("router bgp 65001", "bgp router-id 10.2.0.3", "no bgp ebgp-requires-policy",
                 "neighbor 10.4.0.6 remote-as 65000", "neighbor 10.4.0.2 remote-as 65000",
                 "neighbor 10.4.0.6 bfd", "neighbor 10.4.0.2 bfd", "network 10.0.0.0/24",
                 "network 10.2.0.3/32", "network 10.3.0.1/32", "maximum-paths 2"):
        assert line in leaf1, line
    spine2 = render_frr(t, t.router("spine2"))
    assert "neighbor 10.4.0.1 remote-as 65001" in spine2 and "neighbor 10.4.0.9 remote-as 65002" in spine2
    assert "maximum-paths" not in spine2 and "network 10.2.0.2/32" in spine2
    d = lab_doc()
    d["fabric"]["bfd"] = False
    assert " bfd" not in render_frr(parse_topology(yaml.safe_dump(d)), t.router("leaf1"))


def test_nxos_config() -> None:
    t = load_topology(LAB)
    leaf2 = render_nxos(t, t.router("leaf2"))
    for line in ("system jumbomtu 9216", "match dscp 26", "permit udp any any eq 4791", "set qos-group 3",
                 "pause pfc-cos 3", "class type network-qos c-nq3", "random-detect threshold burst-optimized ecn",
                 "priority-flow-control mode on", "vlan 101", "interface Vlan101", "ip address 10.0.1.254/24",
                 "switchport access vlan 101", "interface Ethernet1/27", "interface Ethernet1/28",
                 "router bgp 65002", "neighbor 10.4.0.13", "remote-as 65000", "maximum-paths 2",
                 "ip address 10.4.0.14/30", "network 10.0.1.0/24"):
        assert line in leaf2, line
    assert leaf2.count("  mtu 9216") >= 5 and leaf2.count("    bfd") == 2
    spine1 = render_nxos(t, t.router("spine1"))
    assert "interface Vlan" not in spine1 and "neighbor 10.4.0.5" in spine1 and "pause pfc-cos 3" in spine1


def test_write_plan_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["fabric", "plan", str(LAB), "--out", str(tmp_path / "out")]) == 0
    names = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert names == ["frr/leaf1/frr.conf", "frr/leaf2/frr.conf", "frr/spine1/frr.conf", "frr/spine2/frr.conf",
                     "netplan/gpuserver1/60-multirail-rails.yaml", "netplan/gpuserver2/60-multirail-rails.yaml",
                     "nxos/leaf1.cfg", "nxos/leaf2.cfg", "nxos/spine1.cfg", "nxos/spine2.cfg"]
    assert "plan for two-rail-lab: 10 files" in capsys.readouterr().out


def test_cli_bad_input_is_a_message_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = lab_doc()
    _dup_asn(d)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(d))
    assert run_cli(["fabric", "validate", str(bad)]) == 2
    assert run_cli(["fabric", "plan", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "duplicate ASN 65001" in err and "Traceback" not in err
    assert run_cli(["fabric", "validate", str(LAB)]) == 0


@pytest.mark.skipif(shutil.which("netplan") is None, reason="netplan (netplan.io) is not installed")
def test_netplan_generate_accepts_plan_and_rejects_garbage() -> None:
    t = load_topology(LAB)
    for s in t.servers:
        res = netplan_generate(render_netplan(t, s))
        assert res is not None and res[0], res
    bad = netplan_generate("network:\n  version: 2\n  ethernets:\n    ens6:\n      mtu: lots\n")
    assert bad is not None and not bad[0]


def test_write_plan_reports_netplan_problems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from multirail.fabric import plan

    t = load_topology(LAB)
    monkeypatch.setattr(plan, "render_netplan", lambda topo, s: "network:\n  version: 2\n  ethernets:\n"
                        "    ens6:\n      routing-policy:\n        - from: 10.0.1.1\n")
    res = write_plan(t, tmp_path, validate_netplan=False)
    assert any("has no table" in p for p in res.problems)


def test_up_refuses_without_root_or_frr(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 1000)
    assert run_cli(["fabric", "up", str(LAB), "--prefix", "mrtnoroot"]) == 1
    assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 0)
    monkeypatch.setattr(emulate, "FRR_DIR", Path("/nonexistent/frr"))
    with pytest.raises(emulate.FabricError, match="FRR is not installed"):
        emulate.preflight()


def test_bad_prefix_and_missing_state(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run_cli(["fabric", "up", str(LAB), "--prefix", "bad prefix!"]) == 1
    assert "invalid prefix" in capsys.readouterr().err
    assert run_cli(["fabric", "verify", "--state-dir", str(tmp_path / "none")]) == 1
    assert "no fabric is up" in capsys.readouterr().err


# ----------------------------------------------------------------------------- root: emulation

def _can_emulate() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    try:
        emulate.preflight()
    except emulate.FabricError as exc:
        return str(exc)
    probe = f"mrtprobe{uuid.uuid4().hex[:6]}"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if p.returncode != 0:
        return f"`ip netns add` is not permitted here: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


_SKIP = _can_emulate()
needs_fabric = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


def _cli(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    code = ("import sys, argparse; from multirail import fabric as f; p = argparse.ArgumentParser(); "
            "f.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
    return subprocess.run([sys.executable, "-c", code, "fabric", *argv], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.fixture(scope="module")
def lab() -> Iterator[emulate.Instance]:
    if _SKIP is not None:
        pytest.skip(_SKIP)
    prefix = f"mrt{uuid.uuid4().hex[:5]}"
    state = emulate.STATE_ROOT / prefix  # FRR (user frr) must be able to enter it
    t0 = time.monotonic()
    try:
        res = _cli("up", str(LAB), "--prefix", prefix, "--state-dir", str(state), "--timeout", "60")
        assert res.returncode == 0, res.stdout + res.stderr
        print(f"\nfabric up: {time.monotonic() - t0:.1f} s ({res.stdout.strip().splitlines()[-3]})")
        yield emulate.Instance.load(None, str(state))
    finally:
        inst = emulate.Instance.create(load_topology(LAB), prefix, str(state))
        pids = [p for r in inst.topo.routers for d in emulate.FRR_DAEMONS
                if (p := emulate._live_pid(inst.router_dir(r.name), d))]
        res = _cli("down", "--prefix", prefix, "--state-dir", str(state))
        left = set(inst.namespaces) & emulate.existing_namespaces()
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and not emulate._is_zombie(p)]
        print(f"fabric up..down: {time.monotonic() - t0:.1f} s")
        assert res.returncode == 0 and not left and not alive and not state.exists(), (res.stderr, left, alive)


@needs_fabric
def test_verify_healthy_fabric(lab: emulate.Instance) -> None:
    res = _cli("verify", "--state-dir", str(lab.state_dir), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["failed"] == 0
    names = [c["name"] for c in doc["checks"]]
    for prefix, count in (("bgp ", 4), ("bfd ", 4), ("ecmp ", 2), ("policy ", 4), ("source-route ", 8),
                          ("reach same-rail", 4), ("reach cross-rail", 4), ("mtu same-rail", 4), ("mtu cross-rail", 4)):
        assert sum(n.startswith(prefix) for n in names) == count, (prefix, names)
    ecmp = [c for c in doc["checks"] if c["name"].startswith("ecmp leaf1")][0]
    assert ecmp["detail"]["nexthops"] == ["10.4.0.2", "10.4.0.6"]


@needs_fabric
def test_status_json_and_up_refuses_twice(lab: emulate.Instance) -> None:
    res = _cli("status", "--state-dir", str(lab.state_dir), "--json")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["phase"] == "up" and st["namespaces_present"]
    assert [[r["address"] for r in s["rails"]] for s in st["servers"]] == [["10.0.0.1", "10.0.1.1"], ["10.0.0.2", "10.0.1.2"]]
    assert all(all(r["daemons"].values()) for r in st["routers"])
    again = _cli("up", str(LAB), "--prefix", lab.prefix, "--state-dir", str(lab.state_dir))
    assert again.returncode == 1 and "already (partly) up" in again.stderr


def _engine_missing() -> str | None:
    p = subprocess.run([sys.executable, "-c", "import multirail._core"], capture_output=True, text=True,
                       timeout=30, env=ENV)
    return None if p.returncode == 0 else "multirail._core is not built (maturin develop): no engine to bench"


@needs_fabric
def test_bench_over_fabric(lab: emulate.Instance, tmp_path: Path) -> None:
    reason = _engine_missing()
    if reason:
        pytest.skip(reason)
    s1, s2 = lab.topo.servers
    ns1, ns2 = lab.ns(s1.name), lab.ns(s2.name)
    rails1 = ",".join(str(n.address) for n in s1.nics)
    rails2 = ",".join(str(n.address) for n in s2.nics)
    listen = f"{s1.nics[0].address}:{47000 + os.getpid() % 1000}"
    target = subprocess.Popen(["ip", "netns", "exec", ns1, sys.executable, "-m", "multirail", "bench", "target",
                               "--listen", listen, "--rails", rails1, "--total-buffer-size", "16MiB",
                               "--duration", "60", "--idle-timeout", "30"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    out = tmp_path / "bench.json"
    try:
        deadline = time.monotonic() + 30
        assert target.stdout is not None
        ready = False
        while time.monotonic() < deadline and not ready:
            line = target.stdout.readline()
            if not line:
                break
            ready = '"ready"' in line
        err = target.stderr.read() if target.stderr is not None and target.poll() is not None else ""
        assert ready, f"target never became ready: {err}"
        res = subprocess.run(["ip", "netns", "exec", ns2, sys.executable, "-m", "multirail", "bench", "initiator",
                              "--connect", listen, "--rails", rails2, "--op", "READ", "--start-block-size", "1MiB",
                              "--max-block-size", "16MiB", "--num-iter", "5", "--warmup-iter", "1",
                              "--check-consistency", "--json", str(out)],
                             capture_output=True, text=True, timeout=90, env=ENV)
        assert res.returncode == 0, res.stdout + res.stderr
        doc = json.loads(out.read_text())
        rows = doc["rows"]
        assert rows and all(r["gbps"] > 0 for r in rows) and not any(r["consistency"].startswith("FAILED") for r in rows)
        big = rows[-1]
        rails = big.get("rails") or []
        assert len(rails) == 2 and all(r["bytes"] > 0 for r in rails), rails  # striped over both rails
        print(f"\nbench over fabric: READ {big['block_size']} B: {big['gbps']:.2f} Gbps; rails: "
              + ", ".join(f"{r.get('name')}={r.get('bytes')}" for r in big.get("rails", [])))
    finally:
        target.kill()
        target.communicate(timeout=10)


@needs_fabric
def test_missing_policy_rule_is_caught(lab: emulate.Instance) -> None:
    server = lab.topo.servers[0]
    nic = server.nics[0]
    table = lab.topo.leaf_for_rail(nic.rail).table
    ns = lab.ns(server.name)
    rule = ["from", str(nic.address), "table", str(table), "priority", str(1000 + nic.rail)]
    subprocess.run(["ip", "-n", ns, "rule", "del", *rule], check=True, timeout=10)
    try:
        res = _cli("verify", "--state-dir", str(lab.state_dir))
        assert res.returncode == 1, res.stdout
        fails = [ln for ln in res.stdout.splitlines() if ln.startswith("FAIL")]
        text = "\n".join(fails)
        assert f"no rule `from {nic.address} lookup {table}`" in text, text
        assert f"from {nic.address} leaves on ens6, expected ens6d1 (rail 0)" in text, text
        assert "reach cross-rail" in text and "rp_filter drops" in text, text
        assert not any("same-rail" in ln or ln.startswith("FAIL bgp") for ln in fails), text
        doctor = _doctor(ns, server)
        if doctor is not None:
            assert doctor.returncode == 1, doctor.stdout
            assert f"no rule selects a table for traffic from {nic.address}" in doctor.stdout, doctor.stdout
    finally:
        subprocess.run(["ip", "-n", ns, "rule", "add", *rule], check=True, timeout=10)
    assert _cli("verify", "--state-dir", str(lab.state_dir)).returncode == 0


def _doctor(ns: str, server: Any) -> subprocess.CompletedProcess[str] | None:
    """`multirail doctor` inside the server namespace, or None where the doctor tool is absent."""
    if not (REPO / "python" / "multirail" / "doctor.py").exists():
        return None
    peers = ",".join(f"10.0.{n.rail}.2" for n in server.nics)
    code = ("import sys, argparse; from multirail import doctor as d; p = argparse.ArgumentParser(); "
            "d.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code, "doctor",
                           "--rails", ",".join(n.name for n in server.nics), "--peer", peers],
                          capture_output=True, text=True, timeout=60, env=ENV)


@needs_fabric
def test_down_after_partial_up(tmp_path: Path) -> None:
    """A crash after the namespaces exist but before FRR starts: `down` still removes all."""
    inst = emulate.Instance.create(load_topology(LAB), f"mrt{uuid.uuid4().hex[:5]}", str(tmp_path / "st"))
    try:
        inst.write_state("creating")
        emulate._build_network(inst)
        assert set(inst.namespaces) <= emulate.existing_namespaces()
    finally:
        res = _cli("down", "--state-dir", str(inst.state_dir))
    assert res.returncode == 0, res.stderr
    assert not set(inst.namespaces) & emulate.existing_namespaces()
    assert not inst.state_dir.exists()
