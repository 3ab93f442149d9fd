"""A pre-scan of a pickle's opcodes that bounds the work and memory of decoding it.

The allow-list (`tierckpt.dcp_metadata`) stops code from running, not algorithmic bombs
(audit 3, H1): a tuple nested 30 levels deep with each level memoized once is 170 bytes
and 2^30 leaves; hashing it (a dict key, a frozenset) or printing it takes hours with the
GIL held. `scan` walks the opcodes *before any object is built*, simulating the
unpickler's stack and memo with one small record per object, and refuses a pickle when:

- the logical (fully expanded) size of what it builds exceeds `budget`: a memo GET of a
  container counts the container's whole expanded size again, a string counts one per
  ``STRING_UNIT`` characters, so the memoized-tuple bomb is refused at its first levels;
- it builds more than `containers_budget` containers and objects (what decoding *holds
  in memory*, about 60 to 250 bytes each, where a memo GET costs one reference): a
  ``.metadata`` of 16M ``EMPTY_LIST`` opcodes in one list is 16M objects, 2 GiB for the
  decoder from 16 MB, while real DCP metadata builds about one per 9 bytes. A set or
  frozenset counts `SET_WEIGHT` (its table is 216 bytes empty);
- an object nests deeper than `MAX_DEPTH` (hash and repr of deep tuples recurse in C);
- a container or instance is changed after a memo GET handed it out again (a recursive
  structure, or one grown after its expanded size was counted: plain DCP metadata has
  neither), or anything but a fresh container or instance is changed (``BUILD`` onto a
  class, a function, an enum member: process-wide objects);
- a memo index is sparse (the C unpickler sizes its memo array by the largest index);
- it uses an opcode plain data never needs (persistent ids, extension codes, ``INST``/
  ``OBJ``, out-of-band buffers), or its opcode stream is malformed.

The cost is linear in the input, one pass in Python. What the scan cannot see (the
arguments a ``REDUCE`` hands to ``bytearray``) is checked by the callables the
allow-list resolves (`dcp_metadata`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["MAX_DEPTH", "SET_WEIGHT", "STRING_UNIT", "ScanRefused", "Scanned", "scan"]

MAX_DEPTH = 100
"""Deepest nesting of containers and objects admitted (DCP metadata nests about 10)."""

STRING_UNIT = 64
"""A string, bytes or int literal counts 1 + len // STRING_UNIT toward the budget."""

SET_WEIGHT = 4
"""What a set or frozenset counts toward the container budget (a list or dict counts 1)."""

# Kinds of stack entries. Atoms and immutable containers are tuples (weight, kind, depth,
# payload); containers and objects that later opcodes may change are lists [weight, kind,
# depth, shared, made_by] ("shared": a memo GET or DUP handed it out again; "made_by": the
# (module, name) of the global whose REDUCE/NEWOBJ made it, or None).
_ATOM, _STR, _GLOBAL, _FROZEN, _CONTAINER, _INSTANCE, _OTHER = range(7)
_ONE = (1, _ATOM, 0, None)
_SETS = frozenset(
    {("builtins", "set"), ("builtins", "frozenset")}
)  # None, bools, ints, floats, (): one unit, no payload


class ScanRefused(Exception):
    """Why the scan refused the pickle; `malformed`: the opcode stream is unreadable."""

    def __init__(self, why: str, *, malformed: bool = False) -> None:
        super().__init__(why)
        self.malformed = malformed


def _text(name: bytes) -> str:
    if len(name) > 256:
        raise ScanRefused(f"a global name of {len(name)} bytes")
    return name.decode("utf-8", "replace")


def _name(data: bytes, node: Any) -> str:
    if node[1] != _STR:
        raise ScanRefused("STACK_GLOBAL of something that is not a string", malformed=True)
    start, end = node[3]
    return _text(data[start:end])


class Scanned(NamedTuple):
    """What a scan admitted: the logical (expanded) object count of the result and the
    containers and objects decoding builds (how `tierckpt.dcp_metadata` sets its
    per-byte bounds from real files)."""

    objects: int
    containers: int


