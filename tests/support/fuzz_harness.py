"""The harness of the fuzz test (tests/integration/test_fuzz.py): a private tree to run
the daemon in, raw-bytes stubs that send what tests/support/fuzz.py generates, the
per-call checks of every status, and a run's findings with one reproduction per class."""

from __future__ import annotations

import hashlib
import os
import re
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
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.checksum import checksum_bytes
from tierckpt.names import is_checkpoint_id
from tierckpt.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

from tests.support.daemon_process import DaemonProcess
from tests.support.fuzz import ESCAPE_MARK, Call, Fuzzer, Method, Save

__all__ = [
    "CALL_TIMEOUT",
    "Checker",
    "Run",
    "Sandbox",
    "Sender",
    "SilentPeer",
    "alive",
    "clear_for_sanity",
    "log_growth",
    "rss",
    "tree_diff",
]

DEPTH = 8  # levels between the private tree and the memory dir (see tests/support/fuzz.py)
CALL_TIMEOUT = 5.0
HEALTH_TIMEOUT = 10.0  # generous: the CI machine has 2 loaded cores
MAX_DETAILS = 2048
MAX_STREAM_REPLIES = 64
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
HARNESS = "harness: "  # a reply the harness made up: the save could not write a file
# A Python traceback or an exception repr ("OSError(28, ...)", "ValueError('...')").
TRACEBACK = re.compile(r"Traceback|File \"|\b[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\(")
HOST_PATHS = ("/dev/shm", "/tmp", "/home", "/root")
T = TypeVar("T")


@dataclass
class Violation:
    assertion: str
    call: Call | None
    code: str
    detail: str


def squeeze(text: str) -> str:
    """Runs of one character as `x*5000`, so a report line stays readable."""
    return re.sub(r"(.)\1{15,}", lambda m: f"{m.group(1)}*{len(m.group(0))}", text)


@dataclass
class Run:
    """What one fuzz run saw."""

    violations: list[Violation] = field(default_factory=list)
    codes: Counter[str] = field(default_factory=Counter)
    calls: int = 0
    rpcs: int = 0  # RPCs sent (a save is several)
    rss_series: list[int] = field(default_factory=list)  # VmRSS every CHECK_EVERY calls
    rss_warm: int = 0
    by_method: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    busy: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    slowest: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    notes: list[str] = field(default_factory=list)

    def add(self, assertion: str, call: Call | None, code: str, detail: str) -> None:
        self.violations.append(Violation(assertion, call, code, squeeze(detail)[:400]))

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
                lines.append(f"    call #{first.call.index}: {squeeze(first.call.describe(300))}")
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


class SilentPeer:
    """The configured peer the fuzzer poses as: a gRPC server with no services, so the
    daemon's own calls to it (holdings at commit) end at once with UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        self.port = int(self.server.add_insecure_port("127.0.0.1:0"))
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def rss(pid: int) -> int:
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
                    return (
                        grpc.StatusCode.OK,
                        "",
                        [f"{HARNESS}outside the memory dir: {path}".encode()],
                    )
                written = content
                if name == save.corrupt:
                    written = bytes([content[0] ^ 1]) + content[1:] if content else b"x"
                try:
                    with path.open("r+b") as f:
                        f.write(written)
                        f.truncate(len(written))
                except OSError as e:
                    return grpc.StatusCode.OK, "", [f"{HARNESS}not writable: {e}".encode()]
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
        if replies and replies[0].startswith(HARNESS.encode()):
            detail = replies[0].decode(errors="replace")
            self.run.add("a rank can write the file OpenFile returned", call, name, detail)
        if call.method.service.endswith("PeerService"):
            for reply in replies:
                if any(p.encode() in reply for p in self.local_paths):
                    leaked = next(p for p in self.local_paths if p.encode() in reply)
                    self.run.add("local path in a PeerService reply", call, name, leaked)
                    break


def health(address: str) -> str:
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


def alive(daemon: DaemonProcess, peer_address: str) -> str:
    if not daemon.running:
        return f"tierckptd exited with {daemon.proc.returncode if daemon.proc else '?'}"
    for where, address in (("local socket", daemon.address), ("peer port", peer_address)):
        problem = health(address)
        if problem:
            return f"Health.Check on the {where} not SERVING: {problem}"
    return ""


def log_growth(path: Path, offset: int) -> tuple[int, int, int, str]:
    """(bytes, lines, longest line, counts of WARNING/ERROR/tracebacks) the log gained
    after `offset`."""
    with path.open("rb") as f:
        f.seek(offset)
        tail = f.read()
    lines = tail.splitlines()
    levels = Counter(
        word for line in lines for word in (b" WARNING ", b" ERROR ", b"Traceback") if word in line
    )
    shown = ", ".join(f"{n} {w.decode().strip()}" for w, n in levels.items()) or "no warnings"
    return len(tail), len(lines), max((len(line) for line in lines), default=0), shown


def tree_diff(before: dict[str, Any], after: dict[str, Any]) -> str:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return f"added {added[:5]}, removed {removed[:5]}, changed {changed[:5]}"


def clear_for_sanity(address: str, run: Run) -> None:
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
