"""SageMaker HyperPod's checkpointing HTTP API, served by tierckptd (`[listen] sagemaker`),
so the unmodified ``amzn-sagemaker-checkpointing`` client saves into tierckpt's tiers.

Modules: `protocol` (routes, names, Shard-Meta, validated where they enter),
`checkpoints` (the seed's blobs as tierckpt checkpoints, the commit; a namespace's
`steps_retained` is its memory window in the daemon's retention), `http` (the listener),
`adapter` (the one narrow door into the daemon: `SeedDaemon`).
`start_listener` is what main.py calls.
"""

from __future__ import annotations

import importlib
import logging
import threading

from tierckptd.config import Config
from tierckptd.sagemaker.adapter import DaemonAdapter, SeedDaemon
from tierckptd.sagemaker.checkpoints import SeedCheckpoints
from tierckptd.sagemaker.http import SeedListener

__all__ = ["DaemonAdapter", "SeedCheckpoints", "SeedDaemon", "SeedListener", "start_listener"]

logger = logging.getLogger(__name__)

# What converting the first metadata blob imports (torch's DCP types): seconds on a busy
# node, so imported in the background at start rather than inside a save's 60 s.
_PRELOAD = ("torch.distributed.checkpoint.filesystem", "tierckpt.dcp_metadata")


def _preload() -> None:
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # the first conversion imports it again and reports
            logger.warning("sagemaker API: cannot preload %s: %.200s", name, e)


def start_listener(config: Config, daemon: SeedDaemon) -> SeedListener | None:
    """The listener of `[listen] sagemaker`, bound and serving; None when it is off.

    Raises:
        AddressInUse: the address cannot be bound.
    """
    if not config.listen.sagemaker:
        return None
    api = SeedCheckpoints(
        daemon,
        allow_reset=config.listen.sagemaker_allow_reset,
    )
    listener = SeedListener(config.listen.sagemaker, api)  # bound before any thread starts
    listener.start()
    threading.Thread(target=_preload, name="tierckptd-sagemaker-preload", daemon=True).start()
    return listener
