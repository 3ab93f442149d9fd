"""Peer security with real daemons: mutual TLS + a shared token between two nodes.

Replication works between properly configured nodes; a peer with the wrong token, or
without a client certificate, is refused and nothing changes on the node.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest
from tierckpt.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from tierckptd.config import SecurityConfig
from tierckptd.peers.security import peer_channel_factory

from tests.support import jobs
from tests.support.backends import Nodes
from tests.support.certs import Certs, Pair, make_certs
from tests.support.cli import ls_json
from tests.support.daemon_process import DaemonProcess
from tests.support.dist_job import run_job
from tests.support.ports import free_ports

pytestmark = pytest.mark.integration

NS = "secure-run"
TOKEN = "dGllcmNrcHQtdGVzdC10b2tlbg=="


def _security(pair: Pair, certs: Certs, token_file: str) -> dict[str, str]:
    return {
        "tls_cert": pair.cert,
        "tls_key": pair.key,
        "tls_ca": certs.ca,
        "token_file": token_file,
    }


def _wait_replicated(address: str, checkpoint_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = {r["id"]: r["state"] for r in ls_json(address, NS)}.get(checkpoint_id)
        if state == "REPLICATED":
            return
        time.sleep(0.3)
    raise AssertionError(f"{checkpoint_id} is {state}, not REPLICATED, over mutual TLS + token")


def _call(channel: grpc.Channel) -> grpc.StatusCode:
    stub = peer_pb2_grpc.PeerServiceStub(channel)
    try:
        stub.ListManifests(peer_pb2.ListManifestsRequest(namespace=NS), timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _publish_fake(channel: grpc.Channel) -> grpc.StatusCode:
    stub = peer_pb2_grpc.PeerServiceStub(channel)
    info = common_pb2.CheckpointInfo(
        ref=common_pb2.CheckpointRef(namespace=NS, checkpoint_id="step-999999"),
        state=common_pb2.COMMITTED,
    )
    try:
        stub.PublishCheckpoint(info, timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_mutual_tls_and_token_between_nodes(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    wrong = tmp_path / "wrong-token"
    wrong.write_text("bm90LXRoZS10b2tlbg==")
    wrong.chmod(0o600)
    ports = free_ports(2)
    pairs = [certs.node_a, certs.node_b]
    with ExitStack() as stack:
        nodes = []
        for i in range(2):
            j = 1 - i
            overrides: dict[str, Any] = {
                "node": {"id": f"node{i}", "failure_domain": f"rack{i}"},
                "listen": {"peer": f"127.0.0.1:{ports[i]}"},
                "replication": {"copies": 1},
                "security": _security(pairs[i], certs, str(token)),
                "peers": [
                    {
                        "id": f"node{j}",
                        "address": f"127.0.0.1:{ports[j]}",
                        "failure_domain": f"rack{j}",
                    }
                ],
            }
            daemon = DaemonProcess(overrides, name=f"node{i}", start=False)
            stack.callback(daemon.cleanup)
            nodes.append(daemon)
        for daemon in nodes:
            daemon.start()

        backend = Nodes(NS, tuple(d.address for d in nodes), 1)
        run_job(jobs.save_only, 2, backend, ["step-000100"], str(tmp_path / "exp"), 3, timeout=120)
        _wait_replicated(nodes[0].address, "step-000100")
        before = ls_json(nodes[0].address, NS)

        target = f"127.0.0.1:{ports[0]}"
        good = SecurityConfig(str(token), certs.node_b.cert, certs.node_b.key, certs.ca)
        with peer_channel_factory(good)(target) as channel:
            assert _call(channel) == grpc.StatusCode.OK
        # Right certificate, wrong token: UNAUTHENTICATED, and the publish changes nothing.
        wrong_token = SecurityConfig(str(wrong), certs.node_b.cert, certs.node_b.key, certs.ca)
        with peer_channel_factory(wrong_token)(target) as channel:
            assert _call(channel) == grpc.StatusCode.UNAUTHENTICATED
            assert _publish_fake(channel) == grpc.StatusCode.UNAUTHENTICATED
        # Right token, no client certificate: refused at the TLS handshake.
        no_cert = grpc.ssl_channel_credentials(root_certificates=Path(certs.ca).read_bytes())
        with grpc.secure_channel(target, no_cert) as channel:
            assert _call(channel) == grpc.StatusCode.UNAVAILABLE
        # A certificate from another CA: refused too.
        rogue = SecurityConfig(str(token), certs.rogue.cert, certs.rogue.key, certs.ca)
        with peer_channel_factory(rogue)(target) as channel:
            assert _call(channel) == grpc.StatusCode.UNAVAILABLE
        assert ls_json(nodes[0].address, NS) == before
