from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTransferHeader(_message.Message):
    __slots__ = ("request_id", "fence", "layout", "dtype", "block_size", "num_kv_heads", "head_dim", "layer_start", "layer_end", "dst_block_ids", "payload_bytes", "crc32c", "num_tokens_after", "capability", "dst_window_slots", "window_layers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_AFTER_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    DST_WINDOW_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LAYERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    fence: int
    layout: str
    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    layer_start: int
    layer_end: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    payload_bytes: int
    crc32c: int
    num_tokens_after: int
    capability: bytes
    dst_window_slots: _containers.RepeatedScalarFieldContainer[int]
    window_layers: int
    def __init__(self, request_id: _Optional[str] = ..., fence: _Optional[int] = ..., layout: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., payload_bytes: _Optional[int] = ..., crc32c: _Optional[int] = ..., num_tokens_after: _Optional[int] = ..., capability: _Optional[bytes] = ..., dst_window_slots: _Optional[_Iterable[int]] = ..., window_layers: _Optional[int] = ...) -> None: ...

class KVTransferMessage(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KVTransferHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[KVTransferHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushBlocksResponse(_message.Message):
    __slots__ = ("num_blocks", "num_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...
