"""Counts the peer RPCs this daemon serves, by method: what a commit, a heal round or a
restore costs each node is then read from `/metrics` (the scale bench fits it against
the cluster size). Only methods the server knows are counted, after authentication,
so a caller cannot grow the label set."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from tierckptd.ops import metrics

__all__ = ["PeerRpcCounter"]

_PREFIX = "/tierckpt.v1.PeerService/"


class PeerRpcCounter(grpc.ServerInterceptor):  # type: ignore[misc]
    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        method = details.method or ""
        if handler is not None and method.startswith(_PREFIX):
            metrics.PEER_REQUESTS.labels(method=method[len(_PREFIX) :]).inc()
        return handler
