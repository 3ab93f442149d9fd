"""The goodput model behind bench/goodput.py: pure arithmetic, no I/O (unit-tested alone).

Why a model: one 2-core machine cannot fail a 2,304-GPU job, but it can measure what each
tier costs per byte. The model multiplies those costs by a cluster's bytes and its failure
rate (which grows with the node count) to get recovery time and goodput at fleet scale.

First-order model (Young/Daly; exponential, independent failures, each taking out one node):
each period of wall time is `interval` of training plus the save's cost `C` (the blocking
copy, plus a stall when the previous copy is still being made persistent). A failure loses
the work since the newest checkpoint that survives the loss (half a period on average, plus
the time that checkpoint took to become restorable), then pays detection, restart and
restore. With cluster MTBF `M`, goodput = interval / period * (1 - (lost + recovery) / M).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

GiB = 1 << 30
GB = 1e9


@dataclass(frozen=True)
class Costs:
    """Per-byte costs measured by the project's benches (per rank or per node, as named)."""

    save_block_s_per_gib: float  # tierckpt async_save: training blocked, per GiB of one rank
    stock_block_s_per_gib: float  # stock DCP async_save staging: blocked, per GiB of one rank
    memory_load_s_per_gib: float  # tierckpt load from the node's memory tier, per GiB of a rank
    replicate_gbps: float  # one node's new checkpoint pushed to its buddy
    peer_restore_gbps: float  # a replacement node pulling its files from buddies
    drain_gbps: float  # one node's checkpoint uploaded to S3 (tierckpt's drain)
    s3_read_gbps: float  # one node reading its files back from S3


