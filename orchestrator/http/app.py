"""FrontDoor: the FastAPI app of the OpenAI-compatible door, its routes over a DecoderSlot
(orchestrator/servicer.py) and the admission queue the gRPC server uses too.

The decoder blocks, so each request runs on a thread of a pool sized like the gRPC server's; its
chunks reach the event loop through a queue. A client that disconnects sets a flag the thread
reads after every round: the decoder's generator is closed, and with it the request's sessions on
both workers. Bodies: schemas.py; answers: render.py; the ASGI guard in front: transport.py.
"""

from __future__ import annotations

import asyncio
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.admission import Admission, CallDeadline, client_key
from orchestrator.http.errors import OpenAIError, error_response, from_service_error
from orchestrator.http.render import Answer
from orchestrator.http.schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from orchestrator.http.transport import Guard, bearer
from orchestrator.servicer import without_addresses
from specdec.errors import ServiceError
from specdec.protocol import GenerationChunk, GenerationRequest
from specdec.security import TokenSet

_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")  # pydantic's name of a union's member in a loc


def _most_telling(errors: list[dict]) -> dict:
    """The error to report of those a body's validation raised: for a field that is a union
    (`stop`: a string or a list of them) each member reports one, and the member that got furthest
    (the list, too long) says more than the one whose type did not match (not a string)."""
    if not errors:
        return {"loc": (), "msg": "invalid request"}
    return max(reversed(errors), key=lambda e: (not e.get("type", "").endswith("_type"), len(e.get("loc", ()))))


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
        # the token and the body's size are checked before the app parses a byte of it (Guard)
        self.app = Guard(self._build(), self._tokens, max_body_bytes, body_timeout_s)

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
            body = {"status": "serving" if ok else "not serving"}
            # what it waits for, why it refuses, or what it serves without (this needs no token:
            # no worker's address in it)
            message = without_addresses(self.slot.status())
            return JSONResponse({**body, "message": message} if message else body, status_code=200 if ok else 503)

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
            ids = await asyncio.get_running_loop().run_in_executor(self._pool, decoder.checks.prompt, generation)
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
        token = bearer(dict(request.scope["headers"]))
        if token:  # the workers reuse cached prompt prefixes within one bearer token's requests only (as over gRPC)
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
