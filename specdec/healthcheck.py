"""A gRPC health probe for container healthchecks: exit 0 when the server says SERVING, else 1.

    python -m specdec.healthcheck HOST:PORT [--service NAME] [--timeout S]

Docker and Compose can only run a command to check health (Kubernetes has native `grpc:` probes
and does not need this). It asks the standard grpc.health.v1 service, which every specdec server
runs: workers answer NOT_SERVING until their model is loaded, the orchestrator until both worker
pools answer. It imports nothing but grpc, so a check every few seconds stays cheap (no torch).

Exit codes follow Docker's HEALTHCHECK contract: 0 healthy, 1 unhealthy. Docker reserves 2, so
bad arguments also exit 1 instead of argparse's usual 2.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.security import ClientTls, open_channel

DEFAULT_TIMEOUT_S = 3.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D102 - argparse would exit 2, which Docker reserves
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m specdec.healthcheck",
                description="Exit 0 if the gRPC server at HOST:PORT reports SERVING, 1 otherwise.")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--service", default="",
                   help="health service name to ask about (default: '', the whole server)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the answer")
    p.add_argument("--tls-ca", default=None, help="the server speaks TLS: verify it against this PEM CA")
    p.add_argument("--tls-cert", default=None, help="mutual TLS: present this PEM certificate ...")
    p.add_argument("--tls-key", default=None, help="... with this key")
    p.add_argument("--tls-server-name", default=None, help="the name in the server's certificate, when it "
                                                          "is not the address's host (e.g. probing localhost)")
    return p


def check(address: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
          tls: ClientTls | None = None, server_name: str | None = None) -> tuple[bool, str]:
    """(serving, status name): the status the server reports, or the gRPC error when it cannot answer."""
    with open_channel(address, tls, [], server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()
            return False, f"{code.name if code else 'UNKNOWN'}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
    serving, status = check(args.address, args.service, args.timeout, tls, args.tls_server_name)
    print(f"{args.address}{' ' + args.service if args.service else ''}: {status}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
