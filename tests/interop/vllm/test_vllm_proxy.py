"""examples/vllm/proxy.py's layer-wise routing against two stand-in HTTP servers (no vLLM):
each request reaches both servers with one tag, the decode copy names the prefill's workers,
learnt once."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PROXY = Path(__file__).parents[3] / "examples" / "vllm" / "proxy.py"
WORKERS = [["10.1.2.3", 4567, 99]]


def _load_proxy():
    spec = importlib.util.spec_from_file_location("dd_vllm_proxy", PROXY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _server(answer):
    seen: list[dict] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            out = json.dumps(answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}", seen


def test_layerwise_routing_sends_both_copies_with_one_tag():
    proxy = _load_proxy()
    pre, pre_url, pre_seen = _server(lambda b: {"kv_transfer_params": {"datadist": {
        "mode": "layerwise", "workers": WORKERS, "block_size": 32}}})
    dec, dec_url, dec_seen = _server(lambda b: {"choices": [{"text": "ok"}]})
    try:
        for _ in range(2):
            out = proxy.layerwise(pre_url, dec_url, "/v1/completions",
                                  {"model": "m", "prompt": "hi", "max_tokens": 9}, 30)
            assert out == {"choices": [{"text": "ok"}]}
        hello, *firsts = pre_seen
        assert hello["kv_transfer_params"] == {"do_remote_decode": True,
                                               "datadist": {"mode": "layerwise"}}
        assert len(firsts) == 2 and len(dec_seen) == 2  # workers learnt once
        for first, second in zip(firsts, dec_seen, strict=True):
            assert first["max_tokens"] == 1 and second["max_tokens"] == 9
            tag = first["kv_transfer_params"]["datadist"]["tag"]
            assert len(bytes.fromhex(tag)) == 16
            assert second["kv_transfer_params"] == {
                "do_remote_prefill": True,
                "datadist": {"mode": "layerwise", "tag": tag, "workers": WORKERS,
                             "block_size": 32}}
        assert firsts[0]["kv_transfer_params"]["datadist"]["tag"] != \
            firsts[1]["kv_transfer_params"]["datadist"]["tag"]
    finally:
        pre.shutdown()
        dec.shutdown()
