"""Chaos runner (issue 12): 3 real tierckptd nodes peering with copies = 1 and draining
to a moto S3 server, a real 2-rank gloo job saving in a loop (rank r on node r), and
faults injected around it, each followed by the invariants.

Injections: a named fault point (`tierckptd.ops.faults`; the node is restarted with
kill -9 and `TIERCKPT_FAULT=point:action@N`, then restarted clean once it fired), kill -9
of a daemon (restarted on the same memory dir), kill -9 of a rank (the job restarts),
memory wipe of a node (kill -9, memory dir emptied, restarted), S3 stopped and
restarted, a flipped byte in a memory copy, and (full runs only) the loss of every node.

After each one, once the cluster healed (a checkpoint begun after the injection is
REPLICATED or DURABLE on every node; the wait is the time to heal), it checks: every
checkpoint listed on any node loads bit-exact (sampled: new ones, the newest from every
node, older ones at random; at the end the newest 20 and 20 others); the newest REPLICATED one before a node
loss loads after it; the newest DURABLE one before losing every node loads after it;
no listed checkpoint misses a file; no node's budget is ever exceeded (sampled every
second, and on disk at each check). A listed checkpoint that does not load is, in turn:
`data intact` when stock DCP loads it bit-exact from S3 (a bug of the load path, no
loss); `partial` when the job's save of it had failed (a half save listed as committed);
`listed-but-lost` when a memory wipe took the last copy of one of its files before it
was REPLICATED or DURABLE (a loss the product never promised to survive) but it is still
listed COMMITTED (the honest state, issue 12 point 3, lists it LOST); otherwise LOST.
A checkpoint a node lists LOST is honest when such a wipe took it (its load must raise
the "lost" error, not a checksum error), a partial when its save failed, otherwise LOST.

    python bench/chaos.py --duration 600            # the full run
    python bench/chaos.py --quick --json out.json   # the smoke (tests/integration)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE.parent), str(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _chaos_cluster import NS, WORLD, ChaosCluster  # noqa: E402
from _chaos_ranks import index_of  # noqa: E402
from tierckptd.ops.faults import POINTS  # noqa: E402

from tests.support.daemon_process import DaemonStartError  # noqa: E402

HEAL_TIMEOUT = 60.0
FIRE_WINDOW = 15.0
ACTIONS = ("kill", "error", "delay=2")
# Where each point can fire: node 0 coordinates (commit, publish, .metadata), nodes 0
# and 1 run a rank each (saves, their files' drain and replication), node 2 holds copies.
_COORDINATOR = ("commit.", "peer.holdings", "peer.publish", "drain.metadata", "drain.after")
_RANK_NODES = ("save.", "pool.", "drain.", "peer.push.chunk", "peer.offer", "retention.")
# Points a verification load makes fire (a node fetching, or serving, a file).
_NEEDS_LOADS = ("peer.fetch.chunk", "peer.serve.chunk")
# The smoke's plan: (kind, fault spec, node), only what the system survives today. Node
# 2 runs no rank (it holds copies): a kill -9 of node 0 or 1 right after a commit can
# lose or half-list the newest checkpoint today (a node that missed the publish collects
# its files of that save as unfinished), so the smoke injects its kills there.
QUICK_PLAN: tuple[tuple[str, str, int | None], ...] = (
    ("fault", "peer.receive.offered:kill@2", 2),
    ("s3_outage", "", None),
    ("bitflip", "", None),
    ("daemon_kill", "", 2),
)
# A full run draws its kinds from shuffled rounds of this bag (every kind shows up in
# every round of 10 injections, fault points most often).
KINDS = {"fault": 4, "daemon_kill": 1, "rank_kill": 1, "wipe": 1, "s3_outage": 1, "bitflip": 1}
KINDS_EVERY_OTHER_ROUND = ("lose_all",)


def nodes_for(point: str) -> tuple[int, ...]:
    if point.startswith(_COORDINATOR):
        return (0,)
    if point.startswith(_RANK_NODES):
        return (0, 1)
    return (0, 1, 2)


class Chaos(ChaosCluster):
    """The injections and the invariants, on a `ChaosCluster`."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(
            rank_bytes=args.rank_bytes, pause=args.pause, budget=args.budget, seed=args.seed
        )
        self.rng = random.Random(args.seed)
        self.sample = 0 if args.quick else 3  # the smoke loads the new and newest only
        self.final_sample = 3 if args.quick else 20
        self.outage = (3.0, 3.0) if args.quick else (3.0, 8.0)
        self.injections: Counter[str] = Counter()
        self.points: dict[str, Counter[str]] = {}
        self.heal_times: list[float] = []
        self.heal_timeouts = 0
        self.repairs = 0
        self.flips = 0
        self.single_loss_checks = 0
        self.all_loss_checks = 0
        self._cycle = [(p, a) for a in ACTIONS for p in sorted(POINTS)]
        self.rng.shuffle(self._cycle)

    # ---- injections ---------------------------------------------------------------------
    def inject(self, kind: str, spec: str = "", node: int | None = None) -> None:
        self.injections[kind] += 1
        since = self.last_index()
        if kind == "fault":
            self._fault(spec, node)
        elif kind == "daemon_kill":
            self._daemon_kill(node)
        else:
            getattr(self, f"_{kind}")()
        healed = self.wait_heal(since, HEAL_TIMEOUT)
        if healed is None:
            self.heal_timeouts += 1
            self.note(f"{kind} {spec}: not healed within {HEAL_TIMEOUT:.0f} s")
        else:
            self.heal_times.append(healed)
        self.check(f"after {kind} {spec}".strip())

    def _fault(self, spec: str = "", node: int | None = None) -> None:
        """Restart a node with the point armed, wait for it to fire (a load makes the
        fetch/serve points fire), then restart it clean if it died or never fired."""
        if not spec:
            point, action = self._cycle[self.injections["fault"] % len(self._cycle)]
            spec = f"{point}:{action}@{self.rng.randint(1, 3)}"
        point, action = spec.split(":")[0], spec.split(":")[1].split("@")[0].split("=")[0]
        node = self.rng.choice(nodes_for(point)) if node is None else node
        d = self.nodes[node]
        d.kill9()
        offset = self.log_size(node)
        try:
            self.start_node(node, fault=spec)
        except DaemonStartError:
            pass  # it fired while adopting (adopt.checkpoint), or the start failed
        fired = False
        deadline = time.monotonic() + FIRE_WINDOW
        pokes = 0
        while time.monotonic() < deadline:
            fired = f"fault {point} fires" in self.log_since(node, offset)
            if fired or not d.running:
                break
            self.keep_job_alive()
            if point in _NEEDS_LOADS:
                others = [i for i in range(len(self.nodes)) if i != node]
                self.poke(node if pokes % 2 == 0 else self.rng.choice(others))
                pokes += 1
            time.sleep(0.3)
        if fired and action == "kill":
            stop = time.monotonic() + 10.0
            while d.running and time.monotonic() < stop:
                time.sleep(0.05)  # it logged the line; SIGKILL follows at once
        if fired and action == "delay":
            time.sleep(2.5)
        if d.running and not fired:
            d.kill9()  # disarm: restart it clean
        if not d.running:
            self.start_node(node)
        self.points.setdefault(f"{point}:{action}", Counter())["fired" if fired else "idle"] += 1

    def _daemon_kill(self, node: int | None = None) -> None:
        i = self.rng.randrange(len(self.nodes)) if node is None else node
        self.nodes[i].kill9()
        time.sleep(self.rng.uniform(0.0, 2.0))
        self.start_node(i)

    def _rank_kill(self) -> None:
        self.kill_rank(self.rng.randrange(WORLD))
        self.keep_job_alive()

    def _wipe(self) -> None:
        before = self.snapshot()
        newest_replicated = max((c for c, s in before.items() if s[0]), key=index_of, default=None)
        i = self.rng.randrange(len(self.nodes))
        self.at_risk |= self.only_copies_on([i])
        self.nodes[i].kill9()
        shutil.rmtree(self.nodes[i].memory_dir, ignore_errors=True)
        self.start_node(i)
        if newest_replicated is not None:
            self.single_loss_checks += 1
            self.wait_heal(self.last_index(), HEAL_TIMEOUT)
            self.verify(newest_replicated, i, "newest REPLICATED after a node loss")

    def _lose_all(self) -> None:
        before = self.snapshot()
        newest_durable = max((c for c, s in before.items() if s[1]), key=index_of, default=None)
        self.at_risk |= self.only_copies_on(list(range(len(self.nodes))))
        for d in self.nodes:
            d.kill9()
            shutil.rmtree(d.memory_dir, ignore_errors=True)
        for i in range(len(self.nodes)):
            self.start_node(i)
        if newest_durable is not None:
            self.all_loss_checks += 1
            for i in range(len(self.nodes)):
                self.verify(newest_durable, i, "newest DURABLE after losing every node")

    def _s3_outage(self) -> None:
        self.moto.stop()
        deadline = time.monotonic() + self.rng.uniform(*self.outage)
        while time.monotonic() < deadline:
            self.keep_job_alive()
            time.sleep(0.3)
        self.moto.restart()

    def _bitflip(self) -> None:
        ls = self.listings()
        # Another copy exists: a replica, or the persistent tier.
        safe = sorted(
            (c for c, (rep, dur) in self.snapshot(ls).items() if rep or dur), key=index_of
        )
        targets = [
            (c, i, p)
            for c in safe[-3:]
            for i in range(len(self.nodes))
            for p in sorted(self.nodes[i].data_dir(NS, c).glob("*"))
            if p.is_file() and p.stat().st_size > 0
        ]
        if not targets:
            self.note("bitflip: no REPLICATED checkpoint with a memory copy to corrupt")
            return
        checkpoint, node, path = self.rng.choice(targets)
        data = path.read_bytes()
        offset = self.rng.randrange(len(data))
        os.chmod(path, 0o600)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes([data[offset] ^ 0x40]))
        self.flips += 1
        if self.verify(checkpoint, node, "load of a flipped copy"):
            time.sleep(1.0)
            if not path.exists() or path.read_bytes() == data:
                self.repairs += 1
            else:
                self.note(f"bitflip: {path.name} of {checkpoint} on node {node} still corrupt")

    # ---- the run ------------------------------------------------------------------------
    def run(
        self, plan: list[tuple[str, str, int | None]] | None, count: int, duration: float
    ) -> None:
        started = time.monotonic()
        self.start_job()
        self.wait_first_save(HEAL_TIMEOUT * 2)
        print(f"[{time.monotonic() - started:6.1f}s] ready: the first checkpoint is replicated")
        bag: list[str] = []
        rounds = 0
        done = 0
        while True:
            if plan is not None:
                if done >= len(plan):
                    break
                kind, spec, node = plan[done]
            else:
                if (count and done >= count) or (
                    duration and time.monotonic() - started >= duration
                ):
                    break
                if not bag:
                    bag = [k for k, n in KINDS.items() for _ in range(n)]
                    bag += list(KINDS_EVERY_OTHER_ROUND) if rounds % 2 else []
                    self.rng.shuffle(bag)
                    rounds += 1
                kind, spec, node = bag.pop(), "", None
            self.inject(kind, spec, node)
            done += 1
            print(f"[{time.monotonic() - started:6.1f}s] {done:4d} {kind:12s} {self.line()}")
        self.final_sweep()
        print(f"[{time.monotonic() - started:6.1f}s] final sweep done")

    def report(self) -> dict[str, Any]:
        heal = sorted(self.heal_times)
        return {
            "injections": dict(self.injections),
            "fault_points": {k: dict(v) for k, v in sorted(self.points.items())},
            "points_fired": sorted({k.split(":")[0] for k, v in self.points.items() if v["fired"]}),
            "saves_completed": self.saves_ok,
            "saves_failed": self.saves_failed,
            "job_restarts": self.job_restarts,
            "checkpoints_verified": len(self.verified_ids),
            "loads_verified": self.loads_ok,
            "lost": sorted(self.lost),
            "listed_committed_but_lost": sorted(self.gap),
            "listed_lost_unprotected": sorted(self.shown_lost),
            "lost_loads_named_lost": self.lost_errors_named,
            "partial_listed": sorted(self.partial),
            "listed_with_another_file_set": sorted(self.odd_layouts),
            "load_failures_data_intact_in_s3": sorted(self.intact),
            "load_failures_served_by_another_node": sorted(self.elsewhere),
            "retired_by_persistent_retention_while_listed": len(self.retired_seen),
            "budget_violations": self.budget_violations,
            "budget_peak_fraction": round(self.budget_peak, 3),
            "repairs": {"flipped_bytes": self.flips, "repaired": self.repairs},
            "single_node_loss_checks": self.single_loss_checks,
            "all_nodes_loss_checks": self.all_loss_checks,
            "heal_seconds": {
                "count": len(heal),
                "median": round(statistics.median(heal), 2) if heal else None,
                "max": round(heal[-1], 2) if heal else None,
                "timeouts": self.heal_timeouts,
            },
            "notes": self.notes[-50:],
            "failures": self.failures[-20:],
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of injections")
    p.add_argument("--injections", type=int, default=0, help="stop after this many (0: none)")
    p.add_argument("--quick", action="store_true", help="the smoke: a fixed, survivable plan")
    p.add_argument("--seed", type=int, default=0, help="0: a random seed (printed)")
    p.add_argument("--rank-bytes", type=int, default=1 << 20, help="bytes each rank saves")
    p.add_argument("--pause", type=float, default=1.0, help="seconds between saves")
    p.add_argument("--budget", default="512MiB", help="each daemon's [memory] budget")
    p.add_argument("--json", type=Path, help="write the figures here too")
    p.add_argument("--logs", type=Path, help="copy the daemons' logs into this directory")
    args = p.parse_args(argv)
    args.seed = args.seed or random.randrange(1, 2**31)
    if args.quick:
        args.rank_bytes, args.pause = min(args.rank_bytes, 256 << 10), min(args.pause, 0.5)
    print(f"chaos: seed {args.seed}, {'quick' if args.quick else f'{args.duration:.0f} s'}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop every daemon on the way
    begun = time.monotonic()
    chaos = Chaos(args)
    print(f"cluster up in {time.monotonic() - begun:.1f} s")
    try:
        chaos.run(list(QUICK_PLAN) if args.quick else None, args.injections, args.duration)
        figures = chaos.report()
    finally:
        closing = time.monotonic()
        chaos.close(args.logs)
        print(f"torn down in {time.monotonic() - closing:.1f} s")
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    ok = not any(
        figures[k]
        for k in ("lost", "partial_listed", "listed_committed_but_lost", "budget_violations")
    )
    print("invariants held" if ok else "INVARIANTS VIOLATED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
