"""Gloo ranks started inside the network namespaces of their nodes.

`dist_job` forks ranks from one forkserver in the test's namespace; a rank of a testbed
node must instead be born in that node's namespace, so each one here is its own
`ip netns exec <ns> python -m tests.support.netns_job` process. The rank body is
`dist_job`'s: the same file-store rendezvous (the filesystem is shared), the same result
and crash files, the same `RankFailed`/`JobTimeout`. Gloo's own connections between ranks
bind to the node's `eth0`, so collectives between nodes cross the bridge.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.support.dist_job import JobTimeout, RankFailed, _rank_entry
from tests.support.testbed import IFACE, Node

__all__ = ["run_ranks"]

_ROOT = str(Path(__file__).resolve().parents[2])
_GRACE = 2.0  # after one rank failed, the others' time to report their own error


def _kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _result(job_dir: Path, rank: int) -> dict[str, Any] | None:
    path = job_dir / f"result.rank{rank}.pkl"
    if not path.exists():
        return None
    value: dict[str, Any] = pickle.loads(path.read_bytes())
    return value


def _errors(job_dir: Path, procs: Sequence[subprocess.Popen[bytes]]) -> dict[int, str]:
    errors: dict[int, str] = {}
    for rank, proc in enumerate(procs):
        result = _result(job_dir, rank)
        if result is None and proc.poll() is not None:
            log = (job_dir / f"rank{rank}.log").read_text(errors="replace")[-4000:]
            crash = job_dir / f"crash.rank{rank}.txt"
            stacks = crash.read_text()[-4000:] if crash.exists() else ""
            errors[rank] = f"exited {proc.returncode} with no result\n{log}\n{stacks}"
        elif result is not None and not result["ok"]:
            errors[rank] = f"{result['type']}: {result['message']}\n{result['traceback']}"
    return errors


def run_ranks(
    fn: Callable[..., Any],
    placements: Sequence[Node],
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(ctx, *args)` on one gloo rank per entry of `placements`, rank r in the
    namespace of `placements[r]`; the values in rank order, or RankFailed / JobTimeout."""
    world = len(placements)
    job_dir = Path(tempfile.mkdtemp(prefix="tcnj", dir=tempfile.gettempdir()))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        (job_dir / "spec.pkl").write_bytes(pickle.dumps((fn, args)))
        environ = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": IFACE}
        environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (_ROOT, environ.get("PYTHONPATH", "")) if p
        )
        for rank, node in enumerate(placements):
            argv = [sys.executable, "-m", "tests.support.netns_job", str(job_dir), str(rank)]
            with open(job_dir / f"rank{rank}.log", "wb") as log:  # the child keeps a copy
                procs.append(
                    subprocess.Popen(
                        node.exec_argv([*argv, str(world)]),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=environ,
                        cwd=_ROOT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if _errors(job_dir, procs):
                time.sleep(_GRACE)  # a failed rank leaves the others stuck in a collective
                break
            if time.monotonic() > deadline:
                _kill(procs)
                done = [r for r in range(world) if _result(job_dir, r) is not None]
                raise JobTimeout(
                    f"job of {world} namespaced ranks timed out after {timeout}s (ranks with "
                    f"results: {done})\n{_describe(_errors(job_dir, procs))}"
                )
            time.sleep(0.05)
        _kill(procs)
        errors = _errors(job_dir, procs)
        if errors:
            raise RankFailed(f"{len(errors)} of {world} ranks failed:\n{_describe(errors)}", errors)
        results = [_result(job_dir, r) for r in range(world)]
        missing = [r for r, res in enumerate(results) if res is None]
        if missing:
            raise RankFailed(f"ranks {missing} left no result", {r: "no result" for r in missing})
        return [res["value"] for res in results if res is not None]
    finally:
        _kill(procs)
        shutil.rmtree(job_dir, ignore_errors=True)


def _describe(errors: dict[int, str]) -> str:
    return "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items()))


def _main(job_dir: str, rank: int, world: int) -> None:
    fn, args = pickle.loads(Path(job_dir, "spec.pkl").read_bytes())
    _rank_entry(rank, fn, world, job_dir, args, True)


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
