"""Seeded generator of hostile requests for every RPC of DaemonService and PeerService.

The fuzz test (tests/integration/test_fuzz.py) and its soak (bench/fuzz_soak.py) draw
call `i` of seed `s` from its own `random.Random(f"{s}/{i}")`, so any call reproduces on
its own, whatever the daemon answered before: `python -m tests.support.fuzz SEED INDEX`
prints it. A payload is random bytes, a message built from the generated protobuf classes
with the audit's hostile names and numbers (or a plausible one, so deeper code runs), or a
mutation of a serialized message (bit flips, truncation, duplicated fields, bogus lengths;
tests/support/fuzz_wire.py). One call in a hundred is a whole local save (`SAVE`) whose
`.metadata` may be hostile, so the drain to the persistent tier is fuzzed too.

Names may hold '/' and '..' (audit C2: an unvalidated peer name becomes a path). So that a
daemon with that bug cannot touch the host, every message passes `Fuzzer.escapes`: no
string in it is an absolute path outside `sandbox` or climbs more than two levels, and the
test runs the daemon deep enough inside a private tree that any mix of such names stays in
it (then asserts that nothing in the tree outside the memory dir changed).
"""

from __future__ import annotations

import math
import os
import pickle
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf import descriptor as pb
from google.protobuf import message_factory, text_format
from google.protobuf.message import DecodeError, Message
from tierckpt.checksum import checksum_bytes
from tierckpt.v1 import common_pb2, daemon_pb2, peer_pb2

from tests.support.fuzz_wire import message_strings, mutate, raw_strings

__all__ = [
    "ESCAPE_MARK",
    "MAX_UPS",
    "NODE_ID",
    "NODE_METADATA",
    "PEER_ID",
    "SAVE",
    "Call",
    "Fuzzer",
    "Method",
    "Save",
    "methods",
]

NODE_ID = "fznode"  # the fuzzed daemon's node id
PEER_ID = "fzpeer"  # the configured peer the fuzzer poses as
NODE_METADATA = "x-tierckpt-node"  # a peer's claimed node id (tierckptd.peers.security)
ESCAPE_MARK = "fuzzesc"  # every name meant to escape a directory contains this
MAX_UPS = 2  # '..' components allowed in one string (a path joins at most 3 names)
_MAX_DEPTH = 4  # nesting of generated messages
_WIDE = 300  # items of a "wide" repeated string field (audit M5: unbounded echo)

_INT32 = (0, 1, -1, 2**31 - 1, -(2**31))
_UINT32 = (0, 1, 2**31, 2**32 - 1)
_UINT64 = (0, 1, 2**31, 2**63, 2**64 - 1, 64 << 20)
_FLOATS = (0.0, -1.0, 1e308, math.nan, math.inf, -math.inf, 4e9)
_NOW = 1.7e9  # a fixed "now": payloads must not depend on the clock
SAVE_SHARE = 0.01  # calls that are a whole local save (method SAVE)

T = TypeVar("T")


@dataclass(frozen=True)
class Method:
    """One RPC, read from the generated descriptors (so a new RPC is fuzzed at once)."""

    service: str
    name: str
    request: type[Message]
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


def methods() -> tuple[Method, ...]:
    """Every method of every service in daemon.proto and peer.proto."""
    out: list[Method] = []
    for file in (daemon_pb2.DESCRIPTOR, peer_pb2.DESCRIPTOR):
        for service in file.services_by_name.values():
            for m in service.methods:
                request = message_factory.GetMessageClass(m.input_type)
                out.append(
                    Method(
                        service.full_name, m.name, request, m.client_streaming, m.server_streaming
                    )
                )
    return tuple(out)


@dataclass(frozen=True)
class Save:
    """A local save the harness performs as a rank would (Begin, Reserve, Open, write,
    CommitFile, CommitCheckpoint), so hostile `.metadata` bytes reach the drain."""

    namespace: str
    checkpoint_id: str
    files: tuple[tuple[str, bytes], ...]  # (name, content)
    corrupt: str = ""  # a file whose written bytes differ from what its commit claims


