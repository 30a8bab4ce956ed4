"""A tiny JSON server on 127.0.0.1 for client tests: fixed answers by path, every request kept.

    with FakeServer({"/v1/models": {"data": [...]}}) as server:
        ...server.url..., server.requests   # [(method, path, JSON body or None, headers)]

An answer is a JSON value (200), a `(status, value)` pair, or a function of the request's body
returning either; a path with no answer gets 404.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeServer:
    def __init__(self, routes: dict, headers: dict | None = None):
        self.routes, self.headers, self.requests = routes, headers or {}, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp's pool expects

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path = self.path.split("?")[0]
                server.requests.append((self.command, path, body, dict(self.headers)))
                answer = server.routes.get(path, (404, {"detail": "Not Found"}))
                answer = answer(body) if callable(answer) else answer
                status, value = answer if isinstance(answer, tuple) else (200, answer)
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, text in server.headers.items():
                    self.send_header(name, text)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):  # quiet
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(5)
