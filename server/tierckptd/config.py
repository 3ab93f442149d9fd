"""Daemon configuration: TOML (tomllib) into frozen dataclasses.

Every key has a default so a bare `tierckptd` serves a single node; unknown sections and
keys are rejected with the list of valid ones, because a typo in a retention or budget key
would otherwise silently fall back to a default and surprise an operator much later.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    "config_changes",
    "format_size",
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


class ConfigError(ValueError):
    """The configuration file is malformed; the message names the key and the fix."""


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


def format_size(n: float) -> str:
    """Human-readable binary size with one decimal, as error messages quote budgets."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass(frozen=True)
class NodeConfig:
    id: str = ""  # "" = the hostname (resolved by load)
    failure_domain: str = ""  # "" = the node id (resolved by load)


@dataclass(frozen=True)
class ListenConfig:
    local: str = "unix:///run/tierckpt/tierckptd.sock"
    peer: str = "0.0.0.0:7070"


@dataclass(frozen=True)
class MemoryConfig:
    dir: str = "/dev/shm/tierckpt"
    budget: int = field(default=64 * 1024**3, metadata=SIZE)
    recycle: bool = True
    prewarm: int = field(default=0, metadata=SIZE)
    abandon_after: float = 900.0


@dataclass(frozen=True)
class PeerConfig:
    id: str = ""
    address: str = ""
    failure_domain: str = ""


@dataclass(frozen=True)
class ReplicationConfig:
    copies: int = 1
    heal_interval: float = 5.0


@dataclass(frozen=True)
class PersistentConfig:
    url: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    every: int = 1
    compression: str = "zstd"
    level: int = 3
    shutdown_deadline: float = 60.0


@dataclass(frozen=True)
class RetentionConfig:
    memory_keep_last: int = 2
    replica_keep_last: int = 2
    persistent_keep_last: int = 0
    persistent_keep_every: int = 0


@dataclass(frozen=True)
class SecurityConfig:
    token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = ""


@dataclass(frozen=True)
class LogConfig:
    level: str = "INFO"


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration; sections mirror the TOML tables."""

    node: NodeConfig = field(default_factory=NodeConfig)
    listen: ListenConfig = field(default_factory=ListenConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    peers: tuple[PeerConfig, ...] = ()
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


def _section(name: str, cls: type[Any], table: object) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table, got {table!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
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
    sections = {name: _section(name, cls, data.get(name, {})) for name, cls in _SECTIONS.items()}
    raw_peers = data.get("peers", [])
    if not isinstance(raw_peers, list):
        raise ConfigError("peers must be an array of tables: write each peer as [[peers]]")
    peers = tuple(_section("peers", PeerConfig, p) for p in raw_peers)
    for peer in peers:
        if not peer.id or not peer.address:
            raise ConfigError(f"[[peers]] entry {peer} needs both id and address")
    config = Config(peers=peers, **sections)
    node_id = config.node.id or socket.gethostname()
    config = dataclasses.replace(
        config,
        node=NodeConfig(id=node_id, failure_domain=config.node.failure_domain or node_id),
    )
    _validate(config)
    return config


def _validate(config: Config) -> None:
    if config.memory.budget <= 0:
        raise ConfigError('[memory] budget must be positive, e.g. budget = "64GiB"')
    if config.persistent.compression not in ("zstd", "none"):
        raise ConfigError(
            f'[persistent] compression = {config.persistent.compression!r}; valid: "zstd", "none"'
        )
    if config.persistent.every < 1:
        raise ConfigError("[persistent] every must be >= 1 (drain every Nth committed checkpoint)")
    if logging.getLevelName(config.log.level.upper()) not in (10, 20, 30, 40, 50):
        raise ConfigError(
            f"[log] level = {config.log.level!r}; valid: DEBUG, INFO, WARNING, ERROR, CRITICAL"
        )
    if not config.listen.local:
        raise ConfigError("[listen] local must not be empty: clients reach the daemon there")


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


def _flatten(value: object, prefix: str) -> dict[str, object]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, object] = {}
        for f in dataclasses.fields(value):
            out.update(_flatten(getattr(value, f.name), f"{prefix}{f.name}."))
        return out
    return {prefix.rstrip("."): value}


def config_changes(old: Config, new: Config) -> list[str]:
    """Human-readable "key: old -> new" lines, logged on SIGHUP."""
    a, b = _flatten(old, ""), _flatten(new, "")
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