class _Marker:
    """Unpickling this creates `path` (audit C1): a daemon that executes a checkpoint's
    `.metadata` leaves the file behind, inside the sandbox, where the test looks."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.path, "w")


def _dcp_metadata() -> bytes:
    """A real, empty DCP `.metadata` (what FileSystemWriter pickles)."""
    from torch.distributed.checkpoint.metadata import Metadata

    return pickle.dumps(Metadata(state_dict_metadata={}))


SAVE = Method("tierckpt.v1.DaemonService", "Save", daemon_pb2.CommitCheckpointRequest, False, False)


@dataclass(frozen=True)
class Call:
    """One generated call: the serialized request message(s) and how they were made."""

    seed: int
    index: int
    method: Method
    messages: tuple[bytes, ...]  # one, or the chunks of a client stream
    kinds: tuple[str, ...]  # per message: random / struct / plausible / mutated(ops)
    metadata: tuple[tuple[str, str], ...] = ()  # the caller a PeerService call claims
    save: Save | None = None  # method SAVE: a composite local save instead of `messages`

    def parsed(self) -> list[Message | None]:
        """Each message as the daemon's protobuf would decode it (None: it does not parse)."""
        out: list[Message | None] = []
        for raw in self.messages:
            try:
                out.append(self.method.request.FromString(raw))
            except DecodeError:
                out.append(None)
        return out

    @property
    def parses(self) -> bool:
        return all(m is not None for m in self.parsed())

    def describe(self, limit: int = 300) -> str:
        if self.save is not None:
            files = ", ".join(f"{n} ({len(c)} B {c[:12]!r})" for n, c in self.save.files)
            lie = f", {self.save.corrupt} corrupt" if self.save.corrupt else ""
            return f"Save {self.save.namespace}/{self.save.checkpoint_id}: {files}{lie}"
        parts = []
        for kind, raw, msg in zip(self.kinds, self.messages, self.parsed(), strict=True):
            if msg is None:
                body = f"unparseable {raw[:24].hex()}{'...' if len(raw) > 24 else ''}"
            else:
                body = text_format.MessageToString(msg, as_one_line=True)
                body = body if len(body) <= limit else body[:limit] + "..."
            parts.append(f"[{kind}, {len(raw)} B] {body}")
        who = f" as {self.metadata[0][1][:20]!r}" if self.metadata else ""
        return f"{self.method.name}{who}: " + " | ".join(parts)

    @property
    def reproduce(self) -> str:
        return f"python -m tests.support.fuzz {self.seed} {self.index}"


