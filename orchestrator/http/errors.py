"""Errors in OpenAI's shape {"error": {"message", "type", "param", "code"}}, and the one mapping
from a ServiceError (its HTTP status and OpenAI type come from specdec/errors.py's table)."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from specdec.errors import ServiceError, status_info


class OpenAIError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# a GenerateRequest field (ServiceError.param) -> the name an OpenAI client knows it by, where they differ
OPENAI_PARAMS = {"max_new_tokens": "max_tokens", "chat": "messages", "token_ids": "prompt",
                 "structured_output": "response_format"}


def from_service_error(exc: ServiceError, params: dict[str, str] = OPENAI_PARAMS) -> OpenAIError:
    """The OpenAI error of a ServiceError: status and type from specdec/errors.py's table, param
    the field the error names (params: this request's OpenAI names for GenerateRequest fields)."""
    status = status_info(exc.code)
    param = params.get(exc.param, exc.param) if exc.param else None
    return OpenAIError(status.http, exc.message, status.openai_type, param, exc.code.name.lower())


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII characters escaped: an error message quoting the client's text
    encodes whatever that text holds."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(err: OpenAIError) -> JSONResponse:
    return _AsciiJSON(err.body(), status_code=err.status)
