"""Fleet emulation: device profiles, a shaped link to the broker, stretched compute.

Off by default. A worker started with ``--emulate PROFILE`` takes the profile's speed,
memory and link from ``profiles.toml``: its training steps are stretched to the profile's
speed and its MQTT traffic goes through an :class:`~edgemesh.common.emulation.link.EmulatedLink`
(rate, latency, disconnects). Nothing outside this package and the worker's start-up knows
that a device is emulated.
"""
