"""Checks of a parsed configuration that need more than a key's type: which listeners a
config exposes to the network (DESIGN invariant 11), and where [node] and [membership]
values come from (the platform's environment) and whether they are usable.

Split from `config` to keep each module readable; `config` re-exports what is public.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from typing import TYPE_CHECKING

from tierckpt.errors import InvalidName
from tierckpt.names import check_namespace

if TYPE_CHECKING:
    from tierckptd.config import Config, MembershipConfig, SecurityConfig

__all__ = [
    "ENV_FAILURE_DOMAIN",
    "ENV_NODE_ID",
    "ConfigError",
    "check_exposure",
    "check_membership",
    "exposure_warnings",
    "host_of",
    "is_dns_name",
    "is_loopback_address",
    "node_identity",
    "peer_port",
]


class ConfigError(ValueError):
    """The configuration file is malformed; the message names the key and the fix."""


def host_of(address: str) -> str | None:
    """The host part of a gRPC listen address; None for a unix socket (no network)."""
    address = address.strip()
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme) :]
    if address.startswith("["):
        end = address.find("]")
        return address[1:end] if end > 0 else address[1:]
    if address.count(":") > 1:  # unbracketed IPv6: "::" alone, or ":::7070"
        try:
            ipaddress.ip_address(address)
            return address
        except ValueError:
            pass
    return address.rsplit(":", 1)[0] if ":" in address else address


def _ip_is_loopback(text: str) -> bool | None:
    """Whether `text` is a loopback IP literal; None when it is not an IP literal."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def is_loopback_address(address: str) -> bool:
    """Whether a listen address ("host:port", "[v6]:port", "unix:...") is reachable only
    from this host. Wildcards, routable IPs and names that resolve anywhere else are not;
    a name that does not resolve counts as exposed (fail closed)."""
    host = host_of(address)
    if host is None:
        return True
    host = host.strip().lower().rstrip(".")
    if host in ("", "*"):
        return False  # ":7070" binds every interface
    literal = _ip_is_loopback(host)
    if literal is not None:
        return literal
    if host == "localhost" or host.endswith(".localhost"):
        return True  # RFC 6761: always loopback
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(_ip_is_loopback(str(info[4][0])) for info in infos)


def _peer_port_secured(security: SecurityConfig) -> bool:
    return bool(security.token_file) or bool(security.tls_cert and security.tls_key)


def check_exposure(config: Config) -> None:
    """Refuse listeners that would let the network in without credentials."""
    if config.security.allow_insecure_peers:
        return
    peer = config.listen.peer
    if peer and not _peer_port_secured(config.security) and not is_loopback_address(peer):
        raise ConfigError(
            f"[listen] peer = {peer!r} listens beyond this host, but the peer port has neither "
            "a token nor TLS: anyone who reaches it could read, replace and delete "
            "checkpoints. Set [security] token_file (and for TLS tls_cert, tls_key, tls_ca), "
            "or set [security] allow_insecure_peers = true on a network you trust; a "
            'single node needs no network listener (peer = "127.0.0.1:7070" or "")'
        )
    local = config.listen.local
    if host_of(local) is not None and not is_loopback_address(local):
        raise ConfigError(
            f"[listen] local = {local!r} would serve the control API (load, delete any "
            "checkpoint) to the network without authentication. Use a unix socket "
            '(local = "unix:///run/tierckpt/tierckptd.sock"), or set [security] '
            "allow_insecure_peers = true if you really mean it"
        )


def exposure_warnings(config: Config) -> list[str]:
    """What the daemon logs as WARNING at start about listeners a config opens up."""
    warnings = []
    peer, local, security = config.listen.peer, config.listen.local, config.security
    if peer and not is_loopback_address(peer):
        if not _peer_port_secured(security):
            warnings.append(
                f"[security] allow_insecure_peers = true: the peer listener {peer} takes "
                "calls without token or TLS; anyone who reaches it can read, replace and "
                "delete checkpoints. Set [security] token_file and tls_cert/tls_key/tls_ca"
            )
        elif not (security.tls_cert and security.tls_key):
            warnings.append(
                f"the peer listener {peer} has a token but no TLS: the token and every "
                "checkpoint byte travel in clear; set [security] tls_cert/tls_key/tls_ca"
            )
    if config.peers and (not peer or is_loopback_address(peer)):
        remote = [p.id for p in config.peers if not is_loopback_address(p.address)]
        if remote:
            warnings.append(
                f"[listen] peer = {peer!r} is not reachable from other nodes, but [[peers]] "
                f"{', '.join(remote[:5])} are: listen on the network, e.g. peer = "
                '"0.0.0.0:7070", with [security] token_file and tls_cert/tls_key/tls_ca'
            )
    if host_of(local) is not None:
        where = "any local user" if is_loopback_address(local) else "anyone who reaches it"
        warnings.append(
            f"[listen] local = {local!r} serves the control API over TCP without "
            f"authentication: {where} can list, load and delete every namespace; a unix "
            "socket's file mode limits who can"
        )
    seed = config.listen.sagemaker
    if seed:
        where = "any local process" if is_loopback_address(seed) else "anyone who reaches it"
        warnings.append(
            f"[listen] sagemaker = {seed!r} serves SageMaker's checkpointing API without "
            f"authentication (its client sends none): {where} can read, overwrite and "
            "delete the namespaces it serves; beyond loopback, limit it with a "
            "NetworkPolicy or a firewall"
        )
    return warnings


