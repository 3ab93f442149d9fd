"""Per-uid isolation of namespaces on one node (`[security] local_isolation = "uid"`).

Who calls is proven by a session token from the login socket (tierckptd.rpc.local_login:
SO_PEERCRED on a unix socket beside the control socket), sent as `x-tierckpt-session`
metadata on every DaemonService call.

Policy: a namespace belongs to the uid whose BeginCheckpoint first claimed it; the claim
is a file `owners/<namespace>` in the memory dir holding "<uid> <node of the claim>" (one
file per namespace, so a claim is one atomic create and an operator can assign a
namespace by writing that file), so it survives restarts. Operators are the uids listed
in `[security] operators` (none by default: neither uid 0 nor the daemon's uid is one
implicitly, since training containers commonly run as root) and may act on every
namespace. A namespace that has checkpoints here but no owner (saved before isolation was
on, or adopted without an owner) belongs to the operators until one of them assigns it.

Ownership is cluster-wide: every save's manifest names its namespace's owner (uid and
claim node), so peers and the persistent tier carry it. A node that has not seen a
namespace asks its peers (ListManifests of it) before a claim: one that names another
uid refuses the claim (PERMISSION_DENIED). Peers that do not answer do not block a claim
(a node must keep serving its own jobs during a partition); such a claim can race another
uid's on the other side, and then each node refuses the other's manifests of that
namespace (`check_record`): no uid ever reads, pins or removes another's checkpoints,
and an operator settles the namespace. A peer's manifest (a publish, gossip, the
persistent tier's adoption) is taken only when its owner is this node's owner of the
namespace (a fresh namespace here takes the manifest's owner); cluster marks (rm, pin)
carry the uid that asked and apply only to that uid's namespaces (`check_mark`); and a
tenant's SetNamespace URL must lie under one of `[security] tenant_urls`, templates whose
`{uid}` and `{namespace}` name the caller's own prefix.

Files: `data/<namespace>` is the one barrier on the path to a tenant's files. A POSIX
ACL on it grants search to its owner uid and nothing to the group (the daemon keeps owning
every file, so a tenant can never chmod one back); `data/` can be searched but not
listed, and `manifests/`, `pool/` and `owners/` are the daemon's alone. The ACL masks are
r-x, so every mode still reads DIR_MODE. (Pool segments are handed back only to the
namespace that last held them: the memory tier's rule, which this relies on.)
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import grpc
from tierckpt.endpoint import SESSION_METADATA
from tierckpt.errors import MemoryBudgetExceeded, PermissionDenied, TierckptError
from tierckpt.names import check_namespace

from tierckptd.catalog import Catalog
from tierckptd.memory.tier import MemoryTier
from tierckptd.model import CheckpointRecord
from tierckptd.rpc.local_login import Sessions

__all__ = [
    "IsolationUnsupported",
    "LocalAccess",
    "Unauthenticated",
    "open_local_access",
    "release_isolation",
]

logger = logging.getLogger(__name__)

MAX_NAMESPACES_PER_UID = 1024

Owner = tuple[int, str]
"""A namespace's owner: (uid, node where it was claimed)."""
AskPeers = Callable[[str], Owner | None]
"""Asks the peers for a namespace's owner (None: no reachable peer knows one)."""

_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF
_ISOLATION = '[security] local_isolation = "uid"'


class Unauthenticated(PermissionDenied):
    """A DaemonService call without a valid session token while isolation is on (a
    refinement of PermissionDenied that travels as UNAUTHENTICATED, so the client knows
    to log in again; the client raises it as PermissionDenied)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class IsolationUnsupported(RuntimeError):
    """The memory dir's filesystem cannot enforce per-uid access (no POSIX ACLs)."""


def _acl(group_perm: int = 0, owner_uid: int | None = None) -> bytes:
    """A POSIX access ACL in the kernel's xattr format: the file owner (the daemon) rwx,
    `owner_uid` r-x, the group `group_perm`, others nothing. The mask is r-x, so the
    mode reads 2750 (DIR_MODE) and the memory tier's mode checks leave it alone."""
    entries = [(_ACL_USER_OBJ, 7, _ACL_UNDEFINED_ID)]
    if owner_uid is not None:
        entries.append((_ACL_USER, 5, owner_uid))
    entries += [
        (_ACL_GROUP_OBJ, group_perm, _ACL_UNDEFINED_ID),
        (_ACL_MASK, 5, _ACL_UNDEFINED_ID),
        (_ACL_OTHER, 0, _ACL_UNDEFINED_ID),
    ]
    return struct.pack("<I", _ACL_VERSION) + b"".join(
        struct.pack("<HHI", tag, perm, ident) for tag, perm, ident in entries
    )


