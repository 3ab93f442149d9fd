"""A bounded, seeded fuzz run over every RPC of both services of a real tierckptd.

Issue 8's fuzz test: random, structured and mutated requests (tests/support/fuzz.py) to
all DaemonService methods on the local socket and all PeerService methods on the peer
port, one at a time with a 5 s deadline each, for TIERCKPT_FUZZ_SECONDS (40 s here;
bench/fuzz_soak.py runs 10 minutes) with seed TIERCKPT_FUZZ_SEED. It asserts what the
audit's fuzzer found broken: the daemon stays up and healthy on both ports, no UNKNOWN,
no INTERNAL for a request that does not even parse, no traceback or local path in any
status detail, details and log lines bounded, RSS flat, and nothing written outside the
memory dir. The daemon runs eight levels deep inside a private tree, so a name that
escapes (audit C2) lands in the tree, where the snapshot sees it, not on the host.
Afterwards a real save, commit and load through the client must still work.

Every violation is collected with the call that caused it; the failure lists one line
per (assertion, method, status) with a reproduction.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import grpc
import pytest
from tierckpt.v1 import common_pb2, daemon_pb2_grpc
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.backends import Tiered
from tests.support.daemon_process import DaemonProcess
from tests.support.fuzz import ESCAPE_MARK, NODE_ID, PEER_ID, Call, Fuzzer
from tests.support.fuzz_harness import (
    CHANNEL_OPTIONS,
    Checker,
    Run,
    Sandbox,
    Sender,
    SilentPeer,
    alive,
    clear_for_sanity,
    log_growth,
    rss,
    tree_diff,
)
from tests.support.ports import free_ports
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

FUZZ_SECONDS = float(os.environ.get("TIERCKPT_FUZZ_SECONDS", "40"))
SEED = int(os.environ.get("TIERCKPT_FUZZ_SEED", "20240808"))
ONLY = os.environ.get("TIERCKPT_FUZZ_ONLY", "")  # a regex of method names, to bisect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(int(FUZZ_SECONDS) + 240)]

CHECK_EVERY = 50  # calls between liveness, health, RSS and tree checks
WARMUP = 300  # calls before the RSS baseline (first use of code paths imports modules)
MAX_RSS_GROWTH = 64 << 20
# A refused call may log one bounded line; a traceback per call (audit M5: 61,575 of them
# in 100 s, 3.7 lines per call here before issue 8) or an echoed 5000-char name may not.
MAX_LOG_BYTES_PER_CALL = 1024  # per RPC sent (a save is several)
MAX_LOG_LINES_PER_CALL = 2
MAX_LOG_LINE = 4096


def _start_daemon(box: Sandbox, nobody: int) -> tuple[DaemonProcess, int]:
    (peer_port,) = free_ports(1)
    daemon = DaemonProcess(
        {
            "node": {"id": NODE_ID},
            "listen": {"peer": f"127.0.0.1:{peer_port}"},
            # The peer the fuzzer poses as (a SilentPeer); no copies are pushed to it.
            "peers": [{"id": PEER_ID, "address": f"127.0.0.1:{nobody}", "failure_domain": "fz"}],
            "replication": {"copies": 0},
            "memory": {"dir": str(box.mem), "budget": "64MiB"},
            "persistent": {"url": f"file://{box.persist}"},
            "retention": {"memory_keep_last": 2},
        },
        name=NODE_ID,
        start=False,
    )
    daemon.start()
    return daemon, peer_port


def _second(item: tuple[str, float]) -> float:
    return -item[1]


def _fuzz(run: Run, fuzzer: Fuzzer, daemon: DaemonProcess, peer_address: str, box: Sandbox) -> None:
    """Send calls until the time is up, checking each status; every CHECK_EVERY calls the
    daemon must be alive and SERVING on both ports. The tree is compared after each call
    that succeeded (that is when a name can have become a path), to name each culprit."""
    checker = Checker(run, daemon, box, fuzzer)
    tree = box.snapshot()
    changes = 0
    marker = fuzzer.marker.encode()
    marker_call: Call | None = None  # the last save whose .metadata creates the marker
    local = grpc.insecure_channel(daemon.address, options=CHANNEL_OPTIONS)
    peer = grpc.insecure_channel(peer_address, options=CHANNEL_OPTIONS)
    sender = Sender(local, peer, box.mem)
    deadline = time.monotonic() + FUZZ_SECONDS
    try:
        while time.monotonic() < deadline:
            call = fuzzer.call(run.calls)
            sent = time.monotonic()
            code, details, replies = sender.send(call)
            took = time.monotonic() - sent
            run.busy[call.method.name] += took
            run.slowest[call.method.name] = max(run.slowest[call.method.name], took)
            checker.status(call, code, details, replies)
            run.calls += 1
            run.rpcs += 3 + 2 * len(call.save.files) if call.save else 1
            if run.calls == WARMUP:  # lazy imports and pools are in place by now
                run.rss_warm = rss(daemon.pid)
            if call.save and any(marker in content for _, content in call.save.files):
                marker_call = call
            if changes < 20 and (code == grpc.StatusCode.OK or run.calls % CHECK_EVERY == 0):
                now = box.snapshot()
                if now != tree:
                    changes += 1
                    diff = tree_diff(tree, now)
                    tree = now  # report the next change on its own
                    if f"{ESCAPE_MARK}-pwned" in diff:  # the drain ran after the save
                        run.add("the daemon never unpickles .metadata", marker_call, "-", diff)
                    else:
                        run.add("nothing changes outside the memory dir", call, code.name, diff)
            if run.calls % CHECK_EVERY == 0:
                problem = alive(daemon, peer_address)
                if problem:
                    detail = f"{problem}\n{daemon.log_tail(30)}"
                    run.add("daemon stays up and SERVING on both ports", call, "-", detail)
                    return
                run.rss_series.append(rss(daemon.pid))
    finally:
        local.close()
        peer.close()


def _check_after(
    run: Run, daemon: DaemonProcess, peer_address: str, box: Sandbox, before: dict[str, Any]
) -> None:
    """The whole-run bounds: alive, RSS, log growth, the tree and the host around it."""
    calls = max(run.rpcs, 1)  # a save is several RPCs
    if daemon.running:
        problem = alive(daemon, peer_address)
        if problem:
            run.add("daemon stays up and SERVING on both ports", None, "-", problem)
        end = rss(daemon.pid)
        base = run.rss_warm or before["rss"]
        series = run.rss_series[:: max(1, len(run.rss_series) // 8)]
        run.notes.append(
            f"VmRSS {before['rss'] >> 20} at start, {base >> 20} after {WARMUP} calls, "
            f"{end >> 20} MiB at the end (along the run: {[r >> 20 for r in series]})"
        )
        if end - base > MAX_RSS_GROWTH:
            run.add(f"RSS growth <= {MAX_RSS_GROWTH >> 20} MiB", None, "-", run.notes[-1])
    slow = ", ".join(f"{m} {t:.1f} s" for m, t in sorted(run.slowest.items(), key=_second)[:3])
    busy = ", ".join(f"{m} {t:.0f} s" for m, t in sorted(run.busy.items(), key=_second)[:3])
    run.notes.append(f"slowest calls: {slow}; most time in: {busy}")
    log_bytes, log_lines, longest, levels = log_growth(daemon.log_path, before["log"])
    run.notes.append(
        f"log +{log_bytes} B, +{log_lines} lines ({log_bytes // calls} B, "
        f"{log_lines / calls:.2f} lines per RPC, longest line {longest} B; {levels})"
    )
    if log_bytes > MAX_LOG_BYTES_PER_CALL * calls or log_lines > MAX_LOG_LINES_PER_CALL * calls:
        run.add("log growth bounded per call", None, "-", run.notes[-1])
    if longest > MAX_LOG_LINE:
        run.add("no unbounded log line", None, "-", f"a new log line of {longest} bytes")
    tree = box.snapshot()
    if tree != before["tree"]:
        run.add(
            "nothing changes outside the memory dir (at the end)",
            None,
            "-",
            tree_diff(before["tree"], tree),
        )
    outside = sorted(set(box.escapes_outside()) - set(before["outside"]))
    if outside:
        run.add("nothing escapes the private tree", None, "-", f"new: {outside}")


def _sanity(run: Run, daemon: DaemonProcess) -> None:
    """Valid traffic still works: a real save, commit and load through the client."""
    clear_for_sanity(daemon.address, run)
    state = plain_tensor_state(2, 512 << 10)
    expected = snapshot(state)
    backend = Tiered("fzsanity", daemon.address)
    try:
        backend.save(state, "step-1")
        target = plain_tensor_state(3, 512 << 10)
        backend.load(target, "step-1")
        assert_state_equal(actual=target, expected=expected, what="sanity load after the fuzz run")
    except (Exception, CheckpointException) as e:  # reported with the fuzz findings
        cause = (str(e).strip().splitlines() or [""])[-1]  # DCP wraps it in a traceback
        run.add("valid save/commit/load after the fuzz run", None, type(e).__name__, cause)


def _wait_durable(address: str, ref: common_pb2.CheckpointRef, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = daemon_pb2_grpc.DaemonServiceStub(channel)
        while (state := stub.GetCheckpoint(ref, timeout=30).state) != common_pb2.DURABLE:
            assert time.monotonic() < deadline, f"{ref} not DURABLE in {timeout} s ({state})"
            time.sleep(0.2)


def test_fuzz_every_rpc_of_both_services() -> None:
    print(f"fuzz seed {SEED} (TIERCKPT_FUZZ_SEED), {FUZZ_SECONDS:.0f} s (TIERCKPT_FUZZ_SECONDS)")
    box = Sandbox.create()
    daemon: DaemonProcess | None = None
    silent = SilentPeer()
    try:
        daemon, peer_port = _start_daemon(box, silent.port)
        peer_address = f"127.0.0.1:{peer_port}"
        assert alive(daemon, peer_address) == "", daemon.log_tail()
        fuzzer = Fuzzer(
            SEED, node_id=NODE_ID, peer_id=PEER_ID, sandbox=box.abs_names_dir, only=ONLY
        )
        paths = {m.path for m in fuzzer.methods}
        if not ONLY:
            assert len(paths) == 25, f"expected 14 DaemonService + 11 PeerService methods: {paths}"
        # Real state for the fuzz to hit, drained to the file:// tier before the baselines.
        Tiered("fz", daemon.address).save(plain_tensor_state(1, 256 << 10), "step-1")
        _wait_durable(
            daemon.address, common_pb2.CheckpointRef(namespace="fz", checkpoint_id="step-1")
        )

        run = Run()
        before = {
            "tree": box.snapshot(),
            "outside": box.escapes_outside(),
            "rss": rss(daemon.pid),
            "log": daemon.log_path.stat().st_size,
        }
        started = time.monotonic()
        _fuzz(run, fuzzer, daemon, peer_address, box)
        seconds = time.monotonic() - started
        _check_after(run, daemon, peer_address, box, before)
        if daemon.running:
            _sanity(run, daemon)

        report = run.report(SEED, seconds)
        print(report)
        assert not run.violations, f"{report}\n{daemon.log_tail(40)}"
    finally:
        if daemon is not None:
            daemon.cleanup()
        silent.stop()
        shutil.rmtree(box.root, ignore_errors=True)
