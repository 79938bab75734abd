"""The OpenAI-compatible HTTP front door of the orchestrator (`--http-port`).

    POST /v1/completions        prompt -> text (stream: server-sent events ending in `data: [DONE]`)
    POST /v1/chat/completions   messages -> an assistant message (the same, streamed)
    GET  /v1/models             the one model this orchestrator serves
    POST /tokenize              prompt or messages -> token ids, as the decoder would encode them
    GET  /health                200 while serving, 503 otherwise (no token needed)
    GET  /metrics               Prometheus text of the orchestrator's metrics, as vLLM serves it (no token needed)

It runs beside the gRPC server in the same process (uvicorn on a thread of its own) and feeds the
same decoder through the same admission queue: one decoding loop, one limit on requests running
and waiting. The decoder blocks, so each request runs on a thread of a pool sized like the gRPC
server's; its chunks reach the event loop through a queue. A client that disconnects sets a flag
the thread reads after every round: the decoder's generator is closed, and with it the
request's sessions on both workers.

Mapping to the decoder (orchestrator/decoder.py): max_tokens / max_completion_tokens ->
max_new_tokens (completions default to 16 as OpenAI's do; chat to as many as fit the context and
--max-new-tokens); temperature, top_p, seed, stop as they are; extensions, e.g. the openai SDK's
`extra_body`: `top_k` (0 or -1: off), `gamma` (drafts per round; 0 = the target alone) and
`sampling_mode` ("coupled", the default with a `seed`: the same answer for a seed whatever the
load or gamma; "rejection").
Every answer carries the speculative statistics in the extension field `specdec` (the last
chunk of a stream). Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import ssl
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Annotated, Any, AsyncIterator, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, model_validator

from orchestrator.admission import Admission, CallDeadline, client_key
from orchestrator import tools
from orchestrator.decoder import MAX_MESSAGES, MAX_N, MAX_STOP_STRINGS
from orchestrator.tools import MAX_TOOLS
from orchestrator.detokenizer import token_bytes
from specdec.errors import ServiceError, status_info
from specdec.protocol import (MAX_GAMMA, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, GenerationChunk,
                              GenerationRequest, GrammarSpec)
from specdec.security import ServerTls, TokenSet

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without a bearer token (load balancers, scrapers)

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Lengths a body's lists may have, checked before any item is validated: a 4 MiB body holds two
# million one-digit token ids or a quarter of a million messages, and validating each (worse: an
# error object for each) would hold the event loop for seconds. The served context is checked after;
# a chat's message count and its stop strings have the decoder's own limits.
MAX_PROMPT_IDS = 1 << 20
MAX_CONTENT_PARTS = 1 << 12
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "stop_token": "stop", "length": "length",
                  "tool_calls": "tool_calls"}


# ---- errors -------------------------------------------------------------------------------------


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


def _unencodable(value, path: str = "") -> str | None:
    """The path of the first string in a parsed JSON body that is not valid Unicode (a lone
    surrogate such as "\\ud800", which JSON's escapes allow and UTF-8 cannot encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _unencodable(key, path) or _unencodable(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):  # a list of numbers costs one test per item
                found = _unencodable(item, f"{path}.{i}" if path else str(i))
                if found:
                    return found
    return None


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")  # pydantic's name of a union's member in a loc


def _most_telling(errors: list[dict]) -> dict:
    """The error to report of those a body's validation raised: for a field that is a union
    (`stop`: a string or a list of them) each member reports one, and the member that got furthest
    (the list, too long) says more than the one whose type did not match (not a string)."""
    if not errors:
        return {"loc": (), "msg": "invalid request"}
    return max(reversed(errors), key=lambda e: (not e.get("type", "").endswith("_type"), len(e.get("loc", ()))))


def _prompt(value):
    """A completion's prompt: a string, a list of strings, or a list of token ids, told apart by
    their items in one pass (a union of list types would validate a list of two million ids as
    strings first, and build two million errors)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string, a list of strings or a list of token ids")
    if len(value) > MAX_PROMPT_IDS:
        raise ValueError(f"at most {MAX_PROMPT_IDS} token ids, got {len(value)}")
    if all(isinstance(x, str) for x in value):
        return value
    if all(type(x) is int for x in value):  # not bool, not float: a token id is an integer
        return value
    raise ValueError("a list must hold only strings or only token ids (integers)")


class _Body(BaseModel):
    """A request body: unknown fields ignored (as OpenAI's server does); text that UTF-8 cannot
    encode refused up front, naming where it is."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        where = _unencodable(data)
        if where is not None:
            raise OpenAIError(400, f"{where}: not valid Unicode text (a lone surrogate such as \\ud800)",
                              param=where)
        return data


# ---- request bodies -----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(_Body):
    """Fields both endpoints take."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM's): 0 or -1 = off
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    gamma: int | None = Field(None, ge=0, le=MAX_GAMMA)  # extension: drafts per round (0 = the target alone)
    sampling_mode: Literal["coupled", "rejection"] | None = None  # extension: how a seed's tokens are drawn
    # decoding controls, exact under speculation (specdec/sampling.py: apply_controls): OpenAI's
    # fields, then vLLM's extensions with vLLM's semantics
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=1e4)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    # vLLM's names (raw_logprobs, processed_logprobs) and this server's (raw, processed)
    logprobs_mode: Literal["raw", "processed", "raw_logprobs", "processed_logprobs"] | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise OpenAIError(400, f"n: must lie in [1, {MAX_N}], got {self.n}", param="n")

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's logit_bias: token ids as strings (JSON keys) to a bias in [-100, 100]."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise OpenAIError(400, f"logit_bias: {key[:32]!r} is not a token id", param="logit_bias")
            bias[int(key)] = value
        return bias

    def generation_kwargs(self) -> dict:
        kwargs: dict[str, Any] = {}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.top_k is not None:
            kwargs["top_k"] = max(0, self.top_k)
        if self.seed is not None:
            kwargs["seed"] = self.seed
        if self.gamma is not None:
            kwargs["gamma"] = self.gamma
        if self.sampling_mode is not None:
            kwargs["sampling_mode"] = self.sampling_mode
        if self.stop is not None:
            kwargs["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.logit_bias:
            kwargs["logit_bias"] = self._logit_bias()
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(self.stop_token_ids)
        if self.ignore_eos:
            kwargs["ignore_eos"] = True
        if self.n is not None:
            kwargs["n"] = self.n
        if self.logprobs_mode is not None:
            kwargs["logprobs_mode"] = self.logprobs_mode.removesuffix("_logprobs")
        spec = self.grammar()
        if spec is not None:
            kwargs["structured_output"] = spec
        return kwargs

    def openai_params(self) -> dict[str, str]:
        """OPENAI_PARAMS, with the output constraint under the name this body gave it."""
        if (self.response_format or {}).get("type", "text") != "text":
            return OPENAI_PARAMS
        return {**OPENAI_PARAMS, "structured_output": "structured_outputs"}

    def grammar(self) -> GrammarSpec | None:
        """The one output constraint the body asks for, by any of the names clients use."""
        asked = []
        rf = self.response_format or {}
        kind = rf.get("type", "text")
        if kind == "json_object":
            asked.append(("response_format", GrammarSpec("json_object")))
        elif kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise OpenAIError(400, "response_format: json_schema needs json_schema.schema, a JSON Schema object",
                                  param="response_format")
            asked.append(("response_format", GrammarSpec("json_schema", json.dumps(schema))))
        elif kind != "text":
            raise OpenAIError(400, f"response_format: type must be text, json_object or json_schema, got {kind!r}",
                              param="response_format")
        so = dict(self.structured_outputs or {})
        for name, value in (("json", self.guided_json), ("regex", self.guided_regex), ("choice", self.guided_choice),
                            ("grammar", self.guided_grammar)):
            if value is not None:
                so.setdefault(name, value)
        for name, value in so.items():
            if value is None or name in ("disable_any_whitespace", "disable_fallback", "whitespace_pattern"):
                continue  # vLLM's options: this server's JSON layout is fixed (specdec/grammar.py, JSON_LAYOUT)
            if name == "json":
                text = value if isinstance(value, str) else json.dumps(value)
                asked.append(("structured_outputs", GrammarSpec("json_schema", text)))
            elif name == "json_object":
                if value:
                    asked.append(("structured_outputs", GrammarSpec("json_object")))
            elif name == "regex" and isinstance(value, str):
                asked.append(("structured_outputs", GrammarSpec("regex", value)))
            elif name == "choice" and isinstance(value, list):
                asked.append(("structured_outputs", GrammarSpec("choice", json.dumps(value))))
            elif name == "grammar" and isinstance(value, str):
                asked.append(("structured_outputs", GrammarSpec("grammar", value)))
            else:
                raise OpenAIError(400, f"structured_outputs: {name!r} is not json, json_object, regex, choice or "
                                       f"grammar of the right type", param="structured_outputs")
        if len(asked) > 1:
            raise OpenAIError(400, "ask for one output constraint (response_format, structured_outputs or guided_*)",
                              param=asked[1][0])
        return asked[0][1] if asked else None


class CompletionRequest(_Common):
    prompt: Annotated[str | list[str] | list[int], PlainValidator(_prompt)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_generation(self) -> GenerationRequest:
        self.check_supported()
        if self.echo:
            raise OpenAIError(400, "echo: not supported", param="echo")
        if self.best_of not in (None, 1):
            raise OpenAIError(400, "best_of: only 1 is supported", param="best_of")
        if self.suffix:
            raise OpenAIError(400, "suffix: not supported", param="suffix")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise OpenAIError(400, "prompt: one prompt per request", param="prompt")
            prompt = prompt[0]
        source = {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": list(prompt)}
        max_new = self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return GenerationRequest(**source, max_new_tokens=max_new, **self.generation_kwargs(),
                                 logprobs=self.logprobs is not None, top_logprobs=self.logprobs or 0)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_dict(self, index: int) -> dict:
        """As chat templates take it; a developer message is a system one."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text(index)}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(400, f"messages[{index}].content: only text parts are supported, got "
                                       f"'{part.type}'", param=f"messages[{index}].content")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # False: "required" makes exactly one call

    def to_generation(self) -> GenerationRequest:
        self.check_supported()
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs: needs logprobs true", param="top_logprobs")
        if not self.messages:
            raise OpenAIError(400, "messages: at least one message is required", param="messages")
        messages = [m.to_dict(i) for i, m in enumerate(self.messages)]
        max_new = self.max_completion_tokens or self.max_tokens  # None: as many as fit
        if self.tool_choice is not None and not isinstance(self.tool_choice, str) and \
                not isinstance((self.tool_choice.get("function") or {}).get("name"), str):
            raise OpenAIError(400, "tool_choice: none, auto, required or {'type': 'function', 'function': "
                                   "{'name': ...}}", param="tool_choice")
        return GenerationRequest(messages=messages, max_new_tokens=max_new, **self.generation_kwargs(),
                                 logprobs=self.logprobs, top_logprobs=self.top_logprobs or 0,
                                 tools=tuple(self.tools or ()), tool_choice=self.tool_choice,
                                 parallel_tool_calls=self.parallel_tool_calls is not False)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None


# ---- the front door -----------------------------------------------------------------------------


class _Call:
    """An HTTP request as the admission queue sees a gRPC call: is its client still there. It
    has no deadline of its own (HTTP clients send none): CallDeadline gives it the server's."""

    def __init__(self):
        self.gone = threading.Event()

    def is_active(self) -> bool:
        return not self.gone.is_set()

    def time_remaining(self) -> float | None:
        return None


_END = object()


class FrontDoor:
    """The FastAPI app over a DecoderSlot (orchestrator/servicer.py) and its admission queue."""

    def __init__(self, slot, admission: Admission, *, tokens: "TokenSet | frozenset[str]" = frozenset(),
                 served_model_name: str | None = None, serving: Callable[[], bool] = lambda: True,
                 request_timeout_s: float = 0.0, max_body_bytes: int = 4 * 1024 * 1024, body_timeout_s: float = 30.0,
                 metrics_registry=None):
        self.slot, self.admission = slot, admission
        self._metrics = metrics_registry  # a prometheus_client registry: GET /metrics (None: 404)
        self._tokens = tokens if isinstance(tokens, TokenSet) else TokenSet(tokens)
        self._served_name = served_model_name
        self._serving = serving
        self.request_timeout_s = request_timeout_s
        # every running and every queued request holds a thread; the admission queue refuses the rest
        self._pool = ThreadPoolExecutor(max_workers=admission.max_running + admission.max_queued + 4,
                                        thread_name_prefix="http")
        # the token and the body's size are checked before the app parses a byte of it (_Guard)
        self.app = _Guard(self._build(), self._tokens, max_body_bytes, body_timeout_s)

    @property
    def model_name(self) -> str:
        decoder = self.slot.get()
        return self._served_name or decoder.target_info.model_name

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- plumbing --


    def _check_model(self, model: str | None) -> None:
        name = self.model_name
        if model is not None and model != name:
            raise OpenAIError(404, f"the model '{model}' does not exist; this server serves '{name}'",
                              param="model", code="model_not_found")

    async def _chunks(self, generation: GenerationRequest, call: _Call,
                      client: str = "") -> AsyncIterator[GenerationChunk]:
        """The decoder's chunks, produced on a pool thread; closing this iterator (the client
        left, or the response ended) stops that thread within one round."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (server stopping): nobody reads any more
                call.gone.set()

        def produce() -> None:
            try:
                decoder = self.slot.get()
                deadline = CallDeadline(call, self.request_timeout_s)
                with self.admission.slot(deadline, client):
                    stream = decoder.generate_stream(generation)
                    try:
                        for chunk in stream:
                            put(chunk)
                            if call.gone.is_set():
                                return
                            if chunk.finish_reason is None:
                                deadline.check()
                    finally:
                        stream.close()  # closes the request's sessions when it stopped early
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop
                put(exc)
            else:
                put(_END)

        self._pool.submit(produce)
        finished = 0
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                finished += item.finish_reason is not None
                if finished == generation.n:  # every choice has ended
                    return
        finally:
            call.gone.set()

    async def _first(self, chunks: AsyncIterator[GenerationChunk], params: dict[str, str]) -> GenerationChunk:
        """The first chunk, so that a refusal (bad input, full, not ready) is an HTTP status,
        not an event in a stream already begun."""
        try:
            return await chunks.__anext__()
        except ServiceError as exc:
            raise from_service_error(exc, params) from None

    async def _collect(self, request: Request, chunks: AsyncIterator[GenerationChunk],
                       call: _Call, params: dict[str, str]) -> list[GenerationChunk]:
        """Every chunk of a non-streamed answer, watching for the client leaving meanwhile."""
        async def drain():
            return [chunk async for chunk in chunks]

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    call.gone.set()
                    task.cancel()
                    raise OpenAIError(499, "the client disconnected", "cancelled")
        except ServiceError as exc:
            raise from_service_error(exc, params) from None

    # -- endpoints --

    def _build(self) -> FastAPI:
        # no redirect from /path/ to /path: a client gets a 404 in OpenAI's shape instead of a 307
        app = FastAPI(title="specdec OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                      redirect_slashes=False)

        @app.exception_handler(OpenAIError)
        async def openai_error(request: Request, exc: OpenAIError):
            return error_response(exc)

        @app.exception_handler(ServiceError)
        async def service_error(request: Request, exc: ServiceError):
            return error_response(from_service_error(exc))

        @app.exception_handler(StarletteHTTPException)
        async def framework_error(request: Request, exc: StarletteHTTPException):
            """The framework's own refusals (no such path, a wrong method, a body it cannot
            parse), in OpenAI's shape as the rest."""
            if exc.status_code == 404:
                message = f"Invalid URL ({request.method} {request.url.path})"
            elif exc.status_code == 405:
                message = f"{request.method} is not allowed on {request.url.path}"
            elif exc.status_code == 400:
                message = "body: could not be parsed as JSON (invalid UTF-8, or nested too deeply)"
            else:
                message = str(exc.detail)
            return error_response(OpenAIError(exc.status_code, message, code=None))

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError):
            first = _most_telling(exc.errors())
            if first.get("type") == "json_invalid":  # the position is not a field
                where = first.get("loc", ("body", "?"))[-1]
                reason = (first.get("ctx") or {}).get("error", "invalid")
                return error_response(OpenAIError(400, f"body: not valid JSON ({reason} at character {where})"))
            loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
            param = ".".join(loc) or None
            return error_response(OpenAIError(400, f"{param or 'body'}: {first.get('msg')}", param=param))

        @app.get("/health")
        async def health():
            ok = self._serving() and self.slot.decoder is not None
            return JSONResponse({"status": "serving" if ok else "not serving"}, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def prometheus_metrics():
            if self._metrics is None:
                raise OpenAIError(404, "metrics are off (the server runs with OTEL_SDK_DISABLED=true)",
                                  code="not_found")
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return Response(generate_latest(self._metrics), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models(request: Request):
            decoder = self.slot.get()
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "specdec", "max_model_len": decoder.max_context}]}

        @app.post("/tokenize")
        async def tokenize(body: TokenizeRequest, request: Request):
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise OpenAIError(400, "give exactly one of prompt or messages", param="prompt")
            generation = GenerationRequest(prompt=body.prompt) if body.prompt is not None else GenerationRequest(
                messages=[{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)])
            decoder = self.slot.get()
            ids = await asyncio.get_running_loop().run_in_executor(self._pool, decoder.encode, generation)
            return {"tokens": ids, "count": len(ids), "max_model_len": decoder.max_context}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self._answer(body, request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request):
            return await self._answer(body, request, chat=True)

        return app

    async def _answer(self, body: CompletionRequest | ChatCompletionRequest, request: Request, chat: bool):
        self._check_model(body.model)
        generation = body.to_generation()
        call = _Call()
        token = _bearer(dict(request.scope["headers"])) if self._tokens else None
        if token:  # the workers reuse cached prompt prefixes within one bearer token's requests only
            generation = replace(generation, cache_scope=client_key(token, ""))
        chunks = self._chunks(generation, call, client_key(token, f"http:{request.client.host if request.client else ''}"))
        params = body.openai_params()
        first = await self._first(chunks, params)
        answer = Answer(chat, self.model_name, self.slot.get().tokenizer if generation.logprobs else None,
                        calling=chat and bool(generation.tools) and generation.tool_choice != "none", n=generation.n,
                        names={t["function"]["name"] for t in generation.tools} or None, params=params)
        if not body.stream:
            if first.finish_reason and generation.n == 1:
                await chunks.aclose()
                return answer.whole([first])
            return answer.whole([first, *await self._collect(request, chunks, call, params)])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(answer.events(first, chunks, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class Answer:
    """Chunks -> OpenAI response bodies: one whole object, or server-sent events."""

    def __init__(self, chat: bool, model: str, tokenizer=None, calling: bool = False, n: int = 1,
                 names: set[str] | None = None, params: dict[str, str] = OPENAI_PARAMS):
        """tokenizer: the request asked for logprobs (token strings come from it); calling: the
        model may call tools (a stream holds their blocks back; names: the tools, for bare JSON
        calls); n: choices; params: the request's OpenAI names of fields (an error event names one)."""
        self.chat, self.model, self.tokenizer, self.n = chat, model, tokenizer, n
        self.params = params
        self.held = {i: tools.HeldText(names) for i in range(n)} if calling else None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offset = 0  # completions' logprobs.text_offset, across chunks
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        """(token text, its bytes): the text of a partial UTF-8 character shows U+FFFD."""
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = token_bytes(self.tokenizer, token_id)
            piece = self._pieces[token_id] = (raw.decode(errors="replace"), list(raw))
        return piece

    def _token(self, token_id: int) -> str:
        return self._piece(token_id)[0]

    def logprobs(self, chunks: list[GenerationChunk]) -> dict | None:
        """OpenAI's logprobs object for these chunks' tokens (None: not asked for)."""
        if self.tokenizer is None:
            return None
        items = [lp for c in chunks for lp in c.logprobs or ()]
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict:
                token, raw = self._piece(token_id)
                return {"token": token, "logprob": _finite(logprob), "bytes": raw}
            return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, x) for t, x in lp.top]}
                                for lp in items]}
        tokens = [self._token(lp.token_id) for lp in items]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in items],
                "top_logprobs": [{self._token(t): _finite(x) for t, x in lp.top} for lp in items],
                "text_offset": offsets}

    @staticmethod
    def usage(*stats) -> dict:
        """Every choice's tokens; the prompt once (the choices share its prefill)."""
        completion = sum(s.generated_tokens for s in stats)
        return {"prompt_tokens": stats[0].prompt_tokens, "completion_tokens": completion,
                "total_tokens": stats[0].prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": stats[0].cached_tokens}}

    def whole(self, chunks: list[GenerationChunk]) -> dict:
        by_choice: dict[int, list[GenerationChunk]] = {}
        for c in chunks:
            by_choice.setdefault(c.index, []).append(c)
        choices, lasts = [], []
        for index, mine in sorted(by_choice.items()):
            last = mine[-1]
            lasts.append(last)
            text = "".join(c.text_delta for c in mine)
            finish = FINISH_REASONS.get(last.finish_reason, last.finish_reason)
            if self.chat:
                message = {"role": "assistant", "content": text}
                if last.tool_calls:  # the calls leave the content (OpenAI's shape)
                    names = {c["function"]["name"] for c in last.tool_calls}
                    message = {"role": "assistant", "content": tools.parse(text, names)[0],
                               "tool_calls": last.tool_calls}
                choices.append({"index": index, "message": message, "logprobs": self.logprobs(mine),
                                "finish_reason": finish})
            else:
                choices.append({"index": index, "text": text, "logprobs": self.logprobs(mine), "finish_reason": finish})
        stats = [last.stats for last in lasts]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage(*stats),
                "specdec": stats[0].to_dict() if len(stats) == 1 else [s.to_dict() for s in stats]}

    def _event(self, choices: list, **extra) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, **extra}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _choice(self, chunk: GenerationChunk, first: bool) -> dict:
        finish = FINISH_REASONS.get(chunk.finish_reason, chunk.finish_reason) if chunk.finish_reason else None
        if self.chat:
            text = chunk.text_delta
            if self.held is not None:  # tools: a call's block is held back, sent as tool_calls at the end
                held = self.held[chunk.index]
                text = held.add(text)
                if chunk.finish_reason is not None:
                    text += held.finish()[0]
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if chunk.tool_calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(chunk.tool_calls)]
            return {"index": chunk.index, "delta": delta, "logprobs": self.logprobs([chunk]), "finish_reason": finish}
        return {"index": chunk.index, "text": chunk.text_delta, "logprobs": self.logprobs([chunk]),
                "finish_reason": finish}

    async def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk],
                     include_usage: bool) -> AsyncIterator[str]:
        chunk, started, finished = first, set(), []
        try:
            while True:
                last = chunk.finish_reason is not None
                extra = {"specdec": chunk.stats.to_dict()} if last and chunk.stats is not None else {}
                if include_usage:
                    extra["usage"] = None  # OpenAI: every chunk has usage null but the last
                yield self._event([self._choice(chunk, chunk.index not in started)], **extra)
                started.add(chunk.index)
                if last:
                    finished.append(chunk.stats)
                    if len(finished) == self.n:
                        break
                chunk = await rest.__anext__()
            if include_usage:
                yield self._event([], usage=self.usage(*finished))
        except StopAsyncIteration:  # the producer ended without a final chunk: not expected
            pass
        except ServiceError as exc:  # after the stream began: an error event, then [DONE]
            yield f"data: {json.dumps(from_service_error(exc, self.params).body())}\n\n"
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"


