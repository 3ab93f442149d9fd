"""The world bench/chaos.py breaks: 3 tierckptd nodes on loopback peering with copies =
1, a moto S3 server they drain to, the saving job, a loader in a process of its own,
and the bookkeeping of what was verified, lost, or never promised.

The nodes reuse tests/support's `DaemonProcess` (kill -9 and restart on the same memory
dir); every node serves metrics and drains to the same bucket.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import s3fs
from _chaos_ranks import ChaosPlan, chaos_rank, index_of, verifier_main
from tierckpt.daemon_client import CheckpointInfo, DaemonClient
from tierckptd.ops.faults import ENV as FAULT_ENV

from tests.support.daemon_process import DaemonProcess
from tests.support.dist_job import DistJob, start_job
from tests.support.moto_s3 import (
    AWS_UNSET,
    BUCKET,
    FAST_FAIL_CONFIG,
    MotoServer,
    aws_environment,
)
from tests.support.ports import free_ports

__all__ = ["NS", "WORLD", "ChaosCluster", "durable", "replicated"]

NS = "chaos"
WORLD = 2
NODES = 3
EPOCH = 100_000  # checkpoint indexes of job restart k start at k * EPOCH + 1
JOB_STALL = 90.0  # a job with no save outcome for this long is restarted
LOAD_TIMEOUT = 60.0


def replicated(info: CheckpointInfo) -> bool:
    """Every file has a copy on a node other than its owner, and the healer has no mark."""
    return (
        bool(info.files)
        and "under-replicated" not in info.tiers
        and "lost" not in info.tiers
        and all(set(f.replica_nodes) - {f.owner_node} for f in info.files)
    )


def durable(info: CheckpointInfo) -> bool:
    return info.state == "DURABLE" or "persistent" in info.tiers


class Loader:
    """`verifier_main` in a spawned process: a load that hangs is killed, not waited on."""

    def __init__(self, rank_bytes: int) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._rank_bytes = rank_bytes
        self._start()

    def _start(self) -> None:
        self.conn, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(
            target=verifier_main, args=(child, NS, WORLD, self._rank_bytes), daemon=True
        )
        self.proc.start()

    def load(self, checkpoint: str, address: str, timeout: float = LOAD_TIMEOUT) -> str:
        """ "" when it loaded bit-exact, else why not."""
        self.conn.send((checkpoint, address))
        if self.conn.poll(timeout):
            status, value = self.conn.recv()
            return "" if status == "ok" else str(value)
        self.proc.kill()
        self.proc.join(10)
        self._start()
        return f"the load did not finish within {timeout:.0f} s"

    def close(self) -> None:
        try:
            self.conn.send(None)
            self.proc.join(5)
        finally:
            if self.proc.is_alive():
                self.proc.kill()


PERSISTENT_KEEP = 30  # [retention] persistent_keep_last of every node


class ChaosCluster:
    """Nodes, S3, the job and the verification bookkeeping (see the module docstring)."""

    def __init__(self, *, rank_bytes: int, pause: float, budget: str, seed: int) -> None:
        self._rng = random.Random(seed ^ 0x5EED)
        self.sample = 6  # older or new checkpoints a check loads at random
        self.final_sample = 20  # the final sweep: the newest this many, as many at random
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request
        self.moto = self.make_moto()
        for name in (*AWS_UNSET, FAULT_ENV):
            os.environ.pop(name, None)
        os.environ.update(aws_environment(self.moto.endpoint_url))
        options = {"endpoint_url": self.moto.endpoint_url, "config_kwargs": FAST_FAIL_CONFIG}
        self.s3 = s3fs.S3FileSystem(**options)
        self.s3.mkdir(BUCKET)
        self.retired_seen: set[str] = set()
        self.nodes: list[DaemonProcess] = self.make_nodes(budget, options)
        starting = [
            threading.Thread(target=self.start_node, args=(i,)) for i in range(len(self.nodes))
        ]
        for thread in starting:  # in parallel: each start waits for its health check
            thread.start()
        for thread in starting:
            thread.join()
        if not all(d.running for d in self.nodes):
            raise RuntimeError(
                "a node did not start:\n" + "\n".join(d.log_tail(20) for d in self.nodes)
            )
        self.clients = [DaemonClient(d.address, timeout_s=15) for d in self.nodes]
        self.plan = ChaosPlan(NS, tuple(d.address for d in self.nodes), rank_bytes, pause)
        self.loader = self.make_loader(rank_bytes)
        self.job: DistJob | None = None
        self.epoch = 0
        self.saves_ok = self.saves_failed = self.job_restarts = self.loads_ok = 0
        self.verified_ids: set[str] = set()
        self.saved: dict[int, str] = {}  # save index -> "ok" / "fail", as the job saw it
        self.intact: set[str] = set()  # failed to load through tierckpt, stock S3 load ok
        # failed to load through one node, bit-exact through another that lists it
        self.elsewhere: set[str] = set()
        self.lost: set[str] = set()
        self.gap: set[str] = set()  # listed COMMITTED, yet no copy of some file is left
        self.shown_lost: set[str] = set()  # listed LOST, lost at a loss never promised
        self.lost_errors_named = 0  # loads of those that raised the "lost" error
        self.at_risk: set[str] = set()  # neither REPLICATED nor DURABLE at a node loss
        self.partial: set[str] = set()
        self.files_expected: frozenset[str] | None = None
        self.odd_layouts: set[str] = set()  # listed with another file set than usual
        self.notes: list[str] = []
        self.failures: list[dict[str, str]] = []
        self.budget_violations: list[str] = []
        self.budget_peak = 0.0
        self._last_outcome = time.monotonic()
        self._outcome_dir = ""  # the job dir `_outcomes` has read, its names, what they say
        self._outcome_names: set[str] = set()
        self._outcome_found: dict[int, dict[int, str]] = {}
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_budget, daemon=True)
        self._sampler.start()

    # ---- construction hooks (bench/net_chaos.py puts the nodes in network namespaces) --
    def make_moto(self) -> MotoServer:
        return MotoServer()

    def make_loader(self, rank_bytes: int) -> Loader:
        return Loader(rank_bytes)

    @staticmethod
    def node_config(budget: str, options: dict[str, Any]) -> dict[str, Any]:
        """The tables every node shares (its id, listen addresses and peers aside)."""
        return {
            "memory": {"budget": budget, "abandon_after": 30.0},
            "replication": {"copies": 1, "heal_interval": 1.0},
            # S3 keeps the newest 30, as an operator would bound it: with every
            # checkpoint kept, each node lists them all and a replacement's start
            # (manifests pulled, durable adoption) grows with the job's history.
            "retention": {"memory_keep_last": 3, "persistent_keep_last": PERSISTENT_KEEP},
            "persistent": {
                "url": f"s3://{BUCKET}",
                "storage_options": options,
                "compression": "none",
                "relist_interval": 2.0,
            },
        }

    def make_nodes(self, budget: str, options: dict[str, Any]) -> list[DaemonProcess]:
        """NODES daemons on loopback, each peering with the others."""
        ports = free_ports(2 * NODES)
        ids = [f"c{i}" for i in range(NODES)]
        nodes = []
        for i in range(NODES):
            config: dict[str, Any] = {
                "node": {"id": ids[i], "failure_domain": f"rack{i}"},
                "listen": {"peer": f"127.0.0.1:{ports[i]}"},
                **self.node_config(budget, options),
                "metrics": {"listen": f"127.0.0.1:{ports[NODES + i]}"},
                "peers": [
                    {"id": ids[j], "address": f"127.0.0.1:{ports[j]}", "failure_domain": f"rack{j}"}
                    for j in range(NODES)
                    if j != i
                ],
            }
            nodes.append(DaemonProcess(config, name=ids[i], start=False))
        return nodes

    # ---- nodes --------------------------------------------------------------------------
    def start_node(self, i: int, fault: str = "") -> None:
        """Start node i on its memory dir, with `TIERCKPT_FAULT=fault` when given."""
        if fault:
            os.environ[FAULT_ENV] = fault
        try:
            # Generous: on a loaded 2-core machine a replacement that pulls and adopts
            # a few hundred manifests before it reports READY can take over 30 s.
            self.nodes[i].start(timeout=120.0)
        finally:
            os.environ.pop(FAULT_ENV, None)

    def log_size(self, i: int) -> int:
        try:
            return self.nodes[i].log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, i: int, offset: int) -> str:
        with open(self.nodes[i].log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def listings(self) -> dict[int, dict[str, CheckpointInfo]]:
        """Each answering node's committed checkpoints."""
        out: dict[int, dict[str, CheckpointInfo]] = {}
        for i, d in enumerate(self.nodes):
            if d.running:
                try:
                    out[i] = {c.checkpoint_id: c for c in self.clients[i].list_checkpoints(NS)}
                except Exception:  # noqa: BLE001 - a node restarting: not listed now
                    pass
        return out

    def snapshot(
        self, ls: dict[int, dict[str, CheckpointInfo]] | None = None
    ) -> dict[str, tuple[bool, bool]]:
        """{checkpoint: (REPLICATED on some node, DURABLE on some node)} as listed now."""
        out: dict[str, tuple[bool, bool]] = {}
        for rows in (self.listings() if ls is None else ls).values():
            for c, info in rows.items():
                rep, dur = out.get(c, (False, False))
                out[c] = (rep or replicated(info), dur or durable(info))
        return out

    def only_copies_on(self, lost: list[int]) -> set[str]:
        """Checkpoints that losing the memory of nodes `lost` takes the last copy of some
        file from, as listed now: neither REPLICATED nor DURABLE anywhere, a file whose
        every holder is among them and which one of them has on disk (a file gone
        earlier is not this loss's: a later failure to load it counts as LOST)."""
        names = {self.nodes[i].name: self.nodes[i] for i in lost}
        ls = self.listings()
        state = self.snapshot(ls)
        found: set[str] = set()
        for rows in ls.values():
            for c, info in rows.items():
                if any(state[c]):
                    continue
                for f in info.files:
                    holders = {f.owner_node, *f.replica_nodes} - {""}
                    if (
                        holders
                        and holders <= set(names)
                        and any((names[h].data_dir(NS, c) / f.name).exists() for h in holders)
                    ):
                        found.add(c)
        return found

    def _sample_budget(self) -> None:
        clients = [DaemonClient(d.address, timeout_s=5) for d in self.nodes]
        while not self._stop.wait(1.0):
            for d, client in zip(self.nodes, clients, strict=True):
                if not d.running:
                    continue
                try:
                    st = client.status()
                except Exception:  # noqa: BLE001 - restarting
                    continue
                held = st.used_bytes + st.reserved_bytes + st.pool_bytes
                self.budget_peak = max(self.budget_peak, held / st.budget_bytes)
                if held > st.budget_bytes:
                    self.budget_violations.append(f"{d.name}: {held} > {st.budget_bytes} bytes")
        for client in clients:
            client.close()

    @staticmethod
    def _allocated(directory: Path) -> int:
        """Bytes of the files under `directory`; what the daemon removes meanwhile (a
        retention eviction, a recycled segment) is skipped."""
        total = 0
        for root, _dirs, files in os.walk(directory):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:
                    continue
        return total

    def _disk_budget(self) -> None:
        for i, d in enumerate(self.nodes):
            total = sum(self._allocated(d.memory_dir / sub) for sub in ("data", "pool"))
            if d.running and total > self.clients[i].status().budget_bytes:
                self.budget_violations.append(f"{d.name}: {total} bytes on disk over budget")

    # ---- the job ------------------------------------------------------------------------
    def start_job(self) -> None:
        self.epoch += 1
        self.job = start_job(chaos_rank, WORLD, self.plan, self.epoch * EPOCH + 1, timeout=1e6)
        self._last_outcome = time.monotonic()

    def _outcomes(self) -> dict[int, dict[int, str]]:
        """{save index: {rank: "ok" | "fail"}} of the job's outcome files, read once each.

        Read-only for callers. The job writes two files per save and a long run keeps
        thousands; this is polled every 50 ms, so only names not seen before are parsed
        (re-reading all of them grew the runner's own CPU with every save and slowed the
        run it measures)."""
        assert self.job is not None
        if self._outcome_dir != self.job.job_dir:
            self._outcome_dir = self.job.job_dir
            self._outcome_names = set()
            self._outcome_found = {}
        fresh = [n for n in os.listdir(self._outcome_dir) if n not in self._outcome_names]
        for name in fresh:
            self._outcome_names.add(name)
            outcome, _, rest = name.partition(".")
            index, _, rank = rest.partition(".")
            if outcome in ("ok", "fail") and index.isdigit() and rank.startswith("rank"):
                self._outcome_found.setdefault(int(index), {})[int(rank[4:])] = outcome
                self._last_outcome = time.monotonic()
        return self._outcome_found

    def last_index(self) -> int:
        """The newest save index begun so far (later ones begin after this moment)."""
        return max(self._outcomes(), default=self.epoch * EPOCH) + 1

    def _harvest(self) -> None:
        for index, ranks in self._outcomes().items():
            ok = len(ranks) == WORLD and set(ranks.values()) == {"ok"}
            self.saved[index] = "ok" if ok else "fail"
            self.saves_ok += ok
            self.saves_failed += not ok

    def outcome(self, checkpoint: str) -> str:
        """How the job's save of `checkpoint` ended: "ok", "fail" or "" (unknown yet)."""
        index = index_of(checkpoint)
        if index in self.saved:
            return self.saved[index]
        ranks = self._outcomes().get(index, {}) if self.job is not None else {}
        if len(ranks) == WORLD:
            return "ok" if set(ranks.values()) == {"ok"} else "fail"
        return "fail" if "fail" in ranks.values() else ""

    def stop_job(self) -> None:
        if self.job is not None:
            Path(self.job.job_dir, "stop").write_text("")
            self.job.kill_all()
            self._harvest()
            self.job.cleanup()
            self.job = None

    def restart_job(self, why: str) -> None:
        self.note(f"job restarted: {why}")
        self.job_restarts += 1
        self.stop_job()
        self.start_job()

    def kill_rank(self, rank: int) -> None:
        assert self.job is not None
        self.job.kill_rank(rank)

    def keep_job_alive(self) -> None:
        if self.job is None:
            return  # stopped (the final sweep)
        ranks = self.job._context.processes  # noqa: SLF001 - DistJob has no liveness query
        dead = [r for r, proc in enumerate(ranks) if not proc.is_alive()]
        if dead:
            self.restart_job(f"rank {dead[0]} died")
            return
        self._outcomes()  # a new outcome file moves `_last_outcome`
        if time.monotonic() - self._last_outcome > JOB_STALL:
            self.restart_job(f"no save finished for {JOB_STALL:.0f} s")

    def wait_first_save(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.keep_job_alive()
            if any(rep or dur for rep, dur in self.snapshot().values()):
                return
            time.sleep(0.5)
        raise TimeoutError(f"no checkpoint REPLICATED or DURABLE within {timeout:.0f} s")

    def wait_heal(self, since: int, timeout: float) -> float | None:
        """Seconds until a checkpoint begun after `since` is REPLICATED or DURABLE on
        every node (None: not within `timeout`)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            self.keep_job_alive()
            ls = self.listings()
            if len(ls) == len(self.nodes):
                for c in set().union(*ls.values()):
                    if index_of(c) > since and all(
                        c in rows and (replicated(rows[c]) or durable(rows[c]))
                        for rows in ls.values()
                    ):
                        return time.monotonic() - started
            time.sleep(0.3)
        return None

    # ---- verification -------------------------------------------------------------------
    def verify(self, checkpoint: str, node: int, why: str) -> bool:
        """Load `checkpoint` through node `node`, bit-exact; a failure (after retries) is
        counted as lost, or as the honest-state gap when it was at risk."""
        error = ""
        for attempt in range(3):
            if attempt:
                time.sleep(2.0)
                self.keep_job_alive()
            error = self.loader.load(checkpoint, self.nodes[node].address)
            if not error:
                self.loads_ok += 1
                self.verified_ids.add(checkpoint)
                return True
        ls = self.listings()
        listed = self.snapshot(ls)
        if checkpoint not in listed:
            self.note(f"{checkpoint} failed to load via {self.nodes[node].name}; no longer listed")
            return False  # removed by retention meanwhile: nothing promised any more
        if self.retired_by_policy(checkpoint):
            return False  # persistent retention deleted it meanwhile: nothing promised
        if checkpoint in self.lost_listed(ls):
            self.judge_lost(checkpoint)
            return False
        kind = self._classify(checkpoint, node, ls)
        {
            "data intact": self.intact,
            "served elsewhere": self.elsewhere,
            "listed-but-lost": self.gap,
            "partial": self.partial,
        }.get(kind, self.lost).add(checkpoint)
        self.failures.append(
            {"checkpoint": checkpoint, "node": self.nodes[node].name, "why": why, "kind": kind}
            | {"save": self.outcome(checkpoint) or "?", "error": error[-1500:]}
        )
        print(f"  {kind}: {checkpoint} via {self.nodes[node].name} ({why}): {error[-400:]}")
        return False

    def _classify(
        self, checkpoint: str, node: int, ls: dict[int, dict[str, CheckpointInfo]]
    ) -> str:
        """Why a listed checkpoint does not load through `node`: its bytes are in S3 after
        all (stock DCP loads them bit-exact: a bug of the load path, no loss), another
        node that lists it serves it bit-exact (a bug of one node's view, no loss), its
        save failed (a partial listed as committed), it was at risk at a node loss (the
        honest-state gap), or LOST: no tier gives its bytes back."""
        if self._in_s3(checkpoint) and not self.loader.load(
            checkpoint, self.persistent_url(checkpoint)
        ):
            return "data intact"
        for i, rows in ls.items():
            serves = i != node and checkpoint in rows and self.nodes[i].running
            if serves and not self.loader.load(checkpoint, self.nodes[i].address):
                self.note(
                    f"{checkpoint}: failed via {self.nodes[node].name}, "
                    f"bit-exact via {self.nodes[i].name}"
                )
                return "served elsewhere"
        if self.outcome(checkpoint) == "fail":
            return "partial"
        return "listed-but-lost" if checkpoint in self.at_risk else "LOST"

    def _in_s3(self, checkpoint: str) -> bool:
        try:
            self.s3.invalidate_cache()
            return bool(self.s3.exists(f"{BUCKET}/{NS}/{checkpoint}/.metadata"))
        except OSError:
            return False

    @staticmethod
    def lost_listed(ls: dict[int, dict[str, CheckpointInfo]]) -> set[str]:
        """Checkpoints some node lists LOST (some file has no copy left on any tier)."""
        return {c for rows in ls.values() for c, info in rows.items() if info.state == "LOST"}

    def judge_lost(self, checkpoint: str) -> None:
        """A checkpoint listed LOST: honest when a node loss took the last copy before it
        was REPLICATED or DURABLE (then its load must raise the "lost" error, naming
        the files); a partial when its save had failed; else a real loss."""
        if checkpoint in self.failed() or self.retired_by_policy(checkpoint):
            return
        if checkpoint in self.at_risk:
            self.shown_lost.add(checkpoint)
            running = [i for i, d in enumerate(self.nodes) if d.running]
            error = self.loader.load(checkpoint, self.nodes[running[0]].address) if running else ""
            if "lost" in error.lower() and "checksum" not in error.lower():
                self.lost_errors_named += 1
            else:
                self.note(f"{checkpoint} is listed LOST but its load said: {error[-300:]!r}")
            return
        kind = "partial" if self.outcome(checkpoint) == "fail" else "LOST"
        (self.partial if kind == "partial" else self.lost).add(checkpoint)
        self.failures.append(
            {"checkpoint": checkpoint, "node": "-", "why": "listed LOST", "kind": kind}
            | {"save": self.outcome(checkpoint) or "?", "error": ""}
        )
        print(f"  {kind}: {checkpoint} is listed LOST")

    def retired_by_policy(self, checkpoint: str) -> bool:
        """Persistent retention deleted it: no `.metadata` of it in S3, and at least
        `persistent_keep_last` newer ones are durable there (a node that had not yet
        learnt of the deletion listed it a moment longer; no loss)."""
        try:
            self.s3.invalidate_cache()
            durable = {p.rsplit("/", 2)[-2] for p in self.s3.glob(f"{BUCKET}/{NS}/*/.metadata")}
        except OSError as e:  # S3 stopped by an injection: not judged now
            self.note(f"cannot list S3 to judge {checkpoint}: {e}")
            return False
        if checkpoint in durable:
            return False
        newer = sum(1 for c in durable if index_of(c) > index_of(checkpoint))
        if newer < PERSISTENT_KEEP:
            return False
        if checkpoint not in self.retired_seen:
            self.retired_seen.add(checkpoint)
            self.note(f"{checkpoint}: deleted by persistent retention ({newer} newer durable)")
        return True

    def failed(self) -> set[str]:
        """Checkpoints that failed to load once or are listed LOST (counted; not loaded
        again)."""
        return self.lost | self.gap | self.partial | self.intact | self.elsewhere | self.shown_lost

    def persistent_url(self, checkpoint: str) -> str:
        return f"s3://{BUCKET}/{NS}/{checkpoint}"

    def poke(self, node: int) -> None:
        """A load through `node` that is not checked (makes fetch/serve points fire)."""
        ls = self.listings()
        ids = sorted(set().union(*ls.values()), key=index_of) if ls else []
        if ids:
            self.loader.load(ids[-1], self.nodes[node].address, timeout=20.0)

    def check(self, label: str) -> None:
        ls = self.listings()
        for c in sorted(self.lost_listed(ls) - self.failed(), key=index_of):
            self.judge_lost(c)
        todo_first: list[str] = []
        ids = sorted(set().union(*ls.values()) - self.failed(), key=index_of) if ls else []
        for rows in ls.values():
            for c, info in rows.items():
                names = frozenset(f.name for f in info.files)
                if self.files_expected is None and c in self.verified_ids:
                    self.files_expected = names
                if self.files_expected not in (None, names) and c not in self.odd_layouts:
                    # Not partial by itself (a writer may lay its items out in other
                    # files); partial is a listed checkpoint that fails to load.
                    self.odd_layouts.add(c)
                    self.note(f"{label}: {c} listed with files {sorted(names)}")
                    todo_first.append(c)
        new = [c for c in ids if c not in self.verified_ids]
        new = new[-2:] + self._rng.sample(new[:-2], min(self.sample, len(new[:-2]))) if new else []
        todo = [(c, self._rng.randrange(len(self.nodes))) for c in todo_first + new]
        if ids:
            todo = [(c, i) for c, i in todo if c != ids[-1]] + [(ids[-1], i) for i in ls]
            older = [c for c in ids[:-1] if c in self.verified_ids]
            todo += [
                (c, self._rng.randrange(len(self.nodes)))
                for c in self._rng.sample(older, min(self.sample // 2, len(older)))
            ]
        for c, i in todo:
            if self.nodes[i].running and c not in self.failed():
                self.verify(c, i, label)
        self._disk_budget()

    def final_sweep(self) -> None:
        """The newest listed checkpoints and a sample of the others, through a node in
        turn (each one was checked when it was new, or sampled then)."""
        self.wait_heal(self.last_index(), 30.0)
        self.stop_job()
        ls = self.listings()
        ids = sorted(set().union(*ls.values()) - self.failed(), key=index_of) if ls else []
        older = ids[: -self.final_sample]
        ids = sorted(
            ids[-self.final_sample :] + self._rng.sample(older, min(self.final_sample, len(older))),
            key=index_of,
        )
        for n, c in enumerate(ids):
            self.verify(c, n % len(self.nodes), "final sweep")

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  note: {text}")

    def saves_now(self) -> int:
        current = self._outcomes().values() if self.job is not None else []
        return self.saves_ok + sum(r == {0: "ok", 1: "ok"} for r in current)

    def line(self) -> str:
        return (
            f"saves {self.saves_now()} verified {len(self.verified_ids)} lost {len(self.lost)} "
            f"gap {len(self.gap)} partial {len(self.partial)} shown-LOST {len(self.shown_lost)}"
        )

    def close(self, logs: Path | None = None) -> None:
        """Stop everything this run started, whatever fails on the way."""
        self._stop.set()
        steps = [self.stop_job, self.loader.close, *(c.close for c in self.clients)]
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            steps += [
                lambda d=d: shutil.copy(d.log_path, logs / f"{d.name}.log") for d in self.nodes
            ]
        steps += [d.cleanup for d in self.nodes] + [self.moto.stop]
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the next step must still run
                print(f"  cleanup: {type(e).__name__}: {e}")
