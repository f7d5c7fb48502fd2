"""Lenient parsing of the gRPC messages Envoy sends (ext_proc and the access log).

Envoy copies client-controlled bytes (header values read as CEL attributes, the user agent, a path)
into protobuf `string` fields without checking that they are UTF-8, and Python's protobuf refuses
to parse such a message. Without this, one header byte like 0xFF - sent by anyone, no credential
needed - would end the whole gRPC stream before the service sees the request (and, on the access
log, every settlement batched with it). So a message that does not parse is scrubbed: every string
field, at any depth, whose bytes are not UTF-8 is decoded with U+FFFD in place of the bad bytes, and
the result is parsed again. The validators downstream treat U+FFFD like any other character that
has no business in a credential, data class, deadline or key, so the request is refused with the
contract's 4xx. The hot path pays nothing: only a message that failed to parse is walked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from extproc.ratelimit import RateLimitedLog

log = logging.getLogger("llmgw.wire")
M = TypeVar("M", bound=Message)
_report = RateLimitedLog(log, every_s=60.0)

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise DecodeError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def scrub(data: bytes, desc: Descriptor) -> bytes:
    """The same message with every invalid UTF-8 string field (at any depth) made valid."""
    out = bytearray()
    i = 0
    while i < len(data):
        start = i
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            _, i = _varint(data, i)
        elif wire == _I64:
            i += 8
        elif wire == _I32:
            i += 4
        elif wire == _LEN:
            length, j = _varint(data, i)
            payload = data[j:j + length]
            if len(payload) != length:
                raise DecodeError("truncated field")
            i = j + length
            field = desc.fields_by_number.get(number)
            if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                payload = payload.decode("utf-8", "replace").encode()
            elif field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
                payload = scrub(payload, field.message_type)
            out += _put_varint(key) + _put_varint(len(payload)) + payload
            continue
        else:  # groups are not used by any message Envoy sends here
            raise DecodeError(f"unsupported wire type {wire}")
        if i > len(data):
            raise DecodeError("truncated field")
        out += data[start:i]
    return bytes(out)


def lenient_parser(cls: type[M]) -> Callable[[bytes], M]:
    """A gRPC request deserializer: the message as protobuf parses it, or, when a string field holds
    bytes that are not UTF-8, the message with those bytes replaced by U+FFFD."""
    def parse(data: bytes) -> M:
        try:
            return cls.FromString(data)
        except DecodeError:
            pass
        msg = cls.FromString(scrub(data, cls.DESCRIPTOR))  # still undecodable: gRPC fails the call
        _report.warning("%s held bytes that are not UTF-8 in a string field; replaced with U+FFFD",
                        cls.DESCRIPTOR.name)
        return msg
    return parse
