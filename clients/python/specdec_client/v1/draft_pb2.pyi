from specdec_client.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "start", "token_ids", "gamma", "sampling", "seed", "options", "session_secret", "features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    gamma: int
    sampling: _common_pb2.SamplingParams
    seed: int
    options: DraftOptions
    session_secret: bytes
    features: _common_pb2.Features
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., gamma: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., options: _Optional[_Union[DraftOptions, _Mapping]] = ..., session_secret: _Optional[bytes] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ...) -> None: ...

class DraftOptions(_message.Message):
    __slots__ = ("p_min", "min_drafts", "lookup", "ahead", "skip_grammar", "skip_forced_tokens")
    P_MIN_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    SKIP_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    SKIP_FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    p_min: float
    min_drafts: int
    lookup: int
    ahead: int
    skip_grammar: bool
    skip_forced_tokens: bool
    def __init__(self, p_min: _Optional[float] = ..., min_drafts: _Optional[int] = ..., lookup: _Optional[int] = ..., ahead: _Optional[int] = ..., skip_grammar: _Optional[bool] = ..., skip_forced_tokens: _Optional[bool] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("index", "token_id", "probs", "compute_s", "batch_rows", "pass_s")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_S_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    probs: _common_pb2.Probs
    compute_s: float
    batch_rows: int
    pass_s: float
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., probs: _Optional[_Union[_common_pb2.Probs, _Mapping]] = ..., compute_s: _Optional[float] = ..., batch_rows: _Optional[int] = ..., pass_s: _Optional[float] = ...) -> None: ...

class ProposeBatchRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ...) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("proposals", "status")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    status: _common_pb2.CallStatus
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., status: _Optional[_Union[_common_pb2.CallStatus, _Mapping]] = ...) -> None: ...

class ProposeBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProposeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ProposeResult, _Mapping]]] = ...) -> None: ...
