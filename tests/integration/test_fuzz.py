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

import hashlib
import os
import re
import shutil
import stat
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.checksum import checksum_bytes
from tierckpt.names import is_checkpoint_id
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.backends import Tiered
from tests.support.daemon_process import DaemonProcess
from tests.support.fuzz import ESCAPE_MARK, NODE_ID, PEER_ID, Call, Fuzzer, Method, Save
from tests.support.ports import free_ports
from tests.support.state_dicts import assert_state_equal, plain_tensor_state, snapshot

FUZZ_SECONDS = float(os.environ.get("TIERCKPT_FUZZ_SECONDS", "40"))
SEED = int(os.environ.get("TIERCKPT_FUZZ_SEED", "20240808"))
ONLY = os.environ.get("TIERCKPT_FUZZ_ONLY", "")  # a regex of method names, to bisect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(int(FUZZ_SECONDS) + 240)]

DEPTH = 8  # levels between the private tree and the memory dir (see tests/support/fuzz.py)
CALL_TIMEOUT = 5.0
CHECK_EVERY = 50  # calls between liveness, health, RSS and tree checks
WARMUP = 300  # calls before the RSS baseline (first use of code paths imports modules)
HEALTH_TIMEOUT = 10.0  # generous: the CI machine has 2 loaded cores
MAX_DETAILS = 2048
MAX_RSS_GROWTH = 64 << 20
# A refused call may log one bounded line; a traceback per call (audit M5: 61,575 of them
# in 100 s, 3.7 lines per call here before issue 8) or an echoed 5000-char name may not.
MAX_LOG_BYTES_PER_CALL = 1024
MAX_LOG_LINES_PER_CALL = 2
MAX_LOG_LINE = 4096
MAX_STREAM_REPLIES = 64
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]

# A Python traceback or an exception repr ("OSError(28, ...)", "ValueError('...')").
TRACEBACK = re.compile(r"Traceback|File \"|\b[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\(")
T = TypeVar("T")
HOST_PATHS = ("/dev/shm", "/tmp", "/home", "/root", "/var", "/run")


@dataclass
class Violation:
    assertion: str
    call: Call | None
    code: str
    detail: str


def _squeeze(text: str) -> str:
    """Runs of one character as `x*5000`, so a report line stays readable."""
    return re.sub(r"(.)\1{15,}", lambda m: f"{m.group(1)}*{len(m.group(0))}", text)


@dataclass
class Run:
    """What one fuzz run saw."""

    violations: list[Violation] = field(default_factory=list)
    codes: Counter[str] = field(default_factory=Counter)
    calls: int = 0
    peak_rss: int = 0
    rss_warm: int = 0
    by_method: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    busy: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    slowest: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    notes: list[str] = field(default_factory=list)

    def add(self, assertion: str, call: Call | None, code: str, detail: str) -> None:
        self.violations.append(Violation(assertion, call, code, _squeeze(detail)[:400]))

    def report(self, seed: int, seconds: float) -> str:
        groups: dict[tuple[str, str, str], list[Violation]] = {}
        for v in self.violations:
            method = v.call.method.name if v.call else "-"
            groups.setdefault((v.assertion, method, v.code), []).append(v)
        lines = [
            f"fuzz seed {seed} (rerun: TIERCKPT_FUZZ_SEED={seed}): {self.calls} calls in "
            f"{seconds:.0f} s; {'; '.join(self.notes)}",
            f"statuses {dict(self.codes.most_common())}",
            *(
                f"  {method}: {', '.join(f'{c} {n}' for c, n in codes.most_common())}"
                for method, codes in sorted(self.by_method.items())
            ),
            f"{len(self.violations)} violation(s) in {len(groups)} class(es):",
        ]
        for (assertion, method, code), items in sorted(groups.items(), key=lambda g: -len(g[1])):
            first = items[0]
            lines.append(f"- {assertion}: {method} -> {code} x{len(items)}: {first.detail!r}")
            if first.call is not None:
                lines.append(f"    call #{first.call.index}: {_squeeze(first.call.describe(300))}")
                lines.append(f"    print it: {first.call.reproduce}")
        return "\n".join(lines)


