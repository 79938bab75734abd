"""Opening a channel to a specdec server: plaintext, TLS, or mutual TLS.

A client given a CA verifies the server against it; given a certificate and key, it presents
them (mutual TLS). Files are read when the channel is opened. The server side of the same
settings is specdec.security (ServerTls), which re-exports these.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def read_file(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class ClientTls:
    ca: str | None = None  # PEM CA bundle that signed the server's certificate (None: system roots)
    cert: str | None = None  # PEM certificate to present (mTLS)
    key: str | None = None
    enabled: bool = False  # TLS even with no file given (public CAs)

    @property
    def on(self) -> bool:
        return self.enabled or bool(self.ca or self.cert)

    def credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs its key, and a key its certificate")
        return grpc.ssl_channel_credentials(root_certificates=read_file(self.ca), private_key=read_file(self.key),
                                            certificate_chain=read_file(self.cert))


def open_channel(address: str, tls: ClientTls | None, options: list, server_name: str | None = None) -> grpc.Channel:
    """A channel to address; server_name: the name its certificate carries when address is an IP
    that a DNS name resolved to."""
    if tls is None or not tls.on:
        return grpc.insecure_channel(address, options=options)
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.secure_channel(address, tls.credentials(), options=options)


def open_aio_channel(address: str, tls: ClientTls | None, options: list) -> "grpc.aio.Channel":
    """open_channel's asyncio twin (grpc.aio), for AsyncClient."""
    if tls is None or not tls.on:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)