def scan(
    data: bytes,
    *,
    budget: int,
    fresh: frozenset[tuple[str, str]],
    containers: frozenset[tuple[str, str]],
    containers_budget: int | None = None,
) -> Scanned:
    """Refuse `data` (raise `ScanRefused`) unless decoding it stays within the bounds
    above; `budget` caps its logical object count, `containers_budget` (default: no
    cap beyond the input's size) the containers and objects it builds.

    Args:
        fresh: the globals whose ``NEWOBJ``/``REDUCE`` makes a new instance a ``BUILD``
            may fill (DCP's dataclasses); any other ``BUILD`` target is refused.
        containers: the globals whose ``REDUCE`` makes a new container that ``SETITEM``,
            ``APPENDS`` or ``ADDITEMS`` may fill (``OrderedDict``, ``set``).
    """
    cap = len(data) * SET_WEIGHT if containers_budget is None else containers_budget
    try:
        return _scan(data, budget, fresh, containers, cap)
    except (IndexError, ValueError) as e:  # an argument or a memo entry past the end
        raise ScanRefused(f"truncated or malformed ({type(e).__name__})", malformed=True) from None


def _over(budget: int) -> ScanRefused:
    return ScanRefused(
        f"it expands to more than {budget} objects (a memoized container counts its whole "
        "size each time it is referenced)"
    )


def _many(cap: int) -> ScanRefused:
    return ScanRefused(
        f"it builds more than {cap} containers and objects, the memory bound for its size "
        "(real DCP metadata builds about one per 9 bytes)"
    )


def _deep() -> ScanRefused:
    return ScanRefused(f"it nests deeper than {MAX_DEPTH} levels")


def _target(stack: list[Any], kind: int, what: str) -> Any:
    node = stack[-1]
    if node[1] != kind:
        if node[1] == _GLOBAL:
            module, name = node[3]
            raise ScanRefused(f"it tried to change {module}.{name} ({what})")
        if node[1] == _OTHER:
            module, name = node[4]
            raise ScanRefused(f"it tried to change what {module}.{name} returns ({what})")
        raise ScanRefused(f"{what} onto something that is not a fresh object")
    if node[3]:
        raise ScanRefused(
            f"{what} onto an object after it was referenced again (a recursive or re-grown "
            "structure)"
        )
    return node


def _grow(node: Any, items: list[Any]) -> None:
    node[0] += sum([i[0] for i in items])
    depth = max([i[2] for i in items], default=-1) + 1
    if depth > node[2]:
        if depth > MAX_DEPTH:
            raise _deep()
        node[2] = depth


def _made(callable_: Any, args: Any, what: str, fresh: Any, containers: Any) -> Any:
    if callable_[1] != _GLOBAL:
        raise ScanRefused(f"{what} of something that is not an admitted global")
    ref = callable_[3]
    kind = _INSTANCE if ref in fresh else _CONTAINER if ref in containers else _OTHER
    depth = args[2] + 1
    if depth > MAX_DEPTH:
        raise _deep()
    return [1 + args[0], kind, depth, False, ref]


def _malformed(why: str, pos: int) -> ScanRefused:
    return ScanRefused(f"{why} at byte {pos}", malformed=True)


