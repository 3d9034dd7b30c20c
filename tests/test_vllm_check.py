"""The parts of `make vllm-check` (tests/vllm/) that run without vLLM: the proxy's protocol, the
metrics the check reads, and which NIXL `multirail nixl-plugin dir` mirrors when the `nixl` meta
package installed both nixl-cu12 and nixl-cu13. The check itself (real vLLM, root) is
`make vllm-check`; docs/nixl-plugin.md, "vLLM"."""

from __future__ import annotations

import json
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))

import proxy as pd_proxy  # noqa: E402


class _Fake:
    """A fake vLLM server: records each JSON body, answers with `answer(body)`."""

    def __init__(self, answer: Any) -> None:
        self.bodies: list[dict[str, Any]] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *_a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                code, out = answer(body)
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def test_proxy_speaks_the_toy_proxy_protocol() -> None:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
              "remote_engine_id": "e", "remote_host": "10.0.0.1", "remote_port": 5600}
    pre = _Fake(lambda b: (200, {"choices": [{"text": "x"}], "kv_transfer_params": params}))
    dec = _Fake(lambda b: (200, {"choices": [{"text": "decoded"}]}))
    order: list[str] = []
    try:
        with pd_proxy.Proxy(pre.url, dec.url) as px:
            px.before_decode = lambda: order.append(f"hook after {len(pre.bodies)} prefill, {len(dec.bodies)} decode")
            out = pd_proxy.post_json(px.url + "/v1/completions",
                                     {"model": "m", "prompt": "hi", "max_tokens": 24, "temperature": 0})
    finally:
        pre.close()
        dec.close()
    assert out == {"choices": [{"text": "decoded"}]}
    (p,), (d,) = pre.bodies, dec.bodies
    assert p["max_tokens"] == 1 and p["stream"] is False and p["prompt"] == "hi"
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["kv_transfer_params"]["do_remote_prefill"] is False
    assert d["max_tokens"] == 24 and d["prompt"] == "hi" and d["kv_transfer_params"] == params
    assert order == ["hook after 1 prefill, 0 decode"]


def test_proxy_passes_a_decode_failure_on() -> None:
    pre = _Fake(lambda b: (200, {"kv_transfer_params": {}}))
    dec = _Fake(lambda b: (500, {"error": "NIXL_ERR_REMOTE_DISCONNECT"}))
    try:
        with pd_proxy.Proxy(pre.url, dec.url) as px, pytest.raises(pd_proxy.HTTPError) as e:
            pd_proxy.post_json(px.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=30)
    finally:
        pre.close()
        dec.close()
    assert e.value.code == 500 and "NIXL_ERR_REMOTE_DISCONNECT" in str(e.value)


def test_metrics_parsed_as_the_check_reads_them() -> None:
    sys.path.insert(0, str(REPO / "python"))
    import check

    text = textwrap.dedent('''\
        # HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
        vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 0.0
        vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 1234.0
        vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"} 7.0
        vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 2.0
        vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} 8.388608e+06
        vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 16.0
        ''')
    m = check.parse_metrics(text)
    assert (m["external"], m["local"], m["failed"], m["bytes"], m["xfers"]) == (1234, 0, 2, 8388608, 16)
    assert m["xfer_s"] != m["xfer_s"]  # NaN: not exported


def test_plugin_dir_mirrors_the_nixl_the_meta_package_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install nixl==1.5.1` brings nixl-cu12 and nixl-cu13; `import nixl` (what vLLM does)
    picks by the CUDA major of torch's build, and vLLM with PyPI's torch 2.13 runs nixl_cu13.
    NIXL_PLUGIN_DIR replaces that NIXL's plugin directory, so it must mirror nixl_cu13's
    plugins (UCX, POSIX, ...), not nixl_cu12's."""
    from multirail import nixl_plugin

    for mod in ("nixl_cu12", "nixl_cu13"):
        (tmp_path / mod).mkdir()
        (tmp_path / mod / "__init__.py").write_text("")
        (tmp_path / f".{mod}.mesonpy.libs" / "plugins").mkdir(parents=True)
    (tmp_path / "nixl_meta_utils.py").write_text("def detect_cuda_major():\n    return 13\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("nixl_cu12", "nixl_cu13", "nixl_meta_utils"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    found = nixl_plugin.find_nixl()
    assert found["module"] == "nixl_cu13"
    assert found["plugins"] == tmp_path / ".nixl_cu13.mesonpy.libs" / "plugins"
    # without the meta package (nixl-cu12 installed alone, as in .venv): the fixed order
    (tmp_path / "nixl_meta_utils.py").write_text("raise ImportError('not installed')\n")
    monkeypatch.delitem(sys.modules, "nixl_meta_utils", raising=False)
    assert nixl_plugin.find_nixl()["module"] == "nixl_cu12"


def test_notification_tally_wants_exactly_one_per_decode_worker() -> None:
    """The decode-TP-2 check's count of prefill's NIXL notifications: each request handed to
    decode, one notification from each of the two decode workers, saying 2 readers. A duplicate,
    a missing one, two from one worker, or one for a request never handed all fail it."""
    sys.path.insert(0, str(REPO / "python"))
    import check

    def line(agent: str, msg: str) -> str:
        return json.dumps({"agent": agent, "msg": msg})

    handed = [{"remote_request_id": "r1"}, {"remote_request_id": "r2"}]
    good = [line("d0", "r1:2"), line("d1", "r1:2"), line("d1", "r2:2"), line("d0", "HB:r2"), line("d0", "r2:2")]
    ok, detail = check.notification_tally(good, handed, consumers=2)
    assert ok, detail
    assert detail.startswith("2/2 requests")
    cases = {
        "duplicate": good + [line("d0", "r1:2")],
        "missing": good[1:],
        "same worker twice": [line("d0", "r1:2"), line("d0", "r1:2"), line("d1", "r2:2"), line("d0", "r2:2")],
        "wrong reader count": [line("d0", "r1:1"), line("d1", "r1:1"), line("d1", "r2:2"), line("d0", "r2:2")],
        "stray request": good + [line("d0", "r9:2"), line("d1", "r9:2")],
    }
    for name, lines in cases.items():
        ok, detail = check.notification_tally(lines, handed, consumers=2)
        assert not ok, f"{name}: {detail}"


def test_cleanup_stops_every_server_when_one_will_not_stop(tmp_path: Path) -> None:
    """A server that does not stop (its stop raises, as one that outlived SIGKILL's wait did on a
    loaded host) must not keep cleanup from stopping the others: before, the exception left
    three vLLM servers and the testbed's namespaces behind."""
    import subprocess

    sys.path.insert(0, str(REPO / "python"))
    import check

    class Stuck:
        name = "stuck"

        def stop(self) -> bool:
            raise subprocess.TimeoutExpired("vllm", 10)

    sleeper = subprocess.Popen(["sleep", "120"], start_new_session=True)
    run = check.Run(check.parse([]))
    run.tb.down = lambda: None  # never brought up here
    run.servers = [Stuck(), check.Server("sleeper", sleeper, "http://127.0.0.1:1", tmp_path / "log")]
    try:
        run.cleanup()
        assert sleeper.wait(60) is not None
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    assert run.servers == []
