"""The memory-tier bench still runs end to end (`--quick`) and reports every ratio.

A smoke only: it asserts that each scenario produced finite, positive ratios and a verdict
per Done-when item, never a timing (the machine is shared; figures belong to the bench).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.bench_run import run_bench, tail

pytestmark = pytest.mark.integration


def _finite_positive(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) and v > 0 for v in values)


@pytest.mark.timeout(180)
def test_memory_tier_bench_quick_reports_every_ratio(tmp_path: Path) -> None:
    out = tmp_path / "memory_tier.json"
    proc = run_bench("bench_memory_tier.py", "--quick", "--out", str(out), timeout=170)
    assert proc.returncode == 0, tail(proc)
    assert "Done-when" in proc.stdout

    record = json.loads(out.read_text())
    assert record["machine"]["torch"] and record["machine"]["cores"]
    assert [s["world"] for s in record["scenarios"]] == [1, 2]
    for scenario in record["scenarios"]:
        r = scenario["ratios"]
        assert _finite_positive(r["first_back_to_back_stock_over_tier"])
        assert _finite_positive(r["first_with_compute_stock_over_tier"])
        for key in (
            "steady_memcpy_over_save",
            "steady_stock_over_save",
            "load_memcpy_over_load",
            "load_stock_over_load",
            "load_over_verified_copy_ceiling",
            "load_over_verified_read_ceiling",
        ):
            assert _finite_positive([r[key]]), key
        assert set(r["async_tier_over_stock"]) == {"thread reused", "thread new"}
        for values in r["async_tier_over_stock"].values():
            assert _finite_positive(values)
    verdicts = [item["verdict"] for item in record["done_when"]]
    # per scenario: 4 of issue 10, 2 of issue 27 (load against both ceilings)
    assert len(verdicts) == 12 and set(verdicts) <= {"PASS", "MISS"}
    costs = record["data_path_core_s_per_gib"]
    assert set(costs) == {"memcpy", "write(2)", "preadv", "xxh3"}
    assert _finite_positive(list(costs.values()))
    assert "bounds from the data path" in proc.stdout


@pytest.mark.timeout(60)
def test_routes_bench_quick_prints_every_ratio(tmp_path: Path) -> None:
    """Native, `tierckpt://` and stock routes each save, load bit-exact and get ratios."""
    out = tmp_path / "routes.json"
    proc = run_bench("bench_routes.py", "--quick", "--out", str(out), timeout=50)
    assert proc.returncode == 0, tail(proc)
    for route in ("native", "tierckpt://", "stock"):
        assert route in proc.stdout
    assert "stock/route" in proc.stdout and "memcpy/route" in proc.stdout
    assert "load average" in proc.stdout

    record = json.loads(out.read_text())
    assert record["machine"]["torch"] and len(record["loadavg_before"]) == 3
    assert list(record["routes"]) == ["native", "tierckpt://", "stock"]
    for route, figures in record["routes"].items():
        assert len(figures["save_s"]) == 4 and len(figures["load_s"]) == 1, route
        assert _finite_positive(list(record["ratios"][route].values())), route


@pytest.mark.timeout(240)
def test_sagemaker_api_bench_quick_prints_every_ratio(tmp_path: Path) -> None:
    """The seed client through tierckptd and the native route each save, load bit-exact
    and get a ratio; the stand-in column (it needs the seed's sdist: tests download
    nothing) is skipped with its reason printed."""
    out = tmp_path / "sagemaker_api.json"
    proc = run_bench(
        "bench_sagemaker_api.py", "--quick", "--no-standin", "--out", str(out), timeout=230
    )
    assert proc.returncode == 0, tail(proc)
    assert "stand-in column skipped: --no-standin" in proc.stdout
    record = json.loads(out.read_text())
    assert set(record["routes"]) == {"seed -> tierckptd", "native"}
    assert record["nbytes"] == 16 << 20 and record["standin_skipped"] == "--no-standin"
    ratio = record["ratios"]["native"]
    assert _finite_positive([ratio["steady_save"], ratio["load"]])
