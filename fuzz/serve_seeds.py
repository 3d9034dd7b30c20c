#!/usr/bin/env python3
"""Writes the seed corpus of the `serve` fuzz target (fuzz/corpus/serve/): a few valid request
sequences in the target's input encoding (documented in fuzz/fuzz_targets/serve.rs, `Run::op`).
Run from the repository root: python3 fuzz/serve_seeds.py"""

import os
import struct

# Regions of the target's fixture, by index.
HOST, RO, GPU, GPU_SMALL, GPU1, LOCAL, UNKNOWN = range(7)
WRONG_KEY = 0xC0


def setup(data_role=False, version=5, name=0, sync_terminal=False):
    return bytes([int(data_role) | ((version - 1) << 1) | (name << 4) | (int(sync_terminal) << 5)])


def single(write, region, off, length):
    # mode 3: the length as given (a payload follows a WRITE; its bytes come from the mode byte)
    return bytes([0 if write else 2, region, 3]) + struct.pack("<HH", off, length)


def zero(write, region, off):
    # mode 0: no bytes
    return bytes([0 if write else 2, region, 0]) + struct.pack("<HH", off, 0)


def vec(write, region, pieces):
    """pieces: (offset, len <= 256, count 1..4, stride - len)"""
    out = bytes([3 if write else 5, region, len(pieces) - 1])
    for off, ln, count, extra in pieces:
        out += struct.pack("<H", off) + bytes([count - 1, 31]) + struct.pack("<H", ln - 1) + bytes([extra])
    return out


PING, META_GET, SYNC, PUSH = b"\x06", b"\x08", b"\x0c", b"\x0d"
NOTIF = b"\x07\x10"
META_PUT_OWN = b"\x09\x00"
FENCE_UNKNOWN, FENCE_SELF = b"\x0a\x01", b"\x0a\x00"

SEEDS = {
    "mixed_control": setup() + single(True, GPU, 0, 16) + single(True, HOST, 8, 1) + single(False, GPU, 0, 32)
    + single(False, HOST, 0, 16) + PING + SYNC + META_GET + NOTIF + META_PUT_OWN + FENCE_UNKNOWN,
    "vectored_data": setup(data_role=True, version=4) + vec(True, GPU, [(0, 64, 3, 16), (1000, 200, 1, 0)])
    + vec(True, HOST, [(10, 20, 2, 0), (4000, 100, 1, 0)]) + vec(False, GPU, [(0, 64, 4, 16)])
    + vec(False, HOST, [(0, 50, 1, 0)]) + SYNC + single(True, GPU1, 100, 300) + single(True, GPU_SMALL, 0, 900)
    + single(True, GPU, 5000, 9000) + single(False, GPU1, 0, 500) + PUSH + single(False, GPU_SMALL, 0, 1024),
    "refusals": setup(version=1) + single(True, GPU | WRONG_KEY, 0, 8) + single(True, RO, 0, 4) + single(False, RO, 500, 12)
    + single(True, LOCAL, 0, 4) + single(False, UNKNOWN, 0, 4) + single(True, HOST, 8190, 4)
    + vec(True, RO, [(0, 4, 1, 0)]) + vec(False, GPU_SMALL, [(1000, 30, 1, 0)]) + PING,
    "pipelined_gpu_writes_then_self_fence": setup(data_role=True) + single(True, GPU, 0, 5000) + single(True, GPU, 6000, 4096)
    + single(True, GPU_SMALL, 0, 16) + single(True, GPU1, 0, 64) + single(False, GPU, 0, 8000) + FENCE_SELF,
    # Issue 33's wedge, as the fuzzer found it again when it was put back (docs/planner.md).
    "zero_length_gpu_requests": setup(data_role=True) + single(True, GPU, 512, 1027) + zero(True, GPU, 768)
    + zero(True, HOST, 770) + zero(True, GPU_SMALL, 0) + single(True, HOST, 0, 1) + zero(False, GPU, 8) + PING,
    "ends_with_garbage": setup(sync_terminal=True) + single(True, HOST, 0, 64) + PING + b"\x0e\x08MR\x01\x0d\x00\x00\x00\x00",
    "ends_with_a_reply_frame": setup(name=1) + single(True, GPU, 0, 64) + b"\x0f\x00",
}

if __name__ == "__main__":
    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "serve")
    os.makedirs(d, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    print(f"{len(SEEDS)} seeds in {d}")