# -- the daemon in a private tree ----------------------------------------------------
@dataclass
class Sandbox:
    root: Path
    deep: Path  # holds mem/ and persist/
    mem: Path
    persist: Path

    @classmethod
    def create(cls) -> Sandbox:
        root = Path(tempfile.mkdtemp(prefix="fz", dir=tempfile.gettempdir())).resolve()
        deep = root.joinpath(*(f"d{i}" for i in range(1, DEPTH + 1)))
        deep.mkdir(parents=True)
        for level in (deep, *deep.parents[:DEPTH]):  # root .. deep, one sentinel each
            (level / "sentinel.txt").write_text(f"sentinel of {level}\n")
        return cls(root, deep, deep / "mem", deep / "persist")

    @property
    def abs_names_dir(self) -> str:
        """Absolute names may point here: seven levels inside the tree."""
        return str(self.deep.parent)

    def snapshot(self) -> dict[str, tuple[str, int, str]]:
        """Everything in the tree except the memory dir and the persistent tier."""
        out: dict[str, tuple[str, int, str]] = {}
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            here = Path(dirpath)
            dirnames[:] = [d for d in dirnames if here / d not in (self.mem, self.persist)]
            for name in [*dirnames, *filenames]:
                path = here / name
                st = path.lstat()
                kind, digest = "other", ""
                if stat.S_ISREG(st.st_mode):
                    kind, digest = "file", hashlib.sha256(path.read_bytes()).hexdigest()[:16]
                elif stat.S_ISDIR(st.st_mode):
                    kind = "dir"
                elif stat.S_ISLNK(st.st_mode):
                    kind, digest = "link", os.readlink(path)
                out[str(path.relative_to(self.root))] = (kind, stat.S_IMODE(st.st_mode), digest)
        return out

    def escapes_outside(self) -> list[str]:
        """Entries named like an escaping fuzz name in the tree's ancestors and the host root."""
        found = []
        for level in {*self.root.parents, Path("/dev/shm")}:
            try:
                found += [str(level / n) for n in os.listdir(level) if ESCAPE_MARK in n]
            except OSError:
                pass
        return sorted(found)


