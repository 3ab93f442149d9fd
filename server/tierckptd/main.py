"""Composition root of tierckptd: `build(config) -> Parts`, then `run(parts)`.

`build` makes every part once, in dependency order, and hands each its collaborators and
callbacks in its constructor; a part built later that must hear from one built earlier
subscribes to that part's listener registry (`ops.events`: e.g. the drainer to
`catalog.events.committed`), and no attribute of a part is written from outside. The
whole run-time graph is readable in `build`.

`run` starts the background work, says READY, and waits for signals. Signal handlers only
enqueue (gunicorn style); the main loop acts and logs, so nothing non-reentrant ever runs
inside a handler. Order at start: lock the memory dir, adopt it, bind the sockets, health
SERVING, READY=1, then the persistent tier's work in the background
(`persistent.startup`: nothing of S3 delays READY). Order at stop: health NOT_SERVING,
STOPPING=1, stop the servers with a grace period, remove the socket, release the lock.

Logging never shows secrets: SIGHUP diffs are redacted (`config_changes`) and the S3
client libraries stay quiet below INFO (`persistent.errors.QUIET_LOGGERS`).
"""

from __future__ import annotations

import argparse
import collections
import functools
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from tierckpt.errors import TierckptError
from tierckpt.units import format_size

from tierckptd import __version__
from tierckptd.catalog import Catalog, Sweeper
from tierckptd.catalog.prewarm import NextSaveWarmer
from tierckptd.catalog.views import freshness
from tierckptd.commit import CommitCoordinator
from tierckptd.config import Config, ConfigError, exposure_warnings, load_config
from tierckptd.config_secrets import config_changes, config_file_warnings
from tierckptd.jobs import JobQueue, StepAside
from tierckptd.memory.capacity import budget_warnings
from tierckptd.memory.scrubber import Scrubber
from tierckptd.memory.tier import MemoryTier, MemoryTierLocked
from tierckptd.ops import metrics
from tierckptd.ops.events import Listeners
from tierckptd.ops.logs import set_log_format, set_log_level, setup_logging
from tierckptd.ops.malloc_tuning import tune_malloc
from tierckptd.ops.priority import at_idle_priority
from tierckptd.ops.systemd import sd_notify
from tierckptd.peers import security as auth
from tierckptd.peers.bulk_client import BulkFetcher
from tierckptd.peers.bulk_grants import Grants
from tierckptd.peers.bulk_server import BulkServer
from tierckptd.peers.bulk_wire import client_context as bulk_client_context
from tierckptd.peers.bulk_wire import server_context as bulk_server_context
from tierckptd.peers.client import PeerClient
from tierckptd.peers.cluster import Cluster
from tierckptd.peers.membership import PEER_CHANNEL_OPTIONS, Membership
from tierckptd.peers.peer_discovery import Discoverer, discoverer_for
from tierckptd.peers.source import PeerSources
from tierckptd.peers.unfinished import UnfinishedSaves
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.drain_plan import PeerHolding, PeerLookup
from tierckptd.persistent.errors import QUIET_LOGGERS
from tierckptd.persistent.listing import Discovery
from tierckptd.persistent.retention import remove_checkpoint
from tierckptd.persistent.roots import Roots
from tierckptd.persistent.startup import start_in_background as start_persistent
from tierckptd.persistent.store import RetryPolicy
from tierckptd.persistent.trust_marker import store_trust
from tierckptd.restore import Restorer, RestoreSources
from tierckptd.rpc.daemon_service import DaemonService
from tierckptd.rpc.health import Health, probe
from tierckptd.rpc.local_access import IsolationUnsupported, LocalAccess, open_local_access
from tierckptd.rpc.peer_service import add_peer_service
from tierckptd.rpc.servers import AddressInUse, Servers, parse_local, start_servers
from tierckptd.sagemaker import DaemonAdapter, SeedListener, start_listener

__all__ = ["BuildFailed", "Parts", "build", "listen_for_signals", "main", "run"]

logger = logging.getLogger(__name__)

