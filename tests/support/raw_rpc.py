"""The audit's raw save and a wire FileEntry, shared by the attack tests.

`write_files` is what a rank does without DCP: Begin, Reserve, Open, write, CommitFile
(the save stays WRITING); `raw_save` then commits it. These are the daemon-level save every
test uses; a DCP save goes through `backends.Tiered.save`, a gloo job's through
`cluster.save_job`. `file_entry` is a peer's
description of a file with real block checksums, for forged or legitimate publishes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tierckpt.checksum import checksum_bytes
from tierckpt.daemon_client import CheckpointInfo, DaemonClient
from tierckpt.v1 import common_pb2

__all__ = ["file_entry", "raw_save", "save_ranks", "write_files"]


def write_files(
    client: DaemonClient, ns: str, cid: str, files: dict[str, bytes], rank: int = 0
) -> None:
    """Write and commit the files of a save through the daemon (not the checkpoint)."""
    client.begin_checkpoint(ns, cid, rank)
    client.reserve_space(ns, cid, rank, sum(len(d) for d in files.values()))
    for name, data in files.items():
        path = client.open_file(ns, cid, name, rank).path
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
        client.commit_file(ns, cid, name, rank, len(data), checksum_bytes(data))


def raw_save(
    client: DaemonClient, ns: str, cid: str, files: dict[str, bytes], rank: int = 0
) -> str:
    """The audit's raw save: Begin/Reserve/Open/write/CommitFile/Commit; the committed id."""
    write_files(client, ns, cid, files, rank)
    return client.commit_checkpoint(ns, cid, list(files)).checkpoint_id


def save_ranks(
    clients: Mapping[int, DaemonClient], ns: str, cid: str, files: Mapping[int, dict[str, bytes]]
) -> CheckpointInfo:
    """A save spread over nodes: rank r writes `files[r]` through `clients[r]` (its node's
    daemon), then rank 0's daemon coordinates the commit of every file."""
    for rank, named in files.items():
        write_files(clients[rank], ns, cid, named, rank)
    return clients[0].commit_checkpoint(
        ns, cid, [name for named in files.values() for name in named]
    )


def file_entry(
    name: str, data: bytes, owner: str, replicas: tuple[str, ...] = ()
) -> common_pb2.FileEntry:
    """A FileEntry for `data` with its real block checksums."""
    cs = checksum_bytes(data)
    return common_pb2.FileEntry(
        name=name,
        size=len(data),
        checksums=common_pb2.BlockChecksums(
            algorithm=cs.algorithm, block_size=cs.block_size, block_digests=cs.digests
        ),
        owner_node=owner,
        replica_nodes=replicas,
    )
