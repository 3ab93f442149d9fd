"""SageMaker HyperPod's checkpointing HTTP API, served by tierckptd (`[listen] sagemaker`),
so the unmodified ``amzn-sagemaker-checkpointing`` client saves into tierckpt's tiers.

Modules: `protocol` (routes, names, Shard-Meta, validated where they enter),
`checkpoints` (the seed's blobs as tierckpt checkpoints, the commit), `http` (the
listener), `adapter` (the one narrow door into the daemon: `SeedDaemon`).
`start_listener` is what main.py calls.
"""

from __future__ import annotations

from tierckptd.catalog import Catalog
from tierckptd.config import Config
from tierckptd.peers.cluster import Cluster
from tierckptd.rpc.daemon_service import Discovery
from tierckptd.sagemaker.adapter import DaemonAdapter, SeedDaemon
from tierckptd.sagemaker.checkpoints import SeedCheckpoints
from tierckptd.sagemaker.http import SeedListener

__all__ = ["DaemonAdapter", "SeedCheckpoints", "SeedDaemon", "SeedListener", "start_listener"]


def start_listener(
    config: Config, catalog: Catalog, cluster: Cluster, discovery: Discovery | None = None
) -> SeedListener | None:
    """The listener of `[listen] sagemaker`, bound and serving; None when it is off.

    Raises:
        AddressInUse: the address cannot be bound.
    """
    if not config.listen.sagemaker:
        return None
    api = SeedCheckpoints(
        DaemonAdapter(catalog, cluster, discovery=discovery),
        allow_reset=config.listen.sagemaker_allow_reset,
    )
    return SeedListener(config.listen.sagemaker, api).start()
