"""Rails chosen for a GPU region, end to end over the testbed (issue 34, "How to prove it").

`Testbed(rails=3, gpu_near=[0, 1])` writes a sysfs-like tree per side in which rails 0 and 1
are near a pretend GPU 0 and rail 2 is not; the initiator (namespace b, affinity "topology",
MULTIRAIL_SYSFS_ROOT at that tree) registers a stand-in GPU region on device 0 and WRITEs it
to the target (namespace a). Its veths' own counters show where the bytes went: rails 0 and 1
only; with both near rails down the far rail carries the transfer and rail_stats says it is a
NODE-class fallback; once they are readmitted the near rails take over again.

Needs root, network namespaces, the built engine and multirail.topology; skips otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import netns_unavailable

REPO = Path(__file__).resolve().parents[1]
PEER = str(Path(__file__).with_name("affinity_peer.py"))
MiB = 1 << 20
N = 8 * MiB


def _why_not() -> str | None:
    try:
        import multirail._core  # noqa: F401
        import multirail.topology  # noqa: F401
    except ImportError as e:
        return f"needs the built engine and multirail.topology ({e})"
    return netns_unavailable()


_SKIP = _why_not()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


class Peer:
    """A peer process inside a namespace, speaking one JSON line per command."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)

    def read(self, timeout: float = 30.0) -> dict[str, Any]:
        import select

        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        line = self.p.stdout.readline() if r else ""  # type: ignore[union-attr]
        if not line:
            self.p.kill()
            raise AssertionError(f"peer gave no answer: {self.p.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        return json.loads(line)

    def ask(self, cmd: str, timeout: float = 40.0) -> dict[str, Any]:
        self.p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]
        return self.read(timeout)

    def close(self) -> None:
        try:
            self.p.stdin.close()  # type: ignore[union-attr]
            self.p.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait(timeout=10)


def test_gpu_region_takes_its_near_rails_falls_back_and_returns() -> None:
    from multirail.testbed import Testbed

    tb = Testbed(f"af{uuid.uuid4().hex[:6]}", rails=3, gpu_near=[0, 1])
    env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "MULTIRAIL_GPU": "standin"}
    env.pop("MULTIRAIL_AFFINITY", None)
    peers: list[Peer] = []
    with tb:
        st = tb.status()
        assert st["topology"]["gpu_near"] == [0, 1] and not st["problems"], st
        devs = [r.devs["b"] for r in tb.rails]
        try:
            t = Peer(tb.exec_argv("a", [sys.executable, PEER, "target", ",".join(tb.addrs("a"))]), env)
            peers.append(t)
            ready = t.read()
            ienv = {**env, "MULTIRAIL_SYSFS_ROOT": str(tb.sysfs_root("b"))}
            i = Peer(tb.exec_argv("b", [sys.executable, PEER, "initiator", ",".join(tb.addrs("b")),
                                        tb.addrs("a")[0], str(ready["port"]), str(ready["addr"])]), ienv)
            peers.append(i)
            gpu0 = i.ask("info")["affinity"]["locations"]["gpu:0"]
            assert [(x["class"], x["rails"]) for x in gpu0] == [("PIX", devs[:2]), ("NODE", devs[2:])], gpu0

            # 1. Near rails only, striped over both.
            out = i.ask("write")
            tx = out["tx"]
            assert tx[devs[0]] > N // 8 and tx[devs[1]] > N // 8, tx
            assert tx[devs[0]] + tx[devs[1]] >= N, tx
            assert tx[devs[2]] < 256 << 10, f"the far rail carried bytes of a GPU 0 transfer: {tx}"
            rails = out["rails"]
            assert [(r["tier_location"], r["tier"], r["tier_class"]) for r in rails[:2]] == [("gpu:0", 0, "PIX")] * 2

            # 2. Both near rails down: the far rail (next class) carries it, and says so.
            tb.set_link(0, False, side="b")
            tb.set_link(1, False, side="b")
            out = i.ask("write")
            tx, far = out["tx"], out["rails"][2]
            assert tx[devs[2]] >= N * 3 // 4, tx
            assert (far["tier_location"], far["tier"], far["tier_class"]) == ("gpu:0", 1, "NODE"), far
            assert far["fallback_bytes"] > 0 and far["tier_reason"].startswith("fallback"), far
            assert not out["rails"][0]["up"] and not out["rails"][1]["up"]

            # 3. Readmitted, the near rails take over again.
            tb.set_link(0, True, side="b")
            tb.set_link(1, True, side="b")
            assert i.ask("up 0")["up"] and i.ask("up 1")["up"]
            out = i.ask("write")
            tx = out["tx"]
            assert tx[devs[0]] + tx[devs[1]] >= N and tx[devs[2]] < 256 << 10, tx
        finally:
            for p in reversed(peers):
                p.close()

        # 4. `multirail bench --gpu 0` on the same testbed: the choice, and the NICs that carried it.
        cmd = [sys.executable, "-m", "multirail", "bench", "local", "--testbed", tb.name, "--gpu", "0", "--op", "WRITE",
               "--start-block-size", "4MiB", "--max-block-size", "4MiB", "--num-iter", "2", "--warmup-iter", "1",
               "--check-consistency", "--json", "-"]
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert cp.returncode == 0, cp.stderr[-2000:]
        doc = json.loads(cp.stdout[cp.stdout.index("{"):])
        assert "rail choice (topology of" in cp.stderr and "gpu:0: tier 0 PIX" in cp.stderr, cp.stderr[-2000:]
        tiers = doc["transport"]["affinity"]["locations"]["gpu:0"]
        assert [(x["class"], x["rails"]) for x in tiers] == [("PIX", devs[:2]), ("NODE", devs[2:])], tiers
        assert [r["tier_class"] for r in doc["transport"]["rails"][:2]] == ["PIX", "PIX"], doc["transport"]["rails"]
        row = doc["rows"][0]
        assert row["consistency"] == "ok", row
        nic = {r["name"]: r["bytes"] for r in row["rails"]}
        assert nic[devs[2]] < 256 << 10 and nic[devs[0]] > 0 and nic[devs[1]] > 0, nic