# ---- ownership and the filesystem ------------------------------------------------------
def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _set_acl(path: Path, acl: bytes | None) -> None:
    """Set (None: remove) a directory's access ACL through its fd, so a planted symlink
    is never followed; a missing directory or a link is left alone."""
    try:
        fd = _open_dir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            return  # not a directory the memory tier made: nothing of ours to protect
        raise
    try:
        if acl is None:
            with contextlib.suppress(OSError):
                os.removexattr(fd, _ACL_XATTR)
        else:
            os.setxattr(fd, _ACL_XATTR, acl)  # sets the mode's permission bits too
    finally:
        os.close(fd)


def release_isolation(tier: MemoryTier) -> None:
    """Isolation is off: drop the ACLs an isolated run set, so the group gets what
    DIR_MODE says again (a no-op on a memory dir that never was isolated). owners/ stays
    as it is: turning isolation back on restores every claim."""
    for d in (tier.data_root, tier.manifest_root, tier.pool_dir):
        _set_acl(d, None)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(tier.data_root):
            if entry.is_dir(follow_symlinks=False):
                _set_acl(Path(entry.path), None)


class LocalAccess:
    """Who may act on which namespace; DaemonService asks before every call.

    `has_records(namespace)` says whether the catalog knows any checkpoint of it (never
    called under `_acl_lock`: the catalog calls `namespace_dir_created`, which takes it,
    under the catalog's own lock).
    """

    def __init__(
        self,
        tier: MemoryTier,
        has_records: Callable[[str], bool],
        *,
        node_id: str = "",
        sessions: Sessions | None = None,
        operators: Iterable[int] = (),
        max_namespaces_per_uid: int = MAX_NAMESPACES_PER_UID,
        tenant_urls: Iterable[str] = (),
        record_owner: Callable[[str, str], int | None] | None = None,
        ask_peers: AskPeers | None = None,
    ) -> None:
        self.tier = tier
        self.has_records = has_records
        self.node_id = node_id or "this node"
        self.sessions = sessions or Sessions()
        # `[security] operators`: explicit, never uid 0 or the daemon's uid by default.
        self.operators = frozenset(operators)
        self.max_namespaces_per_uid = max_namespaces_per_uid
        self.tenant_urls = tuple(tenant_urls)
        # The uid a committed checkpoint's manifest names (None: none, or not known here).
        self.record_owner = record_owner or (lambda namespace, checkpoint_id: None)
        self.ask_peers = ask_peers  # main.py, when the node has peers
        self.owners_dir = tier.root / "owners"
        # Lock order: _claim_lock, then the catalog's (has_records), then _acl_lock; the
        # catalog calls namespace_dir_created, which takes only _acl_lock, under its own.
        self._claim_lock = threading.Lock()
        self._acl_lock = threading.Lock()
        self._acl_of: dict[str, int | None] = {}  # what data/<ns> grants now
        self._claimed: dict[int, set[str]] = {}  # uid -> namespaces (bounds owners/)
        self._warned: set[str] = set()

    # ---- start --------------------------------------------------------------------
    def prepare(self) -> None:
        """Make the memory dir enforce the policy; call after the catalog adopted it and
        before serving. Raises IsolationUnsupported without POSIX ACLs."""
        tier = self.tier
        tier.make_dir(self.owners_dir)
        try:
            _set_acl(self.owners_dir, _acl())
        except OSError as e:
            raise IsolationUnsupported(
                f"{_ISOLATION} needs POSIX ACLs on the filesystem of [memory] dir "
                f"{tier.root} ({os.strerror(e.errno or 0)}): use a tmpfs or ext4/xfs mount "
                "with ACL support, or turn local_isolation off"
            ) from None
        # Ranks search data/ to reach their own files; nobody but us lists it or
        # enters manifests/ and pool/.
        _set_acl(tier.data_root, _acl(group_perm=1))
        for d in (tier.manifest_root, tier.pool_dir):
            _set_acl(d, _acl())
        for entry in os.scandir(self.owners_dir):
            if "~" in entry.name:  # the temp file of a claim cut short
                Path(entry.path).unlink(missing_ok=True)
                continue
            uid = self._read_owner(entry.name)
            if uid is not None:
                self._claimed.setdefault(uid, set()).add(entry.name)
        for entry in os.scandir(tier.data_root):
            if entry.is_dir(follow_symlinks=False):
                self.namespace_dir_created(entry.name)
        tier.namespace_dirs.add(self.namespace_dir_created)

    # ---- ownership ------------------------------------------------------------------
    def _read_owner(self, namespace: str) -> int | None:
        claim = self._read_claim(namespace)
        return claim[0] if claim is not None else None

    def _read_claim(self, namespace: str) -> Owner | None:
        """owners/<namespace>: "<uid>" or "<uid> <node of the claim>"."""
        try:
            fd = os.open(self.owners_dir / namespace, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._bad_owner(namespace, os.strerror(e.errno or 0))
            return None
        try:
            raw = os.read(fd, 256)
        finally:
            os.close(fd)
        text, _, node = raw.decode("ascii", "replace").strip().partition(" ")
        if not text.isdigit() or int(text) >= _ACL_UNDEFINED_ID:
            self._bad_owner(namespace, f"content {text[:16]!r} is not a uid")
            return None
        node = node.strip()
        try:
            check_namespace(node)  # the node-id charset
        except TierckptError:
            node = self.node_id  # written by hand, or by a version without it
        return int(text), node

    def claim_of(self, namespace: str) -> Owner | None:
        """The owner of `namespace` here with the node of its claim (None: unowned)."""
        try:
            check_namespace(namespace)
        except TierckptError:
            return None
        return self._read_claim(namespace)

    def _bad_owner(self, namespace: str, why: str) -> None:
        if namespace not in self._warned and len(self._warned) < 1024:
            self._warned.add(namespace)
            logger.warning(
                "owner of namespace %r unreadable (%s): only operators may use it until "
                "owners/%s holds a uid",
                namespace[:64],
                why,
                namespace[:64],
            )

    def owner(self, namespace: str) -> int | None:
        """The uid that owns `namespace`, or None (unowned, or an invalid name)."""
        try:
            check_namespace(namespace)
        except TierckptError:
            return None
        return self._read_owner(namespace)

    def _fresh(self, namespace: str) -> bool:
        return not (
            os.path.lexists(self.tier.data_root / namespace)
            or os.path.lexists(self.tier.manifest_root / namespace)
            or self.has_records(namespace)
        )

    def _write_owner(self, namespace: str, uid: int, node: str = "") -> bool:
        """Create owners/<namespace> = "uid node" atomically; False if it exists."""
        # "~" is outside the namespace grammar: a temp name never shadows a namespace.
        tmp = self.owners_dir / f"{namespace}~{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, f"{uid} {node or self.node_id}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, self.owners_dir / namespace)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        dfd = _open_dir(self.owners_dir)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return True

    def _prune_empty(self, uid: int) -> None:
        """Release `uid`'s namespaces that hold nothing any more (called at its bound)."""
        for namespace in sorted(self._claimed.get(uid, ())):
            if self._read_owner(namespace) == uid and self._fresh(namespace):
                (self.owners_dir / namespace).unlink(missing_ok=True)
                self._claimed[uid].discard(namespace)

    def _ask_peers(self, namespace: str, uid: int, method: str) -> str:
        """Before claiming a namespace this node has not seen: its owner per the peers.
        Raises PermissionDenied when one names another uid; returns the node of the
        claim to record (the peers' original one, else this node)."""
        if self.ask_peers is None:
            return self.node_id
        known = self.ask_peers(namespace)
        if known is None:
            return self.node_id
        owner, node = known
        if owner != uid:
            raise PermissionDenied(
                f"uid {uid} may not call {method} on namespace {namespace!r}: it belongs to "
                f"uid {owner} (claimed on node {node}, as node {self.node_id}'s peers say; "
                f"{_ISOLATION}); use a namespace of your own, or ask an operator"
            )
        return node

    def _claim(self, namespace: str, uid: int, method: str = "BeginCheckpoint") -> int:
        """Claim a fresh namespace for `uid` (after asking the peers); returns its owner
        afterwards (another uid when a concurrent Begin or a peer's manifest won)."""
        node = self._ask_peers(namespace, uid, method)  # no lock held: peers may be slow
        with self._claim_lock:
            if len(self._claimed.get(uid, ())) >= self.max_namespaces_per_uid:
                self._prune_empty(uid)
            if len(self._claimed.get(uid, ())) >= self.max_namespaces_per_uid:
                raise MemoryBudgetExceeded(
                    f"uid {uid} owns {self.max_namespaces_per_uid} namespaces on node "
                    f"{self.node_id}, the most one uid may ({_ISOLATION}); delete the "
                    "checkpoints of namespaces you no longer use, or reuse one"
                )
            if self._fresh(namespace) and self._write_owner(namespace, uid, node):
                self._claimed.setdefault(uid, set()).add(namespace)
                logger.info("namespace %s belongs to uid %d (claimed on %s)", namespace, uid, node)
        owner = self._read_owner(namespace)
        if owner is None:
            raise PermissionDenied(
                f"namespace {namespace!r} could not be claimed for uid {uid} on node "
                f"{self.node_id}: checkpoints of it without an owner arrived meanwhile, or "
                "its owner file is unreadable; ask an operator to assign it"
            )
        self._sync_acl(namespace, owner)
        return owner

    # ---- the filesystem -----------------------------------------------------------------
    def namespace_dir_created(self, namespace: str) -> None:
        """Hook of the memory tier: restrict a new data/<namespace> to its owner at once."""
        with self._acl_lock:
            owner = self._read_owner(namespace)
            _set_acl(self.tier.data_root / namespace, _acl(owner_uid=owner))
            self._acl_of[namespace] = owner

    def _sync_acl(self, namespace: str, owner: int | None) -> None:
        if namespace in self._acl_of and self._acl_of[namespace] == owner:
            return
        with self._acl_lock:
            _set_acl(self.tier.data_root / namespace, _acl(owner_uid=owner))
            self._acl_of[namespace] = owner

    # ---- the policy -------------------------------------------------------------------
    def caller(self, metadata: Sequence[tuple[str, str | bytes]] | None, method: str) -> int:
        """The uid behind a call's session token; raises Unauthenticated."""
        token = next((v for k, v in metadata or () if k == SESSION_METADATA), None)
        if isinstance(token, str) and len(token) <= 128:
            uid = self.sessions.uid_of(token)
            if uid is not None:
                return uid
            raise Unauthenticated(
                f"{method}: the session token is unknown or expired (tierckptd on node "
                f"{self.node_id} restarted, or the session is over 24 h old); log in again "
                "through the daemon socket's .login companion (tierckpt clients do this "
                "automatically)"
            )
        raise Unauthenticated(
            f"{method}: tierckptd on node {self.node_id} runs with {_ISOLATION} and this call "
            f"carries no {SESSION_METADATA} session: upgrade the tierckpt client (it logs in "
            "through the .login socket beside the daemon socket), and check that you may "
            "connect to that socket"
        )

    def authorize(self, uid: int, namespace: str, method: str, *, begin: bool = False) -> None:
        """Allow `uid` to call `method` on `namespace`, or raise PermissionDenied. A
        BeginCheckpoint in a namespace nobody owns and nothing is in claims it."""
        if uid in self.operators:
            return
        check_namespace(namespace)
        owner = self._read_owner(namespace)
        if owner is None:
            if not self._fresh(namespace):
                raise PermissionDenied(
                    f"uid {uid} may not call {method} on namespace {namespace!r}: it has "
                    f"checkpoints on node {self.node_id} but no owner (they came from a peer "
                    f"or the persistent tier, or predate {_ISOLATION}); until an operator "
                    f"assigns it (owners/{namespace} in the memory dir holds the uid), only "
                    "root and the daemon's uid may use it"
                )
            if not begin:
                return  # nothing there: the catalog answers NOT_FOUND
            owner = self._claim(namespace, uid, method)
        self._sync_acl(namespace, owner)
        if owner != uid:
            raise PermissionDenied(
                f"uid {uid} may not call {method} on namespace {namespace!r}: it belongs to "
                f"uid {owner} on node {self.node_id} ({_ISOLATION}); use a namespace of your "
                "own, or run this as root or the daemon's user"
            )

    # ---- what peers and the persistent tier say --------------------------------------
    def check_record(self, rec: CheckpointRecord) -> None:
        """`Catalog.check_owner`: before a peer's manifest (publish, gossip, or the
        persistent tier's stored one) is taken here. It must name this node's owner of
        its namespace; a namespace fresh here takes the manifest's owner. PermissionDenied
        otherwise (the checkpoint stays wherever it is; nothing here changes)."""
        namespace, uid = rec.namespace, rec.owner_uid
        what = f"{rec.namespace}/{rec.checkpoint_id}"
        claim = self._read_claim(namespace)
        if claim is None and uid is not None:
            with self._claim_lock:
                if self._fresh(namespace) and self._write_owner(
                    namespace, uid, rec.owner_claim_node
                ):
                    self._claimed.setdefault(uid, set()).add(namespace)
                    logger.info(
                        "namespace %s belongs to uid %d (claimed on %s, learnt with %s)",
                        namespace,
                        uid,
                        rec.owner_claim_node or "a peer",
                        what,
                    )
            claim = self._read_claim(namespace)
        if claim is None or claim[0] == uid:
            return  # unowned here and in the manifest: for operators only, as before
        theirs = f"uid {uid}" if uid is not None else "no owner (saved without isolation)"
        logger.warning(
            "refused %s: its manifest names %s, but namespace %s belongs to uid %d on node %s "
            "(claimed on %s)",
            what,
            theirs,
            namespace,
            claim[0],
            self.node_id,
            claim[1],
        )
        raise PermissionDenied(
            f"{what}: its manifest names {theirs} as the owner of namespace {namespace!r}, "
            f"but on node {self.node_id} it belongs to uid {claim[0]} (claimed on {claim[1]}; "
            f"{_ISOLATION}); the checkpoint is not taken here. An operator settles a namespace "
            "claimed twice (owners/<namespace> in the memory dir)"
        )

    def check_mark(self, namespace: str, checkpoint_id: str, uid: int | None) -> None:
        """A cluster rm/pin/unpin a user with `uid` asked on another node (None: an
        operator, or a node without isolation): allowed only on that uid's checkpoints."""
        if uid is None or uid in self.operators:
            return
        owner = self.record_owner(namespace, checkpoint_id)
        if owner is None:
            owner = self._read_owner(namespace)
        if owner != uid:
            raise PermissionDenied(
                f"uid {uid} may not rm, pin or unpin {namespace}/{checkpoint_id} on node "
                f"{self.node_id}: it belongs to "
                f"{f'uid {owner}' if owner is not None else 'the operators'} ({_ISOLATION})"
            )

    def check_url(self, uid: int, namespace: str, url: str) -> None:
        """SetNamespace by `uid` (after `[persistent] allowed_urls` allowed `url`): a
        tenant's URL must lie under one of `[security] tenant_urls` with `{uid}` and
        `{namespace}` filled in, so one tenant cannot point its namespace at another's
        prefix (and list, restore or rm what is there). "" (the daemon's default) is
        always allowed; operators may set any allowed URL."""
        if not url or uid in self.operators:
            return
        for template in self.tenant_urls:
            prefix = template.replace("{uid}", str(uid)).replace("{namespace}", namespace)
            prefix = prefix.rstrip("/")
            if url == prefix or url.startswith(prefix + "/"):
                return
        allowed = ", ".join(self.tenant_urls) or "none are configured"
        raise PermissionDenied(
            f"uid {uid} may not point namespace {namespace!r} at {url[:200]}: with "
            f"{_ISOLATION} a tenant's persistent URL must lie under one of [security] "
            f"tenant_urls with its uid and namespace filled in ({allowed[:300]}); use the "
            'default URL (""), or ask an operator'
        )

    def visible(self, uid: int, namespaces: Iterable[str]) -> set[str]:
        """The namespaces among `namespaces` that `uid` may see in lists and status."""
        names = set(namespaces)
        if uid in self.operators:
            return names
        return {ns for ns in names if self.owner(ns) == uid}


