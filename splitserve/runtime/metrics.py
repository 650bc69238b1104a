"""Prometheus metrics of one service process, on a registry of its own (never the global one).

Names follow vLLM's where one exists, with `splitserve:` in place of `vllm:`; every series
carries `model_name`. Each service builds the groups it needs over one `Metrics`:

    gateway   RequestMetrics (TTFT, ITL, e2e, success), RoutingMetrics
    prefill   RequestMetrics (queue, prefill time), KVTransferMetrics (sent), EngineCollector
    decode    RequestMetrics (ITL, e2e, success), KVTransferMetrics (received), EngineCollector
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from collections.abc import Callable, Collection, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

# The buckets vLLM uses for the same histograms.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TRANSFER_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class Metrics:
    """A process's registry, the `model_name` label's value, and the /metrics server."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def serve(self, host: str, port: int, secret: str = "") -> None:
        """Serve /metrics over HTTP on `host`:`port` (0: not at all); with a `secret`, only to
        a scraper that sends it (`Authorization: Bearer <secret>`; else 401)."""
        if not port:
            return
        app = make_wsgi_app(self.registry)
        if secret:
            app = _bearer_only(app, secret)

        class Server(ThreadingWSGIServer):
            # NOTE: the family of `host` (an IPv6 address binds an AF_INET6 socket)
            address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        self._server = make_server(host, port, app, Server, handler_class=_Quiet)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics%s", host, port, " (bearer)" if secret else "")

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Quiet(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _bearer_only(app: Callable[..., Iterable[bytes]], secret: str) -> Callable[..., Any]:
    """`app`, for callers whose Authorization header carries `secret` as a bearer token."""
    expected = f"Bearer {secret}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="metrics"')],
        )
        return [b"/metrics needs the cluster secret as a bearer token\n"]

    return guarded


class _Unmeasured:
    """Stands in for a histogram a service does not measure (so it is not exported)."""

    def observe(self, amount: float) -> None:
        pass


REQUEST_HISTOGRAMS = {
    "time_to_first_token": ("Seconds from a request's arrival to its first token.", TTFT_BUCKETS),
    "inter_token_latency": ("Seconds between two successive outputs of a request.", ITL_BUCKETS),
    "e2e_request_latency": ("Seconds from a request's arrival to its last token.", REQUEST_BUCKETS),
    "request_queue_time": (
        "Seconds a request waited before an engine step first computed part of it.",
        REQUEST_BUCKETS,
    ),
    "request_prefill_time": (
        "Seconds from a request's first computed chunk to its first token.",
        REQUEST_BUCKETS,
    ),
}


class RequestMetrics:
    """Per-request latencies (`splitserve:<name>_seconds`) and outcomes, as the service that
    sees them measures them; `measured` names the histograms it exports (keys of
    REQUEST_HISTOGRAMS), and `outcomes` whether it counts finished requests."""

    def __init__(self, metrics: Metrics, measured: Collection[str], outcomes: bool) -> None:
        r, model = metrics.registry, metrics.model_name
        self.model_name = model
        unknown = set(measured) - set(REQUEST_HISTOGRAMS)
        if unknown:
            raise ValueError(f"unknown request histograms {sorted(unknown)}")
        hists: dict[str, Histogram | _Unmeasured] = {}
        for name, (doc, buckets) in REQUEST_HISTOGRAMS.items():
            hists[name] = (
                Histogram(
                    f"splitserve:{name}_seconds", doc, ["model_name"], registry=r, buckets=buckets
                ).labels(model)
                if name in measured
                else _Unmeasured()
            )
        self.time_to_first_token = hists["time_to_first_token"]
        self.inter_token_latency = hists["inter_token_latency"]
        self.e2e_request_latency = hists["e2e_request_latency"]
        self.request_queue_time = hists["request_queue_time"]
        self.request_prefill_time = hists["request_prefill_time"]
        self._success = (
            Counter(
                "splitserve:request_success",
                "Requests that finished, by reason (stop, length, abort).",
                ["model_name", "finished_reason"],
                registry=r,
            )
            if outcomes
            else None
        )

    def finished(self, reason: str) -> None:
        if self._success is not None:
            self._success.labels(self.model_name, reason).inc()


class KVTransferMetrics:
    """KV pushes: bytes and seconds of those that landed, and the count of those that did not.
    A prefill worker counts what it sent, a decode worker what it received."""

    def __init__(self, metrics: Metrics) -> None:
        r, model = metrics.registry, metrics.model_name
        labels = ["model_name"]
        self.bytes = Counter(
            "splitserve:kv_transfer_bytes", "KV cache bytes moved.", labels, registry=r
        ).labels(model)
        self.seconds = Histogram(
            "splitserve:kv_transfer_seconds",
            "Seconds one KV push took, from its header to the receiver's acknowledgement.",
            labels,
            registry=r,
            buckets=TRANSFER_BUCKETS,
        ).labels(model)
        self.failures = Counter(
            "splitserve:kv_transfer_failures", "KV pushes that failed.", labels, registry=r
        ).labels(model)

    def observe(self, num_bytes: int, seconds: float | None, ok: bool) -> None:
        """One push; `seconds` None when this end can't time it (a one-sided write's target)."""
        if ok:
            self.bytes.inc(num_bytes)
            if seconds is not None:
                self.seconds.observe(seconds)
        else:
            self.failures.inc()


class RoutingMetrics:
    """The gateway's choices of workers: `kind` decode or prefill; `reason` least_loaded,
    prefix_hit (a decode worker chosen for its cached prefix), local (prefilled on the decode
    worker) or retry (a second prefill worker after a failure). Also the Decode streams moved
    off a lost decode worker."""

    def __init__(self, metrics: Metrics) -> None:
        self.model_name = metrics.model_name
        self._decisions = Counter(
            "splitserve:routing_decisions",
            "Workers chosen by the gateway, by kind of worker and reason.",
            ["model_name", "kind", "reason"],
            registry=metrics.registry,
        )

        self._migrations = Counter(
            "splitserve:stream_migrations",
            "Decode streams moved to another decode worker after theirs was lost or changed "
            "role, by reason (unavailable: the call failed; stalled: silent with no heartbeat; "
            "changing role) and by how their KV got there (kv: handed_off from the old worker, "
            "or recomputed on the new one).",
            ["model_name", "reason", "kv"],
            registry=metrics.registry,
        )

        self._suspicions = Counter(
            "splitserve:worker_suspicions",
            "Workers newly suspect (no new requests for --suspect-s), by the deadline they "
            "missed: reserve (no answer to Reserve), stream (a Decode stream lost) or prefill "
            "(silent while a prefill pushed to it).",
            ["model_name", "cause"],
            registry=metrics.registry,
        )

    def decided(self, kind: str, reason: str) -> None:
        self._decisions.labels(self.model_name, kind, reason).inc()

    def migrated(self, reason: str, kv: str) -> None:
        self._migrations.labels(self.model_name, reason, kv).inc()

    def suspected(self, cause: str) -> None:
        self._suspicions.labels(self.model_name, cause).inc()
