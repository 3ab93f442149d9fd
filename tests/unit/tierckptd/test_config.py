from __future__ import annotations

import dataclasses
import re
import socket
import tomllib
from pathlib import Path

import pytest
from tierckptd.config import (
    Config,
    ConfigError,
    exposure_warnings,
    is_loopback_address,
    load_config,
    parse_config,
    parse_size,
)
from tierckptd.config_secrets import REDACTED, config_changes, config_file_warnings

EXAMPLE = Path(__file__).parents[3] / "deploy" / "tierckptd.example.toml"


def test_defaults_resolve_node_from_hostname() -> None:
    config = load_config(None)
    assert config.node.id == socket.gethostname()
    assert config.node.failure_domain == config.node.id
    assert config.memory.budget == 64 * 1024**3
    assert config.listen.local == "unix:///run/tierckpt/tierckptd.sock"
    assert config.listen.peer == "127.0.0.1:7070"  # a bare daemon serves one node
    assert config.security.allow_insecure_peers is False
    assert config.security.local_isolation == ""
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


def test_removed_key_says_why() -> None:
    with pytest.raises(
        ConfigError, match=r"\[retention\] replica_keep_last was removed: memory_keep_last"
    ):
        parse_config({"retention": {"replica_keep_last": 2}})


def test_every_config_key_is_read_by_the_daemon() -> None:
    """A key no code reads is a promise nobody keeps (replica_keep_last was one)."""
    daemon = Path(__file__).parents[3] / "server" / "tierckptd"
    # attribute reads (`.name`); config.py's own checks count, its declarations do not
    code = "\n".join(p.read_text() for p in daemon.rglob("*.py"))
    unread = [
        f"[{section.name}] {f.name}"
        for section in dataclasses.fields(Config)
        if section.name != "peers"
        for f in dataclasses.fields(getattr(Config(), section.name))
        if not re.search(rf"\.{f.name}\b", code)
    ]
    assert not unread, f"config keys never read: {unread}"


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


# --- safe defaults: the peer listener and the network (C3, M10) --------------------------

EXPOSED = [
    "0.0.0.0:7070",
    "0.0.0.0:0",
    "[::]:7070",
    ":::7070",
    "::",
    ":7070",
    "10.1.2.3:7070",
    "192.168.0.5:0",
    "[fd00::1]:7070",
    "[::ffff:10.0.0.1]:7070",
    "node-b.invalid:7070",  # does not resolve: counted as exposed (fail closed)
]
LOOPBACK = [
    "127.0.0.1:7070",
    "127.0.0.2:0",
    "localhost:7070",
    "LOCALHOST:0",
    "tierckpt.localhost:7070",
    "[::1]:7070",
    "::1",
    "[::ffff:127.0.0.1]:7070",
    "unix:///run/tierckpt/peer.sock",
]


@pytest.mark.parametrize("address", EXPOSED)
def test_exposed_addresses(address: str) -> None:
    assert not is_loopback_address(address)


@pytest.mark.parametrize("address", LOOPBACK)
def test_loopback_addresses(address: str) -> None:
    assert is_loopback_address(address)


def test_hostname_that_resolves_to_loopback_only_is_loopback() -> None:
    # "localhost" is special-cased; a name is otherwise resolved and every answer counts.
    infos = socket.getaddrinfo("localhost", None, proto=socket.IPPROTO_TCP)
    assert infos and is_loopback_address("localhost:1")


@pytest.mark.parametrize("address", EXPOSED)
def test_network_peer_without_token_or_tls_is_refused_naming_both_fixes(address: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"listen": {"peer": address}})
    message = str(e.value)
    assert "token_file" in message and "tls_cert" in message, message
    assert "allow_insecure_peers = true" in message, message


@pytest.mark.parametrize("address", LOOPBACK)
def test_loopback_peer_needs_no_credentials(address: str) -> None:
    config = parse_config({"listen": {"peer": address}})
    assert not any("peer listener" in w for w in exposure_warnings(config))


