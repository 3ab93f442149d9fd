"""SageMaker HyperPod's own client (``amzn-sagemaker-checkpointing`` 1.1.3), unchanged,
against real tierckptd processes serving its HTTP API (`[listen] sagemaker`).

- 2 gloo ranks save several steps with the seed writer and load ``step=None``
  bit-exact; the same checkpoint loads through tierckpt's own `TieredStorageReader`
  (the seed's blobs are stock DCP files and a `.metadata` made from its pickle), and
  through `tierckpt pull` + stock `FileSystemReader`; `tierckpt ls` lists the steps.
- 2 nodes, ``copies = 1``, each rank's client on its own node: the namespace created on
  the coordinator's node, data POSTed to the other, the commit finds it there; that
  node lost with its memory and replaced, the seed reader restores bit-exact through
  the replacement.
- ``steps_retained`` is a memory window: with a persistent tier, memory keeps the newest
  steps and S3 keeps every one (what ``[retention]`` says), still listed and loadable.
- The whole cluster lost: the replacement lists the steps only S3 (moto) holds and the
  seed reader restores the newest bit-exact through the same API.
- What must leave nothing behind: a checksum mismatch, a missing ``Shard-Meta``, a path
  trick, a rank out of range, a body the budget cannot take, a step whose data blob is
  missing (never listed); ``cluster/reset`` refused by default.
"""

from __future__ import annotations

import http.client
import json
import shutil
import time
from concurrent import futures
from contextlib import ExitStack
from typing import Any

import pytest
import requests
import torch.distributed.checkpoint as dcp
import xxhash
from tierckpt.daemon_client import DaemonClient
from tierckpt.storage_reader import TieredStorageReader

from tests.support import moto_s3
from tests.support.cli import cli, ls_json
from tests.support.daemon_process import DaemonProcess
from tests.support.dist_job import run_job
from tests.support.ports import free_ports
from tests.support.sagemaker_seed import _equal
from tests.support.seed_client import (
    expected_state,
    seed_load,
    seed_save_load,
    seed_save_retained,
    template_state,
)

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3


def _sagemaker_node(port: int, **tables: Any) -> DaemonProcess:
    listen = {"sagemaker": f"127.0.0.1:{port}", **tables.pop("listen", {})}
    return DaemonProcess({"listen": listen, **tables}, name="n0")


@pytest.fixture(scope="module")
def node() -> Any:
    """One node for the tests that need no other config (each uses its own namespace and
    leaves nothing held): a daemon start is seconds on 2 cores."""
    port = free_ports(1)[0]
    daemon = _sagemaker_node(port, memory={"budget": "64MiB"})
    try:
        yield daemon, f"http://127.0.0.1:{port}"
    finally:
        daemon.cleanup()


def _shard_meta(body: bytes) -> str:
    import base64

    digest = base64.b64encode(xxhash.xxh3_128_digest(body)).decode()
    return json.dumps({"checksum": digest, "algorithm": "xxh3_128"})


def _held(daemon: DaemonProcess, namespace: str) -> list[str]:
    """Every checkpoint this node knows of the namespace, saves in progress included,
    and every file left in its memory directory."""
    client = DaemonClient(daemon.address)
    try:
        ids = [
            c.checkpoint_id for c in client.list_checkpoints(namespace, include_uncommitted=True)
        ]
    finally:
        client.close()
    root = daemon.data_dir(namespace)
    files = (
        [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()] if root.exists() else []
    )
    return ids + files


def _checkpoint(daemon: DaemonProcess, namespace: str, checkpoint_id: str) -> Any:
    client = DaemonClient(daemon.address)
    try:
        return client.get_checkpoint(namespace, checkpoint_id)
    finally:
        client.close()