class _SilentPeer:
    """The configured peer the fuzzer poses as: a gRPC server with no services, so the
    daemon's own calls to it (holdings at commit) end at once with UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        self.port = int(self.server.add_insecure_port("127.0.0.1:0"))
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def _start_daemon(box: Sandbox, nobody: int) -> tuple[DaemonProcess, int]:
    (peer_port,) = free_ports(1)
    daemon = DaemonProcess(
        {
            "node": {"id": NODE_ID},
            "listen": {"peer": f"127.0.0.1:{peer_port}"},
            # The peer the fuzzer poses as (a _SilentPeer); no copies are pushed to it.
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


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# -- sending one call ----------------------------------------------------------------
class Sender:
    """Raw-bytes generic stubs for every method: the payloads reach the server as sent."""

    def __init__(self, local: grpc.Channel, peer: grpc.Channel, memory_dir: Path) -> None:
        self.local, self.peer = local, peer
        self.memory_dir = memory_dir.resolve()
        self.daemon = daemon_pb2_grpc.DaemonServiceStub(local)
        self._stubs: dict[str, Any] = {}

    def _stub(self, method: Method) -> Any:
        if method.path not in self._stubs:
            channel = self.peer if method.service.endswith("PeerService") else self.local
            factory = {
                (False, False): channel.unary_unary,
                (False, True): channel.unary_stream,
                (True, False): channel.stream_unary,
                (True, True): channel.stream_stream,
            }[(method.client_streaming, method.server_streaming)]
            self._stubs[method.path] = factory(
                method.path, request_serializer=None, response_deserializer=None
            )
        return self._stubs[method.path]

    def save(self, save: Save) -> tuple[grpc.StatusCode, str, list[bytes]]:
        """A rank's save with the generated contents: the status of the first step that
        fails, or OK. A path outside the memory dir is never written (and is reported)."""
        ref = common_pb2.CheckpointRef(namespace=save.namespace, checkpoint_id=save.checkpoint_id)
        stub = self.daemon
        try:
            stub.BeginCheckpoint(daemon_pb2.BeginCheckpointRequest(ref=ref), timeout=CALL_TIMEOUT)
            size = sum(len(content) for _, content in save.files)
            reserve = daemon_pb2.ReserveSpaceRequest(ref=ref, bytes=size)
            stub.ReserveSpace(reserve, timeout=CALL_TIMEOUT)
            for name, content in save.files:
                opened = stub.OpenFile(
                    daemon_pb2.OpenFileRequest(ref=ref, file_name=name), timeout=CALL_TIMEOUT
                )
                path = Path(opened.path).resolve()
                if self.memory_dir not in path.parents:
                    return grpc.StatusCode.OK, "", [f"OUTSIDE {path}".encode()]
                written = content
                if name == save.corrupt:
                    written = bytes([content[0] ^ 1]) + content[1:] if content else b"x"
                with path.open("r+b") as f:
                    f.write(written)
                    f.truncate(len(written))
                cs = checksum_bytes(content)
                commit = daemon_pb2.CommitFileRequest(
                    ref=ref,
                    file_name=name,
                    size=len(content),
                    checksums=common_pb2.BlockChecksums(
                        algorithm=cs.algorithm, block_size=cs.block_size, block_digests=cs.digests
                    ),
                )
                stub.CommitFile(commit, timeout=CALL_TIMEOUT)
            names = [name for name, _ in save.files]
            commit_all = daemon_pb2.CommitCheckpointRequest(ref=ref, required_files=names)
            stub.CommitCheckpoint(commit_all, timeout=CALL_TIMEOUT)
        except grpc.RpcError as e:
            return e.code(), e.details() or "", []
        return grpc.StatusCode.OK, "", []

    def send(self, call: Call) -> tuple[grpc.StatusCode, str, list[bytes]]:
        """(status, details, reply messages) of one call."""
        if call.save is not None:
            return self.save(call.save)
        stub = self._stub(call.method)
        request: Any = iter(call.messages) if call.method.client_streaming else call.messages[0]
        replies: list[bytes] = []
        try:
            if call.method.server_streaming:
                stream = stub(request, timeout=CALL_TIMEOUT, metadata=call.metadata)
                for reply in stream:
                    replies.append(reply)
                    if len(replies) >= MAX_STREAM_REPLIES:
                        stream.cancel()
                        break
            else:
                replies.append(stub(request, timeout=CALL_TIMEOUT, metadata=call.metadata))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and len(replies) >= MAX_STREAM_REPLIES:
                return grpc.StatusCode.OK, "", replies
            return e.code(), e.details() or "", replies
        return grpc.StatusCode.OK, "", replies


# -- the assertions ------------------------------------------------------------------
class Checker:
    def __init__(self, run: Run, daemon: DaemonProcess, box: Sandbox, fuzzer: Fuzzer) -> None:
        self.run = run
        self.local_paths = sorted(
            {str(box.mem), str(box.deep), str(daemon.base_dir)}, key=len, reverse=True
        )
        self.echoes = sorted(fuzzer.absolute_names, key=len, reverse=True)
        # An echo is recognised by a prefix that no local path shares.
        self.min_echo = len(fuzzer.sandbox) + 3

    def _scrub(self, details: str) -> str:
        """Details without the caller's own absolute names (echoing them is no leak)."""
        for name in self.echoes:
            # A message may truncate an echoed name; drop any long enough prefix of it.
            for cut in range(len(name), self.min_echo - 1, -1):
                details = details.replace(name[:cut], "<echo>")
        return details

    def status(self, call: Call, code: grpc.StatusCode, details: str, replies: list[bytes]) -> None:
        name = code.name
        self.run.codes[name] += 1
        self.run.by_method[call.method.name][name] += 1
        if code == grpc.StatusCode.UNKNOWN:
            self.run.add("UNKNOWN status", call, name, details)
        if code == grpc.StatusCode.INTERNAL and not call.parses:
            self.run.add(
                "INTERNAL for a request that does not parse (want INVALID_ARGUMENT)",
                call,
                name,
                details,
            )
        if len(details) > MAX_DETAILS:
            self.run.add(f"details longer than {MAX_DETAILS} chars", call, name, details)
        if TRACEBACK.search(details):
            self.run.add("traceback or exception repr in details", call, name, details)
        scrubbed = self._scrub(details)
        if any(p in scrubbed for p in [*self.local_paths, *HOST_PATHS]):
            self.run.add("local path in details", call, name, details)
        if replies and replies[0].startswith(b"OUTSIDE "):
            self.run.add(
                "OpenFile returns a path in the memory dir", call, name, replies[0].decode()
            )
        if call.method.service.endswith("PeerService"):
            for reply in replies:
                if any(p.encode() in reply for p in self.local_paths):
                    leaked = next(p for p in self.local_paths if p.encode() in reply)
                    self.run.add("local path in a PeerService reply", call, name, leaked)
                    break


