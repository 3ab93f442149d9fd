"""The goodput model's arithmetic (bench/_goodput_model.py) and bench/goodput.py end to end.

The model is pure: these check its math against independent ways of getting the same
answer (brute force vs the closed-form optimum, Young's approximation where it holds,
the recovery formulas by hand), not against figures of any machine.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.bench_run import ROOT, run_bench, tail


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


gm = _load("_goodput_model")
HOUR = 3600.0
GiB = 1 << 30

COSTS = gm.Costs(
    save_block_s_per_gib=0.2,
    stock_block_s_per_gib=0.5,
    memory_load_s_per_gib=0.15,
    replicate_gbps=2.0,
    peer_restore_gbps=2.0,
    drain_gbps=1.0,
    s3_read_gbps=1.5,
)
FLEET = gm.Fleet(
    gpus_per_node=8,
    state_gib_per_gpu=4.0,
    mtbf_node_s=6000 * HOUR,
    detect_s=30.0,
    restart_s=60.0,
    s3_aggregate_gbps=100.0,
)


def _scheme(block: float, persist: float = 0.0, restore: float = 0.0) -> object:
    return gm.Scheme("x", block, persist, restore, 30.0, 60.0)


@pytest.mark.parametrize(
    ("block", "persist", "restore", "mtbf"),
    [(1.0, 0.0, 0.0, 10 * HOUR), (0.5, 20.0, 60.0, 3 * HOUR), (30.0, 5.0, 300.0, 20 * HOUR)],
)
def test_brute_force_optimum_matches_the_closed_form(
    block: float, persist: float, restore: float, mtbf: float
) -> None:
    scheme = _scheme(block, persist, restore)
    best = gm.best_interval_s(lambda t: gm.goodput(scheme, t, mtbf), 1.0, mtbf)
    exact = gm.exact_interval_s(scheme, mtbf)
    assert best == pytest.approx(exact, rel=1e-4)
    assert gm.goodput(scheme, best, mtbf) >= gm.goodput(scheme, exact, mtbf) - 1e-12


def test_young_approximates_the_optimum_when_the_save_is_cheap() -> None:
    scheme = _scheme(block=1.0)
    mtbf = 100 * HOUR
    best = gm.best_interval_s(lambda t: gm.goodput(scheme, t, mtbf), 1.0, mtbf)
    young = gm.young_interval_s(1.0, mtbf)
    assert young == pytest.approx(math.sqrt(2 * mtbf))
    assert best == pytest.approx(young, rel=0.01)


def test_goodput_peaks_at_the_optimum_and_falls_either_side() -> None:
    scheme = _scheme(block=2.0, persist=10.0, restore=60.0)
    mtbf = 10 * HOUR
    best = gm.exact_interval_s(scheme, mtbf)
    values = [gm.goodput(scheme, best * f, mtbf) for f in (0.1, 0.5, 1.0, 2.0, 10.0)]
    assert values[0] < values[1] < values[2] > values[3] > values[4]
    assert all(0.0 <= v <= 1.0 for v in values)


def test_without_failures_only_the_save_costs() -> None:
    scheme = _scheme(block=3.0)
    assert gm.goodput(scheme, 297.0, 1e15) == pytest.approx(297.0 / 300.0)


def test_a_slow_copy_stalls_the_next_save() -> None:
    scheme = _scheme(block=1.0, persist=100.0)
    assert scheme.save_cost_s(60.0) == pytest.approx(41.0)
    assert scheme.save_cost_s(600.0) == pytest.approx(1.0)
    assert scheme.lag_s == pytest.approx(101.0)


def test_failure_rate_grows_with_the_node_count() -> None:
    assert FLEET.nodes(2304) == 288
    assert FLEET.nodes(1) == 1
    assert FLEET.mtbf_cluster_s(2304) == pytest.approx(FLEET.mtbf_node_s / 288)


def test_recovery_formulas() -> None:
    node = 8 * 4.0 * GiB
    for gpus in (64, 2304, 16384):
        tier = gm.tierckpt_scheme(COSTS, FLEET, gpus)
        assert tier.block_s == pytest.approx(4.0 * 0.2)
        assert tier.persist_s == pytest.approx(node / 2e9)
        assert tier.restore_s == pytest.approx(node / 2e9 + 4.0 * 0.15)
        assert tier.recovery_s == pytest.approx(90.0 + tier.restore_s)
    # S3-only: each node reads at its own rate until the shared bandwidth caps it.
    small = gm.s3_only_scheme(COSTS, FLEET, 64)  # 8 nodes: 100/8 > 1.5 GB/s
    assert small.restore_s == pytest.approx(node / 1.5e9)
    assert small.persist_s == pytest.approx(node / 1.0e9)
    big = gm.s3_only_scheme(COSTS, FLEET, 16384)  # 2048 nodes share 100 GB/s
    assert big.restore_s == pytest.approx(node / (100e9 / 2048))
    assert big.persist_s == pytest.approx(node / (100e9 / 2048))


def test_tierckpt_recovery_is_flat_and_s3_grows_with_the_cluster() -> None:
    sizes = [64, 256, 1024, 4096, 16384]
    tier = [gm.tierckpt_scheme(COSTS, FLEET, g).recovery_s for g in sizes]
    s3 = [gm.s3_only_scheme(COSTS, FLEET, g).recovery_s for g in sizes]
    assert len(set(tier)) == 1
    assert all(a <= b for a, b in zip(s3, s3[1:], strict=False)) and s3[-1] > s3[0]


def test_goodput_falls_as_the_cluster_grows() -> None:
    for make in (gm.tierckpt_scheme, gm.s3_only_scheme):
        points = [gm.evaluate(make(COSTS, FLEET, g), FLEET, g) for g in (64, 512, 2304, 16384)]
        values = [p.goodput for p in points]
        assert all(a > b for a, b in zip(values, values[1:], strict=False))
        if make is gm.tierckpt_scheme:  # S3-only's best interval is pinned by its upload
            intervals = [p.interval_s for p in points]
            assert all(a > b for a, b in zip(intervals, intervals[1:], strict=False))


def test_bad_fleet_values_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="state_gib_per_gpu"):
        gm.Fleet(8, 0.0, HOUR, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        gm.Fleet(0, 1.0, HOUR, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="interval"):
        gm.goodput(_scheme(1.0), 0.0, HOUR)


@pytest.mark.timeout(120)
def test_goodput_script_prints_the_table_the_comparison_and_a_plot(tmp_path: Path) -> None:
    png = tmp_path / "goodput.png"
    flags = [
        "--replicate-gbps=2",
        "--peer-restore-gbps=2",
        "--drain-gbps=1",
        "--s3-read-gbps=1.5",
        "--save-block-s-per-gib=0.2",
        "--stock-block-s-per-gib=0.5",
        "--memory-load-s-per-gib=0.15",
    ]
    proc = run_bench("goodput.py", *flags, "--gpus", "64", "2304", "--plot", str(png), timeout=110)
    assert proc.returncode == 0, tail(proc)
    assert "| tierckpt" in proc.stdout and "| S3-only" in proc.stdout
    assert "2,304 GPUs" in proc.stdout and "47 s" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_mtbf_threshold_gives_the_target_goodput() -> None:
    def make(f: object, g: int) -> object:
        return gm.tierckpt_scheme(COSTS, f, g)

    mtbf = gm.mtbf_for_goodput(make, FLEET, 2304, 0.95)
    at = gm.replace(FLEET, mtbf_node_s=mtbf)
    assert gm.evaluate(make(at, 2304), at, 2304).goodput == pytest.approx(0.95, abs=1e-6)
    worse = gm.replace(FLEET, mtbf_node_s=mtbf * 0.9)
    assert gm.evaluate(make(worse, 2304), worse, 2304).goodput < 0.95


MEMORY_FLAGS = [
    "--save-block-s-per-gib=0.2",
    "--stock-block-s-per-gib=0.5",
    "--memory-load-s-per-gib=0.15",
]


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"costs": {"peer_restore_gbps": -1}}',
        '{"costs": {"peer_restore_gbps": "NaN"}}',
        '{"costs": {"rm -rf": 1.0}}',
        '{"nothing": 1}',
    ],
)
def test_a_bad_results_file_is_refused_naming_the_file(tmp_path: Path, text: str) -> None:
    (tmp_path / "goodput_costs.json").write_text(text)
    proc = run_bench("goodput.py", "--results", str(tmp_path), *MEMORY_FLAGS, "--plot=", timeout=60)
    assert proc.returncode != 0
    assert "goodput_costs.json" in proc.stderr and "re-run" in proc.stderr, tail(proc)
    assert "Traceback" not in proc.stderr, tail(proc)


def test_missing_memory_costs_are_named_before_anything_is_measured(tmp_path: Path) -> None:
    proc = run_bench("goodput.py", "--results", str(tmp_path), "--plot=", timeout=60)
    assert proc.returncode != 0
    assert "memory_tier.json is missing" in proc.stderr, tail(proc)
    assert "--save-block-s-per-gib" in proc.stderr and "measuring" not in proc.stdout
    assert not (tmp_path / "goodput_costs.json").exists()
