"""What the TCP side channel (``launcher.faults.side_socket``) sends: frames, and the nodes'
list its start-up gathers.

A frame is a header line ``SOURCE KIND_LENGTH PAYLOAD_LENGTH``, the kind and the payload. Its
kind is ``b`` for a beat, ``l`` for "this rank left", and ``m`` and the message's kind for a
message, whose payload starts with a line of its origin's address ("" when unknown) and its
broadcast number (-1 for none). Frames, not pickles: anyone who reaches the port could send
one, and bytes that are not frames end their connection.
"""

from __future__ import annotations

import json

BEAT, LEFT, MESSAGE = "b", "l", "m"
#: the largest frame taken (a hang's stacks are tens of KB): more is not a rank speaking
MAX_FRAME = 64 << 20


def frame(source: int, kind: str, payload: bytes) -> bytes:
    name = kind.encode()
    return b"%d %d %d\n" % (source, len(name), len(payload)) + name + payload


def unframe(data: bytes) -> tuple[list[tuple[int, str, bytes]], int]:
    """The whole frames in ``data`` (source, kind, payload), and where the next one starts;
    ValueError for bytes that are not frames."""
    frames, offset = [], 0
    while (end := data.find(b"\n", offset)) >= 0:
        source, kind_len, payload_len = (int(field) for field in data[offset:end].split())
        if not 0 <= kind_len + payload_len <= MAX_FRAME:
            raise ValueError("not a frame")
        body = end + 1
        if body + kind_len + payload_len > len(data):
            break
        kind = data[body:body + kind_len].decode()
        frames.append((source, kind, data[body + kind_len:body + kind_len + payload_len]))
        offset = body + kind_len + payload_len
    return frames, offset


def encode_item(address: str, item: tuple) -> bytes:
    origin, sequence, kind, payload = item
    number = -1 if sequence is None else sequence
    return frame(origin, MESSAGE + kind, b"%s %d\n" % (address.encode(), number) + payload)


def decode_item(framed: tuple[int, str, bytes]) -> tuple[str, tuple]:
    """The origin's address ("" when unknown) and the message (origin, number, kind,
    payload) of a message's frame."""
    origin, kind, body = framed
    head, _, payload = body.partition(b"\n")
    address, sequence = head.decode().rsplit(" ", 1)
    number = int(sequence)
    return address, (origin, None if number < 0 else number, kind[len(MESSAGE):], payload)


def runs(nodes: list[str]) -> str:
    """Every rank's node as one run-length list: O(nodes) bytes, not O(ranks)."""
    counted: list[list] = []
    for node in nodes:
        if counted and counted[-1][0] == node:
            counted[-1][1] += 1
        else:
            counted.append([node, 1])
    return json.dumps(counted)


def expand(listed: bytes) -> list[str]:
    return [node for node, count in json.loads(listed) for _ in range(count)]
