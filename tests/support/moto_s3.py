"""A real S3 endpoint for tests: moto's HTTP server on loopback, reset for every test.

Import the fixtures into a test module (pytest finds fixtures by name there)::

    from tests.support import moto_s3

    moto_server = moto_s3.moto_server
    s3 = moto_s3.s3

`moto_server` is module-scoped (one server per test module, port 0); `s3` resets it,
clears fsspec's instance caches, points the AWS environment at it (fake credentials,
``AWS_ENDPOINT_URL_S3``, so that a plain ``dcp.load(sd, checkpoint_id="s3://...")``
finds it too) and creates an empty bucket.
"""

from __future__ import annotations

import logging
import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import s3fs
from moto.server import ThreadedMotoServer

__all__ = ["BUCKET", "MotoServer", "S3Bucket", "moto_server", "s3"]

BUCKET = "tierckpt-test"

# Fail fast in tests: one botocore attempt, short timeouts. Our own RetryPolicy (and
# s3fs's few quick retries) still apply above this.
FAST_FAIL_CONFIG: dict[str, Any] = {
    "retries": {"max_attempts": 1, "mode": "standard"},
    "connect_timeout": 1,
    "read_timeout": 5,
}


class MotoServer:
    """A ThreadedMotoServer on 127.0.0.1 that can be stopped and restarted on its port."""

    def __init__(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.host, self.port = self._server.get_host_and_port()
        self.running = True

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def stop(self) -> None:
        """An outage: stop serving and close the listening socket (connections refused)."""
        if not self.running:
            return
        self._server.stop()
        inner = self._server._server
        if inner is not None:
            inner.server_close()
        self.running = False

    def restart(self) -> None:
        """Serve again on the same port; moto's state lives in-process, so it survives."""
        if self.running:
            return
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.running = True


@dataclass(frozen=True)
class S3Bucket:
    """An empty bucket on the moto server, for one test."""

    endpoint_url: str
    name: str = BUCKET
    storage_options: dict[str, Any] = field(default_factory=dict)

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.name}", *parts])

    def fs(self) -> Any:
        return s3fs.S3FileSystem(**self.storage_options)


@pytest.fixture(scope="module")
def moto_server() -> Iterator[MotoServer]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = MotoServer()
    yield server
    server.stop()


# Variables that would point boto at a real account: unset while a moto server stands in.
AWS_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


def aws_environment(endpoint_url: str) -> dict[str, str]:
    """Fake credentials, no config files, and the moto endpoint for every S3 client in
    this process and its children (stock ``dcp.load`` of an ``s3://`` URL included);
    unset `AWS_UNSET` beside it."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_ENDPOINT_URL_S3": endpoint_url,
    }


@pytest.fixture
def s3(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    for name in AWS_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in aws_environment(moto_server.endpoint_url).items():
        monkeypatch.setenv(name, value)
    moto_server.restart()  # in case the previous test left it stopped
    moto_server.reset()
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = S3Bucket(
        moto_server.endpoint_url,
        storage_options={
            "endpoint_url": moto_server.endpoint_url,
            "config_kwargs": dict(FAST_FAIL_CONFIG),
        },
    )
    bucket.fs().mkdir(bucket.name)
    yield bucket
    s3fs.S3FileSystem.clear_instance_cache()