@pytest.mark.parametrize(
    "security",
    [
        {"token_file": "/etc/tierckpt/token"},
        {"tls_cert": "/c.pem", "tls_key": "/k.pem"},
        {"tls_cert": "/c.pem", "tls_key": "/k.pem", "tls_ca": "/ca.pem"},
        {"allow_insecure_peers": True},
    ],
)
def test_network_peer_is_allowed_with_token_tls_or_the_opt_in(security: dict[str, object]) -> None:
    config = parse_config({"listen": {"peer": "0.0.0.0:7070"}, "security": security})
    assert config.listen.peer == "0.0.0.0:7070"


def test_tls_cert_without_key_does_not_count_as_secured() -> None:
    with pytest.raises(ConfigError, match="allow_insecure_peers"):
        parse_config({"listen": {"peer": "0.0.0.0:7070"}, "security": {"tls_cert": "/c.pem"}})


def test_opt_in_is_warned_about() -> None:
    config = parse_config(
        {"listen": {"peer": "[::]:7070"}, "security": {"allow_insecure_peers": True}}
    )
    (warning,) = exposure_warnings(config)
    assert "allow_insecure_peers" in warning and "token_file" in warning, warning


def test_token_without_tls_on_the_network_is_warned_about() -> None:
    config = parse_config({"listen": {"peer": "0.0.0.0:7070"}, "security": {"token_file": "/t"}})
    (warning,) = exposure_warnings(config)
    assert "in clear" in warning and "tls_cert" in warning, warning
    tls = {"token_file": "/t", "tls_cert": "/c", "tls_key": "/k"}
    assert exposure_warnings(parse_config({"listen": {"peer": "0.0.0.0:1"}, "security": tls})) == []


def test_defaults_expose_nothing_and_warn_about_nothing() -> None:
    assert exposure_warnings(load_config(None)) == []


def test_local_tcp_on_the_network_is_refused_even_with_a_token() -> None:
    # The control API has no token check: only a unix socket's mode protects it.
    with pytest.raises(ConfigError, match=r"\[listen\] local.*unix socket"):
        parse_config(
            {"listen": {"local": "0.0.0.0:7071", "peer": ""}, "security": {"token_file": "/t"}}
        )
    config = parse_config(
        {"listen": {"local": "0.0.0.0:7071"}, "security": {"allow_insecure_peers": True}}
    )
    assert any("anyone who reaches it" in w for w in exposure_warnings(config))


def test_local_tcp_on_loopback_warns_that_any_local_user_can_call_it() -> None:
    config = parse_config({"listen": {"local": "127.0.0.1:7071"}})
    (warning,) = exposure_warnings(config)
    assert "any local user" in warning and "unix socket" in warning, warning


def test_local_isolation_values() -> None:
    assert parse_config({"security": {"local_isolation": "uid"}}).security.local_isolation == "uid"
    with pytest.raises(ConfigError, match=r'local_isolation.*"uid"'):
        parse_config({"security": {"local_isolation": "gid"}})
    with pytest.raises(ConfigError, match="unix socket"):
        parse_config({"listen": {"local": "127.0.0.1:1"}, "security": {"local_isolation": "uid"}})
    with pytest.raises(ConfigError, match="true or false"):
        parse_config({"security": {"allow_insecure_peers": "yes"}})


def test_env_expansion_in_listen_addresses_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_IP", "10.9.8.7")
    config = parse_config(
        {
            "listen": {"peer": "${POD_IP}:7070"},
            "metrics": {"listen": "${POD_IP}:9464"},
            "security": {"token_file": "/t"},
        }
    )
    assert config.listen.peer == "10.9.8.7:7070"
    assert config.metrics.listen == "10.9.8.7:9464"
    # Not expanded anywhere else: the literal is no usable node id (TIERCKPT_NODE_ID is).
    with pytest.raises(ConfigError, match=r"\[node\] id = '\$\{POD_IP\}' is not a usable"):
        parse_config({"node": {"id": "${POD_IP}"}})
    monkeypatch.delenv("POD_IP")
    with pytest.raises(ConfigError, match=r"\[metrics\] listen.*POD_IP is not set"):
        parse_config({"metrics": {"listen": "${POD_IP}:9464"}})


def test_expanded_peer_address_is_still_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_IP", "10.9.8.7")
    with pytest.raises(ConfigError, match="allow_insecure_peers"):
        parse_config({"listen": {"peer": "${POD_IP}:7070"}})


