"""bench/goodput.py --measure still runs end to end against real daemons and a moto S3.

A smoke only: the four costs it measures come back finite and positive, with the machine's
facts, and the model runs on them; no timing is asserted (the figures belong to the bench).
It writes into a temporary results folder, never over bench/results.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.bench_run import run_bench, tail

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_goodput_measure_writes_every_cost_and_runs_the_model(tmp_path: Path) -> None:
    proc = run_bench(
        "goodput.py",
        "--measure",
        "--measure-mib=64",
        "--results",
        str(tmp_path),
        "--save-block-s-per-gib=0.2",
        "--stock-block-s-per-gib=0.5",
        "--memory-load-s-per-gib=0.15",
        "--gpus",
        "64",
        "2304",
        "--plot=",
        timeout=290,
    )
    assert proc.returncode == 0, tail(proc)
    record = json.loads((tmp_path / "goodput_costs.json").read_text())
    costs = record["costs"]
    assert set(costs) == {"replicate_gbps", "peer_restore_gbps", "drain_gbps", "s3_read_gbps"}
    assert all(math.isfinite(v) and v > 0 for v in costs.values()), costs
    assert record["bytes"] == 64 << 20 and record["tensors"] == 1
    assert record["machine"]["cores"] and len(record["machine"]["loadavg_before"]) == 3
    assert record["baseline"]["raw_grpc_loopback_gbps"] > 0
    assert "| tierckpt" in proc.stdout and "seeds' published figures" in proc.stdout
