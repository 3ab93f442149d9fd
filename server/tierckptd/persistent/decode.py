"""Decode a `.metadata` in a short-lived child process with hard resource limits.

The in-process decoder (`tierckpt.dcp_metadata`, with its opcode pre-scan) bounds work
and memory per byte, but its bounds scale with the file (up to 256 MiB) and a bug or a
shape the scan misjudges would cost the daemon itself: its memory, or the GIL its RPC
threads need (audit 3, H1). So the daemon decodes a `.metadata` larger than
`IN_PROCESS_BYTES` (1 MiB) only in a child: `decode` starts
`tierckptd.persistent.decode_child` in a fresh interpreter (``sys.executable -m``, never
a fork of the threaded daemon) with

- ``RLIMIT_AS`` = the child's own address space once it has imported what the file
  names (the interpreter; torch when the file names it: 0.65 GiB for a CPU build, more
  with CUDA) + `BASE_MEMORY` + `MEMORY_PER_BYTE` x size,
- ``RLIMIT_CPU`` = `BASE_CPU_S` + `CPU_S_PER_MIB` x size (SIGXCPU, then SIGKILL),
- a wall-clock deadline of `WALL_FACTOR` x the CPU limit + `BASE_CPU_S` (then SIGKILL),

and reads back plain data only (JSON rows and, for the zstd rewrite, the `.metadata`
bytes the child pickled itself; nothing from the child is unpickled). At most
`MAX_CHILDREN` decode at once. A child stopped by a limit is a refusal: `UnsafeMetadata`
(INVALID_ARGUMENT) naming the file, the limit and its value, remembered like any refusal
(`refusals`). A child that cannot start, or misses the wall-clock deadline (a starved
node, not the file's doing), raises `DecoderUnavailable` and the drain retries later.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from tierckpt.dcp_metadata import MAX_METADATA_BYTES
from tierckpt.errors import TierckptError, UnsafeMetadata

from tierckptd.persistent.decode_child import decode_body

__all__ = [
    "BASE_CPU_S",
    "BASE_MEMORY",
    "CPU_S_PER_MIB",
    "MAX_CHILDREN",
    "MEMORY_PER_BYTE",
    "Decoded",
    "IN_PROCESS_BYTES",
    "DecoderUnavailable",
    "Limits",
    "decode",
]

logger = logging.getLogger(__name__)

BASE_MEMORY = 256 << 20
"""Address space for decoding any `.metadata`, past what the interpreter and torch map."""

MEMORY_PER_BYTE = 24
"""Address space per byte of `.metadata` (the 17.9 MB file of 2,000 tensors x 64 chunks
takes about 15 per byte of resident memory: its objects, the pre-scan's records, the
rows and a rewrite)."""

BASE_CPU_S = 30
"""CPU seconds for starting the interpreter and importing torch (about 5 s)."""

CPU_S_PER_MIB = 1.0
"""CPU seconds per MiB of `.metadata` (the 17.9 MB file decodes in about 10 s here)."""

IN_PROCESS_BYTES = 1 << 20
"""A `.metadata` up to this size is decoded in the daemon itself: the decoder's own bounds
(`tierckpt.dcp_metadata`: objects and containers per byte, depth) keep a hostile one of
1 MiB to tens of MiB and a fraction of a second, while a child would cost an interpreter
and a torch import (about 5 s of CPU) per drain. Larger files go to the limited child."""

WALL_FACTOR = 4
MAX_CHILDREN = 2

_CHILD = "tierckptd.persistent.decode_child"
_LIMITER = threading.BoundedSemaphore(MAX_CHILDREN)
_CACHE_SIZE = 2  # a drain decodes the same bytes twice (the upload, then the commit)
_cache: OrderedDict[bytes, Decoded] = OrderedDict()
_cache_lock = threading.Lock()


class DecoderUnavailable(TierckptError):
    """The decoding child could not run (start failed, node starved past the deadline):
    not the file's doing, so not a refusal; the drain retries later."""

    code = grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class Limits:
    """The child's limits for a file of `size` bytes: `memory` is the address space it
    may add to what it maps before decoding."""

    memory: int
    cpu_s: int
    wall_s: float

    @classmethod
    def for_size(cls, size: int) -> Limits:
        cpu = BASE_CPU_S + int(CPU_S_PER_MIB * size / (1 << 20) + 0.999)
        return cls(BASE_MEMORY + MEMORY_PER_BYTE * size, cpu, WALL_FACTOR * cpu + BASE_CPU_S)


@dataclass(frozen=True)
class Decoded:
    """What the child found: each data file's distinct ``(offset, length)`` items sorted,
    whether any of its items carries transforms, and the rewritten `.metadata` bytes
    (None unless mappings were given)."""

    files: dict[str, tuple[tuple[tuple[int, int], ...], bool]]
    rewritten: bytes | None = None


