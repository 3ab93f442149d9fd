"""Daemon configuration: TOML (tomllib) into frozen dataclasses.

Every key has a default so a bare `tierckptd` serves a single node, on loopback only;
unknown sections and keys are rejected with the list of valid ones, because a typo in a
retention or budget key would otherwise silently fall back to a default and surprise an
operator much later. A config that would expose the peer port to the network without a
token or TLS is refused (DESIGN invariant 11). Keeping secrets out of logs is
`config_secrets`' job.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt.errors import InvalidName
from tierckpt.names import check_persistent_url

from tierckptd.config_checks import (
    ConfigError,
    check_exposure,
    check_membership,
    exposure_warnings,
    host_of,
    is_loopback_address,
    node_identity,
)

__all__ = [
    "Config",
    "ConfigError",
    "ListenConfig",
    "LogConfig",
    "MemoryConfig",
    "MetricsConfig",
    "NodeConfig",
    "PeerConfig",
    "PersistentConfig",
    "ReplicationConfig",
    "RetentionConfig",
    "SecurityConfig",
    "exposure_warnings",
    "is_loopback_address",
    "load_config",
    "parse_config",
    "parse_size",
]

logger = logging.getLogger(__name__)

# A field whose metadata has SIZE accepts an int or a string such as "64GiB".
SIZE = {"kind": "size"}

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(value: object, *, what: str = "size") -> int:
    """Bytes of `value`: an int, or a string like "64GiB", "512MiB", "1.5GB" (KiB = 1024)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size such as 64GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: a size cannot be negative ({value})")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match and match.group(2).lower() in _UNITS:
            return math.floor(float(match.group(1)) * _UNITS[match.group(2).lower()])
    units = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
    raise ConfigError(
        f"{what}: cannot parse size {value!r}; use an integer or e.g. '64GiB' ({units})"
    )


@dataclass(frozen=True)
class NodeConfig:
    """``[node]``: who this daemon is to its peers. `id` names it in the cluster (and in
    every log line); `failure_domain` (a rack, a zone) keeps a file's copies off nodes
    that fail together. Empty values default to the hostname and the node id."""

    id: str = ""  # "" = the hostname (resolved by load)
    failure_domain: str = ""  # "" = the node id (resolved by load)


@dataclass(frozen=True)
class ListenConfig:
    """``[listen]``: where the daemon serves. `local` is the control socket of this
    node's ranks and CLI; `peer` the PeerService address, loopback by default because a
    peer port on the network must be secured (``[security]``) explicitly."""

    local: str = "unix:///run/tierckpt/tierckptd.sock"
    # Loopback: a bare daemon serves one node; peers need an explicit, secured address.
    peer: str = "127.0.0.1:7070"
    # The bulk listener peers fetch file bytes from (`peers/bulk_server.py`), on the host
    # of `peer`, with its TLS, serving only transfers granted over `peer`; false: none
    # (peers fetch over gRPC FetchFile). Its port: 0 = any free one (told in each grant).
    peer_bulk: bool = True
    peer_bulk_port: int = 0
    # SageMaker HyperPod's checkpointing HTTP API for its unmodified client
    # (`tierckptd.sagemaker`): "HOST:PORT", "" = off. It takes no credentials: loopback,
    # or the pod IP behind a NetworkPolicy; refused with local_isolation = "uid".
    sagemaker: str = ""
    # Let POST /v1/cp/cluster/reset delete every namespace the API serves, cluster-wide.
    sagemaker_allow_reset: bool = False


