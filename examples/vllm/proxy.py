"""A minimal disaggregated-serving proxy: prefill on one vLLM server, decode on another.

    python examples/vllm/proxy.py --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000

For each OpenAI-style ``/v1/completions`` or ``/v1/chat/completions`` request it

1. sends the request to the prefill server with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}`` (the prefill server keeps the KV),
2. copies the ``kv_transfer_params`` of the prefill's answer, unchanged, into the original
   request and sends that to the decode server, whose DatadistConnector pulls the KV,
3. returns the decode server's answer.

This is the request flow of vLLM's NixlConnector, so routers written for it (vLLM's
``disagg_proxy`` examples, llm-d, Dynamo) work with the DatadistConnector too.

With ``--layerwise`` (both servers started with ``"mode": "layerwise"`` in
``kv_connector_extra_config``) it routes as layer-wise connectors need: each request goes to
both servers at once with one random tag, the decode copy naming the prefill's datadist
workers (learnt once, from a one-token request to the prefill server), and the prefill
pushes each layer into the decode server's blocks as it computes it (docs/vllm.md,
"Layer-wise mode"). Standard library only; no streaming, no retries, one prefill and one
decode server: a sketch to read, not a production router.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = ("/v1/completions", "/v1/chat/completions")


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def disaggregated(prefill: str, decode: str, path: str, body: dict, timeout: float) -> dict:
    """Run one request through prefill, then decode; return the decode server's answer."""
    first = dict(body, max_tokens=1, stream=False,
                 kv_transfer_params={"do_remote_decode": True})
    first.pop("max_completion_tokens", None)
    first.pop("stream_options", None)
    answer = post(prefill + path, first, timeout)
    params = answer.get("kv_transfer_params")
    second = dict(body)
    if params:  # without them the decode server simply computes the prompt itself
        second["kv_transfer_params"] = params
    return post(decode + path, second, timeout)


_workers: dict[str, dict] = {}
_workers_lock = threading.Lock()


def prefill_workers(prefill: str, path: str, body: dict, timeout: float) -> dict:
    """The prefill server's datadist workers and block size (asked once: any layer-wise
    answer of a prefill server carries them; one without a tag holds nothing)."""
    with _workers_lock:
        if prefill not in _workers:
            hello = dict(body, max_tokens=1, stream=False, kv_transfer_params={
                "do_remote_decode": True, "datadist": {"mode": "layerwise"}})
            hello.pop("max_completion_tokens", None)
            hello.pop("stream_options", None)
            dd = post(prefill + path, hello, timeout)["kv_transfer_params"]["datadist"]
            _workers[prefill] = {"workers": dd["workers"], "block_size": dd["block_size"]}
        return _workers[prefill]


def layerwise(prefill: str, decode: str, path: str, body: dict, timeout: float) -> dict:
    """Send the request to both servers at once (one tag); return the decode's answer."""
    known = prefill_workers(prefill, path, body, timeout)
    tag = secrets.token_hex(16)
    first = dict(body, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "datadist": {"mode": "layerwise", "tag": tag}})
    first.pop("max_completion_tokens", None)
    first.pop("stream_options", None)
    errors: list[BaseException] = []

    def run_prefill() -> None:
        try:
            post(prefill + path, first, timeout)
        except (OSError, ValueError) as e:  # the decode server recomputes (or fails)
            errors.append(e)

    t = threading.Thread(target=run_prefill, daemon=True)
    t.start()
    second = dict(body, kv_transfer_params={"do_remote_prefill": True, "datadist": {
        "mode": "layerwise", "tag": tag, **known}})
    try:
        return post(decode + path, second, timeout)
    finally:
        t.join(timeout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", default="http://127.0.0.1:8100")
    ap.add_argument("--decode", default="http://127.0.0.1:8200")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=300.0, help="per upstream request, s")
    ap.add_argument("--layerwise", action="store_true",
                    help="route for the connectors' layer-wise mode (both servers at once)")
    args = ap.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path not in ROUTES:
                self.send_error(404, f"only {', '.join(ROUTES)}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if body.get("stream"):
                    raise ValueError("this sketch does not stream")
                route = layerwise if args.layerwise else disaggregated
                out = json.dumps(route(args.prefill, args.decode, self.path, body,
                                       args.timeout)).encode()
                code = 200
            except urllib.error.HTTPError as e:
                code, out = e.code, e.read()
            except (ValueError, OSError) as e:
                code, out = 502, json.dumps({"error": str(e)}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"proxy on http://{args.host}:{args.port}: prefill {args.prefill}, "
          f"decode {args.decode}", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
