"""Errors that carry their gRPC status, the one table of what each status means (HTTP, failover),
and the one place that maps them onto gRPC.

Engines (draft, target, orchestrator loop) raise these; they know nothing of gRPC servers.
`ErrorInterceptor` turns them into status codes on every server, and `from_rpc_error` turns a
worker's status back into the same exception on the client side, so the in-process and the
remote paths raise the same things.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

# The error classes live in the client distribution (clients/python/specdec_client/errors.py),
# one copy for both sides: a client catches exactly the classes the server raises.
from specdec_client.errors import (Aborted, AlreadyExists, Cancelled, DeadlineExceeded, FailedPrecondition,  # noqa: F401
                                   InvalidArgument, NotFound, OutOfRange, PermissionDenied, ResourceExhausted,
                                   ServiceError, Unavailable)
from specdec_client.errors import PARAM_METADATA, param_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Status:
    """What a gRPC status means to each part of the service."""

    http: int  # the OpenAI-compatible door's HTTP status (orchestrator/http/)
    openai_type: str  # and its error type
    request_fault: bool = False  # from a worker: about the request, not the worker (no address in it)
    worker_fault: bool = False  # from a worker: the worker's trouble; the request moves to another (placement.py)


# The one table of what each status is; a code not in it is a 500 and no worker's fault.
STATUSES = {
    grpc.StatusCode.INVALID_ARGUMENT: Status(400, "invalid_request_error", request_fault=True),
    grpc.StatusCode.OUT_OF_RANGE: Status(400, "invalid_request_error", request_fault=True),
    grpc.StatusCode.UNAUTHENTICATED: Status(401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: Status(403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: Status(404, "not_found_error", worker_fault=True),  # a worker lost the session
    grpc.StatusCode.RESOURCE_EXHAUSTED: Status(429, "rate_limit_error", worker_fault=True),
    grpc.StatusCode.CANCELLED: Status(499, "cancelled", worker_fault=True),
    grpc.StatusCode.FAILED_PRECONDITION: Status(503, "service_unavailable"),
    grpc.StatusCode.UNAVAILABLE: Status(503, "service_unavailable", worker_fault=True),
    grpc.StatusCode.DEADLINE_EXCEEDED: Status(504, "timeout", worker_fault=True),
    grpc.StatusCode.ABORTED: Status(500, "internal_error", worker_fault=True),
    grpc.StatusCode.UNKNOWN: Status(500, "internal_error", worker_fault=True),  # a worker that crashed mid-call
}
OTHER = Status(500, "internal_error")


def status_info(code: grpc.StatusCode) -> Status:
    return STATUSES.get(code, OTHER)


REQUEST_FAULTS = frozenset(code for code, s in STATUSES.items() if s.request_fault)
WORKER_FAULTS = frozenset(code for code, s in STATUSES.items() if s.worker_fault)


def _worker_error(code: grpc.StatusCode, details: str, peer: str, param: str | None = None) -> ServiceError:
    return ServiceError(details if code in REQUEST_FAULTS else f"{peer}: {details}", code, param)


def from_rpc_error(err: grpc.RpcError, peer: str) -> ServiceError:
    """A worker's failure as seen by the orchestrator, keeping the worker's status code (and, for a
    fault of the worker's, naming it)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return _worker_error(code, details, peer, param_of(err) if hasattr(err, "trailing_metadata") else None)


MAX_MESSAGE_CHARS = 1024  # a status message travels in a header: one quoting a huge input must not burst it


def _clip(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "…"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message an exception travels as: a ServiceError's own, INTERNAL for anything else."""
    if isinstance(exc, ServiceError):
        return exc.code, _clip(exc.message)
    return grpc.StatusCode.INTERNAL, _clip(f"internal error: {type(exc).__name__}: {exc}")


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def from_status(code: int, message: str, peer: str) -> ServiceError:
    """A status received as its number (a batched call's CallStatus), as from_rpc_error gives it."""
    return _worker_error(_CODES.get(code, grpc.StatusCode.UNKNOWN), message, peer)


def _abort(context: grpc.ServicerContext, exc: BaseException):
    if not isinstance(exc, ServiceError):
        log.exception("unexpected error in %s", type(exc).__name__)
    elif exc.param:  # the request field at fault travels beside the message
        context.set_trailing_metadata(((PARAM_METADATA, exc.param),))
    context.abort(*status_of(exc))


def _wrap_unary(behavior):
    def wrapper(request, context):
        try:
            return behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - this is the one place errors become statuses
            if _is_abort(exc, context):
                raise
            _abort(context, exc)

    return wrapper


def _wrap_stream(behavior):
    def wrapper(request, context):
        try:
            yield from behavior(request, context)
        except Exception as exc:  # noqa: BLE001
            if _is_abort(exc, context):
                raise
            _abort(context, exc)

    return wrapper


def _is_abort(exc: Exception, context: grpc.ServicerContext) -> bool:
    # context.abort() raises a bare Exception after setting the status; let it through.
    return type(exc) is Exception and context.code() is not None


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps ServiceError to its status and anything else to INTERNAL, on every RPC."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
