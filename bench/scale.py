"""Scale bench (issue 13 point 3): N real tierckptd daemons on loopback, peering, one
simulated rank per node, and what a save and a one-node restore cost as N grows.

Each rank is a thread of this process speaking the daemon's real socket protocol to its
own node (BeginCheckpoint, ReserveSpace, OpenFile, a write into the memory tier,
CommitFile) exactly as `TieredStorageWriter` does, without torch.distributed collectives
(32+ gloo processes do not fit on 2 cores); rank 0 then commits on node 0 (the DCP
coordinator's daemon). Every node serves `/metrics`, whose
`tierckpt_peer_requests_total{method}` gives the peer RPCs each node served.

The commit carries the ranks' nodes (`holder_nodes`), as the writer gathers them in the DCP
plan: the coordinator asks those for their files and publishes to the files'
neighbourhoods; every other node learns the checkpoint by gossip.

Per save it reports: the commit latency (CommitCheckpoint on the coordinator's node),
peer RPCs served per save by the coordinator's node, by the busiest other node, and on
average, and the bytes replicated per node. RPC counts are net of background: each
node's idle rate (heal rounds and gossip, measured first with no save running) times
the save's window is subtracted; the raw mean is reported beside it. Per restore: a node is killed with its memory
(kill -9, memory dir wiped) and an empty replacement started; it reports the time to
READY, to its first `GetCheckpoint` of the newest checkpoint, and to its rank's file
restored from a buddy (`EnsureLocal`), plus the peer RPCs that recovery cost. A second series saves from a job on a fixed
`--job-nodes` nodes (default 8) while the cluster grows: its commit latency, the peer RPCs
per save in the whole cluster, and those served outside the job's nodes. Then it
fits each figure against N (constant, log N, N) by least squares and says which fits.

    python bench/scale.py --nodes 8 16 32 [64] --saves 5 --rank-mib 1 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import urllib.request
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import MiB  # noqa: E402
from tierckpt.checksum import checksum_bytes  # noqa: E402
from tierckpt.daemon_client import DaemonClient  # noqa: E402
from tierckpt.dcp_metadata import dump_metadata  # noqa: E402
from torch.distributed.checkpoint.metadata import Metadata  # noqa: E402

from tests.support.cluster import LocalCluster  # noqa: E402
from tests.support.raw_rpc import write_files  # noqa: E402

NS = "scale"
_SAMPLE = re.compile(r'^tierckpt_peer_requests_total\{method="(\w+)"\} ([0-9.e+]+)$', re.M)
METADATA = dump_metadata(Metadata(state_dict_metadata={}))
_REPLICATED = re.compile(r"^tierckpt_replicated_bytes_total ([0-9.e+]+)$", re.M)


def scrape(port: int) -> tuple[dict[str, float], float]:
    """One node's peer RPCs served by method, and the bytes it replicated."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    served = {m: float(v) for m, v in _SAMPLE.findall(text)}
    replicated = _REPLICATED.search(text)
    return served, float(replicated.group(1)) if replicated else 0.0


def scrape_all(cluster: LocalCluster) -> list[tuple[dict[str, float], float]]:
    with futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(scrape, cluster.metrics_ports))


def rank_save(client: DaemonClient, checkpoint_id: str, rank: int, data: bytes) -> str:
    """What `TieredStorageWriter` does for one rank's file, over the real socket."""
    name = f"__{rank}_0.distcp"
    write_files(client, NS, checkpoint_id, {name: data}, rank)
    return name


def one_save(
    clients: list[DaemonClient], checkpoint_id: str, data: bytes, pool: futures.Executor
) -> float:
    """Every rank writes its file on its node, then rank 0 commits, passing the ranks'
    nodes as `TieredStorageWriter` does (gathered in the DCP plan): the commit latency."""
    names = list(
        pool.map(lambda r: rank_save(clients[r], checkpoint_id, r, data), range(len(clients)))
    )
    meta = METADATA
    clients[0].reserve_space(NS, checkpoint_id, 0, len(meta))
    opened = clients[0].open_file(NS, checkpoint_id, ".metadata", 0)
    with open(opened.path, "r+b" if opened.preallocated_bytes else "wb") as f:
        f.write(meta)
        f.truncate(len(meta))
    clients[0].commit_file(NS, checkpoint_id, ".metadata", 0, len(meta), checksum_bytes(meta))
    holders = [f"node{r}" for r in range(len(clients))]
    t0 = time.perf_counter()
    clients[0].commit_checkpoint(NS, checkpoint_id, [*names, ".metadata"], holder_nodes=holders)
    return time.perf_counter() - t0


