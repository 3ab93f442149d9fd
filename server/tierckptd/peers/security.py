r"""Peer security: mutual TLS and a shared token on daemon-to-daemon gRPC, and who is calling.

`peer_server_security` gives the peer listener its credentials and token interceptor;
`peer_channel_factory` gives the peer client channels with the matching credentials and
token. With `[security]` empty both are plaintext and token-free (a trusted network).

- `token_file`: every PeerService call must carry metadata `x-tierckpt-token` equal to the
  file's content (whitespace stripped); `grpc.health.v1.Health` stays open for probes.
  Without TLS the token travels in clear: it guards against a misconfigured node, not
  against someone on the wire.
- `tls_cert` + `tls_key`: the peer port speaks TLS, and peer channels present this cert.
- `tls_ca`: peers are verified against this CA, both ways (mutual TLS). Without it the
  server asks for no client cert and clients verify servers against the system roots.
  With it, a client also checks that the server's cert names the node id it calls
  (a DNS subjectAltName; `PeerChannels` sets the TLS name to it), so an address taken
  over by another node gets neither the token nor data.
- `Hello` (who answers at an address) carries no token: it proves the token by
  challenge-response both ways (`HelloChallenge`), so membership from DNS or a hostfile
  hands nothing to whoever answers at a listed address.

Who is calling (`caller_names`), for per-call authorization in PeerService: with
`tls_ca` set, the node ids a peer's verified client certificate names, as a DNS or URI
subjectAltName equal to the node id (`[node] id`, `[[peers]] id`), so a cert binds to
exactly one node and a cert naming no configured peer is refused. Without mutual TLS
it is the `x-tierckpt-node` metadata our client sends: only a claim, which any holder of
the token (or anyone, without one) can make up; use mutual TLS where peers are not
trusted.

Every node may use one cert as both server and client, issued by the cluster's CA for
its node id and for the name or IP in the addresses that `[[peers]]` dial
(`localhost`/`127.0.0.1` for tests):

    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
        -subj /CN=tierckpt-ca -keyout ca.key -out ca.crt
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=node-a \
        -keyout node.key -out node.csr
    printf 'subjectAltName=DNS:node-a,DNS:node-a.example,IP:10.0.0.1\nextendedKeyUsage=%s\n' \
        serverAuth,clientAuth > node.ext
    openssl x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 825 \
        -extfile node.ext -out node.crt
    head -c 32 /dev/urandom | base64 > token && chmod 600 token node.key

(`DNS:node-a` is the node id, `[node] id = "node-a"`; the other names are what peers
dial.) Copy ca.crt, the node's cert and key, and the token to each node (mode 0600, or a
Kubernetes Secret); keep ca.key offline.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from tierckptd.config import ConfigError, SecurityConfig

__all__ = [
    "HEALTH_PREFIX",
    "HELLO_ANSWER_METADATA",
    "HELLO_NONCE_METADATA",
    "HELLO_PROOF_METADATA",
    "NODE_METADATA",
    "TOKEN_METADATA",
    "UNAUTHENTICATED_MESSAGE",
    "HelloChallenge",
    "MetadataClientInterceptor",
    "MethodInterceptor",
    "PeerChannels",
    "PeerServerSecurity",
    "TokenClientInterceptor",
    "TokenServerInterceptor",
    "caller_names",
    "hello_answer",
    "node_client_interceptor",
    "peer_channel_factory",
    "peer_server_security",
    "read_token",
]

logger = logging.getLogger(__name__)

ChannelFactory = Callable[[str], grpc.Channel]

TOKEN_METADATA = "x-tierckpt-token"
NODE_METADATA = "x-tierckpt-node"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
HELLO_METHOD_SUFFIX = "/Hello"
# Hello's challenge-response (no bearer token goes to an address before it proved who
# it is): the caller's nonce and its proof, and the answering daemon's proof.
HELLO_NONCE_METADATA = "x-tierckpt-hello-nonce"
HELLO_PROOF_METADATA = "x-tierckpt-hello-proof"
HELLO_ANSWER_METADATA = "x-tierckpt-hello-answer"
_NONCE_BYTES = 16
_MAX_NONCE = 64
UNAUTHENTICATED_MESSAGE = (
    "peer token missing or wrong: set [security] token_file to the cluster's shared token"
)
_WARNED_PEERS_MAX = 1024


@dataclass(frozen=True)
class PeerServerSecurity:
    credentials: grpc.ServerCredentials | None = None
    interceptors: Sequence[Any] = field(default_factory=tuple)
    # Mutual TLS: a caller is the node its verified client cert names, not what it says.
    mutual_tls: bool = False


def _read(key: str, path: str, *, secret: bool) -> bytes:
    """The bytes of `[security] key` at `path`; a ConfigError naming both if unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
            mode = os.fstat(f.fileno()).st_mode
    except OSError as e:
        raise ConfigError(f"[security] {key} {path}: cannot read: {e.strerror or e}") from e
    if secret and mode & (stat.S_IROTH | stat.S_IRGRP):
        # Group-readable is no better: the daemon's group holds every training user.
        logger.warning(
            "[security] %s %s is readable by %s (mode %o): chmod 600 it",
            key,
            path,
            "every user" if mode & stat.S_IROTH else "its group",
            stat.S_IMODE(mode),
        )
    return data


