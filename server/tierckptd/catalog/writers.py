"""The namespace binding: which nodes write each namespace on this node (`model.Trust`).

A namespace's writers here are the coordinators of its PROVEN checkpoints (committed,
taken part in, or found durable here); while it has none, the writers a majority of the
peers stated once they were asked (`set_cluster_writers`, audit 3 H2: they replace trust
on first use, an empty agreement included); else the coordinators of its VOUCHED ones.
Only a writer's checkpoint is ever a namespace's newest, so a peer publishing into a
namespace it does not write is listed (FOREIGN) but never restored as the newest.

It exists apart from the catalog because it is one rule with its own state (what the
cluster stated, per namespace), asked by the peer tier when it binds a namespace, and
by the catalog when it picks a newest, trusts a publish or explains a NOT_FOUND. It
reads the catalog's records (a read-only view) and shares its lock, as
`durability.DurabilityLedger` does: the methods marked "under the lock" are called by
the catalog with it held; the others take it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from tierckpt.errors import CheckpointNotFound

from tierckptd.catalog.views import listing
from tierckptd.model import CheckpointRecord, Key, State, Trust, coordinator_of

__all__ = ["NamespaceWriters"]


class NamespaceWriters:
    """Per namespace, the nodes that write it here, and what the peers stated of them.

    Args:
        lock: the catalog's lock.
        records: the catalog's records, read only.
        node_id: this node (named in messages).
    """

    def __init__(
        self, lock: threading.Lock, records: Mapping[Key, CheckpointRecord], node_id: str
    ) -> None:
        self._lock = lock
        self._records = records
        self._node_id = node_id
        # The writers the cluster states for a namespace this node has no PROVEN
        # checkpoint of: they replace trust on first use. An empty set: the peers agreed
        # on none (no newest from peers). Beside it, what each peer stated, for messages.
        self._cluster: dict[str, frozenset[str]] = {}
        self._stated: dict[str, dict[str, frozenset[str]]] = {}

    # ---- the rule (under the lock) ----------------------------------------------------
    def _coordinators(self, trust: Trust, namespace: str = "") -> dict[str, set[str]]:
        """The coordinators of the committed checkpoints of `trust`, per namespace (of
        `namespace` only, or of every one)."""
        found: dict[str, set[str]] = {}
        for r in self._records.values():
            if (namespace and r.namespace != namespace) or r.state is not State.COMMITTED:
                continue
            if r.trust is trust and (coordinator := coordinator_of(r.files)):
                found.setdefault(r.namespace, set()).add(coordinator)
        return found

    def proven(self, namespace: str = "") -> dict[str, set[str]]:
        """The coordinators of the PROVEN checkpoints of `namespace` (or of every one)."""
        return self._coordinators(Trust.PROVEN, namespace)

    def by_namespace(self, namespace: str = "") -> dict[str, set[str]]:
        """`of` `namespace`, or of every namespace ("")."""
        proven = self.proven(namespace)
        vouched = self._coordinators(Trust.VOUCHED, namespace)
        cluster = {
            ns: set(w) for ns, w in self._cluster.items() if not namespace or ns == namespace
        }
        return {
            ns: proven.get(ns) or (cluster[ns] if ns in cluster else vouched.get(ns, set()))
            for ns in {*proven, *vouched, *cluster}
        }

    def of(self, namespace: str) -> set[str]:
        """The nodes that write `namespace` here (the module docstring's rule)."""
        return self.by_namespace(namespace).get(namespace, set())

    def foreign(self, rec: CheckpointRecord, writers: set[str] | None = None) -> bool:
        """Whether `rec` is never its namespace's newest here for its coordinator (not a
        writer of the namespace); `writers` of its namespace if known."""
        if rec.state is not State.COMMITTED:
            return False
        coordinator = coordinator_of(rec.files)
        if not coordinator:
            return rec.trust is Trust.FOREIGN
        return coordinator not in (writers if writers is not None else self.of(rec.namespace))

    def trust_of(self, published: CheckpointRecord) -> Trust:
        """A peer's manifest this node took no part in: VOUCHED when its coordinator
        writes the namespace here, or the namespace has no writer yet and the peers were
        not asked about it (trust on first use: a coordinator publishing its own save),
        else FOREIGN. Once the peers stated the writers, those decide, an empty agreement
        included."""
        writers = self.of(published.namespace)
        asked = published.namespace in self._cluster
        if (not writers and not asked) or coordinator_of(published.files) in writers:
            return Trust.VOUCHED
        return Trust.FOREIGN

    def unbound(
        self, namespace: str, is_lost: Callable[[CheckpointRecord], bool]
    ) -> CheckpointNotFound | None:
        """Why a namespace has no newest when its peers agreed on no writer of it (a node
        with no binding of its own), naming the candidates; None otherwise."""
        agreed = self._cluster.get(namespace)
        if self.proven(namespace) or agreed is None or agreed:
            return None  # a binding of its own, never asked, or the peers agreed on writers
        candidates = sorted(
            (r for r in self._records.values() if r.namespace == namespace),
            key=lambda r: r.order,
            reverse=True,
        )
        committed = [r for r in candidates if r.state is State.COMMITTED]
        if not committed:
            return None
        stated = self._stated.get(namespace, {})
        said = "; ".join(
            f"{node} says {listing(sorted(w)) if w else 'none'}"
            for node, w in sorted(stated.items())
        )
        return CheckpointNotFound(
            f"no newest checkpoint of {namespace} on node {self._node_id}: this node took no "
            f"part in {namespace} and its peers agree on no writer of it (a writer needs a "
            f"majority of the {len(stated)} peers that state one, and a node never vouches "
            f"for itself alone: {said or 'none stated'}); candidates: "
            + listing(
                [
                    f"{r.checkpoint_id} (by {coordinator_of(r.files) or 'none'}"
                    + (", LOST)" if is_lost(r) else ")")
                    for r in committed
                ]
            )
            + "; load one by its id"
        )

    # ---- the peer tier's questions (take the lock) -------------------------------------
    def bound_namespaces(self) -> set[str]:
        """The namespaces this node has writers of: its binding, kept."""
        with self._lock:
            return {ns for ns, w in self.by_namespace().items() if w}

    def proven_writers(self, namespace: str = "") -> dict[str, set[str]]:
        """This node's own binding (what it states to peers): per namespace, the
        coordinators of the checkpoints it committed, took part in, or found durable."""
        with self._lock:
            return self.proven(namespace)

    def stated_writers(self, namespace: str = "") -> dict[str, tuple[set[str], bool]]:
        """What this node states to peers as a namespace's writers, and whether the
        statement is only vouched: its PROVEN writers where it has any (False), else the
        ones it uses itself (True: what its peers agreed on, or the coordinators of the
        copies it holds). A node that only holds a job's replicas thus still vouches for
        its coordinator, so the replacement of that job's only writer finds the newest;
        a vouched statement counts only where no peer states proven writers."""
        with self._lock:
            proven = self.proven(namespace)
            return {
                ns: (proven[ns], False) if ns in proven else (nodes, True)
                for ns, nodes in self.by_namespace(namespace).items()
                if nodes
            }

    def set_cluster_writers(
        self, namespace: str, writers: set[str], stated: dict[str, frozenset[str]]
    ) -> bool:
        """The writers of `namespace` a majority of the peers stated (`stated`: what each
        said), for a node that had no binding of it (`bound_namespaces`, asked before the
        peers were): they replace trust on first use, and any VOUCHED one a peer's publish
        made meanwhile. Returns False (nothing set) when this node has PROVEN writers."""
        with self._lock:
            if self.proven(namespace):
                return False
            self._cluster[namespace] = frozenset(writers)
            self._stated[namespace] = dict(stated)
            return True
