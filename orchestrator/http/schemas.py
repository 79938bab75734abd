"""The request bodies of the OpenAI-compatible door, as pydantic records, and their translation
into the decoder's GenerationRequest (the parameters OpenAI's and vLLM's clients send, by their
names; what this server does not support is refused with the field it concerns). What the
fields may hold beyond their shape (n, logprobs, the context, the vocabulary, ...) the decoder
checks for both doors (orchestrator/validation.py); its refusals come back by OpenAI's names
(errors.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, model_validator

from orchestrator.validation import MAX_MESSAGES, MAX_STOP_STRINGS
from orchestrator.http.errors import OPENAI_PARAMS, OpenAIError
from orchestrator.tool_calls import MAX_TOOLS
from specdec.protocol import (MAX_GAMMA, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, GenerationRequest,
                              GrammarSpec)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Lengths a body's lists may have, checked before any item is validated: a 4 MiB body holds two
# million one-digit token ids or a quarter of a million messages, and validating each (worse: an
# error object for each) would hold the event loop for seconds. The served context is checked after;
# a chat's message count and its stop strings have the decoder's own limits.
MAX_PROMPT_IDS = 1 << 20
MAX_CONTENT_PARTS = 1 << 12


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
    sampling_mode: Literal["coupled", "rejection"] | None = None  # extension: how a sampled request draws its tokens
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
