"""The messages and the service stub generated from ``proto/quantroute/v1/quantroute.proto``.

The Makefile generates them (``grpc_tools.protoc``) into ``grpcapi/_gen/``, which is never
committed; a checkout that was not set up with ``make`` gets an error that says so."""

from __future__ import annotations

try:
    from quantroute.grpcapi._gen import quantroute_pb2 as pb
    from quantroute.grpcapi._gen import quantroute_pb2_grpc as pb_grpc
except ModuleNotFoundError as exc:  # pragma: no cover - a checkout without `make`
    if not (exc.name or "").startswith("quantroute.grpcapi._gen"):
        raise
    raise ImportError(
        "quantroute.grpcapi: the code generated from proto/quantroute/v1/quantroute.proto is "
        "missing; `make .venv` (or `make serve` / `make test`) generates it"
    ) from exc

__all__ = ["SERVICE_NAME", "pb", "pb_grpc"]

# "quantroute.v1.Quantroute", as the .proto names it
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Quantroute"].full_name
