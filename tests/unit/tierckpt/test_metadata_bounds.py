"""Audit 3, H1: the `.metadata` decoder has hard bounds on work and memory.

Each bomb of the audit (a 30-level memoized tuple, hashed as a frozenset element or a dict
key; four ``bytearray(512 MiB)`` from 68 bytes) is refused before any object is built,
with an error that says why; a large real DCP `.metadata` still decodes exactly as torch's
own ``pickle.load`` does. The bombs run in a child process with a deadline, so the old
decoder (which hashes 2^30 leaves with the GIL held) fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tierckpt.dcp_metadata import (
    _CONTAINERS,
    _FRESH,
    CONTAINER_BYTES,
    OBJECTS_PER_BYTE,
    container_budget,
    load_metadata,
)
from tierckpt.errors import InvalidArgument, UnsafeMetadata
from tierckpt.pickle_scan import scan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)

from tests.support.large_metadata import large_metadata_bytes

_BOMBS = textwrap.dedent(
    """
    import json, pickle, resource, sys
    from tierckpt.dcp_metadata import load_metadata
    from tierckpt.errors import UnsafeMetadata
    from tests.unit.tierckpt.test_metadata_bounds import bombs

    try:
        load_metadata(pickle.dumps(1))  # imports torch before the RSS baseline
    except UnsafeMetadata:
        pass
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {}
    for name, raw in bombs().items():
        try:
            load_metadata(raw, what=f"ns/{name}/.metadata")
            out[name] = [len(raw), "LOADED"]
        except UnsafeMetadata as e:
            out[name] = [len(raw), str(e)]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"refused": out, "grown_kib": grown}))
    """
)


def _nested(levels: int) -> tuple[Any, ...]:
    t: tuple[Any, ...] = ()
    for _ in range(levels):
        t = (t, t)  # pickle memoizes the inner tuple: two GETs per level
    return t


def _bytearrays(count: int, size: int) -> bytes:
    """The audit's 68-byte variant: ``(bytearray(size),) * count``, each built anew."""
    get = b"\x8c\x08builtins\x94\x8c\tbytearray\x94\x93\x94"  # memo 0, 1, 2 = the class
    one = b"h\x02J" + struct.pack("<i", size) + b"\x85R"
    return b"\x80\x04(" + get + b"0" + one * count + b"t."


def _body(value: object, protocol: int) -> bytes:
    """The opcodes that build `value`, without the PROTO, FRAME and STOP around them."""
    raw = pickle.dumps(value, protocol=protocol)
    start = 11 if raw[2:3] == b"\x95" else 2
    return raw[start:-1]


def bombs() -> dict[str, bytes]:
    """Written opcode by opcode: building them in Python would hash the tree here."""
    tree = _nested(30)
    in_metadata = Metadata(
        state_dict_metadata={},
        planner_data=tree,
        storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 8)},
    )
    return {
        "memoized-tuple": pickle.dumps(tree),
        "frozenset": b"\x80\x04(" + _body(tree, 4) + b"\x91.",
        "dict-key": b"\x80\x04}" + _body(tree, 4) + b"K\x01s.",
        "dict-key-protocol-2": b"\x80\x02}" + _body(tree, 2) + b"K\x01s.",
        "inside-real-metadata": pickle.dumps(in_metadata),
        "bytearray-512MiB-x4": _bytearrays(4, 512 << 20),
        "bytearray8-past-the-end": b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b".",
    }


def test_each_bomb_of_the_audit_is_refused_at_once_with_a_clear_error() -> None:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", _BOMBS],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=100,  # the old decoder spends hours on the frozenset
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    refused = report["refused"]
    assert refused["memoized-tuple"][0] < 170  # the audit's size
    assert refused["bytearray-512MiB-x4"][0] <= 68
    for name, (_, message) in refused.items():
        assert message != "LOADED", name
        assert f"ns/{name}/.metadata: refused" in message, message
        assert "nothing in it was run" in message and len(message) < 600, message
    for name in ("memoized-tuple", "frozenset", "dict-key", "inside-real-metadata"):
        assert "expands to more than" in refused[name][1], refused[name]
    assert "bytearray() from anything but a bytes literal" in refused["bytearray-512MiB-x4"][1]
    assert "unreadable" in refused["bytearray8-past-the-end"][1]
    assert report["grown_kib"] < 200 * 1024  # not the 2 GiB the old decoder allocated


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\x80\x04" + b")" + b"\x85" * 1000 + b".", "nests deeper than 100 levels"),
        (b"\x80\x04]r\xff\xff\xff\x7f.", "sparse memo index"),
        (b"\x80\x04]\x94h\x00a.", "after it was referenced again"),  # l = [l]
        (b"\x80\x04}\x94h\x00K\x01s.", "after it was referenced again"),  # d[d] = 1
        (b"\x80\x04(K\x01K\x02\x90.", "unreadable"),  # ADDITEMS onto no set
        (b"\x80\x04K\x01K\x02\x90.", "unreadable"),  # ADDITEMS without a MARK
        (b"\x80\x04\x8c\x01xQ.", "persistent id"),
        (b"\x80\x04\x82\x01.", "EXT1 opcode"),
        (b"\x80\x04\x8c\x05torch\x8c\x04Size\x93)R}b.", "tried to change what torch.Size"),
        (b"\x80\x04h\x05.", "unreadable"),  # a GET of nothing
    ],
)
def test_malformed_or_unbounded_shapes_are_refused(payload: bytes, why: str) -> None:
    with pytest.raises(UnsafeMetadata) as refused:
        load_metadata(payload)
    assert why in str(refused.value)
    assert isinstance(refused.value, InvalidArgument)  # INVALID_ARGUMENT on the wire