def _refused(what: str, why: str) -> UnsafeMetadata:
    return UnsafeMetadata(
        f"{what}: refused, not plain DCP metadata ({why}); nothing in it was run. Re-save "
        "the checkpoint with dcp.save, or delete it if you did not write it"
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def decode(
    metadata: bytes,
    *,
    what: str,
    mappings: Mapping[str, Mapping[int, tuple[int, int]]] | None = None,
    limits: Limits | None = None,
    seed: bool = False,
) -> Decoded:
    """Decode `metadata` in a child process under `limits` (default: `Limits.for_size`).

    Raises:
        UnsafeMetadata: not plain DCP metadata, or the child hit a limit (named).
        ValueError: `mappings` does not match the file (a rewrite only).

    `seed`: `metadata` is the SageMaker client's pickle; `rewritten` is the stock
    `.metadata` converted from it and `files` its rows (`tierckptd.sagemaker`).
        DecoderUnavailable: the child could not run or missed its wall-clock deadline.
    """
    size = len(metadata)
    if size > MAX_METADATA_BYTES:
        raise _refused(what, f"{size} bytes, more than the {MAX_METADATA_BYTES} allowed")
    key = hashlib.blake2b(metadata, digest_size=32).digest() + what.encode() + bytes([seed])
    if mappings is None:
        with _cache_lock:
            found = _cache.get(key)
            if found is not None:
                _cache.move_to_end(key)
                return found
    limits = limits or Limits.for_size(size)
    wire = (
        None
        if mappings is None
        else {path: [[o, n, ln] for o, (n, ln) in m.items()] for path, m in mappings.items()}
    )
    if size <= IN_PROCESS_BYTES:
        # Small enough that the in-process bounds are small too: no child, no torch import.
        body, rewritten = decode_body(metadata, what, wire, seed=seed)
        out, err, rc = json.dumps(body).encode() + b"\n" + rewritten, b"", 0
    else:
        header = json.dumps({"what": what, "mappings": wire, "seed": seed}).encode()
        request = len(header).to_bytes(8, "little") + header + metadata
        with _LIMITER:
            out, err, rc = _run(request, limits, what)
    decoded = _parse(out, err, rc, what, size, limits, mappings is not None or seed)
    if mappings is None:
        with _cache_lock:
            _cache[key] = decoded
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return decoded


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    # One thread (each thread's stack and malloc arena would count toward RLIMIT_AS),
    # and this interpreter's module path (the daemon's own sources first).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _run(request: bytes, limits: Limits, what: str) -> tuple[bytes, bytes, int]:
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", _CHILD, str(limits.memory), str(limits.cpu_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_environment(),
            close_fds=True,
            cwd="/",
        )
    except OSError as e:
        raise DecoderUnavailable(f"{what}: could not start the .metadata decoder: {e}") from e
    try:
        out, err = child.communicate(request, timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise DecoderUnavailable(
            f"{what}: the .metadata decoder did not finish within {limits.wall_s:.0f} s of "
            f"wall-clock time ({limits.cpu_s} s of CPU allowed): the node is overloaded; "
            "the drain retries later"
        ) from None
    return out, err, child.returncode


def _parse(
    out: bytes, err: bytes, rc: int, what: str, size: int, limits: Limits, rewrite: bool
) -> Decoded:
    memory = (
        f"the decoder's memory limit (RLIMIT_AS {_mib(limits.memory)} past the interpreter "
        f"for {size} bytes: {_mib(BASE_MEMORY)} + {MEMORY_PER_BYTE} per byte)"
    )
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):
        raise _refused(
            what,
            f"it exceeded the decoder's CPU limit (RLIMIT_CPU {limits.cpu_s} s for {size} "
            f"bytes: {BASE_CPU_S} s + {CPU_S_PER_MIB:g} s per MiB)",
        )
    line, _, rest = out.partition(b"\n")
    try:
        body = json.loads(line) if rc == 0 else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        tail = err.decode("utf-8", "replace")[-300:]
        if "MemoryError" in tail or rc in (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS):
            raise _refused(what, f"it exceeded {memory}")
        raise DecoderUnavailable(f"{what}: the .metadata decoder failed (exit {rc}): {tail}")
    error = body.get("error")
    if isinstance(error, dict):
        kind, message = error.get("kind"), str(error.get("message", ""))
        if kind == "memory":
            raise _refused(what, f"it exceeded {memory}")
        if kind == "value":
            raise ValueError(message)
        raise UnsafeMetadata(message)
    files: dict[str, tuple[tuple[tuple[int, int], ...], bool]] = {}
    for path, items, transformed in body["files"]:
        files[str(path)] = (tuple((int(o), int(n)) for o, n in items), bool(transformed))
    rewritten = None
    if rewrite:
        rewritten = bytes(rest[: int(body["rewritten"])])
    return Decoded(files, rewritten)
