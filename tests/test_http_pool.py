"""The proxy's lean HTTP/1.1 client (grpo_lab.proxy.http_pool) against scripted raw TCP servers:
every framing an upstream may use, keep-alive reuse, and every way an answer can go wrong."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from proxy_stubs import run

from grpo_lab.proxy.http_pool import (
    ConnectFailed,
    ConnectionClosed,
    ConnectionPool,
    InvalidResponse,
    ResponseTimeout,
)


async def scripted_server(answer):
    """A TCP server whose `answer(request_bytes, writer)` coroutine replies to each request.
    Returns (server, url, list of connections seen, list of requests seen)."""
    conns, requests = [], []

    async def handle(reader, writer):
        conns.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                requests.append(head + body)
                if await answer(head + body, writer) == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", conns, requests


def reply(status: str, headers: list[str], body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode() \
        + body


def test_framings_keep_alive_and_headers():
    async def body():
        script = iter([
            reply("200 OK", ["Content-Type: application/json", "Content-Length: 11"],
                  b'{"a": 1234}'),
            reply("100 Continue", [], b"") + reply(
                "404 Not Found", ["Content-Length: 2"], b"{}"),
            reply("200 OK", ["Transfer-Encoding: chunked"],
                  b"4;ext=1\r\n{\"b\"\r\n3\r\n: 2\r\n1\r\n}\r\n0\r\nX-Trailer: 1\r\n\r\n"),
            reply("200 OK", ["Connection: close"], b'{"until": "eof"}'),
        ])

        async def answer(request, writer):
            data = next(script)
            writer.write(data)
            await writer.drain()
            return "close" if b"Connection: close" in data else None

        server, url, conns, requests = await scripted_server(answer)
        pool = ConnectionPool(limit=4, headers={"Authorization": "Bearer tok"})
        try:
            assert await pool.post(url + "/v1/completions", b"{}", 5) == (
                200, b'{"a": 1234}', "application/json")
            status, data, _ = await pool.post(url + "/v1/completions?x=1", b"{}", 5)
            assert (status, data) == (404, b"{}")  # the 100 Continue was skipped
            assert (await pool.post(url + "/v1/completions", b"{}", 5))[1] == b'{"b": 2}'
            assert (await pool.post(url + "/v1/completions", b"{}", 5))[1] == b'{"until": "eof"}'
            assert len(conns) == 1  # one connection kept alive for all four answers
            assert requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert requests[1].startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\n")
            assert b"Authorization: Bearer tok\r\n" in requests[0]
            assert b"Content-Type: application/json\r\n" in requests[0]
            # the server closed after the close-delimited answer: the next one reconnects
            script = iter([reply("200 OK", ["Content-Length: 2"], b"{}")])
            assert (await pool.post(url + "/v1/completions", b"{}", 5))[1] == b"{}"
            assert len(conns) == 2
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    run(body(), 30)


@pytest.mark.parametrize("bad, error", [
    (b"NOT HTTP AT ALL\r\n\r\n", InvalidResponse),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", InvalidResponse),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"trunc", ConnectionClosed),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", InvalidResponse),
    (b"", ConnectionClosed),
])
def test_broken_answers_raise_and_drop_the_connection(bad, error):
    async def body():
        async def answer(request, writer):
            writer.write(bad)
            await writer.drain()
            return "close"

        server, url, conns, _ = await scripted_server(answer)
        pool = ConnectionPool()
        try:
            with pytest.raises(error):
                await pool.post(url + "/x", b"{}", 5)
            assert pool.open_connections == 0  # nothing left open
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    run(body(), 30)


def test_timeout_cancel_and_refused_connection():
    async def body():
        async def never(request, writer):
            await asyncio.sleep(3600)

        async def ok(request, writer):
            writer.write(reply("200 OK", ["Content-Length: 2"], b"{}"))
            await writer.drain()

        server, url, conns, _ = await scripted_server(never)
        answering, ok_url, _, _ = await scripted_server(ok)
        pool = ConnectionPool(limit=1, connect_timeout_s=1)  # one slot: a leaked one blocks all
        try:
            with pytest.raises(ResponseTimeout):
                await pool.post(url + "/x", b"{}", 0.2)
            task = asyncio.ensure_future(pool.post(url + "/x", b"{}", 30))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool.open_connections == 0
            # the slot was given back both times: the next request gets it at once
            status, _, _ = await asyncio.wait_for(pool.post(ok_url + "/x", b"{}", 5), 5)
            assert status == 200
        finally:
            pool.close()
            server.close()
            answering.close()
        with socket_port() as port:
            with pytest.raises(ConnectFailed):
                await pool.post(f"http://127.0.0.1:{port}/x", b"{}", 5)

    run(body(), 30)


class socket_port:
    """A local port with nothing listening on it."""

    def __enter__(self):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc):
        return False


def test_the_connection_limit_queues_requests():
    async def body():
        active = peak = 0

        async def slow(request, writer):
            nonlocal active, peak
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.05)
            active -= 1
            writer.write(reply("200 OK", ["Content-Length: 2"], b"{}"))
            await writer.drain()

        server, url, conns, _ = await scripted_server(slow)
        pool = ConnectionPool(limit=3)
        try:
            results = await asyncio.gather(*(pool.post(url + "/x", b"{}", 5) for _ in range(12)))
            assert all(r[0] == 200 for r in results)
            assert peak == 3 and len(conns) == 3  # never more than 3 at once, connections reused
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    run(body(), 30)


def self_signed_certificate(cert: Path, key: Path, host: str = "localhost") -> None:
    """Write a self-signed certificate for `host` and its key (PEM), valid for a day, with the
    `cryptography` package (the `dev` extra): no `openssl` command needed."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    public = private.public_key()
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=False,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public),
                       critical=False)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))


def test_https_upstreams(tmp_path):
    """TLS to an upstream (exposed HF Jobs ports are https://), with a self-signed certificate."""
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    self_signed_certificate(cert, key)

    async def body():
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(cert, key)

        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(reply("200 OK", ["Content-Length: 9"], b'{"tls":1}'))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        pool = ConnectionPool(ssl_context=ssl.create_default_context(cafile=str(cert)))
        try:
            assert await pool.post(f"https://localhost:{port}/x", b"{}", 10) == (
                200, b'{"tls":1}', "application/json")
            with pytest.raises(ConnectFailed):  # the system's CAs do not trust it
                await ConnectionPool().post(f"https://localhost:{port}/x", b"{}", 10)
        finally:
            pool.close()
            server.close()

    run(body(), 60)