# --- secrets never reach logs (M4) ---------------------------------------------------------

OLD_SECRETS = {"key": "AKIAOLDKEY", "secret": "old-s3-secret"}
NEW_SECRETS = {"key": "AKIANEWKEY", "secret": "NEW-s3-secret-rotated"}


def _with_options(options: dict[str, object], **persistent: object) -> Config:
    return parse_config({"persistent": {"storage_options": options, **persistent}})


def test_sighup_diff_redacts_storage_option_secrets() -> None:
    old = _with_options(
        {
            **OLD_SECRETS,
            "endpoint_url": "http://minio:9000",
            "client_kwargs": {"region_name": "eu-1", "aws_session_token": "OLD-STS-TOKEN"},
        }
    )
    new = _with_options(
        {
            **NEW_SECRETS,
            "endpoint_url": "http://minio:9001",
            "client_kwargs": {"region_name": "eu-2", "aws_session_token": "NEW-STS-TOKEN"},
            "Password": "hunter2",
            "credentials": {"anything": "nested-secret"},
        }
    )
    changes = config_changes(old, new)
    text = "\n".join(changes)
    for secret in (*OLD_SECRETS.values(), *NEW_SECRETS.values()):
        assert secret not in text, text
    for secret in ("OLD-STS-TOKEN", "NEW-STS-TOKEN", "hunter2", "nested-secret"):
        assert secret not in text, text
    # What changed is still named, and harmless values are still shown.
    assert f"persistent.storage_options.secret: {REDACTED} -> {REDACTED}" in changes
    assert f"persistent.storage_options.key: {REDACTED} -> {REDACTED}" in changes
    assert f"persistent.storage_options.Password: (unset) -> {REDACTED}" in changes
    assert f"persistent.storage_options.credentials: (unset) -> {REDACTED}" in changes
    assert (
        "persistent.storage_options.endpoint_url: 'http://minio:9000' -> 'http://minio:9001'"
        in changes
    )
    assert "persistent.storage_options.client_kwargs.region_name: 'eu-1' -> 'eu-2'" in changes


def test_sighup_diff_redacts_urls_with_userinfo_and_keeps_paths() -> None:
    old = _with_options({}, url="s3://AKIAURL:url-secret@bucket/ckpt")
    new = parse_config({"security": {"token_file": "/etc/tierckpt/token"}})
    text = "\n".join(config_changes(old, new))
    assert "url-secret" not in text and "AKIAURL" not in text, text
    assert "security.token_file: '' -> '/etc/tierckpt/token'" in text  # a path, not a secret


def test_sighup_diff_unchanged_secret_is_not_reported() -> None:
    assert config_changes(_with_options(OLD_SECRETS), _with_options(OLD_SECRETS)) == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_readable_config_file_with_credentials_is_warned_about(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[persistent]\nstorage_options = { key = "AKIA1", secret = "s3cr3t" }\n')
    path.chmod(mode)
    (warning,) = config_file_warnings(path, load_config(path))
    assert "chmod 600" in warning and "Secret" in warning and f"{mode:04o}" in warning, warning
    assert "s3cr3t" not in warning and "AKIA1" not in warning


def test_private_or_credential_free_config_file_is_not_warned_about(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[persistent]\nstorage_options = { key = "AKIA1", secret = "s3cr3t" }\n')
    path.chmod(0o600)
    assert config_file_warnings(path, load_config(path)) == []
    path.write_text('[persistent]\nstorage_options = { endpoint_url = "http://minio:9000" }\n')
    path.chmod(0o644)
    assert config_file_warnings(path, load_config(path)) == []


def test_remote_peers_with_a_loopback_listener_are_warned_about() -> None:
    # After the default moved to loopback, a multi-node config that forgot [listen] peer
    # would silently never receive replicas.
    remote = {"peers": [{"id": "node-b", "address": "10.0.0.2:7070"}]}
    (warning,) = exposure_warnings(parse_config(remote))
    assert "node-b" in warning and "0.0.0.0:7070" in warning and "token_file" in warning
    local = {"peers": [{"id": "n1", "address": "127.0.0.1:7071"}]}
    assert exposure_warnings(parse_config(local)) == []  # a cluster on one host (tests)
