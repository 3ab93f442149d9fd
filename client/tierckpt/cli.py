"""`tierckpt`: inspect and manage the checkpoints held by the local tierckptd.

Every command takes ``--json`` for scripts. Exit status: 0 ok, 1 a tierckpt error
(message on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from tierckpt import __version__
from tierckpt.completion import (
    DEFAULT_COPIES,
    CheckpointRef,
    Tier,
    TierState,
    checkpoint_ref,
    wait_for,
)
from tierckpt.daemon_client import CheckpointInfo, DaemonClient, FileEntry, PeerMarks
from tierckpt.errors import ChecksumMismatch, InvalidArgument, TierckptError
from tierckpt.freshness import TIERS
from tierckpt.names import (
    LATEST,
    LATEST_VERIFIED,
    METADATA_FILE,
    check_checkpoint_id,
    check_namespace,
)
from tierckpt.progress import Progress, format_age
from tierckpt.trust import parse_trust
from tierckpt.units import format_size

__all__ = ["main"]

_COPY_CHUNK = 16 << 20
_YEAR_10000 = 253402300800.0  # the first Unix time a 4-digit year cannot show


def _when(ts: float) -> str:
    """Local time of a Unix timestamp, "-" for none, "invalid" for one no calendar holds:
    a timestamp may come from a peer's manifest (NaN, 1e308, negative)."""
    if not ts:
        return "-"
    if not math.isfinite(ts) or not 0 < ts < _YEAR_10000:
        return "invalid"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "invalid"


def _json_safe(value: Any) -> Any:
    """`value` with NaN/inf floats as null: strict JSON parsers reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    print(json.dumps(_json_safe(payload), indent=2, allow_nan=False) if args.json else text)


def _lost_note(c: CheckpointInfo, shown: int = 5) -> str:
    """Why a LOST checkpoint cannot be loaded: the files with no copy left."""
    more = len(c.lost_files) - shown
    files = ", ".join(c.lost_files[:shown]) + (f" and {more} more" if more > 0 else "")
    return f"{c.checkpoint_id} is LOST: no copy of {files} is left on any tier; it cannot be loaded"


def _row_json(c: CheckpointInfo) -> dict[str, Any]:
    """A checkpoint's `--json` row: its record and the tiers it reached (`levels`:
    memory, replicated as the fewest nodes holding any one file, durable)."""
    return {**c.to_json(), "levels": TierState.of(c).levels()}


def _ls_target(args: argparse.Namespace) -> tuple[str, str]:
    """`NS [FOLDER]`, `NS/FOLDER` or `tierckpt://NS/FOLDER` as (namespace, folder or "")."""
    text = str(args.namespace).removeprefix("tierckpt://").strip("/")
    namespace, _, folder = text.partition("/")
    folder = "/".join(p for p in (folder, (getattr(args, "folder", None) or "").strip("/")) if p)
    return check_namespace(namespace), check_checkpoint_id(folder) if folder else ""


def _cmd_ls(client: DaemonClient, args: argparse.Namespace) -> int:
    namespace, folder = _ls_target(args)
    rows = client.list_checkpoints(namespace, include_uncommitted=args.all)
    if folder:  # the folder's checkpoints at any depth (and one with its name)
        rows = [
            c for c in rows if c.checkpoint_id == folder or c.checkpoint_id.startswith(f"{folder}/")
        ]
    w = max([24, *(len(c.checkpoint_id) for c in rows)])
    lines = [
        f"{'ID':<{w}} {'STATE':<10} {'TRUST':<8} {'BYTES':>12} {'FILES':>5} {'COPIES':>6}  "
        f"{'CREATED':<19}  TIERS"
    ]
    lines += [
        f"{c.checkpoint_id:<{w}} {c.state:<10} {c.trust.value if c.trust else '-':<8} "
        f"{format_size(c.size_bytes):>12} {c.file_count:>5} "
        f"{TierState.of(c).levels()['replicated']:>6}  "
        f"{_when(c.created_unix):<19}  {','.join(c.tiers) or '-'}"
        for c in rows
    ]
    lines += [_lost_note(c) for c in rows if c.state == "LOST"]
    lines += [
        f"{c.checkpoint_id} is marked {c.trust.value}: {c.trust_reason}"
        for c in rows
        if c.trust is not None and c.trust_reason
    ]
    _emit(args, [_row_json(c) for c in rows], "\n".join(lines))
    return 0


def _ref_of(args: argparse.Namespace) -> CheckpointRef:
    """`NS ID`, `NS/ID` or `tierckpt://NS/ID` as one checkpoint on the CLI's daemon."""
    text = f"{args.target}/{args.id}" if args.id else args.target
    return checkpoint_ref(text, daemon=args.daemon)