class Fuzzer:
    """Deterministic payloads per (seed, index) for the methods of both services.

    Args:
        seed: the run's seed.
        node_id: the daemon's node id (a plausible owner_node / replica).
        sandbox: an absolute dir that absolute names may point into; it must sit at least
            seven levels above anything the daemon uses as a path base.
    """

    def __init__(
        self, seed: int, *, node_id: str, peer_id: str, sandbox: str, only: str = ""
    ) -> None:
        self.seed = seed
        self.sandbox = sandbox.rstrip("/")
        self.peer_id = peer_id
        self.methods = tuple(m for m in methods() if re.search(only, m.name))
        self.valid = (
            "fz",
            "fz-2",
            "step-1",
            "step-2",
            "__0_0.distcp",
            ".metadata",
            node_id,
            peer_id,
        )
        # Who a PeerService call claims to be (x-tierckpt-node): mostly the configured peer,
        # so calls get past authorization; sometimes nobody, a stranger, or this node itself.
        self.callers = (peer_id,) * 8 + (None, "", "n1", node_id, "x" * 300)
        self.hostile = (
            *("", ".", "..", "a/b", "a\x00b", "é", "\u202e", " ", "*", "%s%n", "{0}"),
            *("step-1\n", "x\nERROR forged log line", "\x1b[31mred", "x" * 129, "a" * 128),
            "x" * 5000,
            f"../{ESCAPE_MARK}",
            f"../../{ESCAPE_MARK}-2",
            "../..",
            f"{self.sandbox}/{ESCAPE_MARK}-abs",
        )
        self.absolute_names = (
            f"{self.sandbox}/{ESCAPE_MARK}-abs",
            f"{self.sandbox}/{ESCAPE_MARK}-path",
        )
        # Refs of plausible publishes, pushes and saves: few, so that they meet.
        self.refs = tuple((ns, f"step-{i}") for ns in ("fz", "fz-2") for i in range(1, 4))
        self.saves = bool(re.search(only, SAVE.name))
        self.marker = f"{self.sandbox}/{ESCAPE_MARK}-pwned"
        base = random.Random(f"{seed}/contents")
        real = _dcp_metadata()
        # `.metadata` candidates: real, truncated, other pickles, a code-running pickle.
        self.metadata_files = (
            real,
            real[: len(real) // 2],
            pickle.dumps({"fz": [1, 2.0, "x"]}),
            pickle.dumps(_Marker(self.marker)),
            base.randbytes(100),
            b"",
        )
        # Files a plausible publish announces and a plausible push sends, so they match.
        self.contents = (
            base.randbytes(100),
            base.randbytes(5000),
            b"\0" * 4096,
            real,
            pickle.dumps(_Marker(self.marker)),
        )

    # -- entry point ---------------------------------------------------------------
    def call(self, index: int) -> Call:
        rng = random.Random(f"{self.seed}/{index}")
        method = rng.choice(self.methods) if self.methods else SAVE
        caller = rng.choice(self.callers)
        metadata = (
            ()
            if caller is None or "PeerService" not in method.service
            else ((NODE_METADATA, caller),)
        )
        if method is SAVE or (self.saves and rng.random() < SAVE_SHARE):
            return Call(self.seed, index, SAVE, (), ("save",), save=self._save(rng))
        messages: tuple[bytes, ...] = (b"",)
        kinds: tuple[str, ...] = ("empty",)
        for _ in range(64):
            candidate, made = self._messages(rng, method)
            if not any(self.escapes(m, method.request) for m in candidate):
                messages, kinds = candidate, made
                break
        return Call(self.seed, index, method, messages, kinds, metadata)

    def _save(self, rng: random.Random) -> Save:
        namespace = rng.choice(("fz", "fz-2"))
        files = [(".metadata", rng.choice(self.metadata_files))]
        files += [
            (f"__{rank}_0.distcp", rng.randbytes(rng.choice((0, 100, 8192))))
            for rank in range(rng.randint(0, 2))
        ]
        corrupt = rng.choice([name for name, _ in files]) if rng.random() < 0.1 else ""
        return Save(namespace, f"step-{rng.randint(4, 10**6)}", tuple(files), corrupt)

    def escapes(self, raw: bytes, request: type[Message]) -> bool:
        """Whether some string the daemon could read from `raw` leaves the sandbox."""
        try:
            strings: Iterator[str] = message_strings(request.FromString(raw))
        except DecodeError:
            strings = raw_strings(raw)
        return any(self._escaping(s) for s in strings)

    def _escaping(self, s: str) -> bool:
        if s.startswith("/") and not s.startswith(self.sandbox + "/"):
            return True
        return s.split("/").count("..") > MAX_UPS

    # -- payloads ------------------------------------------------------------------
    def _messages(
        self, rng: random.Random, method: Method
    ) -> tuple[tuple[bytes, ...], tuple[str, ...]]:
        if method.client_streaming:
            if rng.random() < 0.4:
                chunks = self._plausible_push(rng)
                return chunks, ("push-header",) + ("push-data",) * (len(chunks) - 1)
            pairs = [self._payload(rng, method) for _ in range(rng.randint(1, 5))]
            return tuple(p for p, _ in pairs), tuple(k for _, k in pairs)
        payload, kind = self._payload(rng, method)
        return (payload,), (kind,)

    def _payload(self, rng: random.Random, method: Method) -> tuple[bytes, str]:
        r = rng.random()
        if r < 0.2:
            size = rng.choice((0, rng.randint(1, 16), rng.randint(17, 256), rng.randint(257, 4096)))
            return rng.randbytes(size), "random"
        if r < 0.55:
            return self._build(rng, method.request.DESCRIPTOR, 0.5).SerializeToString(), "struct"
        if r < 0.75:
            return self._plausible(rng, method).SerializeToString(), "plausible"
        hostility = rng.choice((0.05, 0.5))
        return mutate(
            rng, self._build(rng, method.request.DESCRIPTOR, hostility).SerializeToString()
        )

    def _plausible(self, rng: random.Random, method: Method) -> Message:
        if method.name == "PublishCheckpoint":
            return self._plausible_info(rng)
        return self._build(rng, method.request.DESCRIPTOR, 0.05)

    def _checksums(self, rng: random.Random, data: bytes) -> common_pb2.BlockChecksums:
        cs = checksum_bytes(data, rng.choice((65536, 1 << 20, 1 << 20, 1 << 20, 4096, 1)))
        return common_pb2.BlockChecksums(
            algorithm=cs.algorithm, block_size=cs.block_size, block_digests=cs.digests
        )

    def _entry(self, rng: random.Random, name: str, data: bytes) -> common_pb2.FileEntry:
        return common_pb2.FileEntry(
            name=name,
            size=len(data),
            checksums=self._checksums(rng, data),
            rank=rng.choice((0, 0, 1)),
            owner_node=rng.choice((self.peer_id,) * 4 + (self.valid[-2], "n1", "")),
        )

    def _plausible_info(self, rng: random.Random) -> common_pb2.CheckpointInfo:
        """A committed manifest whose files are from `contents` (a later push can match)."""
        names = (".metadata", "__0_0.distcp", "__1_0.distcp")
        files = [
            self._entry(rng, name, rng.choice(self.contents))
            for name in names[: rng.randint(1, len(names))]
        ]
        return common_pb2.CheckpointInfo(
            ref=self._ref(rng),
            state=rng.choice((common_pb2.COMMITTED, common_pb2.COMMITTED, common_pb2.WRITING)),
            size_bytes=self._sometimes(rng, sum(f.size for f in files), _UINT64),
            file_count=self._sometimes(rng, len(files), _UINT32),
            created_unix=self._sometimes(rng, _NOW + rng.random(), _FLOATS),
            committed_unix=self._sometimes(rng, _NOW + 1 + rng.random(), _FLOATS),
            sequence=self._sometimes(rng, rng.randint(1, 50), _UINT64),
            files=files,
            tiers=["memory"],
        )

    @staticmethod
    def _sometimes(rng: random.Random, value: T, hostile: tuple[T, ...]) -> T:
        """`value`, or one time in six a hostile one (audit M1, H3, L6: bounds of fields)."""
        return rng.choice(hostile) if rng.random() < 1 / 6 else value

    def _plausible_push(self, rng: random.Random) -> tuple[bytes, ...]:
        """A header, then the file in blocks, sometimes with a wrong offset or byte."""
        data = rng.choice(self.contents)
        entry = self._entry(rng, rng.choice((".metadata", "__0_0.distcp")), data)
        ref = self._ref(rng)
        chunks = [peer_pb2.FileChunk(header=peer_pb2.FileHeader(ref=ref, file=entry))]
        block = entry.checksums.block_size
        offsets = range(0, len(data), block)[:64]  # block_size 1: a stream cut short
        flip = rng.randrange(len(offsets)) if offsets and rng.random() < 0.15 else -1
        skew = rng.randrange(len(offsets)) if offsets and rng.random() < 0.1 else -1
        for i, offset in enumerate(offsets):
            piece = data[offset : offset + block]
            if i == flip:
                piece = bytes([piece[0] ^ 1]) + piece[1:]
            sent = rng.choice(_UINT64) if i == skew else offset
            chunks.append(peer_pb2.FileChunk(offset=sent, data=piece))
        if rng.random() < 0.1:
            chunks.append(peer_pb2.FileChunk(offset=len(data), data=b"extra"))
        return tuple(c.SerializeToString() for c in chunks)

    # -- a message from the descriptor ---------------------------------------------
    def _ref(self, rng: random.Random) -> common_pb2.CheckpointRef:
        if rng.random() < 0.8:
            namespace, checkpoint_id = rng.choice(self.refs)
        else:
            namespace, checkpoint_id = self._name(rng, 0.3), self._name(rng, 0.3)
        return common_pb2.CheckpointRef(namespace=namespace, checkpoint_id=checkpoint_id)

    def _name(self, rng: random.Random, hostility: float) -> str:
        return rng.choice(self.hostile if rng.random() < hostility else self.valid)

    def _build(self, rng: random.Random, desc: Any, hostility: float, depth: int = 0) -> Message:
        msg = message_factory.GetMessageClass(desc)()
        for f in desc.fields:
            if rng.random() < (0.1 if hostility < 0.2 else 0.4):
                continue
            if f.is_repeated:
                wide = f.type == pb.FieldDescriptor.TYPE_STRING and rng.random() < hostility / 10
                count = _WIDE if wide else rng.choice((0, 1, 1, 2, 3))
                if f.type == pb.FieldDescriptor.TYPE_MESSAGE:
                    items = getattr(msg, f.name)
                    for _ in range(count if depth < _MAX_DEPTH else 0):
                        items.add().CopyFrom(self._build(rng, f.message_type, hostility, depth + 1))
                else:
                    getattr(msg, f.name).extend(
                        self._scalar(rng, f, hostility) for _ in range(count)
                    )
            elif f.type == pb.FieldDescriptor.TYPE_MESSAGE:
                if depth < _MAX_DEPTH:
                    getattr(msg, f.name).CopyFrom(
                        self._build(rng, f.message_type, hostility, depth + 1)
                    )
            else:
                setattr(msg, f.name, self._scalar(rng, f, hostility))
        if desc.name == "BlockChecksums" and rng.random() > hostility:
            msg.CopyFrom(self._checksums(rng, rng.choice(self.contents)))
        if desc.name == "CheckpointRef" and rng.random() > hostility * 2:
            msg.CopyFrom(self._ref(rng))
        return msg

    def _scalar(self, rng: random.Random, f: pb.FieldDescriptor, hostility: float) -> object:
        hostile = rng.random() < hostility
        t = f.type
        if t == pb.FieldDescriptor.TYPE_STRING:
            if f.name == "algorithm":
                return rng.choice(("crc32c", "", "md5", *self.hostile)) if hostile else "xxh3-128"
            if f.name == "local_path":
                return rng.choice(("", self.absolute_names[1], "../x"))
            return self._name(rng, 1.0 if hostile else 0.0)
        if t == pb.FieldDescriptor.TYPE_BYTES:
            if hostile:
                return rng.randbytes(rng.choice((0, 1, 15, 17, 4096, 65536)))
            return rng.randbytes(16 * rng.randint(0, 4))
        if t in (pb.FieldDescriptor.TYPE_INT32, pb.FieldDescriptor.TYPE_SINT32):
            return rng.choice(_INT32) if hostile else rng.choice((0, 0, 1, 2, 3))
        if t in (pb.FieldDescriptor.TYPE_UINT32, pb.FieldDescriptor.TYPE_FIXED32):
            return rng.choice(_UINT32) if hostile else rng.choice((4096, 65536, 1 << 20))
        if t in (pb.FieldDescriptor.TYPE_UINT64, pb.FieldDescriptor.TYPE_INT64):
            return rng.choice(_UINT64) if hostile else rng.choice((0, 1, 100, 4096, 65536, 1 << 20))
        if t in (pb.FieldDescriptor.TYPE_DOUBLE, pb.FieldDescriptor.TYPE_FLOAT):
            return rng.choice(_FLOATS) if hostile else _NOW + rng.randint(0, 100)
        if t == pb.FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if t == pb.FieldDescriptor.TYPE_ENUM:
            assert f.enum_type is not None
            numbers = [v.number for v in f.enum_type.values]
            return rng.choice((*numbers, 99, -1, 2**31 - 1)) if hostile else rng.choice(numbers)
        raise TypeError(f"the fuzzer has no values for field {f.full_name} (type {t})")


def main(argv: list[str]) -> int:
    """Print one call: `python -m tests.support.fuzz SEED INDEX [SANDBOX]` (with the
    run's TIERCKPT_FUZZ_ONLY, if it had one; SANDBOX only changes absolute names)."""
    if len(argv) not in (2, 3):
        print(main.__doc__)
        return 2
    sandbox = argv[2] if len(argv) == 3 else "/sandbox/d1/d2/d3/d4/d5/d6/d7"
    only = os.environ.get("TIERCKPT_FUZZ_ONLY", "")
    fuzzer = Fuzzer(int(argv[0]), node_id=NODE_ID, peer_id=PEER_ID, sandbox=sandbox, only=only)
    call = fuzzer.call(int(argv[1]))
    print(call.describe(limit=4000))
    for i, raw in enumerate(call.messages):
        print(f"message {i} ({call.kinds[i]}): {raw.hex()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
