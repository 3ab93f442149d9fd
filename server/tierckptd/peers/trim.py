"""Trimming surplus replicas: a file keeps exactly k extra copies, not more.

More than k + 1 verified copies appear when a holder comes back after healing replaced
it (an owner that was unreachable, a partition that healed) or after a restore fetched a
copy. The copies kept are the k + 1 best in placement preference: the owner first, then
`placement.preference` order (other failure domains first), then nodes that are no
longer members, by id. Every node ranks the same way, so the node that drops a copy
needs no agreement: each node drops only its own copy, only when it ranks beyond k + 1
among the holders whose Holdings answers confirmed a verified copy. The copies kept are
then confirmed, and an unreachable node never counts, so a trim never leaves fewer than
k + 1 confirmed copies. No extra RPC: the heal round's Holdings answers are the input.

Replica lists are told by broadcasts from several nodes (the responsible node's, a
trimming node's) that can cross on the way, leaving a node with a list that names a
node which dropped its copy. `settled_replicas` lets every node correct its own list
from the heal round's answers, when every node the list names answered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tierckptd.model import CheckpointView, FileRecord
from tierckptd.peers.client import Holdings
from tierckptd.peers.placement import Member, file_key, preference

__all__ = ["plan_trim", "ranked_holders", "settled_replicas"]


def ranked_holders(
    view: CheckpointView, f: FileRecord, holders: Sequence[str], members: Sequence[Member]
) -> list[str]:
    """`holders` best first: the owner, then placement preference, then non-members by id."""
    order = preference(file_key(view.namespace, view.checkpoint_id, f.name), f.owner_node, members)
    rank = {n: i for i, n in enumerate([f.owner_node, *order])}
    return sorted(holders, key=lambda n: (rank.get(n, len(rank)), n))


def plan_trim(
    view: CheckpointView,
    holdings: Mapping[str, Holdings],
    members: Sequence[Member],
    k: int,
    me: str,
) -> dict[str, list[str]]:
    """The files whose copy on `me` is surplus, each with the replica list to record
    once it is dropped (the kept holders other than the owner, best first). Pure.

    `holdings`: every reachable node (`me` included) and what it holds; a node whose
    answer did not validate (`files` None) confirms nothing.
    """
    confirmed = [n for n, h in holdings.items() if n == me or h.files is not None]
    trims: dict[str, list[str]] = {}
    for f in view.files:
        if f.owner_node == me:
            continue  # the owner's copy ranks first: never surplus
        holders = [n for n in confirmed if f.name in holdings[n].names]
        if me not in holders or len(holders) <= k + 1:
            continue
        kept = ranked_holders(view, f, holders, members)[: k + 1]
        if me not in kept:
            trims[f.name] = [n for n in kept if n != f.owner_node]
    return trims


def settled_replicas(
    view: CheckpointView, holdings: Mapping[str, Holdings], members: Sequence[Member]
) -> dict[str, list[str]]:
    """The files whose recorded replica list differs from what the holders said, each
    with the list they confirm (holders other than the owner, best first). Only files
    some node holds and whose owner and every listed replica node answered: a node that
    did not answer may still hold its copy. Pure."""
    settled: dict[str, list[str]] = {}
    for f in view.files:
        named = {f.owner_node, *f.replica_nodes} - {""}
        holders = [n for n in holdings if f.name in holdings[n].names]
        if not holders or not named <= set(holdings):
            continue
        confirmed = [n for n in ranked_holders(view, f, holders, members) if n != f.owner_node]
        if confirmed != f.replica_nodes:
            settled[f.name] = confirmed
    return settled
