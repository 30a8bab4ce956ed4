"""A lean HTTP/1.1 client for the proxy's hot path: POST a JSON body, get the whole answer.

Keep-alive connections per upstream, a cap on requests in flight, connect and total timeouts.
With it the proxy spends 0.59-0.66 of the CPU per request it spends with aiohttp's
ClientSession, and serves 1.5-1.7x the requests/s (benchmarks/proxy_overhead.py, side by side);
the proxy keeps aiohttp for everything else (docs/internals.md, "proxy: inside `grpo-lab
proxy`"). Its errors are all OSError: `ConnectFailed` (nothing was sent), `ResponseTimeout`,
`ConnectionClosed`, `InvalidResponse`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024


class ConnectFailed(ConnectionError):
    """The connection could not be opened: the request never left."""


class ResponseTimeout(TimeoutError):
    """No complete answer within the request's timeout."""


class ConnectionClosed(ConnectionError):
    """The upstream closed the connection before the answer was complete."""


class InvalidResponse(ConnectionError):
    """The upstream's bytes are not an HTTP/1.x answer."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one answer at a time into `self.waiter`."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] | None = None
        self.body = bytearray()
        self.keep_alive = True
        self.chunked = False
        self.length: int | None = None

    # ---- asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.headers is not None and self.length is None and not self.chunked:
                self._finish()  # close-delimited body: the end of the connection ends it
            else:
                self.waiter.set_exception(ConnectionClosed(
                    "the connection closed before the answer was complete"))

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.closed = True  # bytes nobody asked for: never reuse this connection
            self.transport.abort()
            return
        self.buf += data
        try:
            self._parse()
        except (ValueError, IndexError) as exc:
            self.waiter.set_exception(InvalidResponse(f"invalid HTTP answer: {exc}"))
            self.closed = True
            self.transport.abort()

    # ---- parsing

    def _parse(self) -> None:
        if self.headers is None:
            end = self.buf.find(b"\r\n\r\n")
            start = bytes(self.buf[:7])
            if not b"HTTP/1.".startswith(start) or len(self.buf) > MAX_HEAD_BYTES:
                raise ValueError(f"does not start like HTTP/1.x: {bytes(self.buf[:40])!r}")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).split(b"\r\n")
            del self.buf[: end + 4]
            version, status = lines[0][:8], lines[0][9:12]
            if version not in (b"HTTP/1.1", b"HTTP/1.0") or not status.isdigit():
                raise ValueError(f"bad status line {lines[0][:60]!r}")
            self.status = int(status)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            if 100 <= self.status < 200:  # an interim answer: the real one follows
                self._reset()
                return self._parse() if self.buf else None
            self.headers = headers
            connection = headers.get(b"connection", b"").lower()
            self.keep_alive = connection != b"close" and (version == b"HTTP/1.1"
                                                          or connection == b"keep-alive")
            if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
                self.chunked = True
            elif b"content-length" in headers:
                self.length = int(headers[b"content-length"])
                if self.length < 0:
                    raise ValueError("negative Content-Length")
            elif self.status in (204, 304):
                self.length = 0
            else:
                self.keep_alive = False  # the body ends with the connection
        if self.chunked:
            self._parse_chunks()
        elif self.length is not None:
            need = self.length - len(self.body)
            self.body += self.buf[:need]
            del self.buf[:need]
            if len(self.body) == self.length:
                self._finish()
        else:
            self.body += self.buf
            self.buf.clear()

    def _parse_chunks(self) -> None:
        while True:
            end = self.buf.find(b"\r\n")
            if end < 0:
                return
            size = int(bytes(self.buf[:end]).split(b";")[0].strip(), 16)
            if size == 0:  # last chunk, then optional trailers and an empty line
                done = self.buf.find(b"\r\n\r\n", end)
                if done < 0:
                    return
                del self.buf[: done + 4]
                self._finish()
                return
            if len(self.buf) < end + 2 + size + 2:
                return
            self.body += self.buf[end + 2: end + 2 + size]
            del self.buf[: end + 2 + size + 2]

    def _finish(self) -> None:
        if self.buf:  # bytes beyond this answer: the stream is out of step, do not reuse
            self.keep_alive = False
        ctype = self.headers.get(b"content-type", b"application/json").decode("latin-1")
        self.waiter.set_result((self.status, bytes(self.body), ctype))


class ConnectionPool:
    """Keep-alive connections to several upstreams; `post()` one JSON request at a time each."""

    def __init__(self, limit: int = 1024, headers: dict[str, str] | None = None,
                 connect_timeout_s: float = 5.0, keepalive_s: float = 4.0,
                 ssl_context: ssl.SSLContext | None = None):
        self._slots = asyncio.Semaphore(limit)
        self._idle: dict[tuple[str, int, bool], deque[_Connection]] = {}  # (host, port, tls)
        self._tls = ssl_context  # for https:// upstreams (default: the system's CAs)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._extra_headers = extra.encode("latin-1")
        self.connect_timeout_s, self.keepalive_s = connect_timeout_s, keepalive_s
        self._open: set[_Connection] = set()
        self._targets: dict[str, tuple[tuple[str, int, bool], bytes]] = {}  # url -> _target()

    @property
    def open_connections(self) -> int:
        """Connections open now, idle or carrying a request: none after `close`, and none left
        behind by a request that failed, timed out or was cancelled."""
        return len(self._open)

    def _target(self, url: str) -> tuple[tuple[str, int, bool], bytes]:
        """`url` -> (its pool key, the request's head up to the Content-Length value), cached:
        a proxy posts to a few URLs only."""
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            key = (parts.hostname, parts.port or (443 if tls else 80), tls)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode("latin-1")
                    + self._extra_headers + b"Content-Type: application/json\r\nContent-Length: ")
            if len(self._targets) < 1024:
                self._targets[url] = (key, head)
            target = (key, head)
        return target

    async def post(self, url: str, body: bytes, timeout_s: float) -> tuple[int, bytes, str]:
        """POST `body` (JSON) to `url` -> (status, body, content type)."""
        key, head = self._target(url)
        loop = asyncio.get_running_loop()
        async with self._slots:
            conn = await self._acquire(key, loop)
            conn.waiter = waiter = loop.create_future()
            conn.transport.write(b"%s%d\r\n\r\n%s" % (head, len(body), body))
            timer = loop.call_later(timeout_s, _expire, waiter, timeout_s)
            try:
                result = await waiter
            except BaseException:  # cancelled, timed out, closed, garbage: drop the connection
                self._discard(conn)
                raise
            finally:
                timer.cancel()
            if conn.keep_alive and not conn.closed:
                conn.waiter = None
                conn._reset()
                conn.idle_since = loop.time()
                self._idle.setdefault(key, deque()).append(conn)
            else:
                self._discard(conn)
            return result

    async def _acquire(self, key: tuple[str, int, bool], loop) -> _Connection:
        idle = self._idle.get(key)
        now = loop.time()
        while idle:
            conn = idle.pop()  # the most recently used
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            self._discard(conn)
        host, port, tls = key
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                _Connection, host, port, ssl=self._tls if tls else None,
                server_hostname=host if tls else None), self.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            raise ConnectFailed(f"cannot connect to {host}:{port}: {reason}") from None
        self._open.add(conn)
        return conn

    def _discard(self, conn: _Connection) -> None:
        conn.closed = True
        self._open.discard(conn)
        if conn.transport is not None:
            conn.transport.abort()

    def prune(self) -> None:
        """Close connections idle for longer than `keepalive_s` (call it now and then)."""
        loop = asyncio.get_running_loop()
        for idle in self._idle.values():
            while idle and (idle[0].closed or loop.time() - idle[0].idle_since
                            >= self.keepalive_s):
                self._discard(idle.popleft())

    def close(self) -> None:
        for conn in list(self._open):
            self._discard(conn)
        self._idle.clear()


def _expire(waiter: asyncio.Future, timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(ResponseTimeout(f"no complete answer within {timeout_s:g} s"))