STOP_GRACE = 5.0
_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class BuildFailed(Exception):
    """A part could not be built: the exit status (2: configuration, 1: the host), and
    whether the message is for stderr (a config error) or the log."""

    def __init__(self, status: int, message: str, *, stderr: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.stderr = stderr


@dataclass(frozen=True)
class Warmer:
    """`[memory] prewarm_next`: the planner and its one worker queue."""

    warmer: NextSaveWarmer
    queue: JobQueue[str]


@dataclass(frozen=True)
class Parts:
    """Every part of one daemon, built and wired by `build`; `run` starts and stops them."""

    config: Config
    tier: MemoryTier
    catalog: Catalog
    stores: Roots
    peer_client: PeerClient
    restorer: Restorer
    cluster: Cluster
    commits: CommitCoordinator
    access: LocalAccess | None
    drainer: Drainer | None
    discovery: Discovery | None
    daemon: DaemonService
    health: Health
    servers: Servers
    bulk: BulkServer | None  # [listen] peer_bulk_port: file bytes to peers
    unfinished: UnfinishedSaves
    sweeper: Sweeper
    warmer: Warmer | None
    scrubber: Scrubber | None
    seed: SeedListener | None  # [listen] sagemaker: the seed client's HTTP API


def _ask_owner(client: PeerClient, namespace: str) -> tuple[int, str] | None:
    """Before a uid claims a namespace this node has not seen: its owner per the peers
    that answer (at once, one deadline for those that do not), else None."""
    found = client.each(lambda node: client.namespace_owner(node, namespace), parallel=True)
    owners = sorted(o for o in found.values() if o is not None)
    return owners[0] if owners else None


def _peer_holdings(client: PeerClient) -> PeerLookup:
    """The drain's view of the peers: what each holds of a checkpoint (None: no answer),
    so a replica holder drains the files of an owner that is gone."""

    def lookup(
        namespace: str, checkpoint_id: str, nodes: Collection[str]
    ) -> dict[str, PeerHolding | None]:
        asked = [n for n in client.peer_ids if n in nodes]
        found = client.each(
            lambda node: client.holdings(node, namespace, checkpoint_id), nodes=asked
        )
        return {
            node: None if (h := found.get(node)) is None else PeerHolding(h.known, h.names)
            for node in asked
        }

    return lookup


def _open_tier(cfg: Config) -> MemoryTier:
    tier = MemoryTier(cfg.memory.dir)
    try:
        tier.open_layout()
    except MemoryTierLocked as e:
        raise BuildFailed(1, str(e)) from e
    except OSError as e:
        raise BuildFailed(1, f"cannot use [memory] dir {cfg.memory.dir}: {e}") from e
    for warning in budget_warnings(cfg.memory.budget, tier.root):
        logger.warning("%s", warning)
    return tier


def _bind_metrics(cfg: Config, catalog: Catalog, peer_client: PeerClient) -> None:
    metrics.bind_gauges(
        cfg.memory.budget,
        catalog.used_bytes,
        catalog.reserved_bytes,
        catalog.pool_bytes,
        catalog.committed_count,
    )
    metrics.bind_prewarm_gauges(
        lambda: catalog.status().prewarm_pending_bytes,
        lambda: catalog.status().prewarm_ready_bytes,
    )
    metrics.bind_freshness(
        lambda: freshness(catalog.list_checkpoints()),
        max_namespaces=cfg.metrics.namespace_series,
        hash_labels=cfg.metrics.hash_namespaces,
    )
    metrics.bind_peers(lambda: peer_client.peer_ids)
    if cfg.metrics.listen:
        metrics.serve(cfg.metrics.listen)


def _warmer(cfg: Config, catalog: Catalog) -> Warmer | None:
    """`[memory] prewarm_next`: after each commit, warm the namespace's next save's
    pool segments on one worker thread (only when evicted files are recycled too)."""
    memory = cfg.memory
    if not (memory.prewarm_next and memory.recycle):
        return None
    warmer = NextSaveWarmer(catalog, max_bytes=memory.prewarm_next_max)
    # Idle priority: the pages are touched while training computes on the same cores.
    queue: JobQueue[str] = JobQueue(
        at_idle_priority(warmer.run_pass), name="tierckptd-prewarm-next"
    )
    catalog.events.prewarm_pending.answer_with(lambda: warmer.pending_bytes)
    catalog.events.prewarm_next.add(queue.put)
    return Warmer(warmer, queue)


def _scrubber(cfg: Config, catalog: Catalog, tier: MemoryTier, cluster: Cluster) -> Scrubber | None:
    """`[memory] scrub_rate`: re-hash the memory copies in the background; a corrupt
    one goes the way of one found while served (dropped, repaired from a peer)."""
    memory = cfg.memory
    if memory.scrub_rate <= 0:
        return None
    return Scrubber(
        catalog,
        tier,
        rate=memory.scrub_rate,
        interval=memory.scrub_interval,
        on_corrupt=cluster.corrupt,
        step_aside=lambda stop: StepAside(catalog.saving, stop=stop).wait,
    )


def _bulk_server(
    cfg: Config, catalog: Catalog, cluster: Cluster, mutual_tls: bool
) -> BulkServer | None:
    """The bulk listener on the host of [listen] peer (none without a TCP peer listener,
    or with peer_bulk = false), with the peer port's TLS; its sends stall out in the
    fetchers' stall window."""
    peer = cfg.listen.peer
    if not peer or peer.startswith("unix:") or not cfg.listen.peer_bulk:
        return None
    host = peer.rpartition(":")[0]
    return BulkServer(
        catalog.file_view,
        Grants(),
        f"{host}:{cfg.listen.peer_bulk_port}",
        node_id=cfg.node.id,
        tls=bulk_server_context(cfg.security),
        mutual_tls=mutual_tls,
        stall=cluster.client.fetch_stall,
        on_corrupt=cluster.corrupt,
        saving=catalog.saving,
    )


def build(cfg: Config) -> Parts:
    """Build and wire every part of a daemon for `cfg`; the memory tier is adopted and the
    sockets are bound, nothing runs in the background yet. Raises `BuildFailed`."""
    try:  # [security] files are read once, now: before adopting the memory tier
        channel_factory = auth.peer_channel_factory(cfg.security, PEER_CHANNEL_OPTIONS)
        peer_security = auth.peer_server_security(cfg.security)
    except ConfigError as e:  # unreadable, empty or not PEM: as a bad config key
        raise BuildFailed(2, f"tierckptd: {e}", stderr=True) from e
    tier = _open_tier(cfg)
    try:
        return _build_on(cfg, tier, channel_factory, peer_security)
    except ConfigError as e:
        tier.close()
        raise BuildFailed(2, f"tierckptd: {e}", stderr=True) from e
    except (AddressInUse, IsolationUnsupported, OSError) as e:
        tier.close()
        raise BuildFailed(1, str(e)) from e
    except BaseException:
        tier.close()
        raise


def _build_on(
    cfg: Config,
    tier: MemoryTier,
    channel_factory: auth.ChannelFactory,
    peer_security: auth.PeerServerSecurity,
) -> Parts:
    # Short retries per operation: the drainer reschedules the whole job.
    stores = Roots.from_config(
        cfg.persistent, retry=RetryPolicy(max_attempts=4, deadline=15.0, cap=4.0)
    )
    catalog = Catalog(
        tier,
        node_id=cfg.node.id,
        failure_domain=cfg.node.failure_domain,
        budget=cfg.memory.budget,
        recycle=cfg.memory.recycle,
        memory_keep_last=cfg.retention.memory_keep_last,
        abandon_after=cfg.memory.abandon_after,
        max_namespaces=cfg.memory.max_namespaces,
        drain_every=cfg.persistent.every if stores.enabled else 0,
        default_persistent=stores.default is not None,
    )
    catalog.limit_peer_manifests(cfg.memory.peer_manifest_share)
    catalog.adopt()
    peer_client = PeerClient(
        Membership(
            cfg.node.id,
            cfg.node.failure_domain,
            peers=cfg.peers,
            copies=cfg.replication.copies,
            channel_factory=channel_factory,
        ),
        bulk=BulkFetcher(bulk_client_context(cfg.security), verify_names=bool(cfg.security.tls_ca)),
    )
    access = open_local_access(
        cfg.security.local_isolation,
        catalog,
        cfg.node.id,
        operators=cfg.security.operators,
        tenant_urls=cfg.security.tenant_urls,
        max_namespaces_per_uid=cfg.security.max_namespaces_per_uid,
        ask_peers=functools.partial(_ask_owner, peer_client),  # uid isolation, cluster-wide
    )
    _bind_metrics(cfg, catalog, peer_client)
    # The one restore chain (restore.py): memory, then the file's peer holders and the
    # other peers, then the persistent tier the checkpoint drained to.
    landed: Listeners[[str, str, str]] = Listeners()  # a peer's copy landed here
    rejected: Listeners[[str, str, str, str]] = Listeners()  # a peer's bulk bytes failed here
    restorer = Restorer(
        catalog,
        RestoreSources(
            catalog,
            peers=PeerSources(peer_client, landed, rejected),
            persistent=stores.source if stores.enabled else None,
        ),
    )
    iso = access
    cluster = Cluster(
        catalog,
        restorer,
        client=peer_client,
        heal_interval=cfg.replication.heal_interval,
        replace_after=cfg.replication.replace_after,
        unstore=functools.partial(remove_checkpoint, stores) if stores.enabled else None,
        store_trust=functools.partial(store_trust, stores) if stores.enabled else None,
        check_mark=(
            (lambda m: iso.check_mark(m.namespace, m.checkpoint_id, m.uid))
            if iso is not None
            else None
        ),
    )
    landed.add(cluster.copy_landed)
    rejected.add(cluster.copy_rejected)
    # Saves committed by a peer coordinator while this node missed the publish (idle
    # WRITING saves, orphans after a restart): the peers are asked before any is collected.
    unfinished = UnfinishedSaves(catalog, cluster.resolve_unfinished)
    drainer: Drainer | None = None
    discovery: Discovery | None = None
    if stores.enabled:
        discovers = bool(cfg.membership.dns or cfg.membership.hostfile)
        drainer = Drainer(
            catalog,
            stores,
            restore=restorer.ensure_local,
            keep_last=cfg.retention.persistent_keep_last,
            keep_every=cfg.retention.persistent_keep_every,
            peers=_peer_holdings(peer_client) if cfg.peers or discovers else None,
            owner_grace=cfg.persistent.owner_grace,
            max_backoff=cfg.persistent.retry_max,
            on_evicted=cluster.ops.retired,  # every node drops it
        )
        catalog.events.committed.add(drainer.enqueue)
        catalog.events.durable_elsewhere.add(drainer.check_now)
        discovery = Discovery(stores, catalog, relist_interval=cfg.persistent.relist_interval)
    # A commit asks the peer tier for the files it holds, commits the catalog, then the
    # peer tier publishes and heals (tierckptd/commit.py).
    commits = CommitCoordinator(
        catalog, cluster.committer, [cluster.committer], peers=len(peer_client.peer_ids)
    )
    peer_client.membership.resized.add(commits.peers_changed)  # [[peers]] on SIGHUP
    daemon = DaemonService(
        catalog,
        commits=commits,
        marks=cluster,
        restorer=restorer,
        access=access,
        discovery=discovery,
        persistent_urls=stores.check if stores.enabled else None,
    )
    health = Health()
    mutual_tls = peer_security.mutual_tls
    bulk = _bulk_server(cfg, catalog, cluster, mutual_tls)
    try:
        servers = start_servers(
            daemon,
            health,
            cfg.listen.local,
            cfg.listen.peer,
            register_peer=lambda server: add_peer_service(
                cluster, server, mutual_tls=mutual_tls, bulk=bulk
            ),
            peer_security=peer_security,
        )
    except BaseException:
        if bulk is not None:
            bulk.stop()
        raise
    if bulk is not None:
        bulk.start()
    # The seed client's HTTP API: the same commit, marks and restore chain as DaemonService.
    seed_daemon = DaemonAdapter(
        catalog, commits=commits, marks=cluster, restorer=restorer, discovery=discovery
    )
    try:
        seed = start_listener(cfg, seed_daemon)
    except BaseException:
        servers.stop(0)
        if bulk is not None:
            bulk.stop()
        raise
    return Parts(
        config=cfg,
        tier=tier,
        catalog=catalog,
        stores=stores,
        peer_client=peer_client,
        restorer=restorer,
        cluster=cluster,
        commits=commits,
        access=access,
        drainer=drainer,
        discovery=discovery,
        daemon=daemon,
        health=health,
        servers=servers,
        bulk=bulk,
        unfinished=unfinished,
        sweeper=Sweeper(unfinished),
        warmer=_warmer(cfg, catalog),
        scrubber=_scrubber(cfg, catalog, tier, cluster),
        seed=seed,
    )


class _Signals:
    """The signals the main loop acts on: queued by the handler, read by the loop."""

    def __init__(self) -> None:
        self.queue: collections.deque[int] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler: NO logging, just queue the signal and wake the main loop."""
        self.queue.append(signum)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass

    def wait(self) -> None:
        select.select([self._wake_r], [], [], 1.0)
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass


class _Running:
    """The state `run` changes: the config a SIGHUP reloads, and what SIGTERM asked."""

    def __init__(self, parts: Parts, config_path: str | None) -> None:
        self.parts = parts
        self.config = parts.config
        self.config_path = config_path
        self.emergency = False
        # [membership]: the first round now, so a restarted node knows its peers before
        # it asks them for manifests; then in the background (started with the cluster).
        self.discoverer: Discoverer | None = discoverer_for(
            parts.config, parts.cluster, lambda: self.config.replication.copies
        )

    def loop(self, signals: _Signals) -> None:
        while True:
            signals.wait()
            while signals.queue:
                signum = signals.queue.popleft()
                if signum == signal.SIGHUP:
                    self.reload()
                else:
                    logger.info("received %s: shutting down", signal.Signals(signum).name)
                    self.emergency = signum == signal.SIGTERM
                    return

    def reload(self) -> None:
        """SIGHUP: retry drain-failed checkpoints now (the operator's override), re-read
        the config file and log what changed."""
        parts = self.parts
        if parts.drainer is not None:
            parts.drainer.retry_failed()
        if self.config_path is None:
            logger.info("SIGHUP: no --config file to reload")
            return
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            logger.error("SIGHUP: keeping the running config: %s", e)
            return
        changes = config_changes(self.config, new)
        if not changes:
            logger.info("SIGHUP: %s unchanged", self.config_path)
        for line in changes:
            live = line.startswith(("peers", "log.", "replication."))
            logger.info("SIGHUP: %s%s", line, "" if live else " (takes effect on restart)")
        if self.discoverer is not None:  # [[peers]] and the discovered ones, together
            self.discoverer.set_static(new.peers)
            parts.cluster.set_healing(new.replication.heal_interval, new.replication.replace_after)
        elif new.peers != self.config.peers or new.replication != self.config.replication:
            parts.cluster.configure(new.peers, new.replication.copies)
            parts.cluster.set_healing(new.replication.heal_interval, new.replication.replace_after)
        if new.log.level != self.config.log.level:
            set_log_level(new.log.level, QUIET_LOGGERS)
        if new.log.format != self.config.log.format:
            set_log_format(new.log.format, self.config.node.id)
        self.config = new
        if self.discoverer is not None:
            self.discoverer.refresh(force=True)  # applies the new peers and copies now


def listen_for_signals() -> _Signals:
    """Queue SIGTERM, SIGINT and SIGHUP from now on (before `build`: a signal during the
    adoption of a large memory tier is acted on once the daemon runs)."""
    signals = _Signals()
    for signum in _HANDLED:
        signal.signal(signum, signals.handle)
    return signals


def run(parts: Parts, config_path: str | None = None, signals: _Signals | None = None) -> int:
    """Run the built daemon until SIGTERM/SIGINT; returns the exit status."""
    cfg, catalog, cluster = parts.config, parts.catalog, parts.cluster
    signals = signals if signals is not None else listen_for_signals()
    running = _Running(parts, config_path)
    # A replacement node (empty memory tier) learns the checkpoints peers know before
    # READY, so GetCheckpoint/ls work at once; the peer listener already answers.
    try:
        cluster.pull_manifests()
    except (TierckptError, OSError) as e:
        # A full tmpfs (or any tier error) while adopting what peers know: start
        # degraded, serving what this node holds; gossip pulls again later.
        logger.error("start-up pull of the peers' manifests stopped: %.300s", e)
    # Files of saves committed while this daemon was down (orphans) are kept once they
    # verify against a pulled manifest; the sweeper asks the peers about the others.
    parts.unfinished.salvage_orphans()
    if cluster.peer_ids:
        threading.Thread(
            target=cluster.republish_own, name="tierckptd-republish", daemon=True
        ).start()
    cluster.start()
    if running.discoverer is not None:
        running.discoverer.start()
    if parts.drainer is not None:
        parts.drainer.start()  # new commits drain at once; the resume comes below
    parts.health.serving()
    if parts.drainer is not None:
        # Nothing of S3 before READY (audit 3 H7, M7): stale uploads aborted, the
        # drain resumed and the durable checkpoints adopted on a thread of their own
        # (a peer's persistent-only manifest is never taken for lost meanwhile: the
        # healer skips files no node claims, and peers answer that it is durable).
        start_persistent(catalog, parts.stores, parts.drainer.resume, parts.discovery)
    status = catalog.status()
    sd_notify(
        f"READY=1\nSTATUS=serving {status.checkpoints} checkpoints, "
        f"{format_size(status.used_bytes)} of {format_size(status.budget_bytes)}"
    )
    logger.info(
        "tierckptd %s ready: node %s, memory dir %s, budget %s",
        __version__,
        cfg.node.id,
        parts.tier.root,
        format_size(cfg.memory.budget),
    )
    parts.sweeper.start()
    if parts.warmer is not None:
        parts.warmer.queue.start()
    if parts.scrubber is not None:
        parts.scrubber.start()
    if cfg.memory.prewarm:
        threading.Thread(
            target=catalog.prewarm,
            args=(cfg.memory.prewarm,),
            name="tierckptd-prewarm",
            daemon=True,
        ).start()
    try:
        running.loop(signals)
        if running.emergency and parts.drainer is not None:
            parts.drainer.emergency(cfg.persistent.shutdown_deadline)
    finally:
        _stop(parts, running.discoverer)
    return 0


def _stop(parts: Parts, discoverer: Discoverer | None) -> None:
    if parts.scrubber is not None:
        parts.scrubber.stop()
    if parts.warmer is not None:
        parts.warmer.warmer.stop()
        parts.warmer.queue.stop()
    if parts.drainer is not None:
        parts.drainer.stop()
    if discoverer is not None:
        discoverer.stop()
    if parts.seed is not None:
        parts.seed.stop()
    parts.cluster.stop()
    parts.health.shutting_down()
    sd_notify("STOPPING=1")
    parts.sweeper.stop()
    parts.servers.stop(STOP_GRACE)
    if parts.bulk is not None:
        parts.bulk.stop()
    parts.tier.close()
    logger.info("stopped")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierckptd",
        description="Per-node tierckpt daemon: memory tier of checkpoints in shared memory.",
    )
    parser.add_argument(
        "--config", metavar="PATH", help="TOML config file (default: built-in defaults)"
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="check the running daemon's health on [listen] local and exit 0 if SERVING "
        "(for exec probes: Kubernetes' gRPC probes cannot speak TLS)",
    )
    parser.add_argument("--version", action="version", version=f"tierckptd {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point `tierckptd`."""
    args = _parser().parse_args(argv)
    try:
        config = load_config(Path(args.config) if args.config else None)
    except ConfigError as e:
        print(f"tierckptd: {e}", file=sys.stderr)
        return 2
    if args.probe:
        return probe(parse_local(config.listen.local)[0])
    setup_logging(config.log.level, config.log.format, config.node.id, QUIET_LOGGERS)
    warnings = exposure_warnings(config)
    if args.config:
        warnings += config_file_warnings(args.config, config)
    for warning in warnings:
        logger.warning("%s", warning)
    tune_malloc()
    signals = listen_for_signals()
    try:
        parts = build(config)
    except BuildFailed as e:
        if e.stderr:
            print(e, file=sys.stderr)
        else:
            logger.error("%s", e)
        return e.status
    return run(parts, args.config, signals)