def open_local_access(
    mode: str,
    catalog: Catalog,
    node_id: str,
    *,
    operators: Iterable[int] = (),
    tenant_urls: Iterable[str] = (),
    max_namespaces_per_uid: int = MAX_NAMESPACES_PER_UID,
    ask_peers: AskPeers | None = None,
) -> LocalAccess | None:
    """The policy for `[security] local_isolation` (None when it is off, after giving an
    earlier isolated run's directories back to the group); call after adoption. Stamps
    each new save with its namespace's owner and checks peers' manifests against it."""
    if mode != "uid":
        release_isolation(catalog.tier)
        return None

    def record_owner(namespace: str, checkpoint_id: str) -> int | None:
        try:
            return catalog.get(namespace, checkpoint_id).owner_uid
        except TierckptError:
            return None

    access = LocalAccess(
        catalog.tier,
        lambda ns: bool(catalog.list_checkpoints(ns, include_uncommitted=True)),
        node_id=node_id,
        operators=operators,
        tenant_urls=tenant_urls,
        max_namespaces_per_uid=max_namespaces_per_uid,
        record_owner=record_owner,
        ask_peers=ask_peers,
    )
    access.prepare()
    catalog.events.owner_of.answer_with(access.claim_of)
    catalog.events.check_owner.add(access.check_record)
    return access
