"""The gRPC API beside the HTTP one (``server.grpc_port``; docs/grpc.md).

::

    server.py    GrpcServer, start_grpc: the server, its health and reflection services
    servicer.py  quantroute.v1.Quantroute: Generate, Chat, ListModels, Explain
    convert.py   proto messages <-> the HTTP API's schemas and views; chunks of a run
    status.py    errors as gRPC status codes and trailing metadata
    keys.py      a call's key, by api/auth.py's rules
    proto.py     the code generated from proto/quantroute/v1/quantroute.proto (by make)
"""

from __future__ import annotations

from quantroute.grpcapi.proto import SERVICE_NAME
from quantroute.grpcapi.server import HEALTH_POLL_S, GrpcServer, start_grpc
from quantroute.grpcapi.status import CODES, Status, status_of

__all__ = [
    "CODES",
    "HEALTH_POLL_S",
    "SERVICE_NAME",
    "GrpcServer",
    "Status",
    "start_grpc",
    "status_of",
]
