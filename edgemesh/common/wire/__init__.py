"""What goes on the wire: the envelope and message bodies (``envelope``), tensors (``tensors``, ``half``) and
the chunks a large payload travels in (``chunks``). The envelope's functions are this package's own names:
``wire.encode(msg)``, ``wire.decode(payload, Type)``."""

from edgemesh.common.wire.envelope import (
    CHUNK_KIND,
    MAX_ITEMS,
    MAX_STR,
    WIRE_VERSION,
    Envelope,
    decode,
    decode_envelope,
    encode,
    from_json_body,
    kind_of,
    message,
    pack,
    registered_kinds,
    to_json_dict,
    truncate,
    unpack,
    unpack_json,
)

__all__ = [
    "CHUNK_KIND",
    "MAX_ITEMS",
    "MAX_STR",
    "WIRE_VERSION",
    "Envelope",
    "decode",
    "decode_envelope",
    "encode",
    "from_json_body",
    "kind_of",
    "message",
    "pack",
    "registered_kinds",
    "to_json_dict",
    "truncate",
    "unpack",
    "unpack_json",
]
