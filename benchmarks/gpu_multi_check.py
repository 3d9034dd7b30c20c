#!/usr/bin/env python3
"""The multi-GPU checks of `make gpu-check` (issue 35), one per subcommand; each prints one JSON
line and exits 0 only when the check held.

- ``ipc2 --gpu cuda|standin [--target-dev 1 --local-dev 0]``: KV pages (``--pages`` x
  ``--page`` bytes, every page to a non-adjacent slot: one gather) WRITE then READ between a
  target process whose memory is on one GPU and this process's buffer on another, by CUDA IPC.
  Checks the bytes both ways, the path (``ipc_transfers``, ``ipc_copy_path``) and, on CUDA,
  that this process has no context on the target's GPU (``nvidia-smi --query-compute-apps``).
  Runs on the stand-in too (``MULTIRAIL_STANDIN_DEVICES=2``), which is how CI tests it.
- ``capture --seconds S``: one thread captures and replays a CUDA graph (a matmul, torch's
  default global capture mode) in a loop while this thread runs staged and IPC VRAM transfers;
  no capture may fail. Needs torch with CUDA.
- ``expandable``: a target process's tensor of torch's allocator with
  ``expandable_segments:True`` (CUDA VMM memory, which legacy IPC cannot export) by IPC, WRITE
  and READ: the bytes must land both ways and the path must be IPC (exported by its chunks'
  file descriptors; ``ipc_transfers`` 2, no ``ipc_fallback_reason``).

``foreign_contexts`` and ``parse_smi_list`` are the parsing the checks use (tested without a GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def parse_smi_list(text: str) -> list[str]:
    """The GPU UUIDs of `nvidia-smi -L` output, in ordinal order."""
    out = []
    for line in text.splitlines():
        if "(UUID: " in line:
            out.append(line.split("(UUID: ", 1)[1].rstrip(")").strip())
    return out


def foreign_contexts(csv: str, pid: int, allowed: set[str]) -> list[str]:
    """GPU UUIDs on which process `pid` has a context, outside `allowed`, from
    `nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader`."""
    bad = []
    for line in csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) == pid and parts[1] not in allowed:
            bad.append(parts[1])
    return sorted(set(bad))


def _smi(args: list[str]) -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    p = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60)
    return p.stdout if p.returncode == 0 else None


def ipc2(a: argparse.Namespace) -> dict:
    import numpy as np

    import multirail
    from gpu_peer import Target
    from multirail.gpu import DeviceBuffer

    n = a.page * a.pages
    env = {"MULTIRAIL_STANDIN_DEVICES": "2"} if a.gpu == "standin" else {}
    os.environ.update(env)
    tgt = Target(n, off=0, kind=a.gpu, device=a.target_dev, env=env, timeout=30.0)
    out: dict = {"check": "ipc2", "gpu": a.gpu, "target_dev": a.target_dev, "local_dev": a.local_dev, "ok": False}
    i = multirail.Agent("initiator", {"gpu": a.gpu, "timeout": 30.0})
    try:
        data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
        src = DeviceBuffer(n, device=a.local_dev, kind=a.gpu)
        back = DeviceBuffer(n, device=a.local_dev, kind=a.gpu)
        src.copy_from_host(data)
        i.register_memory(src)
        i.register_memory(back)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        slot = [a.pages - 1 - k for k in range(a.pages)]
        rd = i.get_xfer_descs([(tgt.addr + slot[k] * a.page, a.page, 0) for k in range(a.pages)], "VRAM")
        t0 = time.perf_counter()
        for op, buf in (("WRITE", src), ("READ", back)):
            ld = i.get_xfer_descs([(buf.addr + k * a.page, a.page, a.local_dev) for k in range(a.pages)], "VRAM")
            h = i.initialize_xfer(op, ld, rd, "target")
            i.transfer_sync(h, 60)
            i.release_xfer_handle(h)
        out["secs"] = round(time.perf_counter() - t0, 4)
        want = b"".join(data[(a.pages - 1 - s) * a.page:(a.pages - s) * a.page].tobytes() for s in range(a.pages))
        out["write_bytes_ok"] = tgt.ask("digest") == hashlib.sha256(want).hexdigest()
        out["read_bytes_ok"] = bool(np.array_equal(back.to_host(), data))
        c = i.peer_counters("target")
        out.update({k: c[k] for k in ("ipc_transfers", "ipc_copy_path", "ipc_devices", "ipc_fallback_reason")})
        out["ok"] = out["write_bytes_ok"] and out["read_bytes_ok"] and c["ipc_transfers"] == 2
        if a.gpu == "cuda":
            uuids = parse_smi_list(_smi(["-L"]) or "")
            apps = _smi(["--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"])
            if apps is None or len(uuids) <= max(a.local_dev, a.target_dev):
                out["foreign_contexts"] = "not checked: nvidia-smi cannot list the GPUs or compute apps"
            else:
                # CUDA_VISIBLE_DEVICES unset: the ordinals are nvidia-smi's.
                out["foreign_contexts"] = foreign_contexts(apps, os.getpid(), {uuids[a.local_dev]})
                out["ok"] = out["ok"] and not out["foreign_contexts"]
        else:
            from multirail import gpu

            out["contexts"] = gpu.standin_contexts()
            out["ok"] = out["ok"] and out["contexts"] == [a.local_dev]
    except Exception as e:  # noqa: BLE001 - reported in the JSON line
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        i.close()
        tgt.close()
    return out


def capture(a: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    import multirail
    from gpu_peer import Target

    out: dict = {"check": "capture", "ok": False, "captures": 0, "capture_errors": [], "transfers": 0}
    dev = torch.device("cuda:0")
    x = torch.randn(1024, 1024, device=dev)
    stop = threading.Event()

    def loop() -> None:
        s = torch.cuda.Stream(dev)
        while not stop.is_set():
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                    y = x @ x  # noqa: F841 - captured work
                g.replay()
                torch.cuda.synchronize(dev)
                out["captures"] += 1
            except Exception as e:  # noqa: BLE001 - counted, the check fails
                out["capture_errors"].append(f"{type(e).__name__}: {e}")
                if len(out["capture_errors"]) > 5:
                    return

    n = 16 << 20
    tgt = Target(n, kind="cuda", timeout=30.0)
    t = multirail.Agent("host-target", {"gpu": "cuda"})
    i = multirail.Agent("initiator", {"gpu": "cuda", "timeout": 30.0})
    th = threading.Thread(target=loop)
    try:
        remote = np.zeros(n, np.uint8)
        t.register_memory(remote)
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
        i.register_memory(src)
        i.fetch_remote_metadata("host-target", "127.0.0.1", t.port)
        i.fetch_remote_metadata("target", "127.0.0.1", tgt.port)
        th.start()
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            for peer, rd in (("host-target", [remote]), ("target", i.get_xfer_descs([(tgt.addr, n, 0)], "VRAM"))):
                h = i.initialize_xfer("WRITE", [src], rd, peer)
                i.transfer_sync(h, 60)
                i.release_xfer_handle(h)
                out["transfers"] += 1
        out["ok"] = not out["capture_errors"] and out["captures"] > 0
    except Exception as e:  # noqa: BLE001 - reported in the JSON line
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop.set()
        if th.is_alive():
            th.join(60)
        i.close()
        t.close()
        tgt.close()
    return out


# A target whose registered memory is a torch tensor in expandable segments (CUDA VMM), of
# whole 20 MiB chunks (the large pool's segment size) and allocated first, so it starts and
# ends on chunk boundaries (the whole-allocation rule, per chunk). Answers "digest" on stdin.
EXPANDABLE_TARGET = r"""
import hashlib, json, os, sys
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch
import multirail
n = int(sys.argv[1])
t = multirail.Agent("target", {"gpu": "cuda", "timeout": 30.0})
x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
t.register_memory(x)
print(json.dumps({"port": t.port, "addr": x.data_ptr()}), flush=True)
for line in sys.stdin:
    if line.strip() != "digest":
        break
    print(hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest(), flush=True)
