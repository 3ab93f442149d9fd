"""The SageMaker API's wire vocabulary (`tierckptd.sagemaker.protocol`) and its config:
names, ranks and steps validated where they enter, absolute-form targets, Shard-Meta,
and the listener refused together with uid isolation."""

from __future__ import annotations

import base64
import json

import pytest
import xxhash
from tierckpt.errors import InvalidArgument, InvalidName
from tierckptd.config import ConfigError, exposure_warnings, parse_config
from tierckptd.sagemaker.http import status_of
from tierckptd.sagemaker.protocol import (
    NoRoute,
    Route,
    data_file,
    metadata_file,
    metadata_rank,
    parse_shard_meta,
    parse_target,
    shard_meta,
    step_of,
)


def test_routes_and_absolute_form_targets() -> None:
    blob = parse_target("/v1/cp/checkpoints/job-1/2/300")
    assert (blob.route, blob.namespace, blob.rank, blob.step) == (Route.BLOB, "job-1", 2, 300)
    proxied = parse_target(
        "http://ai-toolkit-gossip-headless.aws-hyperpod.svc.cluster.local:9200/v1/cp/namespaces/j?num_ranks=3&steps_retained=3"
    )
    assert proxied.route is Route.NAMESPACE and proxied.query == {
        "num_ranks": "3",
        "steps_retained": "3",
    }
    assert parse_target("/v1/cp/checkpoints/latest/latest").route is Route.LATEST
    assert parse_target("/v1/cp/cluster/reset").route is Route.RESET


@pytest.mark.parametrize(
    ("target", "error"),
    [
        ("/v1/cp/checkpoints/..%2Fetc/0/1", InvalidName),
        ("/v1/cp/checkpoints/../0/1", InvalidName),
        ("/v1/cp/checkpoints/a/-1/1", InvalidArgument),
        ("/v1/cp/checkpoints/a/1/99999999999999999999", InvalidArgument),
        ("/v1/cp/checkpoints/a/1048576/1", InvalidArgument),
        ("/v1/cp/checkpoints/a/0x1/1", InvalidArgument),
        ("/v1/cp/checkpoints/a/1/2/3", NoRoute),
        ("/etc/passwd", NoRoute),
        ("*", NoRoute),
        ("/v1/cp/namespaces/" + "a" * 3000, InvalidArgument),
    ],
)
def test_bad_targets_refused(target: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse_target(target)


def test_status_of_errors() -> None:
    assert status_of(NoRoute("x")) == 404
    assert status_of(InvalidName("x")) == 400
    assert status_of(RuntimeError("x")) == 500


def test_shard_meta_round_trip_and_refusals() -> None:
    digest = xxhash.xxh3_128_digest(b"body")
    assert parse_shard_meta(shard_meta(digest)) == digest
    b64 = base64.b64encode(digest).decode()
    assert parse_shard_meta(json.dumps({"checksum": b64})) == digest  # algorithm defaults
    for bad in (
        None,
        "not json",
        "[]",
        json.dumps({"checksum": "!!"}),
        json.dumps({"checksum": b64, "algorithm": "md5"}),
        json.dumps({"checksum": base64.b64encode(b"short").decode()}),
    ):
        with pytest.raises(InvalidArgument):
            parse_shard_meta(bad)


def test_names() -> None:
    assert data_file(3) == "__3_0.distcp"
    assert metadata_rank(metadata_file(4)) == 4 and metadata_rank("__4_0.distcp") is None
    assert step_of("step_12") == 12 and step_of("step_x") is None and step_of("ckpt_1") is None


def test_listener_is_off_by_default_and_refused_with_uid_isolation() -> None:
    assert parse_config({}).listen.sagemaker == ""
    with pytest.raises(ConfigError, match="local_isolation"):
        parse_config(
            {
                "listen": {"local": "unix:///run/t.sock", "sagemaker": "127.0.0.1:9200"},
                "security": {"local_isolation": "uid"},
            }
        )


def test_listener_address_takes_the_pod_ip_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    assert (
        parse_config({"listen": {"sagemaker": "${POD_IP}:9200"}}).listen.sagemaker
        == "10.0.0.7:9200"
    )


def test_listener_is_warned_about_at_start() -> None:
    assert not [w for w in exposure_warnings(parse_config({})) if "sagemaker" in w]
    config = parse_config({"listen": {"sagemaker": "0.0.0.0:9200"}})
    assert any(
        "anyone who reaches it" in w and "NetworkPolicy" in w for w in exposure_warnings(config)
    )


@pytest.mark.parametrize("in_child", [False, True])
def test_seed_metadata_converts_in_the_limited_child_as_in_process(
    in_child: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metadata blob goes through the drain's decoder (`persistent.decode`): above
    1 MiB in the resource-limited child; the result is the in-process conversion's, and
    a pickle that is not the client's metadata is refused there too."""
    import pickle

    from tierckpt.errors import UnsafeMetadata
    from tierckpt.sagemaker_import import converted_metadata
    from tierckptd.persistent import decode

    from tests.integration.test_sagemaker_http import _metadata_blob

    monkeypatch.setattr(decode, "IN_PROCESS_BYTES", 0 if in_child else 1 << 20)
    raw = _metadata_blob(2)
    found = decode.decode(raw, what="m", seed=True)
    stock, items = converted_metadata(raw, "m")
    assert found.rewritten == stock
    assert (
        sorted(found.files)
        == ["__0_0.distcp", "__1_0.distcp"]
        == [f"__{r}_0.distcp" for r in sorted(items)]
    )
    with pytest.raises(UnsafeMetadata):
        decode.decode(pickle.dumps({"not": "metadata"}), what="evil", seed=True)