@dataclass(frozen=True)
class MemoryConfig:
    """``[memory]``: the memory tier, files in `dir` (a tmpfs) under a byte `budget`:
    segment recycling and prewarming (so a save finds pages already faulted in), when an
    idle save is abandoned, the background scrubber, and the bounds that keep one peer or
    many namespaces from filling the node."""

    dir: str = "/dev/shm/tierckpt"
    budget: int = field(default=64 * 1024**3, metadata=SIZE)
    recycle: bool = True
    prewarm: int = field(default=0, metadata=SIZE)
    # After each commit, warm pool segments for the namespace's next save in the
    # background (within the budget), at most prewarm_next_max bytes (0: the last save's).
    prewarm_next: bool = True
    prewarm_next_max: int = field(default=0, metadata=SIZE)
    abandon_after: float = 900.0
    # The background scrubber re-hashes every memory copy against its checksums at most
    # this many bytes per second (0: off), so a flipped bit is found and repaired from
    # another copy before anyone reads it; a pass starts scrub_interval s after the last.
    scrub_rate: int = field(default=64 * 1024**2, metadata=SIZE)
    scrub_interval: float = 300.0
    # The share of the budget the manifests of one coordinating peer may take here (a
    # peer's manifest beyond it is RESOURCE_EXHAUSTED): no peer fills the budget.
    peer_manifest_share: float = 0.01
    # Namespaces this node keeps at most (its saves, peers' manifests, the persistent
    # tier's adoptions): a save or manifest of one more is RESOURCE_EXHAUSTED. Each one
    # costs manifests, directories and metric series; 0 = no bound.
    max_namespaces: int = 4096


@dataclass(frozen=True)
class PeerConfig:
    """One ``[[peers]]`` entry: a static member of the cluster, its node id, peer
    address and failure domain (ids left empty are learnt from the peer's Hello)."""

    id: str = ""
    address: str = ""
    failure_domain: str = ""


@dataclass(frozen=True)
class ReplicationConfig:
    """``[replication]``: how many extra copies of each file buddies hold (used when
    there are peers), how often the healer re-replicates files that lost one, and how
    long it waits for a holder that does not answer before replacing its copies."""

    copies: int = 1
    heal_interval: float = 5.0
    # Seconds a holder that does not answer is waited for before its copies are pushed
    # elsewhere: a cut or a flap shorter than this costs no re-replication (and no trim
    # when the holder is back); a node that answers without its copies is replaced at once.
    replace_after: float = 15.0


@dataclass(frozen=True)
class PersistentConfig:
    """``[persistent]``: the durable tier under `url` (any fsspec URL; none when empty):
    which checkpoints are drained (`every` Nth), how (`compression`, `level`), how long
    SIGTERM's drain may take, how long a view of the tier may age and an unreachable
    owner is waited for, and which other URLs a job may choose for its namespace."""

    url: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    every: int = 1
    compression: str = "zstd"
    level: int = 3
    shutdown_deadline: float = 60.0
    # Seconds a node's view of a namespace in the persistent tier may age before "the
    # newest" or a listing re-lists it (checkpoints other clusters drained meanwhile).
    relist_interval: float = 30.0
    # Seconds an unreachable owner of a file (or the coordinator) is waited for before the
    # first live holder of a replica drains that file (or commits .metadata) instead.
    owner_grace: float = 30.0
    # Seconds the drain waits at most between two attempts of a checkpoint that is not
    # durable yet (an S3 outage, a peer still uploading): waits double from 0.5 s up to it.
    retry_max: float = 10.0
    # URL prefixes a job may choose for its namespace (SetNamespace, the SageMaker
    # compat's s3_tier_base_path): the URL must be one of them or lie under one, whole
    # segments compared. Empty: only `url`. Same storage_options and credentials as `url`.
    allowed_urls: tuple[str, ...] = field(default=(), metadata={"kind": "urls"})


@dataclass(frozen=True)
class RetentionConfig:
    """``[retention]``: how many checkpoints each namespace keeps, per tier (0: all).

    `memory_keep_last` bounds every copy this node holds, its ranks' files and the copies
    kept for buddies alike: the healer re-pushes any copy missing from a committed
    checkpoint, so a smaller window for buddies' copies would fight it. The persistent
    tier keeps the newest `persistent_keep_last` plus every step that is a multiple of
    `persistent_keep_every`."""

    memory_keep_last: int = 2
    persistent_keep_last: int = 0
    persistent_keep_every: int = 0


