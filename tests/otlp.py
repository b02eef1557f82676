"""An OTLP/HTTP traces receiver on a loopback port, for tests: each export's protobuf
body and headers, decoded into span attributes on demand."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class Received:
    """What the receiver was sent: bodies, and the headers of each export."""

    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP traces endpoint: keeps each export's protobuf body."""

    received: Received

    def do_POST(self) -> None:
        length = int(self.headers["content-length"])
        self.received.bodies.append(self.rfile.read(length))
        self.received.headers.append({k.lower(): v for k, v in self.headers.items()})
        self.received.paths.append(self.path)
        assert self.headers["content-type"] == "application/x-protobuf"
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[str, Received]]:
    """A receiver's base URL (``http://127.0.0.1:PORT``) and what it is sent."""
    received = Received()
    handler = type("Handler", (_Receiver,), {"received": received})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def exported(bodies: list[bytes]) -> tuple[dict[str, str], dict[str, dict[str, object]]]:
    """The resource's attributes (the last export's), and span name → its attributes (the
    last of that name), from every export."""
    resource: dict[str, str] = {}
    spans: dict[str, dict[str, object]] = {}
    for body in bodies:
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for scope in rs.scope_spans:
                for span in scope.spans:
                    attrs: dict[str, object] = {}
                    for a in span.attributes:
                        v = a.value
                        attrs[a.key] = getattr(v, v.WhichOneof("value"))
                    attrs["_trace_id"] = span.trace_id.hex()
                    spans[span.name] = attrs
    return resource, spans