def _levels_text(state: TierState) -> str:
    levels = state.levels()
    return (
        f"memory {'yes' if levels['memory'] else 'no'}, "
        f"replicated to {levels['replicated']} node(s), "
        f"durable {'yes' if levels['durable'] else 'no'}"
    )


def _cmd_info(client: DaemonClient, args: argparse.Namespace) -> int:
    ref = _ref_of(args)
    c = client.get_checkpoint(ref.namespace, ref.checkpoint_id)
    state = TierState.of(c)
    lines = [
        f"{c.namespace}/{c.checkpoint_id}: {c.state}, {format_size(c.size_bytes)} in "
        f"{c.file_count} files, committed {_when(c.committed_unix)}, tiers "
        f"{','.join(c.tiers) or '-'}{', pinned' if c.pinned else ''}",
        f"reached: {_levels_text(state)}",
        f"{'FILE':<24} {'BYTES':>12} {'RANK':>5}  HOLDERS",
    ]
    lines += [
        f"{f.name:<24} {format_size(f.size):>12} {f.rank:>5}  "
        f"{','.join(dict.fromkeys(n for n in (f.owner_node, *f.replica_nodes) if n)) or '-'}"
        for f in c.files
    ]
    if c.state == "LOST":
        lines.append(_lost_note(c))
    if c.trust is not None:
        lines.insert(
            1, f"trust: {c.trust.value}" + (f" ({c.trust_reason})" if c.trust_reason else "")
        )
    payload = {
        **_row_json(c),
        "file_list": [
            {
                "name": f.name,
                "bytes": f.size,
                "rank": f.rank,
                "owner": f.owner_node,
                "replicas": list(f.replica_nodes),
            }
            for f in c.files
        ],
    }
    _emit(args, payload, "\n".join(lines))
    return 0


def _cmd_wait(client: DaemonClient, args: argparse.Namespace) -> int:
    ref = _ref_of(args)
    started = time.monotonic()
    state = wait_for(ref, args.tier, copies=args.copies, timeout=args.timeout)
    elapsed = time.monotonic() - started
    payload = {**dataclasses.asdict(state), "tier": args.tier, "seconds": elapsed}
    text = (
        f"{state.namespace}/{state.checkpoint_id} reached the {args.tier} tier "
        f"after {elapsed:.1f} s ({_levels_text(state)})"
    )
    _emit(args, payload, text)
    return 0


def _freshness_lines(fresh: dict[str, dict[str, float]], now: float) -> list[str]:
    """One line per namespace: how old its newest checkpoint is at each tier (the RPO)."""
    if not fresh:
        return []
    width = max(len("NAMESPACE"), *(len(ns) for ns in fresh))
    lines = [(f"{'NAMESPACE':<{width}}  " + "  ".join(f"{t.upper():<12}" for t in TIERS)).rstrip()]
    for ns, tiers in sorted(fresh.items()):
        ages = [f"{format_age(now - tiers[t]) + ' ago' if t in tiers else '-':<12}" for t in TIERS]
        lines.append(f"{ns:<{width}}  " + "  ".join(ages).rstrip())
    return lines


