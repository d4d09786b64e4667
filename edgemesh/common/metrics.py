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

logger = logging.getLogger(__name__)

# a rejection is logged at WARNING the first time per reason, then every this many times
REJECT_LOG_EVERY = 100


class ServiceMetrics:
    """The metrics every service has, on a registry it owns, plus factories for its own."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry or CollectorRegistry()
        self.prefix = f"edgemesh_{service}_"
        self._server: Any = None
        self._thread: Any = None
        self.port = 0
        self._rejects_seen: dict[str, int] = {}

        self.published_messages = self.counter("published_messages", "Messages published", ["kind"])
        self.published_bytes = self.counter("published_bytes", "Payload bytes published (after chunking)")
        self.received_messages = self.counter("received_messages", "Messages received and decoded", ["kind"])
        self.received_bytes = self.counter("received_bytes", "Payload bytes received")
        self.rejected = self.counter("rejected", "Messages rejected, by reason", ["reason"])
        self.connects = self.counter("broker_connects", "Successful broker connections")
        self.connected = self.gauge("broker_connected", "1 while connected to the broker")
        self.up = self.gauge("up", "1 while the service runs")

    # --- factories ---------------------------------------------------------------------
    def counter(self, name: str, doc: str, labels: list[str] | None = None) -> Counter:
        return Counter(self.prefix + name, doc, labels or [], registry=self.registry)

    def gauge(self, name: str, doc: str, labels: list[str] | None = None) -> Gauge:
        return Gauge(self.prefix + name, doc, labels or [], registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: list[str] | None = None) -> Histogram:
        return Histogram(self.prefix + name, doc, labels or [], buckets=buckets, registry=self.registry)

    # --- rejections ----------------------------------------------------------------------
    def reject(self, reason: str, topic: str, detail: object) -> None:
        """Count a rejected message and log it (first time per reason, then sparsely)."""
        self.rejected.labels(reason=reason).inc()
        seen = self._rejects_seen.get(reason, 0) + 1
        self._rejects_seen[reason] = seen
        text = str(detail)
        if len(text) > 200:
            text = text[:200] + "..."
        level = logging.WARNING if seen == 1 or seen % REJECT_LOG_EVERY == 0 else logging.DEBUG
        logger.log(level, "%s rejected a message on %s (%s, #%d): %s", self.service, topic, reason, seen, text)

    # --- reading (tests, demo summary) -----------------------------------------------------
    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample on this registry (0 if absent)."""
        found = self.registry.get_sample_value(name, labels or None)
        return float(found or 0.0)

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
