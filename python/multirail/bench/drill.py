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
  taken down (``how``: "link", its device on side a down; or "blackhole", side a silently
  drops what it sends on it, carrier intact; or "delete", its veth pair deleted, no readmission) once ``fraction`` of its bytes are done (detect time = link down -> the engine
  marks the rail down; remainder rate = bytes done after detection / time after detection);
  a transfer with the rail still down (the one-rail rate of this run); the link back up, the
  time until the engine readmits the rail; a last transfer that must use it again. Every
  transfer is checked byte for byte. A break that lands only after the rail has finished its
  part of the failover transfer (breaking forks ``ip``, which a loaded host may delay) tests
  nothing: it is recorded in ``late_breaks``, the rail mended, and the transfer posted again,
  breaking at a quarter of the fraction (``break_tries``, default 3).
* ``notif_failover``: the rail the control connection (notifications) runs on goes down with no
  data in flight; a notification must still go out, over another rail, in about a second.
* ``all_down``: every rail is taken down mid-transfer; the transfer must fail (PeerLostError)
  within stall_timeout + slack.
* ``stale_write``: a WRITE loses a rail mid-way, the next WRITE overwrites the range and is
  verified, the link comes back, and the range is verified again (a chunk left queued on the
  dead rail's socket must not land late and overwrite newer data).
* ``flap``: transfers back to back while rails go down and up (one at a time, cycling through
  ``flap_rails``, default rail 1; ``how`` as for ``failover``, default "link"), ``flaps``
  times or for ``duration_s`` seconds; sizes cycle through ``sizes`` and, with op ``MIXED``,
  READs and WRITEs alternate. Counts transfers
  completed, failed (separately: while no rail was up), lost (still in progress after
  ``lost_after_s``) and bytes corrupted; per flapped rail, the time from link down to the
  engine marking it down and from link up to readmission. `multirail bench local --chaos
  rail-flap` (chaos.py) and benchmarks/soak.py run this scenario.

Host side: `run_drill(tb, spec)` starts the target, runs the initiator under a timeout and
returns its JSON (raising `DrillError` with the initiator's stderr when it produced none);
`env=` sets both processes' environment (the shared secret travels there, not on argv) and
`sampler=` (procstat.ProcSampler) watches both by PID.
Nothing here imports the engine at import time; the initiator imports it when it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from multirail.bench.core import TARGET_SEED, pattern
from multirail.bench.procstat import ProcSampler

POLL_S = 0.001


class DrillError(RuntimeError):
    """The drill could not run or produced no result (message carries the reason)."""


# ------------------------------------------------------------------------------ host side

@contextlib.contextmanager
def target_process(tb: Any, buffer_size: int, *, connections: int = 1, chunk_size: str = "1MiB",
                   stall_timeout: float = 0.5, lifetime_s: float = 300.0,
                   env: dict[str, str] | None = None, transport: str = "tcp") -> Iterator[tuple[int, int]]:
    """A `bench target` on every rail of namespace a; yields (port, pid); killed by PID on exit.
    `env` is the target's environment (e.g. with MULTIRAIL_SECRET: secrets stay off argv)."""
    from multirail.bench.target import launch, stop

    addrs = tb.addrs("a")
    cmd = tb.exec_argv("a", [sys.executable, "-m", "multirail", "bench", "target",
                             "--listen", f"{addrs[0]}:0", "--rails", ",".join(addrs),
                             "--total-buffer-size", str(buffer_size), "--connections", str(connections),
                             "--chunk-size", chunk_size, "--stall-timeout", str(stall_timeout),
                             "--duration", str(lifetime_s), "--idle-timeout", str(lifetime_s),
                             "--transport", transport])
    proc, ready, errf = launch(cmd, env=env)
    try:
        yield int(ready["port"]), int(ready.get("pid") or proc.pid)
    finally:
        stop(proc, grace=0.0)
        errf.close()


@contextlib.contextmanager
def target_in(tb: Any, buffer_size: int, *, connections: int = 1, chunk_size: str = "1MiB",
              stall_timeout: float = 0.5, lifetime_s: float = 300.0) -> Iterator[int]:
    """A `bench target` on every rail of namespace a; yields its port; killed by PID on exit."""
    with target_process(tb, buffer_size, connections=connections, chunk_size=chunk_size,
                        stall_timeout=stall_timeout, lifetime_s=lifetime_s) as (port, _pid):
        yield port


def run_drill(tb: Any, spec: dict[str, Any], timeout: float = 120.0, *, env: dict[str, str] | None = None,
              sampler: ProcSampler | None = None) -> dict[str, Any]:
    """Start a target, run the drill `spec` in namespace b, return the initiator's JSON result.

    `env`: environment of both processes (None: inherited). `sampler`: watches the target and
    the initiator by PID (as "target" and "initiator") while the drill runs."""
    spec = {"testbed": tb.name, "target": tb.addrs("a")[0], "rails": tb.addrs("b"), **spec}
    with target_process(tb, int(spec["size"]), connections=int(spec.get("connections", 1)),
                        chunk_size=str(spec.get("chunk_size", "1MiB")),
                        stall_timeout=float(spec.get("stall_timeout", 0.5)),
                        lifetime_s=timeout + 30, env=env,
                        transport=str(spec.get("transport") or os.environ.get("MULTIRAIL_TRANSPORT") or "tcp")) as (port, target_pid):
        spec["port"] = port
        cmd = tb.exec_argv("b", [sys.executable, "-m", "multirail.bench.drill", json.dumps(spec)])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        if sampler is not None:  # `ip netns exec` execs the command: proc.pid is the initiator
            sampler.watch("target", target_pid)
            sampler.watch("initiator", proc.pid)
            sampler.start()
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # by PID: exactly the initiator we started
            _, stderr = proc.communicate()
            raise DrillError(f"drill {spec['mode']} did not finish within {timeout:.0f} s; stderr: "
                             f"{(stderr or '')[-800:]!r}") from None
        finally:
            if sampler is not None:
                sampler.stop()
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    lines = [x for x in stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise DrillError(f"drill {spec['mode']} failed (exit {proc.returncode}): {stderr.strip()[-1500:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    out["stderr_tail"] = stderr.strip()[-1500:]
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
    corrupt_bytes: int = 0            # bytes that differ (-1: differ, count unknown)
    lost: bool = False                # neither completed nor failed within the wait limit
    unverified: str | None = None     # WRITE: the target's verification did not come back
    op: str = ""
    size: int = 0
    start: float = 0.0                # monotonic time of the post
    rails_up: list[bool] | None = None  # the engine's view of each rail when a transfer failed

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Initiator:
    """An EngineWorker plus the testbed, with the helpers the scenarios share.

    ``spec["op"]`` is READ, WRITE or MIXED. Transfers use one region of the buffer per op:
    all of it for READ or WRITE; for MIXED the first half is READ from (the target's pattern,
    never written) and the second half is written, so both ops run against one target."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from multirail.bench.core import parse_size
        from multirail.bench.worker import EngineWorker
        from multirail.testbed import Testbed

        tb = Testbed.load(spec["testbed"])
        if tb is None:
            raise DrillError(f"testbed {spec['testbed']!r} is not recorded")
        self.tb = tb
        self.op = str(spec.get("op", "READ")).upper()
        if self.op not in ("READ", "WRITE", "MIXED"):
            raise DrillError(f"op must be READ, WRITE or MIXED, not {self.op!r}")
        self.size = int(spec["size"])
        self.timeout = float(spec.get("timeout", 30.0))
        self.stall_timeout = float(spec.get("stall_timeout", 0.5))
        self.worker = EngineWorker(
            op="WRITE" if self.op == "WRITE" else "READ", target_host=spec["target"],
            target_port=int(spec["port"]), target_name=spec.get("target_name", "mr-bench-target"),
            buffer_size=self.size, connections=int(spec.get("connections", 1)), rails=list(spec["rails"]),
            policy=str(spec.get("policy", "weighted")), chunk_size=parse_size(str(spec.get("chunk_size", "1MiB"))),
            timeout=self.timeout, stall_timeout=self.stall_timeout, fill_target=self.op != "WRITE",
            transport=str(spec.get("transport") or os.environ.get("MULTIRAIL_TRANSPORT") or "tcp"))
        self.agent = self.worker.agent
        self.peer = self.worker.peer
        self._expect: np.ndarray | None = None  # the READ region's expected bytes (made once)
        self._seed = 0x1000
        self._h: Any = None
        self._cur: tuple[str, int, int, int] = ("", 0, 0, 0)  # op, offset, length, seed of the posted one
        self.last_end = 0.0  # monotonic time the last successful transfer completed

    def region(self, op: str) -> tuple[int, int]:
        """(offset, length) of the buffer range transfers of `op` use (same on both sides)."""
        if self.op == "MIXED":
            half = self.size // 2
            return (0, half) if op == "READ" else (half, half)
        return 0, self.size

    def stats(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self.agent.rail_stats(self.peer)]

    def rail_bytes(self) -> list[int]:
        return [int(s["bytes"]) for s in self.stats()]

    def _release(self) -> None:
        if self._h is not None:
            h, self._h = self._h, None
            self.agent.release_xfer_handle(h)

    def post(self, op: str | None = None, size: int | None = None) -> float:
        """Prepare (zero for READ, fresh pattern for WRITE) and post one transfer of `size`
        bytes (default: the whole region) at the start of `op`'s region; returns its start."""
        op = op or self.op
        if op not in ("READ", "WRITE"):
            raise DrillError(f"post needs READ or WRITE, not {op!r}")
        off, room = self.region(op)
        n = room if size is None else size
        if not 0 < n <= room:
            raise DrillError(f"transfer of {n} bytes does not fit the {op} region ({room} bytes)")
        self._release()
        buf = self.worker.buf
        if op == "READ":
            buf[off:off + n] = 0  # stale data must not pass the check
        else:  # fresh data each time: a dropped or stale chunk must not pass unseen
            self._seed += 1
            buf[off:off + n] = pattern(self._seed, off, n)
        local = np.array([[buf.ctypes.data + off, n, 0]], dtype=np.uint64)
        remote = np.array([[self.worker.remote_addr + off, n, self.worker.remote_dev]], dtype=np.uint64)
        self._h = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local),
                                             self.agent.get_xfer_descs(remote), self.peer)
        self._cur = (op, off, n, self._seed)
        t0 = time.monotonic()
        self.agent.transfer(self._h)
        return t0

    def finish(self, t0: float, deadline_s: float | None = None) -> Transfer:
        """Wait for the posted transfer and check every byte. A transfer still in progress when
        the wait gives up is reported `lost` (it neither completed nor failed)."""
        op, off, n, seed = self._cur
        try:
            self.agent.wait(self._h, timeout=deadline_s or self.timeout)
        except Exception as e:  # noqa: BLE001 - every engine error is a result here
            secs = time.monotonic() - t0
            lost = self.agent.check_xfer_state(self._h) == self.worker.mr.XferState.IN_PROGRESS
            return Transfer(False, secs, str(e), type(e).__name__, lost=lost, op=op, size=n, start=t0)
        secs = time.monotonic() - t0
        self.last_end = t0 + secs
        done = Transfer(True, secs, op=op, size=n, start=t0)
        if op == "READ":
            if self._expect is None or len(self._expect) < off + n:
                self._expect = pattern(TARGET_SEED, 0, self.region("READ")[1])
            bad = self.worker.buf[off:off + n] != self._expect[off:off + n]
            count = int(np.count_nonzero(bad))
            if count:
                done.corrupt = f"READ {n} B: {count} bytes differ, first at offset {off + int(np.argmax(bad))}"
                done.corrupt_bytes = count
            return done
        try:
            problem = self.worker.verify_remote(seed, off, n)
        except Exception as e:  # noqa: BLE001 - a verification that never came back is a result
            done.unverified = f"{type(e).__name__}: {e}"
            return done
        if problem is not None:
            done.corrupt = f"WRITE {n} B at {off}: {problem}"
            done.corrupt_bytes = int(self.worker.last_verified.get("bad_bytes", -1))
        return done

    def transfer(self, op: str | None = None, size: int | None = None, deadline_s: float | None = None) -> Transfer:
        try:
            t0 = self.post(op, size)
        except DrillError:
            raise
        except Exception as e:  # noqa: BLE001 - posting can fail too (e.g. no rail left)
            return Transfer(False, 0.0, str(e), type(e).__name__, op=op or self.op,
                            size=size or 0, start=time.monotonic())
        return self.finish(t0, deadline_s)

    def wait_rail(self, rail: int, up: bool, limit_s: float, poll_s: float = POLL_S) -> float | None:
        """Seconds until rail_stats shows `rail` up/down (polled), or None after limit_s."""
        t0 = time.monotonic()
        while True:
            if bool(self.stats()[rail]["up"]) == up:
                return time.monotonic() - t0
            if time.monotonic() - t0 >= limit_s:
                return None
            time.sleep(poll_s)

    def in_progress(self) -> bool:
        """Whether the posted transfer is still in progress. Read without driving it: a poll
        here must not complete responses the engine's own threads would (`check_xfer_state`)."""
        return self._h is not None and int(self._h._h.state()) == 1

    def wait_down_in_transfer(self, rail: int, limit_s: float) -> tuple[float | None, bool]:
        """Wait until rail_stats shows `rail` down, or the posted transfer ended with the rail
        still up (then the rail cannot die under it any more), or limit_s. Returns the seconds
        until the rail was seen down (None: not seen) and whether the transfer was still in
        progress then (its state read after the rail's: in progress then, in progress when
        the rail went down)."""
        t0 = time.monotonic()
        while True:
            down = not bool(self.stats()[rail]["up"])
            busy = self.in_progress()
            if down:
                return time.monotonic() - t0, busy
            if not busy or time.monotonic() - t0 >= limit_s:
                return None, busy
            time.sleep(POLL_S)

    def wait_bytes(self, rail: int, target_bytes: int, limit_s: float) -> None:
        t0 = time.monotonic()
        while self.rail_bytes()[rail] < target_bytes and time.monotonic() - t0 < limit_s:
            time.sleep(POLL_S)

    def rail_events(self) -> list[str]:
        return [e for e in self.agent.events() if "rail" in e]

    def close(self) -> None:
        try:
            self._release()  # a held handle keeps the buffer registered
            self.worker.finish_size()
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
    # "link": the rail's device on side a goes down (side b loses carrier); "blackhole": side
    # a silently drops what it sends on the rail (carrier stays up: only the stall timeout sees it)
    # "delete": the rail's veth pair is deleted (gone for good: no readmission step)
    how = str(spec.get("how", "link"))
    if how not in ("link", "blackhole", "delete"):
        raise ValueError(f"unknown failure kind {how!r}")
    breakers: dict[str, Callable[[int, bool], None]] = {
        "link": ini.tb.set_link,
        "blackhole": lambda r, up: ini.tb.set_blackhole(r, not up),
        "delete": lambda r, up: None if up else ini.tb.delete_rail(r),
    }
    breaker = breakers[how]
    # The rail must die under the transfer, but breaking it (`ip`, forked) takes what the host
    # gives it: on a loaded host the rail had sometimes finished its part before the break took
    # effect, and a blackholed rail with nothing in flight is never found dead. Such a late try
    # is recorded, the rail mended, and the transfer posted again, breaking earlier.
    fraction = float(spec.get("fraction", 0.5))
    tries = 1 if how == "delete" else max(1, int(spec.get("break_tries", 3)))
    late: list[dict[str, Any]] = []
    for k in range(tries):
        start = ini.rail_bytes()
        t0 = ini.post()
        ini.wait_bytes(rail, start[rail] + int(share * fraction), ini.timeout)
        before_down = ini.rail_bytes()
        t_down = time.monotonic()
        breaker(rail, False)
        t_link = time.monotonic()
        detect_after_call, in_transfer = ini.wait_down_in_transfer(rail, ini.timeout)
        detect = None if detect_after_call is None else time.monotonic() - t_down
        res = ini.finish(t0)
        if detect is not None or in_transfer or k + 1 == tries or not res.ok or res.corrupt is not None:
            break
        late.append({"fraction": fraction, "link_down_call_s": t_link - t_down,
                     "bytes_before_down": sum(b - s for b, s in zip(before_down, start)), "ok": res.ok})
        breaker(rail, True)
        if ini.wait_rail(rail, True, float(spec.get("readmit_limit_s", 10.0))) is None:
            raise DrillError(f"rail {rail} is not up after mending a break that came late: {ini.stats()[rail]}")
        fraction /= 4
    t_end = ini.last_end
    end = ini.rail_bytes()
    done_at_down = sum(b - s for b, s in zip(before_down, start))
    out["failover"] = {
        **res.as_dict(), "gbps": _gbps(ini.size, res.seconds),
        "bytes_before_down": done_at_down,
        "link_down_call_s": t_link - t_down,
        "detect_s": detect,  # from just before `ip link set down` to rail_stats up=False
        # ... from when that call returned (the break took effect in between)
        "detect_after_call_s": detect_after_call,
        # whether the transfer was still in progress when the rail was seen down
        "down_in_transfer": in_transfer and detect is not None,
        # tries whose break came after the rail had finished its part (see above)
        "late_breaks": late,
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
    if how == "delete":
        out["rail_stats_end"] = ini.stats()
        return out
    t_up = time.monotonic()
    breaker(rail, True)
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


def scenario_notif_failover(ini: Initiator, spec: dict[str, Any]) -> dict[str, Any]:
    """A notification while the rail its control connection was opened on is down (no data in
    flight, so nothing else has noticed): it must go out over another rail well within the
    agent's timeout."""
    from multirail.bench import protocol as bproto

    rail = int(spec.get("rail", 0))
    ini.transfer()
    ini.agent.send_notif(ini.peer, bproto.encode(bproto.KEEPALIVE, {}))  # opens the control connection
    ini.tb.set_link(rail, False)
    t0 = time.monotonic()
    err = None
    try:
        ini.agent.send_notif(ini.peer, bproto.encode(bproto.KEEPALIVE, {}))
    except Exception as e:  # noqa: BLE001 - reported
        err = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    ini.tb.set_link(rail, True)
    return {"rail": rail, "notif_s": took, "error": err, "timeout": ini.timeout}


def _overlaps(a0: float, a1: float, windows: list[tuple[float, float]]) -> bool:
    return any(a0 < w1 and w0 < a1 for w0, w1 in windows)


class Tally:
    """Running counts of checked transfers (a soak posts tens of thousands: keep no list)."""

    def __init__(self) -> None:
        self.transfers = self.completed = self.failed = self.lost = self.bytes_moved = 0
        self.corrupt_transfers = self.bytes_corrupted = self.unverified = 0
        self.seconds = 0.0

    def add(self, r: Transfer) -> None:
        self.transfers += 1
        self.seconds += r.seconds
        if not r.ok:
            self.failed += 1
            self.lost += int(r.lost)
            return
        self.completed += 1
        self.bytes_moved += r.size
        self.unverified += int(r.unverified is not None)
        if r.corrupt:
            self.corrupt_transfers += 1
            self.bytes_corrupted += max(0, r.corrupt_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "seconds"}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def scenario_flap(ini: Initiator, spec: dict[str, Any]) -> dict[str, Any]:
    """Transfers back to back while rails flap (one at a time, cycling through ``flap_rails``,
    default ``[rail]`` = [1]), for ``flaps`` flaps or, with ``duration_s``, until that many
    seconds have passed. ``sizes`` (default: the whole region) and the ops (READ, WRITE, or both
    alternating for MIXED) cycle so that every (op, size) pair recurs. Every transfer is checked
    byte for byte; one still in progress after ``lost_after_s`` is `lost`. A failure counts as
    `failed_no_rail_up` when every rail's link was down at some point during it (or up to
    ``readmit_grace_s`` before it: the engine readmits a rail within its probe backoff)."""
    n_rails = len(ini.stats())
    flap_rails = [int(r) for r in (spec.get("flap_rails") or [spec.get("rail", 1)])]
    if not flap_rails or any(not 0 <= r < n_rails for r in flap_rails):
        raise DrillError(f"flap_rails {flap_rails} must be rail indices 0..{n_rails - 1}")
    duration = float(spec["duration_s"]) if spec.get("duration_s") is not None else None
    flaps_max = int(spec.get("flaps", 3)) if duration is None else None
    down_s, up_s = float(spec.get("down_s", 1.0)), float(spec.get("up_s", 2.0))
    how = str(spec.get("how", "link"))  # "link": device down on side a; "blackhole": a drops silently
    if how not in ("link", "blackhole"):
        raise DrillError(f"unknown flap kind {how!r} (link or blackhole)")

    def set_rail(rail: int, up: bool) -> None:
        if how == "link":
            ini.tb.set_link(rail, up)
        else:
            ini.tb.set_blackhole(rail, not up)
    poll_s = float(spec.get("poll_s", 0.002))
    ops = ["READ", "WRITE"] if ini.op == "MIXED" else [ini.op]
    sizes = [int(x) for x in (spec.get("sizes") or [])] or [min(ini.region(op)[1] for op in ops)]
    wait_s = float(spec.get("lost_after_s", ini.timeout + ini.stall_timeout + 5.0))
    grace = float(spec.get("readmit_grace_s", 3.0))
    fail_pause_s = float(spec.get("fail_pause_s", 0.05))  # no tight loop of posts to a dead peer
    stop = threading.Event()
    flap_log: list[dict[str, Any]] = []
    flap_error: list[str] = []
    t_start = time.monotonic()

    def flapper() -> None:
        try:
            time.sleep(up_s / 2)
            k = 0
            while not stop.is_set():
                if flaps_max is not None and k >= flaps_max:
                    break
                if duration is not None and time.monotonic() - t_start + down_s > duration:
                    break
                rail = flap_rails[k % len(flap_rails)]
                t = time.monotonic()
                set_rail(rail, False)
                seen = ini.wait_rail(rail, False, max(0.0, down_s - (time.monotonic() - t)), poll_s)
                detect = None if seen is None else time.monotonic() - t
                time.sleep(max(0.0, down_s - (time.monotonic() - t)))
                t_up = time.monotonic()
                set_rail(rail, True)
                readmit = None
                if detect is not None:
                    back = ini.wait_rail(rail, True, up_s, poll_s)
                    readmit = None if back is None else time.monotonic() - t_up
                flap_log.append({"rail": rail, "down_at": t, "up_at": t_up, "detect_s": detect,
                                 "readmit_s": readmit})
                k += 1
                time.sleep(max(0.0, up_s - (time.monotonic() - t_up)))
        except Exception as e:  # noqa: BLE001 - reported in the result
            flap_error.append(f"{type(e).__name__}: {e}")
        finally:
            stop.set()

    th = threading.Thread(target=flapper, daemon=True)
    th.start()
    total, by_op, by_size = Tally(), {op: Tally() for op in ops}, {sz: Tally() for sz in sizes}
    failed: list[Transfer] = []          # every failure (rare), for the classification below
    corrupt: list[str] = []
    unverified: list[str] = []
    i = 0
    while not stop.is_set() or not total.transfers or (duration is not None and time.monotonic() - t_start < duration):
        op, size = ops[i % len(ops)], sizes[(i // len(ops)) % len(sizes)]
        r = ini.transfer(op, size, wait_s)
        for t in (total, by_op[op], by_size[size]):
            t.add(r)
        if not r.ok:
            try:
                r.rails_up = [bool(s["up"]) for s in ini.stats()]
            except Exception:  # noqa: BLE001 - the view is informative only
                pass
            failed.append(r)
            time.sleep(fail_pause_s)
        elif r.corrupt and len(corrupt) < 5:
            corrupt.append(r.corrupt)
        elif r.unverified and len(unverified) < 5:
            unverified.append(r.unverified)
        i += 1
    th.join(timeout=30)
    # after the last flap the rails must come back and carry clean transfers again
    t_wait = time.monotonic()
    readmit = None
    for rail in sorted(set(flap_rails)):
        if ini.wait_rail(rail, True, 10.0, poll_s) is None:
            readmit = None
            break
        readmit = time.monotonic() - t_wait
    before = ini.rail_bytes()
    finals = [ini.transfer(op, max(sizes), wait_s) for op in ops]
    wall = time.monotonic() - t_start

    # a failure is excused only while no rail's link was up: one rail at a time flaps, so that
    # is when the testbed has a single rail (windows extended by the readmission grace)
    windows = [(f["down_at"], f["up_at"] + grace) for f in flap_log] if n_rails == 1 else []
    excused = [r for r in failed if not r.lost and _overlaps(r.start, r.start + r.seconds, windows)]
    last = next((f for f in finals if not f.ok or f.corrupt), finals[0])
    per_rail = []
    for rail in sorted(set(flap_rails)):
        fl = [f for f in flap_log if f["rail"] == rail]
        det = [float(f["detect_s"]) for f in fl if f["detect_s"] is not None]
        rea = [float(f["readmit_s"]) for f in fl if f["readmit_s"] is not None]
        per_rail.append({"rail": rail, "flaps": len(fl), "undetected": len(fl) - len(det),
                         "detect_median_s": _median(det), "detect_max_s": max(det, default=None),
                         "readmit_median_s": _median(rea), "readmit_max_s": max(rea, default=None),
                         "not_readmitted": len(det) - len(rea)})
    return {
        "flaps": len(flap_log), "flap_error": flap_error, **total.as_dict(),
        "failed_no_rail_up": len(excused), "failed_with_rail_up": len(failed) - len(excused),
        "failures": sorted({f"{r.error_type}: {r.error}" for r in failed})[:5],
        "failure_details": [{**r.as_dict(), "start": r.start - t_start} for r in failed][:20],
        "corrupt_details": corrupt, "unverified_details": unverified,
        "stale_replies": ini.worker.stale_replies,
        "gbps_overall": _gbps(total.bytes_moved, total.seconds),
        "by_op": {op: t.as_dict() for op, t in by_op.items()},
        "by_size": {str(sz): t.as_dict() for sz, t in by_size.items()},
        "per_rail": per_rail, "flap_rails": flap_rails, "how": how, "sizes": sizes, "ops": ops,
        "down_s": down_s, "up_s": up_s, "duration_s": duration, "lost_after_s": wait_s,
        "flap_log": [{**f, "down_at": f["down_at"] - t_start, "up_at": f["up_at"] - t_start} for f in flap_log],
        "readmit_after_last_flap_s": readmit, "last": {**last.as_dict(), "start": last.start - t_start},
        "final_transfers": [{**f.as_dict(), "start": f.start - t_start} for f in finals],
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
    "notif_failover": scenario_notif_failover,
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