def _cmd_status(client: DaemonClient, args: argparse.Namespace) -> int:
    s = client.status()
    fresh = s.freshness
    payload = {
        "node": s.node_id,
        "failure_domain": s.failure_domain,
        "memory_dir": s.memory_dir,
        "budget_bytes": s.budget_bytes,
        "used_bytes": s.used_bytes,
        "reserved_bytes": s.reserved_bytes,
        "pool_bytes": s.pool_bytes,
        "checkpoints": s.checkpoints,
        "namespaces": list(s.namespaces),
        "version": s.version,
        "address": client.address,
        "prewarm_pending_bytes": s.prewarm_pending_bytes,
        "prewarm_ready_bytes": s.prewarm_ready_bytes,
        "prewarm_used_bytes": s.prewarm_used_bytes,
        "pool_hits": s.pool_hits,
        "pool_misses": s.pool_misses,
        # newest commit time per namespace and tier (memory, replicated, durable)
        "freshness": fresh,
        # seconds each peer's clock was ahead of this daemon's (order never depends on it)
        "peer_clocks": s.peer_clocks,
    }
    text = (
        f"node {s.node_id} (failure domain {s.failure_domain}) at {client.address}, tierckptd {s.version}\n"
        f"memory {s.memory_dir}: {format_size(s.used_bytes)} used + {format_size(s.reserved_bytes)} reserved "
        f"+ {format_size(s.pool_bytes)} warm pool of {format_size(s.budget_bytes)} budget\n"
        f"warm pool: {format_size(s.prewarm_ready_bytes)} prewarmed for next saves, "
        f"{format_size(s.prewarm_pending_bytes)} to prewarm, {format_size(s.prewarm_used_bytes)} "
        f"prewarmed bytes written by saves; files opened warm {s.pool_hits}, cold {s.pool_misses}\n"
        f"{s.checkpoints} committed checkpoints in {len(s.namespaces)} namespaces: {', '.join(s.namespaces) or '-'}"
    )
    lines = _freshness_lines(fresh, time.time())
    if lines:
        text += "\nnewest checkpoint per tier (RPO):\n  " + "\n  ".join(lines)
    skewed = {peer: ahead for peer, ahead in s.peer_clocks.items() if ahead > 0}
    if skewed:
        text += "\npeer clocks ahead of this node's (times shown clamped; order is unaffected): "
        text += ", ".join(f"{peer} +{ahead:.0f} s" for peer, ahead in sorted(skewed.items()))
    _emit(args, payload, text)
    return 0


def _copy_verified(
    entry: FileEntry, what: str, target: str, progress: Progress | None = None
) -> None:
    """`entry`'s local copy into `target`, every block verified (ChecksumMismatch if not)."""
    tmp = f"{target}.tmp"
    with (
        entry.open_verified(what) as src,
        open(tmp, "wb") as out,
    ):
        for start in range(0, entry.size, _COPY_CHUNK):
            data = src.read(start, min(_COPY_CHUNK, entry.size - start))
            out.write(data)
            if progress is not None:
                progress.advance(len(data))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)


def _pull(
    client: DaemonClient, info: CheckpointInfo, dest: str, progress: Progress | None = None
) -> int:
    """Copy every file, verified block by block, then `.metadata` last (the commit marker).

    Each file goes through the daemon's restore chain first (EnsureLocal): a file this
    node does not hold is restored from a peer or the persistent tier into memory, and a
    local copy that fails verification is replaced (once), as `dcp.load` would.
    """
    os.makedirs(dest, exist_ok=True)
    if os.path.exists(os.path.join(dest, METADATA_FILE)):
        raise FileExistsError(
            f"{dest} already holds a checkpoint (.metadata exists); pull into an empty directory"
        )
    total = 0
    ordered = sorted(info.files, key=lambda f: f.name == METADATA_FILE)
    for listed in ordered:
        target = os.path.join(dest, listed.name)
        what = f"{info.namespace}/{info.checkpoint_id}/{listed.name}"
        entry = client.ensure_local(info.namespace, info.checkpoint_id, listed.name)
        copied = progress.done_bytes if progress is not None else 0
        try:
            _copy_verified(entry, what, target, progress)
        except ChecksumMismatch as e:
            if progress is not None:  # the file starts over
                progress.done_bytes = copied
                progress.close()
            print(f"tierckpt pull: {e}; asking tierckptd to repair it", file=sys.stderr)
            entry = client.ensure_local(
                info.namespace, info.checkpoint_id, listed.name, repair=True
            )
            _copy_verified(entry, what, target, progress)
        total += entry.size
        if progress is not None:
            progress.advance(files=1)
    return total


