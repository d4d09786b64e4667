"""Prometheus metrics: one registry per service, served on ``/metrics``.

Names follow ``edgemesh_<service>_<noun>_<unit>``; counters end in ``_total`` (the client
library appends it). Labels stay low-cardinality: message kind, reason, codec, policy.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from edgemesh.common.errors import ConfigError
from edgemesh.common.health import DeviceHealth, HealthSources

logger = logging.getLogger(__name__)

REJECT_LOG_EVERY = 100
"""A rejection is logged at WARNING the first time per route and reason, then every this many times."""
LOGGED_DETAIL_CHARS = 200
"""Longest detail of a rejection in a log line."""
HANDLER_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
"""Buckets of the router's handler-duration histogram, seconds."""


class ServiceMetrics:
    """The metrics every service has, on a registry it owns, plus factories for its own."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry or CollectorRegistry()
        self.prefix = f"edgemesh_{service}_"
        self._server: Any = None
        self._thread: Any = None
        self.port = 0
        self._rejects_seen: dict[tuple[str, str], int] = {}

        self.published_messages = self.counter("published_messages", "Messages published", ["kind"])
        self.published_bytes = self.counter("published_bytes", "Payload bytes published (after chunking)")
        self.received_messages = self.counter("received_messages", "Messages the router decoded and handed to "
                                              "their route's handler", ["route"])
        self.received_bytes = self.counter("received_bytes", "Payload bytes received")
        self.rejected = self.counter("rejected", "Messages rejected, by route and reason", ["route", "reason"])
        self.unsolicited = self.counter("unsolicited_messages", "Messages the broker sent on a topic no subscription "
                                        "of this client covers (dropped: not for this client)")
        self.handler_seconds = self.histogram("handler_seconds", "Time a route's handler took for one message",
                                              HANDLER_BUCKETS, ["route"])
        self.refused = self.counter("broker_refused", "Operations the broker refused", ["operation"])
        self.connects = self.counter("broker_connects", "Successful broker connections")
        self.connected = self.gauge("broker_connected", "1 while connected to the broker")
        self.inbox = self.gauge("inbox_messages", "Messages received and waiting for the router")
        self.chunk_bytes = self.gauge("chunk_bytes", "Chunk size of the next large message published that is not "
                                      "retained (grows with the measured upload rate, up to the broker's limit)")
        self.up = self.gauge("up", "1 while the service runs")
        self.health: DeviceHealth | None = None
        """The host's temperature and throttling (``edgemesh_device_*``): exported on this registry by
        ``export_health``, or those a job host exports, whose service this is."""

    # --- factories ---------------------------------------------------------------------
    def counter(self, name: str, doc: str, labels: list[str] | None = None) -> Counter:
        return Counter(self.prefix + name, doc, labels or [], registry=self.registry)

    def gauge(self, name: str, doc: str, labels: list[str] | None = None) -> Gauge:
        return Gauge(self.prefix + name, doc, labels or [], registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: list[str] | None = None) -> Histogram:
        return Histogram(self.prefix + name, doc, labels or [], buckets=buckets, registry=self.registry)

    def export_health(self, sources: HealthSources) -> DeviceHealth:
        """Export the host's health, read from ``sources``, on this registry (once); the caller keeps it read
        (``DeviceHealth.watch``)."""
        if self.health is None:
            self.health = DeviceHealth(sources)
            self.registry.register(self.health)
        return self.health

    # --- rejections ----------------------------------------------------------------------
    def reject(self, reason: str, topic: str, detail: object, *, route: str,
               error: BaseException | None = None) -> None:
        """Count a rejected message of ``route`` and log it: the first time per route and reason (with
        the traceback of ``error``, a handler's exception), then every ``REJECT_LOG_EVERY`` times."""
        self.rejected.labels(route=route, reason=reason).inc()
        key = (route, reason)
        seen = self._rejects_seen.get(key, 0) + 1
        self._rejects_seen[key] = seen
        text = str(detail)
        if len(text) > LOGGED_DETAIL_CHARS:
            text = text[:LOGGED_DETAIL_CHARS] + "..."
        first = seen == 1
        level = logging.WARNING if first or seen % REJECT_LOG_EVERY == 0 else logging.DEBUG
        if error is not None and first:
            level = logging.ERROR
        logger.log(level, "%s rejected a message on %s (%s %s, #%d): %s", self.service, topic, route, reason, seen,
                   text, exc_info=error if first else None)

    # --- reading (tests, demo summary) -----------------------------------------------------
    def value(self, name: str, **labels: str) -> float:
        """A sample on this registry summed over the labels not given (0 if absent)."""
        want = set(labels.items())
        return float(sum(s.value for metric in self.registry.collect() for s in metric.samples
                         if s.name == name and want <= set(s.labels.items())))

    # --- HTTP ----------------------------------------------------------------------------
    def serve(self, address: str, port_file: str = "") -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0 = any free port); returns the port.

        With ``port_file``, the bound port is written there (atomically) for a supervisor to read.
        """
        if not address:
            return 0
        host, _, port = address.rpartition(":")
        try:
            self._server, self._thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=self.registry)  # noqa: S104
        except OSError as exc:
            raise ConfigError(f"metrics.address {address}: {exc}") from exc
        self.port = int(self._server.server_address[1])
        if port_file:
            tmp = f"{port_file}.tmp"
            with open(tmp, "w") as fh:
                fh.write(f"{self.port}\n")
            os.replace(tmp, port_file)
        logger.info("%s metrics on http://%s:%d/metrics", self.service, host or "0.0.0.0", self.port)  # noqa: S104
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition to ``{(sample name, sorted labels): value}``."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def sum_samples(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    """Sum of every sample called ``name`` whatever its labels."""
    return sum(v for (n, _), v in samples.items() if n == name)
