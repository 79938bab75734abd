"""The client-facing records: what a request carries and what comes back, with their proto converters.

Client <-> orchestrator: GenerationRequest (its limits RequestLimits), GenerationChunk,
GenerationResult, GenerationStats, and the request/stats/chunk/result converters (what a client
needs of these comes from the client distribution, specdec_client.protocol, re-exported here).
A request's sampling and decoding controls, SamplingParams, and its structured output,
GrammarSpec, are defined here too: the orchestrator sends them on to the workers unchanged.
What only the orchestrator <-> worker hop uses (CompactProbs, a distribution on the wire;
Proposal, Verification, ModelInfo, DraftOptions, the batched calls and their statuses) lives in
specdec/wire.py, which imports this module (never the other way round). Servicers and clients
convert with the functions of the two modules and nowhere else.

This module imports neither torch nor transformers (a gRPC client needs neither). It owns no
model, no server and no session state.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from specdec.errors import InvalidArgument
from specdec.v1 import common_pb2, orchestrator_pb2
# What a client needs (its records, request_to_proto, the *_from_proto converters, the message
# limit) lives in the client distribution (clients/python/specdec_client/protocol.py): one copy,
# imported here for the server's side of the same messages.
from specdec_client.protocol import (CLIENT_MAX_MESSAGE_BYTES, FINISH_NAMES, FINISH_REASONS,  # noqa: F401
                                     REQUEST_SCALARS, SAMPLING_MODE_NAMES, SAMPLING_MODES, GenerationChunk,
                                     GenerationResult, TokenLogprob, chunk_from_proto, message_options,
                                     request_to_proto, result_from_proto, stats_from_proto, tool_call_from_proto,
                                     tool_call_to_proto)

MAX_GAMMA = 16  # most drafts per round a request may ask for
DEFAULT_GAMMA = 4
DEFAULT_MAX_NEW_TOKENS = 128
MAX_TOP_LOGPROBS = 20  # as OpenAI's API
GREEDY_BELOW = 1e-5  # temperatures below this are greedy


# ---- sampling parameters and structured output (a request's, sent on to the workers) -------


MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI's API allows
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint (structured output). text by kind:
    json_schema: the schema as a JSON object string; json_object: "" (any JSON object);
    regex: the pattern (Rust regex syntax, \\d meaning [0-9]; it must match the whole output);
    choice: a JSON list of non-empty strings; grammar: Lark text in llguidance's dialect
    (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md) or llama.cpp GBNF.
    Compiled and followed by specdec/grammar.py (which this module does not import: no engine here)."""

    kind: str
    text: str = ""

    def validate(self, max_chars: int | None = None) -> "GrammarSpec":
        """Structural checks that need no engine; the engine's own come at compile. Raises InvalidArgument."""
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidArgument(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}; got {self.kind!r}",
                                  param="structured_output")
        if not isinstance(self.text, str):
            raise InvalidArgument(f"grammar text must be a string, got {type(self.text).__name__}",
                                  param="structured_output")
        if max_chars is not None and len(self.text) > max_chars:
            raise InvalidArgument(f"{self.kind} text is {len(self.text)} characters; the limit is {max_chars}",
                                  param="structured_output")
        if self.kind == "json_object":
            if self.text.strip():
                raise InvalidArgument("json_object takes no text (use json_schema for a schema)",
                                      param="structured_output")
            return self
        if not self.text.strip():
            raise InvalidArgument(f"{self.kind} text is empty", param="structured_output")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except ValueError as exc:
                raise InvalidArgument(f"json_schema is not valid JSON: {exc}", param="structured_output") from None
            if not isinstance(schema, dict):
                raise InvalidArgument(f"json_schema must be a JSON object, got {type(schema).__name__}",
                                      param="structured_output")
        elif self.kind == "choice":
            try:
                choices = json.loads(self.text)
            except ValueError as exc:
                raise InvalidArgument(f"choice is not valid JSON: {exc}", param="structured_output") from None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidArgument("choice must be a non-empty JSON list of non-empty strings",
                                      param="structured_output")
        elif self.kind == "grammar" and self.text.lstrip().startswith("{"):
            # llguidance would read a JSON text as its internal grammar list, with options we do not vet
            raise InvalidArgument("grammar must be Lark or GBNF text, not JSON", param="structured_output")
        return self

    def to_proto(self) -> common_pb2.Grammar:
        return common_pb2.Grammar(kind=self.kind, text=self.text)

    @classmethod
    def from_proto(cls, msg: common_pb2.Grammar) -> "GrammarSpec":
        return cls(msg.kind, msg.text)

    @classmethod
    def from_structured_output(cls, msg: orchestrator_pb2.StructuredOutput) -> "GrammarSpec | None":
        """The client's oneof (orchestrator.proto StructuredOutput) as a spec; None when unset."""
        form = msg.WhichOneof("format")
        if form is None or (form == "json_object" and not msg.json_object):
            return None
        if form == "choice":
            return cls("choice", json.dumps(list(msg.choice.choices)))
        return cls(form, "" if form == "json_object" else getattr(msg, form))
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class SamplingParams:
    """How both workers turn a position's logits into its token or distribution (specdec/sampling.py).

    The decoding controls (vLLM's semantics) are functions of the logits and of the prefix the
    position sees, drafts of the round included: both workers apply them at every position they
    score, so q and p are the controlled distributions and the rejection test (or greedy and
    coupled choice) stays exact for the controlled target. In order: logit_bias, min_tokens, the
    penalties (greedy takes the argmax here), temperature, min_p, top-k, top-p."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    # set: coupled sampling (specdec/sampling.py, coupled_choice): each position's token is a fixed
    # function of this seed, the position and the distribution there; None: each side draws its own
    coupling_seed: int | None = None
    # a positive logit of a token in the prefix (prompt and output) is divided by it, a negative one
    # multiplied; 1 = off
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0  # logit -= frequency_penalty * count in the output before the position
    presence_penalty: float = 0.0  # logit -= presence_penalty if the token is in the output before it
    min_p: float = 0.0  # sampling keeps tokens with at least min_p x the most likely token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending
    output_start: int = 0  # the absolute position of the first output token (the prompt's length)
    min_tokens: int = 0  # the stop tokens are masked at the first min_tokens output positions ...
    stop_token_ids: tuple[int, ...] = ()  # ... these (EOS unless ignore_eos, and the request's stop_token_ids)
    grammar: GrammarSpec | None = None  # structured output: output positions masked by the grammar's state
    processed_logprobs: bool = False  # logprobs of the distribution a token was chosen from, not the raw model's

    @property
    def greedy(self) -> bool:
        # as vLLM does: below 1e-5, logits / T overflows float32 and the answer is the argmax anyway
        return self.temperature < GREEDY_BELOW

    @property
    def coupled(self) -> bool:
        return self.coupling_seed is not None and not self.greedy

    @property
    def deterministic(self) -> bool:
        """Each worker decides a position's token itself (greedy: the argmax; coupled: the seeded
        Gumbel-max): proposals carry no q, verifications no p, the round keeps drafts while they
        equal the target's tokens."""
        return self.greedy or self.coupling_seed is not None

    @property
    def controlled(self) -> bool:
        """Some control changes logits by the position's prefix (or by token): the workers apply
        specdec/sampling.py's apply_controls before choosing or computing a distribution."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.stop_token_ids))
                or self.grammar is not None)

    def validate(self) -> "SamplingParams":
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {self.temperature}",
                                  param="temperature")
        if not 0 <= self.top_k < 2**31:  # the wire's int32; any value >= the vocabulary is the same as 0
            raise InvalidArgument(f"top_k must lie in [0, 2**31 - 1] (0 turns it off), got {self.top_k}", param="top_k")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise InvalidArgument(f"top_p must lie in (0, 1], got {self.top_p}", param="top_p")
        if self.coupling_seed is not None and not 0 <= self.coupling_seed < 2**64:
            raise InvalidArgument(f"coupling_seed must lie in [0, 2**64 - 1], got {self.coupling_seed}", param="seed")
        if not 0.0 < self.repetition_penalty <= 1e4:  # vLLM: > 0 (1 = off); also rejects NaN and inf
            raise InvalidArgument(f"repetition_penalty must lie in (0, 10000] (1 turns it off), got {self.repetition_penalty}",
                                  param="repetition_penalty")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # OpenAI's and vLLM's range
                raise InvalidArgument(f"{name} must lie in [-2, 2], got {getattr(self, name)}", param=name)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must lie in [0, 1], got {self.min_p}", param="min_p")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
                                  param="logit_bias")
        for i, (token, bias) in enumerate(self.logit_bias):
            if token < 0 or i and token <= self.logit_bias[i - 1][0]:
                raise InvalidArgument("logit_bias: token ids must be >= 0, each once, in ascending order",
                                      param="logit_bias")
            if not -100.0 <= bias <= 100.0:  # OpenAI's range; also rejects NaN
                raise InvalidArgument(f"logit_bias: the bias of token {token} must lie in [-100, 100], got {bias}",
                                      param="logit_bias")
        if self.output_start < 0 or self.min_tokens < 0:
            raise InvalidArgument(f"output_start and min_tokens must be >= 0, got {self.output_start}, {self.min_tokens}",
                                  param="min_tokens")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS + 16 or any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids >= 0", param="stop_token_ids")
        return self

    def raw_logit(self, controlled: float, token: int, prefix: list[int]) -> float:
        """The raw logit of `token` at the position after `prefix`, from its controlled logit: the
        controls of specdec.sampling.apply_controls undone (each is invertible for one token; the
        orchestrator uses it to report raw log-probabilities under rejection sampling)."""
        z = controlled
        if self.frequency_penalty or self.presence_penalty:
            count = prefix[self.output_start:].count(token)
            z += self.frequency_penalty * count + (self.presence_penalty if count else 0.0)
        if self.repetition_penalty != 1.0 and token in prefix:
            z = z * self.repetition_penalty if z > 0 else z / self.repetition_penalty
        return z - dict(self.logit_bias).get(token, 0.0)

    def check_vocabulary(self, vocab_size: int) -> None:
        """INVALID_ARGUMENT for a token id the controls name that the vocabulary does not have."""
        for name, tokens in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in tokens if t >= vocab_size]
            if bad:
                raise InvalidArgument(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                                      param=name)

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, coupling_seed=self.coupling_seed,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty != 1.0 else None,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, min_p=self.min_p,
            logit_bias_token_ids=[t for t, _ in self.logit_bias], logit_bias_values=[b for _, b in self.logit_bias],
            output_start=self.output_start, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
            grammar=self.grammar.to_proto() if self.grammar is not None else None,
            processed_logprobs=self.processed_logprobs)

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams) -> "SamplingParams":
        # proto3 cannot tell 0 from unset: the orchestrator always sets all three, and greedy
        # requests need neither top_k nor top_p.
        if len(msg.logit_bias_token_ids) != len(msg.logit_bias_values):
            raise InvalidArgument("logit_bias_token_ids and logit_bias_values must have the same length")
        controls = dict(
            repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            frequency_penalty=msg.frequency_penalty, presence_penalty=msg.presence_penalty,
            logit_bias=tuple(zip(msg.logit_bias_token_ids, msg.logit_bias_values)), output_start=msg.output_start,
            min_tokens=msg.min_tokens, stop_token_ids=tuple(msg.stop_token_ids),
            grammar=GrammarSpec.from_proto(msg.grammar).validate() if msg.HasField("grammar") else None,
            processed_logprobs=msg.processed_logprobs)
        if 0 <= msg.temperature < GREEDY_BELOW:
            return cls(temperature=0.0, **controls).validate()
        return cls(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, min_p=msg.min_p,
                   coupling_seed=msg.coupling_seed if msg.HasField("coupling_seed") else None, **controls).validate()


# ---- requests and results (client <-> orchestrator) ------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    """Exactly one of prompt, messages (chat, rendered with the chat template) or token_ids."""

    prompt: str | None = None
    messages: Sequence[dict] | None = None
    token_ids: Sequence[int] | None = None
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None: as many as fit (context, server limit)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    gamma: int = DEFAULT_GAMMA
    stop: Sequence[str] = ()
    logprobs: bool = False  # each token's log-probability under the target ...
    top_logprobs: int = 0  # ... and this many most likely alternatives (0-MAX_TOP_LOGPROBS)
    sampling_mode: str | None = None  # "coupled" or "rejection"; None: coupled with a seed (the server's default)
    # decoding controls (SamplingParams says what each does)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()  # generation also ends after one of these (finish "stop_token")
    ignore_eos: bool = False  # generation does not end at EOS
    structured_output: GrammarSpec | None = None  # the output follows this grammar
    # chat only: OpenAI-shaped function tools, shown by the chat template (orchestrator/tool_calls.py)
    tools: Sequence[dict] = ()
    tool_choice: str | dict | None = None  # "none", "auto" (the default with tools), "required" or a name
    parallel_tool_calls: bool = True  # False: tool_choice required makes exactly one call
    n: int = 1  # choices: each decodes from the one prefill with its own seed (orchestrator/decoder.py, choice_seed)
    # the tenant, set by the server from the caller's bearer token (never by a client): the
    # workers reuse cached prompt prefixes of the same scope only
    cache_scope: str = ""
    logprobs_mode: str = "raw"  # or "processed": the distribution each token was chosen from (LOGPROBS_MODES)

    @property
    def sampling(self) -> SamplingParams:
        """The request's sampling and controls; the decoder adds what depends on the prompt and
        the model (output_start, the stop tokens min_tokens holds back, a coupling seed)."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:  # before sorting a dict of any size
            raise InvalidArgument(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
        return SamplingParams(self.temperature, self.top_k, self.top_p, repetition_penalty=self.repetition_penalty,
                              frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                              min_p=self.min_p, logit_bias=tuple(sorted((int(t), float(b)) for t, b in bias.items())),
                              min_tokens=self.min_tokens,
                              grammar=self.structured_output.validate() if self.structured_output else None,
                              processed_logprobs=self.logprobs_mode == "processed")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; beyond it, INVALID_ARGUMENT naming the limit."""

    max_new_tokens: int = 4096
    max_prompt_tokens: int = 0  # 0: what the context allows


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's tokens, those the target copied from its prefix cache
    generated_tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    target_forward_passes: int = 0
    wire_bytes: int = 0
    wire_bytes_per_round: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    sampling_s: float = 0.0
    total_s: float = 0.0
    tokens_per_second: float = 0.0
    gamma: int = 0
    draft_compute_s: float = 0.0
    verify_compute_s: float = 0.0
    target_failovers: int = 0
    draft_failovers: int = 0
    mean_gamma: float = 0.0
    sampling: str = ""  # "greedy", "coupled" or "rejection"
    seed: int = 0  # the seed the request ran with, as an unsigned 64-bit integer
    suffix_drafted_tokens: int = 0  # of drafted_tokens, those of suffix drafts (orchestrator/proposers/suffix.py)
    suffix_accepted_tokens: int = 0  # of accepted_tokens, those of suffix drafts
    draft_prefill_tokens: int = 0  # tokens the draft model took in beyond one a round (its prompt, catch-ups)
    ahead_rounds: int = 0  # rounds whose drafts the draft was asked to make ahead (during the verify before) ...
    ahead_hits: int = 0  # ... and those that found them all made

    def record_round(self, gamma: int, num_accepted: int, suffix: bool = False) -> None:
        if suffix:
            self.suffix_drafted_tokens += gamma
            self.suffix_accepted_tokens += num_accepted
        self.rounds += 1
        self.target_forward_passes += 1
        self.drafted_tokens += gamma
        self.accepted_tokens += num_accepted
        if len(self.drafted_by_position) < gamma:
            grow = gamma - len(self.drafted_by_position)
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(gamma):
            self.drafted_by_position[i] += 1
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    def finalize(self, generated: int, total_s: float) -> None:
        self.generated_tokens = generated
        self.total_s = total_s
        self.acceptance_rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        self.mean_accepted_length = generated / self.rounds if self.rounds else 0.0
        self.wire_bytes_per_round = self.wire_bytes / self.rounds if self.rounds else 0.0
        self.mean_gamma = self.drafted_tokens / self.rounds if self.rounds else 0.0
        self.tokens_per_second = generated / total_s if total_s > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def request_from_proto(msg: orchestrator_pb2.GenerateRequest) -> GenerationRequest:
    kwargs = {}
    which = msg.WhichOneof("input")
    if which == "prompt":
        kwargs["prompt"] = msg.prompt
    elif which == "chat":
        kwargs["messages"] = [_message(m) for m in msg.chat.messages]
    elif which == "tokens":
        kwargs["token_ids"] = list(msg.tokens.token_ids)
    for name in REQUEST_SCALARS[:-1]:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.sampling_mode:
        if msg.sampling_mode not in SAMPLING_MODE_NAMES:  # a number this server does not know
            raise InvalidArgument(f"sampling_mode {msg.sampling_mode} is not one of {sorted(SAMPLING_MODES)}",
                                  param="sampling_mode")
        kwargs["sampling_mode"] = SAMPLING_MODE_NAMES[msg.sampling_mode]
    return GenerationRequest(**kwargs, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                             logit_bias=dict(msg.logit_bias) or None,
                             structured_output=GrammarSpec.from_structured_output(msg.structured_output),
                             tools=tuple(_tool(t) for t in msg.tools), tool_choice=msg.tool_choice or None)


def _message(m: orchestrator_pb2.ChatMessage) -> dict:
    """A chat message as chat templates take it (OpenAI's shape)."""
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [tool_call_from_proto(c) for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _tool(t: orchestrator_pb2.Tool) -> dict:
    try:
        parameters = json.loads(t.parameters_json) if t.parameters_json else {"type": "object"}
    except ValueError as exc:
        raise InvalidArgument(f"tools: {t.name[:64]}'s parameters_json is not JSON: {exc}", param="tools") from None
    return {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": parameters}}


def stats_to_proto(stats: GenerationStats) -> orchestrator_pb2.GenerationStats:
    return orchestrator_pb2.GenerationStats(**stats.to_dict())


def chunk_to_proto(chunk: GenerationChunk) -> orchestrator_pb2.GenerateChunk:
    return orchestrator_pb2.GenerateChunk(
        text_delta=chunk.text_delta,
        token_ids=chunk.token_ids,
        finish_reason=FINISH_REASONS.get(chunk.finish_reason, 0),
        stats=stats_to_proto(chunk.stats) if chunk.stats is not None else None,
        logprobs=[lp.to_proto() for lp in chunk.logprobs or ()],
        tool_calls=[tool_call_to_proto(c) for c in chunk.tool_calls or ()],
        index=chunk.index,
    )


def result_to_proto(text: str, token_ids: list[int], last: GenerationChunk,
                    logprobs: list[TokenLogprob] | None = None) -> orchestrator_pb2.GenerateResponse:
    return orchestrator_pb2.GenerateResponse(text=text, token_ids=token_ids,
                                             finish_reason=FINISH_REASONS[last.finish_reason],
                                             stats=stats_to_proto(last.stats),
                                             logprobs=[lp.to_proto() for lp in logprobs or ()],
                                             tool_calls=[tool_call_to_proto(c) for c in last.tool_calls or ()])


def choice_of(index: int, answer: orchestrator_pb2.GenerateResponse) -> orchestrator_pb2.Choice:
    """One choice of a request with n > 1, from the answer that choice alone would get."""
    return orchestrator_pb2.Choice(index=index, text=answer.text, token_ids=answer.token_ids,
                                   finish_reason=answer.finish_reason, stats=answer.stats, logprobs=answer.logprobs,
                                   tool_calls=answer.tool_calls)
