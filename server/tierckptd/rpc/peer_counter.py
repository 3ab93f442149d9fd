"""Counts the peer RPCs this daemon serves, by method: what a commit, a heal round or a
restore costs each node is then read from `/metrics` (the scale bench fits it against
the cluster size). Only methods the server knows are counted, after authentication,
so a caller cannot grow the label set."""

from __future__ import annotations

import grpc

from tierckptd.ops import metrics
from tierckptd.peers.security import MethodInterceptor

__all__ = ["PeerRpcCounter"]

_PREFIX = "/tierckpt.v1.PeerService/"


class PeerRpcCounter(MethodInterceptor):
    """Counts each PeerService call the server knows in ``tierckpt_peer_requests``."""

    def intercept(
        self, handler: grpc.RpcMethodHandler, method: str, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if method.startswith(_PREFIX):
            metrics.PEER_REQUESTS.labels(method=method[len(_PREFIX) :]).inc()
        return handler
