"""Run a function in N gloo ranks, each in its own spawned process.

The function must be a picklable top-level callable `fn(ctx: RankContext, *args)`. Ranks
rendezvous through a file store in the job's temp dir (no TCP ports), return values come
back through per-rank pickle files, and any exception in a rank -- including a
`BaseException` such as DCP's `CheckpointException` -- is re-raised in the test as
`RankFailed` carrying every failing rank's traceback. A hard timeout kills every rank.

`start_job` returns a `DistJob` handle for fault injection: wait for a rank to reach a
point (`wait_for_marker`), `kill_rank(r)` with SIGKILL, then `kill_all()`.

Ranks start from a forkserver that has imported torch once (importing torch and its
distributed packages is most of a spawned rank's start-up), so each rank is still a new
process with its own interpreter state, but without the import. A rank gets the test
process's environment as it is when the job starts, as a spawned one would.
`TIERCKPT_TEST_START_METHOD=spawn` starts ranks the plain way.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

__all__ = ["DistJob", "JobTimeout", "RankContext", "RankFailed", "run_job", "start_job"]

START_METHOD_ENV = "TIERCKPT_TEST_START_METHOD"
# What the forkserver imports before it forks ranks: torch and the parts every rank
# function uses. Only imports, no work (forking after `import torch` is what DataLoader's
# fork workers do); no grpc or tierckpt, whose channels and pools must not cross a fork.
_FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch._dynamo",  # imported by FSDP2's first fully_shard: seconds per rank otherwise
    "s3fs",  # stock DCP's load of an s3:// id: 0.4 s of CPU per rank otherwise (no client yet)
]


def _start_method() -> str:
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use 'forkserver' or 'spawn'")
    if method == "forkserver":
        # Takes effect when the forkserver starts (the first job); later calls are no-ops.
        mp.get_context("forkserver").set_forkserver_preload(_FORKSERVER_PRELOAD)
    return method


class RankFailed(AssertionError):
    """One or more ranks raised or died; the message holds their tracebacks."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