t.close()
"""


def expandable(a: argparse.Namespace) -> dict:
    """Both sides' tensors in expandable segments; the target's (2 chunks of 20 MiB) is what
    IPC must export: by its chunks' file descriptors (CUDA VMM), since cudaIpcGetMemHandle
    refuses such memory. The path must be IPC (two transfers, no fallback reason), both ways."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    import multirail

    n = 40 << 20
    out: dict = {"check": "expandable", "ok": False}
    p = subprocess.Popen([sys.executable, "-c", EXPANDABLE_TARGET, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    i = multirail.Agent("initiator", {"gpu": "cuda", "timeout": 30.0})
    try:
        info = json.loads(p.stdout.readline())  # type: ignore[union-attr]
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
        back = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
        i.register_memory(src)
        i.register_memory(back)
        i.fetch_remote_metadata("target", "127.0.0.1", info["port"])
        rd = i.get_xfer_descs([(info["addr"], n, 0)], "VRAM")
        for op, buf in (("WRITE", src), ("READ", back)):
            h = i.initialize_xfer(op, [buf], rd, "target")
            i.transfer_sync(h, 60)
            i.release_xfer_handle(h)
        p.stdin.write("digest\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        out["write_bytes_ok"] = p.stdout.readline().strip() == hashlib.sha256(src.cpu().numpy().tobytes()).hexdigest()  # type: ignore[union-attr]
        out["read_bytes_ok"] = bool(torch.equal(back, src))
        c = i.peer_counters("target")
        out.update({k: c[k] for k in ("ipc_transfers", "ipc_fallback_reason", "ipc_copy_path")})
        out["ok"] = out["write_bytes_ok"] and out["read_bytes_ok"] and c["ipc_transfers"] == 2 and not c["ipc_fallback_reason"]
    except Exception as e:  # noqa: BLE001 - reported in the JSON line
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        i.close()
        try:
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("ipc2")
    q.add_argument("--gpu", choices=("cuda", "standin"), default="cuda")
    q.add_argument("--target-dev", type=int, default=1)
    q.add_argument("--local-dev", type=int, default=0)
    q.add_argument("--page", type=int, default=4096)
    q.add_argument("--pages", type=int, default=256)
    c = sub.add_parser("capture")
    c.add_argument("--seconds", type=float, default=30.0)
    sub.add_parser("expandable")
    a = p.parse_args(argv)
    out = {"ipc2": ipc2, "capture": capture, "expandable": expandable}[a.cmd](a)
    print(json.dumps(out), flush=True)
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
