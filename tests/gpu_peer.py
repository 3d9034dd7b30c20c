"""A target agent in another process, for CUDA IPC tests (CUDA maps only other processes'
memory): `n` bytes of GPU memory (stand-in or CUDA), the whole allocation (CUDA IPC exports
only those) or, with `off`, at that offset inside a larger one (then staged), driven over stdin ("digest", "notifs",
"dereg", "meta" and "bare_meta": its metadata in hex, with and without the region), killed by PID if it does not exit."""

from __future__ import annotations

TARGET_SCRIPT = r"""
import hashlib, json, sys, time
import numpy as np
import multirail
from multirail.gpu import DeviceBuffer
n, off, ipc, access, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], sys.argv[5]
timeout, dev, name = float(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
t = multirail.Agent(name, {"gpu": kind, "gpu_ipc": ipc, "timeout": timeout})
block = DeviceBuffer(off + n + (4096 if off else 0), device=dev, kind=kind)  # off > 0: an offset inside a block
block.copy_from_host(np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8), off)
bare = t.get_agent_metadata()  # this incarnation's metadata without the region
reg = t.register_memory([(block.addr + off, n, dev)], "VRAM", access=access)
print(json.dumps({"port": t.port, "addr": block.addr + off}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "digest":
        out = np.empty(n, np.uint8)
        block.copy_to_host(out, off)
        print(hashlib.sha256(out.tobytes()).hexdigest(), flush=True)
    elif cmd == "notifs":
        print(json.dumps({k: [m.decode() for m in v] for k, v in t.get_new_notifs().items()}), flush=True)
    elif cmd in ("meta", "bare_meta"):
        print((bare if cmd == "bare_meta" else t.get_agent_metadata()).hex(), flush=True)
    elif cmd == "dereg":
        t0 = time.monotonic()
        try:
            t.deregister_memory(reg)
            out = {"ok": True}
        except Exception as e:
            out = {"ok": False, "error": type(e).__name__ + ": " + str(e)}
        out["secs"] = time.monotonic() - t0
        print(json.dumps(out), flush=True)
    else:
        break
t.close()
"""


class Target:
    """A target agent in another process (CUDA IPC maps only other processes' memory), with
    `n` bytes of GPU memory of `kind`: a whole allocation, or at offset `off` inside a larger one.
    `env` is added to the process's environment (e.g. `MULTIRAIL_STANDIN_ALLOC=vmm:65536`: the
    stand-in allocates that memory as VMM chunks, see docs/gpu.md)."""

    def __init__(self, n: int, off: int = 0, ipc: bool = True, access: str = "rw", kind: str = "standin",
                 timeout: float = 5.0, device: int = 0, env: dict | None = None, name: str = "target"):
        import json
        import os
        import subprocess
        import sys

        self.n = n
        self.p = subprocess.Popen([sys.executable, "-c", TARGET_SCRIPT, str(n), str(off), "1" if ipc else "0", access, kind,
                                   str(timeout), str(device), name],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=None if env is None else {**os.environ, **env})
        try:
            info = json.loads(self._line())
        except BaseException:
            self.close()
            raise
        self.port, self.addr = info["port"], info["addr"]

    def _line(self) -> str:
        import select

        r, _, _ = select.select([self.p.stdout], [], [], 30)
        assert r, "target process did not answer within 30 s"
        line = self.p.stdout.readline()  # type: ignore[union-attr]
        assert line, f"target process exited ({self.p.poll()})"
        return line

    def ask(self, cmd: str) -> str:
        self.p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]
        return self._line().strip()

    def close(self) -> None:
        try:
            self.p.stdin.close()  # type: ignore[union-attr]
            self.p.wait(timeout=10)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()


INITIATOR_SCRIPT = r"""
import hashlib, json, os, sys
import numpy as np
import multirail
from multirail import gpu
port, addr, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
# A GPU this process uses before the transfer (as a vLLM worker uses its own), if any.
used = os.environ.get("MULTIRAIL_TEST_USE_GPU")
own = gpu.DeviceBuffer(64, device=int(used), kind="standin") if used else None
i = multirail.Agent("initiator", {"gpu": "standin", "timeout": 5.0})
local = np.zeros(n, np.uint8)
i.register_memory(local)
i.fetch_remote_metadata("target", "127.0.0.1", port)
rd = i.get_xfer_descs([(addr, n, 0)], "VRAM")

def run(op):
    h = i.initialize_xfer(op, [local], rd, "target")
    try:
        i.transfer(h)
        i.wait(h, 30)
    finally:
        i.release_xfer_handle(h)

run("READ")
print(json.dumps({"sum": int(local.sum(dtype=np.uint64))}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "counters":
        print(json.dumps(i.peer_counters("target")), flush=True)
    elif cmd == "digest":
        print(json.dumps(hashlib.sha256(local.tobytes()).hexdigest()), flush=True)
    elif cmd == "rails":
        print(json.dumps(i.rail_stats("target")), flush=True)
    elif cmd == "contexts":
        print(json.dumps(gpu.standin_contexts()), flush=True)
    elif cmd == "write":
        local[:] = 0xEE
        try:
            run("WRITE")
            print(json.dumps({"ok": True}), flush=True)
        except Exception as e:
            print(json.dumps({"ok": False, "error": type(e).__name__ + ": " + str(e)}), flush=True)
    else:
        break
i.close()
"""


class Initiator(Target):
    """An initiator agent in another process that READs `n` bytes of the test's GPU region at
    `addr` over CUDA IPC at start, then answers "counters", "digest", "rails", "contexts" and
    "write" on stdin. `env` is added to its environment (a process's visible devices are fixed
    for its life, as CUDA_VISIBLE_DEVICES is); `use_gpu` makes it use that GPU first."""

    def __init__(self, port: int, addr: int, n: int, env: dict | None = None,
                 use_gpu: int | None = None):  # noqa: super().__init__ starts a target
        import os
        import subprocess
        import sys

        self.n = n
        penv = {**os.environ, **(env or {})}
        penv.pop("MULTIRAIL_TEST_USE_GPU", None)
        if use_gpu is not None:
            penv["MULTIRAIL_TEST_USE_GPU"] = str(use_gpu)
        self.p = subprocess.Popen([sys.executable, "-c", INITIATOR_SCRIPT, str(port), str(addr), str(n)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=penv)
        try:
            self.first = self._line()
        except BaseException:
            self.close()
            raise
