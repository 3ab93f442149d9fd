"""The soak (bench/soak.py) still runs end to end in its quick mode, and what it measures
holds where it is not a timing: 3 real daemons with peers and copies = 1, a moto S3 that
every 5th checkpoint drains to (persistent_keep_last = 2), a real 2-rank gloo job saving
30 times with a new writer per save, every load bit-exact, no fd growth after the
warm-up and threads within the lazily started RPC workers, and each node's memory tier
equal, at every sample, to what retention should keep (checked against the daemon's own
accounting, its files on disk and what S3 holds). RSS slopes over 30 saves are warm-up
noise: the full 1,000-save run reports them (docs/reliability.md, "Soak").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench_run import run_bench, tail

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_soak_quick_keeps_fds_threads_and_memory_tier_flat(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = run_bench("soak.py", "--quick", "--out", str(out), timeout=230)
    assert out.exists(), tail(proc)
    record = json.loads(out.read_text())
    config = record["config"]

    # Every save committed and every load was bit-exact (a rank raises otherwise).
    for rank in record["ranks"]:
        assert rank["saves"] == config["saves"] == 30
        assert rank["loads"] == 2 * (30 // config["load_every"])

    summary = record["summary"]
    verdicts = summary["verdicts"]
    for node in ("node0", "node1", "node2"):
        assert f"{node} rss flat" not in verdicts  # warm-up only: not judged
        assert verdicts[f"{node} fds flat"], summary["figures"][node]["fds"]
        assert verdicts[f"{node} threads flat"], summary["figures"][node]["threads"]
    assert not summary["problems"], "\n".join(f"save {s}: {m}" for s, m in summary["problems"])
    assert "RSS slope not judged" in proc.stdout
    assert proc.returncode == 0, tail(proc)
