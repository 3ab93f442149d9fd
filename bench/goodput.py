"""Goodput at fleet scale: recovery time and goodput vs cluster size, tierckpt vs S3-only.

Costs come from the project's own benches: save blocking and memory-tier load per GiB
from bench/results/memory_tier.json (bench_memory_tier.py), replication, peer restore,
drain and S3 read throughput from bench/results/goodput_costs.json (`--measure` writes it
against real daemons and a moto S3 in about a minute; missing -> measured now). Every cost can be
overridden by a flag; the fleet's shape and failure behaviour are flags with documented
defaults. The model itself is bench/_goodput_model.py (first-order Young/Daly).

    python bench/goodput.py [--measure] [--plot docs/goodput.png] [--state-gib-per-gpu 3.06] ...
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _goodput_model import (  # noqa: E402
    Costs,
    Fleet,
    Point,
    Scheme,
    drain_s,
    evaluate,
    exact_interval_s,
    mtbf_for_goodput,
    s3_only_scheme,
    tierckpt_scheme,
)

RESULTS = Path(__file__).resolve().parent / "results"
MEASURED_HERE = {"replicate_gbps", "peer_restore_gbps", "drain_gbps", "s3_read_gbps"}
GPU_SIZES = [64, 128, 256, 512, 1024, 2304, 4096, 8192, 16384]

# Llama 3 (Meta, 2024): 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. one per
# 50,700 GPU-hours; an 8-GPU node then fails once per ~6,300 hours.
LLAMA3_GPU_MTBF_H = 16384 * 54 * 24 / 419
# Llama-3 70B with fp32 weights + AdamW moments (12 bytes a parameter) over 256 GPUs.
LLAMA70B_STATE_BYTES = 70e9 * 12


def _median_tail(values: list[float]) -> float:
    """Calls 2..N: call 1 pays one-off setup (staging buffers, first pages)."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def memory_tier_costs(record: dict[str, Any]) -> dict[str, float]:
    """Per-GiB save blocking (tierckpt and stock async_save) and load, 1 rank x 1 GiB."""
    scenario = next(s for s in record["scenarios"] if s["world"] == 1)
    gib = scenario["bytes"] / (1 << 30)
    runs = scenario["async"]
    tier = [
        _median_tail(runs[k]["blocking_s"]) for k in runs if k.startswith("tierckpt") and "new" in k
    ]
    stock = [_median_tail(runs[k]["blocking_s"]) for k in runs if k.startswith("stock")]
    return {
        "save_block_s_per_gib": max(tier) / gib,
        "stock_block_s_per_gib": min(stock) / gib,
        "memory_load_s_per_gib": min(scenario["load_s"]) / gib,
    }


def _read_json(path: Path, read: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, float]:
    """A results file's costs, each a finite number > 0 under a known name, or a clear exit."""
    try:
        found = read(json.loads(path.read_text()))
        costs = {str(k): float(v) for k, v in found.items()}
    except (OSError, ValueError, TypeError, KeyError, StopIteration) as e:
        raise SystemExit(f"{path}: unreadable ({e!r}); re-run the bench that writes it") from e
    for key, value in costs.items():
        if key not in Costs.__dataclass_fields__ or not (math.isfinite(value) and value > 0):
            raise SystemExit(f"{path}: {key} = {value} is not a known cost > 0; re-run its bench")
    return costs


