from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "coupling_seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "logit_bias_token_ids", "logit_bias_values", "output_start", "min_tokens", "stop_token_ids", "grammar", "processed_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    COUPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    coupling_seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    output_start: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar: Grammar
    processed_logprobs: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., coupling_seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., output_start: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., processed_logprobs: _Optional[bool] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class Probs(_message.Message):
    __slots__ = ("dense", "sparse")
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    dense: DenseProbs
    sparse: SparseProbs
    def __init__(self, dense: _Optional[_Union[DenseProbs, _Mapping]] = ..., sparse: _Optional[_Union[SparseProbs, _Mapping]] = ...) -> None: ...

class DenseProbs(_message.Message):
    __slots__ = ("float32_le",)
    FLOAT32_LE_FIELD_NUMBER: _ClassVar[int]
    float32_le: bytes
    def __init__(self, float32_le: _Optional[bytes] = ...) -> None: ...

class SparseProbs(_message.Message):
    __slots__ = ("vocab_size", "indices_int32_le", "probs_float32_le")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    INDICES_INT32_LE_FIELD_NUMBER: _ClassVar[int]
    PROBS_FLOAT32_LE_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    indices_int32_le: bytes
    probs_float32_le: bytes
    def __init__(self, vocab_size: _Optional[int] = ..., indices_int32_le: _Optional[bytes] = ..., probs_float32_le: _Optional[bytes] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "vocab_fingerprint", "eos_token_ids", "bos_token_id", "pad_token_id", "max_context", "device", "dtype", "max_gamma", "open_sessions", "draining", "held_tokens", "kernels", "draft_kind", "feature_layers", "feature_size", "num_layers", "hidden_size", "host_id", "cpus", "device_uuid")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    vocab_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    pad_token_id: int
    max_context: int
    device: str
    dtype: str
    max_gamma: int
    open_sessions: int
    draining: bool
    held_tokens: int
    kernels: str
    draft_kind: str
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    feature_size: int
    num_layers: int
    hidden_size: int
    host_id: str
    cpus: _containers.RepeatedScalarFieldContainer[int]
    device_uuid: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., max_context: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_gamma: _Optional[int] = ..., open_sessions: _Optional[int] = ..., draining: _Optional[bool] = ..., held_tokens: _Optional[int] = ..., kernels: _Optional[str] = ..., draft_kind: _Optional[str] = ..., feature_layers: _Optional[_Iterable[int]] = ..., feature_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., host_id: _Optional[str] = ..., cpus: _Optional[_Iterable[int]] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start", "rows", "width", "bfloat16_le")
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    BFLOAT16_LE_FIELD_NUMBER: _ClassVar[int]
    start: int
    rows: int
    width: int
    bfloat16_le: bytes
    def __init__(self, start: _Optional[int] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., bfloat16_le: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "fork_of", "fork_secret", "prefix_scope", "feature_layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORK_OF_FIELD_NUMBER: _ClassVar[int]
    FORK_SECRET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SCOPE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    fork_of: str
    fork_secret: bytes
    prefix_scope: str
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., fork_of: _Optional[str] = ..., fork_secret: _Optional[bytes] = ..., prefix_scope: _Optional[str] = ..., feature_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("length", "compute_s", "cached_tokens", "session_secret", "features")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    length: int
    compute_s: float
    cached_tokens: int
    session_secret: bytes
    features: Features
    def __init__(self, length: _Optional[int] = ..., compute_s: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., session_secret: _Optional[bytes] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class TruncateRequest(_message.Message):
    __slots__ = ("session_id", "length", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    session_secret: bytes
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ..., session_secret: _Optional[bytes] = ...) -> None: ...

class TruncateResponse(_message.Message):
    __slots__ = ("length",)
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    length: int
    def __init__(self, length: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: bytes
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[bytes] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