def read_token(path: str) -> bytes:
    """The shared token in `path`, whitespace stripped; refuses an empty or non-ASCII one."""
    token = _read("token_file", path, secret=True).strip()
    if not token:
        raise ConfigError(f"[security] token_file {path} is empty: put the cluster's token in it")
    if not all(0x21 <= b <= 0x7E for b in token):
        raise ConfigError(
            f"[security] token_file {path}: the token must be printable ASCII without spaces "
            "(e.g. base64 of random bytes)"
        )
    return token


def _proof(token: bytes, role: bytes, nonce: str, *names: str) -> str:
    message = b"\0".join(
        [b"tierckpt-hello-v1", role, nonce.encode("utf-8", "replace")]
        + [n.encode("utf-8", "replace") for n in names]
    )
    return hmac.new(token, message, hashlib.sha256).hexdigest()


def _value(metadata: Sequence[tuple[str, str | bytes]] | None, key: str) -> str:
    for k, v in metadata or ():
        if k == key:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return ""


@dataclass(frozen=True)
class HelloChallenge:
    """Hello without a bearer token: the caller sends a fresh nonce and its proof of the
    token (HMAC-SHA256 of the nonce and its node id); the answering daemon sends back
    its own proof (HMAC of the nonce, the node id it answers with and the caller's id,
    in another role so a proof cannot be reflected). Whoever listens at an address, or
    answers there, learns neither the token nor anything to replay as an answer."""

    token: bytes
    caller: str
    nonce: str = field(default_factory=lambda: secrets.token_hex(_NONCE_BYTES))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (
            (HELLO_NONCE_METADATA, self.nonce),
            (HELLO_PROOF_METADATA, _proof(self.token, b"caller", self.nonce, self.caller)),
        )

    def proven(self, metadata: Sequence[tuple[str, str | bytes]] | None, answered: str) -> bool:
        """Whether the answer metadata proves the token for the node id `answered`."""
        want = _proof(self.token, b"answer", self.nonce, answered, self.caller).encode()
        ok = False
        for key, value in metadata or ():
            if key == HELLO_ANSWER_METADATA:
                given = value.encode() if isinstance(value, str) else value
                ok |= hmac.compare_digest(given, want)
        return ok


def hello_answer(
    token: bytes | None, metadata: Sequence[tuple[str, str | bytes]] | None, node_id: str
) -> tuple[tuple[str, str], ...]:
    """The proof this node sends with its Hello answer (as `node_id`), for the caller's
    nonce; () without a token or a nonce."""
    nonce = _value(metadata, HELLO_NONCE_METADATA)
    if token is None or not nonce or len(nonce) > _MAX_NONCE:
        return ()
    caller = _value(metadata, NODE_METADATA)
    return ((HELLO_ANSWER_METADATA, _proof(token, b"answer", nonce, node_id, caller)),)


