"""A small prefill/decode proxy speaking the protocol of vLLM's own toy proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py in vLLM's source).

For each `POST /v1/completions`: the request goes to the prefill server with `max_tokens=1`,
`stream=false` and `kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false,
...}`; the original request then goes to the decode server with the `kv_transfer_params` the
prefill server returned, and the decode server's answer is the proxy's answer. The decode server
pulls the prompt's KV blocks from the prefill server (NIXL READ) before decoding.

`before_decode`, when set, is called between the two requests (the check takes every rail down
there, so that the rails fail exactly while decode pulls).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

TIMEOUT_S = 60.0


def post_json(url: str, body: dict[str, Any], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """POST a JSON body; the JSON answer. An HTTP error raises `HTTPError` with vLLM's message."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise HTTPError(e.code, f"{url}: HTTP {e.code}: {detail}") from None


class HTTPError(RuntimeError):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class Proxy:
    """The proxy, serving on 127.0.0.1 in a thread of this process."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.before_decode: Callable[[], None] | None = None
        #: the kv_transfer_params prefill returned, one per request, in the order they came back
        self.handed: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    out, code = proxy.handle(self.path, body), 200
                except HTTPError as e:
                    out, code = {"error": str(e)}, e.code
                except Exception as e:  # noqa: BLE001 - any failure is the client's 502, with its text
                    out, code = {"error": f"{type(e).__name__}: {e}"}, 502
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="proxy", daemon=True)

    def __enter__(self) -> Proxy:
        self.thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        pre = dict(body)
        pre.update(max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        })
        pre.pop("max_completion_tokens", None)
        pre.pop("stream_options", None)
        answer = post_json(self.prefill + path, pre)
        dec = dict(body)
        dec["kv_transfer_params"] = answer.get("kv_transfer_params")
        with self.lock:
            self.handed.append(dict(dec["kv_transfer_params"] or {}))
        hook = self.before_decode
        if hook is not None:
            hook()
        return post_json(self.decode + path, dec)
