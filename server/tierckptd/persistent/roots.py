"""Which persistent tier a checkpoint drains to: one daemon, several object-store roots.

A daemon has its ``[persistent] url`` (the default) and, per namespace, the URL a job
chose (`SetNamespace`; the SageMaker compat's per-job ``s3_tier_base_path``). The choice
is policy, not trust: a URL must equal or lie under one of ``[persistent] allowed_urls``,
compared by whole segments after normalization (`tierckpt.names.check_persistent_url`),
so ``s3://bucket/jobs`` admits ``s3://bucket/jobs/run7`` but not ``s3://bucket/jobs-evil``
or ``s3://bucket/jobs/../secret``. Every root uses the daemon's own ``storage_options``
(credentials): a job picks a place the operator allowed, never an identity.

The URL a checkpoint drains to is fixed when it is committed and travels with its
manifest (``CheckpointRecord.persistent_url``, "" for the default), so every owner of its
files drains to the same place and a namespace that changes its URL never strands the
checkpoints already drained. A manifest from a peer or a file is checked again here
before it is used: a URL this node does not allow resolves to no tier (`tier` returns
None), and the drain refuses it rather than write where its operator did not agree to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tierckpt.errors import InvalidName, PermissionDenied
from tierckpt.names import check_persistent_url

from tierckptd.config import PersistentConfig
from tierckptd.config_secrets import redact
from tierckptd.persistent.source import PersistentSource
from tierckptd.persistent.store import PersistentTier

__all__ = ["MAX_ROOTS", "Roots"]

MAX_ROOTS = 1024  # distinct per-namespace roots one daemon opens (each holds an fs client)


class Roots:
    """The persistent tiers of one daemon, by the URL recorded in a checkpoint.

    Args:
        default: the ``[persistent] url`` tier (None: no default; namespaces may still
            choose an allowed URL).
        allowed: normalized prefixes a namespace URL must equal or lie under.
        make: builds the tier for an allowed URL (main.py: the config's options).
    """

    def __init__(
        self,
        default: PersistentTier | None,
        allowed: tuple[str, ...] = (),
        make: Callable[[str], PersistentTier] | None = None,
    ) -> None:
        self.default = default
        self.allowed = tuple(check_persistent_url(p) for p in allowed)
        self._make = make
        self._default_url = _normalized(default.url) if default is not None else ""
        self._roots: dict[str, PersistentTier] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: PersistentConfig, **tier_options: object) -> Roots:
        """The stores of ``[persistent]``; `tier_options` as `PersistentTier` takes them."""

        def make(url: str) -> PersistentTier:
            return PersistentTier(
                url,
                dict(config.storage_options),
                compression=config.compression,
                level=config.level,
                **tier_options,  # type: ignore[arg-type]
            )

        default = make(config.url) if config.url else None
        return cls(default, config.allowed_urls, make)

    @property
    def enabled(self) -> bool:
        """Whether any checkpoint can drain (a default, or URLs a namespace may choose)."""
        return self.default is not None or bool(self.allowed and self._make)

    def check(self, url: str) -> str:
        """`url` as a checkpoint records it: "" for the default tier, else normalized.

        Raises:
            InvalidName: a malformed URL.
            PermissionDenied: not under ``[persistent] allowed_urls``.
        """
        normalized = check_persistent_url(url)
        if not normalized or normalized == self._default_url:
            return ""
        if not any(normalized == p or normalized.startswith(p + "/") for p in self.allowed):
            allowed = ", ".join(str(redact(p)) for p in self.allowed) or "none"
            raise PermissionDenied(
                f"persistent URL {redact(normalized)} is not under this daemon's "
                f"[persistent] allowed_urls ({allowed}); an operator adds its prefix there, "
                "or the job uses one of them"
            )
        return normalized

    def source(self, url: str) -> PersistentSource | None:
        """The persistent tier a checkpoint recorded with `url` drains to, as a source of
        the restore chain (`restore.PersistentCopies`); None when this node has none."""
        tier = self.tier(url)
        return PersistentSource(tier) if tier is not None else None

    def tier(self, url: str) -> PersistentTier | None:
        """The tier a checkpoint recorded with `url` drains to; None when this node has
        none there (no default, a URL it does not allow, or too many roots open)."""
        if not url:
            return self.default
        try:
            normalized = self.check(url)
        except (InvalidName, PermissionDenied):
            return None
        if not normalized:
            return self.default
        with self._lock:
            found = self._roots.get(normalized)
            if found is None and self._make is not None and len(self._roots) < MAX_ROOTS:
                found = self._roots[normalized] = self._make(normalized)
            return found

    def known(self) -> list[PersistentTier]:
        """Every tier opened so far, the default first (shutdown deadlines, adoption)."""
        with self._lock:
            roots = list(self._roots.values())
        return [self.default, *roots] if self.default is not None else roots

    def url_of(self, tier: PersistentTier) -> str:
        """What a checkpoint found in `tier` records: "" for the default."""
        return "" if tier is self.default else _normalized(tier.url)


def _normalized(url: str) -> str:
    """The grammar's spelling of a configured URL, or the URL itself when the grammar
    does not accept it (an operator's `[persistent] url` may use any fsspec form)."""
    try:
        return check_persistent_url(url)
    except InvalidName:
        return url
