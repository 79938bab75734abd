from specdec_client.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "start", "token_ids", "draft_token_ids", "sampling", "logprobs", "top_logprobs", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    logprobs: bool
    top_logprobs: int
    session_secret: bytes
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., session_secret: _Optional[bytes] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("argmax_token_ids", "probs", "length", "compute_s", "batch_rows", "pass_s", "logprob_bases", "top_logprobs", "raw_log_norms", "features")
    ARGMAX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_BASES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RAW_LOG_NORMS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    argmax_token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Probs]
    length: int
    compute_s: float
    batch_rows: int
    pass_s: float
    logprob_bases: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    raw_log_norms: _containers.RepeatedScalarFieldContainer[float]
    features: _common_pb2.Features
    def __init__(self, argmax_token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[_Union[_common_pb2.Probs, _Mapping]]] = ..., length: _Optional[int] = ..., compute_s: _Optional[float] = ..., batch_rows: _Optional[int] = ..., pass_s: _Optional[float] = ..., logprob_bases: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., raw_log_norms: _Optional[_Iterable[float]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("response", "status")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    response: VerifyResponse
    status: _common_pb2.CallStatus
    def __init__(self, response: _Optional[_Union[VerifyResponse, _Mapping]] = ..., status: _Optional[_Union[_common_pb2.CallStatus, _Mapping]] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...
