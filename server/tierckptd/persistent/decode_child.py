"""The `.metadata` decoder's child process: ``python -m tierckptd.persistent.decode_child``.

The daemon never decodes a `.metadata` itself (audit 3, H1): `tierckptd.persistent.decode`
starts this module in a fresh interpreter for each decode, under the resource limits it
passes on the command line: ``RLIMIT_CPU`` (soft: SIGXCPU, hard a second later: SIGKILL)
and no core file, set before anything is read; ``RLIMIT_AS``, set before anything is
decoded, to the address space the interpreter has then plus the allowance passed. If
the file names torch (its bytes hold ``torch``; a pickle can name a module no other
way, extension codes are refused) torch's metadata classes are imported before the
limit, so the allowance is for the file's objects alone, whatever torch build maps.
Whatever a file makes the decoder do, it does it here, and the daemon's memory and GIL
are not involved.

Input (stdin): an 8-byte little-endian length, that many bytes of a JSON header
(``what``: the file's name in errors; ``mappings``: for a zstd rewrite, each data file's
``[[old_offset, new_offset, new_length], ...]``, or null), then the `.metadata` bytes.

Output (stdout): one line of JSON, then, for a rewrite, the new `.metadata` bytes
(``rewritten``: their length). The JSON is plain data the daemon parses with `json`:
``{"files": [[relative_path, [[offset, length], ...], transformed], ...]}``, or
``{"error": {"kind": "unsafe" | "value" | "memory", "message": ...}}`` for a refusal
(``unsafe``: not plain DCP metadata, or more distinct items than `BYTES_PER_ITEM`
allows, so the rows the daemon parses stay a bounded share of the file; ``memory``: the
decoder hit ``RLIMIT_AS``; ``value``: a rewrite whose mappings do not match the file).
Exit status 0 either way.

It imports torch only when the pickle names a global (`tierckpt.dcp_metadata`): a bomb
of plain containers is refused without it. Only the standard library, `tierckpt` and
torch are imported (with ``"seed": true`` in the header, the SageMaker client's pickle
converted to a stock `.metadata`: also `tierckpt.sagemaker_import` and its fsspec), no
other module of the daemon (this package's ``__init__`` files import nothing).
"""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

ZSTD_DESCRIPTOR = "stream.zstd/1"  # ZStandard.registry_name() + "/1", as DCP records it

BYTES_PER_ITEM = 48
"""The rows handed to the daemon are at most one distinct item per this many bytes of
`.metadata` (+ `MIN_ITEMS`): what the daemon parses stays a bounded share of the file
(real DCP metadata: one item per 140 bytes, 128k items in 17.9 MB)."""

MIN_ITEMS = 4096


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmSize in /proc/self/status")


def main(argv: list[str]) -> int:
    allowance, cpu = int(argv[1]), int(argv[2])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # before any input is read

    import json

    stdin = sys.stdin.buffer
    header_length = int.from_bytes(stdin.read(8), "little")
    header = json.loads(stdin.read(header_length))
    raw = stdin.read()
    if b"torch" in raw:  # the classes it names; a bomb of plain containers never does
        import torch.distributed._shard.sharded_tensor.metadata  # noqa: F401 (legacy DCP)
        import torch.distributed.checkpoint.filesystem  # noqa: F401
        import torch.distributed.checkpoint.metadata  # noqa: F401
    import tierckpt.dcp_metadata  # noqa: F401

    if header.get("seed"):  # the SageMaker client's metadata, converted (tierckptd.sagemaker)
        import tierckpt.sagemaker_import  # noqa: F401
        import torch.distributed.checkpoint.filesystem  # noqa: F401, F811 (the stock entries)

    limit = _address_space() + allowance
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # before anything is decoded
    out = sys.stdout.buffer
    try:
        body, rewritten = decode_body(
            raw, header["what"], header.get("mappings"), seed=bool(header.get("seed"))
        )
    except MemoryError:
        body, rewritten = {"error": {"kind": "memory", "message": ""}}, b""
    out.write(json.dumps(body).encode() + b"\n")
    out.write(rewritten)
    out.flush()
    return 0


