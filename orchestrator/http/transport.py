"""The door's transport: uvicorn on a thread of its own (HttpServer), its h11 protocol hardened
against slow and malformed clients, and the ASGI guard (Guard) that checks the bearer token and a
body's size and pace before the app reads a byte of it."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
from typing import Any, Protocol

from orchestrator.http.errors import OpenAIError
from specdec.security import ServerTls, TokenSet

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without a bearer token (load balancers, scrapers)


class Guard:
    """ASGI middleware in front of the door: before the app reads a byte of a request's body, the
    bearer token (every path but /health) and the declared Content-Length; while the body arrives,
    its size (at most max_body_bytes, else 413) and its pace (each piece within body_timeout_s,
    else 408). A body that passes is handed to the app whole, so nothing unbounded is parsed."""

    def __init__(self, app, tokens: TokenSet, max_body_bytes: int, body_timeout_s: float):
        self.app, self.tokens = app, tokens
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("http_version") not in ("1.0", "1.1"):  # h11 reads any HTTP/x.y request line
            return await _refuse(send, OpenAIError(505, f"HTTP/{scope.get('http_version')} is not supported; "
                                                        "send HTTP/1.1", code="http_version_not_supported"))
        if scope["http_version"] == "1.0":  # no keep-alive for HTTP/1.0: say so, or its client reuses a closed socket
            send = _closing(send)
        headers = dict(scope["headers"])
        if self.tokens and scope["path"] not in OPEN_PATHS and not self.tokens.holds(bearer(headers)):
            return await _refuse(send, OpenAIError(
                401, "missing or invalid bearer token (send 'Authorization: Bearer <token>')",
                "authentication_error", code="invalid_api_key"))
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await _refuse(send, self._too_large())
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s or None)
            except asyncio.TimeoutError:
                return await _refuse(send, OpenAIError(
                    408, f"the request body did not arrive within {self.body_timeout_s:g} s", code="timeout"))
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return await _refuse(send, self._too_large())
            if not message.get("more_body", False):
                break
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # a streamed answer still learns of its client leaving

        return await self.app(scope, replay, send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} "
                                "bytes (--http-max-body)", code="request_too_large")


def _closing(send):
    """send, with `Connection: close` on the answer's head."""
    async def closing_send(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await send(message)

    return closing_send


async def _refuse(send, err: OpenAIError) -> None:
    """An error answer sent straight from the ASGI layer; the connection closes after it (the
    rest of a refused body is not read)."""
    payload = json.dumps(err.body(), ensure_ascii=True).encode("ascii")
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


def bearer(headers: dict) -> bytes | None:
    header = headers.get(b"authorization", b"").decode("latin-1")
    return header[len("Bearer "):].strip().encode("latin-1") if header.startswith("Bearer ") else None


LINGER_S = 2.0  # how long a connection refused as unparseable goes on being read (and dropped) before it closes


def _door_protocol(head_timeout_s: float):
    """uvicorn's h11 protocol, letting go of a connection whose request head (request line and
    headers) is not complete head_timeout_s after it opened or after its last answer (0: never),
    so a client that sends nothing, or half its headers, cannot hold a connection for ever;
    and answering a request h11 cannot parse (a bad request line, headers past 16 KiB) in
    OpenAI's error shape instead of plain text."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimedH11(H11Protocol):
        _head_timer = None
        _lingering = False  # answered a request it could not parse: reading the rest only to drop it

        def _arm(self) -> None:
            self._disarm()
            if head_timeout_s > 0:
                self._head_timer = self.loop.call_later(head_timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a whole head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            payload = json.dumps(OpenAIError(400, f"{msg} The request line or headers are malformed, or past "
                                                  "16 KiB.").body()).encode("ascii")
            for event in (h11.Response(status_code=400, reason=b"Bad Request", headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close")]), h11.Data(data=payload), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            # a lingering close (as nginx's): closing now, with the client's bytes still unread, would
            # reset the connection and lose the answer; half-close, drop what comes, close soon after
            self._disarm()
            self._lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    return HeadTimedH11


class Door(Protocol):
    """What HttpServer serves (orchestrator/http/app.py's FrontDoor): its ASGI app, and what it
    lets go of when the server stops."""

    app: Any

    def close(self) -> None: ...


class HttpServer:
    """uvicorn serving a Door (a FrontDoor) on a thread of its own; bind first, so port 0 works. Slow
    clients are let go: a request head must arrive within head_timeout_s (and each piece of a
    body within the door's body timeout); beyond max_connections open connections a request gets
    503."""

    def __init__(self, door: Door, host: str, port: int, tls: ServerTls | None = None,
                 log_level: str = "info", head_timeout_s: float = 10.0, max_connections: int = 1024):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: a response's head and body go out as written, not after
        # the client's delayed ACK (the 40 ms keep-alive stall of Nagle's algorithm)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.door = door
        kwargs = {}
        if tls is not None and tls.enabled:
            kwargs = dict(ssl_certfile=tls.cert, ssl_keyfile=tls.key)
            if tls.client_ca:
                kwargs.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        kwargs["http"] = _door_protocol(head_timeout_s)
        self.server = uvicorn.Server(uvicorn.Config(door.app, log_level=log_level, lifespan="off",
                                                    access_log=False, timeout_graceful_shutdown=5,
                                                    limit_concurrency=max_connections or None, **kwargs))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http",
                                       daemon=True)

    def start(self) -> "HttpServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the HTTP server did not start on port {self.port}")
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(grace_s + 5)
        self.door.close()
        self.sock.close()
