from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Frame(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerificationRequest(_message.Message):
    __slots__ = ("prefix_token_ids", "draft_token_ids", "draft_logprobs", "temperature", "top_k", "session_id", "top_p", "seed", "strategy", "threshold", "draft_probs")
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_logprobs: _containers.RepeatedScalarFieldContainer[float]
    temperature: float
    top_k: int
    session_id: str
    top_p: float
    seed: int
    strategy: str
    threshold: float
    draft_probs: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    def __init__(self, prefix_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_logprobs: _Optional[_Iterable[float]] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., session_id: _Optional[str] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., strategy: _Optional[str] = ..., threshold: _Optional[float] = ..., draft_probs: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ...) -> None: ...

class VerificationResponse(_message.Message):
    __slots__ = ("num_accepted_tokens", "acceptance_mask", "corrected_token_ids", "next_token_id", "total_tokens", "verify_s", "lossy", "strategy", "session_id")
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_MASK_FIELD_NUMBER: _ClassVar[int]
    CORRECTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    num_accepted_tokens: int
    acceptance_mask: _containers.RepeatedScalarFieldContainer[bool]
    corrected_token_ids: _containers.RepeatedScalarFieldContainer[int]
    next_token_id: int
    total_tokens: int
    verify_s: float
    lossy: bool
    strategy: str
    session_id: str
    def __init__(self, num_accepted_tokens: _Optional[int] = ..., acceptance_mask: _Optional[_Iterable[bool]] = ..., corrected_token_ids: _Optional[_Iterable[int]] = ..., next_token_id: _Optional[int] = ..., total_tokens: _Optional[int] = ..., verify_s: _Optional[float] = ..., lossy: _Optional[bool] = ..., strategy: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class BatchVerificationRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[VerificationRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[VerificationRequest, _Mapping]]] = ...) -> None: ...

class BatchVerificationResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[VerificationResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[VerificationResponse, _Mapping]]] = ...) -> None: ...
