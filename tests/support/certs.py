"""Test certificates: a CA, node certs for 127.0.0.1/localhost, a rogue CA's cert.

Every node cert names its node id as a DNS subjectAltName (the peer port binds a cert
to the node it names, `tierckptd.peers.security`) besides the loopback names tests dial.
Generated with `cryptography` (a moto dependency) so no openssl binary is needed.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Certs", "Pair", "make_certs"]


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class Certs:
    ca: str
    node_a: Pair  # the server in these tests (node id node_ids[0])
    node_b: Pair  # a peer with a cert from the same CA (node_ids[1])
    rogue: Pair  # a cert with node_b's names from another CA
    localhost_only: Pair  # names only DNS:localhost, not IP:127.0.0.1 (and no node)
    stranger: Pair  # the right CA, but a node id no cluster configures ("node-stranger")
    twin: Pair  # the right CA, naming both node ids (one cert for two nodes)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key: Any) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _key()
    cert = (
        _builder(_name(cn), _name(cn), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _write_pair(
    directory: Path,
    name: str,
    ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate],
    sans: list[x509.GeneralName],
) -> Pair:
    ca_key, ca_cert = ca
    key = _key()
    cert = (
        _builder(_name(name), ca_cert.subject, key.public_key())
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return Pair(str(cert_path), str(key_path))


def make_certs(directory: Path, node_ids: tuple[str, str] = ("node0", "node1")) -> Certs:
    """Write a CA, two node certs (for `node_ids`), a rogue cert, a localhost-only cert,
    a stranger's and a twin cert into `directory`."""
    ca, other_ca = _ca("tierckpt-test-ca"), _ca("some-other-ca")
    (directory / "ca.crt").write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    loopback: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    a, b = (x509.DNSName(n) for n in node_ids)
    return Certs(
        ca=str(directory / "ca.crt"),
        node_a=_write_pair(directory, "node-a", ca, [a, *loopback]),
        node_b=_write_pair(directory, "node-b", ca, [b, *loopback]),
        rogue=_write_pair(directory, "rogue", other_ca, [b, *loopback]),
        localhost_only=_write_pair(directory, "localhost-only", ca, [x509.DNSName("localhost")]),
        stranger=_write_pair(directory, "stranger", ca, [x509.DNSName("node-stranger"), *loopback]),
        twin=_write_pair(directory, "twin", ca, [a, b, *loopback]),
    )