def delta(
    before: list[tuple[dict[str, float], float]], after: list[tuple[dict[str, float], float]]
) -> tuple[list[float], list[float]]:
    rpcs = [sum(a[0].values()) - sum(b[0].values()) for b, a in zip(before, after, strict=True)]
    replicated = [a[1] - b[1] for b, a in zip(before, after, strict=True)]
    return rpcs, replicated


def wait_replicated(cluster: LocalCluster, checkpoint_id: str, timeout: float) -> float:
    """Seconds until node 0 lists the checkpoint REPLICATED (every file has its copies)."""
    t0 = time.perf_counter()
    cluster.wait(
        f"{checkpoint_id} REPLICATED",
        lambda: cluster.rows(0).get(checkpoint_id, {}).get("state") == "REPLICATED",
        timeout,
    )
    return time.perf_counter() - t0


def save_series(
    cluster: LocalCluster,
    clients: list[DaemonClient],
    prefix: str,
    saves: int,
    data: bytes,
    pool: futures.Executor,
    idle_rate: list[float],
) -> dict[str, list[Any]]:
    """`saves` saves by one rank per node of `clients`: commit and settle times, and per
    save the peer RPCs and replicated bytes each node of the cluster served: raw, and net
    of that node's background (its idle rate times the save's window)."""
    got: dict[str, list[Any]] = {"commit": [], "settle": [], "rpcs": [], "net": [], "bytes": []}
    for s in range(saves):
        checkpoint_id = f"{prefix}-{s:04d}"
        before = scrape_all(cluster)
        t0 = time.perf_counter()
        got["commit"].append(one_save(clients, checkpoint_id, data, pool))
        got["settle"].append(wait_replicated(cluster, checkpoint_id, 120))
        after = scrape_all(cluster)
        window = time.perf_counter() - t0
        rpcs, replicated = delta(before, after)
        got["rpcs"].append(rpcs)
        got["net"].append(
            [max(0.0, r - rate * window) for r, rate in zip(rpcs, idle_rate, strict=True)]
        )
        got["bytes"].append(replicated)
    return got


def idle_rates(cluster: LocalCluster, seconds: float) -> list[float]:
    """Peer RPCs each node serves per second with no save running (heal loop, gossip)."""
    before = scrape_all(cluster)
    time.sleep(seconds)
    rpcs, _ = delta(before, scrape_all(cluster))
    return [r / seconds for r in rpcs]


def run_size(n: int, saves: int, rank_bytes: int, job_nodes: int) -> dict[str, Any]:
    data = os.urandom(rank_bytes)
    with ExitStack() as stack, futures.ThreadPoolExecutor(min(n, 32)) as pool:
        t0 = time.perf_counter()
        cluster = LocalCluster(
            stack,
            n,
            namespace=NS,
            copies=1,
            heal_interval=5.0,
            metrics_all=True,
            overrides={
                "memory": {"budget": "256MiB", "scrub_rate": 0},
                # Both series and the restore's checkpoint stay in memory.
                "retention": {"memory_keep_last": 2 * saves + 4},
            },
        )
        started = time.perf_counter() - t0
        clients = [DaemonClient(a) for a in cluster.addresses]
        for client in clients:
            stack.callback(client.close)
        one_save(clients, "warm", data, pool)
        wait_replicated(cluster, "warm", 120)
        # Background: what the heal loops and gossip cost with no save running (3 heal
        # rounds), subtracted from each save's count ("net").
        idle = 15.0
        idle_rate = idle_rates(cluster, idle)
        series = save_series(cluster, clients, "step", saves, data, pool, idle_rate)
        # A job on the first `job_nodes` nodes while the cluster grows: what a commit
        # costs the cluster when it spans a fixed number of nodes (before the restore,
        # whose healing would count against it).
        j = min(job_nodes, n)
        job = save_series(cluster, clients[:j], "job", saves, data, pool, idle_rate)
        # Restore: lose a node that is not the coordinator's, start an empty replacement.
        victim = n // 2
        newest = f"step-{saves - 1:04d}"
        before = scrape_all(cluster)
        before[victim] = ({}, 0.0)  # the replacement is a new process: its counters start at 0
        cluster.lose(victim)
        t0 = time.perf_counter()
        cluster.replace(victim)
        ready_s = time.perf_counter() - t0
        fresh = DaemonClient(cluster.addresses[victim])
        stack.callback(fresh.close)
        fresh.get_checkpoint(NS, newest)
        listed_s = time.perf_counter() - t0
        entry = fresh.ensure_local(NS, newest, f"__{victim}_0.distcp")
        restored_s = time.perf_counter() - t0
        if Path(entry.local_path).read_bytes() != data:
            raise SystemExit(f"node {victim}'s restored file differs from what its rank wrote")
        recovery_rpcs, _ = delta(before, scrape_all(cluster))
    raw, net = series["rpcs"], series["net"]
    return {
        "nodes": n,
        "start_s": started,
        "commit_s": statistics.median(series["commit"]),
        "replicated_s": statistics.median(series["settle"]),
        "rpcs_coordinator": statistics.median(r[0] for r in net),
        "rpcs_max_other": statistics.median(max(r[1:]) for r in net),
        "rpcs_mean": statistics.median(sum(r) / n for r in net),
        "rpcs_total": statistics.median(sum(r) for r in net),
        "raw_rpcs_mean": statistics.median(sum(r) / n for r in raw),
        "raw_rpcs_max_other": statistics.median(max(r[1:]) for r in raw),
        "replicated_bytes_mean": statistics.median(sum(b) / n for b in series["bytes"]),
        "idle_rpcs_per_node_s": sum(idle_rate) / n,
        "restore_ready_s": ready_s,
        "restore_listed_s": listed_s,
        "restore_file_s": restored_s,
        "restore_rpcs_total": sum(recovery_rpcs),
        "restore_bit_exact": True,
        "job_nodes": j,
        "job_commit_s": statistics.median(job["commit"]),
        "job_rpcs_total": statistics.median(sum(r) for r in job["net"]),
        "job_rpcs_outside": statistics.median(sum(r[j:]) for r in job["net"]),
    }