def _positive(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number > 0")
    return value


def _measured_context(path: Path) -> str:
    """When and how loaded the machine was for goodput_costs.json (context, never a cost)."""
    try:
        record = json.loads(path.read_text())
        machine, raw = record["machine"], float(record["baseline"]["raw_grpc_loopback_gbps"])
        return (
            f"  (goodput_costs.json: {machine['utc']}, {machine['cores']} cores, load average "
            f"{machine['loadavg_before'][0]}-{machine['loadavg_after'][0]}; a raw grpcio stream "
            f"ran at {raw:.2f} GB/s on loopback in the same run)"
        )
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return "  (goodput_costs.json: no machine facts)"


def _shown(path: Path) -> str:
    """A results path as the reader knows it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(RESULTS.parent.parent))
    except ValueError:
        return str(path)


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number of seconds >= 0")
    return value


def _count(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 10_000_000:
        raise argparse.ArgumentTypeError(f"{text}: must be a count from 1 to 10,000,000")
    return value


def load_costs(args: argparse.Namespace) -> tuple[Costs, dict[str, str]]:
    """The measured costs, each overridable by its flag; returns them and where each came from."""
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    memory = args.results / "memory_tier.json"
    if memory.exists():
        for key, value in _read_json(memory, memory_tier_costs).items():
            values[key], sources[key] = value, _shown(memory)
    measured = args.results / "goodput_costs.json"
    flagged = {key for key in Costs.__dataclass_fields__ if getattr(args, key) is not None}
    missing = set(Costs.__dataclass_fields__) - MEASURED_HERE - set(values) - flagged
    if missing:  # before a minute of measuring
        raise SystemExit(
            f"{_shown(memory)} is missing: run python bench/bench_memory_tier.py (about 3 min) "
            f"or pass --{' --'.join(sorted(k.replace('_', '-') for k in missing))}"
        )
    if args.measure or (not measured.exists() and not flagged >= MEASURED_HERE):
        from _goodput_measure import measure

        print("measuring replication, peer restore, drain and S3 read (real daemons, moto)...")
        try:
            record = measure(args.measure_mib)
        except ValueError as e:
            raise SystemExit(str(e)) from e
        measured.parent.mkdir(parents=True, exist_ok=True)
        measured.write_text(json.dumps(record, indent=2) + "\n")
    if measured.exists():
        for key, value in _read_json(measured, lambda r: dict(r["costs"])).items():
            values[key], sources[key] = value, _shown(measured)
    for key in Costs.__dataclass_fields__:
        flag = getattr(args, key)
        if flag is not None:
            values[key], sources[key] = flag, "--" + key.replace("_", "-")
        if key not in values:
            raise SystemExit(
                f"cost {key} is missing: run python bench/bench_memory_tier.py "
                f"(memory_tier.json) or pass --{key.replace('_', '-')}"
            )
    return Costs(**values), sources


def _fmt_s(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


Maker = Callable[[Fleet, int], Scheme]


def makers(costs: Costs, s3_assumed_gbps: float) -> list[Maker]:
    """tierckpt and S3-only with the measured costs, and S3-only at an assumed node rate."""
    assumed = replace(costs, drain_gbps=s3_assumed_gbps, s3_read_gbps=s3_assumed_gbps)
    name = f"S3@{s3_assumed_gbps:g}"
    return [
        lambda f, g: tierckpt_scheme(costs, f, g),
        lambda f, g: s3_only_scheme(costs, f, g),
        lambda f, g: s3_only_scheme(assumed, f, g, name=name),
    ]


def table(
    costs: Costs, fleet: Fleet, sizes: list[int], schemes: list[Maker]
) -> tuple[str, list[list[Point]]]:
    rows = [
        f"{'GPUs':>6} {'nodes':>5} {'MTBF':>8} | {'scheme':<8} {'block':>7} {'persist':>8} "
        f"{'restore':>8} {'recovery':>8} {'interval':>9} {'Young':>9} {'goodput':>8}"
    ]
    points = []
    for gpus in sizes:
        row = [evaluate(make(fleet, gpus), fleet, gpus) for make in schemes]
        points.append(row)
        for k, p in enumerate(row):
            s = p.scheme
            head = f"{gpus:>6} {fleet.nodes(gpus):>5} {_fmt_s(fleet.mtbf_cluster_s(gpus)):>8}"
            rows.append(
                f"{head if k == 0 else '':>21} | {s.name:<8} {_fmt_s(s.block_s):>7} "
                f"{_fmt_s(s.persist_s):>8} {_fmt_s(s.restore_s):>8} {_fmt_s(s.recovery_s):>8} "
                f"{_fmt_s(p.interval_s):>9} {_fmt_s(p.young_s):>9} {100 * p.goodput:>7.2f}%"
            )
        rows.append(
            f"{'':>21} | tierckpt's drain to S3, behind: {_fmt_s(drain_s(costs, fleet, gpus))}"
        )
    return "\n".join(rows), points


def seeds(costs: Costs, fleet: Fleet, schemes: list[Maker]) -> str:
    """Against the seeds' published figures (as quoted in issue 13)."""
    lines = ["\n## Against the seeds' published figures"]
    at = [evaluate(make(fleet, 2304), fleet, 2304) for make in schemes]
    lines.append("2,304 GPUs, seed: recovery < 2 min and goodput >= 95%. Model:")
    for p in at:
        s = p.scheme
        mtbf = mtbf_for_goodput(schemes[at.index(p)], fleet, 2304, 0.95) / 3600
        lines.append(
            f"  {s.name:<8} recovery {_fmt_s(s.recovery_s)} (detect {_fmt_s(s.detect_s)} + restart "
            f"{_fmt_s(s.restart_s)} + restore {_fmt_s(s.restore_s)}), goodput {100 * p.goodput:.2f}%; "
            f"stays >= 95% down to a node MTBF of {mtbf:,.0f} h"
        )
    llama = replace(fleet, state_gib_per_gpu=LLAMA70B_STATE_BYTES / 256 / (1 << 30))
    lines.append(
        f"256 GPUs, Llama-3 70B ({llama.state_gib_per_gpu:.2f} GiB/GPU: fp32 weights + AdamW), "
        "seed: recovery 47 s. Model:"
    )
    for make in schemes:
        s = make(llama, 256)
        lines.append(
            f"  {s.name:<8} recovery {_fmt_s(s.recovery_s)} (restore {_fmt_s(s.restore_s)} of it)"
        )
    tier = at[0].scheme
    spare = (
        120
        - fleet.detect_s
        - fleet.restart_s
        - fleet.state_gib_per_gpu * costs.memory_load_s_per_gib
    )
    need = f"{fleet.node_bytes() / spare / 1e9:.2f} GB/s" if spare > 0 else "impossible"
    lines.append(
        f"tierckpt's own part of a recovery is its restore ({_fmt_s(tier.restore_s)} here); "
        f"< 2 min needs detect + restart < {_fmt_s(120 - tier.restore_s)}, or with "
        f"detect + restart as assumed a peer restore of {need}. Detection and restart are "
        "this model's inputs, not measured here."
    )
    return "\n".join(lines)


def plot(points: list[list[Point]], fleet: Fleet, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [row[0].gpus for row in points]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    labels = {
        "tierckpt": "tierckpt: memory + buddy (measured)",
        "S3-only": "S3-only, stock async_save (measured, moto)",
    }
    for k, style in enumerate(("o-", "s--", "^:")):
        name = points[0][k].scheme.name
        label = labels.get(name, f"S3-only at an assumed {name[3:]} GB/s per node")
        ax.plot(gpus, [100 * row[k].goodput for row in points], style, label=label)
    ax.axhline(95, color="grey", lw=0.8, ls=":")
    ax.axvline(2304, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus], fontsize=7)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput at the best interval (%)")
    ax.set_title(
        f"{fleet.state_gib_per_gpu:.2f} GiB/GPU, node MTBF {fleet.mtbf_node_s / 3600:,.0f} h, "
        f"detect+restart {fleet.detect_s + fleet.restart_s:.0f} s, S3 shared {fleet.s3_aggregate_gbps:g} GB/s",
        fontsize=8,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--measure", action="store_true", help="re-measure bench/results/goodput_costs.json"
    )
    p.add_argument(
        "--measure-mib", type=_count, default=256, help="checkpoint size --measure uses (x 64 MiB)"
    )
    p.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="where memory_tier.json and goodput_costs.json are",
    )
    p.add_argument("--plot", default="docs/goodput.png", help="PNG to write ('' = none)")
    p.add_argument("--gpus-per-node", type=_count, default=8)
    p.add_argument(
        "--state-gib-per-gpu",
        type=_positive,
        default=round(LLAMA70B_STATE_BYTES / 256 / (1 << 30), 2),
        help="checkpointed bytes per rank (default: Llama-3 70B, fp32 + AdamW, over 256 GPUs)",
    )
    p.add_argument(
        "--mtbf-node-hours",
        type=_positive,
        default=None,
        help="one node's MTBF (default: Llama 3's 419 interruptions / 54 days / 16,384 GPUs)",
    )
    p.add_argument("--detect-s", type=_seconds, default=30.0, help="failure -> job knows (assumed)")
    p.add_argument(
        "--restart-s",
        type=_seconds,
        default=60.0,
        help="spare node in, processes up, groups formed (assumed)",
    )
    p.add_argument(
        "--s3-assumed-gbps",
        type=_positive,
        default=2.5,
        help="a third scheme: S3-only at this assumed per-node S3 rate (moto is no real S3)",
    )
    p.add_argument(
        "--s3-aggregate-gbps",
        type=_positive,
        default=100.0,
        help="S3 GB/s the job shares (assumed)",
    )
    for key in Costs.__dataclass_fields__:
        p.add_argument(
            "--" + key.replace("_", "-"),
            type=_positive,
            default=None,
            help="override a measured cost",
        )
    p.add_argument("--gpus", type=_count, nargs="+", default=GPU_SIZES)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    costs, sources = load_costs(args)
    mtbf_h = args.mtbf_node_hours or LLAMA3_GPU_MTBF_H / args.gpus_per_node
    fleet = Fleet(
        gpus_per_node=args.gpus_per_node,
        state_gib_per_gpu=args.state_gib_per_gpu,
        mtbf_node_s=mtbf_h * 3600,
        detect_s=args.detect_s,
        restart_s=args.restart_s,
        s3_aggregate_gbps=args.s3_aggregate_gbps,
    )
    print("## Measured costs (source)")
    for key, value in vars(costs).items():
        print(f"  {key:<24} {value:8.3f}  ({sources[key]})")
    print(_measured_context(args.results / "goodput_costs.json"))
    print(
        f"## Fleet: {fleet.gpus_per_node} GPUs/node, {fleet.state_gib_per_gpu:.2f} GiB/GPU "
        f"({fleet.node_bytes() / (1 << 30):.1f} GiB/node), node MTBF {mtbf_h:,.0f} h, detect "
        f"{fleet.detect_s:g} s, restart {fleet.restart_s:g} s, S3 shared {fleet.s3_aggregate_gbps:g} GB/s"
    )
    schemes = makers(costs, args.s3_assumed_gbps)
    text, points = table(costs, fleet, sorted(set(args.gpus)), schemes)
    print(text)
    check = points[0][0]
    note = "(interval: best by brute force; Young: sqrt(2 C M)"
    if check.scheme.persist_s <= check.interval_s:  # no stall: the closed form applies
        try:
            exact = exact_interval_s(check.scheme, fleet.mtbf_cluster_s(check.gpus))
            note += f"; closed form for tierckpt at {check.gpus} GPUs: {_fmt_s(exact)}"
        except ValueError as e:
            note += f"; closed form: {e}"
    print(note + ")")
    print(seeds(costs, fleet, schemes))
    if args.plot:
        plot(points, fleet, Path(args.plot))
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
