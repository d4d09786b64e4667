"""The MQTT bus every service talks through: the client (``client``: one connection, its life one ``async with``,
and publishing), the router (``router``: routes, dispatch and its metrics), what the client reads from paho under
aiomqtt (``taps``) and the zero-copy paho layer a bus may opt into (``paho_layer``)."""

from edgemesh.common.bus.client import Bus, forget_protocols
from edgemesh.common.bus.router import Handler, Route

__all__ = ["Bus", "Handler", "Route", "forget_protocols"]
