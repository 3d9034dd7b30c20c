"""The bench control protocol: small notifications between initiator and target.

All messages travel as engine notifications (`send_notif` / `get_new_notifs`), prefixed
`bench:`; payloads are JSON (never pickle). Order of a session:

1. initiator: fetch_remote_metadata(target) and send_local_metadata(target's address)
2. initiator -> target  `bench:hello {"fill": bool}`      (fill: write the pattern first)
3. target -> initiator  `bench:info {"addr", "len", "dev", "mem", "gpu"}`  (its one buffer; mem
   "DRAM" or "VRAM", gpu {"kind", "device", "name"} or null; an older target sends no mem: DRAM)
4. per block size, WRITE with --check-consistency:
   initiator -> target  `bench:verify {"seed", "offset", "length"}`
   target -> initiator  `bench:verified {"ok", "first_bad", "bad_bytes", "seed", "offset", "length"}`
5. initiator -> target  `bench:keepalive` between block sizes (resets the idle timeout)
   around each timed loop of a run with VRAM, the target's staging totals:
   initiator -> target  `bench:stats {"i"}`
   target -> initiator  `bench:stats {"i", "staging": {...}, "rows"}` (served_stats of that
   initiator summed over rails, bench/staging.py; or {"i", "error"})
6. initiator -> target  `bench:stop`  (target deregisters and exits 0)
"""

from __future__ import annotations

import json
from typing import Any

PREFIX = b"bench:"
HELLO, INFO, VERIFY, VERIFIED, KEEPALIVE, STOP, STATS = (
    "hello", "info", "verify", "verified", "keepalive", "stop", "stats")
DEFAULT_TARGET_NAME = "mr-bench-target"


def encode(kind: str, payload: dict[str, Any] | None = None) -> bytes:
    body = b"" if payload is None else b" " + json.dumps(payload, separators=(",", ":")).encode()
    return PREFIX + kind.encode() + body


def decode(msg: bytes) -> tuple[str, dict[str, Any]] | None:
    """(kind, payload) of a bench message; None for anything else (ignored by both sides)."""
    if not msg.startswith(PREFIX):
        return None
    kind, _, body = msg[len(PREFIX):].partition(b" ")
    try:
        payload = json.loads(body) if body else {}
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    return kind.decode(errors="replace"), payload
