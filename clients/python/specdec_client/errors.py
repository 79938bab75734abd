"""Errors that carry their gRPC status.

A refused or failed call raises ServiceError (or one of its subclasses) whose .code is the
grpc.StatusCode. The server raises the very same classes (specdec.errors re-exports them), so
code that catches them works the same in-process and over the network.
"""

from __future__ import annotations

import grpc

PARAM_METADATA = "specdec-param"  # trailing metadata of a refused call: the request field at fault


def param_of(err: grpc.RpcError) -> str | None:
    """The request field a refused call names (PARAM_METADATA), or None."""
    try:
        metadata = err.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error raised before any call has none
        return None
    return next((value for key, value in metadata if key == PARAM_METADATA), None)


class ServiceError(Exception):
    """A request failed with a known gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    param: str | None = None  # a refused request: the GenerateRequest field at fault, where one is

    def __init__(self, message: str, code: grpc.StatusCode | None = None, param: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRange(ServiceError):
    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class Aborted(ServiceError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
