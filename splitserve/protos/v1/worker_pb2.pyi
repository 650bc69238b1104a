from splitserve.protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_KIND_UNSPECIFIED: _ClassVar[WorkerKind]
    WORKER_KIND_PREFILL: _ClassVar[WorkerKind]
    WORKER_KIND_DECODE: _ClassVar[WorkerKind]
    WORKER_KIND_COLOCATED: _ClassVar[WorkerKind]
WORKER_KIND_UNSPECIFIED: WorkerKind
WORKER_KIND_PREFILL: WorkerKind
WORKER_KIND_DECODE: WorkerKind
WORKER_KIND_COLOCATED: WorkerKind

class SetRoleRequest(_message.Message):
    __slots__ = ("kind", "drain_timeout_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    kind: WorkerKind
    drain_timeout_s: float
    def __init__(self, kind: _Optional[_Union[WorkerKind, str]] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class GetRoleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoleReply(_message.Message):
    __slots__ = ("kind", "previous_kind", "switch_seconds", "num_streams_moved")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_KIND_FIELD_NUMBER: _ClassVar[int]
    SWITCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_MOVED_FIELD_NUMBER: _ClassVar[int]
    kind: WorkerKind
    previous_kind: WorkerKind
    switch_seconds: float
    num_streams_moved: int
    def __init__(self, kind: _Optional[_Union[WorkerKind, str]] = ..., previous_kind: _Optional[_Union[WorkerKind, str]] = ..., switch_seconds: _Optional[float] = ..., num_streams_moved: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class AdapterList(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("worker_id", "address", "block_ids", "num_cached_tokens", "fence", "kv_transports", "capability", "adapter", "window_slots")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SLOTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    fence: int
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    capability: bytes
    adapter: str
    window_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., fence: _Optional[int] = ..., kv_transports: _Optional[_Iterable[str]] = ..., capability: _Optional[bytes] = ..., adapter: _Optional[str] = ..., window_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "destination", "priority", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    destination: KVDestination
    priority: int
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., priority: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("index", "token_id", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    logprobs: _common_pb2.TokenLogprobs
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_tokens", "num_blocks_sent", "num_bytes_sent", "num_cached_tokens")
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_tokens: _containers.RepeatedCompositeFieldContainer[FirstToken]
    num_blocks_sent: int
    num_bytes_sent: int
    num_cached_tokens: int
    def __init__(self, first_tokens: _Optional[_Iterable[_Union[FirstToken, _Mapping]]] = ..., num_blocks_sent: _Optional[int] = ..., num_bytes_sent: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "resume", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    resume: ResumeFrom
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume: _Optional[_Union[ResumeFrom, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class ResumeFrom(_message.Message):
    __slots__ = ("sample_index", "output_token_ids", "num_text_chars")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_text_chars: int
    def __init__(self, sample_index: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., num_text_chars: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("destination",)
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    destination: KVDestination
    def __init__(self, destination: _Optional[_Union[KVDestination, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "sampling", "first_tokens", "priority", "resume", "kv_handed_off")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    KV_HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: _common_pb2.SamplingParams
    first_tokens: _containers.RepeatedCompositeFieldContainer[FirstToken]
    priority: int
    resume: ResumeFrom
    kv_handed_off: bool
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_tokens: _Optional[_Iterable[_Union[FirstToken, _Mapping]]] = ..., priority: _Optional[int] = ..., resume: _Optional[_Union[ResumeFrom, _Mapping]] = ..., kv_handed_off: _Optional[bool] = ...) -> None: ...

class DecodeControl(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: DecodeStart
    cancel: int
    def __init__(self, start: _Optional[_Union[DecodeStart, _Mapping]] = ..., cancel: _Optional[int] = ...) -> None: ...

class DecodeStart(_message.Message):
    __slots__ = ("stream", "request", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STREAM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    stream: int
    request: DecodeRequest
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, stream: _Optional[int] = ..., request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DecodeItem(_message.Message):
    __slots__ = ("stream", "response", "end")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream: int
    response: DecodeResponse
    end: DecodeEnd
    def __init__(self, stream: _Optional[int] = ..., response: _Optional[_Union[DecodeResponse, _Mapping]] = ..., end: _Optional[_Union[DecodeEnd, _Mapping]] = ...) -> None: ...

class DecodeEnd(_message.Message):
    __slots__ = ("code", "details", "trailers")
    class TrailersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailers: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DecodeBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DecodeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DecodeItem, _Mapping]]] = ...) -> None: ...

class HandOffRequest(_message.Message):
    __slots__ = ("request_id", "destination", "num_tokens", "destination_request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    destination: KVDestination
    num_tokens: int
    destination_request_id: str
    def __init__(self, request_id: _Optional[str] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., num_tokens: _Optional[int] = ..., destination_request_id: _Optional[str] = ...) -> None: ...

class HandOffResponse(_message.Message):
    __slots__ = ("num_blocks_sent", "num_bytes_sent")
    NUM_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    num_blocks_sent: int
    num_bytes_sent: int
    def __init__(self, num_blocks_sent: _Optional[int] = ..., num_bytes_sent: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("chunk", "finished")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.SampleDelta
    finished: DecodeFinished
    def __init__(self, chunk: _Optional[_Union[_common_pb2.SampleDelta, _Mapping]] = ..., finished: _Optional[_Union[DecodeFinished, _Mapping]] = ...) -> None: ...

class DecodeFinished(_message.Message):
    __slots__ = ("samples", "usage")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.SampleFinish]
    usage: _common_pb2.Usage
    def __init__(self, samples: _Optional[_Iterable[_Union[_common_pb2.SampleFinish, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "num_total_blocks", "num_free_blocks", "num_cached_blocks", "num_running", "num_waiting", "num_reservations", "kv_bytes_received", "kv_blocks_received", "kv_bytes_sent", "prefix_cache_hit_tokens", "num_reclaimed", "num_requests", "num_pinned_blocks", "block_size", "num_prefill_tokens", "num_handoffs_sent", "num_leases_rewritten")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFFS_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_REWRITTEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_reservations: int
    kv_bytes_received: int
    kv_blocks_received: int
    kv_bytes_sent: int
    prefix_cache_hit_tokens: int
    num_reclaimed: int
    num_requests: int
    num_pinned_blocks: int
    block_size: int
    num_prefill_tokens: int
    num_handoffs_sent: int
    num_leases_rewritten: int
    def __init__(self, worker_id: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_reservations: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_blocks_received: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., num_reclaimed: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_prefill_tokens: _Optional[int] = ..., num_handoffs_sent: _Optional[int] = ..., num_leases_rewritten: _Optional[int] = ...) -> None: ...
