from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "truncate", "normalize")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    truncate: bool
    normalize: bool
    def __init__(self, inputs: _Optional[_Iterable[str]] = ..., truncate: _Optional[bool] = ..., normalize: _Optional[bool] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("tokenization_seconds", "queue_seconds", "inference_seconds", "total_seconds")
    TOKENIZATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokenization_seconds: float
    queue_seconds: float
    inference_seconds: float
    total_seconds: float
    def __init__(self, tokenization_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., inference_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "token_counts", "total_tokens", "truncated_inputs", "timings")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    total_tokens: int
    truncated_inputs: _containers.RepeatedScalarFieldContainer[int]
    timings: Timings
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., token_counts: _Optional[_Iterable[int]] = ..., total_tokens: _Optional[int] = ..., truncated_inputs: _Optional[_Iterable[int]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "model_version", "dim", "max_input_length", "max_batch_tokens", "max_batch_size", "max_client_batch_size", "max_queue_tokens", "max_delay_seconds", "execution_provider", "precision", "version")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_version: str
    dim: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_size: int
    max_client_batch_size: int
    max_queue_tokens: int
    max_delay_seconds: float
    execution_provider: str
    precision: str
    version: str
    def __init__(self, model_id: _Optional[str] = ..., model_version: _Optional[str] = ..., dim: _Optional[int] = ..., max_input_length: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_client_batch_size: _Optional[int] = ..., max_queue_tokens: _Optional[int] = ..., max_delay_seconds: _Optional[float] = ..., execution_provider: _Optional[str] = ..., precision: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...
