"""Folders deeper than a namespace: ``tierckpt://team/run1/step-10`` as a local folder.

Stock `dcp.save`/`dcp.load` with `tierckpt://` ids that are folder paths, through two real
daemons draining to moto S3, and the fsspec calls torchtitan 0.3.0's checkpoint manager
makes on its ``--checkpoint.folder`` (`torchtitan.tools.filesystem`: exists, isdir,
listdir as basenames of ``ls``, isfile of ``<step>/.metadata`` and of
``<step>/model.safetensors.index.json``, ``rm(recursive=True)`` to purge). The drained
bucket holds the natural layout, ``<ns>/run1/step-20/.metadata``, which stock DCP loads
from S3 without tierckpt; a restarted daemon adopts the nested checkpoint from its memory
dir; a removed checkpoint is gone from every node and from S3.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

import fsspec
import pytest
import torch.distributed.checkpoint as dcp

from tests.support import moto_s3
from tests.support.cluster import local_cluster
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

pytestmark = pytest.mark.integration

moto_server = moto_s3.moto_server
s3 = moto_s3.s3

NS = "team"
FOLDER = f"tierckpt://{NS}/run1"


def _listdir(fs: Any, path: str) -> list[str]:
    """torchtitan's `filesystem.listdir` of a remote path."""
    _, p = fsspec.core.url_to_fs(path)
    return [
        posixpath.basename(e.rstrip("/"))
        for e in fs.ls(p, detail=False)
        if e.rstrip("/") != p.rstrip("/")
    ]


def _find_load_step(fs: Any, folder: str) -> int:
    """torchtitan's `_find_load_step`: the newest ``step-N`` holding a ``.metadata``."""
    if not fs.isdir(folder):
        return -1
    steps = []
    for name in _listdir(fs, folder):
        match = re.search(r"step-(\d+)", name)
        path = posixpath.join(folder, name)
        is_dcp = fs.isfile(posixpath.join(path, ".metadata"))
        is_hf = fs.isfile(posixpath.join(path, "model.safetensors.index.json"))
        if match and (is_dcp or is_hf):
            steps.append(int(match.group(1)))
    return max(steps, default=-1)


@pytest.mark.timeout(300)
def test_folders_save_list_load_purge_and_survive_a_restart(
    s3: moto_s3.S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = {"persistent": {"url": s3.url(), "storage_options": dict(s3.storage_options)}}
    states = {step: plain_tensor_state(step, 1 << 20) for step in (10, 20)}
    expected = {step: snapshot(state) for step, state in states.items()}
    with local_cluster(2, namespace=NS, copies=1, overrides=overrides) as c:
        monkeypatch.setenv("TIERCKPT_DAEMON", c.nodes[0].address)
        fs = fsspec.filesystem("tierckpt")
        # A fresh start, as torchtitan sees it: nothing there, and makedirs succeeds.
        assert not fs.exists(FOLDER) and _find_load_step(fs, FOLDER) == -1
        fs.makedirs(FOLDER, exist_ok=True)
        for step, state in states.items():
            dcp.save(state, checkpoint_id=f"{FOLDER}/step-{step}")
        for step in states:
            c.wait_state(f"run1/step-{step}", "DURABLE")

        assert fs.ls(f"tierckpt://{NS}", detail=False) == [f"{NS}/run1"]
        assert fs.ls(FOLDER, detail=False) == [f"{NS}/run1/step-10", f"{NS}/run1/step-20"]
        assert [e["type"] for e in fs.ls(FOLDER)] == ["directory", "directory"]
        assert fs.isdir(FOLDER) and fs.isdir(f"{FOLDER}/step-20") and fs.exists(FOLDER)
        assert fs.isfile(f"{FOLDER}/step-20/.metadata")
        assert not fs.isfile(f"{FOLDER}/step-20/model.safetensors.index.json")
        assert not fs.exists(f"tierckpt://{NS}/run2") and not fs.isdir(f"{FOLDER}/step-30")
        assert _find_load_step(fs, FOLDER) == 20
        names = sorted(e.rsplit("/", 1)[-1] for e in fs.ls(f"{FOLDER}/step-20", detail=False))
        assert names == [".metadata", "__0_0.distcp"]

        target = plain_tensor_state(99, 1 << 20)
        dcp.load(target, checkpoint_id=f"{FOLDER}/step-20")
        assert_state_equal(actual=target, expected=expected[20], what="load of run1/step-20")

        # The drained layout nests as a local folder would; stock DCP loads it from S3.
        bucket = s3.fs()
        bucket.invalidate_cache()
        base = f"{s3.name}/{NS}/run1"
        assert sorted(p[len(base) + 1 :] for p in bucket.find(base)) == [
            "step-10/.metadata",
            "step-10/__0_0.distcp",
            "step-20/.metadata",
            "step-20/__0_0.distcp",
        ]
        target = plain_tensor_state(98, 1 << 20)
        dcp.load(target, checkpoint_id=s3.url(NS, "run1", "step-20"))  # stock FsspecReader
        assert_state_equal(actual=target, expected=expected[20], what="stock load from S3")

        # torchtitan's purge: rm of the step folder, cluster-wide and in S3.
        fs.rm(f"{FOLDER}/step-10", recursive=True)
        for node in c.nodes:
            assert "run1/step-10" not in c.rows(c.nodes.index(node))
            assert not node.data_dir(NS, "run1/step-10").exists()
        bucket.invalidate_cache()
        assert not bucket.exists(f"{base}/step-10/.metadata")
        assert bucket.find(f"{base}/step-10") == []
        assert bucket.exists(f"{base}/step-20/.metadata")
        assert fs.ls(FOLDER, detail=False) == [f"{NS}/run1/step-20"]

        # A restarted daemon adopts the nested checkpoint from its memory dir.
        assert c.nodes[0].data_dir(NS, "run1/step-20").is_dir()
        c.nodes[0].terminate()
        c.nodes[0].start()
        row = c.rows()["run1/step-20"]
        assert "memory" in row["tiers"], row
        assert fs.ls(FOLDER, detail=False) == [f"{NS}/run1/step-20"]
        target = plain_tensor_state(97, 1 << 20)
        dcp.load(target, checkpoint_id=f"{FOLDER}/step-20")
        assert_state_equal(actual=target, expected=expected[20], what="load after a restart")

        # rm of a folder removes every checkpoint in it.
        fs.rm(FOLDER, recursive=True)
        assert not fs.exists(FOLDER) and c.rows() == {}
        bucket.invalidate_cache()
        assert bucket.find(base) == []