@dataclass(frozen=True)
class SecurityConfig:
    """``[security]``: who may talk to the daemon. Peers authenticate with a shared
    token and/or mutual TLS (refused on a network address without either unless
    `allow_insecure_peers`); `local_isolation` = "uid" gives each namespace to the uid
    that began it, with `operators`, per-tenant URLs and a per-uid namespace bound."""

    token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # Opt-out of the refusal to listen for peers on the network without token or TLS.
    allow_insecure_peers: bool = False
    # "uid": a namespace belongs to the uid that began it; "" = every local caller is trusted.
    local_isolation: str = ""
    # With local_isolation: the uids that may act on every namespace (the CLI of an
    # admin). None by default: neither root nor the daemon's uid is one implicitly.
    operators: tuple[int, ...] = field(default=(), metadata={"kind": "uids"})
    # With local_isolation: URL prefixes a tenant may point its namespace at
    # (SetNamespace), `{uid}` and `{namespace}` filled in with the caller's, e.g.
    # "s3://bucket/tenants/{uid}"; each must also lie under [persistent] allowed_urls.
    # Empty: tenants keep the default URL; operators may set any allowed URL.
    tenant_urls: tuple[str, ...] = field(default=(), metadata={"kind": "url_templates"})
    # With local_isolation: namespaces one uid may own on this node.
    max_namespaces_per_uid: int = 1024


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: the Prometheus endpoint (off when `listen` is empty) and how many
    per-namespace series it carries, by name or by a short hash of the name."""

    listen: str = ""
    # Per-namespace series (freshness per tier) for at most this many namespaces, the
    # most recently committed first (the rest are summed up in tierckpt_namespaces);
    # 0 = none. Bounds the scrape whatever the cluster's number of jobs.
    namespace_series: int = 100
    # Label those series with a short hash of the namespace instead of its name (job
    # names stay off a /metrics endpoint that other users can reach).
    hash_namespaces: bool = False


@dataclass(frozen=True)
class MembershipConfig:
    """``[membership]``: peers learnt from the platform beside the static ``[[peers]]``:
    a DNS name (a Kubernetes headless Service) or a host file, re-read every `refresh`
    seconds, so joins and leaves take effect without a SIGHUP."""

    # Peers from the platform, beside the static [[peers]] (issue 13): `dns` names a
    # Kubernetes headless Service (its A/AAAA records, `port` = the peer port, default
    # the port of [listen] peer), `hostfile` a file of "address" or "id address [domain]"
    # lines; both re-read every `refresh` seconds (ids learnt from each peer's Hello).
    dns: str = ""
    port: int = 0
    hostfile: str = ""
    refresh: float = 10.0


@dataclass(frozen=True)
class LogConfig:
    """``[log]``: the root log level and the line format ("text" or "json")."""

    level: str = "INFO"
    # "text" or "json" (one object per line with namespace/checkpoint/rank/node fields).
    format: str = "text"


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration; sections mirror the TOML tables."""

    node: NodeConfig = field(default_factory=NodeConfig)
    listen: ListenConfig = field(default_factory=ListenConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    peers: tuple[PeerConfig, ...] = ()
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    persistent: PersistentConfig = field(default_factory=PersistentConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log: LogConfig = field(default_factory=LogConfig)


_SECTIONS: dict[str, type[Any]] = {
    "node": NodeConfig,
    "listen": ListenConfig,
    "memory": MemoryConfig,
    "membership": MembershipConfig,
    "replication": ReplicationConfig,
    "persistent": PersistentConfig,
    "retention": RetentionConfig,
    "security": SecurityConfig,
    "metrics": MetricsConfig,
    "log": LogConfig,
}
_SECTION_NAMES = ", ".join([*_SECTIONS, "[[peers]]"])


def _coerce(section: str, f: dataclasses.Field[Any], value: object, default: object) -> object:
    where = f"[{section}] {f.name}"
    if f.metadata.get("kind") == "size":
        return parse_size(value, what=where)
    if f.metadata.get("kind") == "urls":
        return _urls(value, where)
    if f.metadata.get("kind") == "uids":
        return _uids(value, where)
    if f.metadata.get("kind") == "url_templates":
        return _url_templates(value, where)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{where}: expected a non-negative number of seconds, got {value!r}")
        return float(value)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: expected a non-negative integer, got {value!r}")
        return value
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _urls(value: object, where: str) -> tuple[str, ...]:
    """A list of persistent-tier URL prefixes, normalized (`check_persistent_url`)."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f'{where}: expected a list of URLs, e.g. ["s3://bucket/jobs"]')
    try:
        return tuple(check_persistent_url(v) for v in value)
    except InvalidName as e:
        raise ConfigError(f"{where}: {e}") from None


def _uids(value: object, where: str) -> tuple[int, ...]:
    """A list of numeric uids (names are not resolved: the daemon may run in a container
    whose /etc/passwd is not its callers')."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 0xFFFFFFFF for v in value
    ):
        raise ConfigError(f"{where}: expected a list of numeric uids, e.g. [0, 1000]")
    return tuple(dict.fromkeys(value))


def _url_templates(value: object, where: str) -> tuple[str, ...]:
    """URL prefixes with optional `{uid}` / `{namespace}` placeholders, each one a valid
    URL once filled in; a placeholder may only stand for a whole path segment."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f'{where}: expected a list of URLs, e.g. ["s3://bucket/t/{{uid}}"]')
    out = []
    for template in value:
        filled = template.replace("{uid}", "1000").replace("{namespace}", "ns")
        segments = template.split("/")
        if (
            "{" in filled
            or "}" in filled
            or any(
                ("{uid}" in s or "{namespace}" in s) and s not in ("{uid}", "{namespace}")
                for s in segments
            )
        ):
            raise ConfigError(
                f"{where}: {template!r}: only {{uid}} and {{namespace}} may be used, each as "
                "a whole path segment"
            )
        try:
            check_persistent_url(filled)
        except InvalidName as e:
            raise ConfigError(f"{where}: {e}") from None
        out.append(template.rstrip("/"))
    return tuple(out)


# Keys that existed once, with why they went: a clearer refusal than "unknown key".
_REMOVED = {
    "retention": {
        "replica_keep_last": "memory_keep_last bounds the copies a node keeps for its "
        "buddies too (it was never read)",
    },
}


def _section(name: str, cls: type[Any], table: object) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table, got {table!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in sorted(set(table) & set(_REMOVED.get(name, {}))):
        raise ConfigError(f"[{name}] {key} was removed: {_REMOVED[name][key]}; delete the line")
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in [{name}]; valid keys of [{name}]: "
            + ", ".join(fields)
        )
    defaults = cls()
    return cls(**{k: _coerce(name, fields[k], v, getattr(defaults, k)) for k, v in table.items()})


def parse_config(data: dict[str, Any]) -> Config:
    """Validate a parsed TOML document and resolve defaults that depend on the host."""
    unknown = sorted(set(data) - set(_SECTIONS) - {"peers"})
    if unknown:
        raise ConfigError(
            f"unknown section(s) {', '.join(unknown)}; valid sections: {_SECTION_NAMES}"
        )
    data = _expand_addresses(data)
    sections = {name: _section(name, cls, data.get(name, {})) for name, cls in _SECTIONS.items()}
    raw_peers = data.get("peers", [])
    if not isinstance(raw_peers, list):
        raise ConfigError("peers must be an array of tables: write each peer as [[peers]]")
    peers = tuple(_section("peers", PeerConfig, p) for p in raw_peers)
    for peer in peers:
        if not peer.id or not peer.address:
            raise ConfigError(f"[[peers]] entry {peer} needs both id and address")
    config = Config(peers=peers, **sections)
    node_id, domain = node_identity(config.node.id, config.node.failure_domain)
    config = dataclasses.replace(config, node=NodeConfig(id=node_id, failure_domain=domain))
    _validate(config)
    return config


def _validate(config: Config) -> None:
    if config.memory.budget <= 0:
        raise ConfigError('[memory] budget must be positive, e.g. budget = "64GiB"')
    if not 0 < config.memory.peer_manifest_share <= 1:
        raise ConfigError(
            f"[memory] peer_manifest_share = {config.memory.peer_manifest_share!r}: the share "
            "of the budget one peer's manifests may take is above 0 and at most 1, e.g. 0.01"
        )
    if config.persistent.compression not in ("zstd", "none"):
        raise ConfigError(
            f'[persistent] compression = {config.persistent.compression!r}; valid: "zstd", "none"'
        )
    if config.persistent.every < 1:
        raise ConfigError("[persistent] every must be >= 1 (drain every Nth committed checkpoint)")
    grace = config.persistent.owner_grace
    if not (math.isfinite(grace) and grace >= 0):
        raise ConfigError(
            "[persistent] owner_grace must be a finite number of seconds >= 0 (how long an "
            "unreachable owner is waited for before a replica holder drains its files)"
        )
    retry_max = config.persistent.retry_max
    if not (math.isfinite(retry_max) and retry_max >= 0.5):
        raise ConfigError(
            "[persistent] retry_max must be a finite number of seconds >= 0.5 (the longest "
            "wait between two drain attempts of a checkpoint that is not durable yet)"
        )
    if logging.getLevelName(config.log.level.upper()) not in (10, 20, 30, 40, 50):
        raise ConfigError(
            f"[log] level = {config.log.level!r}; valid: DEBUG, INFO, WARNING, ERROR, CRITICAL"
        )
    if config.log.format not in ("text", "json"):
        raise ConfigError(f'[log] format = {config.log.format!r}; valid: "text", "json"')
    if not config.listen.local:
        raise ConfigError("[listen] local must not be empty: clients reach the daemon there")
    if config.listen.peer_bulk_port > 65535:
        raise ConfigError(
            f"[listen] peer_bulk_port = {config.listen.peer_bulk_port}; valid: a port, "
            "or 0 (any free port)"
        )
    if config.security.local_isolation not in ("", "uid"):
        raise ConfigError(
            f"[security] local_isolation = {config.security.local_isolation!r}; "
            'valid: "" (every local caller is trusted) or "uid" (a namespace belongs to its uid)'
        )
    if config.security.local_isolation and host_of(config.listen.local) is not None:
        raise ConfigError(
            f'[security] local_isolation = "uid" needs [listen] local to be a unix socket '
            f"(the caller's uid cannot be proven over TCP), got {config.listen.local!r}"
        )
    if config.security.local_isolation and config.listen.sagemaker:
        raise ConfigError(
            f"[listen] sagemaker = {config.listen.sagemaker!r} cannot be combined with "
            '[security] local_isolation = "uid": the SageMaker client sends no credentials, '
            "so its API could not keep one uid out of another's namespaces; turn one of them off"
        )
    check_membership(config)
    check_exposure(config)


# --- exposure of the listeners (DESIGN invariant 11) -------------------------------------

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Only these values may name ${ENV} variables: a DaemonSet binds them to the pod IP.
_EXPANDED = (("listen", "peer"), ("listen", "sagemaker"), ("metrics", "listen"))


def _expand_addresses(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with `${NAME}` in [listen] peer and [metrics] listen replaced from the
    environment (Kubernetes' downward API gives the pod IP only as a variable)."""
    out = dict(data)
    for section, key in _EXPANDED:
        table = out.get(section)
        if not isinstance(table, dict) or not isinstance(table.get(key), str):
            continue

        def env(match: re.Match[str], where: str = f"[{section}] {key}") -> str:
            value = os.environ.get(match.group(1))
            if value is None:
                raise ConfigError(
                    f"{where}: environment variable {match.group(1)} is not set; set it "
                    "(e.g. from status.podIP in a DaemonSet) or write the address literally"
                )
            return value

        out[section] = {**table, key: _ENV_REF.sub(env, table[key])}
    return out


def load_config(path: str | Path | None) -> Config:
    """Read the TOML file at `path` (None = every default)."""
    if path is None:
        return parse_config({})
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path} does not exist") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
