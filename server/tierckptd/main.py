"""Composition root of tierckptd: config, logging, adoption, servers, signals, sd_notify.

Signal handlers only enqueue (gunicorn style); the main loop acts and logs, so nothing
non-reentrant ever runs inside a handler. Order at start: lock the memory dir, adopt it,
bind the sockets, health SERVING, READY=1, then the persistent tier's work in the
background (`persistent.startup`: nothing of S3 delays READY). Order at stop: health
NOT_SERVING, STOPPING=1, stop the servers with a grace period, remove the socket, release
the lock.

Logging never shows secrets: SIGHUP diffs are redacted (`config_changes`) and the S3
client libraries stay at INFO even under `[log] level = "DEBUG"`, because botocore's
DEBUG output carries request headers (X-Amz-Security-Token, the access key id).
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
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tierckpt.errors import TierckptError
from tierckpt.units import format_size

from tierckptd import __version__
from tierckptd.catalog import Catalog, Sweeper
from tierckptd.catalog.prewarm import NextSaveWarmer
from tierckptd.catalog.views import freshness
from tierckptd.config import (
    Config,
    ConfigError,
    exposure_warnings,
    load_config,
)
from tierckptd.config_secrets import config_changes, config_file_warnings
from tierckptd.jobs import JobQueue, StepAside
from tierckptd.memory.capacity import budget_warnings
from tierckptd.memory.scrubber import Scrubber
from tierckptd.memory.tier import MemoryTier, MemoryTierLocked
from tierckptd.model import FileRecord
from tierckptd.ops import logs, metrics
from tierckptd.ops.malloc_tuning import tune_malloc
from tierckptd.ops.priority import at_idle_priority
from tierckptd.ops.systemd import sd_notify
from tierckptd.peers import security as auth
from tierckptd.peers.client import PeerClient
from tierckptd.peers.cluster import Cluster
from tierckptd.peers.membership import PEER_CHANNEL_OPTIONS, Membership
from tierckptd.peers.peer_discovery import Discoverer, discoverer_for
from tierckptd.peers.source import peer_sources
from tierckptd.persistent.drain import Drainer
from tierckptd.persistent.drain_plan import PeerHolding, PeerLookup
from tierckptd.persistent.listing import Discovery
from tierckptd.persistent.retention import remove_checkpoint
from tierckptd.persistent.roots import Roots
from tierckptd.persistent.source import PersistentSource
from tierckptd.persistent.startup import start_in_background as start_persistent
from tierckptd.persistent.store import RetryPolicy
from tierckptd.restore import FileSource, Restorer
from tierckptd.rpc.health import Health
from tierckptd.rpc.local_access import IsolationUnsupported, open_local_access
from tierckptd.rpc.peer_service import add_peer_service
from tierckptd.rpc.servers import AddressInUse, Servers, parse_local, start_servers
from tierckptd.sagemaker import start_listener  # [listen] sagemaker

__all__ = ["Daemon", "main"]

logger = logging.getLogger(__name__)

STOP_GRACE = 5.0
_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Their DEBUG records carry credentials (signed headers, session tokens): never below INFO.
QUIET_LOGGERS = ("botocore", "aiobotocore", "boto3", "s3fs", "fsspec", "urllib3")
PROBE_TIMEOUT = 3.0


class _QuietBelowInfo(logging.Filter):
    """Drops DEBUG records of QUIET_LOGGERS even if a library lowers its own level."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.INFO or record.name.split(".", 1)[0] not in QUIET_LOGGERS


def set_log_level(level: str) -> None:
    """Set the root level, keeping the QUIET_LOGGERS at INFO or above."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))


def set_log_format(kind: str, node: str) -> None:
    """`[log] format`: "text" lines or one JSON object per line (`ops.logs`)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logs.formatter(kind, node))


def setup_logging(config: Config) -> None:
    """stderr logging (journald / kubectl logs) with the node id in every line."""
    logging.basicConfig(level=config.log.level.upper(), stream=sys.stderr)
    set_log_format(config.log.format, config.node.id)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _QuietBelowInfo) for f in handler.filters):
            handler.addFilter(_QuietBelowInfo())
    set_log_level(config.log.level)


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


