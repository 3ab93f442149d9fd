"""SageMaker HyperPod's checkpointing client API (``amzn-sagemaker-checkpointing`` 1.1.3)
over tierckpt: migrate a training script by changing its import line only::

    # before
    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import (
        SageMakerCheckpointConfig)
    from amzn_sagemaker_checkpointing.checkpointing.filesystem.filesystem import (
        SageMakerTieredStorageWriter, SageMakerTieredStorageReader)
    # after
    from tierckpt.compat.sagemaker import (
        SageMakerCheckpointConfig, SageMakerTieredStorageReader, SageMakerTieredStorageWriter)

Mapping (same signatures, same step rules):

- namespace -> the tierckpt namespace; step N -> checkpoint id ``step_N`` (the seed's own
  directory name; `tierckpt import-sagemaker` converts old checkpoints to the same ids).
- ``SageMakerTieredStorageWriter(config, path="", step=-1)``: the step is `step`, else
  the ``step_N`` in `path`, else `SageMakerTieredStorageError`; DCP's checkpoint id is
  ignored (``reset``), as in the seed. One writer per step; reusing a step raises
  (tierckpt checkpoints are immutable).
- ``SageMakerTieredStorageReader(config, step=None)``: ``step=None`` loads the highest
  ``step_N`` the daemon knows in any tier (memory, peers, the persistent tier).
- ``world_size`` is validated and otherwise unused (tierckpt also loads at another world
  size); ``disk_tier_base_path``/``save_to_disk`` are dead in the seed and ignored here.

``s3_tier_base_path`` is per job, as in the seed: each writer and reader sets it as the
namespace's persistent URL on its daemon (`DaemonClient.set_namespace`), and each
checkpoint records it, so every node drains its files to ``<s3_tier_base_path>/
<namespace>/step_N/`` (stock DCP layout) with the daemon's credentials. The daemon admits
only URLs under its ``[persistent] allowed_urls``; a refused one raises
`SageMakerS3TierError` from the save when ``save_to_s3`` is set, before anything is written
(else a warning: nothing needs S3 yet). Constructors make no call: the URL is sent when DCP
sets the writer up, and when the reader reads the metadata, on every rank. An empty ``s3_tier_base_path`` means the daemon's ``[persistent] url``.
``save_to_s3=True`` commits the checkpoint with tierckpt's per-checkpoint durable hint:
the daemon drains it whatever its ``[persistent] every`` says. The coordinator then waits
until the daemon reports it durable and checks that ``<s3_tier_base_path>/<namespace>/
step_N/.metadata`` exists; a timeout, a failed drain or a copy somewhere else raises
`SageMakerS3TierError` from the save. Errors keep their tierckpt cause (``__cause__``).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import fsspec
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tierckpt.daemon_client import DaemonClient
from tierckpt.errors import (
    InvalidArgument,
    InvalidName,
    NoPersistentTier,
    PermissionDenied,
    TierckptError,
)
from tierckpt.names import METADATA_FILE, check_namespace
from tierckpt.storage_reader import TieredStorageReader
from tierckpt.storage_writer import TieredStorageWriter
from tierckpt.trust import Trust

__all__ = [
    "SageMakerCheckpointConfig",
    "SageMakerInMemoryTierError",
    "SageMakerS3TierError",
    "SageMakerTieredStorageConfigError",
    "SageMakerTieredStorageError",
    "SageMakerTieredStorageReader",
    "SageMakerTieredStorageWriter",
    "checkpoint_id_of_step",
    "step_from",
]

logger = logging.getLogger(__name__)

_STEP_ID = re.compile(r"step_(\d+)")
# The daemon's tier tag of a checkpoint whose coordinator does not write its namespace
# on that node (`tierckptd.catalog.views.FOREIGN_TAG`): never the newest step.
FOREIGN = "foreign"
DEFAULT_S3_TIMEOUT_S = 600.0
_POLL_S = 0.2


class SageMakerTieredStorageError(Exception):
    """Base exception class for all SageMaker checkpointing errors."""


class SageMakerInMemoryTierError(SageMakerTieredStorageError):
    """Errors related to InMemory Tier (here: the tierckpt daemon and its tiers)."""


class SageMakerS3TierError(SageMakerTieredStorageError):
    """Errors related to S3 Tier (here: the daemon's persistent tier)."""


class SageMakerTieredStorageConfigError(SageMakerTieredStorageError):
    """Errors related to checkpoint configuration."""


@dataclass
class SageMakerCheckpointConfig:
    """The seed's configuration, field for field (1.1.3).

    Attributes:
        namespace: the training job; tierckpt's namespace (``[A-Za-z0-9._-]``, 1-128).
        world_size: ranks of the job; must be positive.
        disk_tier_base_path, save_to_disk: unused (dead in the seed too).
        s3_tier_base_path: ``s3://bucket/prefix``; must equal the daemon's
            ``[persistent] url`` for ``save_to_s3`` checkpoints (checked after each).
        s3_path_strategy: the seed's Ray layout; not supported (raises when set).
        save_to_s3: make the next writer's checkpoint durable (read when it is built).
        logger: accepted; tierckpt logs through the ``tierckpt`` logger hierarchy.
    """

    namespace: str
    world_size: int
    disk_tier_base_path: str = ""
    s3_tier_base_path: str = ""
    s3_path_strategy: Any = None
    save_to_s3: bool = False
    save_to_disk: bool = False
    logger: logging.Logger | None = None

    def __post_init__(self) -> None:
        if self.s3_path_strategy is not None and self.s3_tier_base_path:
            raise ValueError("s3_tier_base_path and s3_path_strategy are mutually exclusive")


def _validated(config: SageMakerCheckpointConfig) -> SageMakerCheckpointConfig:
    """The seed's checks (same messages), plus tierckpt's namespace grammar."""
    if not config.namespace:
        raise SageMakerTieredStorageConfigError(
            "Namespace in SageMakerCheckpointConfig cannot be empty"
        )
    if not isinstance(config.world_size, int) or config.world_size <= 0:
        raise SageMakerTieredStorageConfigError(
            f"Invalid world size:{config.world_size}, expecting a positive integer"
        )
    if config.save_to_s3 and not str(config.s3_tier_base_path or "").startswith("s3://"):
        raise SageMakerTieredStorageConfigError(
            "Invalid S3 tier base path, should start with s3://"
        )
    if config.s3_path_strategy is not None:
        raise SageMakerTieredStorageConfigError(
            "s3_path_strategy is not supported by tierckpt: durable checkpoints go to "
            "<s3_tier_base_path>/<namespace>/step_N; use s3_tier_base_path"
        )
    try:
        check_namespace(config.namespace)
    except InvalidName as e:
        raise SageMakerTieredStorageConfigError(str(e)) from e
    return config


def checkpoint_id_of_step(step: int) -> str:
    """tierckpt's checkpoint id of a SageMaker step: ``step_N``."""
    return f"step_{step}"


def step_from(step: int, path: str | os.PathLike[str]) -> int:
    """The seed's step rule: `step` unless -1, else the N of ``step_N`` in `path`."""
    selected = -1
    if step != -1:
        selected = step
    elif path and "step_" in str(path):
        try:
            selected = int(str(path).split("step_")[1].split("/")[0])
        except (IndexError, ValueError):
            pass
    if selected < 0:
        raise SageMakerTieredStorageError(f"Invalid step value, step:{step}. path:{path}")
    return selected


def _in_memory_error(e: TierckptError) -> SageMakerInMemoryTierError:
    return SageMakerInMemoryTierError(f"{type(e).__name__}: {e}")


def _set_base_path(
    client: DaemonClient, config: SageMakerCheckpointConfig, *, reset: bool = True
) -> None:
    """Make ``s3_tier_base_path`` the namespace's persistent URL on this rank's daemon.
    Refused (not allowed, no persistent tier): raise when this step needs S3, else warn.
    An unset base path resets the namespace to the daemon's ``[persistent] url`` only
    with `reset` (writers): a reader without one must not redirect a running job's drain."""
    base = str(config.s3_tier_base_path or "")
    if not base and not reset:
        return
    try:
        client.set_namespace(config.namespace, persistent_url=base)
    except (PermissionDenied, InvalidArgument) as e:
        if config.save_to_s3:
            raise SageMakerS3TierError(
                f"s3_tier_base_path {base!r} was refused by the daemon at {client.address}: {e}"
            ) from e
        logger.warning(
            "s3_tier_base_path %r refused by the daemon (%s); checkpoints of %s that drain "
            "go to its [persistent] url",
            base,
            e,
            config.namespace,
        )
    except TierckptError as e:
        raise _in_memory_error(e) from e


class SageMakerTieredStorageWriter(TieredStorageWriter):
    """``SageMakerTieredStorageWriter(checkpoint_config, path="", step=-1)`` over
    `TieredStorageWriter`: saves ``<namespace>/step_N`` into the daemon's memory tier.

    Keyword-only extras (not in the seed): `daemon` (default ``$TIERCKPT_DAEMON``),
    `thread_count`, and `s3_timeout_s`, how long the coordinator waits for a
    ``save_to_s3`` checkpoint to become durable.
    """

    def __init__(
        self,
        checkpoint_config: SageMakerCheckpointConfig,
        path: str | os.PathLike[str] = "",
        step: int = -1,
        *args: Any,
        daemon: str | None = None,
        thread_count: int = 2,
        s3_timeout_s: float = DEFAULT_S3_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        step = step_from(step, path)  # the seed checks the step first
        config = _validated(checkpoint_config)
        # per writer (the README flips save_to_s3 per step): the commit's durable hint
        save_to_s3 = bool(config.save_to_s3)
        super().__init__(
            config.namespace, daemon=daemon, thread_count=thread_count, durable=save_to_s3
        )
        self.checkpoint_config = config
        self.step = step
        self.save_to_s3 = save_to_s3
        self.s3_base_path = config.s3_tier_base_path
        self.s3_timeout_s = s3_timeout_s
        self.reset()

    @property
    def s3_checkpoint_dir(self) -> str:
        """Where a ``save_to_s3`` checkpoint lands: ``<s3_tier_base_path>/<ns>/step_N``."""
        base = self.s3_base_path.rstrip("/")
        return f"{base}/{self.namespace}/{checkpoint_id_of_step(self.step)}"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's checkpoint id is ignored, as in the seed: the step names the checkpoint."""
        super().reset(checkpoint_id_of_step(self.step))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _set_base_path(self.client, self.checkpoint_config)  # every rank, before its Begin
        try:
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        except TierckptError as e:
            raise _in_memory_error(e) from e

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return super().write_data(plan, planner)
        except TierckptError as e:
            raise _in_memory_error(e) from e

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            super().finish(metadata, results)
        except NoPersistentTier as e:  # save_to_s3 with a daemon that has no S3 tier
            raise SageMakerS3TierError(
                f"save_to_s3=True, but the daemon has no persistent tier for "
                f"{self.namespace}: set s3_tier_base_path under its [persistent] "
                f"allowed_urls, or its [persistent] url ({e})"
            ) from e
        except TierckptError as e:
            raise _in_memory_error(e) from e
        if self.save_to_s3:
            self._wait_durable()

    def _wait_durable(self) -> None:
        """``save_to_s3``: the checkpoint must become durable, under s3_tier_base_path."""
        cid = checkpoint_id_of_step(self.step)
        what = f"{self.namespace}/{cid}"
        deadline = time.monotonic() + self.s3_timeout_s
        while True:
            try:
                info = self.client.get_checkpoint(self.namespace, cid)
            except TierckptError as e:
                raise SageMakerS3TierError(f"{what}: cannot ask the daemon: {e}") from e
            if info.state == "DURABLE" or "persistent" in info.tiers:
                break
            if "drain-failed" in info.tiers:
                raise SageMakerS3TierError(
                    f"{what}: the daemon could not make it durable (drain-failed); see its log"
                )
            if time.monotonic() >= deadline:
                raise SageMakerS3TierError(
                    f"{what}: save_to_s3=True, but it is not durable after "
                    f"{self.s3_timeout_s:.0f} s (the daemon drains it in the background; "
                    "see its log, or raise s3_timeout_s)"
                )
            time.sleep(_POLL_S)
        self._check_location(what)

    def _check_location(self, what: str) -> None:
        """Trust, but verify: the durable copy must be where the job said, under
        s3_tier_base_path (the URL was set when the writer was made; a daemon restarted
        since then, or another writer of the namespace, may have changed it)."""
        marker = f"{self.s3_checkpoint_dir}/{METADATA_FILE}"
        try:
            fs, path = fsspec.core.url_to_fs(marker)
            fs.invalidate_cache(path)
            found = bool(fs.exists(path))
        except Exception as e:  # no credentials here, s3fs missing, ...: say so
            logger.warning(
                "%s is durable, but whether it is under s3_tier_base_path %s could not be "
                "checked from this process (%s: %.200s)",
                what,
                self.s3_base_path,
                type(e).__name__,
                e,
            )
            return
        if not found:
            raise SageMakerS3TierError(
                f"{what} is durable in the daemon's persistent tier, but not under "
                f"s3_tier_base_path ({marker} does not exist): the namespace's persistent "
                "URL on the daemon differs (another process of the job set another "
                "s3_tier_base_path, or the daemon restarted before the commit); give every "
                "rank the same config"
            )


class SageMakerTieredStorageReader(TieredStorageReader):
    """``SageMakerTieredStorageReader(checkpoint_config, step=None)`` over
    `TieredStorageReader`: restores ``<namespace>/step_N`` from the nearest tier, every
    block verified. ``step=None``: the highest step in any tier (resolved when DCP reads
    the metadata; `step` is then set to it, as in the seed).

    Keyword-only extras: `daemon` (default ``$TIERCKPT_DAEMON``), `io_threads`.
    """

    def __init__(
        self,
        checkpoint_config: SageMakerCheckpointConfig,
        step: int | None = None,
        *,
        daemon: str | None = None,
        io_threads: int = 4,
    ) -> None:
        config = _validated(checkpoint_config)
        super().__init__(config.namespace, daemon=daemon, io_threads=io_threads)
        self.checkpoint_config = config
        self.step = step
        self.s3_base_path = config.s3_tier_base_path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's checkpoint id is ignored, as in the seed: `step` names the checkpoint."""
        super().reset(None if self.step is None else checkpoint_id_of_step(self.step))

    def newest_step(self) -> int:
        """The highest ``step_N`` of the namespace in any tier the daemon knows, among
        the checkpoints the daemon would restore as a newest: a LOST one, or one tagged
        `foreign` (published by a node that does not write the namespace, audit 3 H2:
        a peer's ``step_99999999``) or one marked bad (`tierckpt.mark`) never is."""
        try:
            rows = self.client.list_checkpoints(self.namespace)
        except TierckptError as e:
            raise _in_memory_error(e) from e
        # A LOST step (a file left on no tier after a node loss) cannot be restored: the
        # newest step that can is the answer, as the seed falls back to an older step.
        found = [
            (int(m.group(1)), r.state)
            for r in rows
            if (m := _STEP_ID.fullmatch(r.checkpoint_id))
            and FOREIGN not in r.tiers
            and r.trust is not Trust.BAD
        ]
        steps = [step for step, state in found if state != "LOST"]
        lost = sorted(step for step, state in found if state == "LOST")
        if lost:
            logger.warning(
                "%s: step(s) %s are LOST (a file has no copy on any tier); step=None restores "
                "the newest step that is whole",
                self.namespace,
                ", ".join(map(str, lost)),
            )
        if not steps:
            raise SageMakerTieredStorageError(
                f"No checkpoints to read metadata: {self.namespace} has no step_N checkpoint "
                + (f"that is whole (LOST: {', '.join(map(str, lost))}) " if lost else "")
                + f"in any tier of the daemon at {self.client.address} (S3 was looked up under "
                f"s3_tier_base_path {self.s3_base_path or 'unset: the daemon [persistent] url'}); "
                "checkpoints the SageMaker client wrote need `tierckpt import-sagemaker` first"
            )
        return max(steps)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Every rank reads the metadata first: its daemon then looks up S3 under the
        # job's base path (a replacement node finds the job's durable checkpoints there).
        _set_base_path(self.client, self.checkpoint_config, reset=False)
        if self.step is None:
            self.step = self.newest_step()
            super().reset(checkpoint_id_of_step(self.step))
        try:
            return super().read_metadata(*args, **kwargs)
        except TierckptError as e:
            raise _in_memory_error(e) from e