def test_a_refused_value_is_shown_in_bounded_time_and_length() -> None:
    """The error names the bad value without its repr: a list of 100,000 references to
    one 1,000-character string would be a 100 MB message (and a 2^30 tree hours). 50,000
    references (800k objects expanded) stay within the object budget of the 400 kB file."""
    big = ["x" * 1000] * 50_000
    md = Metadata(
        state_dict_metadata={},
        storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 8)},
    )
    info = next(iter(md.storage_data.values()))
    info.__dict__["offset"] = big
    with pytest.raises(UnsafeMetadata, match="offset is") as refused:
        load_metadata(pickle.dumps(md))
    assert len(str(refused.value)) < 600


def test_a_large_real_metadata_decodes_as_torch_does(tmp_path: Path) -> None:
    """The bounds scale with the file: 600 tensors of 32 chunks (19k items, 2.7 MB)
    and a stock dcp.save of 1,500 small tensors decode exactly as pickle.load does."""
    raw = large_metadata_bytes(600, 32)
    assert len(raw) > 2_500_000
    assert load_metadata(raw) == pickle.loads(raw)
    with pytest.raises(UnsafeMetadata, match="tuple, not a Metadata"):
        load_metadata(pickle.dumps(_nested(12)))  # shared, within the budget: decoded
    state = {f"layer{i}.weight": torch.full((2, 3), float(i)) for i in range(1500)}
    state["step"] = 7  # type: ignore[assignment]
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    saved = (tmp_path / ".metadata").read_bytes()
    with open(tmp_path / ".metadata", "rb") as f:
        assert load_metadata(saved) == pickle.load(f)


def test_loads_run_side_by_side_without_a_process_wide_lock() -> None:
    """Many threads decode at once (no lock is held across a load) and each gets its
    own, correct result; a bomb refused on one thread does not disturb the others."""
    raw = large_metadata_bytes(50, 8)
    expected = pickle.loads(raw)
    results: list[object] = []
    errors: list[BaseException] = []

    def load(payload: bytes) -> None:
        try:
            results.append(load_metadata(payload))
        except UnsafeMetadata as e:
            results.append(e)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=load, args=(raw if i % 2 else bombs()["frozenset"],))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 8
    assert sum(1 for r in results if r == expected) == 4
    assert sum(1 for r in results if isinstance(r, UnsafeMetadata)) == 4
    import tierckpt.dcp_metadata as module

    assert not hasattr(module, "_LOCK")


def list_bomb(n: int) -> bytes:
    """n EMPTY_LIST opcodes inside one list: n bytes, n lists (the old decoder: 2 GiB
    for 16M, then refused as "not a Metadata" after 45 s)."""
    return b"\x80\x02(" + b"]" * n + b"l."


_LIST_BOMB = textwrap.dedent(
    """
    import json, resource, sys
    limit = 2560 << 20  # a decoder that holds 16M lists fails here, not the machine
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from tierckpt.dcp_metadata import load_metadata
    from tierckpt.errors import UnsafeMetadata

    raw = b"\\x80\\x02(" + b"]" * 16_000_000 + b"l."  # list_bomb(16M), without torch
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        load_metadata(raw, what="ns/lists/.metadata")
        message = "LOADED"
    except UnsafeMetadata as e:
        message = str(e)
    except MemoryError:
        message = "MemoryError"
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"message": message, "grown_kib": grown, "torch": "torch" in sys.modules}))
    """
)


def test_a_memory_bomb_of_empty_lists_is_refused_with_bounded_memory() -> None:
    """16 MB of EMPTY_LIST opcodes: the scan stops at the container budget (one per
    `CONTAINER_BYTES` bytes), so the decoding process grows by about 0.5 GiB (the scan's
    records), not the 2 GiB of 16M lists, and torch is never imported for it."""
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", _LIST_BOMB],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    message = report["message"]
    assert message.startswith("ns/lists/.metadata: refused"), message
    assert f"builds more than {container_budget(16_000_005)} containers" in message, message
    assert report["grown_kib"] < 640 * 1024, report
    assert not report["torch"]


def test_the_bounds_leave_real_metadata_room_and_it_decodes_as_torch_does() -> None:
    """The 2,000 tensors x 64 chunks `.metadata` (17.9 MB, 128k items): its logical
    objects and containers per byte are well inside the per-byte bounds (measured:
    0.27 and 0.108, bounds 2 and 0.25), and it decodes exactly as pickle.loads does."""
    raw = large_metadata_bytes(2000, 64)
    assert len(raw) > 17_000_000
    found = scan(raw, budget=1 << 40, fresh=_FRESH, containers=_CONTAINERS)
    assert found.objects / len(raw) < OBJECTS_PER_BYTE / 4
    assert found.containers / len(raw) < 0.5 / CONTAINER_BYTES
    assert load_metadata(raw) == pickle.loads(raw)