class Daemon:
    """One running tierckptd; `run()` blocks until SIGTERM/SIGINT and returns the exit code."""

    def __init__(self, config: Config, config_path: str | None) -> None:
        self.config = config
        self.config_path = config_path
        self._signals: collections.deque[int] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self.cluster: Cluster | None = None
        self.drainer: Drainer | None = None
        self.discoverer: Discoverer | None = None
        self._emergency = False
        os.set_blocking(self._wake_w, False)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler: NO logging, just queue the signal and wake the main loop."""
        self._signals.append(signum)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass

    def run(self) -> int:
        cfg = self.config
        try:  # [security] files are read once, now: before adopting the memory tier
            channel_factory = auth.peer_channel_factory(cfg.security, PEER_CHANNEL_OPTIONS)
            peer_security = auth.peer_server_security(cfg.security)
        except ConfigError as e:  # unreadable, empty or not PEM: as a bad config key
            print(f"tierckptd: {e}", file=sys.stderr)
            return 2
        tier = MemoryTier(cfg.memory.dir)
        try:
            tier.open_layout()
        except MemoryTierLocked as e:
            logger.error("%s", e)
            return 1
        except OSError as e:
            logger.error("cannot use [memory] dir %s: %s", cfg.memory.dir, e)
            return 1
        for warning in budget_warnings(cfg.memory.budget, tier.root):
            logger.warning("%s", warning)
        catalog = Catalog(
            tier,
            node_id=cfg.node.id,
            failure_domain=cfg.node.failure_domain,
            budget=cfg.memory.budget,
            recycle=cfg.memory.recycle,
            memory_keep_last=cfg.retention.memory_keep_last,
            abandon_after=cfg.memory.abandon_after,
        )
        for signum in _HANDLED:
            signal.signal(signum, self._on_signal)
        catalog.limit_peer_manifests(cfg.memory.peer_manifest_share)
        try:
            catalog.adopt()
            access = open_local_access(
                cfg.security.local_isolation,
                catalog,
                cfg.node.id,
                operators=cfg.security.operators,
                tenant_urls=cfg.security.tenant_urls,
                max_namespaces_per_uid=cfg.security.max_namespaces_per_uid,
            )
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
            catalog.max_namespaces = cfg.memory.max_namespaces
            if cfg.metrics.listen:
                metrics.serve(cfg.metrics.listen)
            # The one restore chain: memory, then the file's peer holders and the other
            # peers, then the persistent tier (restore.py).
            peer_client = PeerClient(
                Membership(
                    cfg.node.id,
                    cfg.node.failure_domain,
                    peers=cfg.peers,
                    copies=cfg.replication.copies,
                    channel_factory=channel_factory,
                )
            )
            metrics.bind_peers(lambda: peer_client.peer_ids)
            discovery: Discovery | None = None
            discovers = bool(cfg.membership.dns or cfg.membership.hostfile)
            # Short retries per operation: the drainer reschedules the whole job.
            stores = Roots.from_config(
                cfg.persistent, retry=RetryPolicy(max_attempts=4, deadline=15.0, cap=4.0)
            )

            def sources_for(namespace: str, checkpoint_id: str, f: FileRecord) -> list[FileSource]:
                """Peers, then the persistent tier the checkpoint drained to (its own)."""
                tier = stores.tier(catalog.persistent_url(namespace, checkpoint_id))
                persistent = [PersistentSource(tier)] if tier is not None else []
                landed = self.cluster.copy_landed if self.cluster is not None else None
                return [*peer_sources(peer_client, f, landed), *persistent]

            restorer = Restorer(catalog, sources_for)
            cluster = Cluster(
                catalog,
                restorer,
                client=peer_client,
                heal_interval=cfg.replication.heal_interval,
            )
            self.cluster = cluster
            if access is not None:  # uid isolation, cluster-wide (rpc/local_access.py)
                access.ask_peers = functools.partial(_ask_owner, peer_client)
                iso = access
                cluster.ops.check_mark = lambda m: iso.check_mark(
                    m.namespace, m.checkpoint_id, m.uid
                )
            if stores.enabled:
                drainer = Drainer(
                    catalog,
                    stores,
                    restore=restorer.ensure_local,
                    keep_last=cfg.retention.persistent_keep_last,
                    keep_every=cfg.retention.persistent_keep_every,
                    peers=_peer_holdings(peer_client) if cfg.peers or discovers else None,
                    owner_grace=cfg.persistent.owner_grace,
                )
                catalog.drain_every = cfg.persistent.every
                catalog.default_persistent = stores.default is not None
                cluster.ops.unstore = functools.partial(remove_checkpoint, stores)  # rm
                drainer.retention.on_evicted = cluster.ops.retired  # every node drops it
                catalog.on_committed = drainer.enqueue
                self.drainer = drainer
                discovery = Discovery(
                    stores, catalog, relist_interval=cfg.persistent.relist_interval
                )
            health = Health()
            servers = start_servers(
                catalog,
                health,
                cfg.listen.local,
                cfg.listen.peer,
                register_peer=lambda server: add_peer_service(cluster, server),
                peer_security=peer_security,
                cluster=cluster,
                access=access,
                discovery=discovery,
                persistent_urls=stores.check if stores.enabled else None,
            )
            # [listen] sagemaker: the seed client's HTTP API (tierckptd.sagemaker).
            seed = start_listener(cfg, catalog, cluster, discovery)
        except ConfigError as e:
            print(f"tierckptd: {e}", file=sys.stderr)
            tier.close()
            return 2
        except (AddressInUse, IsolationUnsupported, OSError) as e:
            logger.error("%s", e)
            tier.close()
            return 1
        # A replacement node (empty memory tier) learns the checkpoints peers know before
        # READY, so GetCheckpoint/ls work at once; the peer listener already answers.
        # [membership]: the first round now, so a restarted node knows its peers before
        # it asks them for manifests; then in the background (started with the cluster).
        self.discoverer = discoverer_for(cfg, cluster, lambda: self.config.replication.copies)
        try:
            cluster.pull_manifests()
        except (TierckptError, OSError) as e:
            # A full tmpfs (or any tier error) while adopting what peers know: start
            # degraded, serving what this node holds; gossip pulls again later.
            logger.error("start-up pull of the peers' manifests stopped: %.300s", e)
        # Files of saves committed while this daemon was down (orphans) are kept once they
        # verify against a pulled manifest; the sweeper asks the peers about the others.
        catalog.resolve_unfinished = cluster.resolve_unfinished
        catalog.salvage_orphans()
        if cluster.peer_ids:
            threading.Thread(
                target=cluster.republish_own, name="tierckptd-republish", daemon=True
            ).start()
        cluster.start()
        if self.discoverer is not None:
            self.discoverer.start()
        if self.drainer is not None:
            self.drainer.start()  # new commits drain at once; the resume comes below
        health.serving()
        if self.drainer is not None:
            # Nothing of S3 before READY (audit 3 H7, M7): stale uploads aborted, the
            # drain resumed and the durable checkpoints adopted on a thread of their own
            # (a peer's persistent-only manifest is never taken for lost meanwhile: the
            # healer skips files no node claims, and peers answer that it is durable).
            start_persistent(catalog, stores, self.drainer.resume, discovery)
        status = catalog.status()
        sd_notify(
            f"READY=1\nSTATUS=serving {status.checkpoints} checkpoints, "
            f"{format_size(status.used_bytes)} of {format_size(status.budget_bytes)}"
        )
        logger.info(
            "tierckptd %s ready: node %s, memory dir %s, budget %s",
            __version__,
            cfg.node.id,
            tier.root,
            format_size(cfg.memory.budget),
        )
        sweeper = Sweeper(catalog)
        sweeper.start()
        warmer = self._start_warmer(catalog)
        scrubber = self._start_scrubber(catalog, tier, cluster)
        if cfg.memory.prewarm:
            threading.Thread(
                target=catalog.prewarm,
                args=(cfg.memory.prewarm,),
                name="tierckptd-prewarm",
                daemon=True,
            ).start()
        try:
            self._loop()
            if self._emergency and self.drainer is not None:
                self.drainer.emergency(cfg.persistent.shutdown_deadline)
        finally:
            if scrubber is not None:
                scrubber.stop()
            if warmer is not None:
                warmer[0].stop()
                warmer[1].stop()
            if self.drainer is not None:
                self.drainer.stop()
            if self.discoverer is not None:
                self.discoverer.stop()
            if seed is not None:  # [listen] sagemaker
                seed.stop()
            cluster.stop()
            self._shutdown(health, servers, sweeper, tier)
        return 0

    def _start_scrubber(
        self, catalog: Catalog, tier: MemoryTier, cluster: Cluster
    ) -> Scrubber | None:
        """`[memory] scrub_rate`: re-hash the memory copies in the background; a corrupt
        one goes the way of one found while served (dropped, repaired from a peer)."""
        memory = self.config.memory
        if memory.scrub_rate <= 0:
            return None
        scrubber = Scrubber(
            catalog,
            tier,
            rate=memory.scrub_rate,
            interval=memory.scrub_interval,
            on_corrupt=cluster.corrupt,
            step_aside=lambda stop: StepAside(catalog.saving, stop=stop).wait,
        )
        scrubber.start()
        return scrubber

    def _start_warmer(self, catalog: Catalog) -> tuple[NextSaveWarmer, JobQueue[str]] | None:
        """`[memory] prewarm_next`: after each commit, warm the namespace's next save's
        pool segments on one worker thread (only when evicted files are recycled too)."""
        memory = self.config.memory
        if not (memory.prewarm_next and memory.recycle):
            return None
        warmer = NextSaveWarmer(catalog, max_bytes=memory.prewarm_next_max)
        # Idle priority: the pages are touched while training computes on the same cores.
        queue: JobQueue[str] = JobQueue(
            at_idle_priority(warmer.run_pass), name="tierckptd-prewarm-next"
        )
        catalog.prewarm_pending = lambda: warmer.pending_bytes
        catalog.prewarm_next = queue.put
        queue.start()
        return warmer, queue

    def _loop(self) -> None:
        while True:
            select.select([self._wake_r], [], [], 1.0)
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
            while self._signals:
                signum = self._signals.popleft()
                if signum == signal.SIGHUP:
                    self._reload()
                else:
                    logger.info("received %s: shutting down", signal.Signals(signum).name)
                    self._emergency = signum == signal.SIGTERM
                    return

    def _reload(self) -> None:
        """SIGHUP: retry drain-failed checkpoints now (the operator's override), re-read
        the config file and log what changed."""
        if self.drainer is not None:
            self.drainer.retry_failed()
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
            if self.cluster is not None:
                self.cluster.heal_interval = new.replication.heal_interval
        elif self.cluster is not None and (
            new.peers != self.config.peers or new.replication != self.config.replication
        ):
            self.cluster.configure(new.peers, new.replication.copies)
            self.cluster.heal_interval = new.replication.heal_interval
        if new.log.level != self.config.log.level:
            set_log_level(new.log.level)
        if new.log.format != self.config.log.format:
            set_log_format(new.log.format, self.config.node.id)
        self.config = new
        if self.discoverer is not None:
            self.discoverer.refresh(force=True)  # applies the new peers and copies now

    def _shutdown(
        self, health: Health, servers: Servers, sweeper: Sweeper, tier: MemoryTier
    ) -> None:
        health.shutting_down()
        sd_notify("STOPPING=1")
        sweeper.stop()
        servers.stop(STOP_GRACE)
        tier.close()
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


def probe(config: Config) -> int:
    """Exit status of a health probe against the daemon on `[listen] local`."""
    address, _ = parse_local(config.listen.local)
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT
            )
    except grpc.RpcError as e:
        print(f"tierckptd --probe: {address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(f"tierckptd --probe: {address} is {status}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point `tierckptd`."""
    args = _parser().parse_args(argv)
    try:
        config = load_config(Path(args.config) if args.config else None)
    except ConfigError as e:
        print(f"tierckptd: {e}", file=sys.stderr)
        return 2
    if args.probe:
        return probe(config)
    setup_logging(config)
    warnings = exposure_warnings(config)
    if args.config:
        warnings += config_file_warnings(args.config, config)
    for warning in warnings:
        logger.warning("%s", warning)
    tune_malloc()
    return Daemon(config, args.config).run()