class JobTimeout(AssertionError):
    """The job did not finish within its hard timeout; every rank was killed."""


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a rank function gets besides its own arguments."""

    rank: int
    world_size: int
    job_dir: str

    def marker(self, name: str) -> None:
        """Signal the test process that this rank reached `name` (see DistJob.wait_for_marker)."""
        path = Path(self.job_dir, "markers", f"{name}.rank{self.rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(os.getpid()))


def _rank_entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    job_dir: str,
    args: tuple[Any, ...],
    use_pg: bool,
    environ: dict[str, str] | None = None,
) -> None:
    # A forkserver's child inherits the forkserver's environment: take the test's.
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    # Everything that fails here is written to a file: torch's spawn wrapper only reports
    # `Exception`s, and DCP raises CheckpointException, a BaseException.
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result_path = Path(job_dir, f"result.rank{rank}.pkl")
    # A native crash (abort, segfault) leaves no result: the Python stacks of every
    # thread at that moment go to a file the job's error message shows.
    crash_log = open(Path(job_dir, f"crash.rank{rank}.txt"), "w")  # noqa: SIM115 - the rank's life
    faulthandler.enable(file=crash_log, all_threads=True)
    try:
        if use_pg:
            dist.init_process_group(
                backend="gloo",
                init_method=f"file://{Path(job_dir, 'store')}",
                rank=rank,
                world_size=world_size,
            )
        try:
            value = fn(RankContext(rank, world_size, job_dir), *args)
        finally:
            if use_pg and dist.is_initialized():
                dist.destroy_process_group()
        payload: dict[str, Any] = {"ok": True, "value": value}
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        payload = {
            "ok": False,
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }
    tmp = result_path.with_suffix(".tmp")
    try:
        data = pickle.dumps(payload)
    except Exception as exc:  # an unpicklable return value is a test bug; say so
        data = pickle.dumps(
            {"ok": False, "type": "PicklingError", "message": str(exc), "traceback": ""}
        )
    tmp.write_bytes(data)
    tmp.rename(result_path)


class DistJob:
    """A running multi-rank job; see `start_job`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...],
        *,
        timeout: float,
        use_pg: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.job_dir = tempfile.mkdtemp(prefix="tcjob", dir=tempfile.gettempdir())
        self._deadline = time.monotonic() + timeout
        environ = {**os.environ, **(env or {})}
        self._context = mp.start_processes(
            _rank_entry,
            args=(fn, world_size, self.job_dir, args, use_pg, environ),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._context.processes]

    def marker_path(self, name: str, rank: int) -> Path:
        return Path(self.job_dir, "markers", f"{name}.rank{rank}")

    def wait_for_marker(self, name: str, ranks: list[int], timeout: float = 60.0) -> None:
        """Block until every rank in `ranks` called `ctx.marker(name)`; fail if a rank died first."""
        deadline = time.monotonic() + timeout
        while not all(self.marker_path(name, r).exists() for r in ranks):
            for rank, proc in enumerate(self._context.processes):
                if not proc.is_alive():
                    self.kill_all()
                    raise RankFailed(
                        f"rank {rank} exited (code {proc.exitcode}) before marker {name!r}:\n"
                        + self._describe_errors(),
                        self._errors(),
                    )
            if time.monotonic() > deadline:
                self.kill_all()
                raise JobTimeout(f"marker {name!r} not reached by ranks {ranks} in {timeout}s")
            time.sleep(0.05)

    def kill_rank(self, rank: int) -> None:
        proc = self._context.processes[rank]
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)

    def kill_all(self) -> None:
        for proc in self._context.processes:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._context.processes:
            proc.join(timeout=10)

    def _read_result(self, rank: int) -> dict[str, Any] | None:
        path = Path(self.job_dir, f"result.rank{rank}.pkl")
        if not path.exists():
            return None
        return pickle.loads(path.read_bytes())

    def _errors(self) -> dict[int, str]:
        errors: dict[int, str] = {}
        for rank, proc in enumerate(self._context.processes):
            result = self._read_result(rank)
            if result is None:
                if not proc.is_alive():
                    errors[rank] = f"died with exit code {proc.exitcode} and no result"
                    crash = Path(self.job_dir, f"crash.rank{rank}.txt")
                    if crash.exists() and crash.stat().st_size:
                        errors[rank] += (
                            "; Python stacks at the crash:\n" + crash.read_text()[-6000:]
                        )
            elif not result["ok"]:
                errors[rank] = f"{result['type']}: {result['message']}\n{result['traceback']}"
        return errors

    def _describe_errors(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(self._errors().items()))

    def join(self) -> list[Any]:
        """Wait for every rank; return their values in rank order or raise RankFailed/JobTimeout."""
        try:
            while True:
                alive = [p for p in self._context.processes if p.is_alive()]
                if not alive:
                    break
                # A failed rank usually leaves the others stuck in a collective: stop early.
                if self._errors():
                    time.sleep(2.0)  # bounded grace so peers can report their own error
                    break
                if time.monotonic() > self._deadline:
                    self.kill_all()
                    done = {r: "finished" for r in range(self.world_size) if self._read_result(r)}
                    raise JobTimeout(
                        f"job of {self.world_size} ranks timed out after {self.timeout}s "
                        f"(ranks with results: {sorted(done)})\n{self._describe_errors()}"
                    )
                time.sleep(0.05)
        finally:
            self.kill_all()
        errors = self._errors()
        if errors:
            raise RankFailed(
                f"{len(errors)} of {self.world_size} ranks failed:\n{self._describe_errors()}",
                errors,
            )
        values = []
        for rank in range(self.world_size):
            result = self._read_result(rank)
            assert result is not None, f"rank {rank} left no result"
            values.append(result["value"])
        return values

    def cleanup(self) -> None:
        self.kill_all()
        shutil.rmtree(self.job_dir, ignore_errors=True)


def start_job(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    use_pg: bool = True,
    env: dict[str, str] | None = None,
) -> DistJob:
    """Spawn `world_size` ranks running `fn(ctx, *args)` and return without waiting."""
    return DistJob(fn, world_size, args, timeout=timeout, use_pg=use_pg, env=env)


def run_job(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    use_pg: bool = True,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` gloo ranks and return the per-rank values."""
    job = start_job(fn, world_size, *args, timeout=timeout, use_pg=use_pg, env=env)
    try:
        return job.join()
    finally:
        job.cleanup()