def _scan(data: bytes, budget: int, fresh: Any, containers: Any, cap: int) -> Scanned:
    """The loop of `scan`, written for speed (it is pure Python, one pass): fixed-width
    arguments are read without bounds checks (an IndexError past the end is malformed),
    and ops that add one object are not counted one by one: there are fewer of them than
    bytes, so `heavy` (everything else: memo GETs, long literals) may use the budget less
    the input's size. `built` counts the ops that make a container or an object, checked
    against `cap` as it grows."""
    size = len(data)
    heavy_budget = budget - size
    heavy = 0
    built = 0
    pos = 0
    stack: list[Any] = []
    push = stack.append
    marks: list[list[Any]] = []
    memo: list[Any] = []
    unit = STRING_UNIT
    one = _ONE
    frombytes = int.from_bytes
    kinds = {ref: _CONTAINER for ref in containers}
    kinds.update({ref: _INSTANCE for ref in fresh})
    glob, other, instance, container = _GLOBAL, _OTHER, _INSTANCE, _CONTAINER
    while True:
        op = data[pos]
        pos += 1
        if op == 0x94:  # MEMOIZE
            memo.append(stack[-1])
        elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
            if op == 0x68:
                idx = data[pos]
                pos += 1
            else:
                idx = frombytes(data[pos : pos + 4], "little")
                pos += 4
            node = memo[idx]
            heavy += node[0]
            if heavy > heavy_budget:
                raise _over(budget)
            if node.__class__ is list:
                node[3] = True
            push(node)
        elif op == 0x4B:  # BININT1
            pos += 1
            push(one)
        elif op == 0x28:  # MARK
            marks.append(stack)
            stack = []
            push = stack.append
        elif op == 0x29 or op == 0x89 or op == 0x4E or op == 0x88:  # (), False, None, True
            push(one)
        elif op == 0x81 or op == 0x52:  # NEWOBJ, REDUCE
            args = stack.pop()
            node = stack[-1]
            if node[1] != glob or args[2] >= MAX_DEPTH:
                _made(node, args, "NEWOBJ" if op == 0x81 else "REDUCE", fresh, containers)
            ref = node[3]
            stack[-1] = [1 + args[0], kinds.get(ref, other), args[2] + 1, False, ref]
            built += SET_WEIGHT if ref in _SETS else 1
            if built > cap:
                raise _many(cap)
        elif op == 0x85:  # TUPLE1
            a = stack[-1]
            if a[2] >= MAX_DEPTH:
                raise _deep()
            stack[-1] = (1 + a[0], _FROZEN, a[2] + 1, None)
            built += 1
            if built > cap:
                raise _many(cap)
        elif op == 0x62:  # BUILD
            state = stack.pop()
            node = stack[-1]
            if node[1] != instance or node[3]:
                _target(stack, _INSTANCE, "BUILD")  # raises
            node[0] += state[0]
            if state[2] >= node[2]:
                if state[2] >= MAX_DEPTH:
                    raise _deep()
                node[2] = state[2] + 1
        elif op == 0x75 or op == 0x65 or op == 0x90:  # SETITEMS, APPENDS, ADDITEMS
            items = stack
            stack = marks.pop()
            push = stack.append
            node = stack[-1]
            if node[1] != container or node[3]:
                _target(stack, _CONTAINER, "adding items")  # raises
            _grow(node, items)
        elif op == 0x7D or op == 0x5D or op == 0x8F:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
            push([1, _CONTAINER, 0, False, None])
            built += SET_WEIGHT if op == 0x8F else 1
            if built > cap:
                raise _many(cap)
        elif op == 0x86:  # TUPLE2
            b = stack.pop()
            a = stack[-1]
            depth = (a[2] if a[2] > b[2] else b[2]) + 1
            if depth > MAX_DEPTH:
                raise _deep()
            stack[-1] = (1 + a[0] + b[0], _FROZEN, depth, None)
            built += 1
            if built > cap:
                raise _many(cap)
        elif op == 0x87:  # TUPLE3
            items = stack[-3:]
            if len(items) < 3:
                raise _malformed("TUPLE3 with too few items", pos)
            del stack[-3:]
            depth = max([i[2] for i in items]) + 1
            if depth > MAX_DEPTH:
                raise _deep()
            push((1 + sum([i[0] for i in items]), _FROZEN, depth, None))
            built += 1
            if built > cap:
                raise _many(cap)
        elif op == 0x8C or op == 0x58 or op == 0x8D:  # SHORT_BINUNICODE, BINUNICODE(8)
            width = 1 if op == 0x8C else 4 if op == 0x58 else 8
            n = frombytes(data[pos : pos + width], "little")
            start = pos + width
            pos = start + n
            if pos > size:
                raise _malformed("a string past the end of the data", pos)
            push((1 + n // unit, _STR, 0, (start, pos)))
            if n >= unit:
                heavy += n // unit
                if heavy > heavy_budget:
                    raise _over(budget)
        elif op == 0x4D:  # BININT2
            pos += 2
            push(one)
        elif op == 0x4A:  # BININT
            pos += 4
            push(one)
        elif op == 0x47:  # BINFLOAT
            pos += 8
            push(one)
        elif op == 0x73 or op == 0x61:  # SETITEM, APPEND
            n = 2 if op == 0x73 else 1
            items = stack[-n:]
            if len(stack) < n + 1:
                raise _malformed("SETITEM or APPEND with too few items", pos)
            del stack[-n:]
            _grow(_target(stack, _CONTAINER, "adding items"), items)
        elif op in _SIZED:  # a length-prefixed literal: a string, bytes or LONG1/4 int
            width = _SIZED[op]
            n = frombytes(data[pos : pos + width], "little")
            pos += width + n
            if pos > size:
                raise _malformed("a literal past the end of the data", pos)
            push((1 + n // unit, _ATOM, 0, None))
            heavy += n // unit
            if heavy > heavy_budget:
                raise _over(budget)
        elif op == 0x93:  # STACK_GLOBAL
            name = _name(data, stack.pop())
            module = _name(data, stack[-1])
            stack[-1] = (1, _GLOBAL, 0, (module, name))
        elif op == 0x74 or op == 0x91 or op == 0x6C or op == 0x64:  # TUPLE FROZENSET LIST DICT
            items = stack
            stack = marks.pop()
            push = stack.append
            depth = max([i[2] for i in items], default=-1) + 1
            if depth > MAX_DEPTH:
                raise _deep()
            weight = 1 + sum([i[0] for i in items])
            built += SET_WEIGHT if op == 0x91 else 1
            if built > cap:
                raise _many(cap)
            if op == 0x74 or op == 0x91:
                push((weight, _FROZEN, depth, None))
            else:
                push([weight, _CONTAINER, depth, False, None])
        elif op == 0x71 or op == 0x72 or op == 0x70:  # BINPUT, LONG_BINPUT, PUT
            if op == 0x71:
                idx = data[pos]
                pos += 1
            elif op == 0x72:
                idx = frombytes(data[pos : pos + 4], "little")
                pos += 4
            else:
                idx, pos = _decimal(data, pos)
            if idx > len(memo):
                raise ScanRefused(f"a sparse memo index {idx} ({len(memo)} entries so far)")
            if idx == len(memo):
                memo.append(stack[-1])
            else:
                memo[idx] = stack[-1]
        elif op == 0x95:  # FRAME
            pos += 8
        elif op == 0x80:  # PROTO
            pos += 1
        elif op == 0x2E:  # STOP
            if marks or len(stack) != 1:
                raise _malformed("STOP with a MARK open or not exactly one object", pos)
            if pos > size:
                raise _malformed("an argument past the end of the data", pos)
            return Scanned(stack[0][0], built)
        elif op == 0x63:  # GLOBAL
            end = data.index(b"\n", pos)
            module = _text(data[pos:end])
            pos = data.index(b"\n", end + 1) + 1
            push((1, _GLOBAL, 0, (module, _text(data[end + 1 : pos - 1]))))
        elif op == 0x67 or op == 0x32:  # GET, DUP
            if op == 0x67:
                idx, pos = _decimal(data, pos)
                node = memo[idx]
            else:
                node = stack[-1]
            heavy += node[0]
            if heavy > heavy_budget:
                raise _over(budget)
            if node.__class__ is list:
                node[3] = True
            push(node)
        elif op == 0x92:  # NEWOBJ_EX
            kwargs = stack.pop()
            args = stack.pop()
            both = (args[0] + kwargs[0], _FROZEN, max(args[2], kwargs[2]), None)
            stack[-1] = _made(stack[-1], both, "NEWOBJ_EX", fresh, containers)
            built += 1
            if built > cap:
                raise _many(cap)
        elif op == 0x30:  # POP
            if stack:
                stack.pop()
            else:
                stack = marks.pop()
                push = stack.append
        elif op == 0x31:  # POP_MARK
            stack = marks.pop()
            push = stack.append
        elif op in (0x49, 0x4C, 0x46, 0x53, 0x56):  # INT, LONG, FLOAT, STRING, UNICODE
            end = data.index(b"\n", pos)
            n = end - pos
            push((1 + n // unit, _STR if op == 0x56 else _ATOM, 0, (pos, end)))
            heavy += n // unit
            if heavy > heavy_budget:
                raise _over(budget)
            pos = end + 1
        else:
            named = _REFUSED_OPS.get(op)
            if named:
                raise ScanRefused(f"it uses the {named}, which plain data never needs")
            raise _malformed(f"an unknown opcode 0x{op:02x}", pos - 1)


# Length-prefixed literals and the width of their length: SHORT_BINSTRING, BINSTRING,
# SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8, LONG1, LONG4.
_SIZED = {0x55: 1, 0x54: 4, 0x43: 1, 0x42: 4, 0x8E: 8, 0x96: 8, 0x8A: 1, 0x8B: 4}
_REFUSED_OPS = {
    0x50: "PERSID opcode (a persistent id)",
    0x51: "BINPERSID opcode (a persistent id)",
    0x82: "EXT1 opcode (an extension code)",
    0x83: "EXT2 opcode (an extension code)",
    0x84: "EXT4 opcode (an extension code)",
    0x69: "INST opcode",
    0x6F: "OBJ opcode",
    0x97: "NEXT_BUFFER opcode (an out-of-band buffer)",
    0x98: "READONLY_BUFFER opcode (an out-of-band buffer)",
}


def _decimal(data: bytes, pos: int) -> tuple[int, int]:
    """A protocol-0 memo index (PUT, GET): the index and the position after its line."""
    end = data.index(b"\n", pos)
    text = data[pos:end]
    if not (0 < len(text) <= 10 and text.isdigit()):
        raise ScanRefused(f"a memo index {text[:20]!r} that is not a small decimal", malformed=True)
    return int(text), end + 1
