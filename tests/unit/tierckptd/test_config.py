from __future__ import annotations

import dataclasses
import re
import socket
import tomllib
from pathlib import Path

import pytest
from tierckptd.config import Config, ConfigError, load_config, parse_config, parse_size

EXAMPLE = Path(__file__).parents[3] / "deploy" / "tierckptd.example.toml"


def test_defaults_resolve_node_from_hostname() -> None:
    config = load_config(None)
    assert config.node.id == socket.gethostname()
    assert config.node.failure_domain == config.node.id
    assert config.memory.budget == 64 * 1024**3
    assert config.listen.local == "unix:///run/tierckpt/tierckptd.sock"
    assert config.listen.peer == "0.0.0.0:7070"
    assert config.retention.memory_keep_last == 2
    assert config.peers == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (123, 123),
        ("64GiB", 64 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("0", 0),
        ("10 KiB", 10240),
        ("2g", 2 << 30),
    ],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "1.5XB", True, -3, 1.5])
def test_bad_sizes_name_the_format(bad: object) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(bad)


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"memory": {"budgett": "1GiB"}})
    message = str(e.value)
    assert "budgett" in message
    for key in ("dir", "budget", "recycle", "prewarm", "abandon_after"):
        assert key in message


def test_unknown_section_lists_valid_sections() -> None:
    with pytest.raises(ConfigError, match=r"retention.*\[\[peers\]\]"):
        parse_config({"retension": {}})


def test_types_and_values_are_checked() -> None:
    with pytest.raises(ConfigError, match="recycle"):
        parse_config({"memory": {"recycle": "yes"}})
    with pytest.raises(ConfigError, match="compression"):
        parse_config({"persistent": {"compression": "gzip"}})
    with pytest.raises(ConfigError, match="level"):
        parse_config({"log": {"level": "LOUD"}})
    with pytest.raises(ConfigError, match="address"):
        parse_config({"peers": [{"id": "b"}]})


def test_file_with_peers_and_sizes(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[node]\nid = "a"\n[memory]\nbudget = "2GiB"\nprewarm = 1024\n'
        '[[peers]]\nid = "b"\naddress = "b:7070"\nfailure_domain = "r2"\n'
    )
    config = load_config(path)
    assert config.node.id == "a" and config.node.failure_domain == "a"
    assert config.memory.budget == 2 << 30 and config.memory.prewarm == 1024
    assert config.peers[0].address == "b:7070"


def test_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[memory]\nbogus = 1\n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)


def test_example_toml_equals_defaults() -> None:
    assert load_config(EXAMPLE) == load_config(None)


def test_example_toml_mentions_every_key() -> None:
    text = EXAMPLE.read_text()
    doc = tomllib.loads(text)
    for section in dataclasses.fields(Config):
        if section.name == "peers":
            assert "peers" in doc
            for key in ("id", "address", "failure_domain"):
                assert re.search(rf"^# {key} = ", text, re.M), f"[[peers]] {key} not documented"
            continue
        keys = {f.name for f in dataclasses.fields(getattr(Config(), section.name))}
        assert set(doc[section.name]) == keys, f"[{section.name}] drifted from config.py"
    for line in text.splitlines():
        if re.match(r"^\w+ = ", line):
            assert "#" in line or line.startswith("peers"), f"undocumented key: {line}"
