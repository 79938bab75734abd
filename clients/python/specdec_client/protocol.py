"""The records a client of the orchestrator receives, and their proto converters.

request_to_proto builds a GenerateRequest from keyword arguments; result_from_proto and
chunk_from_proto turn the answers into GenerationResult and GenerationChunk. The server
(specdec/protocol.py) uses these same definitions, with its own server-side records beside them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from specdec_client.errors import InvalidArgument
from specdec_client.v1 import orchestrator_pb2

# Prompts to the orchestrator are small next to the worker hop's distributions, but a 128k-token
# prompt of int32 ids still needs ~0.7 MB.
CLIENT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def message_options(limit: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target model (its raw logits, temperature
    1), and the most likely tokens at its position with theirs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_proto(self) -> orchestrator_pb2.TokenLogprob:
        return orchestrator_pb2.TokenLogprob(token_id=self.token_id, logprob=self.logprob,
                                             top_token_ids=[t for t, _ in self.top],
                                             top_logprobs=[lp for _, lp in self.top])

    @classmethod
    def from_proto(cls, msg: orchestrator_pb2.TokenLogprob) -> "TokenLogprob":
        return cls(msg.token_id, msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs)))


@dataclass
class GenerationChunk:
    text_delta: str
    token_ids: list[int]
    finish_reason: str | None = None  # "length", "eos", "stop_string", "stop_token" or "tool_calls" on the last chunk
    # on the last chunk: a dict on the client side (the server's own chunks carry GenerationStats)
    stats: Any = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    tool_calls: list[dict] | None = None  # the last chunk, with tools: OpenAI-shaped calls
    index: int = 0  # the choice it belongs to (a request with n > 1)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    # with tools: the calls the model made, OpenAI-shaped:
    # {"id": ..., "type": "function", "function": {"name": ..., "arguments": JSON text}}
    tool_calls: list[dict] | None = None
    choices: list["GenerationResult"] | None = None  # n > 1: every choice, in index order (this one is choice 0)


FINISH_REASONS = {
    "length": orchestrator_pb2.FINISH_REASON_LENGTH,
    "eos": orchestrator_pb2.FINISH_REASON_EOS,
    "stop_string": orchestrator_pb2.FINISH_REASON_STOP_STRING,
    "stop_token": orchestrator_pb2.FINISH_REASON_STOP_TOKEN,
    "tool_calls": orchestrator_pb2.FINISH_REASON_TOOL_CALLS,
}
FINISH_NAMES = {code: name for name, code in FINISH_REASONS.items()}
REQUEST_SCALARS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "gamma", "logprobs", "top_logprobs", "n",
                   "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "min_tokens", "ignore_eos",
                   "logprobs_mode", "parallel_tool_calls", "sampling_mode")
SAMPLING_MODES = {"rejection": orchestrator_pb2.SAMPLING_MODE_REJECTION, "coupled": orchestrator_pb2.SAMPLING_MODE_COUPLED}
SAMPLING_MODE_NAMES = {code: name for name, code in SAMPLING_MODES.items()}


STRUCTURED_OUTPUTS = ("json_schema", "json_object", "regex", "choice", "grammar")


def _structured_output(msg: orchestrator_pb2.StructuredOutput, spec: dict) -> None:
    """{"json_schema": dict or JSON text} | {"json_object": True} | {"regex": str} |
    {"choice": [str, ...]} | {"grammar": Lark or GBNF text}: exactly one key."""
    if len(spec) != 1 or next(iter(spec)) not in STRUCTURED_OUTPUTS:
        raise InvalidArgument(f"structured_output takes exactly one of {', '.join(STRUCTURED_OUTPUTS)}")
    (kind, value), = spec.items()
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choice":
        msg.choice.choices.extend(value)
    else:
        setattr(msg, kind, value)


def request_to_proto(
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    token_ids: Sequence[int] | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    logit_bias: dict[int, float] | None = None,
    structured_output: dict | None = None,
    tools: Sequence[dict] = (),
    tool_choice: str | dict | None = None,
    **scalars,
) -> orchestrator_pb2.GenerateRequest:
    """The request message; scalars left None take the server's defaults. Values protobuf
    cannot hold raise InvalidArgument, as the server would."""
    if sum(x is not None for x in (prompt, messages, token_ids)) > 1:
        raise InvalidArgument("give exactly one of prompt, messages or token_ids")
    unknown = set(scalars) - set(REQUEST_SCALARS)
    if unknown:
        raise TypeError(f"unexpected request fields: {sorted(unknown)}")
    try:
        req = orchestrator_pb2.GenerateRequest(stop=list(stop), stop_token_ids=list(stop_token_ids))
        for token, bias in (logit_bias or {}).items():
            req.logit_bias[int(token)] = bias
        if structured_output:
            _structured_output(req.structured_output, structured_output)
        if prompt is not None:
            req.prompt = prompt
        if messages is not None:
            req.chat.messages.extend(orchestrator_pb2.ChatMessage(
                role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id") or "",
                tool_calls=[tool_call_to_proto(c) for c in m.get("tool_calls") or ()]) for m in messages)
            req.chat.SetInParent()
        for tool in tools:  # OpenAI's shape: {"type": "function", "function": {"name", "description", "parameters"}}
            fn = tool.get("function", tool)
            req.tools.add(name=fn["name"], description=fn.get("description", ""),
                          parameters_json=json.dumps(fn["parameters"]) if fn.get("parameters") else "")
        if tool_choice is not None:
            req.tool_choice = tool_choice if isinstance(tool_choice, str) else tool_choice["function"]["name"]
        if token_ids is not None:
            req.tokens.token_ids.extend(token_ids)
            req.tokens.SetInParent()
        for name, value in scalars.items():
            if name == "sampling_mode" and value is not None:
                if value not in SAMPLING_MODES:
                    raise InvalidArgument(f"sampling_mode must be one of {sorted(SAMPLING_MODES)}, got {value!r}")
                value = SAMPLING_MODES[value]
            if value is not None:
                setattr(req, name, value)
    except (ValueError, TypeError) as exc:  # e.g. a negative seed or a token id beyond int32
        raise InvalidArgument(f"invalid request: {exc}") from None
    return req


def tool_call_to_proto(call: dict) -> orchestrator_pb2.ToolCall:
    """An OpenAI-shaped call ({"id", "function": {"name", "arguments"}}) as a ToolCall."""
    fn = call["function"]
    args = fn.get("arguments", "{}")
    return orchestrator_pb2.ToolCall(id=call.get("id", ""), name=fn["name"],
                                     arguments_json=args if isinstance(args, str) else json.dumps(args))


def tool_call_from_proto(msg: orchestrator_pb2.ToolCall) -> dict:
    return {"id": msg.id, "type": "function", "function": {"name": msg.name, "arguments": msg.arguments_json}}


def stats_from_proto(msg: orchestrator_pb2.GenerationStats) -> dict:
    return {f.name: list(getattr(msg, f.name)) if f.is_repeated else getattr(msg, f.name)
            for f in msg.DESCRIPTOR.fields}


def chunk_from_proto(msg: orchestrator_pb2.GenerateChunk) -> GenerationChunk:
    last = msg.HasField("stats")
    return GenerationChunk(msg.text_delta, list(msg.token_ids), FINISH_NAMES.get(msg.finish_reason) if last else None,
                           stats_from_proto(msg.stats) if last else None,
                           [TokenLogprob.from_proto(lp) for lp in msg.logprobs] or None,
                           [tool_call_from_proto(c) for c in msg.tool_calls] or None, msg.index)


def result_from_proto(msg) -> GenerationResult:
    """A GenerateResponse (or one of its Choices) as a GenerationResult."""
    return GenerationResult(msg.text, list(msg.token_ids), FINISH_NAMES.get(msg.finish_reason, ""),
                            stats_from_proto(msg.stats), [TokenLogprob.from_proto(lp) for lp in msg.logprobs] or None,
                            [tool_call_from_proto(c) for c in msg.tool_calls] or None,
                            [result_from_proto(c) for c in msg.choices] if getattr(msg, "choices", None) else None)
