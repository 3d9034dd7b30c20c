"""Failover drills on the emulated testbed: a rail dies (or flaps) under a live transfer.

Model
-----
A drill runs on a testbed (python/multirail/testbed.py) with two processes, as on two hosts:

* the **target**, `multirail bench target` in namespace ``NAME-a`` on all of a's rail
  addresses (started by `target_in`, killed by PID when the drill ends);
* the **initiator**, ``python -m multirail.bench.drill SPEC`` in namespace ``NAME-b``: it
  connects with `EngineWorker` (the bench's initiator), runs the scenario and prints one JSON
  object on stdout. It also breaks the rails itself (`Testbed.set_link` on side a, run from
  inside b, which works because ``ip -n`` addresses namespaces by name), so the moment a link
  goes down and the engine's view of it (`Agent.rail_stats`, polled every millisecond or two)
  are read with one clock.

Scenarios (``SPEC["mode"]``):

* ``failover``: a baseline transfer on all rails; then a transfer during which rail ``rail`` is
  taken down once ``fraction`` of its bytes are done (detect time = link down -> the engine
  marks the rail down; remainder rate = bytes done after detection / time after detection);
  a transfer with the rail still down (the one-rail rate of this run); the link back up, the
  time until the engine readmits the rail; a last transfer that must use it again. Every
  transfer is checked byte for byte.
* ``all_down``: every rail is taken down mid-transfer; the transfer must fail (PeerLostError)
  within stall_timeout + slack.
* ``stale_write``: a WRITE loses a rail mid-way, the next WRITE overwrites the range and is
  verified, the link comes back, and the range is verified again (a chunk left queued on the
  dead rail's socket must not land late and overwrite newer data).
* ``flap``: transfers back to back for the whole drill while one rail goes down and up
  ``flaps`` times; counts transfers completed, failed and bytes corrupted.

Host side: `run_drill(tb, spec)` starts the target, runs the initiator under a timeout and
returns its JSON (raising `DrillError` with the initiator's stderr when it produced none).
Nothing here imports the engine at import time; the initiator imports it when it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from multirail.bench.core import TARGET_SEED, first_mismatch, pattern

POLL_S = 0.001


class DrillError(RuntimeError):
    """The drill could not run or produced no result (message carries the reason)."""


# ------------------------------------------------------------------------------ host side

@contextlib.contextmanager
def target_in(tb: Any, buffer_size: int, *, connections: int = 1, chunk_size: str = "1MiB",
              stall_timeout: float = 1.0, lifetime_s: float = 300.0) -> Iterator[int]:
    """A `bench target` on every rail of namespace a; yields its port; killed by PID on exit."""
    from multirail.bench.target import launch, stop

    addrs = tb.addrs("a")
    cmd = tb.exec_argv("a", [sys.executable, "-m", "multirail", "bench", "target",
                             "--listen", f"{addrs[0]}:0", "--rails", ",".join(addrs),
                             "--total-buffer-size", str(buffer_size), "--connections", str(connections),
                             "--chunk-size", chunk_size, "--stall-timeout", str(stall_timeout),
                             "--duration", str(lifetime_s), "--idle-timeout", str(lifetime_s)])
    proc, ready, errf = launch(cmd)
    try:
        yield int(ready["port"])
    finally:
        stop(proc, grace=0.0)
        errf.close()


def run_drill(tb: Any, spec: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """Start a target, run the drill `spec` in namespace b, return the initiator's JSON result."""
    spec = {"testbed": tb.name, "target": tb.addrs("a")[0], "rails": tb.addrs("b"), **spec}
    with target_in(tb, int(spec["size"]), connections=int(spec.get("connections", 1)),
                   chunk_size=str(spec.get("chunk_size", "1MiB")),
                   stall_timeout=float(spec.get("stall_timeout", 1.0)),
                   lifetime_s=timeout + 30) as port:
        spec["port"] = port
        cmd = tb.exec_argv("b", [sys.executable, "-m", "multirail.bench.drill", json.dumps(spec)])
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:  # subprocess.run kills the child by PID
            raise DrillError(f"drill {spec['mode']} did not finish within {timeout:.0f} s; stderr: "
                             f"{(e.stderr or b'')[-800:]!r}") from None
    lines = [x for x in res.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise DrillError(f"drill {spec['mode']} failed (exit {res.returncode}): {res.stderr.strip()[-1500:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    out["stderr_tail"] = res.stderr.strip()[-1500:]
    return out


# ------------------------------------------------------------------------------ initiator side

@dataclass
class Transfer:
    """Outcome of one checked transfer."""

    ok: bool
    seconds: float                     # post -> completion (the check is not included)
    error: str | None = None
    error_type: str | None = None
    corrupt: str | None = None        # None when byte-exact (or not checked after an error)
    corrupt_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Initiator:
    """An EngineWorker plus the testbed, with the helpers the scenarios share."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from multirail.bench.core import parse_size
        from multirail.bench.worker import EngineWorker
        from multirail.testbed import Testbed

        tb = Testbed.load(spec["testbed"])
        if tb is None:
            raise DrillError(f"testbed {spec['testbed']!r} is not recorded")
        self.tb = tb
        self.op = str(spec.get("op", "READ")).upper()
        self.size = int(spec["size"])
        self.timeout = float(spec.get("timeout", 30.0))
        self.worker = EngineWorker(
            op=self.op, target_host=spec["target"], target_port=int(spec["port"]),
            target_name=spec.get("target_name", "mr-bench-target"), buffer_size=self.size,
            connections=int(spec.get("connections", 1)), rails=list(spec["rails"]),
            policy=str(spec.get("policy", "weighted")), chunk_size=parse_size(str(spec.get("chunk_size", "1MiB"))),
            timeout=self.timeout, stall_timeout=float(spec.get("stall_timeout", 1.0)),
            fill_target=self.op == "READ")
        self.agent = self.worker.agent
        self.peer = self.worker.peer
        self._expect = pattern(TARGET_SEED, 0, self.size) if self.op == "READ" else None
        self._seed = 0x1000
        self.last_end = 0.0  # monotonic time the last successful transfer completed

    def stats(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self.agent.rail_stats(self.peer)]

    def rail_bytes(self) -> list[int]:
        return [int(s["bytes"]) for s in self.stats()]

    def post(self) -> float:
        """Prepare (zero for READ, pattern for WRITE) and post one transfer; returns its start."""
        self.worker.finish_size()
        self.worker.prepare(self.size, 1, True)
        if self.op == "WRITE":  # fresh data each time: a dropped chunk must not pass unseen
            self._seed += 1
            self.worker.buf[:self.size] = pattern(self._seed, 0, self.size)
        t0 = time.monotonic()
        self.agent.transfer(self.worker.handle)
        return t0

    def finish(self, t0: float, deadline_s: float | None = None) -> Transfer:
        """Wait for the posted transfer and check every byte."""
        try:
            self.agent.wait(self.worker.handle, timeout=deadline_s or self.timeout)
        except Exception as e:  # noqa: BLE001 - every engine error is a result here
            return Transfer(False, time.monotonic() - t0, str(e), type(e).__name__)
        secs = time.monotonic() - t0
        self.last_end = t0 + secs
        if self._expect is not None:
            buf = self.worker.buf[:self.size]
            bad = int(np.count_nonzero(buf != self._expect))
            first = first_mismatch(buf, TARGET_SEED, 0) if bad else None
            return Transfer(True, secs, corrupt=None if not bad else f"first bad byte at {first}", corrupt_bytes=bad)
        problem = self.worker.verify_remote(self._seed, 0, self.size)
        return Transfer(True, secs, corrupt=problem, corrupt_bytes=0 if problem is None else -1)

    def transfer(self) -> Transfer:
        return self.finish(self.post())

    def wait_rail(self, rail: int, up: bool, limit_s: float) -> float | None:
        """Seconds until rail_stats shows `rail` up/down (polled), or None after limit_s."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            if bool(self.stats()[rail]["up"]) == up:
                return time.monotonic() - t0
            time.sleep(POLL_S)
        return None

    def wait_bytes(self, rail: int, target_bytes: int, limit_s: float) -> None:
        t0 = time.monotonic()
        while self.rail_bytes()[rail] < target_bytes and time.monotonic() - t0 < limit_s:
            time.sleep(POLL_S)

    def rail_events(self) -> list[str]:
        return [e for e in self.agent.events() if "rail" in e]

    def close(self) -> None:
        try:
            self.worker.finish_size()  # a held handle keeps the buffer registered
        finally:
            self.worker.close()


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def scenario_failover(ini: Initiator, spec: dict[str, Any]) -> dict[str, Any]:
    rail = int(spec.get("rail", 1))
    others = [i for i in range(len(ini.stats())) if i != rail]
    out: dict[str, Any] = {"rail": rail}
    base = ini.transfer()
    out["baseline"] = {**base.as_dict(), "gbps": _gbps(ini.size, base.seconds)}

    # the failover transfer: link down once `fraction` of the rail's expected share is done
    share = ini.size // (len(others) + 1)
    start = ini.rail_bytes()
    t0 = ini.post()
    ini.wait_bytes(rail, start[rail] + int(share * float(spec.get("fraction", 0.5))), ini.timeout)
    before_down = ini.rail_bytes()
    t_down = time.monotonic()
    ini.tb.set_link(rail, False)
    t_link = time.monotonic()
    detect_after_call = ini.wait_rail(rail, False, ini.timeout)
    detect = None if detect_after_call is None else time.monotonic() - t_down
    res = ini.finish(t0)
    t_end = ini.last_end
    end = ini.rail_bytes()
    done_at_down = sum(b - s for b, s in zip(before_down, start))
    out["failover"] = {
        **res.as_dict(), "gbps": _gbps(ini.size, res.seconds),
        "bytes_before_down": done_at_down,
        "link_down_call_s": t_link - t_down,
        "detect_s": detect,  # from just before `ip link set down` to rail_stats up=False
        # the rest of the transfer (in-flight chunks of the dead rail included) over the time
        # from link down to completion, and what the surviving rails moved in that time
        "remainder_bytes": ini.size - done_at_down, "remainder_s": t_end - t_down,
        "remainder_gbps": _gbps(ini.size - done_at_down, t_end - t_down),
        "survivors_gbps": _gbps(sum(end[i] - before_down[i] for i in others), t_end - t_down),
        "rail_stats": ini.stats(),
    }
    one = ini.transfer()  # the rail is still down: this is the one-rail rate of this run
    one_bytes = ini.rail_bytes()
    out["one_rail"] = {**one.as_dict(), "gbps": _gbps(ini.size, one.seconds),
                       "bytes_on_down_rail": one_bytes[rail] - end[rail]}
    t_up = time.monotonic()
    ini.tb.set_link(rail, True)
    readmit = ini.wait_rail(rail, True, float(spec.get("readmit_limit_s", 10.0)))
    out["readmit_s"] = None if readmit is None else time.monotonic() - t_up
    before_after = ini.rail_bytes()
    after = ini.transfer()
    out["after_readmit"] = {**after.as_dict(), "gbps": _gbps(ini.size, after.seconds),
                            "rail_bytes": [a - b for a, b in zip(ini.rail_bytes(), before_after)]}
    out["rail_stats_end"] = ini.stats()
    return out


def scenario_all_down(ini: Initiator, spec: dict[str, Any]) -> dict[str, Any]:
    warm = ini.transfer()
    n = len(ini.stats())
    start = ini.rail_bytes()
    t0 = ini.post()
    ini.wait_bytes(0, start[0] + ini.size // (4 * n), ini.timeout)
    for r in range(n):
        ini.tb.set_link(r, False)
    t_down = time.monotonic()
    res = ini.finish(t0, deadline_s=float(spec.get("wait_limit_s", 20.0)))
    fail_after = time.monotonic() - t_down
    out = {"warmup": warm.as_dict(), "result": res.as_dict(), "fail_after_s": fail_after,
           "rail_stats": ini.stats()}
    for r in range(n):  # give the testbed back whole
        ini.tb.set_link(r, True)
    return out


def scenario_flap(ini: Initiator, spec: dict[str, Any]) -> dict[str, Any]:
    rail, flaps = int(spec.get("rail", 1)), int(spec.get("flaps", 3))
    down_s, up_s = float(spec.get("down_s", 1.0)), float(spec.get("up_s", 2.0))
    stop = threading.Event()
    flap_log: list[dict[str, float]] = []
    flap_error: list[str] = []

    def flapper() -> None:
        try:
            time.sleep(up_s / 2)
            for _ in range(flaps):
                t = time.monotonic()
                ini.tb.set_link(rail, False)
                time.sleep(down_s)
                ini.tb.set_link(rail, True)
                flap_log.append({"down_at": t, "up_at": time.monotonic()})
                time.sleep(up_s)
        except Exception as e:  # noqa: BLE001 - reported in the result
            flap_error.append(f"{type(e).__name__}: {e}")
        finally:
            stop.set()

    th = threading.Thread(target=flapper, daemon=True)
    t_start = time.monotonic()
    th.start()
    results: list[Transfer] = []
    while not stop.is_set() or not results:
        results.append(ini.transfer())
    th.join(timeout=30)
    # one more after the last flap: the rail must be usable again
    readmit = ini.wait_rail(rail, True, 10.0)
    before = ini.rail_bytes()
    last = ini.transfer()
    wall = time.monotonic() - t_start
    ok = [r for r in results if r.ok]
    return {
        "flaps": len(flap_log), "flap_error": flap_error, "transfers": len(results),
        "completed": len(ok), "failed": len(results) - len(ok),
        "failures": sorted({f"{r.error_type}: {r.error}" for r in results if not r.ok})[:5],
        "corrupt_transfers": sum(1 for r in ok if r.corrupt),
        "corrupt_details": [r.corrupt for r in ok if r.corrupt][:5],
        "stale_replies": ini.worker.stale_replies, "bytes_corrupted": sum(max(0, r.corrupt_bytes) for r in ok),
        "gbps_overall": _gbps(len(ok) * ini.size, sum(r.seconds for r in results)),
        "readmit_after_last_flap_s": readmit, "last": last.as_dict(),
        "last_rail_bytes": [a - b for a, b in zip(ini.rail_bytes(), before)],
        "wall_s": wall, "rail_stats_end": ini.stats(),
    }


def scenario_stale_write(ini: Initiator, spec: dict[str, Any]) -> dict[str, Any]:
    """WRITE k loses rail 1 mid-way (its chunks are reissued); WRITE k+1 overwrites the whole
    range with new data and is verified; the link comes back; k+1's data is verified again.
    A reissued chunk of k that was still queued on the dead rail's socket must not land now."""
    rail = int(spec.get("rail", 1))
    if ini.op != "WRITE":
        raise DrillError("stale_write needs op WRITE")
    start = ini.rail_bytes()
    t0 = ini.post()
    ini.wait_bytes(rail, start[rail] + ini.size // 4, ini.timeout)
    ini.tb.set_link(rail, False)
    first = ini.finish(t0)
    second = ini.transfer()  # rail still down: new data everywhere, verified
    ini.tb.set_link(rail, True)
    time.sleep(float(spec.get("settle_s", 1.5)))
    again = ini.worker.verify_remote(ini._seed, 0, ini.size)
    return {"first": first.as_dict(), "second": second.as_dict(), "second_reverified": again,
            "rail_stats": ini.stats()}


SCENARIOS: dict[str, Callable[[Initiator, dict[str, Any]], dict[str, Any]]] = {
    "failover": scenario_failover, "all_down": scenario_all_down, "flap": scenario_flap,
    "stale_write": scenario_stale_write,
}


def main(argv: list[str] | None = None) -> int:
    """Initiator entry point: `python -m multirail.bench.drill '<json spec>'` (inside NAME-b)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        spec = json.loads(args[0])
        scenario = SCENARIOS[spec["mode"]]
    except (IndexError, ValueError, KeyError, TypeError):
        print(f"usage: python -m multirail.bench.drill '<json spec with mode in {sorted(SCENARIOS)}>'",
              file=sys.stderr)
        return 2
    try:
        ini = Initiator(spec)
    except Exception as e:  # noqa: BLE001 - one readable line, not a traceback
        print(f"drill: cannot connect: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        out = scenario(ini, spec)
        out["events"] = ini.rail_events()
    except Exception as e:  # noqa: BLE001
        print(f"drill {spec['mode']}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        try:
            ini.close()
        except Exception as e:  # noqa: BLE001 - the scenario's result matters more
            print(f"drill: close: {type(e).__name__}: {e}", file=sys.stderr)
    out.update(mode=spec["mode"], op=ini.op, size=ini.size, pid=os.getpid())
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
