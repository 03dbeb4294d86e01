"""TensorBoard's event file format, written and read with the standard library only.

An event file is a sequence of TFRecords (``uint64 length, uint32 masked CRC32C of the length,
data, uint32 masked CRC32C of the data``, little-endian), each holding one ``tensorflow.Event``
protobuf. The first event names the format (``file_version: "brain.Event:2"``); each later one
carries a wall time, a step and a ``Summary`` of scalar values (``tag``, ``simple_value``).
Those few fields are all a scalar curve needs, so they are encoded here by hand (~100 lines)
instead of depending on ``tensorboard`` (with protobuf, grpcio and its web server, tens of MB
that no rank needs); every reader of the format (TensorBoard, tbparse, W&B, MLflow) reads them.
The field numbers are those of tensorflow/core/util/event.proto and summary.proto.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

FILE_VERSION = b"brain.Event:2"
_MASK_DELTA = 0xA282EAD8


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli, reflected
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's checksum: a CRC of data that holds CRCs is weak, so it is rotated and offset."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord framing ``data``."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc(length)) + data
            + struct.pack("<I", masked_crc(data)))


def records(buffer: bytes) -> Iterator[bytes]:
    """The records of an event file, up to the first one that is torn or corrupt (a writer
    killed mid-record leaves a partial one at the end)."""
    pos = 0
    while pos + 12 <= len(buffer):
        header = buffer[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", buffer[pos + 8:pos + 12])
        end = pos + 12 + length + 4
        if header_crc != masked_crc(header) or end > len(buffer):
            return
        data = buffer[pos + 12:end - 4]
        if struct.unpack("<I", buffer[end - 4:end])[0] != masked_crc(data):
            return
        yield data
        pos = end


# --- protobuf: the wire format of the few fields used ------------------------------------------

def _varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF  # int64: negative numbers as ten bytes, as protobuf does
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def _fields(message: bytes) -> Iterator[tuple[int, int | float | bytes]]:
    """(field number, value) of a message: varints as int, fixed64 as double, fixed32 as
    float, length-delimited as bytes."""
    pos = 0
    while pos < len(message):
        key, pos = _read_varint(message, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(message, pos)
        elif wire == 1:
            (value,), pos = struct.unpack_from("<d", message, pos), pos + 8
        elif wire == 5:
            (value,), pos = struct.unpack_from("<f", message, pos), pos + 4
        elif wire == 2:
            length, pos = _read_varint(message, pos)
            value, pos = message[pos:pos + length], pos + length
        else:
            raise ValueError(f"protobuf wire type {wire} is not used by scalar events")
        yield number, value


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


# --- events ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """One event: the file's version line (``step`` None, no values), or scalars at a step."""

    wall_time: float
    step: int | None = None
    values: tuple[tuple[str, float], ...] = ()
    version: bytes = b""


def encode(event: Event) -> bytes:
    """``tensorflow.Event``: wall_time = 1 (double), step = 2 (int64), file_version = 3,
    summary = 5; ``Summary.value`` = 1; ``Summary.Value``: tag = 1, simple_value = 2 (float)."""
    out = _field(1, 1, struct.pack("<d", event.wall_time))
    if event.step is not None:
        out += _field(2, 0, _varint(event.step))
    if event.version:
        out += _bytes_field(3, event.version)
    if event.values:
        summary = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", v)))
            for tag, v in event.values)
        out += _bytes_field(5, summary)
    return out


def decode(data: bytes) -> Event:
    """``encode``'s inverse (other fields of an Event are skipped)."""
    fields = dict(wall_time=0.0, step=None, version=b"")
    values = []
    for number, value in _fields(data):
        if number in (1, 2, 3):
            fields[("wall_time", "step", "version")[number - 1]] = value
        elif number == 5:
            for _, item in _fields(value):
                parts = dict(_fields(item))
                values.append((parts.get(1, b"").decode(), parts.get(2, 0.0)))
    if fields["step"] is not None and fields["step"] >= 1 << 63:
        fields["step"] -= 1 << 64
    return Event(values=tuple(values), **fields)


def read_events(buffer: bytes) -> list[Event]:
    return [decode(data) for data in records(buffer)]
