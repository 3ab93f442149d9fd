"""What bench/soak.py measures of each daemon, and what retention says it should hold.

A sample is taken while the job is parked at a sample point (no save in flight): the
process figures come from /proc (VmRSS and its parts, open fds, threads), the memory
tier from the daemon (GetStatus, ListCheckpoints) and, independently, from the files
under its memory dir. `problems` compares them with the retention policy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt.daemon_client import CheckpointInfo, DaemonClient

PAGE = os.sysconf("SC_PAGE_SIZE")  # the daemon's budget charges tmpfs pages, as tmpfs does

__all__ = ["NodeSample", "ProcFigures", "fit_slope", "proc_figures", "sample_node"]

KiB = 1024


@dataclass(frozen=True)
class ProcFigures:
    rss: int  # VmRSS, bytes
    rss_anon: int  # RssAnon: heap and stacks (a leak shows here)
    rss_file: int
    rss_shmem: int  # pages of the memory tier the daemon has mapped or touched
    threads: int
    fds: int
    thread_names: dict[str, int]  # per name (comm): which pool grew, when one does


def proc_figures(pid: int) -> ProcFigures:
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads"):
            number = int(value.split()[0])
            fields[key] = number if key == "Threads" else number * KiB
    names: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        names[name] = names.get(name, 0) + 1
    return ProcFigures(
        rss=fields["VmRSS"],
        rss_anon=fields.get("RssAnon", 0),
        rss_file=fields.get("RssFile", 0),
        rss_shmem=fields.get("RssShmem", 0),
        threads=fields["Threads"],
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        thread_names=dict(sorted(names.items())),
    )


@dataclass
class NodeSample:
    """One daemon at one sample point."""

    node: str
    proc: ProcFigures
    used: int
    reserved: int
    pool: int
    prewarm_pending: int
    held: int  # bytes of the files the daemon says it holds (its own view)
    charged: int  # what the budget charges for them: whole pages, a page per checkpoint dir
    on_disk: int  # bytes of the checkpoint files under memory.dir/data/<ns>
    in_memory: list[str]  # checkpoints with a copy of some file on some node
    persistent_only: list[str]
    data_dirs: list[str]
    manifests: int
    stray: list[str] = field(default_factory=list)  # incoming/temp files at quiescence
    moved: bool = False  # the daemon's accounting changed while the sample was taken


def _holders(info: CheckpointInfo) -> set[str]:
    return {n for f in info.files for n in (f.owner_node, *f.replica_nodes) if n}


def _files_under(directory: Path) -> tuple[int, list[str]]:
    """Bytes of the checkpoint files under `directory`, and any hidden (incoming or
    temporary) files; a file or dir the daemon removes meanwhile is skipped (a sample
    that is not settled is taken again)."""
    total, stray = 0, []
    for root, _dirs, files in os.walk(directory):
        for name in files:
            path = Path(root, name)
            if name.startswith(".") and name != ".metadata":
                stray.append(str(path.relative_to(directory)))
                continue
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                continue
    return total, stray


def _names(directory: Path) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:
        return []


def sample_node(
    node: str, pid: int, client: DaemonClient, memory_dir: Path, namespace: str
) -> tuple[NodeSample, list[CheckpointInfo]]:
    """One daemon's figures; `client` is kept for the whole soak (a new channel per
    sample would itself open and close a socket on the daemon)."""
    status = client.status()
    rows = client.list_checkpoints(namespace)
    held = charged = 0
    in_memory, persistent_only = [], []
    manifests_dir = memory_dir / "manifests" / namespace
    for info in rows:
        if _holders(info):
            in_memory.append(info.checkpoint_id)
            sizes = [f.size for f in info.files if f.local_path]
            held += sum(sizes)
            charged += sum(-(-n // PAGE) * PAGE for n in sizes) + (PAGE if sizes else 0)
        else:
            persistent_only.append(info.checkpoint_id)
    data = memory_dir / "data" / namespace
    dirs = _names(data)
    on_disk, stray = _files_under(data)
    manifests = sum(name.endswith(".json") for name in _names(manifests_dir))
    # The status, the listing and the walk are not one snapshot: a retention eviction or
    # a copy landing between them would look like a leak. Read the totals again after.
    after = client.status()
    moved = (after.used_bytes, after.reserved_bytes) != (status.used_bytes, status.reserved_bytes)
    sample = NodeSample(
        node=node,
        proc=proc_figures(pid),
        used=status.used_bytes,
        reserved=status.reserved_bytes,
        pool=status.pool_bytes,
        prewarm_pending=status.prewarm_pending_bytes,
        held=held,
        charged=charged,
        on_disk=on_disk,
        in_memory=sorted(in_memory),
        persistent_only=sorted(persistent_only),
        data_dirs=dirs,
        manifests=manifests,
        stray=stray,
        moved=moved,
    )
    return sample, rows


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