def test_seed_client_saves_steps_and_loads_newest_bit_exact_also_through_tierckpt() -> None:
    port = free_ports(1)[0]
    daemon = _sagemaker_node(port)
    try:
        results = run_job(seed_save_load, 2, [port], "seed-job", [10, 20, 30], None, timeout=180)
        assert results == [{"step": 30, "exact": True}] * 2
        assert requests.get(
            f"http://127.0.0.1:{port}/v1/cp/checkpoints/seed-job/latest"
        ).json() == [30, 20, 10]
        # An explicit older step, through the seed reader again.
        assert (
            run_job(seed_load, 2, [port], "seed-job", 20, timeout=120)
            == [{"step": 20, "exact": True}] * 2
        )
        # The same checkpoint is an ordinary tierckpt one: stock DCP through tierckpt's reader.
        state = {**template_state(0), **template_state(1)}
        reader = TieredStorageReader("seed-job", daemon=daemon.address)
        dcp.load(state, storage_reader=reader, checkpoint_id="step_30", no_dist=True)
        assert _equal(state, {**expected_state(0, 30), **expected_state(1, 30)})
        # `tierckpt pull` + stock FileSystemReader; `tierckpt ls` lists it.
        dest = daemon.base_dir / "pulled"
        cli(daemon.address, "pull", "seed-job", "step_30", str(dest))
        state = {**template_state(0), **template_state(1)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(dest)), no_dist=True)
        assert _equal(state, {**expected_state(0, 30), **expected_state(1, 30)})
        assert {r["id"] for r in ls_json(daemon.address, "seed-job")} == {
            "step_10",
            "step_20",
            "step_30",
        }
        info = _checkpoint(daemon, "seed-job", "step_30")
        names = sorted(f.name for f in info.files)
        assert names == [
            ".metadata",
            ".sagemaker_metadata_2",
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    finally:
        daemon.cleanup()


def _two_nodes(stack: ExitStack) -> tuple[list[DaemonProcess], list[int]]:
    """Two started nodes, peers of each other, `copies = 1`; and their API ports."""
    peer_ports, api_ports = free_ports(2), free_ports(2)
    nodes = []
    for i in range(2):
        j = 1 - i
        config = {
            "node": {"id": f"n{i}", "failure_domain": f"rack{i}"},
            "listen": {
                "peer": f"127.0.0.1:{peer_ports[i]}",
                "sagemaker": f"127.0.0.1:{api_ports[i]}",
            },
            "replication": {"copies": 1, "heal_interval": 1.0},
            "peers": [
                {
                    "id": f"n{j}",
                    "address": f"127.0.0.1:{peer_ports[j]}",
                    "failure_domain": f"rack{j}",
                }
            ],
        }
        daemon = DaemonProcess(config, name=f"n{i}", start=False)
        stack.callback(daemon.cleanup)
        nodes.append(daemon)
    with futures.ThreadPoolExecutor(2) as pool:  # side by side, as `LocalCluster` does
        list(pool.map(lambda d: d.start(timeout=120.0), nodes))
    return nodes, api_ports


def test_two_nodes_each_rank_on_its_own_node() -> None:
    with ExitStack() as stack:
        nodes, api_ports = _two_nodes(stack)
        results = run_job(seed_save_load, 2, api_ports, "two-nodes", [1, 2], None, timeout=180)
        assert results == [{"step": 2, "exact": True}] * 2
        # Any node answers for the job: the namespace was created on node 0 only.
        other = requests.get(f"http://127.0.0.1:{api_ports[1]}/v1/cp/namespaces/two-nodes")
        assert other.status_code == 200 and other.json()["num_ranks"] == 3
        files = {f.name: f.owner_node for f in _checkpoint(nodes[0], "two-nodes", "step_2").files}
        assert files["__1_0.distcp"] == "n1" and files[".metadata"] == "n0"
        # Node 1 dies with its memory once every file has its copy on the other node; its
        # empty replacement serves rank 1's reader at once, restoring through the peers.
        deadline = time.monotonic() + 60
        while _checkpoint(nodes[0], "two-nodes", "step_2").state != "REPLICATED":
            assert time.monotonic() < deadline, "step_2 never replicated"
            time.sleep(0.3)
        nodes[1].kill9()
        shutil.rmtree(nodes[1].memory_dir, ignore_errors=True)
        nodes[1].start()
        results = run_job(seed_load, 2, api_ports, "two-nodes", None, timeout=120)
        assert results == [{"step": 2, "exact": True}] * 2


def test_steps_retained_keeps_the_newest_steps_on_every_node() -> None:
    """The namespace is created through node 0 with steps_retained=2 (the daemons'
    own `memory_keep_last` is unlimited); 5 steps saved, each rank through its own node:
    both nodes list only the 2 newest, and node 1 reports the window it never saw."""
    with ExitStack() as stack:
        nodes, api_ports = _two_nodes(stack)
        results = run_job(seed_save_retained, 2, api_ports, "kept", [1, 2, 3, 4, 5], 2, timeout=240)
        assert results == [{"step": 5, "exact": True}] * 2
        for daemon, port in zip(nodes, api_ports, strict=True):
            base = f"http://127.0.0.1:{port}"
            _wait_latest(base, "kept", [5, 4])
            deadline = time.monotonic() + 30
            while (ids := {r["id"] for r in ls_json(daemon.address, "kept")}) != {
                "step_4",
                "step_5",
            }:
                assert time.monotonic() < deadline, f"{daemon.name} lists {sorted(ids)}"
                time.sleep(0.3)
            config = requests.get(f"{base}/v1/cp/namespaces/kept", timeout=30).json()
            assert config == {"num_ranks": 3, "steps_to_retain_per_rank": 2}
        # The evicted steps are gone, not just unlisted: a GET of one is a 404 anywhere.
        base = f"http://127.0.0.1:{api_ports[1]}"
        assert requests.get(f"{base}/v1/cp/checkpoints/kept/0/3", timeout=30).status_code == 404


def test_steps_retained_is_a_memory_window_the_persistent_tier_keeps_every_step(
    s3: moto_s3.S3Bucket,
) -> None:
    """steps_retained=2 with a persistent tier (moto) draining every step: memory keeps
    the 2 newest, S3 keeps all 5 (`[retention]` persistent keeps everything here), and
    the evicted steps stay listed and loadable from S3."""
    port = free_ports(1)[0]
    persistent = {"url": s3.url("tiers"), "storage_options": dict(s3.storage_options), "every": 1}
    daemon = _sagemaker_node(port, persistent=persistent)
    base = f"http://127.0.0.1:{port}"
    steps = [1, 2, 3, 4, 5]
    try:
        results = run_job(seed_save_retained, 2, [port], "kept3", steps, 2, timeout=240)
        assert results == [{"step": 5, "exact": True}] * 2
        fs = s3.fs()
        deadline = time.monotonic() + 60
        in_memory: list[str] = []
        while True:
            fs.invalidate_cache()
            drained = [
                s for s in steps if fs.exists(s3.url("tiers", "kept3", f"step_{s}", ".metadata"))
            ]
            client = DaemonClient(daemon.address)
            try:
                listed = client.list_checkpoints("kept3")
            finally:
                client.close()
            in_memory = sorted(c.checkpoint_id for c in listed if "memory" in c.tiers)
            if drained == steps and in_memory == ["step_4", "step_5"]:
                break
            assert time.monotonic() < deadline, f"drained {drained}, in memory {in_memory}"
            time.sleep(0.3)
        assert sorted(c.checkpoint_id for c in listed) == [f"step_{s}" for s in steps]
        assert all(c.tiers == ("persistent",) for c in listed if c.checkpoint_id < "step_4")
        assert not daemon.data_dir("kept3", "step_3").exists()
        # Listed and served from S3: the seed reader loads an evicted step bit-exact.
        _wait_latest(base, "kept3", [5, 4, 3, 2, 1])
        assert (
            run_job(seed_load, 2, [port], "kept3", 2, timeout=120)
            == [{"step": 2, "exact": True}] * 2
        )
    finally:
        daemon.cleanup()


def _wait_latest(base: str, namespace: str, want: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    seen: Any = None
    while time.monotonic() < deadline:
        seen = requests.get(f"{base}/v1/cp/checkpoints/{namespace}/latest", timeout=30).json()
        if seen == want:
            return
        time.sleep(0.3)
    raise AssertionError(f"latest of {namespace} is {seen}, not {want}")


def test_whole_cluster_lost_restores_from_s3_through_the_same_api(s3: moto_s3.S3Bucket) -> None:
    port = free_ports(1)[0]
    persistent = {"url": s3.url("tiers"), "storage_options": dict(s3.storage_options), "every": 1}
    daemon = _sagemaker_node(port, persistent=persistent)
    base = f"http://127.0.0.1:{port}"
    try:
        assert (
            run_job(seed_save_load, 2, [port], "lost", [1, 2], None, timeout=180)
            == [{"step": 2, "exact": True}] * 2
        )
        fs = s3.fs()
        deadline = time.monotonic() + 60
        while not fs.exists(s3.url("tiers", "lost", "step_2", ".metadata")):
            assert time.monotonic() < deadline, "step_2 never drained"
            time.sleep(0.3)
            fs.invalidate_cache()
        daemon.kill9()  # the node dies with its memory; its replacement starts empty
        shutil.rmtree(daemon.memory_dir, ignore_errors=True)
        daemon.start()
        _wait_latest(base, "lost", [2, 1])
        assert requests.get(f"{base}/v1/cp/namespaces/lost").json()["num_ranks"] == 3
        assert (
            run_job(seed_load, 2, [port], "lost", None, timeout=120)
            == [{"step": 2, "exact": True}] * 2
        )
    finally:
        daemon.cleanup()


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(
        url,
        data=body,
        headers=headers if headers is not None else {"Shard-Meta": _shard_meta(body)},
    )


def test_refusals_leave_nothing_behind(node: tuple[DaemonProcess, str]) -> None:
    daemon, base = node
    ns = f"{base}/v1/cp/checkpoints/bad"
    assert requests.post(
        f"{base}/v1/cp/namespaces/bad", params={"num_ranks": 3, "steps_retained": 3}
    ).ok
    body = b"x" * 5000

    wrong = json.dumps({"checksum": _shard_meta(b"y")[14:38], "algorithm": "xxh3_128"})
    r = _post(f"{ns}/0/1", body, {"Shard-Meta": wrong})
    assert r.status_code == 400 and "Shard-Meta" in r.text
    r = _post(f"{ns}/0/1", body, {})
    assert r.status_code == 400 and "missing" in r.text
    r = _post(f"{ns}/7/1", body)
    assert r.status_code == 400 and "out of range" in r.text
    for trick in (
        "/v1/cp/checkpoints/..%2F..%2Fetc/0/1",
        "/v1/cp/checkpoints/../0/1",
        "/v1/cp/checkpoints/a/-1/1",
    ):
        r = _post(base + trick, body)
        assert r.status_code in (400, 404), trick
    assert len(r.text) < 1024 and "Traceback" not in r.text
    # A body the budget (64 MiB) cannot take: refused before a byte is read, 507.
    conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=30)
    conn.putrequest("POST", "/v1/cp/checkpoints/bad/0/1")
    conn.putheader("Content-Length", str(1 << 30))
    conn.putheader("Shard-Meta", _shard_meta(b""))
    conn.endheaders()
    reply = conn.getresponse()
    assert reply.status == 507 and b"budget" in reply.read()
    conn.close()
    assert _held(daemon, "bad") == []

    # Metadata for a step whose data blob (rank 1's) never arrived: refused, never listed.
    assert _post(f"{ns}/0/5", body).status_code == 201
    meta = _metadata_blob(2)
    r = _post(f"{ns}/2/5", meta)
    assert r.status_code == 409 and "__1_0.distcp" in r.text
    assert requests.get(f"{ns}/latest").json() == []
    assert requests.get(f"{ns}/0/5").status_code == 404
    assert _held(daemon, "bad") == []

    r = requests.post(f"{base}/v1/cp/cluster/reset")
    assert r.status_code == 403 and "sagemaker_allow_reset" in r.text


def _metadata_blob(world_size: int) -> bytes:
    """The client's metadata pickle for a step whose ranks 0..world_size-1 each hold one
    item (the seed writer's format, `tests.support.sagemaker_seed`)."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    from tests.support.sagemaker_seed import SeedLayoutWriter, _pickle_as_seed

    class _Memory:
        def pipe_file(self, path: str, data: bytes) -> None:
            pass

    merged: Metadata | None = None
    for rank in range(world_size):
        writer = SeedLayoutWriter(_Memory(), "b", "ns", 5, rank)
        dcp.save({f"t{rank}": torch.ones(3)}, storage_writer=writer, no_dist=True)
        md = writer.metadata
        assert md is not None and md.storage_data is not None
        if merged is None:
            merged = md
        else:
            merged.state_dict_metadata.update(md.state_dict_metadata)
            assert merged.storage_data is not None
            merged.storage_data.update(md.storage_data)
    assert merged is not None
    del io
    return _pickle_as_seed(merged)


def test_multi_block_blobs_round_trip_byte_exact_and_deletes_are_real(
    node: tuple[DaemonProcess, str],
) -> None:
    """Blobs of several 1 MiB blocks (the second into the pool the deleted step left)
    come back byte for byte with the client's digest; the metadata blob byte-exact."""
    import os as _os

    daemon, base = node
    ns = f"{base}/v1/cp/checkpoints/raw"
    assert requests.post(f"{base}/v1/cp/namespaces/raw", params={"num_ranks": 2}).ok
    # Idempotent, unlike the seed's 409; and the config any client reads back.
    assert requests.post(f"{base}/v1/cp/namespaces/raw", params={"num_ranks": 2}).ok
    assert requests.get(f"{base}/v1/cp/namespaces/raw").json() == {
        "num_ranks": 2,
        "steps_to_retain_per_rank": 3,
    }
    meta = _metadata_blob(1)
    # 40 MiB: more than the socket buffers hold, so the send waits for the reader.
    for step, size in ((1, (3 << 20) + 12345), (2, (40 << 20) + 7)):
        data = _os.urandom(size)
        assert _post(f"{ns}/0/{step}", data).status_code == 201
        assert _post(f"{ns}/0/{step}", data).status_code == 201  # a retry: same bytes
        assert _post(f"{ns}/1/{step}", meta).status_code == 201
        # Committed: the same bytes again are acknowledged; other bytes refused (409),
        # the body read off so the client gets the answer, and the step unchanged.
        assert _post(f"{ns}/1/{step}", meta).status_code == 201
        assert _post(f"{ns}/0/{step}", data).status_code == 201
        other = _post(f"{ns}/0/{step}", data[:-1] + bytes([data[-1] ^ 1]))
        assert other.status_code == 409
        assert f"step {step} is committed" in other.text and "tierckpt rm raw" in other.text
        got = requests.get(f"{ns}/0/{step}")
        assert got.status_code == 200 and got.content == data
        assert got.headers["Shard-Meta"] == _shard_meta(data)
        assert got.headers["Content-Length"] == str(size) and "Content-Encoding" not in got.headers
        assert requests.get(f"{ns}/1/{step}").content == meta
        if step == 1:  # its files go to the warm pool; step 2's blob reuses a segment
            assert requests.delete(f"{ns}/0/1").ok
            assert requests.get(f"{ns}/0/1").status_code == 404
            assert requests.delete(f"{ns}/0/1").status_code == 404
    assert requests.get(f"{ns}/latest", params={"limit": 3}).json() == [2]

    # An unfinished save (its metadata never came) holding other bytes: refused, and the
    # way out the answer names (`tierckpt rm`) lets the restarted job save that step.
    first, second = _os.urandom(5000), _os.urandom(5000)
    assert _post(f"{ns}/0/3", first).status_code == 201
    refused = _post(f"{ns}/0/3", second)
    assert refused.status_code == 409 and "unfinished save of step 3" in refused.text
    cli(daemon.address, "rm", "raw", "step_3")
    assert _post(f"{ns}/0/3", second).status_code == 201
    assert _post(f"{ns}/1/3", meta).status_code == 201
    assert requests.get(f"{ns}/0/3").content == second
    assert requests.delete(f"{base}/v1/cp/namespaces/raw").ok
    assert requests.get(f"{ns}/latest").json() == []
    assert _held(daemon, "raw") == []