def decode_body(
    raw: bytes, what: str, mappings: dict[str, list[list[int]]] | None, *, seed: bool = False
) -> tuple[dict[str, object], bytes]:
    """The decode itself (in the child, or in the daemon for a small file): a JSON-able
    body of rows or an error, and the rewritten `.metadata` bytes when `mappings` is given.
    `seed`: `raw` is the SageMaker client's metadata pickle; the rewritten bytes are the
    stock `.metadata` converted from it (`tierckpt.sagemaker_import.converted_metadata`)."""
    from tierckpt.dcp_metadata import OUT_OF_MEMORY, dump_metadata, load_metadata
    from tierckpt.errors import UnsafeMetadata

    try:
        if seed:
            from tierckpt.sagemaker_import import converted_metadata

            raw, _ = converted_metadata(raw, what)
        md = load_metadata(raw, what=what)
    except UnsafeMetadata as e:
        message = str(e)
        kind = "memory" if OUT_OF_MEMORY in message or "MemoryError" in message else "unsafe"
        return {"error": {"kind": kind, "message": message}}, b""
    files: dict[str, set[tuple[int, int]]] = {}
    transformed: set[str] = set()
    for info in md.storage_data.values():
        files.setdefault(info.relative_path, set()).add((int(info.offset), int(info.length)))
        if getattr(info, "transform_descriptors", None):
            transformed.add(info.relative_path)
    count, cap = sum(len(items) for items in files.values()), MIN_ITEMS + len(raw) // BYTES_PER_ITEM
    if count > cap:
        message = (
            f"{what}: refused, not plain DCP metadata ({count} distinct items, more than the "
            f"{cap} allowed for {len(raw)} bytes: one per {BYTES_PER_ITEM}); nothing in it was "
            "run. Re-save the checkpoint with dcp.save, or delete it if you did not write it"
        )
        return {"error": {"kind": "unsafe", "message": message}}, b""
    body: dict[str, object] = {
        "files": [[path, sorted(items), path in transformed] for path, items in files.items()]
    }
    if seed:
        body["rewritten"] = len(raw)
        return body, raw
    if mappings is None:
        return body, b""
    try:
        rewritten = dump_metadata(_rewrite(md, mappings))
    except ValueError as e:
        return {"error": {"kind": "value", "message": str(e)}}, b""
    body["rewritten"] = len(rewritten)
    return body, rewritten


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _rewrite(md: Metadata, mappings: dict[str, list[list[int]]]) -> Metadata:
    """`md` with the items of the files in `mappings` pointing at their zstd frames."""
    import dataclasses

    indexes = {
        path: {old: (offset, length) for old, offset, length in rows}
        for path, rows in mappings.items()
    }
    storage = md.storage_data
    rewritten: dict[object, object] = {}
    for key, info in storage.items():
        mapping = indexes.get(info.relative_path)
        if mapping is not None:
            if getattr(info, "transform_descriptors", None):
                raise ValueError(
                    f"{info.relative_path}: item {_shown(key.fqn)} is already transformed "
                    f"({_shown(info.transform_descriptors)}); upload such files verbatim"
                )
            try:
                new_offset, new_length = mapping[int(info.offset)]
            except KeyError:
                raise ValueError(
                    f"{info.relative_path}: no compressed frame for the item at offset "
                    f"{info.offset} ({_shown(key.fqn)}); the file's index does not match this "
                    ".metadata"
                ) from None
            info = dataclasses.replace(
                info,
                offset=new_offset,
                length=new_length,
                transform_descriptors=[ZSTD_DESCRIPTOR],
            )
        rewritten[key] = info
    md.storage_data = rewritten
    return md


if __name__ == "__main__":
    sys.exit(main(sys.argv))
