"""Protobuf wire-format helpers for the fuzzer (tests/support/fuzz.py): walking fields
without a schema (to mutate a message, and to find every string a lenient decoder could
read) and mutating serialized messages."""

from __future__ import annotations

import random
from collections.abc import Iterator

from google.protobuf import descriptor as pb
from google.protobuf.message import Message

__all__ = ["message_strings", "mutate", "raw_strings", "spans", "varint"]


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def spans(buf: bytes) -> Iterator[tuple[int, int, int, int, int]]:
    """(field, wire type, start, value start, end) of each field, until the first error."""
    pos, n = 0, len(buf)
    while pos < n:
        start = pos
        key = shift = 0
        while True:
            if pos >= n or shift > 63:
                return
            byte = buf[pos]
            pos += 1
            key |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        field, wire = key >> 3, key & 7
        vstart = pos
        if wire == 0:
            while pos < n and buf[pos] & 0x80:
                pos += 1
            pos += 1
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length = shift = 0
            while True:
                if pos >= n or shift > 63:
                    return
                byte = buf[pos]
                pos += 1
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            vstart = pos
            pos += length
        elif wire not in (3, 4):  # groups: their fields follow at this level
            return
        if pos > n:
            return
        yield field, wire, start, vstart, pos


def raw_strings(buf: bytes, depth: int = 0) -> Iterator[str]:
    """Every length-delimited value, at every depth, that is UTF-8: a superset of the
    strings any protobuf decoder (or a lenient hand-written one) could see in `buf`."""
    for _field, wire, _start, vstart, end in spans(buf):
        if wire != 2:
            continue
        value = buf[vstart:end]
        try:
            yield value.decode()
        except UnicodeDecodeError:
            pass
        if depth < 6:
            yield from raw_strings(value, depth + 1)


def message_strings(msg: Message) -> Iterator[str]:
    for f, value in msg.ListFields():
        values = value if f.is_repeated else [value]
        for v in values:
            if f.type == pb.FieldDescriptor.TYPE_STRING:
                yield v
            elif f.type == pb.FieldDescriptor.TYPE_MESSAGE:
                yield from message_strings(v)


def mutate(rng: random.Random, raw: bytes) -> tuple[bytes, str]:
    """1-3 of: bit flips, truncation, a duplicated field, inserted bytes, a bogus length,
    an unknown field; returns the bytes and a label naming the operations."""
    buf = bytearray(raw)
    ops = []
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(("flip", "truncate", "duplicate", "insert", "bad-length", "unknown"))
        ops.append(op)
        fields = list(spans(bytes(buf)))
        if op == "flip" and buf:
            for _ in range(rng.randint(1, 8)):
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif op == "truncate" and buf:
            del buf[rng.randrange(len(buf)) :]
        elif op == "duplicate" and fields:
            _, _, start, _, end = rng.choice(fields)
            at = rng.choice([f[2] for f in fields] + [len(buf)])
            buf[at:at] = buf[start:end]
        elif op == "insert":
            at = rng.randint(0, len(buf))
            buf[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == "bad-length":
            lengths = [f for f in fields if f[1] == 2]
            if lengths:
                field, _, start, vstart, end = rng.choice(lengths)
                huge = varint(rng.choice((2**31, 2**63, end - vstart + 1)))
                buf[start:vstart] = varint(field << 3 | 2) + huge
        else:
            field, wire = rng.choice((15, 1000, 2**29 - 1)), rng.choice((0, 1, 2, 3, 5, 7))
            buf += varint(field << 3 | wire) + rng.randbytes(rng.randint(0, 9))
    return bytes(buf), f"mutated({','.join(ops)})"
