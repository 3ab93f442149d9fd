"""The parts main.py wires around one catalog, for tests that serve it over gRPC or
commit through the coordinator: its cluster (a node without peers unless one is given),
the commit coordinator asking that cluster, and the DaemonService over them."""

from __future__ import annotations

from tierckptd.catalog import Catalog
from tierckptd.commit import CommitCoordinator
from tierckptd.peers.cluster import Cluster
from tierckptd.restore import Restorer, no_sources
from tierckptd.rpc.daemon_service import DaemonService, Discovery, PersistentUrls
from tierckptd.rpc.local_access import LocalAccess


def one_node(catalog: Catalog) -> Cluster:
    """The peer tier of a node without peers (rm and pin still go through its marks)."""
    return Cluster(catalog, Restorer(catalog, no_sources))


def coordinator(catalog: Catalog, cluster: Cluster) -> CommitCoordinator:
    """The commit coordinator as main.py builds it: holders and listener the cluster's,
    asked while its membership has peers."""
    commits = CommitCoordinator(
        catalog, cluster.committer, [cluster.committer], peers=len(cluster.peer_ids)
    )
    cluster.membership.resized.add(commits.peers_changed)
    return commits


def daemon_service(
    catalog: Catalog,
    *,
    cluster: Cluster | None = None,
    access: LocalAccess | None = None,
    discovery: Discovery | None = None,
    persistent_urls: PersistentUrls | None = None,
) -> DaemonService:
    """DaemonService over `catalog` wired as main.py does."""
    cluster = cluster if cluster is not None else one_node(catalog)
    return DaemonService(
        catalog,
        commits=coordinator(catalog, cluster),
        marks=cluster,
        restorer=cluster.restorer,
        access=access,
        discovery=discovery,
        persistent_urls=persistent_urls,
    )
