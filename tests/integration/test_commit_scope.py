"""A commit asks the nodes its ranks wrote to (the writer's hint) first and every other
peer too (the hint only orders: audit 3, M2), publishes to the files' neighbourhoods, and
the nodes it did not publish to learn the checkpoint by gossip; a real 2-rank gloo job on
2 of 5 daemons, loaded bit-exact afterwards from two other nodes (issue 13, point 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import jobs
from tests.support.backends import Nodes
from tests.support.cluster import local_cluster
from tests.support.dist_job import run_job

pytestmark = pytest.mark.integration

NS = "scoped"


@pytest.mark.timeout(240)
def test_a_commit_asks_the_ranks_nodes_and_the_rest_learn_by_gossip(tmp_path: Path) -> None:
    with local_cluster(5, namespace=NS, heal_interval=1.0) as c:
        expected = tmp_path / "exp"
        save = Nodes(NS, c.addresses[:2], 1)  # rank 0 on node0 (coordinator), rank 1 on node1
        run_job(jobs.save_only, 2, save, ["step-1"], str(expected), 5, timeout=120)
        log = c.nodes[0].log_tail(400)
        # The hint only orders: every peer is asked, so a hinted node's claim is checked
        # against all the others (audit 3, M2).
        assert "commit scoped/step-1: asked 4 of 4 peers for their files (1 hinted" in log, log
        # Every node lists it: published to the files' neighbourhoods, gossiped to the rest.
        c.wait(
            "every node listing step-1",
            lambda: all("step-1" in c.rows(i) for i in range(5)),
            timeout=60,
        )
        # Another pair of nodes restores it (fetching every file from a peer), bit-exact.
        load = Nodes(NS, c.addresses[3:5], 1)
        run_job(jobs.load_and_verify, 2, load, "step-1", str(expected / "step-1"), timeout=120)
