"""A reward server for the --rm-url tests: a real HTTP server on a loopback port, in a thread of the test.

POST /score: 1.0 when the response contains the label, else 0.0, with the response's length as an extra.
POST /flaky: HTTP 503 for the first `flaky_failures` requests, then /score's answer. POST /hang: answers only
once the test releases it (`release`). POST /nan: a reward of NaN. POST /text: not JSON. Anything else: 404.
Every request body is kept in `requests`, by path.
"""

from __future__ import annotations

import collections
import contextlib
import http.server
import json
import threading


class RewardServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, flaky_failures: int = 0):
        super().__init__(("127.0.0.1", 0), Handler)
        self.flaky_failures = flaky_failures
        self.requests: dict[str, list[dict]] = collections.defaultdict(list)
        self.release = threading.Event()
        self.lock = threading.Lock()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


class Handler(http.server.BaseHTTPRequestHandler):
    server: RewardServer

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests[self.path].append(body)
            seen = len(self.server.requests[self.path])
        if self.path == "/hang":
            self.server.release.wait()
            return self.answer(200, b"0.0")
        if self.path == "/flaky" and seen <= self.server.flaky_failures:
            return self.answer(503, b"busy")
        if self.path in ("/score", "/flaky"):
            reward = float(str(body["label"]) in body["response"])
            return self.answer(200, json.dumps({"reward": reward, "length": len(body["response"])}).encode())
        if self.path == "/nan":
            return self.answer(200, b'{"reward": NaN}')
        if self.path == "/text":
            return self.answer(200, b"seven")
        self.answer(404, b"no such endpoint")

    def answer(self, code: int, payload: bytes):
        self.send_response(code)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@contextlib.contextmanager
def reward_server(flaky_failures: int = 0):
    server = RewardServer(flaky_failures)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
