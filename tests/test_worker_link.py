"""The worker's link meter (``services/worker/link.py``): the uplink rate a device reports in its stats."""

from __future__ import annotations

from edgemesh.services.worker.link import LinkMeter


def test_the_link_meter_averages_publishes_and_a_declared_rate_wins() -> None:
    meter = LinkMeter()
    assert meter.rate_bps == 0.0
    meter.observe(1000, 0.0)  # no duration: no sample
    assert meter.rate_bps == 0.0
    meter.observe(1000, 1.0)
    assert meter.rate_bps == 1000.0
    meter.observe(2000, 1.0)
    assert 1000.0 < meter.rate_bps < 2000.0  # a moving average, not the last sample
    meter.declare(5e6)
    assert meter.rate_bps == 5e6
    meter.declare(0.0)
    assert 1000.0 < meter.rate_bps < 2000.0