@dataclass(frozen=True)
class Fleet:
    """What the costs do not say: the job's shape and the platform's failure behaviour."""

    gpus_per_node: int
    state_gib_per_gpu: float  # checkpointed bytes per rank (fully sharded: no two ranks alike)
    mtbf_node_s: float  # mean time between failures of one node
    detect_s: float  # failure -> the job knows
    restart_s: float  # replacement node scheduled, processes up, process groups formed
    s3_aggregate_gbps: float  # S3 throughput the whole job shares, each direction

    def __post_init__(self) -> None:
        for name in ("state_gib_per_gpu", "mtbf_node_s", "s3_aggregate_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.gpus_per_node < 1 or self.detect_s < 0 or self.restart_s < 0:
            raise ValueError("gpus_per_node must be >= 1 and detect_s, restart_s >= 0")

    def nodes(self, gpus: int) -> int:
        return max(1, math.ceil(gpus / self.gpus_per_node))

    def node_bytes(self) -> float:
        return self.gpus_per_node * self.state_gib_per_gpu * GiB

    def mtbf_cluster_s(self, gpus: int) -> float:
        """The failure rate grows with the node count: M_cluster = M_node / nodes."""
        return self.mtbf_node_s / self.nodes(gpus)


@dataclass(frozen=True)
class Scheme:
    """One checkpointing scheme on one cluster size: its costs in seconds."""

    name: str
    block_s: float  # training blocked per save
    persist_s: float  # after the block, until the checkpoint survives losing a node
    restore_s: float  # after the restart, until every rank has its state back
    detect_s: float
    restart_s: float

    def save_cost_s(self, interval_s: float) -> float:
        """Blocked per save: the copy, plus a stall if the previous one is still persisting."""
        return self.block_s + max(0.0, self.persist_s - interval_s)

    @property
    def lag_s(self) -> float:
        """From the state a save captures to when that checkpoint survives a node loss."""
        return self.block_s + self.persist_s

    @property
    def recovery_s(self) -> float:
        return self.detect_s + self.restart_s + self.restore_s


def tierckpt_scheme(costs: Costs, fleet: Fleet, gpus: int) -> Scheme:
    """Memory tier + buddy replication: a node loss is restored from its buddy.

    The replacement pulls one node's files from its buddy (the other nodes keep theirs in
    memory), then every rank loads from its node's memory tier, all nodes in parallel: the
    cost does not depend on the cluster size. The S3 drain runs behind, off the critical path.
    """
    node = fleet.node_bytes()
    rank_gib = fleet.state_gib_per_gpu
    return Scheme(
        name="tierckpt",
        block_s=rank_gib * costs.save_block_s_per_gib,
        persist_s=node / (costs.replicate_gbps * GB),
        restore_s=node / (costs.peer_restore_gbps * GB) + rank_gib * costs.memory_load_s_per_gib,
        detect_s=fleet.detect_s,
        restart_s=fleet.restart_s,
    )


def s3_node_gbps(per_node_gbps: float, fleet: Fleet, gpus: int) -> float:
    """Each node's share of S3: its own rate until the job's shared bandwidth caps it."""
    return min(per_node_gbps, fleet.s3_aggregate_gbps / fleet.nodes(gpus))


def s3_only_scheme(costs: Costs, fleet: Fleet, gpus: int, name: str = "S3-only") -> Scheme:
    """Stock DCP async_save to S3: persistent once every node has uploaded; after a failure
    every rank of every node reads its state back from S3 at once, sharing its bandwidth."""
    node = fleet.node_bytes()
    return Scheme(
        name=name,
        block_s=fleet.state_gib_per_gpu * costs.stock_block_s_per_gib,
        persist_s=node / (s3_node_gbps(costs.drain_gbps, fleet, gpus) * GB),
        restore_s=node / (s3_node_gbps(costs.s3_read_gbps, fleet, gpus) * GB),
        detect_s=fleet.detect_s,
        restart_s=fleet.restart_s,
    )


def drain_s(costs: Costs, fleet: Fleet, gpus: int) -> float:
    """tierckpt's background upload of one checkpoint (sets the durable RPO, not goodput)."""
    return fleet.node_bytes() / (s3_node_gbps(costs.drain_gbps, fleet, gpus) * GB)


def goodput(scheme: Scheme, interval_s: float, mtbf_cluster_s: float) -> float:
    """Useful fraction of wall time: interval / period * (1 - (lost + recovery) / M)."""
    if interval_s <= 0 or mtbf_cluster_s <= 0:
        raise ValueError("interval and MTBF must be > 0")
    period = interval_s + scheme.save_cost_s(interval_s)
    lost = period / 2 + scheme.lag_s
    return max(0.0, interval_s / period * (1.0 - (lost + scheme.recovery_s) / mtbf_cluster_s))


def young_interval_s(save_cost_s: float, mtbf_cluster_s: float) -> float:
    """Young's first-order optimum, sqrt(2 C M)."""
    return math.sqrt(2.0 * save_cost_s * mtbf_cluster_s)


def exact_interval_s(scheme: Scheme, mtbf_cluster_s: float) -> float:
    """The optimum of `goodput` while the save cost is constant (no stall): d/dτ = 0 gives
    τ² + 2Cτ - 2AC = 0 with A = M - R - lag - C/2, so τ = sqrt(C² + 2AC) - C (≈ Daly's
    sqrt(2CM) - C when C << M)."""
    c = scheme.block_s
    a = mtbf_cluster_s - scheme.recovery_s - scheme.lag_s - c / 2
    if c <= 0 or a <= 0:
        raise ValueError("no positive optimum: the save is free or the job never progresses")
    return math.sqrt(c * c + 2 * a * c) - c


def best_interval_s(fn: Callable[[float], float], lo: float, hi: float) -> float:
    """Brute force: the interval in [lo, hi] that maximises `fn`, on a log grid then refined
    by golden section around the best point (works where the stall makes C depend on τ)."""
    steps = 2000
    grid: list[float] = [lo * (hi / lo) ** (i / steps) for i in range(steps + 1)]
    best = max(range(len(grid)), key=lambda i: fn(grid[i]))
    a, b = grid[max(0, best - 1)], grid[min(steps, best + 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if fn(c) >= fn(d):
            b = d
        else:
            a = c
    return (a + b) / 2


@dataclass(frozen=True)
class Point:
    """One scheme on one cluster size at its best interval."""

    gpus: int
    scheme: Scheme
    interval_s: float
    young_s: float
    goodput: float


def evaluate(scheme: Scheme, fleet: Fleet, gpus: int) -> Point:
    mtbf = fleet.mtbf_cluster_s(gpus)
    interval = best_interval_s(lambda t: goodput(scheme, t, mtbf), 1.0, mtbf)
    return Point(
        gpus=gpus,
        scheme=scheme,
        interval_s=interval,
        young_s=young_interval_s(scheme.save_cost_s(interval), mtbf),
        goodput=goodput(scheme, interval, mtbf),
    )


def mtbf_for_goodput(
    make: Callable[[Fleet, int], Scheme], fleet: Fleet, gpus: int, target: float
) -> float:
    """The node MTBF (s) below which the best-interval goodput of `make`'s scheme falls under
    `target` (bisection: goodput grows with MTBF); inf if even 10^7 h does not reach it."""
    lo, hi = 60.0, 3.6e10

    def ok(mtbf: float) -> bool:
        f = replace(fleet, mtbf_node_s=mtbf)
        return evaluate(make(f, gpus), f, gpus).goodput >= target

    if not ok(hi):
        return math.inf
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi
