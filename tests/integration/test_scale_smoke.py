"""The scale bench (bench/scale.py) runs end to end on a small cluster, and what it counts
holds where it is not a timing: 4 real daemons peering, one simulated rank per node, every
save reaching REPLICATED, the peer RPCs each node served read from its own /metrics, and a
node lost with its memory restoring its rank's file bit-exact from a buddy. The N = 8…32
run and its fitted growth are in docs/scale.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench_run import run_bench, tail

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_scale_quick_counts_rpcs_and_restores_a_lost_node(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = run_bench(
        "scale.py",
        "--nodes",
        "4",
        "--saves",
        "2",
        "--rank-mib",
        "0.25",
        "--json",
        str(out),
        timeout=230,
    )
    assert proc.returncode == 0 and out.exists(), tail(proc)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["nodes"] == 4
    # The commit reached peers: they served its holdings and publish calls, counted by
    # the daemons themselves; every other node replicated its rank's file to a buddy.
    assert row["rpcs_total"] >= 3, row
    assert row["replicated_bytes_mean"] >= 0.25 * (1 << 20) * 0.9, row
    assert row["restore_bit_exact"] is True
    assert 0 < row["restore_ready_s"] <= row["restore_listed_s"] <= row["restore_file_s"], row
    assert row["restore_rpcs_total"] >= 1, row