def _health(address: str) -> str:
    """'' when SERVING within the deadline (three tries), else what went wrong."""
    problem = ""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(3):
            try:
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return ""
                problem = f"health status {reply.status}"
            except grpc.RpcError as e:
                problem = f"{e.code().name}: {e.details()}"
            time.sleep(1.0)
    return problem


def _alive(daemon: DaemonProcess, peer_address: str) -> str:
    if not daemon.running:
        return f"tierckptd exited with {daemon.proc.returncode if daemon.proc else '?'}"
    for where, address in (("local socket", daemon.address), ("peer port", peer_address)):
        problem = _health(address)
        if problem:
            return f"Health.Check on the {where} not SERVING: {problem}"
    return ""


def _second(item: tuple[str, float]) -> float:
    return -item[1]


def _log_growth(path: Path, offset: int) -> tuple[int, int, int]:
    """(bytes, lines, longest line) the log gained after `offset`."""
    with path.open("rb") as f:
        f.seek(offset)
        tail = f.read()
    lines = tail.splitlines()
    return len(tail), len(lines), max((len(line) for line in lines), default=0)


def _tree_diff(before: dict[str, Any], after: dict[str, Any]) -> str:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return f"added {added[:5]}, removed {removed[:5]}, changed {changed[:5]}"


def _fuzz(run: Run, fuzzer: Fuzzer, daemon: DaemonProcess, peer_address: str, box: Sandbox) -> None:
    """Send calls until the time is up, checking each status; every CHECK_EVERY calls the
    daemon must be alive and SERVING on both ports. The tree is compared after each call
    that succeeded (that is when a name can have become a path), to name the culprit."""
    checker = Checker(run, daemon, box, fuzzer)
    tree = box.snapshot()
    tree_changed = False
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
            if run.calls == WARMUP:  # lazy imports and pools are in place by now
                run.rss_warm = _rss(daemon.pid)
            if call.save and any(marker in content for _, content in call.save.files):
                marker_call = call
            if not tree_changed and (code == grpc.StatusCode.OK or run.calls % CHECK_EVERY == 0):
                now = box.snapshot()
                if now != tree:
                    tree_changed = True
                    diff = _tree_diff(tree, now)
                    if f"{ESCAPE_MARK}-pwned" in diff:  # the drain ran after the save
                        run.add("the daemon never unpickles .metadata", marker_call, "-", diff)
                    else:
                        run.add("nothing changes outside the memory dir", call, code.name, diff)
            if run.calls % CHECK_EVERY == 0:
                problem = _alive(daemon, peer_address)
                if problem:
                    detail = f"{problem}\n{daemon.log_tail(30)}"
                    run.add("daemon stays up and SERVING on both ports", call, "-", detail)
                    return
                run.peak_rss = max(run.peak_rss, _rss(daemon.pid))
    finally:
        local.close()
        peer.close()


def _check_after(
    run: Run, daemon: DaemonProcess, peer_address: str, box: Sandbox, before: dict[str, Any]
) -> None:
    """The whole-run bounds: alive, RSS, log growth, the tree and the host around it."""
    calls = max(run.calls, 1)
    if daemon.running:
        problem = _alive(daemon, peer_address)
        if problem:
            run.add("daemon stays up and SERVING on both ports", None, "-", problem)
        rss = _rss(daemon.pid)
        base = run.rss_warm or before["rss"]
        growth = rss - base
        run.notes.append(
            f"VmRSS {before['rss'] >> 20} at start, {base >> 20} after {WARMUP} calls, "
            f"{rss >> 20} MiB at the end (peak {max(run.peak_rss, rss) >> 20})"
        )
        if growth > MAX_RSS_GROWTH:
            run.add(f"RSS growth <= {MAX_RSS_GROWTH >> 20} MiB", None, "-", run.notes[-1])
    slow = ", ".join(f"{m} {t:.1f} s" for m, t in sorted(run.slowest.items(), key=_second)[:3])
    busy = ", ".join(f"{m} {t:.0f} s" for m, t in sorted(run.busy.items(), key=_second)[:3])
    run.notes.append(f"slowest calls: {slow}; most time in: {busy}")
    log_bytes, log_lines, longest = _log_growth(daemon.log_path, before["log"])
    run.notes.append(
        f"log +{log_bytes} B, +{log_lines} lines ({log_bytes // calls} B, "
        f"{log_lines / calls:.2f} lines per call, longest line {longest} B)"
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
            _tree_diff(before["tree"], tree),
        )
    outside = sorted(set(box.escapes_outside()) - set(before["outside"]))
    if outside:
        run.add("nothing escapes the private tree", None, "-", f"new: {outside}")