class _Guard:
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
        if self.tokens and scope["path"] not in OPEN_PATHS and not self.tokens.holds(_bearer(headers)):
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


def _bearer(headers: dict) -> bytes | None:
    header = headers.get(b"authorization", b"").decode("latin-1")
    return header[len("Bearer "):].strip().encode("latin-1") if header.startswith("Bearer ") else None


def _finite(logprob: float) -> float:
    """JSON has no -inf; OpenAI reports an impossible token as -9999.0."""
    return max(logprob, -9999.0)


# ---- the server ---------------------------------------------------------------------------------


LINGER_S = 2.0  # how long a connection refused as unparseable goes on being read (and dropped) before it closes


def _door_protocol(head_timeout_s: float):
    """uvicorn's h11 protocol, letting go of a connection whose request head (request line and
    headers) is not complete head_timeout_s after it opened or after its last answer (0: never),
    so a client that sends nothing, or half its headers, no longer holds a connection for ever;
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


class HttpServer:
    """uvicorn serving a FrontDoor on a thread of its own; bind first, so port 0 works. Slow
    clients are let go: a request head must arrive within head_timeout_s (and each piece of a
    body within the door's body timeout); beyond max_connections open connections a request gets
    503."""

    def __init__(self, door: FrontDoor, host: str, port: int, tls: ServerTls | None = None,
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