def _hello_proven(token: bytes, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
    """A Hello whose caller proved the token for its nonce (HelloChallenge)."""
    nonce = _value(metadata, HELLO_NONCE_METADATA)
    given = _value(metadata, HELLO_PROOF_METADATA)
    if not nonce or len(nonce) > _MAX_NONCE or not given:
        return False
    want = _proof(token, b"caller", nonce, _value(metadata, NODE_METADATA))
    return hmac.compare_digest(given.encode(), want.encode())


class _Tls(NamedTuple):
    cert: bytes
    key: bytes
    ca: bytes | None


def _read_tls(security: SecurityConfig) -> _Tls | None:
    if not (security.tls_cert or security.tls_key or security.tls_ca):
        return None
    given = [k for k in ("tls_cert", "tls_key", "tls_ca") if getattr(security, k)]
    for key in ("tls_cert", "tls_key"):
        if key not in given:
            raise ConfigError(
                f"[security] {key} is missing: TLS needs both tls_cert and tls_key "
                f"(only {' and '.join(given)} set)"
            )
    return _Tls(
        cert=_read_pem("tls_cert", security.tls_cert, secret=False),
        key=_read_pem("tls_key", security.tls_key, secret=True),
        ca=_read_pem("tls_ca", security.tls_ca, secret=False) if security.tls_ca else None,
    )


def _read_pem(key: str, path: str, *, secret: bool) -> bytes:
    data = _read(key, path, secret=secret)
    if b"-----BEGIN " not in data:
        raise ConfigError(f"[security] {key} {path} is not a PEM file (-----BEGIN ... missing)")
    return data


def _abort_handler(
    handler: grpc.RpcMethodHandler, note: Callable[[str], None]
) -> grpc.RpcMethodHandler:
    """A handler that only answers UNAUTHENTICATED, in the response shape of `handler`.

    It takes the request as a stream it never reads (the wire is the same for a unary
    request), so a caller that opens a call and never sends the body cannot hold a
    server thread waiting for it.
    """

    def reject(context: grpc.ServicerContext) -> None:
        note(context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    def unary(requests: Any, context: grpc.ServicerContext) -> Any:
        reject(context)

    def streaming(requests: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        reject(context)
        yield  # pragma: no cover - abort raises

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    return grpc.stream_unary_rpc_method_handler(unary)


class MethodInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """The head every interceptor of the peer listener shares: it asks the server for the
    call's handler and hands `intercept` only calls to a method the server knows, with
    the full method name ("/package.Service/Method"); unknown methods pass untouched (gRPC
    answers UNIMPLEMENTED), so an interceptor never sees a name a caller made up."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method or ""
        return self.intercept(handler, method, handler_call_details)

    def intercept(
        self, handler: grpc.RpcMethodHandler, method: str, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """The handler to serve `method` with: `handler` itself, or one wrapping it."""
        raise NotImplementedError


class TokenServerInterceptor(MethodInterceptor):
    """Lets a call through only with the shared token; health is always open.

    A rejected call never reaches its servicer: the request is not even deserialized.
    """

    def __init__(self, token: bytes) -> None:
        self._token = token
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        ok = False
        for key, value in metadata or ():
            if key == TOKEN_METADATA:
                given = value.encode() if isinstance(value, str) else value
                # No early exit: every value is compared, in constant time.
                ok |= hmac.compare_digest(given, self._token)
        return ok

    def intercept(
        self, handler: grpc.RpcMethodHandler, method: str, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if method.startswith(HEALTH_PREFIX):
            return handler
        metadata = details.invocation_metadata
        if self._authorized(metadata):
            return handler
        if method.endswith(HELLO_METHOD_SUFFIX) and _hello_proven(self._token, metadata):
            return handler  # a Hello proves the token without sending it
        return _abort_handler(handler, self._note_rejected)

    def _note_rejected(self, peer: str) -> None:
        """Warn once per peer host (a bounded set), then log its rejections at debug."""
        host = peer.rsplit(":", 1)[0]
        with self._lock:
            first = host not in self._warned and len(self._warned) < _WARNED_PEERS_MAX
            if first:
                self._warned.add(host)
        if first:
            logger.warning("rejected a peer call from %s: %s", peer, UNAUTHENTICATED_MESSAGE)
        else:
            logger.debug("rejected a peer call from %s: missing or wrong token", peer)


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str | bytes]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any


class MetadataClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Sets one metadata key on every call (also plaintext, unlike call credentials)."""

    def __init__(self, key: str, value: str) -> None:
        self._key = key
        self._value = value

    def _with_metadata(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [(k, v) for k, v in (details.metadata or ()) if k != self._key]
        metadata.append((self._key, self._value))
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_metadata(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_metadata(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_metadata(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_metadata(details), requests)


class TokenClientInterceptor(MetadataClientInterceptor):
    """Adds `x-tierckpt-token` to every call."""

    def __init__(self, token: bytes) -> None:
        super().__init__(TOKEN_METADATA, token.decode("ascii"))


def node_client_interceptor(node_id: str) -> MetadataClientInterceptor:
    """Says which node calls (`x-tierckpt-node`): the caller's identity on a peer port
    without mutual TLS (a claim; with mutual TLS the cert decides)."""
    return MetadataClientInterceptor(NODE_METADATA, node_id)


def _names(values: Sequence[bytes] | None) -> list[str]:
    return [v.decode("utf-8", "replace") for v in values or ()]


def caller_names(context: grpc.ServicerContext, *, mutual_tls: bool) -> list[str]:
    """The names a PeerService caller goes by: with mutual TLS, the DNS and URI
    subjectAltNames of its verified client cert (grpc verified it against `tls_ca`
    during the handshake; IP names are left out, they name an address, not a node);
    without, the node id it claims in `x-tierckpt-node` (at most one). The caller is the
    configured peer among them (PeerService decides)."""
    if mutual_tls:
        auth = context.auth_context() or {}
        if "peer_dns" in auth or "peer_uri" in auth:
            return _names(auth.get("peer_dns")) + _names(auth.get("peer_uri"))
        return _names(auth.get("x509_subject_alternative_name"))
    for key, value in context.invocation_metadata() or ():
        if key == NODE_METADATA:
            return [value.decode("utf-8", "replace") if isinstance(value, bytes) else value]
    return []


def peer_server_security(security: SecurityConfig) -> PeerServerSecurity:
    """Credentials and interceptors for the peer listener; reads the files once, now.

    Raises ConfigError (naming the `[security]` key and path) for a partial TLS config, an
    unreadable file or an empty token.
    """
    tls = _read_tls(security)
    credentials = None
    if tls is not None:
        credentials = grpc.ssl_server_credentials(
            [(tls.key, tls.cert)],
            root_certificates=tls.ca,
            require_client_auth=tls.ca is not None,
        )
    interceptors: tuple[Any, ...] = ()
    if security.token_file:
        interceptors = (TokenServerInterceptor(read_token(security.token_file)),)
        if tls is None:
            logger.warning(
                "[security] token_file without TLS: the token crosses the network in clear; "
                "set tls_cert/tls_key (and tls_ca for mutual TLS) on untrusted networks"
            )
    logger.info(
        "peer listener security: %s, %s",
        "plaintext" if tls is None else ("mutual TLS" if tls.ca else "TLS"),
        "token required" if interceptors else "no token",
    )
    return PeerServerSecurity(
        credentials, interceptors, mutual_tls=tls is not None and bool(tls.ca)
    )


class PeerChannels:
    """Opens channels to peers with this node's credentials.

    `open(address)` (or calling the object) gives a member channel: it carries the token.
    `open(address, token=False)` gives one without it, for a Hello to an address that has
    not proven who answers there. `server_name`: with TLS, the name the server's
    certificate must carry (gRPC checks it at every handshake; `verify_names` says
    whether a node id is checked that way: mutual TLS, `tls_ca` set).
    """

    def __init__(
        self,
        credentials: grpc.ChannelCredentials | None,
        token: bytes | None,
        options: Sequence[tuple[str, Any]],
        *,
        verify_names: bool,
    ) -> None:
        self._credentials = credentials
        self.token = token
        self._interceptor = TokenClientInterceptor(token) if token is not None else None
        self._options = list(options)
        self.verify_names = verify_names

    def open(self, address: str, *, token: bool = True, server_name: str = "") -> grpc.Channel:
        if self._credentials is None:
            channel = grpc.insecure_channel(address, options=self._options)
        else:
            options = self._options
            if server_name:
                options = [o for o in options if o[0] != "grpc.ssl_target_name_override"]
                options.append(("grpc.ssl_target_name_override", server_name))
            channel = grpc.secure_channel(address, self._credentials, options=options)
        if token and self._interceptor is not None:
            channel = grpc.intercept_channel(channel, self._interceptor)
        return channel

    def __call__(self, address: str) -> grpc.Channel:
        return self.open(address)


def peer_channel_factory(
    security: SecurityConfig, options: Sequence[tuple[str, Any]] = ()
) -> PeerChannels:
    """The channels to peers, with this node's credentials and token (`PeerChannels`).

    Reads the files once, now (ConfigError as in `peer_server_security`). `options` go to
    every channel, e.g. `("grpc.ssl_target_name_override", "localhost")` when the peers'
    certs do not name the address dialed.
    """
    tls = _read_tls(security)
    credentials = None
    if tls is not None:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
        )
    token = read_token(security.token_file) if security.token_file else None
    return PeerChannels(
        credentials, token, options, verify_names=tls is not None and tls.ca is not None
    )