def _sanity(run: Run, daemon: DaemonProcess) -> None:
    """Valid traffic still works: a real save, commit and load through the client."""
    _clear_for_sanity(daemon.address, run)
    state = plain_tensor_state(2, 512 << 10)
    expected = snapshot(state)
    backend = Tiered("fzsanity", daemon.address)
    try:
        backend.save(state, "step-1")
        target = plain_tensor_state(3, 512 << 10)
        backend.load(target, "step-1")
        assert_state_equal(target, expected, what="sanity load after the fuzz run")
    except (Exception, CheckpointException) as e:  # reported with the fuzz findings
        cause = (str(e).strip().splitlines() or [""])[-1]  # DCP wraps it in a traceback
        run.add("valid save/commit/load after the fuzz run", None, type(e).__name__, cause)


def _wait_durable(address: str, namespace: str, checkpoint_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    state = 0
    with grpc.insecure_channel(address) as channel:
        stub = daemon_pb2_grpc.DaemonServiceStub(channel)
        ref = common_pb2.CheckpointRef(namespace=namespace, checkpoint_id=checkpoint_id)
        while time.monotonic() < deadline:
            state = int(stub.GetCheckpoint(ref, timeout=30).state)
            if state == common_pb2.DURABLE:
                return
            time.sleep(0.2)
    raise AssertionError(
        f"{namespace}/{checkpoint_id} not DURABLE in the file:// tier within {timeout} s "
        f"(state {common_pb2.CheckpointState.Name(state)})"  # type: ignore[arg-type]
    )


def _clear_for_sanity(address: str, run: Run) -> None:
    """Abort, unpin and delete what the fuzz left in valid namespaces, so the sanity save
    finds budget (reservations and pins are legitimate holds, not bugs)."""

    def attempt(what: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                run.add(
                    f"cleanup after the fuzz run ({what})", None, e.code().name, e.details() or ""
                )
            return None

    with grpc.insecure_channel(address) as channel:
        stub = daemon_pb2_grpc.DaemonServiceStub(channel)
        status = attempt(
            "GetStatus", lambda: stub.GetStatus(daemon_pb2.GetStatusRequest(), timeout=30)
        )
        for ns in filter(is_checkpoint_id, status.namespaces if status else ()):  # same charset
            request = daemon_pb2.ListCheckpointsRequest(namespace=ns, include_uncommitted=True)
            listing = attempt("ListCheckpoints", partial(stub.ListCheckpoints, request, timeout=30))
            for info in listing.checkpoints if listing else ():
                ref = info.ref
                if info.state == common_pb2.WRITING:
                    attempt("AbortCheckpoint", partial(stub.AbortCheckpoint, ref, timeout=30))
                    continue
                if info.pinned:
                    unpin = daemon_pb2.PinCheckpointRequest(ref=ref, pinned=False)
                    attempt("PinCheckpoint", partial(stub.PinCheckpoint, unpin, timeout=30))
                attempt("DeleteCheckpoint", partial(stub.DeleteCheckpoint, ref, timeout=30))


def test_fuzz_every_rpc_of_both_services() -> None:
    box = Sandbox.create()
    daemon: DaemonProcess | None = None
    silent = _SilentPeer()
    try:
        daemon, peer_port = _start_daemon(box, silent.port)
        peer_address = f"127.0.0.1:{peer_port}"
        assert _alive(daemon, peer_address) == "", daemon.log_tail()
        fuzzer = Fuzzer(
            SEED, node_id=NODE_ID, peer_id=PEER_ID, sandbox=box.abs_names_dir, only=ONLY
        )
        paths = {m.path for m in fuzzer.methods}
        if not ONLY:
            assert len(paths) == 19, f"expected 13 DaemonService + 6 PeerService methods: {paths}"
        # Real state for the fuzz to hit, drained to the file:// tier before the baselines.
        Tiered("fz", daemon.address).save(plain_tensor_state(1, 256 << 10), "step-1")
        _wait_durable(daemon.address, "fz", "step-1")

        run = Run()
        before = {
            "tree": box.snapshot(),
            "outside": box.escapes_outside(),
            "rss": _rss(daemon.pid),
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
