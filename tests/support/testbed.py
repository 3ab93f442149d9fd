"""A multi-host testbed on one machine: every node in its own network namespace, with its
own address on a shared Linux bridge, and network faults that can be injected and healed.

Without it every daemon-to-daemon byte crosses loopback: no link goes down, no peer
half-answers, no link is slow. Here node i lives in namespace `<prefix><run>n<i>`, its
`eth0` (a veth pair whose other end `<prefix><run>v<i>` is a port of the bridge
`<prefix><run>br`) holds 10.77.0.<i+1>/24, and a process is put in it with `ip netns
exec`. Filesystem paths are shared, so a daemon's local unix socket still reaches the
test process and the ranks of its node; only TCP/IP is partitioned.

Faults (each a `Fault`, healed by `heal()` or on leaving its `with` block):
    cut_node        the node's bridge port goes down (a pulled cable: silent drops)
    cut_between     two groups (racks) cannot reach each other; each still reaches the rest
    cut_one_way     packets from one group to another are lost, the reverse ones delivered
    flap            the node's port goes down and up on a schedule
    freeze          SIGSTOP a process (a hung daemon whose sockets stay open)
    slow_link       the node's link shaped by a token bucket (`tc qdisc tbf`) both ways

The kernel this project's CI runs has `tbf` and `htb` but no `netem`, no tc `gact` drop
action, and no iptables/nft userland; so group and one-way cuts point the peers' IPv4
neighbour entries at a MAC no port owns (`ip neigh replace ... nud permanent`), which
drops the frames silently at the bridge exactly as a partition does. Latency and random
loss are left out (docs/reliability.md says how they could come).

Every run takes a short random id, holds an flock on `/run/tierckpt-testbed/<id>.lock`
while it lives, and removes everything it made in `close()` (also at interpreter exit).
A run killed with SIGKILL leaves its lock unheld: the next testbed sweeps such runs'
namespaces (killing what still runs in them), links and bridges before it starts.
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType

__all__ = [
    "IFACE",
    "PREFIX",
    "Fault",
    "Flap",
    "Node",
    "Testbed",
    "TestbedError",
    "TestbedUnavailable",
    "TbfShape",
    "leftovers",
    "sweep_stale",
    "unavailable_reason",
]

PREFIX = "tckb"  # tierckpt testbed: every namespace, link and bridge name starts with it
SUBNET = "10.77.0"  # a /24 that exists only inside this run's namespaces and bridge
IFACE = "eth0"  # the node's interface inside its namespace
LOCK_DIR = Path("/run/tierckpt-testbed")
# A locally administered MAC that no port of any bridge owns: frames sent to it are
# flooded by the bridge and dropped by every receiver, i.e. lost without an error.
NOWHERE_MAC = "02:00:00:00:00:01"
_NAME = re.compile(rf"^{PREFIX}([0-9a-f]{{4}})(?:n|v|br)\d*$")
_COMMAND_TIMEOUT = 30.0


class TestbedUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no netns support)."""

    __test__ = False  # not a pytest test class, whatever its name


class TestbedError(RuntimeError):
    """An `ip`/`tc` command of the testbed failed; the message holds the command and stderr."""

    __test__ = False


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, check=False
    )
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why no testbed can be made on this machine, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        uid = os.geteuid() if hasattr(os, "geteuid") else "unknown"
        return f"network namespaces need root (running as uid {uid})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not on PATH"
    return None


# --- runs, their locks, and the sweep of dead ones ----------------------------------------


def _lock_path(run: str) -> Path:
    return LOCK_DIR / f"{run}.lock"


def _netns_names() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def leftovers(run: str | None = None) -> list[str]:
    """Namespaces and links named like a testbed's (of run `run`, or of any run)."""
    found = []
    for name in _netns_names() + _link_names():
        match = _NAME.match(name)
        if match and (run is None or match.group(1) == run):
            found.append(name)
    return found


