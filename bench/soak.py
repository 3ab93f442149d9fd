"""Soak (issue 12, point 5): many saves of a small state with retention on, measured.

Real daemons (3 by default, peering, `copies` extra copies of every file, memory
retention `memory_keep_last`, optionally draining every Nth checkpoint to a moto S3 with
S3 retention) and a real 2-rank gloo job: rank r saves on node r, with a new
TieredStorageWriter per save, and every `--load-every` saves loads the newest checkpoint
(checkpoint_id=None) and the oldest one retention keeps, bit-exact. Every
`--sample-every` saves the ranks park; once the daemons are quiescent (copies made,
drains done) the driver samples each daemon: VmRSS (and RssAnon), open fds, threads,
and memory-tier bytes from GetStatus, from ListCheckpoints and from the files under its
memory dir, and checks them against what retention should keep. After the warm-up it
fits least-squares slopes per 100 saves and prints a table and a verdict:

  RSS     slope < 1 MiB per 100 saves (a leak of 10 KiB per save shows as 1 MiB per
          100); not judged under 200 saves, where it is the warm-up's
  fds     slope < 0.5 per 100 saves, no new high in the last half (an S3 keep-alive
          connection may be open or not); --quick: at most 2 above the warm-up
  threads slope < 0.5 per 100 saves, no new high in the last half (the RPC pools
          start workers lazily, then plateau); --quick: at most 8 above the warm-up
  memory  at every sample, on every node: the checkpoints in memory are exactly the
          newest memory_keep_last, its files on disk are exactly what it says it holds,
          used bytes are those files plus the manifests peers published, nothing is
          reserved or half-received, every kept file has copies + 1 holders, every due
          one is DURABLE, and what it lists as in S3 only is what S3 holds (within
          --settle s: a node learns other nodes' S3 deletions at its next re-listing)

    python bench/soak.py                  # 1,000 saves, 3 daemons, S3 drain every 5th
    python bench/soak.py --quick          # 30 saves (the integration smoke runs this)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

_BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(_BENCH), str(_BENCH.parent)]  # bench helpers, then tests.support
from _harness import MiB, free_ports, machine_facts, tmpfs_root  # noqa: E402
from _soak_probe import NodeSample, fit_slope, sample_node  # noqa: E402
from _soak_ranks import SoakPlan, checkpoint_id, soak_rank  # noqa: E402
from tierckpt.daemon_client import CheckpointInfo, DaemonClient  # noqa: E402

from tests.support.daemon_process import DaemonProcess  # noqa: E402
from tests.support.dist_job import start_job  # noqa: E402

NS = "soak"
WORLD = 2
# Verdict thresholds, per 100 saves after the warm-up (see the module docstring).
RSS_SLOPE_MAX = 1 * MiB
COUNT_SLOPE_MAX = 0.5
JUDGED_SAVES = 200  # fewer saves: the RSS slope is warm-up noise (--quick)
LAZY_THREADS = 8  # workers the RPC pools may still start during a --quick run
LAZY_FDS = 2  # S3 keep-alive connections open or not at a --quick sample
RELIST_INTERVAL = 2.0  # s: how stale a node's view of S3 may be (a sample waits for it)
MANIFEST_CHARGE_MAX = 8192  # the pages one manifest of this small a checkpoint is charged


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--saves", type=int, default=1000)
    p.add_argument("--quick", action="store_true", help="30 saves, sampled every 3")
    p.add_argument("--nodes", type=int, default=3, help="daemons (2 ranks on the first two)")
    p.add_argument("--copies", type=int, default=1, help="[replication] copies")
    p.add_argument("--keep-last", type=int, default=2, help="[retention] memory_keep_last")
    p.add_argument("--rank-mib", type=float, default=2.0, help="state per rank, MiB")
    p.add_argument("--sample-every", type=int, default=20)
    p.add_argument("--load-every", type=int, default=10)
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of saves before fits")
    p.add_argument("--persistent-every", type=int, default=5, help="0: no S3 tier")
    p.add_argument("--persistent-keep-last", type=int, default=2)
    p.add_argument("--budget", default="512MiB")
    p.add_argument("--settle", type=float, default=20.0, help="seconds to wait for quiescence")
    p.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the daemons (e.g. MALLOC_TRIM_THRESHOLD_=131072: glibc's\n"
        "default trimming, so RSS follows the live heap when a slope needs explaining)",
    )
    p.add_argument("--out", help="write the record as JSON here")
    p.add_argument("--logs", help="copy every daemon's log here (always on a failure)")
    args = p.parse_args(argv)
    if args.quick:
        args.saves, args.sample_every, args.load_every = 30, 3, 3
    if args.nodes < WORLD:
        p.error(f"--nodes must be at least {WORLD} (one per rank)")
    return args


class Soak:
    """The daemons, the optional S3, and the samples of one soak run."""

    def __init__(self, args: argparse.Namespace, stack: ExitStack) -> None:
        self.args = args
        self.root = Path(tempfile.mkdtemp(prefix="tierckpt-soak-", dir=tmpfs_root()))
        stack.callback(shutil.rmtree, self.root, True)
        self.persistent: dict[str, Any] = {}
        self.s3: Any = None  # an s3fs filesystem on the bucket, to list what is durable
        self.s3_prefix = ""
        if args.persistent_every > 0:
            self.persistent = self._start_s3(stack)
        for item in args.daemon_env:  # DaemonProcess passes os.environ on
            key, _, value = item.partition("=")
            os.environ[key] = value
        self.nodes = self._start_daemons(stack)
        self.clients = [DaemonClient(d.address) for d in self.nodes]
        for client in self.clients:
            stack.callback(client.close)
        self.points: list[dict[str, Any]] = []

    # ---- setup ------------------------------------------------------------------------
    def _start_s3(self, stack: ExitStack) -> dict[str, Any]:
        import logging

        from tests.support.moto_s3 import (
            AWS_UNSET,
            BUCKET,
            FAST_FAIL_CONFIG,
            MotoServer,
            aws_environment,
        )

        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        server = MotoServer()
        stack.callback(server.stop)
        for name in AWS_UNSET:
            os.environ.pop(name, None)
        os.environ.update(aws_environment(server.endpoint_url))
        options = {"endpoint_url": server.endpoint_url, "config_kwargs": dict(FAST_FAIL_CONFIG)}
        import s3fs

        self.s3 = s3fs.S3FileSystem(**options)
        self.s3.mkdir(BUCKET)
        self.s3_prefix = f"{BUCKET}/soak/{NS}"
        return {
            "url": f"s3://{BUCKET}/soak",
            "storage_options": options,
            "every": self.args.persistent_every,
            "relist_interval": RELIST_INTERVAL,
        }

    def _start_daemons(self, stack: ExitStack) -> list[DaemonProcess]:
        a = self.args
        ports = free_ports(a.nodes)
        ids = [f"node{i}" for i in range(a.nodes)]
        retention: dict[str, Any] = {"memory_keep_last": a.keep_last}
        if self.persistent:
            retention["persistent_keep_last"] = a.persistent_keep_last
        nodes = []
        for i in range(a.nodes):
            config: dict[str, Any] = {
                "node": {"id": ids[i], "failure_domain": f"rack{i}"},
                "listen": {"peer": f"127.0.0.1:{ports[i]}"},
                "memory": {"dir": str(self.root / ids[i]), "budget": a.budget},
                "retention": retention,
                "replication": {"copies": a.copies, "heal_interval": 2.0},
                "peers": [
                    {"id": ids[j], "address": f"127.0.0.1:{ports[j]}", "failure_domain": f"rack{j}"}
                    for j in range(a.nodes)
                    if j != i
                ],
            }
            if self.persistent:
                config["persistent"] = self.persistent
            daemon = DaemonProcess(config, name=ids[i], start=False)
            stack.callback(daemon.cleanup)
            nodes.append(daemon)
        for daemon in nodes:
            daemon.start()
        return nodes

    # ---- one sample point -------------------------------------------------------------
    def _kept(self, index: int) -> set[str]:
        return {checkpoint_id(j) for j in range(max(1, index - self.args.keep_last + 1), index + 1)}

    def _s3_durable(self) -> set[str]:
        """The checkpoint ids whose `.metadata` is in S3 (the commit marker)."""
        if self.s3 is None:
            return set()
        self.s3.invalidate_cache()
        return {p.split("/")[-2] for p in self.s3.glob(f"{self.s3_prefix}/*/.metadata")}

    def _unsettled(
        self, index: int, samples: list[NodeSample], rows: list[list[CheckpointInfo]]
    ) -> list[str]:
        """What the background work (copies, drains, prewarm, retention after a drain)
        has yet to do after save `index`; a sample waits for it, up to --settle s."""
        a, kept, out = self.args, self._kept(index), []
        for s, listed in zip(samples, rows, strict=True):
            if set(s.in_memory) != kept:
                out.append(
                    f"{s.node} keeps {s.in_memory} in memory; retention keeps {sorted(kept)}"
                )
            if s.reserved or s.prewarm_pending:
                out.append(f"{s.node} reserved {s.reserved}, prewarm pending {s.prewarm_pending}")
            if s.stray:
                out.append(f"{s.node} has incoming/temp files: {s.stray[:5]}")
            if s.moved:
                out.append(f"{s.node}'s used/reserved bytes changed while it was sampled")
            # C = held files in whole pages (a page per checkpoint dir) + the manifest of
            # every listed checkpoint, the node's own too, in whole pages (audit 3 M6). A
            # node may over-count one checkpoint for a few seconds around the eviction of
            # a durable one (its next sample is exact): past --settle it is a leak.
            if not 0 <= s.used - s.charged <= len(listed) * MANIFEST_CHARGE_MAX:
                out.append(
                    f"{s.node} used {s.used} = held {s.charged} (pages) + "
                    f"{s.used - s.charged}, more than {len(listed)} manifests can be"
                )
            for info in listed:
                due = a.persistent_every > 0 and info.sequence % a.persistent_every == 0
                if due and info.checkpoint_id in kept and info.state != "DURABLE":
                    out.append(f"{s.node}: {info.checkpoint_id} is due for S3 but {info.state}")
        # A node learns from a re-listing (every relist_interval) what another node's
        # persistent retention deleted: its "S3 only" rows catch up, they need not be exact.
        listed_s3 = self._s3_durable() - kept
        out.extend(
            f"{s.node} lists {s.persistent_only} as in S3 only; S3 holds "
            f"{sorted(listed_s3)} besides the kept ones"
            for s in samples
            if set(s.persistent_only) != listed_s3
        )
        want = min(a.copies, a.nodes - 1) + 1
        for info in rows[0]:
            for f in info.files if info.checkpoint_id in kept else ():
                holders = {f.owner_node, *f.replica_nodes} - {""}
                if len(holders) < want:
                    out.append(
                        f"{info.checkpoint_id}/{f.name} on {sorted(holders)}, not {want} nodes"
                    )
        return out

    def _problems(
        self, index: int, samples: list[NodeSample], rows: list[list[CheckpointInfo]]
    ) -> list[str]:
        """Where the settled daemons differ from what retention should keep."""
        out = self._unsettled(index, samples, rows)
        for s, listed in zip(samples, rows, strict=True):
            n = s.node
            if s.on_disk != s.held:
                out.append(f"{n} has {s.on_disk} bytes of files on disk but says it holds {s.held}")
            with_files = {i.checkpoint_id for i in listed if any(f.local_path for f in i.files)}
            if set(s.data_dirs) != with_files:
                out.append(
                    f"{n} data dirs {s.data_dirs} != checkpoints it holds {sorted(with_files)}"
                )
            if s.manifests != len(listed):
                out.append(f"{n} has {s.manifests} manifests for {len(listed)} listed checkpoints")
        return out

    def sample(self, index: int) -> dict[str, Any]:
        """Wait (up to --settle s) until the background work is done, then record the
        figures and every difference from what retention should keep."""
        started = time.monotonic()
        while True:
            taken = [
                sample_node(d.name, d.pid, c, d.memory_dir, NS)
                for d, c in zip(self.nodes, self.clients, strict=True)
            ]
            samples, rows = [t[0] for t in taken], [t[1] for t in taken]
            waited = time.monotonic() - started
            if not self._unsettled(index, samples, rows) or waited > self.args.settle:
                break
            time.sleep(0.2)
        point = {
            "saves": index,
            "settle_s": round(waited, 2),
            "problems": self._problems(index, samples, rows),
            "nodes": [asdict(s) for s in samples],
        }
        self.points.append(point)
        return point

    def save_logs(self) -> None:
        """Keep the daemons' logs (they go with their temp dirs): --logs, else a new
        temp dir, named on stderr."""
        target = Path(self.args.logs or tempfile.mkdtemp(prefix="tierckpt-soak-logs-"))
        target.mkdir(parents=True, exist_ok=True)
        for d in self.nodes:
            if d.log_path.exists():
                shutil.copy(d.log_path, target / f"{d.name}.log")
        print(f"daemon logs in {target}", file=sys.stderr)

    # ---- the run ----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        plan = SoakPlan(
            namespace=NS,
            addresses=tuple(d.address for d in self.nodes[:WORLD]),
            saves=a.saves,
            rank_bytes=int(a.rank_mib * MiB),
            keep_last=a.keep_last,
            sample_every=a.sample_every,
            load_every=a.load_every,
        )
        job = start_job(soak_rank, WORLD, plan, timeout=max(900.0, a.saves * 5.0))
        started = time.monotonic()
        try:
            for index in range(1, a.saves + 1):
                if index % a.sample_every and index != a.saves:
                    continue
                job.wait_for_marker(f"at-{index}", [0], timeout=600)
                point = self.sample(index)
                Path(job.job_dir, f"resume-{index}").write_text("")
                _progress(point, time.monotonic() - started)
            ranks = job.join()
        finally:
            job.cleanup()
        return {
            "machine": machine_facts(),
            "config": vars(a),
            "seconds": round(time.monotonic() - started, 1),
            "ranks": ranks,
            "points": self.points,
            "summary": summarize(self.points, a.warmup * a.saves),
        }


def _progress(point: dict[str, Any], elapsed: float) -> None:
    figures = "  ".join(
        f"{n['node']} rss {n['proc']['rss'] / MiB:.1f}M fds {n['proc']['fds']} thr {n['proc']['threads']}"
        for n in point["nodes"]
    )
    flag = f"  PROBLEMS: {point['problems']}" if point["problems"] else ""
    print(f"[{elapsed:6.0f}s] save {point['saves']:>5}  {figures}{flag}", flush=True)


METRICS: dict[str, tuple[str, float]] = {
    # name: (unit, divisor)
    "rss": ("MiB", MiB),
    "rss_anon": ("MiB", MiB),
    "rss_shmem": ("MiB", MiB),
    "fds": ("", 1),
    "threads": ("", 1),
    "used": ("MiB", MiB),
    "held": ("MiB", MiB),
    "pool": ("MiB", MiB),
    "manifests": ("", 1),
}


def _value(node: dict[str, Any], metric: str) -> float:
    return float(node["proc"][metric] if metric in node["proc"] else node[metric])


def _flat(f: dict[str, float], slope_max: float) -> bool:
    """Slope under `slope_max` per 100 saves and no new high in the last half of the
    samples after the warm-up (a pool that starts threads lazily plateaus; a leak
    keeps climbing)."""
    return f["slope_per_100"] < slope_max and f["late_max"] <= f["early_max"]


def summarize(points: list[dict[str, Any]], warmup_saves: float) -> dict[str, Any]:
    """Per node and metric: first/last/min/max after the warm-up and the slope per 100
    saves; then the verdict of each property. Under JUDGED_SAVES saves (--quick) the
    RSS slope is warm-up noise and not judged, and threads may still grow by
    LAZY_THREADS as the RPC pools start workers for new peaks of concurrent calls."""
    after = [p for p in points if p["saves"] > warmup_saves] or points[-1:]
    before = [p for p in points if p["saves"] <= warmup_saves]
    half = len(after) // 2
    judged = points[-1]["saves"] >= JUDGED_SAVES
    names = [n["node"] for n in points[0]["nodes"]]
    figures: dict[str, dict[str, dict[str, float]]] = {}
    verdicts: dict[str, bool] = {}
    for i, node in enumerate(names):
        figures[node] = {}
        xs = [float(p["saves"]) for p in after]
        for metric in METRICS:
            ys = [_value(p["nodes"][i], metric) for p in after]
            early = [_value(p["nodes"][i], metric) for p in before]
            figures[node][metric] = {
                "first": ys[0],
                "last": ys[-1],
                "min": min(ys),
                "max": max(ys),
                "warmup_max": max(early) if early else ys[0],
                "early_max": max(ys[: max(half, 1)]),
                "late_max": max(ys[half:]),
                "slope_per_100": fit_slope(xs, ys) * 100,
            }
        f = figures[node]
        if judged:
            verdicts[f"{node} rss flat"] = f["rss"]["slope_per_100"] < RSS_SLOPE_MAX
            verdicts[f"{node} threads flat"] = _flat(f["threads"], COUNT_SLOPE_MAX)
            verdicts[f"{node} fds flat"] = _flat(f["fds"], COUNT_SLOPE_MAX)
        else:
            verdicts[f"{node} threads flat"] = (
                f["threads"]["max"] <= f["threads"]["warmup_max"] + LAZY_THREADS
            )
            verdicts[f"{node} fds flat"] = f["fds"]["max"] <= f["fds"]["warmup_max"] + LAZY_FDS
    problems = [(p["saves"], msg) for p in after for msg in p["problems"]]
    verdicts["memory tier == retention, every sample after warm-up"] = not problems
    in_warmup = [(p["saves"], msg) for p in before for msg in p["problems"]]
    verdicts["memory tier == retention, warm-up samples too"] = not in_warmup
    return {
        "warmup_saves": warmup_saves,
        "samples_after_warmup": len(after),
        "figures": figures,
        "problems": in_warmup + problems,
        "max_settle_s": max(p["settle_s"] for p in points),
        "verdicts": verdicts,
        "flat": all(verdicts.values()),
    }


def render(record: dict[str, Any]) -> str:
    s, a = record["summary"], record["config"]
    out = [
        f"\n## soak: {a['saves']} saves of {WORLD} x {a['rank_mib']} MiB on {a['nodes']} daemons "
        f"(copies {a['copies']}, memory_keep_last {a['keep_last']}, S3 every "
        f"{a['persistent_every'] or '-'}) in {record['seconds']} s",
        f"ranks: {record['ranks']}",
        f"fits over {s['samples_after_warmup']} samples after save {s['warmup_saves']:.0f}; "
        f"slowest settle {s['max_settle_s']} s",
        f"{'node':<6} {'metric':<10} {'first':>9} {'last':>9} {'min':>9} {'max':>9} "
        f"{'warmup max':>10} {'slope/100 saves':>16}",
    ]
    for node, metrics in s["figures"].items():
        for metric, f in metrics.items():
            unit, div = METRICS[metric]
            cells = [f[k] / div for k in ("first", "last", "min", "max", "warmup_max")]
            out.append(
                f"{node:<6} {metric + (' ' + unit if unit else ''):<10} "
                + " ".join(f"{c:>9.2f}" for c in cells[:4])
                + f" {cells[4]:>10.2f} {f['slope_per_100'] / div:>+16.3f}"
            )
    for saves, msg in s["problems"][:20]:
        out.append(f"problem at save {saves}: {msg}")
    if not any("rss" in name for name in s["verdicts"]):
        out.append(f"RSS slope not judged: under {JUDGED_SAVES} saves it is the warm-up's")
    out.append("verdict:")
    out += [f"  {'PASS' if ok else 'FAIL'}  {name}" for name, ok in s["verdicts"].items()]
    out.append(f"soak {'FLAT' if s['flat'] else 'NOT FLAT'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    with ExitStack() as stack:
        soak = Soak(args, stack)
        try:
            record = soak.run()
        except BaseException:
            soak.save_logs()
            raise
        if args.logs:
            soak.save_logs()
    print(render(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0 if record["summary"]["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