# --- where this node's identity comes from (issue 13) ------------------------------------

# The platform tells a pod where it runs only through environment variables (Kubernetes'
# downward API: spec.nodeName, and a zone/rack label); they fill [node] when it is empty.
ENV_NODE_ID = "TIERCKPT_NODE_ID"
ENV_FAILURE_DOMAIN = "TIERCKPT_FAILURE_DOMAIN"


def _checked_name(value: str, where: str) -> str:
    try:
        return check_namespace(value)
    except InvalidName:
        shown = value if len(value) <= 64 else value[:64] + "..."
        raise ConfigError(
            f"{where} = {shown!r} is not a usable node name: use 1-128 characters from "
            "[A-Za-z0-9._-] (peers compare, log and hash it)"
        ) from None


def node_identity(node_id: str, failure_domain: str) -> tuple[str, str]:
    """[node] id and failure_domain, filled when empty from TIERCKPT_NODE_ID /
    TIERCKPT_FAILURE_DOMAIN, then the hostname / the node id; each validated."""
    if node_id:
        node_id = _checked_name(node_id, "[node] id")
    elif os.environ.get(ENV_NODE_ID, "").strip():
        node_id = _checked_name(os.environ[ENV_NODE_ID].strip(), f"environment {ENV_NODE_ID}")
    else:
        node_id = _checked_name(socket.gethostname(), "the hostname (the default [node] id)")
    if failure_domain:
        failure_domain = _checked_name(failure_domain, "[node] failure_domain")
    elif os.environ.get(ENV_FAILURE_DOMAIN, "").strip():
        failure_domain = _checked_name(
            os.environ[ENV_FAILURE_DOMAIN].strip(), f"environment {ENV_FAILURE_DOMAIN}"
        )
    return node_id, failure_domain or node_id


# --- [membership] ------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def is_dns_name(name: str) -> bool:
    """Whether `name` is a syntactically valid DNS host name (a trailing dot allowed)."""
    name = name[:-1] if name.endswith(".") else name
    return 0 < len(name) <= 253 and all(_DNS_LABEL.fullmatch(p) for p in name.split("."))


def peer_port(config: Config) -> int:
    """The port discovered members listen on: [membership] port, else [listen] peer's."""
    if config.membership.port:
        return config.membership.port
    peer = config.listen.peer.strip()
    if host_of(peer) is None:
        return 0  # a unix socket: no port
    port = peer.rsplit(":", 1)[-1]
    return int(port) if ":" in peer and port.isdigit() and int(port) <= 65535 else 0


def check_membership(config: Config) -> None:
    """[membership] is usable: a valid name, a port, a sane refresh, a peer listener."""
    m: MembershipConfig = config.membership
    if m.port > 65535:
        raise ConfigError(
            f"[membership] port = {m.port}: a TCP port is 1-65535 (0: [listen] peer's)"
        )
    if not (m.dns or m.hostfile):
        return
    if m.dns and not is_dns_name(m.dns):
        raise ConfigError(
            f"[membership] dns = {m.dns[:300]!r} is not a DNS name; name the headless Service, "
            'e.g. dns = "tierckpt.tierckpt-system.svc.cluster.local"'
        )
    if "\0" in m.hostfile:
        raise ConfigError("[membership] hostfile contains a NUL byte")
    if not (math.isfinite(m.refresh) and 0.1 <= m.refresh <= 86400):
        raise ConfigError(
            f"[membership] refresh = {m.refresh!r}: re-read the sources every 0.1 to 86400 "
            "seconds (e.g. refresh = 10.0)"
        )
    if not config.listen.peer:
        raise ConfigError(
            '[membership] needs a peer listener: [listen] peer = "" leaves discovered peers '
            'nothing to call back, e.g. peer = "${POD_IP}:7070"'
        )
    if m.dns and not peer_port(config):
        raise ConfigError(
            "[membership] dns gives addresses without a port: set [membership] port, or a "
            f"fixed port in [listen] peer (now {config.listen.peer!r})"
        )