def _is_held(run: str) -> bool:
    """Whether a live testbed holds run `run`'s lock (a dead one's lock is free)."""
    try:
        fd = os.open(_lock_path(run), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock we may have taken
    return False


def _remove_run(run: str, netns: Iterable[str], links: Iterable[str]) -> None:
    """Kill every process in the run's namespaces, then delete them, its links and bridge."""
    for ns in netns:
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", ns, check=False)
    # Veth pairs go with their namespace end; delete what is left, the bridge last.
    for link in sorted(links, key=lambda name: name.endswith("br")):
        _run("ip", "link", "del", link, check=False)


def sweep_stale() -> list[str]:
    """Remove the namespaces, links and bridges of testbed runs whose owner died; return
    their names. Live runs (their lock held) are left alone, so parallel runs are safe."""
    by_run: dict[str, tuple[list[str], list[str]]] = {}
    for name in _netns_names():
        if match := _NAME.match(name):
            by_run.setdefault(match.group(1), ([], []))[0].append(name)
    for name in _link_names():
        if match := _NAME.match(name):
            by_run.setdefault(match.group(1), ([], []))[1].append(name)
    removed: list[str] = []
    for run, (netns, links) in sorted(by_run.items()):
        if _is_held(run):
            continue
        _remove_run(run, netns, links)
        _lock_path(run).unlink(missing_ok=True)
        removed += netns + links
    return removed


def _take_run() -> tuple[str, int]:
    """A fresh run id whose lock this process holds (the fd keeps it until closed)."""
    LOCK_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    taken = set(leftovers())
    for _ in range(100):
        run = secrets.token_hex(2)
        if any(_NAME.match(n) and n[len(PREFIX) : len(PREFIX) + 4] == run for n in taken):
            continue
        path = _lock_path(run)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        # A sweeper may have unlinked the file between our open and flock: then the lock
        # guards nothing a later sweeper can see, so take another id.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return run, fd
        os.close(fd)
    raise TestbedError(f"no free testbed run id under {LOCK_DIR}")


# --- nodes, shapes and faults ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Node:
    """One host of the testbed: its namespace, its address, its bridge port, its rack."""

    index: int
    netns: str
    address: str  # IPv4 of its eth0, on the bridge's /24
    port: str  # the veth end on the bridge (down = the node's cable pulled)
    rack: str

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _port_up(node: Node, timeout: float = 5.0) -> None:
    """Bring the node's bridge port up and return once both ends carry traffic: the kernel
    applies a carrier change in its linkwatch work, up to a second after `ip link set up`,
    and drops every packet until then."""
    _run("ip", "link", "set", node.port, "up")
    deadline = time.monotonic() + timeout
    operstate = Path("/sys/class/net", node.port, "operstate")
    while True:
        inside = _run("ip", "-n", node.netns, "-o", "link", "show", IFACE, check=False).stdout
        if operstate.read_text().strip() == "up" and "state UP" in inside:
            return
        if time.monotonic() > deadline:
            raise TestbedError(f"{node.port} not up {timeout} s after `ip link set up`: {inside}")
        time.sleep(0.02)


@dataclasses.dataclass(frozen=True)
class TbfShape:
    """A token-bucket shaper (`tc qdisc tbf`): `rate` bytes/s with a `burst`-byte bucket.
    A transfer of `n` bytes through it takes at least `(n - burst) / rate` seconds."""

    rate: int  # bytes per second
    burst: int = 64 << 10  # at least one 64 KiB GSO packet of a veth
    latency_ms: int = 200  # how long a packet may queue before tbf drops it

    def tc_args(self) -> list[str]:
        return [
            "tbf",
            "rate",
            f"{self.rate * 8}bit",
            "burst",
            str(self.burst),
            "latency",
            f"{self.latency_ms}ms",
        ]

    def min_seconds(self, nbytes: int) -> float:
        """The least time `nbytes` can take through this shaper (both buckets full)."""
        return max(0.0, nbytes - self.burst) / self.rate


class Fault:
    """One injected fault; `heal()` undoes it (idempotent), as does leaving `with`."""

    def __init__(self, bed: Testbed, description: str, undo: Callable[[], object]) -> None:
        self.description = description
        self._bed = bed
        self._undo = undo
        self._lock = threading.Lock()
        self.healed = False

    def heal(self) -> None:
        with self._lock:
            if self.healed:
                return
            self.healed = True
        try:
            self._undo()
        finally:
            self._bed._forget(self)

    def __enter__(self) -> Fault:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.heal()

    def __repr__(self) -> str:
        return f"Fault({self.description}, healed={self.healed})"


class Flap(Fault):
    """A link that goes down for `down_s` and up for `up_s`, again and again, until healed
    (then it stays up). `cycles` counts the completed down-up cycles."""

    def __init__(self, bed: Testbed, node: Node, down_s: float, up_s: float) -> None:
        self.cycles = 0
        self._stop = threading.Event()
        self._node = node
        self._thread = threading.Thread(
            target=self._run, args=(down_s, up_s), name=f"flap-{node.port}", daemon=True
        )
        super().__init__(bed, f"flap {node.port} ({down_s}s down, {up_s}s up)", self._halt)
        self._thread.start()

    def _run(self, down_s: float, up_s: float) -> None:
        while not self._stop.is_set():
            _run("ip", "link", "set", self._node.port, "down")
            if self._stop.wait(down_s):
                break
            _run("ip", "link", "set", self._node.port, "up")
            self.cycles += 1
            self._stop.wait(up_s)

    def _halt(self) -> None:
        self._stop.set()
        self._thread.join(timeout=_COMMAND_TIMEOUT)
        self._bed._reconnect(self._node)


class Testbed:
    """`n` nodes in their own network namespaces on one bridge; see the module docstring.

    Args:
        n: how many nodes.
        racks: each node's rack (its failure domain); default one rack per node.
        shape: a token bucket every link starts with (None: links at veth speed).
    Raises:
        TestbedUnavailable: namespaces cannot be made here (the message says why).
    """

    __test__ = False

    def __init__(
        self, n: int, *, racks: Sequence[str] | None = None, shape: TbfShape | None = None
    ) -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"a testbed has 1 to 250 nodes, not {n}")
        if racks is not None and len(racks) != n:
            raise ValueError(f"{len(racks)} racks given for {n} nodes")
        reason = unavailable_reason()
        if reason is not None:
            raise TestbedUnavailable(reason)
        self.swept = sweep_stale()
        self.run, self._lock_fd = _take_run()
        self.base_shape = shape
        self.bridge = f"{PREFIX}{self.run}br"
        self.nodes = [
            Node(
                index=i,
                netns=f"{PREFIX}{self.run}n{i}",
                address=f"{SUBNET}.{i + 1}",
                port=f"{PREFIX}{self.run}v{i}",
                rack=racks[i] if racks is not None else f"rack{i}",
            )
            for i in range(n)
        ]
        self._faults: list[Fault] = []
        self._faults_lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        first = _run("ip", "netns", "add", self.nodes[0].netns, check=False)
        if first.returncode != 0:
            raise TestbedUnavailable(
                f"`ip netns add` failed here: {first.stderr.strip()} (network namespaces "
                "need root and a kernel with CONFIG_NET_NS)"
            )
        _run("ip", "link", "add", self.bridge, "type", "bridge", "stp_state", "0")
        _run("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            if node.index:
                _run("ip", "netns", "add", node.netns)
            _run(
                "ip", "link", "add", node.port, "type", "veth",
                "peer", "name", IFACE, "netns", node.netns,
            )  # fmt: skip
            _run("ip", "link", "set", node.port, "master", self.bridge, "up")
            _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", IFACE)
            _run("ip", "-n", node.netns, "link", "set", IFACE, "up")
            _run("ip", "-n", node.netns, "link", "set", "lo", "up")
            if self.base_shape is not None:
                self._shape(node, self.base_shape)

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Heal every fault, kill what still runs in the namespaces, delete everything."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for fault in list(self._faults):
            try:
                fault.heal()
            except TestbedError:
                pass  # the namespace goes anyway
        _remove_run(self.run, [n.netns for n in self.nodes], [n.port for n in self.nodes])
        _run("ip", "link", "del", self.bridge, check=False)
        _lock_path(self.run).unlink(missing_ok=True)
        os.close(self._lock_fd)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- looking at it --------------------------------------------------------------------
    def rack(self, name: str) -> list[Node]:
        return [node for node in self.nodes if node.rack == name]

    @property
    def faults(self) -> list[Fault]:
        """The faults in force now."""
        with self._faults_lock:
            return list(self._faults)

    def port_bytes(self, node: Node) -> tuple[int, int]:
        """(bytes the node sent, bytes it received) through its bridge port so far."""
        stats = Path("/sys/class/net", node.port, "statistics")
        # The bridge side's rx is what the node sent, its tx what the node received.
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def run_in(
        self, node: Node, argv: Sequence[str], *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command inside the node's namespace."""
        return _run(*node.exec_argv(argv), check=check)

    # -- faults -----------------------------------------------------------------------------
    def _add(self, fault: Fault) -> Fault:
        with self._faults_lock:
            self._faults.append(fault)
        return fault

    def _forget(self, fault: Fault) -> None:
        with self._faults_lock:
            if fault in self._faults:
                self._faults.remove(fault)

    def cut_node(self, node: Node) -> Fault:
        """The node's cable is pulled: its bridge port goes down, every packet to or from
        it is lost; its processes and their sockets live on (no RST, no error). Healing
        returns once the link carries traffic again."""
        _run("ip", "link", "set", node.port, "down")
        return self._add(Fault(self, f"cut {node.netns}", lambda: self._reconnect(node)))

    def _reconnect(self, node: Node) -> None:
        """Bring the node's port back up and forget what ARP learnt while it was down: a
        neighbour entry left FAILED or PROBE by the cut holds the next packets for up to a
        second (its retransmit time); a fresh one resolves at once. Permanent entries (the
        group cuts) are kept."""
        _port_up(node)
        _run("ip", "-n", node.netns, "neigh", "flush", "dev", IFACE, check=False)
        for other in self.nodes:
            if other is not node:
                _run(
                    "ip", "-n", other.netns, "neigh", "flush", "to", node.address, "dev", IFACE,
                    check=False,
                )  # fmt: skip

    def _blackhole(self, src: Node, dst: Node) -> Callable[[], None]:
        """Frames from `src` to `dst`'s address go to a MAC nobody has; the undo."""
        _run(
            "ip", "-n", src.netns, "neigh", "replace", dst.address,
            "lladdr", NOWHERE_MAC, "dev", IFACE, "nud", "permanent",
        )  # fmt: skip

        def undo() -> None:
            _run("ip", "-n", src.netns, "neigh", "del", dst.address, "dev", IFACE, check=False)

        return undo

    def cut_one_way(self, sources: Iterable[Node], targets: Iterable[Node]) -> Fault:
        """Every packet from a node of `sources` to one of `targets` is lost; packets the
        other way arrive (a peer that receives requests but whose answers never come back).
        Over TCP no connection between them completes either way, but the far side's SYNs
        and requests do arrive and are acted on."""
        src, dst = list(sources), list(targets)
        undos = [self._blackhole(s, t) for s in src for t in dst if s != t]
        names = f"{[n.index for n in src]} -> {[n.index for n in dst]}"
        return self._add(Fault(self, f"one-way cut {names}", lambda: [u() for u in undos]))

    def cut_between(self, group_a: Iterable[Node], group_b: Iterable[Node]) -> Fault:
        """The two groups (e.g. racks) cannot reach each other; each node still reaches its
        own group and every node outside both (a partition of a spine link)."""
        a, b = list(group_a), list(group_b)
        undos = [self._blackhole(s, t) for s in a for t in b if s != t]
        undos += [self._blackhole(s, t) for s in b for t in a if s != t]
        names = f"{[n.index for n in a]} | {[n.index for n in b]}"
        return self._add(Fault(self, f"cut {names}", lambda: [u() for u in undos]))

    def cut_rack(self, rack_a: str, rack_b: str) -> Fault:
        """`cut_between` the nodes of two racks."""
        a, b = self.rack(rack_a), self.rack(rack_b)
        if not a or not b:
            raise ValueError(f"no nodes in rack {rack_a!r} or {rack_b!r}")
        return self.cut_between(a, b)

    def flap(self, node: Node, down_s: float, up_s: float) -> Flap:
        """The node's link flaps: down `down_s`, up `up_s`, repeated until healed."""
        fault = Flap(self, node, down_s, up_s)
        self._add(fault)
        return fault

    def freeze(self, pid: int) -> Fault:
        """SIGSTOP a process (its whole group when it leads one): it keeps every socket
        open and the kernel keeps accepting connections for it, but it answers nothing."""
        target = pid if os.getpgid(pid) == pid else None

        def send(sig: signal.Signals) -> None:
            try:
                if target is not None:
                    os.killpg(target, sig)
                else:
                    os.kill(pid, sig)
            except ProcessLookupError:
                pass

        send(signal.SIGSTOP)
        return self._add(Fault(self, f"freeze pid {pid}", lambda: send(signal.SIGCONT)))

    def _shape(self, node: Node, shape: TbfShape) -> None:
        # The node's egress (its eth0) and its ingress (the bridge port's egress).
        _run("tc", "-n", node.netns, "qdisc", "replace", "dev", IFACE, "root", *shape.tc_args())
        _run("tc", "qdisc", "replace", "dev", node.port, "root", *shape.tc_args())

    def _unshape(self, node: Node) -> None:
        if self.base_shape is not None:
            self._shape(node, self.base_shape)
            return
        _run("tc", "-n", node.netns, "qdisc", "del", "dev", IFACE, "root", check=False)
        _run("tc", "qdisc", "del", "dev", node.port, "root", check=False)

    def slow_link(self, node: Node, shape: TbfShape) -> Fault:
        """The node's link carries at most `shape.rate` bytes/s each way (tbf); healing
        puts back the testbed's base shape (or none)."""
        self._shape(node, shape)
        return self._add(
            Fault(
                self,
                f"slow {node.netns} to {shape.rate} B/s",
                lambda: self._unshape(node),
            )
        )
