"""Network chaos (issue 28): bench/chaos.py's checks on 4 tierckptd nodes, each in its own
network namespace of a `Testbed` (two racks, `copies = 1`, draining to moto S3 on a host
of its own), with network faults injected around a 2-rank job that saves in a loop.

Fault kinds (tests/support/testbed.py does the cutting):
    node_cut        a node's cable pulled
    rack_cut        rack a and rack b cannot reach each other (each reaches S3)
    one_way_cut     a node's (or a rack's) packets to the others lost, theirs delivered
    flap            a node's link down and up every 0.3-1 s
    freeze          a daemon SIGSTOPped: its sockets open, nothing answered
    slow_link       a node's link at 2 MB/s each way (tbf)
    s3_cut          the S3 host's cable pulled (an S3 outage by the network)
    member_change   a node cut, and meanwhile another node of its rack replaced by an
                    empty one (kill -9, memory wiped, restarted): membership changes
                    during the cut, within one failure domain

Moments (each fault is injected at one, drawn in shuffled rounds):
    save            while a save writes (the job's next save begun)
    commit          the moment the coordinator lists a new checkpoint (its publish and
                    replication starting)
    replication     a new checkpoint listed but not yet REPLICATED on its coordinator
    drain           a checkpoint REPLICATED but not yet DURABLE on its coordinator
    heal            right after a 1.5 s cut of another node healed, while the healer
                    re-replicates what was saved during it
    random          after a random 0-3 s

Each fault is held 1-3 s (`--hold`; the job saving on); meanwhile the newest REPLICATED or
DURABLE checkpoint is restored through a node that is neither frozen nor itself cut off
(through a cut-off node a restore can only name the sources it cannot reach), bit-exact, and timed
(the restore time under that fault kind; the checkpoint is one replicated when the fault
began: under a cut it is listed under-replicated, its unreachable holder waited for
`replace_after` before it is replaced, and it loads from its other copies). Then the fault heals and the runner measures
convergence: the seconds until every checkpoint begun since the injection is listed on
every node REPLICATED or DURABLE (heal rounds: those seconds over `heal_interval`, 1 s,
rounded up). Then bench/chaos.py's checks run (every listed checkpoint checked bit-exact
as sampled there, a failure classified as there; `--check-every N`: after every Nth
injection only), and every listing is checked for
honesty: a file of a checkpoint listed REPLICATED must be on disk on its owner and on
every replica node listed for it (read twice, 1.5 s apart, to let an eviction settle).

    python bench/net_chaos.py --injections 300 --json bench/results/net_chaos_300.json
    python bench/net_chaos.py --quick --json out.json   # the smoke: 2 cuts (tests/integration)

SIGTERM stops the run after the injection in flight; the final sweep and the report follow.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE.parent), str(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _chaos_cluster import NS, durable, replicated  # noqa: E402
from _chaos_ranks import index_of  # noqa: E402
from _net_chaos_cluster import NODES, RACKS, NetChaosCluster  # noqa: E402

from tests.support.testbed import Fault, TbfShape, TestbedUnavailable, unavailable_reason  # noqa: E402

KINDS = (
    "node_cut",
    "rack_cut",
    "one_way_cut",
    "flap",
    "freeze",
    "slow_link",
    "s3_cut",
    "member_change",
)
MOMENTS = ("save", "commit", "replication", "drain", "heal", "random")
COPIES = 1
HEAL_INTERVAL = 1.0  # [replication] heal_interval of every node (ChaosCluster.node_config)
MOMENT_TIMEOUT = 10.0
# How often the coordinator's listing is read while a moment is awaited, and every node's
# after a heal: each read is a listing RPC the 2-core machine's daemons serve. At 20 ms and
# 100 ms the runner took half a core and the daemons a third of one each (stop 34).
MOMENT_POLL = 0.05
CONVERGE_POLL = 0.25
# Where an injection's seconds go (reported: what bounds the injections per hour).
PHASES = ("moment", "fault", "convergence", "checks")
SLOW = TbfShape(rate=2_000_000)  # 16 Mbit/s: a 1 MiB message well within the fetch stall
BASE = TbfShape(rate=100_000_000 // 8)  # every link at 100 Mbit/s: replication takes time
# The smoke's plan: one of each cut kind, each at a moment of its own.
QUICK_PLAN: tuple[tuple[str, str], ...] = (
    ("node_cut", "commit"),
    ("freeze", "replication"),
)


def _stats(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "median": round(statistics.median(ordered), 2) if ordered else None,
        "max": round(ordered[-1], 2) if ordered else None,
    }


class NetChaos(NetChaosCluster):
    """The network injections and their measurements, on a `NetChaosCluster`."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(
            rank_bytes=args.rank_bytes,
            pause=args.pause,
            budget=args.budget,
            seed=args.seed,
            shape=BASE,
        )
        self.rng = random.Random(args.seed)
        self.sample = 0 if args.quick else 1
        self.final_sample = 3 if args.quick else 10
        low, _, high = args.hold.partition(",")
        self.hold = (1.0, 1.5) if args.quick else (float(low), float(high or low))
        self.isolated: set[int] = set()  # nodes cut off from the others now
        self.phase_s: dict[str, list[float]] = {p: [] for p in PHASES}
        self.converge_timeout = args.converge_timeout
        self.check_every = max(1, args.check_every)
        self.injections: Counter[str] = Counter()
        self.moments: dict[str, Counter[str]] = {}
        self.restore_s: dict[str, list[float]] = {k: [] for k in KINDS}
        self.restore_failures: dict[str, list[str]] = {k: [] for k in KINDS}
        self.converge_s: dict[str, list[float]] = {k: [] for k in KINDS}
        self.converge_timeouts: Counter[str] = Counter()
        self.dishonest: set[str] = set()
        self.dishonest_detail: list[str] = []
        # Listed REPLICATED on the names of holders whose retention let their copies go:
        # the checkpoint is DURABLE (they list it so, its .metadata in S3 when checked) or
        # retired by both retention windows (gone from the holders' listings, outside
        # `persistent_keep_last`). The written exception to promise 2: the seconds until
        # the listing node learns it (docs/reliability.md).
        self.lagging_retention: set[str] = set()
        self.honesty_checks = 0

    # ---- moments ----------------------------------------------------------------------
    def _coordinator_rows(self) -> dict[str, Any]:
        try:
            return {c.checkpoint_id: c for c in self.clients[0].list_checkpoints(NS)}
        except Exception:  # noqa: BLE001 - restarting or frozen: nothing seen now
            return {}

    def _outcome_count(self) -> int:
        return len(self._outcomes()) if self.job is not None else 0

    def _wait_new(self, test: Any) -> bool:
        """Poll the coordinator every MOMENT_POLL seconds until `test(info)` holds for a
        checkpoint it did not list at the start; False after MOMENT_TIMEOUT."""
        seen = set(self._coordinator_rows())
        deadline = time.monotonic() + MOMENT_TIMEOUT
        while time.monotonic() < deadline:
            rows = self._coordinator_rows()
            if any(test(info) for c, info in rows.items() if c not in seen):
                return True
            time.sleep(MOMENT_POLL)
        self.keep_job_alive()
        return False

    def wait_moment(self, moment: str) -> bool:
        """Return at `moment` (see the module docstring); whether it was seen."""
        if moment == "save":
            before = self._outcome_count()
            deadline = time.monotonic() + MOMENT_TIMEOUT
            while self._outcome_count() == before and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(self.plan.pause + 0.05)  # the next save is writing now
            return self._outcome_count() == before + 1
        if moment == "commit":
            return self._wait_new(lambda info: True)
        if moment == "replication":
            return self._wait_new(lambda info: not replicated(info) and not durable(info))
        if moment == "drain":
            return self._wait_new(lambda info: replicated(info) and not durable(info))
        if moment == "heal":
            node = self.bed.nodes[self.rng.randrange(NODES)]
            with self.bed.cut_node(node):
                self._hold(1.5)
            listed = self.listings()
            return any(
                not replicated(info) and not durable(info)
                for rows in listed.values()
                for info in rows.values()
            )
        time.sleep(self.rng.uniform(0.0, 3.0))
        return True

    # ---- faults -----------------------------------------------------------------------
    def make_fault(self, kind: str) -> Fault:
        bed, rng = self.bed, self.rng
        node = bed.nodes[rng.randrange(NODES)]
        if kind in ("node_cut", "flap", "member_change"):
            self.isolated.add(node.index)  # a restore through it only proves it is cut off
        if kind == "node_cut":
            return bed.cut_node(node)
        if kind == "rack_cut":
            return bed.cut_rack("a", "b")
        if kind == "one_way_cut":
            if rng.random() < 0.5:
                return bed.cut_one_way(bed.rack("a"), bed.rack("b"))
            self.isolated.add(node.index)
            return bed.cut_one_way([node], [n for n in bed.nodes[:NODES] if n is not node])
        if kind == "flap":
            return bed.flap(node, rng.uniform(0.3, 1.0), rng.uniform(0.3, 1.0))
        if kind == "freeze":
            self.frozen.add(node.index)  # not listed nor restored through while frozen
            return bed.freeze(self.nodes[node.index].pid)
        if kind == "slow_link":
            return bed.slow_link(node, SLOW)
        if kind == "s3_cut":
            return bed.cut_node(self.s3_host)
        if kind == "member_change":
            fault = bed.cut_node(node)
            mates = [n.index for n in bed.nodes[:NODES] if n.rack == node.rack and n is not node]
            j = rng.choice(mates)
            self.at_risk |= self.only_copies_on([j])
            self.nodes[j].kill9()
            shutil.rmtree(self.nodes[j].memory_dir, ignore_errors=True)
            self.start_node(j)
            return fault
        raise ValueError(f"unknown fault kind {kind!r}")

    def _hold(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.keep_job_alive()
            time.sleep(0.1)

    def restore_under(self, kind: str, state: dict[str, tuple[bool, bool]]) -> None:
        """Restore the newest checkpoint that was REPLICATED or DURABLE when the fault
        began (`state`; under a cut it is listed under-replicated until its unreachable
        holder is back or replaced, and loads from its other copies) through a node that
        is neither frozen nor itself cut off from the others, bit-exact, timed."""
        ready = sorted((c for c, (rep, dur) in state.items() if rep or dur), key=index_of)
        ready = [c for c in ready if c not in self.failed()]
        out = self.frozen | self.isolated
        candidates = [i for i in range(NODES) if i not in out and self.nodes[i].running]
        if not ready or not candidates:
            return
        checkpoint, i = ready[-1], self.rng.choice(candidates)
        started = time.monotonic()
        error = self.loader.load(checkpoint, self.nodes[i].address)
        elapsed = time.monotonic() - started
        if error:
            self.restore_failures[kind].append(f"{checkpoint} via n{i}: {error[-300:]}")
            self.note(f"restore under {kind} failed: {checkpoint} via n{i}: {error[-200:]}")
        else:
            self.restore_s[kind].append(elapsed)
            self.loads_ok += 1
            self.verified_ids.add(checkpoint)

    # ---- after the heal ---------------------------------------------------------------
    def converge(self, since: int, until: int) -> float | None:
        """Seconds until every checkpoint begun from `since` to `until` (the injection to
        the heal) that any node lists is listed on every node, REPLICATED or DURABLE there
        (None: not within the timeout); later saves are not the fault's to heal."""
        started = time.monotonic()
        behind: list[str] = []
        while time.monotonic() - started < self.converge_timeout:
            self.keep_job_alive()
            ls = self.listings()
            ids = {c for rows in ls.values() for c in rows if since <= index_of(c) <= until}
            behind = [f"n{i} does not answer" for i in range(NODES) if i not in ls]
            behind += [
                f"n{i}: {c} " + (f"{rows[c].state} {rows[c].tiers}" if c in rows else "unlisted")
                for c in sorted(ids, key=index_of)
                for i, rows in ls.items()
                if c not in rows or not (replicated(rows[c]) or durable(rows[c]))
            ]
            if not behind:
                return time.monotonic() - started
            time.sleep(CONVERGE_POLL)
        self.note(f"not converged: {behind[:6]}")
        return None

    def _lacking(self) -> dict[tuple[int, str, str], tuple[list[str], list[str]]]:
        """(node, checkpoint, file) of every listing that says REPLICATED (not DURABLE)
        for a file some listed holder lacks on disk: what it lacks."""
        names = {d.name: d for d in self.nodes}
        out: dict[tuple[int, str, str], str] = {}
        for i, rows in self.listings().items():
            for c, info in rows.items():
                if info.state != "REPLICATED" or durable(info):
                    continue
                for f in info.files:
                    holders = [h for h in (f.owner_node, *f.replica_nodes) if h]
                    present = [
                        h
                        for h in holders
                        if h in names and (names[h].data_dir(NS, c) / f.name).is_file()
                    ]
                    if len(present) < COPIES + 1:
                        out[(i, c, f.name)] = (holders, present)
        return out

    def check_honesty(self, label: str) -> None:
        self.honesty_checks += 1
        first = self._lacking()
        if not first:
            return
        time.sleep(1.5)  # an eviction or a trim in flight settles; a lie stays
        # A listing may name more holders than copies + 1 (a surplus copy trimmed since):
        # dishonest is fewer than copies + 1 copies on disk, not a stale extra name.
        ls = self.listings()
        names = {d.name: i for i, d in enumerate(self.nodes)}
        for key, (holders, present) in self._lacking().items():
            if key in first:
                node, checkpoint, name = key
                why = f"listed on {holders}, on disk on {present}"
                gone = [names[h] for h in holders if h not in present and h in names]
                durable_there = all(
                    checkpoint in ls.get(h, {}) and durable(ls[h][checkpoint]) for h in gone
                )
                retired_there = all(checkpoint not in ls.get(h, {}) for h in gone)
                if (durable_there and self._in_s3(checkpoint)) or (
                    retired_there and self.retired_by_policy(checkpoint)
                ):
                    if checkpoint not in self.lagging_retention:
                        self.note(f"n{node} lists {checkpoint} REPLICATED after retention: {why}")
                    self.lagging_retention.add(checkpoint)
                    continue
                self.dishonest.add(checkpoint)
                self.dishonest_detail.append(
                    f"{label}: n{node} lists {checkpoint} REPLICATED; {name}: {why}"
                )
                self.note(f"dishonest listing: n{node} {checkpoint} {name}: {why}")

    # ---- one injection, the run -------------------------------------------------------
    def inject(self, kind: str, moment: str) -> None:
        self.injections[kind] += 1
        since = self.last_index()
        clock = time.monotonic()
        hit = self.wait_moment(moment)
        clock = self._phase("moment", clock)
        self.moments.setdefault(moment, Counter())["seen" if hit else "timed out"] += 1
        before = self.snapshot()
        fault = self.make_fault(kind)
        try:
            held = time.monotonic() + self.rng.uniform(*self.hold)
            self.restore_under(kind, before)
            self._hold(held - time.monotonic())
        finally:
            fault.heal()
            self.frozen.clear()
            self.isolated.clear()
        clock = self._phase("fault", clock)
        took = self.converge(since, self.last_index())
        clock = self._phase("convergence", clock)
        if took is None:
            self.converge_timeouts[kind] += 1
            self.note(
                f"{kind}@{moment}: not converged {self.converge_timeout:.0f} s after the heal"
            )
        else:
            self.converge_s[kind].append(took)
        label = f"after {kind}@{moment}"
        self.check_honesty(label)
        if sum(self.injections.values()) % self.check_every == 0:
            self.check(label)
        self._phase("checks", clock)

    def _phase(self, phase: str, since: float) -> float:
        now = time.monotonic()
        self.phase_s[phase].append(now - since)
        return now

    def run(
        self,
        plan: list[tuple[str, str]] | None,
        count: int,
        duration: float,
        stopped: Callable[[], bool] = lambda: False,
    ) -> None:
        started = time.monotonic()
        self.start_job()
        self.wait_first_save(120.0)
        print(f"[{time.monotonic() - started:6.1f}s] ready: the first checkpoint is replicated")
        kinds: list[str] = []
        moments: list[str] = []
        done = 0
        while not stopped():
            if plan is not None:
                if done >= len(plan):
                    break
                kind, moment = plan[done]
            else:
                if (count and done >= count) or (
                    duration and time.monotonic() - started >= duration
                ):
                    break
                if not kinds:
                    kinds = list(KINDS)
                    self.rng.shuffle(kinds)
                if not moments:
                    moments = list(MOMENTS)
                    self.rng.shuffle(moments)
                kind, moment = kinds.pop(), moments.pop()
            self.inject(kind, moment)
            done += 1
            print(
                f"[{time.monotonic() - started:6.1f}s] {done:4d} {kind:13s} @{moment:11s} "
                f"{self.line()} dishonest {len(self.dishonest)}"
            )
        self.final_sweep()
        print(f"[{time.monotonic() - started:6.1f}s] final sweep done")

    def report(self) -> dict[str, Any]:
        convergence = {}
        for kind in KINDS:
            seconds = self.converge_s[kind]
            rounds = [math.ceil(s / HEAL_INTERVAL) for s in seconds]
            convergence[kind] = {
                "seconds": _stats(seconds),
                "heal_rounds": _stats([float(r) for r in rounds]),
                "timeouts": self.converge_timeouts[kind],
            }
        return {
            "nodes": NODES,
            "racks": list(RACKS),
            "copies": COPIES,
            "injections": dict(self.injections),
            "network_injections": sum(self.injections.values()),
            "moments": {k: dict(v) for k, v in sorted(self.moments.items())},
            "checkpoints_completed": self.saves_ok,
            "saves_failed": self.saves_failed,
            "job_restarts": self.job_restarts,
            "checkpoints_verified_bit_exact": len(self.verified_ids),
            "loads_verified": self.loads_ok,
            "lost": sorted(self.lost),
            "listed_dishonestly": sorted(self.dishonest),
            "dishonest_detail": self.dishonest_detail[-20:],
            "honesty_checks": self.honesty_checks,
            "listed_replicated_after_retention": sorted(self.lagging_retention),
            "listed_committed_but_lost": sorted(self.gap),
            "listed_lost_unprotected": sorted(self.shown_lost),
            "partial_listed": sorted(self.partial),
            "load_failures_data_intact_in_s3": sorted(self.intact),
            "load_failures_served_by_another_node": sorted(self.elsewhere),
            "budget_violations": self.budget_violations,
            "restore_seconds": {k: _stats(v) for k, v in self.restore_s.items()},
            "restore_failures_under_fault": {
                k: {"count": len(v), "last": v[-3:]} for k, v in self.restore_failures.items()
            },
            "convergence_after_heal": convergence,
            "seconds_per_injection_by_phase": {p: _stats(v) for p, v in self.phase_s.items()},
            "notes": self.notes[-50:],
            "failures": self.failures[-20:],
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=0.0, help="seconds of injections (0: none)")
    p.add_argument("--injections", type=int, default=300, help="stop after this many (0: none)")
    p.add_argument("--quick", action="store_true", help="the smoke: a fixed plan of 4 cuts")
    p.add_argument(
        "--converge-timeout", type=float, default=45.0, help="seconds to wait after a heal"
    )
    p.add_argument("--plan", default="", help="kind@moment,... instead of drawn ones")
    p.add_argument("--hold", default="1.0,3.0", help="seconds a fault is held: low,high")
    p.add_argument(
        "--check-every",
        type=int,
        default=1,
        help="bench/chaos.py's sampled bit-exact checks after every Nth injection (the "
        "honesty check and the restore under the fault run after every one; the final "
        "sweep checks every listed checkpoint)",
    )
    p.add_argument("--seed", type=int, default=0, help="0: a random seed (printed)")
    p.add_argument("--rank-bytes", type=int, default=1 << 20, help="bytes each rank saves")
    p.add_argument("--pause", type=float, default=2.0, help="seconds between saves")
    p.add_argument("--budget", default="512MiB", help="each daemon's [memory] budget")
    p.add_argument("--json", type=Path, help="write the figures here too")
    p.add_argument("--note", default="", help="a line recorded in the figures (the machine)")
    p.add_argument("--logs", type=Path, help="copy the daemons' logs into this directory")
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"net_chaos: no testbed here: {reason}")
        return 2
    args.seed = args.seed or random.randrange(1, 2**31)
    if args.quick:
        args.rank_bytes, args.pause = min(args.rank_bytes, 256 << 10), min(args.pause, 1.0)
        args.converge_timeout = min(args.converge_timeout, 20.0)
    print(f"net_chaos: seed {args.seed}, {'quick' if args.quick else 'full'}")
    # SIGTERM ends the run after the injection in flight: the final sweep, the report and
    # the teardown still run (a second SIGTERM exits at once, stopping every daemon).
    stopping: list[bool] = []

    def stop(*_: object) -> None:
        if stopping:
            sys.exit(143)
        stopping.append(True)
        print("net_chaos: SIGTERM: stopping after this injection (again: at once)", flush=True)

    signal.signal(signal.SIGTERM, stop)
    begun = time.monotonic()
    try:
        chaos = NetChaos(args)
    except TestbedUnavailable as e:
        print(f"net_chaos: no testbed here: {e}")
        return 2
    print(f"cluster up in {time.monotonic() - begun:.1f} s")
    try:
        plan = [tuple(x.split("@")) for x in args.plan.split(",")] if args.plan else None
        plan = list(QUICK_PLAN) if args.quick and plan is None else plan
        chaos.run(plan, args.injections, args.duration, lambda: bool(stopping))  # type: ignore[arg-type]
        figures = chaos.report()
    finally:
        closing = time.monotonic()
        chaos.close(args.logs)
        print(f"torn down in {time.monotonic() - closing:.1f} s")
    figures = {
        "command": "python bench/net_chaos.py " + " ".join(argv or sys.argv[1:]),
        "seed": args.seed,
        "seconds": round(time.monotonic() - begun, 1),
        "note": args.note,
        **figures,
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    ok = not any(
        figures[k]
        for k in (
            "lost",
            "listed_dishonestly",
            "partial_listed",
            "listed_committed_but_lost",
            "budget_violations",
        )
    )
    print("invariants held" if ok else "INVARIANTS VIOLATED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
