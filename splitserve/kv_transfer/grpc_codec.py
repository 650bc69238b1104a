"""The PushBlocks wire codec: KVTransferMessage bytes, with data chunks framed and parsed by
hand (one copy fewer on each side than building protobuf messages), and the header through
protobuf. Senders and receivers that use the generated code interoperate with it."""

from __future__ import annotations

from typing import Any

import grpc

from splitserve.protos.v1 import kv_transfer_pb2

PUSH_BLOCKS = "/splitserve.v1.KVTransfer/PushBlocks"
ENDPOINT_KEY = "grpc.address"
"""The key of a gRPC receiver's address in its published endpoint."""
Part = kv_transfer_pb2.KVTransferHeader | memoryview
"""One message of a PushBlocks stream, decoded: the header, or a slice of the payload."""

_DATA_TAG = b"\x12"  # KVTransferMessage field 2 (`data`), length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def encode_part(part: Part | kv_transfer_pb2.KVTransferMessage) -> bytes:
    """A KVTransferMessage's wire bytes. A data chunk is framed by hand (tag, length, bytes):
    one copy, where building the message and serialising it would make two."""
    if isinstance(part, kv_transfer_pb2.KVTransferMessage):
        return part.SerializeToString()
    if isinstance(part, kv_transfer_pb2.KVTransferHeader):
        return kv_transfer_pb2.KVTransferMessage(header=part).SerializeToString()
    return b"".join((_DATA_TAG, _varint(len(part)), part))


def decode_part(raw: bytes) -> Part | kv_transfer_pb2.KVTransferMessage:
    """The inverse of `encode_part`: a data message becomes a view of `raw` (no copy); anything
    else is parsed by protobuf (and checked by the servicer)."""
    if raw[:1] == _DATA_TAG:
        size, shift, pos = 0, 0, 1
        while pos < len(raw) and pos <= 10:
            byte = raw[pos]
            size |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not byte & 0x80:
                if pos + size == len(raw):
                    return memoryview(raw)[pos:]
                break
    return kv_transfer_pb2.KVTransferMessage.FromString(raw)


def as_part(message: object) -> Part | None:
    """The header or data of a decoded message (None for an empty or unknown one)."""
    if isinstance(message, kv_transfer_pb2.KVTransferMessage):
        kind = message.WhichOneof("part")
        if kind == "header":
            return message.header
        return memoryview(message.data) if kind == "data" else None
    if isinstance(message, kv_transfer_pb2.KVTransferHeader | memoryview):
        return message
    return None


def add_kv_transfer_servicer(servicer: Any, server: grpc.Server | grpc.aio.Server) -> None:
    """Serve KVTransfer with the direct data codec (the generated `add_*_to_server` would parse
    every chunk into a message first, one more copy)."""
    handler = grpc.stream_unary_rpc_method_handler(
        servicer.PushBlocks,
        request_deserializer=decode_part,
        response_serializer=kv_transfer_pb2.PushBlocksResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("splitserve.v1.KVTransfer", {"PushBlocks": handler}),)
    )
