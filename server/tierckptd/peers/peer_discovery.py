"""Peers from the platform: a hostfile and DNS (a Kubernetes headless Service) beside the
static `[[peers]]`, re-read every `[membership] refresh` seconds (issue 13).

A source gives addresses; the node id and failure domain at an address come from its
`Hello` answer, proven (`PeerClient.hello`): with a token the daemon there proves it
holds the token (challenge-response: no token is sent to it), with mutual TLS its
certificate names the id it answers with. An address that answers without proof is no
member (a WARNING names the address and the id it claimed). A hostfile line that names
its id is taken as written once its address has proven that id (or what it proves
instead). Every address is said Hello to
each round, also to learn whether its daemon knows this node yet (a joining node pulls
the manifests it was refused once it does). Everything read is untrusted and bounded: a hostfile of at most
MAX_HOSTFILE_BYTES, lines of at most MAX_LINE characters (a bad line is skipped with a
warning), at most MAX_MEMBERS members, names and addresses validated where they enter.
A source that fails (file unreadable, DNS down) keeps its last good answer: a resolver
hiccup must not empty the cluster. A node whose Hello fails keeps the identity it last
proved (it may be restarting); it leaves when its address leaves the sources.

Two addresses claiming one node id never displace a member: `[[peers]]` wins over any
discovered claim; among discovered addresses the one that is the member now stays, and
when none is, neither is taken until only one claims the id. Each conflict is warned
about once and counted (tierckpt_membership_refused_total{reason="conflict"}).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tierckpt.errors import InvalidName
from tierckpt.names import check_namespace

from tierckptd.config import Config, PeerConfig
from tierckptd.config_checks import is_dns_name, peer_port
from tierckptd.ops import metrics
from tierckptd.peers.client import PeerCallError
from tierckptd.peers.cluster import Cluster
from tierckptd.wire import bounded

__all__ = [
    "MAX_HOSTFILE_BYTES",
    "MAX_LINE",
    "MAX_MEMBERS",
    "Discoverer",
    "HostEntry",
    "SourceError",
    "admitted",
    "check_address",
    "discoverer_for",
    "parse_hostfile",
    "read_hostfile",
    "resolve_dns",
]

logger = logging.getLogger(__name__)

MAX_HOSTFILE_BYTES = 1 << 20
MAX_LINE = 512
MAX_MEMBERS = 4096
HELLO_WORKERS = 8
# A wake-up (a stranger said Hello) runs a round at most this often.
MIN_ROUND_GAP = 1.0
_MAX_WARNED = 1024

Resolver = Callable[..., list[tuple[Any, ...]]]
# (address, node id known there or "") -> (node id, failure domain, whether it knows this
# node as a member) of the daemon answering there; raises when none answers.
Hello = Callable[[str, str], tuple[str, str, bool]]
# While a peer does not know this node yet (it is joining), rounds run this often, at most
# SOON_ROUNDS times in a row: the peer looks again when it is said Hello to.
SOON = 2.0
SOON_ROUNDS = 15


class SourceError(Exception):
    """A membership source could not be read; the message names it and the cause."""


@dataclass(frozen=True)
class HostEntry:
    """One member address, with the node id and failure domain when the source names them."""

    address: str
    node_id: str = ""
    failure_domain: str = ""


def _name(value: str, what: str) -> str:
    try:
        return check_namespace(value)
    except InvalidName:
        raise ValueError(
            f"{what} {value[:64]!r}: use 1-128 characters from [A-Za-z0-9._-]"
        ) from None


def check_address(text: str) -> str:
    """A peer address "host:port", "[v6]:port" or "v4:port", validated and normalized
    (IPv6 bracketed); ValueError naming what is wrong."""
    text = text.strip()
    if len(text) > 260:
        raise ValueError(f"address {text[:64]!r}...: too long")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"address {text[:64]!r}: expected host:port with a port 1-65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ip = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"address {text[:64]!r}: {host[:64]} is not an IPv6 address") from None
        return f"[{ip}]:{int(port)}"
    try:
        return f"{ipaddress.IPv4Address(host)}:{int(port)}"
    except ValueError:
        pass
    if not is_dns_name(host):
        raise ValueError(f"address {text[:64]!r}: {host[:64]!r} is neither an IP nor a host name")
    return f"{host.lower()}:{int(port)}"


def parse_hostfile(text: str, where: str = "hostfile") -> tuple[list[HostEntry], list[str]]:
    """Entries of a hostfile and the problems of the lines skipped.

    A line is "address", "id address" or "id address failure_domain"; "#" starts a
    comment. At most MAX_MEMBERS entries are kept.
    """
    entries: list[HostEntry] = []
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            if len(raw) > MAX_LINE:
                raise ValueError(f"longer than {MAX_LINE} characters")
            fields = line.split()
            if len(fields) > 3:
                raise ValueError('expected "address", "id address" or "id address domain"')
            address = check_address(fields[0] if len(fields) == 1 else fields[1])
            node = _name(fields[0], "node id") if len(fields) > 1 else ""
            domain = _name(fields[2], "failure domain") if len(fields) > 2 else ""
        except ValueError as e:
            problems.append(f"{where} line {number}: {e}; line skipped")
            continue
        if len(entries) >= MAX_MEMBERS:
            problems.append(f"{where}: more than {MAX_MEMBERS} members; the rest is ignored")
            break
        entries.append(HostEntry(address, node, domain))
    return entries, problems


def read_hostfile(path: str) -> tuple[list[HostEntry], list[str]]:
    """The entries of the hostfile at `path` and the problems of the lines skipped;
    SourceError when it cannot be read, is larger than MAX_HOSTFILE_BYTES or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_HOSTFILE_BYTES + 1)
    except OSError as e:
        raise SourceError(f"[membership] hostfile {path}: {e.strerror or e}") from None
    if len(data) > MAX_HOSTFILE_BYTES:
        raise SourceError(
            f"[membership] hostfile {path} is larger than {MAX_HOSTFILE_BYTES} bytes: "
            "list one address per line"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"[membership] hostfile {path} is not UTF-8 text: {e}") from None
    return parse_hostfile(text, f"[membership] hostfile {path}")


