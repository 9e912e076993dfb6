"""A stand-in for `distpool serve` in the --launch tests, stdlib only so that it starts at once:

    python -m tests.bench.standin_server [--step-delay S] [--exit-status N] --port P

GET /health and /v1/models; POST /v1/completions streams `max_tokens` chunks of one token id each
(the prompt's first id), `step_delay` seconds apart, then the usage chunk and [DONE]. SIGTERM ends
it with status N (0), as a drained `distpool serve` exits 0."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def handler(step_delay_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (
                {"status": "ok"}
                if self.path == "/health"
                else {"data": [{"id": "stand-in", "max_model_len": 512}]}
            )
            self._send(json.dumps(body).encode(), "application/json")

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt, max_tokens = request["prompt"], request["max_tokens"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
            for _ in range(max_tokens):
                time.sleep(step_delay_s)
                self._event({"choices": [{"index": 0, "text": "", "token_ids": [prompt[0]]}]})
            self._event(
                {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": max_tokens}}
            )
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, payload: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-delay", type=float, default=0.001)
    parser.add_argument("--exit-status", type=int, default=0)
    ns = parser.parse_args()

    def stop(*_) -> None:
        print("stopped after serving", flush=True)
        sys.exit(ns.exit_status)

    signal.signal(signal.SIGTERM, stop)
    print(f"serving on port {ns.port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", ns.port), handler(ns.step_delay)).serve_forever()


if __name__ == "__main__":
    main()
