"""A real etcd for tests: Debian's etcd-server (/usr/bin/etcd, 3.4) on free loopback ports.

Also the etcd of `benchmarks/etcd_metadata.py`. `EtcdServer(tmp_dir)` starts one member (client and peer URLs on 127.0.0.1, its own data dir),
waits for /health, and is stopped by PID (`stop`, `kill`); `restart` starts it again on the
same ports and data dir. Tests skip with `ETCD_MISSING` as the reason when there is no binary.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
ETCD_MISSING = None if ETCD else "etcd is not installed (apt-get install etcd-server; `make deps` does it)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """`host`/`netns`: listen on that address inside that network namespace (root) instead
    of 127.0.0.1 here; health is then checked from inside the namespace."""

    def __init__(self, data_dir: Path, name: str = "mrtest", host: str = "127.0.0.1", netns: str | None = None,
                 extra: list[str] | None = None) -> None:
        assert ETCD, ETCD_MISSING
        self.extra = list(extra or [])  # more etcd flags (benchmarks/etcd_metadata.py --etcd-flag)
        self.data_dir = Path(data_dir)
        self.name = name
        self.host, self.netns = host, netns
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        self.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def in_ns(self, argv: list[str]) -> list[str]:
        return (["ip", "netns", "exec", self.netns] if self.netns else []) + argv

    def url(self, prefix: str) -> str:
        return f"etcd://{self.endpoint}/{prefix.strip('/')}"

    def start(self, timeout: float = 30.0) -> None:
        client = self.http
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = self.in_ns([ETCD, "--name", self.name, "--data-dir", str(self.data_dir),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"{self.name}={peer}", "--logger", "zap", "--log-level", "error", *self.extra])
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout:g} s: {self.log_tail()}")

    def healthy(self) -> bool:
        if self.netns:
            probe = ("import json, sys, urllib.request; "
                     "print(json.loads(urllib.request.urlopen(sys.argv[1], timeout=1).read()).get('health'))")
            try:
                cp = subprocess.run(self.in_ns([sys.executable, "-c", probe, f"{self.http}/health"]),
                                    capture_output=True, text=True, timeout=10)
            except subprocess.TimeoutExpired:
                return False
            return cp.stdout.strip() == "true"
        try:
            with urllib.request.urlopen(f"{self.http}/health", timeout=1.0) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-1500:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL by PID (a crash: no graceful shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid
