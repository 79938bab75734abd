"""Transport security and client authentication, for every hop.

TLS: a server given a certificate and key serves TLS only; given a client CA as well, it also
demands a client certificate signed by that CA (mutual TLS) and refuses any other at the
handshake. A client given a CA verifies the server against it; given a certificate and key, it
presents them. Paths come from flags (and SPECDEC_<ROLE>_* variables); files are read once.

Bearer tokens (client-facing API only): with tokens configured, every call to the Orchestrator
service must carry `authorization: Bearer <token>`, else UNAUTHENTICATED. Health and reflection
stay open, so probes need no secret. Tokens over plaintext are readable on the wire: use TLS.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

# The client's half (ClientTls, open_channel, open_aio_channel) lives in the client distribution
# (clients/python/specdec_client/channel.py); the orchestrator reaches its workers with it too.
from specdec_client.channel import ClientTls, open_aio_channel, open_channel  # noqa: F401
from specdec_client.channel import read_file as _read

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerTls:
    cert: str | None = None  # PEM certificate chain of this server
    key: str | None = None  # its PEM private key
    client_ca: str | None = None  # PEM CA bundle: require client certificates it signed (mTLS)

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that follow the files: each new connection is served with the certificate,
        key and client CA as they are on disk then (a renewed certificate needs no restart; a
        half-written or unreadable set keeps the one before, with a warning)."""
        if not (self.cert and self.key):
            raise ValueError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
        files = tuple(p for p in (self.cert, self.key, self.client_ca) if p)
        state = {"stamp": _stamp(files)}

        def configuration() -> grpc.ServerCertificateConfiguration:
            ca = _read(self.client_ca)
            return grpc.ssl_server_certificate_configuration([(_read(self.key), _read(self.cert))],
                                                            root_certificates=ca)

        def fetch():  # gRPC asks before each handshake; None keeps the current configuration
            try:
                stamp = _stamp(files)
                if stamp == state["stamp"]:
                    return None
                fresh = configuration()
            except (OSError, ValueError) as exc:
                log.warning("keeping the TLS certificate loaded before: %s", exc)
                return None
            state["stamp"] = stamp
            log.info("TLS certificate files changed: new connections get the new ones")
            return fresh

        return grpc.dynamic_ssl_server_credentials(configuration(), fetch,
                                                   require_client_authentication=self.client_ca is not None)


def _stamp(files: tuple[str, ...]) -> tuple:
    return tuple((st.st_mtime_ns, st.st_size) for st in map(os.stat, files))


def bind(server: grpc.Server, address: str, tls: ServerTls | None) -> int:
    """Adds the listening port, TLS when configured; returns the bound port."""
    if tls is not None and tls.enabled:
        return server.add_secure_port(address, tls.credentials())
    return server.add_insecure_port(address)


def read_tokens(path: str | None) -> frozenset[str]:
    """Bearer tokens, one per line (blank lines and # comments skipped)."""
    if not path:
        return frozenset()
    tokens = [line.strip() for line in Path(path).read_text().splitlines()]
    tokens = frozenset(t for t in tokens if t and not t.startswith("#"))
    if not tokens:
        raise ValueError(f"{path} holds no token")
    return tokens


def bearer_token(metadata) -> bytes | None:
    """The token of an 'authorization: Bearer T' entry of gRPC metadata (None: no such entry)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip().encode()
    return None


class TokenSet:
    """Tokens a caller may present, compared in constant time each (no early exit to time).

    From files (`files=`), the set follows them: a file whose size or modification time changed
    is read again (checked at most once a second), so tokens are added and revoked without a
    restart. A file that became unreadable or empty keeps the tokens read before, with a warning."""

    RECHECK_S = 1.0

    def __init__(self, tokens: frozenset[str] = frozenset(), files: tuple[str | None, ...] = ()):
        self._static = frozenset(tokens)
        self._files = tuple(p for p in files if p)
        self._stamp: tuple | None = None
        self._checked = float("-inf")
        self._lock = threading.Lock()
        self._tokens = [t.encode() for t in self._static]
        if self._files:
            self._refresh(force=True)

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._files or (not force and now - self._checked < self.RECHECK_S):
            return
        with self._lock:
            self._checked = now
            try:
                stamp = tuple((s.st_mtime_ns, s.st_size) for s in map(os.stat, self._files))
                if stamp == self._stamp:
                    return
                tokens = self._static.union(*(read_tokens(p) for p in self._files))
            except (OSError, ValueError) as exc:
                if force:
                    raise
                log.warning("keeping the tokens read before: %s", exc)
                return
            self._tokens, self._stamp = [t.encode() for t in tokens], stamp
            if not force:
                log.info("token files changed: %d tokens now", len(tokens))

    def __bool__(self) -> bool:
        self._refresh()
        return bool(self._tokens)

    def holds(self, given: bytes | None) -> bool:
        self._refresh()
        return given is not None and any([hmac.compare_digest(given, t) for t in self._tokens])

    def caller_holds_one(self, context) -> bool:
        """The gRPC caller of `context` sent one of these tokens."""
        return self.holds(bearer_token(context.invocation_metadata()))


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls to the protected services without a valid `authorization: Bearer` header."""

    def __init__(self, tokens: "TokenSet | frozenset[str]", protected_prefix: str):
        self._tokens = tokens if isinstance(tokens, TokenSet) else TokenSet(tokens)
        self._prefix = protected_prefix

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token "
                          "(send metadata 'authorization: Bearer <token>')")

        self._refusals = {
            (False, False): grpc.unary_unary_rpc_method_handler(refuse),
            (False, True): grpc.unary_stream_rpc_method_handler(refuse),
        }

    def _valid(self, metadata) -> bool:
        return self._tokens.holds(bearer_token(metadata))

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(self._prefix) or self._valid(
                handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._refusals[(handler.request_streaming, handler.response_streaming)]