def _cmd_pull(client: DaemonClient, args: argparse.Namespace) -> int:
    namespace = check_namespace(args.namespace)
    if args.id in (LATEST, LATEST_VERIFIED):  # the newest never marked bad, or verified
        verified = args.verified or args.id == LATEST_VERIFIED
        info = client.get_checkpoint(namespace, None, verified=verified)
    elif args.verified:
        raise InvalidArgument(f"--verified picks the newest verified: give ID {LATEST}")
    else:
        info = client.get_checkpoint(namespace, check_checkpoint_id(args.id))
    started = time.perf_counter()
    progress = None
    if not args.json:  # drawn on a terminal only (Progress.enabled)
        label = f"pull {info.namespace}/{info.checkpoint_id}"
        progress = Progress(label, info.size_bytes, len(info.files), sys.stderr)
    try:
        total = _pull(client, info, args.dest, progress)
    finally:
        if progress is not None:
            progress.close()
    elapsed = time.perf_counter() - started
    payload = {
        "id": info.checkpoint_id,
        "dest": args.dest,
        "bytes": total,
        "files": len(info.files),
        "seconds": elapsed,
    }
    text = (
        f"pulled {info.namespace}/{info.checkpoint_id} into {args.dest}: {len(info.files)} files, "
        f"{format_size(total)} in {elapsed:.2f} s; load it with FileSystemReader({args.dest!r})"
    )
    _emit(args, payload, text)
    return 0


def _peers_json(peers: PeerMarks) -> dict[str, Any]:
    return {
        "peers_applied": peers.applied,
        "peers_pending": list(peers.pending),
        "peers_refused": list(peers.refused),
    }


def _cmd_rm(client: DaemonClient, args: argparse.Namespace) -> int:
    freed, peers = client.remove_checkpoint(
        check_namespace(args.namespace), check_checkpoint_id(args.id)
    )
    _emit(
        args,
        {"id": args.id, "freed_bytes": freed, **_peers_json(peers)},
        f"removed {args.namespace}/{args.id} here ({format_size(freed)}); "
        f"peers notified ({peers.summary()})",
    )
    return 0


def _cmd_pin(client: DaemonClient, args: argparse.Namespace) -> int:
    pinned = args.command == "pin"
    info, peers = client.pin_checkpoint_report(
        check_namespace(args.namespace), check_checkpoint_id(args.id), pinned
    )
    verb = "pinned" if pinned else "unpinned"
    _emit(
        args,
        {**info.to_json(), **_peers_json(peers)},
        f"{verb} {info.namespace}/{info.checkpoint_id} here; peers notified ({peers.summary()})",
    )
    return 0


def _cmd_mark(client: DaemonClient, args: argparse.Namespace) -> int:
    info, peers = client.mark_checkpoint(
        check_namespace(args.namespace),
        check_checkpoint_id(args.id),
        parse_trust(args.state),
        reason=args.reason,
    )
    _emit(
        args,
        {**info.to_json(), **_peers_json(peers)},
        f"marked {info.namespace}/{info.checkpoint_id} {args.state} here; peers notified "
        f"({peers.summary()})",
    )
    return 0


def _cmd_verify(client: DaemonClient, args: argparse.Namespace) -> int:
    ok, verified, corrupt = client.verify_checkpoint(
        check_namespace(args.namespace), check_checkpoint_id(args.id)
    )
    payload = {"id": args.id, "ok": ok, "verified_bytes": verified, "corrupt_files": corrupt}
    text = (
        f"{args.namespace}/{args.id}: ok, {format_size(verified)} verified"
        if ok
        else f"{args.namespace}/{args.id}: CORRUPT files {', '.join(corrupt)}"
    )
    _emit(args, payload, text)
    return 0 if ok else 1