def resolve_dns(name: str, port: int, resolver: Resolver = socket.getaddrinfo) -> list[str]:
    """The addresses (A and AAAA records) of `name` as "ip:port" / "[ip]:port", sorted,
    at most MAX_MEMBERS; SourceError when the name does not resolve."""
    try:
        infos = resolver(name, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise SourceError(f"[membership] dns {name}: {e}") from None
    found: set[str] = set()
    for info in infos:
        try:
            ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        except (ValueError, IndexError, TypeError):
            continue  # not an IP: nothing a resolver should return
        found.add(f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")
    addresses = sorted(found)
    if len(addresses) > MAX_MEMBERS:
        logger.warning("[membership] dns %s: %d addresses, using %d", name, len(found), MAX_MEMBERS)
    return addresses[:MAX_MEMBERS]


class Discoverer:
    """Re-reads the membership sources and applies the member list when it changes.

    Args:
        hello: (address, known node id or "") -> (node id, failure domain) of the daemon
            answering there; raises any exception when it does not answer.
        apply: takes the full peer list (static first) when it differs from the last.
        on_admitted: called (in the round) when a peer that did not know this node as a
            member does now: a joining node pulls the manifests it was refused at start.
    """

    def __init__(
        self,
        node_id: str,
        *,
        static: Sequence[PeerConfig] = (),
        hostfile: str = "",
        dns: str = "",
        port: int = 0,
        refresh: float = 10.0,
        hello: Hello,
        apply: Callable[[list[PeerConfig]], None],
        on_admitted: Callable[[], object] | None = None,
        resolver: Resolver = socket.getaddrinfo,
    ) -> None:
        self.node_id = node_id
        self.hostfile = hostfile
        self.dns = dns
        self.port = port
        self.refresh_interval = refresh
        self._hello = hello
        self._apply = apply
        self._on_admitted = on_admitted
        self._resolver = resolver
        self._static = list(static)
        self._lock = threading.Lock()  # one round at a time
        self._hosts: list[HostEntry] = []  # last good answer of each source
        self._dns: list[str] = []
        self._known: dict[str, tuple[str, str]] = {}  # address -> last Hello answer
        self._applied: list[PeerConfig] | None = None
        self._warned: set[tuple[str, str]] = set()
        self._problems: dict[str, list[str]] = {}
        self._silent: set[str] = set()  # addresses whose last Hello failed (logged once)
        self._unproven: set[str] = set()  # addresses that answered without proof, this round
        self._unadmitted: set[str] = set()  # answered, but do not know this node yet
        self._soon_left = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_round = 0.0

    def set_static(self, peers: Sequence[PeerConfig]) -> None:
        """SIGHUP: the new `[[peers]]`; applied by the next round (call `refresh`)."""
        with self._lock:
            self._static = list(peers)

    def _note(self, source: str, problems: list[str]) -> None:
        """Log a source's problems when they differ from its last round's (a bad line or
        a DNS outage is logged once, not every `refresh` seconds)."""
        if problems == self._problems.get(source, []):
            return
        self._problems[source] = problems
        for problem in problems[:20]:
            logger.warning("%s", problem)
        if len(problems) > 20:
            logger.warning("... and %d more problems with %s", len(problems) - 20, source)

    def _read_sources(self) -> list[HostEntry]:
        if self.hostfile:
            try:
                self._hosts, problems = read_hostfile(self.hostfile)
            except SourceError as e:
                problems = [f"{e}; keeping the last {len(self._hosts)} entries"]
            self._note("hostfile", problems)
        if self.dns:
            problems = []
            try:
                self._dns = resolve_dns(self.dns, self.port, self._resolver)
            except SourceError as e:
                problems = [f"{e}; keeping the last {len(self._dns)} addresses"]
            self._note("dns", problems)
        return [*self._hosts, *(HostEntry(a) for a in self._dns)]

    def _ask(self, address: str) -> tuple[str, str, bool] | None:
        """The validated, proven Hello answer at `address`, None when there is none
        (logged when the address falls silent, not every round; an answer without proof
        is warned about once and makes the address no member)."""
        known = self._known.get(address, ("", ""))[0]
        try:
            node, domain, knows_me = self._hello(address, known)
            node = _name(node, f"node id answered at {address}")
            domain = _name(domain, f"failure domain of {node}") if domain else node
        except PeerCallError as e:
            if e.code != "NOT_PROVEN":
                self._silence(address, e)
                return None
            self._unproven.add(address)
            metrics.MEMBERSHIP_REFUSED.labels(reason="unproven").inc()
            self._warn_once(
                ("unproven", address),
                "[membership] the daemon at %s is not a member: %s",
                address,
                bounded(e.details, 400),
            )
            return None
        except Exception as e:
            self._silence(address, e)
            return None
        self._silent.discard(address)
        return node, domain, bool(knows_me)

    def _silence(self, address: str, e: Exception) -> None:
        first = address not in self._silent
        self._silent.add(address)
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "[membership] no Hello from %s: %s",
            address,
            str(e)[:300],
        )

    def _warn_once(self, key: tuple[str, str], fmt: str, *args: object) -> None:
        if key not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add(key)
            logger.warning(fmt, *args)

    def refresh(self, *, force: bool = False) -> list[PeerConfig]:
        """One round: read the sources, ask every address without a named id who it is,
        apply the member list if it changed (or `force`: SIGHUP changed the copies);
        returns it."""
        with self._lock:
            self._last_round = time.monotonic()
            entries = self._read_sources()
            ask = list(dict.fromkeys(e.address for e in entries))
            self._unproven = set()
            with ThreadPoolExecutor(HELLO_WORKERS, thread_name_prefix="tierckptd-hello") as pool:
                answers = dict(zip(ask, pool.map(self._ask, ask), strict=True))
            self._silent &= set(ask)
            fresh = {a: got[:2] for a, got in answers.items() if got is not None}
            admitted = self._admission(answers)
            # An address that answered without proof loses what it proved before.
            self._known = {
                a: fresh.get(a) or self._known[a]
                for a in ask
                if a in fresh or (a in self._known and a not in self._unproven)
            }
            stale = {a: self._known[a] for a in ask if a not in fresh and a in self._known}
            named = {e.address: e for e in entries if e.node_id}
            proven = {**stale, **fresh}
            candidates = [
                *(self._named(e, proven[e.address]) for e in named.values() if e.address in proven),
                *(PeerConfig(n, a, d) for a, (n, d) in fresh.items() if a not in named),
                *(PeerConfig(n, a, d) for a, (n, d) in stale.items() if a not in named),
            ]
            peers = self._dedupe(self._static, candidates)
            if force or peers != self._applied:
                self._applied = peers
                self._apply(list(peers))
            if admitted and self._on_admitted is not None:
                logger.info("[membership] admitted by %s", ", ".join(sorted(admitted)[:20]))
                self._on_admitted()
            return list(peers)

    def _named(self, e: HostEntry, answer: tuple[str, str]) -> PeerConfig:
        """A hostfile line that names its node, once its address proved an id: as
        written, unless the daemon there proves it is another node (then what answered,
        and a warning once)."""
        if answer[0] == e.node_id:
            return PeerConfig(e.node_id, e.address, e.failure_domain or e.node_id)
        self._warn_once(
            (e.node_id, e.address),
            "[membership] the hostfile names %s at %s, but node %s answers there: "
            "taking %s; fix the line",
            e.node_id,
            e.address,
            answer[0],
            answer[0],
        )
        return PeerConfig(answer[0], e.address, answer[1])

    def _admission(self, answers: dict[str, tuple[str, str, bool] | None]) -> set[str]:
        """Addresses that did not know this node as a member and now do; keeps the ones
        that still do not (rounds run every SOON seconds while there are new ones)."""
        now_unadmitted = {
            a
            for a, got in answers.items()
            if got is not None and not got[2] and got[0] != self.node_id
        }
        admitted = {a for a in self._unadmitted if (got := answers.get(a)) is not None and got[2]}
        if now_unadmitted - self._unadmitted:
            self._soon_left = SOON_ROUNDS
        self._unadmitted = now_unadmitted
        return admitted

    def _dedupe(self, static: list[PeerConfig], found: list[PeerConfig]) -> list[PeerConfig]:
        """The members: `static` (first wins), then the discovered ones. An id claimed
        at several addresses keeps its static peer, else the address that is its member
        now, else none of them (until only one claims it): never the first in order."""
        peers: dict[str, PeerConfig] = {}
        addresses: set[str] = set()
        for p in static:
            if p.id == self.node_id or p.id in peers or p.address in addresses:
                continue
            peers[p.id] = p
            addresses.add(p.address)
        claims: dict[str, list[PeerConfig]] = {}
        for p in found:
            if p.id == self.node_id or p.address in addresses:
                continue  # this node itself (its own address in DNS), or a repeat
            if all(p.address != q.address for q in claims.get(p.id, [])):
                claims.setdefault(p.id, []).append(p)
        current = {p.id: p.address for p in self._applied or ()}
        for node, ps in claims.items():
            kept: PeerConfig | None = ps[0]
            if node in peers or len(ps) > 1:
                if node in peers:
                    kept, others = peers[node], ps
                else:
                    kept = next((p for p in ps if p.address == current.get(node)), None)
                    others = [p for p in ps if p is not kept]
                self._conflict(node, kept, others)
                if node in peers or kept is None:
                    continue
            assert kept is not None
            if kept.address in addresses:
                continue
            if len(peers) >= MAX_MEMBERS:
                logger.warning(
                    "[membership] more than %d members: the rest is ignored", MAX_MEMBERS
                )
                break
            peers[node] = kept
            addresses.add(kept.address)
        return list(peers.values())

    def _conflict(self, node: str, kept: PeerConfig | None, others: list[PeerConfig]) -> None:
        """Warn once per claiming address, and count, an id claimed at several addresses."""
        where = " and ".join(([] if kept is None else [kept.address]) + [p.address for p in others])
        for p in others:
            if (node, p.address) in self._warned:
                continue
            metrics.MEMBERSHIP_REFUSED.labels(reason="conflict").inc()
            self._warn_once(
                (node, p.address),
                "[membership] node id %s is claimed at %s: keeping %s; give every daemon "
                "its own [node] id (TIERCKPT_NODE_ID), and look for an impostor",
                node,
                bounded(where, 300),
                "none of them (none is a member yet)" if kept is None else kept.address,
            )

    # ---- background -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tierckptd-membership", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Run a round soon (a node not yet a member said Hello: it is joining)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            soon = bool(self._unadmitted) and self._soon_left > 0
            if soon:
                self._soon_left -= 1
            woken = self._wake.wait(
                min(SOON, self.refresh_interval) if soon else self.refresh_interval
            )
            self._wake.clear()
            if self._stop.is_set():
                return
            gap = MIN_ROUND_GAP - (time.monotonic() - self._last_round)
            if gap > 0 and self._stop.wait(gap):
                return
            try:
                metrics.MEMBERSHIP_ROUNDS.labels(trigger="wake" if woken else "timer").inc()
                self.refresh()
            except Exception:
                logger.exception("[membership] refresh failed; keeping the current members")


def admitted(cluster: Cluster) -> None:
    """Peers that refused this joining node now know it: pull the manifests they refused
    at start, and heal every checkpoint again (the heal that ran while they refused it saw
    them as unreachable)."""
    cluster.pull_manifests()
    cluster.heal_all()


def discoverer_for(
    config: Config, cluster: Cluster, copies: Callable[[], int]
) -> Discoverer | None:
    """The `[membership]` discoverer of a daemon (None when it names no source), its first
    round run now; members found go to `cluster.configure` with `copies()`. A node that
    says Hello and is not a member yet makes the next round run at once."""
    m = config.membership
    if not (m.dns or m.hostfile):
        return None
    discoverer = Discoverer(
        config.node.id,
        static=config.peers,
        hostfile=m.hostfile,
        dns=m.dns,
        port=peer_port(config),
        refresh=m.refresh,
        hello=cluster.client.hello,
        apply=lambda peers: cluster.configure(peers, copies()),
        on_admitted=lambda: admitted(cluster),
    )
    cluster.membership.strangers.add(lambda node: discoverer.wake())
    discoverer.refresh()
    return discoverer