def fit(ns: list[int], ys: list[float]) -> tuple[str, dict[str, float]]:
    """Least-squares fits y = a + b*g(N) for g in {1, log N, N}; the best by residual,
    preferring the simpler model unless the richer one cuts the residual by half."""
    residuals: dict[str, float] = {}
    mean = statistics.fmean(ys)
    residuals["O(1)"] = sum((y - mean) ** 2 for y in ys)
    for label, g in (("O(log N)", math.log), ("O(N)", float)):
        xs = [g(n) for n in ns]
        xm = statistics.fmean(xs)
        sxx = sum((x - xm) ** 2 for x in xs)
        b = sum((x - xm) * (y - mean) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
        a = mean - b * xm
        residuals[label] = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    best = "O(1)"
    for label in ("O(log N)", "O(N)"):
        if residuals[label] < 0.5 * residuals[best]:
            best = label
    return best, residuals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--rank-mib", type=float, default=1.0)
    parser.add_argument(
        "--job-nodes", type=int, default=8, help="nodes of the fixed-size job series (default 8)"
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = []
    for n in args.nodes:
        row = run_size(n, args.saves, int(args.rank_mib * MiB), args.job_nodes)
        rows.append(row)
        print(json.dumps(row), flush=True)
    columns = [
        ("commit_s", "commit s"),
        ("replicated_s", "to REPLICATED s"),
        ("rpcs_coordinator", "net RPCs coord/save"),
        ("rpcs_max_other", "net RPCs max other/save"),
        ("rpcs_mean", "net RPCs mean/node/save"),
        ("raw_rpcs_mean", "raw RPCs mean/node/save"),
        ("idle_rpcs_per_node_s", "idle RPCs/node/s"),
        ("restore_listed_s", "restore: listed s"),
        ("restore_file_s", "restore: file s"),
        ("restore_rpcs_total", "restore RPCs"),
        ("job_commit_s", "fixed job: commit s"),
        ("job_rpcs_total", "fixed job: net RPCs/save"),
        ("job_rpcs_outside", "fixed job: net RPCs outside/save"),
    ]
    print("\n| N | " + " | ".join(c[1] for c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for row in rows:
        print(f"| {row['nodes']} | " + " | ".join(f"{row[k]:.3g}" for k, _ in columns) + " |")
    ns = [r["nodes"] for r in rows]
    fits = {}
    if len(ns) >= 3:
        print("\nfitted growth (least squares; a richer model must halve the residual):")
        for key, label in columns:
            fits[key], _ = fit(ns, [r[key] for r in rows])
            print(f"  {label:24s} {fits[key]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "fits": fits}, indent=2) + "\n")


if __name__ == "__main__":
    main()