def _cmd_import_sagemaker(client: DaemonClient, args: argparse.Namespace) -> int:
    from tierckpt.sagemaker_import import import_sagemaker  # imports torch: only here

    steps = [int(s) for part in args.steps or () for s in part.split(",") if s.strip()]
    started = time.perf_counter()
    done = import_sagemaker(
        args.src_url, check_namespace(args.namespace), dest_url=args.dest, steps=steps or None
    )
    dest = args.dest or args.src_url
    lines = [
        f"{r.checkpoint_id}: already imported"
        if r.skipped
        else f"{r.checkpoint_id}: {r.files} files, {format_size(r.bytes)}"
        for r in done
    ]
    lines.append(
        f"imported {sum(not r.skipped for r in done)} checkpoint(s) of {args.namespace} into "
        f"{dest}/{args.namespace}/ in {time.perf_counter() - started:.2f} s; load one with "
        f"dcp.load(sd, checkpoint_id='{dest}/{args.namespace}/step_N') or a tierckptd whose "
        "[persistent] url is that URL"
    )
    _emit(args, [r.to_json() for r in done], "\n".join(lines))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierckpt", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--version", action="version", version=f"tierckpt {__version__}")
    parser.add_argument(
        "--daemon", help="daemon address (default: $TIERCKPT_DAEMON, else the default socket)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    ls = add("ls", "list a namespace's checkpoints (committed only, unless --all)")
    ls.add_argument("namespace", help="NAMESPACE, NAMESPACE/FOLDER or tierckpt://NAMESPACE/FOLDER")
    ls.add_argument("folder", nargs="?", help="only the checkpoints in this folder (run1/)")
    ls.add_argument("--all", action="store_true", help="also show WRITING and ABORTED saves")
    add("status", "the daemon's node, memory budget and namespaces")
    pull = add("pull", "copy a checkpoint into a directory stock dcp.load / FileSystemReader reads")
    pull.add_argument("namespace")
    pull.add_argument(
        "id",
        help=f"the checkpoint id; {LATEST}: the newest, {LATEST_VERIFIED}: the newest verified",
    )
    pull.add_argument("dest")
    pull.add_argument(
        "--verified", action="store_true", help=f"with ID {LATEST}: the newest verified checkpoint"
    )
    rm = add(
        "rm",
        "delete a checkpoint from every node's memory and from the persistent tier "
        "(a node that is down learns it on return)",
    )
    rm.add_argument("namespace")
    rm.add_argument("id")
    for name, help_text in (
        ("pin", "exempt a checkpoint from memory and persistent retention on every node"),
        ("unpin", "let retention evict a pinned checkpoint again, on every node"),
    ):
        pin = add(name, help_text)
        pin.add_argument("namespace")
        pin.add_argument("id")
    mark = add(
        "mark",
        "mark a checkpoint verified (its state was healthy) or bad (never restored as the "
        "newest), on every node",
    )
    mark.add_argument("namespace")
    mark.add_argument("id")
    mark.add_argument("state", help="verified or bad")
    mark.add_argument("--reason", default="", help="why (shown in ls; at most 256 characters)")
    info = add("info", "one checkpoint: its state, the tiers it reached, and who holds each file")
    info.add_argument("target", help="NAMESPACE/ID, tierckpt://NAMESPACE/ID or NAMESPACE")
    info.add_argument("id", nargs="?", help="the checkpoint id, when TARGET is the namespace")
    wait = add(
        "wait",
        "wait until a checkpoint reaches a tier (exit 1 with the reason on a timeout): "
        "run retention or advance 'latest' only after this",
    )
    wait.add_argument("target", help="NAMESPACE/ID, tierckpt://NAMESPACE/ID or NAMESPACE")
    wait.add_argument("id", nargs="?", help="the checkpoint id, when TARGET is the namespace")
    wait.add_argument(
        "--tier", choices=[t.value for t in Tier], default=Tier.MEMORY.value, help="default: memory"
    )
    wait.add_argument(
        "--copies",
        type=int,
        default=DEFAULT_COPIES,
        help=f"nodes that must hold every file, for --tier replicated (default {DEFAULT_COPIES})",
    )
    wait.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    verify = add("verify", "re-read a checkpoint and check every block checksum")
    verify.add_argument("namespace")
    verify.add_argument("id")
    sm = add(
        "import-sagemaker",
        "convert checkpoints of the SageMaker tiered-checkpointing client into stock DCP ones "
        "(server-side copies; no daemon needed)",
    )
    sm.add_argument("src_url", help="the SageMaker client's s3_tier_base_path (s3://bucket/prefix)")
    sm.add_argument("namespace", help="its namespace; also the tierckpt namespace")
    sm.add_argument(
        "--steps", action="append", help="steps to import, e.g. 100,200 (default: all committed)"
    )
    sm.add_argument(
        "--dest", help="the daemon's [persistent] url to import into (default: SRC_URL)"
    )
    return parser


_COMMANDS = {
    "ls": _cmd_ls,
    "info": _cmd_info,
    "wait": _cmd_wait,
    "pin": _cmd_pin,
    "unpin": _cmd_pin,
    "mark": _cmd_mark,
    "status": _cmd_status,
    "pull": _cmd_pull,
    "rm": _cmd_rm,
    "verify": _cmd_verify,
    "import-sagemaker": _cmd_import_sagemaker,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    client = DaemonClient(args.daemon)
    try:
        return _COMMANDS[args.command](client, args)
    except (TierckptError, OSError, ValueError) as e:
        print(f"tierckpt {args.command}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
