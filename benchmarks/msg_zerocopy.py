#!/usr/bin/env python3
"""Does MSG_ZEROCOPY pay for the engine's bulk sends here? (issue 22 item 5)

One TCP connection on loopback: a sender thread sends 1 MiB slices of a 64 MiB buffer, a
receiver thread lands them in another 64 MiB buffer (the engine's WRITE shape), for --seconds,
alternately with plain `send` and with `send(MSG_ZEROCOPY)` (SO_ZEROCOPY on, completions drained
from the error queue after every send). Prints each thread's CPU seconds per GB
(`time.thread_time`) and how many completions the kernel marked SO_EE_CODE_ZEROCOPY_COPIED (it
copied after all: every skb delivered to a local socket, loopback or veth, is copied, so
zero-copy cannot pay on this host; it pays only through a NIC that DMAs from user pages).

    .venv/bin/python benchmarks/msg_zerocopy.py [--rounds 3] [--seconds 2]
"""

from __future__ import annotations

import argparse
import socket
import struct
import threading
import time

import numpy as np

SO_ZEROCOPY, MSG_ZEROCOPY = 60, 0x4000000
SIZE, CHUNK = 64 << 20, 1 << 20


def run(zerocopy: bool, seconds: float) -> dict[str, float]:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    s = socket.create_connection(lst.getsockname(), timeout=30)
    s.settimeout(None)  # blocking: MSG_DONTWAIT on the error queue raises BlockingIOError
    r, _ = lst.accept()
    r.settimeout(30)
    if zerocopy:
        s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
    src = np.random.default_rng(1).integers(0, 255, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, np.uint8)
    out = {"sent": 0.0, "notifications": 0.0, "copied": 0.0}

    def drain() -> None:
        while True:
            try:
                _, anc, _, _ = s.recvmsg(0, 256, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            for _lvl, _typ, data in anc:
                # struct sock_extended_err: errno, origin, type, code, pad, info, data
                _e, _origin, _t, code, _pad, lo, hi = struct.unpack("IBBBBII", data[:16])
                out["notifications"] += hi - lo + 1
                out["copied"] += (hi - lo + 1) if code & 1 else 0

    def tx() -> None:
        t0, off, end = time.thread_time(), 0, time.monotonic() + seconds
        mv = memoryview(src)
        while time.monotonic() < end:
            n = s.send(mv[off:off + CHUNK], MSG_ZEROCOPY if zerocopy else 0)
            out["sent"] += n
            off = (off + n) % (SIZE - CHUNK)
            if zerocopy:
                drain()
        s.shutdown(socket.SHUT_WR)
        out["tx_cpu"] = time.thread_time() - t0

    def rx() -> None:
        t0, off = time.thread_time(), 0
        dv = memoryview(dst)
        while True:
            n = r.recv_into(dv[off:off + CHUNK])
            if n == 0:
                break
            off = (off + n) % (SIZE - CHUNK)
        out["rx_cpu"] = time.thread_time() - t0

    threads = [threading.Thread(target=rx), threading.Thread(target=tx)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    for x in (s, r, lst):
        x.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    for _ in range(a.rounds):
        for zc in (False, True):
            o = run(zc, a.seconds)
            gb = o["sent"] / 1e9
            print(f"{'MSG_ZEROCOPY' if zc else 'plain send  '}  send {o['tx_cpu'] / gb:.3f}  recv {o['rx_cpu'] / gb:.3f} "
                  f"CPU-s/GB  {o['sent'] * 8 / a.seconds / 1e9:5.1f} Gbit/s  completions {o['notifications']:.0f} "
                  f"(copied {o['copied']:.0f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
