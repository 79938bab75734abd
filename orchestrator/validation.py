"""What a request may ask, checked once for both doors.

The gRPC servicer (orchestrator/servicer.py) and the HTTP API (orchestrator/http/) both hand the
decoder a GenerationRequest; the decoder checks it here before any worker holds a session:
`RequestChecks.prompt` (its size, then its prompt as token ids) and `RequestChecks.params` (every
other field, against the model and this server's limits). Each refusal is an InvalidArgument
naming its field: gRPC INVALID_ARGUMENT, HTTP 400 with that `param`. The HTTP schemas parse
OpenAI's shapes and take their bounds from the same constants.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from orchestrator import tool_calls
from specdec.errors import InvalidArgument
from specdec.protocol import (LOGPROBS_MODES, MAX_GAMMA, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, SAMPLING_MODES,
                              GenerationRequest, RequestLimits, SamplingParams)

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: the detokenizer holds back that much text each round
MAX_MESSAGES = 1024
MAX_ROLE_CHARS = 64
MAX_N = 16  # choices per request


class RequestChecks:
    """The checks of one decoder: its model's vocabulary, context and chat template, its limits,
    and whether it has a draft."""

    def __init__(self, tokenizer, *, vocab_size: int, max_context: int, limits: RequestLimits, eos: frozenset[int],
                 has_draft: bool, model_name: str, grammar_compiler: Callable):
        self.tokenizer, self.vocab_size, self.max_context, self.limits = tokenizer, vocab_size, max_context, limits
        self.eos, self.has_draft, self.model_name = eos, has_draft, model_name
        self.grammar_compiler = grammar_compiler  # the decoder's (made once, in the background)
        self._tool_tags = tool_calls.tag_ids(tokenizer)  # <tool_call> as one token, where the model has one
        self._max_token_chars = max(map(len, tokenizer.get_vocab()), default=1) or 1

    def sizes(self, request: GenerationRequest) -> None:
        """What a request may hold, checked before any work that grows with it (tokenizing,
        the chat template, the detokenizer's stop search)."""
        if len(request.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in request.stop):
            raise InvalidArgument(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                                  f"{MAX_STOP_CHARS} characters", param="stop")
        if request.messages is not None:
            if len(request.messages) > MAX_MESSAGES:
                raise InvalidArgument(f"chat has {len(request.messages)} messages; at most {MAX_MESSAGES}",
                                      param="chat")
            for i, m in enumerate(request.messages):
                if not 1 <= len(str(m.get("role", ""))) <= MAX_ROLE_CHARS:
                    raise InvalidArgument(f"chat message {i}: its role must have 1 to {MAX_ROLE_CHARS} characters",
                                          param="chat")

    def prompt(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as token ids (its text tokenized, its chat through the model's template),
        refused where it is malformed or cannot fit."""
        given = [x is not None for x in (request.prompt, request.messages, request.token_ids)]
        if sum(given) != 1:
            raise InvalidArgument("give exactly one of prompt, chat messages or token ids")
        self.sizes(request)
        if request.prompt is not None:
            if not request.prompt:
                raise InvalidArgument("prompt is empty", param="prompt")
            self._text_fits(len(request.prompt))
            ids = self.tokenizer(request.prompt).input_ids
        elif request.messages is not None:
            if not request.messages:
                raise InvalidArgument("chat has no messages", param="chat")
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidArgument(f"model '{self.model_name}' has no chat template; send a prompt",
                                      param="chat")
            self._text_fits(sum(len(str(m.get("content", ""))) + len(str(m.get("role", "")))
                                      for m in request.messages))
            try:
                text = self.tokenizer.apply_chat_template(tool_calls.template_messages(list(request.messages)),
                                                          tools=list(request.tools) or None, tokenize=False,
                                                          add_generation_prompt=True)
            except Exception as exc:  # jinja2 errors: e.g. a template that demands alternating roles
                raise InvalidArgument(f"the chat template refused these messages: {exc}", param="chat") from None
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        else:
            limit = min(self.max_context, self.limits.max_prompt_tokens or self.max_context)
            if len(request.token_ids) > limit:  # before touching each id: a list may hold millions
                why = ("--max-prompt-tokens" if limit < self.max_context else f"context {self.max_context}")
                raise InvalidArgument(f"the prompt has {len(request.token_ids)} token ids; at most {limit} fit ({why})",
                                      param="token_ids")
            ids = [int(t) for t in request.token_ids]
            if not ids:
                raise InvalidArgument("token_ids is empty", param="token_ids")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                      param="token_ids")
        if not ids:
            raise InvalidArgument("the prompt encodes to no tokens", param="prompt")
        return list(ids)

    def _text_fits(self, chars: int) -> None:
        """Refuses text that cannot fit the context before tokenizing it (which costs seconds and
        gigabytes for a prompt near the 16 MiB message limit): a token covers at most as many
        characters as its longest vocabulary entry, so the text needs at least chars / that."""
        limit = min(self.max_context, self.limits.max_prompt_tokens or self.max_context)
        if chars > limit * self._max_token_chars:
            raise InvalidArgument(f"a prompt of {chars} characters needs at least {chars // self._max_token_chars} "
                                  f"tokens; at most {limit} fit (context {self.max_context})", param="prompt")

    def params(self, request: GenerationRequest, prompt_len: int) -> SamplingParams:
        """The request's sampling parameters once every field is checked, with what the decoding
        controls need of the prompt; a tool choice that constrains the output becomes its grammar."""
        params = request.sampling.validate()
        if not 0 <= request.gamma <= MAX_GAMMA:
            raise InvalidArgument(f"gamma must lie in [0, {MAX_GAMMA}] (0 = no speculation), got {request.gamma}",
                                  param="gamma")
        if request.max_new_tokens <= 0:
            raise InvalidArgument(f"max_new_tokens must be > 0, got {request.max_new_tokens}", param="max_new_tokens")
        if prompt_len + request.max_new_tokens > self.max_context:
            raise InvalidArgument(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the context "
                f"of {self.max_context} tokens"
            , param="max_new_tokens")
        if request.max_new_tokens > self.limits.max_new_tokens:
            raise InvalidArgument(f"max_new_tokens {request.max_new_tokens} exceeds this server's limit of "
                                  f"{self.limits.max_new_tokens} (--max-new-tokens)", param="max_new_tokens")
        if self.limits.max_prompt_tokens and prompt_len > self.limits.max_prompt_tokens:
            raise InvalidArgument(f"the prompt has {prompt_len} tokens; this server accepts at most "
                                  f"{self.limits.max_prompt_tokens} (--max-prompt-tokens)", param="prompt")
        if request.seed is not None and not -(2**63) <= request.seed < 2**64:
            raise InvalidArgument(f"seed must lie in [-2**63, 2**64 - 1], got {request.seed}", param="seed")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}",
                                  param="top_logprobs")
        if request.sampling_mode is not None and request.sampling_mode not in SAMPLING_MODES:
            raise InvalidArgument(f"sampling_mode must be one of {sorted(SAMPLING_MODES)}, got {request.sampling_mode!r}",
                                  param="sampling_mode")
        if request.top_logprobs and not request.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs", param="top_logprobs")
        if request.gamma > 0 and not self.has_draft:
            raise InvalidArgument("this orchestrator has no draft worker; use gamma 0", param="gamma")
        if request.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidArgument(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {request.logprobs_mode!r}",
                                  param="logprobs_mode")
        if not 1 <= request.n <= MAX_N:
            raise InvalidArgument(f"n (choices) must lie in [1, {MAX_N}], got {request.n}", param="n")
        if not 0 <= request.min_tokens <= request.max_new_tokens:
            raise InvalidArgument(f"min_tokens must lie in [0, max_new_tokens = {request.max_new_tokens}], "
                                  f"got {request.min_tokens}", param="min_tokens")
        if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(f"stop_token_ids has {len(request.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
                                  param="stop_token_ids")
        bad = [t for t in request.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.vocab_size})", param="stop_token_ids")
        params.check_vocabulary(self.vocab_size)
        if request.tools or request.tool_choice is not None:
            if request.messages is None:
                raise InvalidArgument("tools need a chat (messages), not a prompt", param="tools")
            tool_calls.check_tools(request.tools, request.tool_choice)
            constraint = tool_calls.grammar(request.tools, request.tool_choice, self._tool_tags,
                                       parallel=request.parallel_tool_calls)
            if constraint is not None:
                if params.grammar is not None:
                    raise InvalidArgument("tool_choice required or a named tool constrains the output already; "
                                          "drop structured_output", param="tool_choice")
                params = replace(params, grammar=constraint)
        if params.grammar is not None:  # the engine's refusal now, before any worker holds a session
            self.grammar_compiler().compile(params.grammar)
        # what the controls need of the prompt and the model: where the output starts (penalties,
        # min_tokens) and the tokens min_tokens holds back
        stops = sorted({*request.stop_token_ids, *(() if request.ignore_eos else self.eos)})
        return replace(params, output_start=prompt_len, stop_token_ids=tuple(stops) if request.min_tokens else ())
