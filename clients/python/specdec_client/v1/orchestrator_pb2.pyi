from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLING_MODE_UNSPECIFIED: _ClassVar[SamplingMode]
    SAMPLING_MODE_REJECTION: _ClassVar[SamplingMode]
    SAMPLING_MODE_COUPLED: _ClassVar[SamplingMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
SAMPLING_MODE_UNSPECIFIED: SamplingMode
SAMPLING_MODE_REJECTION: SamplingMode
SAMPLING_MODE_COUPLED: SamplingMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenInput(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "chat", "tokens", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "gamma", "stop", "logprobs", "top_logprobs", "sampling_mode", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos", "structured_output", "tools", "tool_choice", "n", "logprobs_mode", "parallel_tool_calls")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_MODE_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatInput
    tokens: TokenInput
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    gamma: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    sampling_mode: SamplingMode
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    structured_output: StructuredOutput
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: str
    n: int
    logprobs_mode: str
    parallel_tool_calls: bool
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., tokens: _Optional[_Union[TokenInput, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., gamma: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., sampling_mode: _Optional[_Union[SamplingMode, str]] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., n: _Optional[int] = ..., logprobs_mode: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "drafted_by_position", "accepted_by_position", "target_forward_passes", "wire_bytes", "wire_bytes_per_round", "prefill_s", "draft_s", "verify_s", "sampling_s", "total_s", "tokens_per_second", "gamma", "draft_compute_s", "verify_compute_s", "target_failovers", "draft_failovers", "mean_gamma", "sampling", "seed", "cached_tokens", "suffix_drafted_tokens", "suffix_accepted_tokens", "draft_prefill_tokens", "ahead_rounds", "ahead_hits")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    MEAN_GAMMA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    drafted_by_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_by_position: _containers.RepeatedScalarFieldContainer[int]
    target_forward_passes: int
    wire_bytes: int
    wire_bytes_per_round: float
    prefill_s: float
    draft_s: float
    verify_s: float
    sampling_s: float
    total_s: float
    tokens_per_second: float
    gamma: int
    draft_compute_s: float
    verify_compute_s: float
    target_failovers: int
    draft_failovers: int
    mean_gamma: float
    sampling: str
    seed: int
    cached_tokens: int
    suffix_drafted_tokens: int
    suffix_accepted_tokens: int
    draft_prefill_tokens: int
    ahead_rounds: int
    ahead_hits: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., drafted_by_position: _Optional[_Iterable[int]] = ..., accepted_by_position: _Optional[_Iterable[int]] = ..., target_forward_passes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., wire_bytes_per_round: _Optional[float] = ..., prefill_s: _Optional[float] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., sampling_s: _Optional[float] = ..., total_s: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., gamma: _Optional[int] = ..., draft_compute_s: _Optional[float] = ..., verify_compute_s: _Optional[float] = ..., target_failovers: _Optional[int] = ..., draft_failovers: _Optional[int] = ..., mean_gamma: _Optional[float] = ..., sampling: _Optional[str] = ..., seed: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., suffix_drafted_tokens: _Optional[int] = ..., suffix_accepted_tokens: _Optional[int] = ..., draft_prefill_tokens: _Optional[int] = ..., ahead_rounds: _Optional[int] = ..., ahead_hits: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logprobs", "tool_calls", "choices")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "stats", "logprobs", "tool_calls")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text_delta", "token_ids", "finish_reason", "stats", "logprobs", "tool_calls", "index")
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text_delta: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    index: int
    def __init__(self, text_delta: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("role", "address", "source", "state", "message", "model_name", "open_sessions", "active_sessions", "placed_sessions")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PLACED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    source: str
    state: str
    message: str
    model_name: str
    open_sessions: int
    active_sessions: int
    placed_sessions: int
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., source: _Optional[str] = ..., state: _Optional[str] = ..., message: _Optional[str] = ..., model_name: _Optional[str] = ..., open_sessions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., placed_sessions: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class AddWorkersRequest(_message.Message):
    __slots__ = ("target", "draft")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    target: _containers.RepeatedScalarFieldContainer[str]
    draft: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, target: _Optional[_Iterable[str]] = ..., draft: _Optional[_Iterable[str]] = ...) -> None: ...
