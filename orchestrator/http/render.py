"""The decoder's chunks as OpenAI response bodies: one whole object, or server-sent events
(text, tool calls held back until they parse, logprobs, usage and the `specdec` statistics)."""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from orchestrator import tool_calls
from orchestrator.detokenizer import token_bytes
from orchestrator.http.errors import OPENAI_PARAMS, from_service_error
from specdec.errors import ServiceError
from specdec.protocol import GenerationChunk

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "stop_token": "stop", "length": "length",
                  "tool_calls": "tool_calls"}


class Answer:
    """Chunks -> OpenAI response bodies: one whole object, or server-sent events."""

    def __init__(self, chat: bool, model: str, tokenizer=None, calling: bool = False, n: int = 1,
                 names: set[str] | None = None, params: dict[str, str] = OPENAI_PARAMS):
        """tokenizer: the request asked for logprobs (token strings come from it); calling: the
        model may call tools (a stream holds their blocks back; names: the tools, for bare JSON
        calls); n: choices; params: the request's OpenAI names of fields (an error event names one)."""
        self.chat, self.model, self.tokenizer, self.n = chat, model, tokenizer, n
        self.params = params
        self.held = {i: tool_calls.HeldText(names) for i in range(n)} if calling else None
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
                    message = {"role": "assistant", "content": tool_calls.parse(text, names)[0],
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


def _finite(logprob: float) -> float:
    """JSON has no -inf; OpenAI reports an impossible token as -9999.0."""
    return max(logprob, -9999.0)
